"""benchmarks/gpu_plans.py: the table of what each GPU size gets is the planner's
own plan, every plan fits its card, a bigger card never gets less, and a stale
copy in a file is caught."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import llmcustoms.planning.step_choices as step_choices
from llmcustoms.planning import plan
from llmcustoms.planning.presets import load_families, load_preset

ROOT = Path(__file__).parent.parent.parent
# Loaded from its file, not by putting benchmarks/ on sys.path, where its other
# scripts' names (common, quality, shapes) would shadow modules for later tests.
_SPEC = importlib.util.spec_from_file_location("gpu_plans", ROOT / "benchmarks" / "gpu_plans.py")
gpu_plans = sys.modules["gpu_plans"] = importlib.util.module_from_spec(_SPEC)  # dataclasses look it up
_SPEC.loader.exec_module(gpu_plans)

FAMILIES = load_families()
METHOD_RANK = {"qlora": 0, "lora": 1, "full": 2}  # how much of the model trains at full precision


@pytest.fixture(scope="module")
def replay_default():
    """The tables show what a user's run gets: replay at its default, which the
    suite turns off elsewhere (conftest.py, `no_replay_unless_asked`)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("LLMCUSTOMS_REPLAY", raising=False)
        patch.setattr(step_choices, "DEFAULT_REPLAY", plan.DEFAULT_REPLAY)
        yield


@pytest.fixture(autouse=True)
def no_replay_unless_asked(replay_default):
    """Overrides conftest.py's fixture of this name for this module's tests."""


@pytest.fixture(scope="module")
def rows(replay_default):
    return gpu_plans.plan_rows()


@pytest.fixture(scope="module")
def generated(rows):
    return gpu_plans.render(rows)


def table_rows(markdown: str, preset: str) -> list[list[str]]:
    """The body rows of one preset's table, as cells."""
    section = markdown.split(f"#### Preset `{preset}`", 1)[1].split("#### Preset", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| ")][1:]  # past the header
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


@pytest.mark.parametrize("preset", gpu_plans.PRESETS)
def test_a_row_for_every_card_and_family(generated, preset):
    cells = table_rows(generated, preset)
    pairs = [(row[0], row[1]) for row in cells]
    assert sorted(pairs) == sorted((card.size, family) for card in gpu_plans.CARDS for family in FAMILIES)
    assert all(len(row) == 9 for row in cells)


def test_every_plan_fits_its_card(rows):
    for row in rows:
        assert row.plan is not None, (row.card.size, row.family, row.preset, row.refusal)
        total = row.plan.memory["total_bytes"]
        assert total <= row.card.total_mib * 1024 ** 2, (row.card.size, row.family, row.preset)
        # Within the free memory, with the planner's margin: not merely under the card's size.
        assert total <= row.plan.memory["budget_bytes"] * 0.9
        assert row.plan.packing and row.plan.mixed_precision == "bf16"
        assert 0 < row.epoch_seconds <= row.plan.estimated_seconds  # one epoch of the whole run


def test_a_bigger_card_never_gets_less(rows):
    """Card by card, for each preset and family: a model at least as high in the
    preset's order, and for the same model at least as much of it trained at full
    precision and at least as large a micro-batch."""
    by_key = {(row.preset, row.family, row.card.size): row.plan for row in rows}
    for preset in gpu_plans.PRESETS:
        for family in FAMILIES.values():
            order = [c.name for c in gpu_plans.candidates(load_preset(preset), family, FAMILIES)]
            plans = [by_key[preset, family.name, card.size] for card in gpu_plans.CARDS]
            for smaller, bigger in zip(plans, plans[1:]):
                where = (preset, family.name, smaller.model, bigger.model)
                assert order.index(bigger.model) <= order.index(smaller.model), where
                if bigger.model == smaller.model:
                    assert (METHOD_RANK[bigger.method], bigger.micro_batch_size) >= \
                           (METHOD_RANK[smaller.method], smaller.micro_batch_size), where
            assert plans[-1].memory["budget_bytes"] > 5 * plans[0].memory["budget_bytes"]  # the cards do differ


def test_a_card_too_small_gets_the_planners_refusal():
    tiny = gpu_plans.Card("2 GB", "NVIDIA GeForce GT 1030", 2048, 256, (8, 6), 4, 8)
    row = gpu_plans.plan_row(tiny, FAMILIES["mistral"], load_preset("quality"), FAMILIES)
    assert row.plan is None and "does not fit" in row.refusal and "GiB" in row.refusal
    assert f"does not fit: {row.refusal}" in gpu_plans.render_row(row)


def test_check_catches_a_stale_copy_and_write_fixes_it(tmp_path, capsys, generated):
    path = tmp_path / "page.md"
    path.write_text(f"# Title\n\nBefore.\n\n{gpu_plans.START}\nold table\n{gpu_plans.END}\n\nAfter.\n")
    assert gpu_plans.main(["--check", str(path)]) == 1
    assert "-old table" in capsys.readouterr().out
    assert gpu_plans.main(["--write", str(path)]) == 0
    assert gpu_plans.main(["--check", str(path)]) == 0
    text = path.read_text()
    assert text.startswith("# Title\n\nBefore.\n\n") and text.endswith(f"{gpu_plans.END}\n\nAfter.\n")
    assert generated in text and "old table" not in text


def test_write_without_markers_fails_and_leaves_the_file(tmp_path, capsys):
    path = tmp_path / "page.md"
    path.write_text("# No markers here\n")
    assert gpu_plans.main(["--write", str(path)]) == 2
    assert gpu_plans.START in capsys.readouterr().err
    assert path.read_text() == "# No markers here\n"


@pytest.mark.parametrize("name,presets", [("docs/benchmarks.md", ["--preset", "quality"]),
                                           ("benchmarks/gpu/PLANS.md", [])])
def test_the_committed_copies_are_current(name, presets, capsys):
    path = ROOT / name
    assert gpu_plans.START in path.read_text()
    assert gpu_plans.main([*presets, "--check", str(path)]) == 0, capsys.readouterr().out


def test_runs_without_torch():
    code = ("import sys; sys.path.insert(0, 'benchmarks'); import gpu_plans; gpu_plans.render(gpu_plans.plan_rows());"
            "heavy = [m for m in ('torch', 'transformers', 'peft', 'bitsandbytes') if m in sys.modules];"
            "assert not heavy, heavy")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
