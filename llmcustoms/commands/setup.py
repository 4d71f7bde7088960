"""`llmcustoms setup`: an interactive wizard that writes the env file.

Every question has a default, so pressing Enter throughout gives a sensible
setup, and it works with piped input (`yes '' | llmcustoms setup ...`). The
file is written once, at the end, through a temporary file and a rename, so
Ctrl-C at any prompt leaves no half-written file. Variables already in the
file that the wizard does not set (HF_TOKEN, say) are kept.

Each answer is checked as it is given, the way `train` would meet it: the data
is read with `train`'s bad-row policy, and a model must be a model directory,
or a Hub id that is cached or can be downloaded (`hub_access`). A refused answer
is asked again; where no one can answer again (piped input used up, stdin
closed, CI) the wizard stops with one message and exit 2 rather than writing a
file `train` would refuse.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from llmcustoms.commands import example_data
from llmcustoms.commands.env_writing import check_writable, write_env
from llmcustoms.data.dataset import BAD_ROW_SHARE, Dataset, read_dataset
from llmcustoms.data.splits import eval_fraction, split_eval
from llmcustoms.errors import ConfigError, DataError, LlmcustomsError
from llmcustoms.models import hub_access
from llmcustoms.models.loading import looks_like_path
from llmcustoms.planning.access_tokens import hide_tokens, looks_like_token
from llmcustoms.planning.duration import CPU_TIME_LIMIT_S, human_duration
from llmcustoms.planning.fitting import fitting_models
from llmcustoms.planning.hardware import Hardware
from llmcustoms.planning.plan import DataStats, Plan
from llmcustoms.planning.planner import DEFAULT_SEED, Planner
from llmcustoms.planning.presets import TrainingPreset, builtin_preset_names, find_model_spec, load_families, load_preset
from llmcustoms.planning.settings import PREFIX, read_env_file
from llmcustoms.planning.train_options import TrainOptions
from llmcustoms.preparation.prepared_run import estimated_stats
from llmcustoms.preparation.preparing import prepare_run
from llmcustoms.ui import dialog

GOALS = {
    "highspeed": "a quick first result: small adapter, short sequences, one or two epochs",
    "quality": "a good adapter in reasonable time (recommended)",
    "bestaccuracy": "the best this machine can do: bigger adapter, longer sequences, early stopping",
}
MAX_ATTEMPTS = 3
DATA_QUESTION = "Training data file (.jsonl, .json, .csv, .parquet, .txt)"
MODEL_QUESTION = "Model (number, hub id or local directory)"
NO_ONE_TO_ASK = ("No one is there to answer again (input has run out, or CI is set), so nothing was written: "
                 "run `llmcustoms setup` in a terminal, or pipe one answer per line.")


def refuse(question: str, why: str, hint: str | None = None) -> None:
    """Say why an answer was refused, before the question comes again; where
    no one can answer again, stop here (exit 2) instead of asking in a loop."""
    if not dialog.can_ask_again():
        raise ConfigError(f"Setup stopped at \"{question}\": {why}", " ".join(filter(None, [hint, NO_ONE_TO_ASK])))
    dialog.ask_again(why + (f" {hint}" if hint else ""))


def ask_after(question: str, default: str | None, refused: str | None, hint: str | None = None) -> str:
    """Ask; when input runs out on a question asked again after `refused`, that
    refusal stands (exit 2) rather than the default quietly replacing the answer given."""
    answer = dialog.ask(question, default)
    if refused and not dialog.can_ask_again():
        refuse(question, refused, hint)
    return answer


def ask_data(default: str | None) -> tuple[str, Dataset, bool, bool]:
    """The data file, read as `train` reads it; whether its bad rows are to be
    skipped however many there are (the user agreed to LLMCUSTOMS_SKIP_BAD_ROWS);
    whether it is the example. Without --data, the example is offered (the
    default; read where it is installed, copied where the user says by
    `run_wizard` at the end): a first run needs nothing of the user's."""
    why, offered = None, default is None and example_data.is_available()
    if offered:
        dialog.show_example_offer(example_data.EXAMPLE_ANSWER, example_data.WHAT_IT_TEACHES)
        default = example_data.EXAMPLE_ANSWER
    for _ in range(MAX_ATTEMPTS):
        path = ask_after(DATA_QUESTION, default, why)
        default = None
        example = offered and path == example_data.EXAMPLE_ANSWER and not Path(path).exists()
        path = str(example_data.example_path()) if example else path
        if not path:
            why = "No data file was given."
            refuse(DATA_QUESTION, why, "Give the path of your data file (or pass --data PATH).")
            continue
        try:
            dataset = read_dataset(path)
        except DataError as error:
            dataset, why = offer_skipping(path, error)
            if dataset is None:
                default = path if Path(path).is_file() else None  # fixed in another window, say
                continue
            return path, dataset, True, example
        show_checked(dataset)
        return path, dataset, False, example
    raise ConfigError("No usable data file was given.", "Run `llmcustoms setup --data PATH`.")


def ask_example_copy() -> Path:
    """Where to copy the example: a file of the user's, which `.env` then names
    (the installed copy moves with every upgrade), never over another file.
    Copied with the env file, at the end: a setup that stops writes nothing."""
    question, why = "Copy the example to", None
    default = example_data.free_copy_name(Path.cwd())
    for _ in range(MAX_ATTEMPTS):
        target = Path(ask_after(question, default, why) or default).expanduser()
        why = example_data.copy_problem(target)
        if why is None:
            return target
        refuse(question, why, "Give a new file name in a directory you can write to.")
    raise ConfigError("No place to copy the example was given.", "Run `llmcustoms setup` again, or pass --data PATH.")


def show_checked(dataset: Dataset) -> None:
    stats = estimated_stats(dataset, None, 0)
    dialog.show_data_checked(dataset.format_description, dataset.rows, stats.percentile(50), stats.percentile(95))
    if dataset.skipped:
        dialog.show_bad_rows(dataset.skipped, dataset.bad.lines(), dataset.policy == "skip", BAD_ROW_SHARE)


def offer_skipping(path: str, error: DataError) -> tuple[Dataset | None, str | None]:
    """(the file read with every bad row skipped, None) if that is what stopped
    it and the user agrees; else (None, why it was refused), after saying so."""
    try:
        dataset = read_dataset(path, "skip")
    except DataError:  # not the number of bad rows: no format, no usable row, no file
        if not dialog.can_ask_again():
            raise error from None
        dialog.show_data_problem(error.message, error.hint)
        return None, error.message
    # Only more bad rows than the share skipped without asking stop the default policy and not "skip".
    total = dataset.rows + dataset.skipped + dataset.unlearned
    dialog.show_too_many_bad_rows(Path(path).name, dataset.skipped, total, BAD_ROW_SHARE, dataset.bad.lines(),
                                  dataset.format_description)
    answer = dialog.ask(f"Skip these {dataset.skipped:,} rows and train on the {dataset.rows:,} good ones? "
                        f"(saved as {PREFIX}SKIP_BAD_ROWS=true)", "n", choices=["y", "n"])
    if answer == "y":
        show_checked(dataset)
        return dataset, None
    why = f"{Path(path).name}: {dataset.skipped:,} of {total:,} rows fail validation."
    refuse(DATA_QUESTION, why,
           f"Fix the file and give it again, or answer y to skip them ({PREFIX}SKIP_BAD_ROWS=true).")
    return None, why


def run_wizard(hardware: Hardware, env_file: Path, data: str | None) -> list[str]:
    """Ask, then write `env_file`. Returns the train command to run next."""
    from llmcustoms.data.token_cache import cache_dir
    from llmcustoms.runs.speeds import with_measured_speeds

    check_writable(env_file)  # before a single question: the answers would be lost
    hardware = with_measured_speeds(hardware, cache_dir())  # the times beside the models, as `plan` gives them
    dialog.show_setup_start(hardware)
    data_path, dataset, skip_bad_rows, example = ask_data(data)
    copy_to = ask_example_copy() if example else None

    dialog.show_goals([(name, GOALS.get(name, load_preset(name).description)) for name in builtin_preset_names()])
    preset_name = dialog.ask("Goal", "quality", choices=builtin_preset_names())
    preset = load_preset(preset_name)

    stats = planning_stats(dataset, preset)
    seq_len = min(preset.max_seq_len, max(64, -(-stats.percentile(99) // 64) * 64))
    answers = TrainOptions(data=str(Path(data_path).resolve()), preset=preset_name, skip_bad_rows=skip_bad_rows,
                           model_source="env", preset_source=f"env {PREFIX}PRESET")
    model = ask_model(hardware, preset, stats, seq_len, plan_as_plan_does(hardware, answers, dataset),
                      runs_dir(env_file))
    output_dir = dialog.ask("Where to put runs", "runs")
    save_every = ask_save_every()

    # The data too, so `llmcustoms train`, `plan` and `tune` need no argument; its whole
    # path, so they find it from any directory (given --env-file).
    values = {f"{PREFIX}DATA": str((copy_to or Path(data_path)).resolve()), f"{PREFIX}PRESET": preset_name,
              f"{PREFIX}MODEL": model, f"{PREFIX}OUTPUT_DIR": output_dir}
    if skip_bad_rows:
        values[f"{PREFIX}SKIP_BAD_ROWS"] = "true"
    if save_every != "auto":
        values[f"{PREFIX}SAVE_EVERY"] = save_every
    if env_file.exists():
        overwrite = dialog.ask(f"{env_file} exists. Replace its llmcustoms settings? (other variables are kept)", "y",
                               choices=["y", "n"])
        if overwrite != "y":
            dialog.say("Nothing written.")
            return []
    if copy_to is not None:
        dialog.say(f"Copied the example to {example_data.copy_example(copy_to)}.")
    write_env(env_file, values)
    dialog.say(f"Wrote {env_file}.")
    command = ["llmcustoms", "train"]
    if env_file.resolve() != Path(".env").resolve():
        command += ["--env-file", str(env_file)]
    return command


PlanFor = Callable[[str], Plan]


def runs_dir(env_file: Path) -> Path:
    """Where the runs here are, as `train` would put them: the env file's, the
    environment's, or ./runs (the wizard's default)."""
    name = f"{PREFIX}OUTPUT_DIR"
    written = read_env_file(env_file).get(name, ("", 0))[0] if env_file.is_file() else ""
    return Path(os.environ.get(name) or written or "runs").expanduser()


def plan_as_plan_does(hardware: Hardware, answers: TrainOptions, dataset: Dataset) -> PlanFor:
    """For a model, the plan `llmcustoms plan` makes once `.env` holds these
    answers: the same call, so the time setup shows is the one `plan` shows
    (with the model's tokenizer's lengths where it is on this disk)."""
    def plan_for(model: str) -> Plan:
        return prepare_run(replace(answers, model=model), hardware, tokenizer_required=False, dataset=dataset).plan

    return plan_for


def planning_stats(dataset: Dataset, preset: TrainingPreset) -> DataStats:
    """The training rows' lengths as `train` estimates them to choose a model:
    the preset's evaluation split held out (`prepare_run`'s `estimate`)."""
    fraction, _ = eval_fraction(preset, dataset.rows, {})
    train_rows, eval_rows = split_eval(dataset.rows, fraction, DEFAULT_SEED)
    return estimated_stats(dataset, train_rows, len(eval_rows))


@dataclass(frozen=True)
class ModelOffer:
    """A model `setup` lists: how it would train here and where it would load from."""

    hub_id: str
    params: int
    method: str
    total_bytes: int
    seconds: float | None  # the plan's estimate for this data; None when the preset cannot plan it here
    where: str  # hub_access.availability
    origin: str = ""  # a model on this disk that the catalog does not list: where it was found (`local_models`)

    @property
    def usable(self) -> bool:
        return self.where != hub_access.UNAVAILABLE

    @property
    def estimate(self) -> str:
        return human_duration(self.seconds) if self.seconds is not None else "cannot plan"


def model_offers(hardware: Hardware, preset: TrainingPreset, stats: DataStats, seq_len: int,
                 plan_for: PlanFor | None = None, runs: Path | None = None) -> list[ModelOffer]:
    """The models on this disk the catalog does not list (`local_models`: those
    the runs in `runs` trained, then the Hugging Face cache's), then the catalog
    models that fit this machine, smallest first, each planned for this data as
    `train` would plan it: by `plan_for` (as `plan` plans it) when the model is
    on this disk; from the lengths `stats` estimates from characters when it is
    not, which is what `plan` does until it is downloaded (setup downloads
    nothing to list it)."""
    from llmcustoms.models.loading import choice_from_spec

    families = load_families()
    optimizer = Planner(hardware, preset)
    fitting = fitting_models(hardware, families, seq_len)
    offers = disk_offers(runs, {fit.hub_id for fit in fitting}, plan_for) if plan_for and runs else []
    for fit in fitting:
        choice = choice_from_spec(find_model_spec(fit.hub_id, families), families, "planner")
        offer = ModelOffer(fit.hub_id, fit.params, fit.method, fit.total_bytes, None, hub_access.availability(fit.hub_id))
        try:
            on_disk = plan_for is not None and offer.where in (hub_access.LOCAL, hub_access.CACHED)
            plan = plan_for(fit.hub_id) if on_disk else optimizer.plan(choice, stats, {})
        except LlmcustomsError:  # does not fit, or `plan` would refuse it: no time to give
            offers.append(offer)
            continue
        offers.append(replace(offer, method=plan.method, total_bytes=plan.memory["total_bytes"],
                              seconds=plan.estimated_seconds))
    return offers


def disk_offers(runs: Path, catalog: set[str], plan_for: PlanFor) -> list[ModelOffer]:
    """`local_models.models_on_disk`, each planned as `plan` plans it (its size from its config)."""
    from llmcustoms.commands.local_models import models_on_disk
    from llmcustoms.models.loading import describe_model

    offers = []
    for name, origin in models_on_disk(runs, catalog):
        offer = ModelOffer(name, 0, "?", 0, None, hub_access.availability(name), origin)
        try:
            plan = plan_for(name)
            params = describe_model(name, load_families(), "env").arch.params
        except LlmcustomsError:  # `train` would refuse it here: listed without a time, never suggested
            offers.append(offer)
            continue
        offers.append(replace(offer, params=params, method=plan.method, total_bytes=plan.memory["total_bytes"],
                              seconds=plan.estimated_seconds))
    return offers


def suggested_model(hardware: Hardware, preset: TrainingPreset, stats: DataStats,
                    offers: list[ModelOffer]) -> tuple[str | None, str]:
    """The model to offer as the default, and why: the one `train` would choose
    among the preset's models that can be used here; else the largest usable
    model expected to finish in reasonable time; else none."""
    from llmcustoms.models.loading import choice_from_spec

    families = load_families()
    where = {offer.hub_id: offer.where for offer in offers}
    fitting = [m for m in preset.model_candidates(hardware.has_gpu) if m in where]
    usable = [m for m in fitting if where[m] != hub_access.UNAVAILABLE]
    candidates = [choice_from_spec(find_model_spec(m, families), families, "planner") for m in usable]
    if candidates:
        try:
            choice, reason = Planner(hardware, preset).choose_model(candidates, stats, {})
        except ConfigError:
            pass
        else:
            if len(usable) < len(fitting):
                reason += f"; of the preset's models only {', '.join(m.split('/')[-1] for m in usable)} can be used here"
            return choice.name, reason
    timed = [offer for offer in offers if offer.usable and offer.seconds is not None]
    if on_disk := [offer for offer in timed if offer.origin]:  # in the list's order: the newest run's first
        pick = min(on_disk, key=lambda offer: offer.seconds > CPU_TIME_LIMIT_S)  # the first quick one, if any
        return pick.hub_id, (f"{Path(pick.hub_id).name}, {pick.origin}, estimated at {pick.estimate}: none of the "
                             "preset's models can be used here")
    quick = [offer for offer in timed if offer.seconds <= CPU_TIME_LIMIT_S]
    if quick:
        pick = max(quick, key=lambda offer: offer.params)
        return pick.hub_id, (f"model {pick.hub_id}: none of the preset's models can be used here; the largest that "
                             f"can is estimated at {pick.estimate}")
    if timed:
        pick = min(timed, key=lambda offer: offer.seconds)
        return pick.hub_id, f"model {pick.hub_id}: the quickest that can be used here, estimated {pick.estimate}"
    return None, ("no listed model can be used here (not cached, and the Hub cannot be reached): "
                  "give the path of a local model directory")


def ask_model(hardware: Hardware, preset: TrainingPreset, stats: DataStats, seq_len: int, plan_for: PlanFor,
              runs: Path | None = None) -> str:
    """Offer the models on this disk and the catalog models that fit, with time
    and availability, suggesting the one `train` would choose (offline, one on
    this disk); accept a number, a Hub id or a model directory."""
    offers = model_offers(hardware, preset, stats, seq_len, plan_for, runs)
    suggested, reason = suggested_model(hardware, preset, stats, offers)
    dialog.show_model_choices(offers, seq_len, suggested, reason, hub_access.offline_note())
    hint, why = "Give a number from the list, a Hub id, or the path of a model directory.", None
    # A path is long to show as the default: its number in the list answers the same.
    default = next((str(i) for i, o in enumerate(offers, 1) if o.hub_id == suggested and o.origin), suggested)
    for _ in range(MAX_ATTEMPTS):
        answer = ask_after(MODEL_QUESTION, default, why, hint)
        name, why = checked_model(answer, offers)
        if not answer and suggested is None:
            why = f"No model was given, and {reason}."
        if why is None:
            offer = next((o for o in offers if o.hub_id == name), None)
            where = offer.where if offer else hub_access.availability(name)
            detail = f"estimated training time here {offer.estimate}" if offer else local_estimate(name, plan_for)
            dialog.show_model_accepted(name, where, detail)
            return name
        refuse(MODEL_QUESTION, why, hint)
    raise ConfigError("No usable model was given.", "Run `llmcustoms setup` again, or set LLMCUSTOMS_MODEL.")


def checked_model(answer: str, offers: list[ModelOffer]) -> tuple[str, str | None]:
    """(what to write, why the answer cannot be used or None)."""
    if not answer:
        return answer, "No model was given."
    if looks_like_token(answer) and not Path(answer).expanduser().exists():
        return hide_tokens(answer), ("That looks like an access token, not a model; it was not used. Give a Hugging "
                                     "Face token as HF_TOKEN (or `hf auth login`).")
    if answer.isdigit():
        if not 1 <= int(answer) <= len(offers):
            return answer, f"There is no model {answer} in the list (1 to {len(offers)})."
        answer = offers[int(answer) - 1].hub_id
    if looks_like_path(answer):  # as `train` reads --model
        path = Path(answer).expanduser()
        return str(path.resolve()), model_directory_problem(answer, path)
    if not hub_access.is_hub_id(answer):
        return answer, f"{answer!r} is neither a directory here nor a Hub id (organisation/name)."
    if hub_access.availability(answer) == hub_access.UNAVAILABLE:
        return answer, (f"{answer} is not a directory here nor in the local Hugging Face cache, and the Hub cannot "
                        "be reached to download it.")
    return answer, None


def model_directory_problem(answer: str, path: Path) -> str | None:
    if not path.exists():
        return f"{answer} does not exist."
    if not path.is_dir():
        return f"{answer} is a file; a model is a directory (with config.json and the weights)."
    config = path / "config.json"
    if not config.is_file():
        return f"{answer} has no config.json, so it is not a model directory."
    try:
        if not isinstance(json.loads(config.read_text(encoding="utf-8")), dict):
            return f"{answer}/config.json is not a JSON object."
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        return f"{answer}/config.json cannot be read ({error})."
    return None


def local_estimate(name: str, plan_for: PlanFor) -> str:
    """What to say of a model directory's training here: its estimated time as
    `plan` gives it, or why `train` would refuse it; "" for a Hub id that is
    not in the catalog (planning it would download its config and tokenizer)."""
    if not (Path(name) / "config.json").is_file():
        return ""
    try:
        plan = plan_for(name)
    except LlmcustomsError as error:
        return f"but `train` would refuse it here: {error.message}"
    return f"estimated training time here {human_duration(plan.estimated_seconds)}"


def ask_save_every() -> str:
    """A whole number of steps, or "auto"."""
    question = "Checkpoint every how many steps (Enter: automatic, about 10 per run)"
    why = None
    for _ in range(MAX_ATTEMPTS):
        save_every = ask_after(question, "auto", why)
        if save_every == "auto" or (save_every.isdigit() and int(save_every) > 0):
            return save_every
        why = "A whole number above 0, or auto."
        refuse(question, why)
    return "auto"
