"""Command-line flags: the options table (`planning/options.py`) turned into Typer
parameters, and the flags that steer a command rather than set a value
(`--yes`, `--quiet`, launch options...), each declared once here.

`takes_options(command)` gives a command function every table option that
command accepts: Typer reads the function's signature, so the decorator
extends it, and the function receives the values as `**values`.
`takes_permissions` gives a command that loads a run's model the two flags that
allow more than safe loading, as one `allowed` value.
"""

from __future__ import annotations

import functools
import inspect
import math
import textwrap
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

from llmcustoms.planning import options
from llmcustoms.planning.options import Option

# Click's Context as this Typer has it: recent Typers carry their own copy of click.
_Context: Any = typer.core.TyperCommand.context_class


class _HelpFormatter(_Context.formatter_class):  # type: ignore[misc]
    """Wraps option help between words only: click also breaks at hyphens,
    which cuts the flag names a help text mentions ("--eval-" / "split")."""

    def write_dl(self, rows: Any, col_max: int = 30, col_spacing: int = 2) -> None:
        rows = list(rows)
        first_col = min(max((len(first) for first, _ in rows), default=0), col_max) + col_spacing
        width = max(self.width - first_col - 2, 10)  # click's own text width for the column
        # A paragraph that starts with "\b" is one click leaves as it is.
        super().write_dl([(first, "\b\n" + textwrap.fill(second, width, break_on_hyphens=False,
                                                        break_long_words=False) if second else second)
                          for first, second in rows], col_max, col_spacing)


class _HelpContext(_Context):  # type: ignore[misc]
    formatter_class = _HelpFormatter


class Command(typer.core.TyperCommand):
    """Every command's class (`@app.command(cls=flags.Command)`): its usage line
    writes a required argument as RUN, as the README and docs/ do (Typer 0.29 writes
    {RUN}, which reads like a set of choices), and its help keeps flag names whole."""

    context_class = _HelpContext

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return [piece[1:-1] if piece.startswith("{") and piece.endswith("}") else piece
                for piece in super().collect_usage_pieces(ctx)]


def _choice_type(option: Option) -> type[Enum]:
    """Typer takes choices as an Enum; `given_values` turns members back into text."""
    title = "".join(part.title() for part in option.name.split("_"))
    return Enum(title, {c: c for c in option.choices}, type=str)  # type: ignore[misc]


def _typer_info(option: Option) -> Any:
    if option.argument:
        # DATA, as the docstrings, README and docs/ write it; Typer would write the parameter's name, data.
        return typer.Argument(help=_help(option), show_default=False, metavar=option.name.upper())
    names = [option.flag]
    if option.kind is bool:  # on or off; not given means "the plan decides"
        names = [f"{option.flag}/--no-{option.flag.removeprefix('--')}"]
    if option.short:
        names.append(option.short)
    if option.kind in (int, float) and not option.choices:
        # The same parser as the environment's: one range, one message.
        return typer.Option(*names, help=_help(option), show_default=False, parser=_parser(option),
                            metavar="<int>" if option.kind is int else "<float>")
    if option.choices and not isinstance(option.choices, tuple):  # choices that may grow: checked when given
        return typer.Option(*names, help=_help(option), show_default=False, parser=_parser(option),
                            metavar=f"[{'|'.join(option.choices)}]")
    return typer.Option(*names, help=_help(option), show_default=False)


def _help(option: Option) -> str:
    """The help text, naming the variable that sets the same value."""
    return f"{option.help} (env {option.variable})" if option.variable else option.help


def _parser(option: Option) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return option.parse(text)
        except ValueError as error:
            raise typer.BadParameter(str(error)) from None
    return parse


def _finite(minimum: float, maximum: float = float("inf")) -> Callable[[str], float]:
    """The parser of a float flag outside the options table. Click's own ranges
    let "nan" and "inf" through (nan compares false with every bound)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise typer.BadParameter(f"expected a number, got '{text}'.") from None
        if not (math.isfinite(value) and minimum <= value <= maximum):
            bounds = f"between {minimum:g} and {maximum:g}" if math.isfinite(maximum) else f"at least {minimum:g}"
            raise typer.BadParameter(f"expected a finite number {bounds}, got {text}.")
        return value
    return parse


def _utf8(what: str) -> Callable[[str], str]:
    """The parser of free text: bytes a terminal sent in another encoding (Latin-1) reach
    Python as lone surrogates, which no tokenizer takes."""
    def parse(text: str) -> str:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise typer.BadParameter(f"{what} is not UTF-8 text: set your terminal to UTF-8 (LANG=C.UTF-8, "
                                     "for example), then give it again.") from None
        return text
    return parse


def _annotation(option: Option) -> Any:
    kind: Any = _choice_type(option) if isinstance(option.choices, tuple) and option.choices else option.kind
    return Annotated[Optional[kind], _typer_info(option)]


def parameters(command: str) -> list[inspect.Parameter]:
    """The table's options for `command` as keyword parameters, each defaulting to None (not given)."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return [inspect.Parameter(o.name, kind, default=None, annotation=_annotation(o))
            for o in options.for_command(command)]


def takes_options(command: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Extend a command's signature with the table's options; the function takes them as **values.

    Arguments come first (Typer's order of positional arguments is the
    signature's), then the table's options, then the command's own."""
    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        own = [p for p in inspect.signature(func, eval_str=True).parameters.values()
               if p.kind is not inspect.Parameter.VAR_KEYWORD]
        table = parameters(command)
        arguments = [p for p in table if options.BY_NAME[p.name].argument]
        flags = [p for p in table if not options.BY_NAME[p.name].argument]
        func.__signature__ = inspect.Signature(arguments + flags + own)  # type: ignore[attr-defined]
        return func
    return decorate


def takes_permissions(func: Callable[..., Any]) -> Callable[..., Any]:
    """Give a command that loads a run's model --trust-remote-code and
    --allow-pickle-weights; it receives them as `allowed` (`loading.Allowed`).
    Flags of this command only: a run's plan.json and the environment never allow them."""
    own = [p for p in inspect.signature(func, eval_str=True).parameters.values() if p.name != "allowed"]
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    flags = [inspect.Parameter("trust_remote_code", kind, default=False, annotation=TrustRemoteCode),
             inspect.Parameter("allow_pickle_weights", kind, default=False, annotation=AllowPickleWeights)]
    rest = [p for p in own if p.kind is inspect.Parameter.VAR_KEYWORD]

    @functools.wraps(func)
    def command(*args: Any, trust_remote_code: bool = False, allow_pickle_weights: bool = False, **kwargs: Any) -> Any:
        from llmcustoms.models.loading import Allowed

        return func(*args, allowed=Allowed(trust_remote_code, allow_pickle_weights), **kwargs)

    command.__signature__ = inspect.Signature([p for p in own if p not in rest] + flags + rest)  # type: ignore[attr-defined]
    return command


def given_values(values: dict[str, Any]) -> dict[str, Any]:
    """The table options a user gave on the command line: enums as their text, None dropped."""
    return {name: value.value if isinstance(value, Enum) else value
            for name, value in values.items() if name in options.BY_NAME and value is not None}


# Flags that steer a command, not settings: no environment variable on purpose.
# metavar="<int>": Typer would write "<int range>", as if a range were asked for; [x>=1] says the range.
RunName = Annotated[Optional[str], typer.Option("--run-name", help="Name of this run's directory. Default: model-preset-time.")]
Overwrite = Annotated[bool, typer.Option("--overwrite", help="Replace an existing run directory of the same name.")]
Yes = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress display; for scripts.")]
EnvFile = Annotated[Optional[Path], typer.Option("--env-file", help="Read settings from this file instead of ./.env.")]
NumProcesses = Annotated[Optional[int], typer.Option("--num-processes", metavar="<int>", min=1, help="Processes per machine (one per GPU), launched through accelerate.")]
NumMachines = Annotated[Optional[int], typer.Option("--num-machines", metavar="<int>", min=1, help="Machines training together (run the same command on each).")]
MachineRank = Annotated[int, typer.Option("--machine-rank", metavar="<int>", min=0, help="This machine's index, 0 on the main one.")]
MainIp = Annotated[Optional[str], typer.Option("--main-process-ip", help="Address of machine 0, for several machines.")]
MainPort = Annotated[Optional[int], typer.Option("--main-process-port", metavar="<int>", min=1, max=65535, help="Port on machine 0 for the processes to meet.")]
Vram = Annotated[Optional[float], typer.Option("--vram", metavar="<float>", parser=_finite(0.5, 100_000), help="Plan for a GPU with this many GB instead of this machine's.")]
Json = Annotated[bool, typer.Option("--json", help="Print the plan as JSON (the shape of plan.json) and nothing else; an error as {\"error\": ...}.")]
ResumeRun = Annotated[Optional[Path], typer.Argument(metavar="RUN_DIR", help="The run to continue. Default: the newest unfinished run under --output-dir.")]

# `resume`'s own: given once, so none has a variable (LLMCUSTOMS_EPOCHS in a .env would extend a run at every resume).
FromStep = Annotated[Optional[str], typer.Option("--from", metavar="step-N", help="Go on from this checkpoint (step-N, or N) instead of the newest, e.g. the best one; the checkpoints after it are deleted and their steps trained again.")]
ModelChangedOk = Annotated[bool, typer.Option("--model-changed-ok", help="Go on although the base model's files differ from those the run began with: the run continues training on the new weights.")]
ResetOptimizer = Annotated[bool, typer.Option("--reset-optimizer", help="Start the optimizer state afresh (AdamW moments zero); weights, learning-rate schedule, data order and random state are the checkpoint's.")]
ResumeEpochs = Annotated[Optional[float], typer.Option("--epochs", metavar="<float>", show_default=False, parser=_parser(options.BY_NAME["epochs"]), help="Train to this many epochs in all, more than the run has: extends it, a completed run too. The learning-rate decay is stretched to the new length. Only this flag extends a run, not LLMCUSTOMS_EPOCHS.")]
ResumeMaxSteps = Annotated[Optional[int], typer.Option("--max-steps", metavar="<int>", min=1, show_default=False, help="Train to this many steps in all, more than the run has done: shortens or extends it, a completed run too. The learning-rate decay follows the new length. Only this flag, not LLMCUSTOMS_MAX_STEPS.")]

# `tune`'s own.
Trials = Annotated[int, typer.Option("--trials", "-n", metavar="<int>", min=1, help="Trials to run now (added to the study's earlier ones).")]
TrialSteps = Annotated[Optional[int], typer.Option("--max-steps", metavar="<int>", min=1, help="Optimizer steps per trial. Default: 100, or one run if shorter.")]
BudgetTokens = Annotated[Optional[int], typer.Option("--budget-tokens", metavar="<int>", min=1, help="Training tokens per trial (instead of --max-steps).")]
Timeout = Annotated[Optional[float], typer.Option("--timeout", metavar="<float>", parser=_finite(1), help="Stop starting new trials after this many seconds.")]
Storage = Annotated[Optional[str], typer.Option("--storage", help="Optuna storage URL (sqlite:///..., postgresql://..., journal:FILE). Default: SQLite in the study directory.")]
StudyName = Annotated[Optional[str], typer.Option("--study-name", help="Name of the study. Default: from the data file and model.")]
LrFind = Annotated[Optional[bool], typer.Option("--lr-find/--no-lr-find", show_default=False, help="Centre the lr range on `llmcustoms lr-find`'s suggestion for this model and data. Default: when one is saved; --lr-find runs the range test first if none is; --no-lr-find: around the preset's lr.")]
Confirm = Annotated[bool, typer.Option("--confirm/--no-confirm", help="Train the best trial and the preset for a whole run each and write the better as the preset (two runs' time; --no-confirm writes the best trial unchecked).")]

# `lr-find`'s own.
LrSteps = Annotated[Optional[int], typer.Option("--steps", metavar="<int>", min=5, help="Optimizer steps of the range test. Default: 100, or fewer if a whole run is shorter.")]
StartLr = Annotated[float, typer.Option("--start-lr", metavar="<float>", parser=_finite(0), help="Learning rate of the first step.")]
EndLr = Annotated[float, typer.Option("--end-lr", metavar="<float>", parser=_finite(0), help="Learning rate of the last step.")]


class Sampler(str, Enum):
    tpe = "tpe"
    random = "random"
    grid = "grid"


SamplerOpt = Annotated[Sampler, typer.Option("--sampler", help="tpe (default), random or grid.")]

# `setup`'s own.
SetupData = Annotated[Optional[str], typer.Option("--data", help="Your training data (asked for if not given).")]
SetupEnvFile = Annotated[Path, typer.Option("--env-file", help="The settings file to write.")]
Example = Annotated[bool, typer.Option("--example", help="Print an example .env instead: every LLMCUSTOMS_ variable, explained, commented out.")]

# After training.
RunArg = Annotated[Path, typer.Argument(metavar="RUN", help="A run directory, e.g. runs/my-run.")]
Plot = Annotated[bool, typer.Option("--plot", help="Also write loss.png (train/eval loss and learning rate) into the run.")]
Details = Annotated[bool, typer.Option("--details", help="Each verdict's reasons, and the sample replies.")]
PromptArg = Annotated[Optional[str], typer.Argument(metavar="PROMPT", show_default=False, parser=_utf8("the prompt"), help="What to ask the model (or --prompt).")]
Prompt = Annotated[Optional[str], typer.Option("--prompt", "-p", parser=_utf8("the prompt"), help="What to ask the model.")]
Checkpoint = Annotated[Optional[str], typer.Option("--checkpoint", metavar="latest|best|step-N", help="Load a checkpoint instead of the finished run's adapter: latest (the newest), best (the best evaluation's weights) or step-N. For a run that has not finished, or to compare steps.")]
System = Annotated[Optional[str], typer.Option("--system", parser=_utf8("the system message"), help="A system message for the whole conversation.")]
ExportOutput = Annotated[Path, typer.Option("--output", help="Directory to write the exported model into.")]
Merge = Annotated[bool, typer.Option("--merge", help="Merge the adapter into a standalone model, in --dtype.")]
Dtype = Annotated[str, typer.Option("--dtype", help="Weights of the merged model: auto (the base's own), bfloat16, float16, float32.")]
ExportFormat = Annotated[str, typer.Option("--format", help="hf: the adapter or (--merge) a transformers model; gguf: model.gguf and an Ollama Modelfile, checked against the trained model.")]
Quant = Annotated[str, typer.Option("--quant", help="GGUF weights: q8_0 (default: half of f16's size, replies nearly always identical), q4_0 (a quarter, small loss), f16, bf16.")]
Verify = Annotated[bool, typer.Option("--verify/--no-verify", help="Read the GGUF back and compare it with the trained model (default on).")]
ExportOverwrite = Annotated[bool, typer.Option("--overwrite", help="Replace a non-empty --output directory.")]
# A bound that is a number generation can hold; no model's context is near it.
MaxNewTokens = Annotated[int, typer.Option("--max-new-tokens", metavar="<int>", min=1, max=1_000_000, help="Longest reply in tokens.")]
GenerateTemperature = Annotated[float, typer.Option("--temperature", metavar="<float>", parser=_finite(0.0, 100.0), help="0 (the default) is greedy: the most likely reply, the same every time, to check what the model learned; higher samples more varied replies.")]
ChatTemperature = Annotated[float, typer.Option("--temperature", metavar="<float>", parser=_finite(0.0, 100.0), help="0 is greedy: the most likely reply, the same every time; higher is more varied. The default, 0.7, samples replies.")]
Seed = Annotated[Optional[int], typer.Option("--seed", metavar="<int>", parser=_parser(options.BY_NAME["seed"]), help=options.BY_NAME["seed"].help)]

# Loading a run's model (`takes_permissions`): given on the command itself, or not at all.
TrustRemoteCode = Annotated[bool, typer.Option("--trust-remote-code", help="Let the run's model repository run its own code, for this command; the run's plan.json alone never does.")]
AllowPickleWeights = Annotated[bool, typer.Option("--allow-pickle-weights", help="Also load model weights from pickle files (pytorch_model.bin), which can run code when loaded, for this command. Default: safetensors weights only.")]
