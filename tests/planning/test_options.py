"""Every option is declared once (llmcustoms/planning/options.py); these tests hold
each list derived from the table to it, so an option added to only one side
(a flag without a variable, a variable without a flag, a range that differs
between the command line, the environment and preset files) fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer
import typer.core
from typer.testing import CliRunner

from llmcustoms.planning import options
from llmcustoms.cli import app
from llmcustoms.planning.resolver import OVERRIDABLE
from llmcustoms.planning.presets import TUNABLE_FIELDS, validate_preset_values
from llmcustoms.planning.settings import SETTINGS, example_file
from tiny_models import WIDE

ROOT = Path(__file__).parent.parent.parent
# Flags that steer a command rather than set a value: no variable, on purpose.
STEERING = {"--run-name", "--overwrite", "--yes", "--quiet", "--env-file", "--num-processes", "--num-machines",
            "--machine-rank", "--main-process-ip", "--main-process-port", "--help"}


def command(name: str) -> typer.core.TyperCommand:
    return typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]


def flag_names(name: str) -> set[str]:
    return {opt for param in command(name).params if isinstance(param, typer.core.TyperOption)
            for opt in param.opts if opt.startswith("--")}


def env_example_variables() -> set[str]:
    text = (ROOT / ".env.example").read_text()
    return set(re.findall(r"^# (LLMCUSTOMS_[A-Z_]+)=", text, re.MULTILINE))


def test_env_example_is_written_from_the_table():
    assert (ROOT / ".env.example").read_text() == example_file()


def test_every_variable_has_its_flag_on_train_and_every_value_flag_has_a_variable():
    flags = flag_names("train")
    for variable in env_example_variables():
        option = options.BY_VARIABLE[variable]
        if option.argument:  # LLMCUSTOMS_DATA: the DATA argument
            assert option.name in {p.name for p in command("train").params if isinstance(p, typer.core.TyperArgument)}
        else:
            assert option.flag in flags, f"{variable} has no flag on train"
    value_flags = flags - STEERING
    with_variables = {options.BY_VARIABLE[v].flag for v in env_example_variables()} - {None}
    assert value_flags == with_variables, f"flags without a variable: {sorted(value_flags - with_variables)}"


def test_train_help_shows_every_flag_and_its_variable():
    result = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": WIDE}, terminal_width=300)
    assert result.exit_code == 0
    text = result.output
    for variable in env_example_variables():
        option = options.BY_VARIABLE[variable]
        assert variable in text
        if option.flag:
            assert option.flag in text


def test_settings_and_overrides_and_presets_come_from_the_table():
    assert {s.variable for s in SETTINGS} == env_example_variables()
    assert set(TUNABLE_FIELDS) == set(options.preset_keys())
    # A value planning accepts as an override can be set: it has a flag and a variable.
    for name in OVERRIDABLE:
        option = next(o for o in options.OPTIONS if o.plan == name)
        assert option.flag and option.variable, f"{name} is overridable with no way to set it"
    # And every flag that sets a plan value reaches planning.
    assert {o.plan for o in options.OPTIONS if o.flag and o.plan} == set(OVERRIDABLE)


def _boundary_values(option: options.Option) -> list[float]:
    values = [-1.0, 0.0, 0.5, 1.0, 0.99, 0.999, 2.0, 16.0, 15.0, 1e6]
    for bound in (option.minimum, option.maximum):
        if bound is not None:
            values += [bound, bound - 1e-9, bound + 1e-9, bound - 1, bound + 1]
    if option.kind is int:
        values = [v for v in values if float(v).is_integer()]
    return sorted(set(values))


NUMERIC = [o for o in options.OPTIONS if o.kind in (int, float) and not o.choices]


@pytest.mark.parametrize("option", NUMERIC, ids=lambda o: o.name)
def test_the_same_range_everywhere(option, tmp_path, monkeypatch):
    """The flag, the variable and a preset file accept exactly the same values."""
    monkeypatch.chdir(tmp_path)
    on_train = option.flag in flag_names("train")
    for value in _boundary_values(option):
        text = str(int(value)) if option.kind is int else repr(value)
        try:
            option.parse(text)
            env_ok = True
        except ValueError:
            env_ok = False
        if on_train:  # a missing data file is the next thing a valid value runs into
            result = CliRunner().invoke(app, ["train", "missing.jsonl", option.flag, text])
            flag_ok = "Invalid value for" not in result.output
            assert flag_ok == env_ok, (option.name, text, result.output)
        if option.preset:
            typed = int(value) if option.kind is int else value
            preset_ok = not validate_preset_values({option.preset: typed}, "preset")
            assert preset_ok == env_ok, (option.name, text)


def test_eval_split_accepts_the_same_095_everywhere(tmp_path, monkeypatch):
    """The drift that started this: --eval-split stopped at 0.9 while the variable took 0.95."""
    from llmcustoms.planning.settings import load_settings

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LLMCUSTOMS_EVAL_SPLIT", "0.95")
    assert load_settings().get("eval_split") == 0.95
    assert options.BY_NAME["eval_split"].parse("0.95") == 0.95
    assert not validate_preset_values({"eval_split": 0.95}, "preset")


def test_a_bad_flag_value_says_the_range_and_exits_2(tmp_path):
    result = CliRunner().invoke(app, ["plan", "data.jsonl", "--lora-dropout", "1"])
    assert result.exit_code == 2
    assert "expected a number of at least 0 and below 1" in " ".join(result.output.replace("│", " ").split())


def test_every_option_is_documented_in_the_settings_page():
    page = (ROOT / "docs" / "settings.md").read_text()
    for option in options.OPTIONS:
        if option.variable:
            assert option.variable in page, f"{option.variable} is not in docs/settings.md"
