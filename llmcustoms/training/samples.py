"""Sample replies: what the model says to a few held-out prompts, before and after training.

Eval loss says *that* the model changed; a reply shows *how*. A few prompts
are drawn (seeded, so a resumed run draws the same) from the user's own
held-out rows and answered greedily with a short `max_new_tokens`: by the base
model before the first step, by the model kept at the end, and at each
evaluation when that is cheap next to the training between evaluations.
Rows go to the run's samples.jsonl:

    {"step": 0, "label": "base", "row": 17, "prompt": "...", "reply": "...", "reference": "...", "stopped": true}

`label` is "base", "eval" or "trained". `stopped` says whether the reply ended
with a token generation stops on (EOS, the chat template's end-of-turn token:
`generation.generation_stops`) before the token limit; the share of replies
that did is the stop rate (`runs/stop_rates.py`), which the summary, `report`
and the model card show. Rows written before it have no `stopped`. The
prompts are the user's data, so they stay in the terminal and the output
directory (the run's, and the base model's kept replies beside it:
`base_replies.py`); the exported model card never shows them, only the stop rate. In a run with evaluation rows the
"base" and "trained" answers come with the forgetting check's score
(`general_knowledge.py`). A sample is a look, never worth the run: a prompt too long
for the plan's sequence length is not drawn, a failure to answer is a
warning, and a stop asked for (SIGINT, SIGTERM) ends the answering at the next
token, writing none of them.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from llmcustoms.data.prompt_draws import SamplePrompt, pick_prompts
from llmcustoms.data.row_formats import Example
from llmcustoms.preparation.prepared_run import PreparedRun
from llmcustoms.recovery.stop_signals import StopRequested
from llmcustoms.reporting import Reporter
from llmcustoms.runs import check_prompts
from llmcustoms.training.base_replies import FOLDER, answers_key, keep_answers, kept_answers
from llmcustoms.training.general_knowledge import LABELS as GENERAL_LABELS
from llmcustoms.training.general_knowledge import GeneralKnowledge, general_check

SAMPLE_PROMPTS = 3
CHECK_PROMPTS = 4  # what an export's merge is checked on (`commands/merging.py`)
MAX_NEW_TOKENS = 48
# Answer at evaluations too when it takes at most this share of the time the
# training between two evaluations took.
CHEAP_SHARE = 0.05


def held_out_examples(prepared: PreparedRun) -> list[Example]:
    """The run's evaluation rows as examples (at most `splits.MAX_EVAL_ROWS`), in row order:
    from the rows preparation kept, or one pass over the file when it held too many to keep."""
    evaluation = prepared.evaluation
    rows = set(evaluation.row_numbers.tolist()) if evaluation is not None else set()
    return [e for e in prepared.eval_file_examples() if e.row in rows] if rows else []


def held_out_prompts(prepared: PreparedRun, count: int = SAMPLE_PROMPTS,
                     held_out: list[Example] | None = None) -> list[SamplePrompt]:
    """Prompts from the run's evaluation rows (`held_out`, none without evaluation),
    each short enough to be answered within the plan's sequence length."""
    evaluation = prepared.evaluation
    if evaluation is None or not len(evaluation):
        return []
    room = prepared.plan.max_seq_len - MAX_NEW_TOKENS
    short = set(evaluation.row_numbers[evaluation.first_loss <= room].tolist())
    held_out = held_out_examples(prepared) if held_out is None else held_out
    return pick_prompts((e for e in held_out if e.row in short), count, prepared.plan.seed)


def keep_check_prompts(prepared: PreparedRun, held_out: list[Example], run_dir: Any,
                       warn: Callable[[str], None]) -> None:
    """check_prompts.json (`runs/check_prompts.py`): what `export` checks its merge on, drawn
    as the samples are from the held-out rows; where they give too few, from all the data's
    rows while they are kept in memory (never a pass over a large file for it). A write that
    fails (a full disk) is a warning: export then draws them from the data file."""
    if not run_dir.writable:
        return
    drawn = pick_prompts(held_out, CHECK_PROMPTS, prepared.plan.seed)
    if len(drawn) < CHECK_PROMPTS and prepared.dataset.kept is not None:  # a few held-out rows, or none
        drawn = pick_prompts(prepared.dataset.kept, CHECK_PROMPTS, prepared.plan.seed)
    try:
        check_prompts.write(run_dir.path, [list(p.messages) for p in drawn], prepared.dataset.system_prompt)
    except OSError as error:
        warn(f"{check_prompts.FILE} not written ({error.strerror or error}): export will read its check prompts "
             "from the data file")


def run_samples(prepared: PreparedRun, run_dir: Any, warn: Callable[[str], None]) -> "SampleReplies":
    """A run's sample replies (`train`, `resume`), with the forgetting check when it has
    evaluation rows; the export's check prompts kept beside them."""
    held_out = held_out_examples(prepared)
    keep_check_prompts(prepared, held_out, run_dir, warn)
    return SampleReplies(held_out_prompts(prepared, held_out=held_out), prepared.tokenizer, prepared.plan, run_dir,
                         warn=warn, general=general_check(prepared, run_dir, warn))


class SampleReplies:
    """Answers the prompts with a model and appends the replies to samples.jsonl."""

    def __init__(self, prompts: list[SamplePrompt], tokenizer: Any, plan: Any, run_dir: Any,
                 max_new_tokens: int = MAX_NEW_TOKENS, warn: Callable[[str], None] = lambda text: None,
                 general: GeneralKnowledge | None = None):
        self.prompts = prompts
        self.general = general  # the forgetting check, scored beside the "base" and "trained" replies
        self.tokenizer = tokenizer
        self.plan = plan
        self.run_dir = run_dir
        self.max_new_tokens = max_new_tokens
        self.warn = warn
        self.seconds: float | None = None  # how long answering took last time
        self.reused = False  # whether the last answers were the base model's, kept from an earlier run

    def answer_in_run(self, processes: Any, model: Any, step: int, label: str, reporter: Reporter,
                      due: bool = True) -> None:
        """Answer from the main process of a run (`processes.Processes`) when it finds
        it `due` and no stop was asked of it; the others wait. Not under FSDP, where
        every forward is a collective. `reporter` is told what is answered and how
        far it got: on a busy CPU a base model's replies take minutes."""
        def stopped() -> bool:  # asked of the main process's own signals: it alone answers
            return processes.signals.received is not None

        if processes.fsdp or not processes.main_decides(due and not stopped()):
            return
        if processes.is_main:
            replies, questions = f"sample replies ({label})", f"general questions ({label})"
            reporter.activity(replies)
            self.answer(processes.accelerator.unwrap_model(model), step, label, stopped,
                        lambda done, total: reporter.count(replies, done, total))
            if self.general is not None and label in GENERAL_LABELS:
                reporter.activity(questions)
                self.general.score(processes.accelerator.unwrap_model(model), step, label, stopped,
                                   lambda done, total: reporter.count(f"{questions}, token", done, total))
            if label == "base" and (self.reused or (self.general is not None and self.general.reused)):
                reporter.message("the base model's answers: reused from an earlier run with the same model, prompts "
                                 f"and settings ({self.run_dir.path.resolve().parent / FOLDER})")
            reporter.activity(None)
        processes.accelerator.wait_for_everyone()

    def answer(self, model: Any, step: int, label: str, stopped: Callable[[], bool] = lambda: False,
               counted: Callable[[int, int], None] = lambda done, total: None) -> list[dict[str, Any]]:
        """Greedy replies of `model` (in eval mode while answering), written and
        returned; none, with a warning, if answering fails (out of memory, ...),
        and none, silently, once `stopped()` says so (asked after every token).
        `counted(done, total)` is told of each reply, from 0 of them on."""
        from llmcustoms.models.generation import reply_and_stop

        def token(text: str) -> None:
            if stopped():
                raise StopRequested

        started, self.reused = time.perf_counter(), False
        was_training = model.training
        model.eval()
        try:
            key = self._key(model) if label == "base" and self.prompts else None
            kept = _replies(kept_answers(self.run_dir.path.resolve().parent, key, len(self.prompts)))
            replies = list(kept[0]) if kept else []
            self.reused = kept is not None
            counted(len(replies), len(self.prompts))
            for prompt in self.prompts[len(replies):]:
                replies.append(reply_and_stop(model, self.tokenizer, self.plan, list(prompt.messages),
                                              self.max_new_tokens, 0.0, token))
                counted(len(replies), len(self.prompts))
        except StopRequested:
            return []
        except Exception as error:  # noqa: BLE001 - whatever it was, training goes on
            self.warn(f"sample replies at step {step} skipped ({type(error).__name__}: {error})")
            return []
        finally:
            model.train(was_training)
        # Kept answers bring the time they took: `cheap` judges answering at evaluations by it.
        self.seconds = kept[1] if kept else time.perf_counter() - started
        if not kept and self.run_dir.writable:
            keep_answers(self.run_dir.path.resolve().parent, key, [list(reply) for reply in replies], self.seconds,
                         "samples", self.plan)
        rows = [{"step": step, "label": label, "row": p.row, "prompt": p.text, "reply": reply,
                 "reference": p.reference, "stopped": stopped} for p, (reply, stopped) in zip(self.prompts, replies)]
        self.run_dir.append_samples(rows)
        return rows

    def _key(self, model: Any) -> str | None:
        prompts = [list(p.messages) for p in self.prompts]
        return answers_key("samples", self.plan, self.tokenizer, model, prompts, {"max_new_tokens": self.max_new_tokens})

    def cheap(self, training_seconds: float) -> bool:
        """Whether answering at an evaluation costs little next to `training_seconds`."""
        return bool(self.prompts) and self.seconds is not None and self.seconds <= CHEAP_SHARE * training_seconds


def _replies(kept: tuple[list[Any], float] | None) -> tuple[list[tuple[str, bool]], float] | None:
    """Kept base answers as (reply, stopped) pairs, or None when they are not such pairs."""
    if kept is None or not all(isinstance(a, list) and len(a) == 2 and isinstance(a[0], str) and isinstance(a[1], bool)
                               for a in kept[0]):
        return None
    return [(reply, stopped) for reply, stopped in kept[0]], kept[1]


def side_by_side(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per prompt: its text, the data's reply, the base model's and the
    trained model's; and, for rows that say so, whether each stopped
    ("base_stopped", "trained_stopped": `runs/stop_rates.py` counts them)."""
    by_row: dict[int, dict[str, Any]] = {}
    for row in rows:
        entry = by_row.setdefault(row["row"], {"prompt": row["prompt"], "reference": row.get("reference", ""),
                                               "base": "", "trained": ""})
        if row["label"] in ("base", "trained"):
            entry[row["label"]] = row["reply"]
            if isinstance(row.get("stopped"), bool):  # not in older runs' rows, nor in a damaged one's
                entry[f"{row['label']}_stopped"] = row["stopped"]
            else:
                entry.pop(f"{row['label']}_stopped", None)
    return [by_row[r] for r in sorted(by_row)]
