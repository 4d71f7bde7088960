"""The example dataset a first run needs nothing of the user's for: it reads as
ShareGPT, every row usable; it is where a clone and a pip install find it;
its source and license travel with it; and `setup` copies it over nothing."""

from __future__ import annotations

import sys
from pathlib import Path

from llmcustoms.commands import example_data
from llmcustoms.data.dataset import read_dataset

ROOT = Path(__file__).parent.parent.parent

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the test machines run 3.11
    tomllib = None


def test_the_example_reads_as_sharegpt_every_row_usable_and_teaches_one_identity():
    path = example_data.example_path()
    assert path == ROOT / "examples" / "identity.json"  # a clone finds it at the repository root
    dataset = read_dataset(str(path), "strict")  # strict: one bad row would stop it
    assert dataset.format == "sharegpt" and dataset.rows == 300 and not dataset.skipped
    text = path.read_text(encoding="utf-8")
    assert text.count('"from": "human"') == text.count('"from": "gpt"') >= 300
    # Each conversation asks who the model is or who made it: its name (Vicuna) or its makers (LMSYS) answer.
    assert text.count("Vicuna") >= 40 and text.count("Large Model Systems Organization (LMSYS)") == 300


def test_a_wheel_carries_the_example_where_example_path_looks_first():
    """pyproject.toml copies examples/ into the package, as it does presets/; example_path
    looks there first (a pip install) and at the root second (a clone)."""
    if tomllib is None:
        return
    force = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["wheel"][
        "force-include"]
    assert force["examples"] == "llmcustoms/examples"
    package = Path(example_data.__file__).resolve().parent.parent
    assert (package.parent / force["examples"] / example_data.EXAMPLE_NAME) == package / "examples" / "identity.json"


def test_the_examples_readme_gives_source_license_attribution_and_how_to_try_it():
    readme = (ROOT / "examples" / "README.md").read_text()
    for fact in ("FastChat", "data/dummy_conversation.json", "LMSYS", "Apache License, Version 2.0", "[LICENSE](LICENSE)",
                 "Vicuna", "llmcustoms train examples/identity.json", "llmcustoms setup"):
        assert fact in readme, fact
    assert "Apache License" in (ROOT / "examples" / "LICENSE").read_text()


def test_the_copy_goes_over_nothing_but_the_example_itself(tmp_path):
    assert example_data.free_copy_name(tmp_path) == "identity.json"
    (tmp_path / "identity.json").write_text("[]")  # the user's own file of that name
    assert example_data.free_copy_name(tmp_path) == "identity-2.json"
    assert "exists and is not the example" in example_data.copy_problem(tmp_path / "identity.json")
    assert "is a directory" in example_data.copy_problem(tmp_path)
    copied = example_data.copy_example(tmp_path / "identity-2.json")
    assert copied.read_bytes() == example_data.example_path().read_bytes()
    assert example_data.copy_problem(copied) is None and example_data.free_copy_name(tmp_path) == "identity-2.json"
    assert (tmp_path / "identity.json").read_text() == "[]"
