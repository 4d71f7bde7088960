"""The README and docs/ hold together: every relative link leads to a file
(and, with `#anchor`, to a heading of that file), the README stays short, and
docs/README.md lists every page of docs/ and nothing else."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).parent.parent
DOCS = ROOT / "docs"
README_MAX_LINES = 300

# A fenced block (``` or ~~~ up to the same fence) and inline code: neither holds links or headings.
FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[ \t]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"(`+)(?:(?!\n[ \t]*\n).)*?\1", re.DOTALL)  # within a paragraph
# [text](target) or [text](target "title"); an image's ![alt](target) too.
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)[ \t#]*$", re.MULTILINE)


def pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted(DOCS.glob("*.md"))]


def prose(text: str) -> str:
    """The text without code, where a `[x](y)` or a `# line` means nothing."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (but - and _),
    each space a hyphen; links and emphasis count by their text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # [text](url) -> text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in `path`, with -1, -2, ... for repeats, as GitHub numbers them."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    for match in HEADING.finditer(text):
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def relative_links(path: Path) -> list[str]:
    """The links of `path` that point into the repository (no scheme, no mailto)."""
    targets = LINK.findall(prose(path.read_text(encoding="utf-8")))
    return [t for t in targets if not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", t)]


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with each relative link of `path`, one sentence each."""
    problems = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / unquote(file_part)).resolve() if file_part else path
        where = f"{path.relative_to(root)}: ({target})"
        if not dest.exists():
            problems.append(f"{where} leads to {file_part}, which does not exist")
        elif anchor and dest.suffix == ".md" and unquote(anchor).lower() not in anchors(dest):
            problems.append(f"{where}: {dest.relative_to(root)} has no heading with the anchor #{anchor}")
    return problems


def listed_pages() -> set[Path]:
    """The pages of docs/ that docs/README.md links to."""
    return {(DOCS / target.partition("#")[0]).resolve() for target in relative_links(DOCS / "README.md")
            if target.partition("#")[0].endswith(".md") and (DOCS / target.partition("#")[0]).resolve().parent == DOCS}


@pytest.mark.parametrize("path", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_somewhere(path):
    assert path.exists()
    assert not broken_links(path), "\n".join(broken_links(path))


def test_the_links_are_found():
    """The check would pass on a page whose links it cannot see: make sure it sees them."""
    readme = relative_links(ROOT / "README.md")
    assert "docs/README.md" in readme and "CONTRIBUTING.md" in readme
    assert any("#" in link for link in readme)


def test_a_broken_link_or_anchor_is_caught(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## Flags of `train`\n\n```bash\n# not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md) [ok](other.md#flags-of-train) [ok](#a-heading) [web](https://example.com)\n"
                    "`[in code](missing.md)`\n\n## A heading\n\n"
                    "[gone](missing.md) [no anchor](other.md#no-such-heading) [code](other.md#not-a-heading)\n")
    problems = broken_links(page, root=tmp_path)
    assert len(problems) == 3, problems
    assert "missing.md" in problems[0] and "#no-such-heading" in problems[1] and "#not-a-heading" in problems[2]


@pytest.mark.parametrize("heading,anchor", [
    ("Settings: `.env` and `LLMCUSTOMS_*`", "settings-env-and-llmcustoms_"),
    ("Sharded full fine-tuning: `--distributed fsdp`", "sharded-full-fine-tuning---distributed-fsdp"),
    ("Preference tuning (DPO)", "preference-tuning-dpo"),
    ("How accurate is the memory estimate?", "how-accurate-is-the-memory-estimate"),
])
def test_anchors_are_githubs(heading, anchor):
    assert slug(heading) == anchor


def test_the_readme_stays_short():
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/ (at most {README_MAX_LINES})"


def test_the_docs_index_lists_every_page_and_only_pages_that_exist():
    listed = listed_pages()
    missing = sorted(p.name for p in listed if not p.exists())
    assert not missing, f"docs/README.md lists pages that do not exist: {missing}"
    present = {p.resolve() for p in DOCS.glob("*.md") if p.name != "README.md"}
    unlisted = sorted(p.name for p in present - listed)
    assert not unlisted, f"pages of docs/ that docs/README.md does not list: {unlisted}"


def test_every_page_starts_with_a_title_and_a_sentence():
    for path in sorted(DOCS.glob("*.md")):
        lines = path.read_text(encoding="utf-8").splitlines()
        assert lines[0].startswith("# ") and not lines[1].strip() and lines[2].strip(), path.name


def test_the_readmes_test_counts_are_the_suites():
    # Written by benchmarks/suite_counts.py from one collection (no test runs): a README that said
    # 1,180 tests in one place and 1,178 in another, hand-counted, is what this stops.
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "suite_counts.py"), "--check"],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, (f"{out.stdout}{out.stderr[-2000:]}\nrun `python benchmarks/suite_counts.py` "
                                 "(and with --fast/--slow after measuring a run: its docstring says how)")


def test_what_the_readmes_first_run_makes_in_a_clone_is_ignored_by_git():
    # After the first run `git status` listed identity.json, the exported model, ...: each is ignored.
    import shutil
    import subprocess

    from llmcustoms.commands.example_data import EXAMPLE_NAME

    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git clone")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    first_run = FENCE.search(readme, readme.index("## Your first run"))[0]
    exported = re.findall(r"--output (\S+)", first_run)
    [runs] = set(re.findall(r"(\S+)/<run-name>", first_run))
    made = [EXAMPLE_NAME, EXAMPLE_NAME.replace(".", "-2."),  # setup's copy of the example, or beside another file
            ".env", ".env.tmp",  # setup's answers, and the file it checks it can write with
            f"{runs}/my-run/adapter/adapter_model.safetensors", f"{runs}/my-run/loss.png",  # train, report --plot
            *(f"{name}/model.gguf" for name in exported)]
    assert exported and runs == "runs"
    out = subprocess.run(["git", "check-ignore", "--no-index", *made, "examples/identity.json"],
                         capture_output=True, text=True, cwd=ROOT)
    assert sorted(out.stdout.split()) == sorted(made), f"not ignored: {set(made) - set(out.stdout.split())}"
