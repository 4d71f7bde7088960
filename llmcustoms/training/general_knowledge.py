"""The forgetting check: how many general questions the model answers, before training and after.

Training on the user's rows may wear away what the base model knew outside
them. llmcustoms ships a small set of general questions written for it
(`general_questions.json` beside this module: arithmetic, capitals, science,
units, words, one-line code facts), each with short accepted answers. In a run
with evaluation rows the base model answers them before the first step and the
kept model at the end, beside the sample replies (`samples.SampleReplies`
calls `GeneralKnowledge.score`): greedily, at most `MAX_NEW_TOKENS` tokens, in
the format the run trains on (its chat template, `generation.prompt_ids`), in
left-padded batches. A reply is right when it holds one of the question's
answers as a word, case aside (`is_right`: "56" is in "It is 56." but not in
"156"). Seconds on a small model on a CPU (docs/train-and-plan.md has the
measurement).

The score goes to status.json, `general_knowledge: {"base": {"right": 41,
"asked": 88, "seconds": 3.1}, "trained": {...}}`, and each question's reply to
general.jsonl in the run directory (the questions are ours, not the user's
data). `runs/forgetting.py` reads the score for the summary, `report` and the
model card. Like a sample, the check is a look, never worth the run: a failure
to answer is a warning, and a stop asked for ends it at the next token,
recording nothing.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from llmcustoms.preparation.prepared_run import PreparedRun
from llmcustoms.recovery.stop_signals import StopRequested
from llmcustoms.runs.disk_writes import replace_file
from llmcustoms.training.base_replies import answers_key, keep_answers, kept_answers

QUESTIONS_FILE = Path(__file__).with_name("general_questions.json")
GENERAL_FILE = "general.jsonl"  # in the run directory: a row per question and label
MAX_NEW_TOKENS = 24
# Said after each question: a small model's short answer fits in the token limit,
# where its long one often ran out before the answer.
BRIEFLY = " Answer in a few words."
# Questions answered at once on a GPU, where the memory is training's too: 16
# short rows' KV cache, a few hundred MB for a 7B model. On a CPU all of them
# at once: on one CPU thread SmolLM2-135M answered all 67 in 23 s of CPU time, 31 s in batches of 32.
GPU_BATCH_SIZE = 16
LABELS = ("base", "trained")


@dataclass(frozen=True)
class GeneralQuestion:
    question: str
    answers: tuple[str, ...]  # accepted answers: any one of them, as a word, case aside


def load_questions(path: Path = QUESTIONS_FILE) -> list[GeneralQuestion]:
    """The general questions, in the file's order."""
    data = json.loads(path.read_text(encoding="utf-8"))
    return [GeneralQuestion(q["question"], tuple(q["answers"])) for q in data["questions"]]


def is_right(reply: str, answers: tuple[str, ...]) -> bool:
    """Whether `reply` holds one of `answers`, case aside, not inside a longer
    word or number: an answer's letter or digit edge may not touch another."""
    text = reply.casefold()
    for answer in answers:
        key = answer.casefold()
        before = r"(?<!\w)" if key[:1].isalnum() else ""
        after = r"(?!\w)" if key[-1:].isalnum() else ""
        if re.search(before + re.escape(key) + after, text):
            return True
    return False


def answer_questions(model: Any, tokenizer: Any, plan: Any, questions: list[str], max_new_tokens: int = MAX_NEW_TOKENS,
                     batch_size: int | None = None, stopped: Callable[[], bool] = lambda: False,
                     counted: Callable[[int, int], None] = lambda done, total: None, said_after: str = BRIEFLY
                     ) -> list[str]:
    """Greedy replies of `model` to `questions`, each asked alone as the user's
    turn (followed by `said_after`: `BRIEFLY` for the check), answered in left-padded batches of
    `batch_size` (None: `GPU_BATCH_SIZE` on a GPU, all at once on a CPU).
    Raises StopRequested once `stopped()` says so (asked before each batch and after each token).
    `counted(done, total)` is told of each token generated, `total` being every batch's
    `max_new_tokens`: on a CPU all the questions are one batch, so a count of
    questions would stand still until the very end."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    from llmcustoms.models.generation import generation_stops, prompt_ids

    class Halt(StoppingCriteria):
        def __init__(self) -> None:
            # The tokens counted in the batches before this one, and where this batch's replies begin.
            self.before, self.width = 0, 0

        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            if stopped():
                raise StopRequested
            counted(self.before + input_ids.shape[1] - self.width, total)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    stops = sorted(generation_stops(tokenizer, plan))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    batch_size = max(batch_size or (len(questions) if model.device.type == "cpu" else GPU_BATCH_SIZE), 1)
    replies: list[str] = []
    starts, halt = range(0, len(questions), batch_size), Halt()
    total = len(starts) * max_new_tokens
    counted(0, total)
    for number, start in enumerate(starts):
        if stopped():
            raise StopRequested
        prompts = [prompt_ids(tokenizer, plan, [{"role": "user", "content": q + said_after}])[0]
                   for q in questions[start:start + batch_size]]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):  # left-padded: every prompt ends where the replies begin
            ids[row, width - len(prompt):], mask[row, width - len(prompt):] = prompt, 1
        halt.before, halt.width = number * max_new_tokens, width
        with torch.no_grad():
            out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                                 max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stops,
                                 pad_token_id=pad, use_cache=True, stopping_criteria=StoppingCriteriaList([halt]))
        replies += [_decoded(tokenizer, new.tolist(), set(stops)) for new in out[:, width:]]
        counted((number + 1) * max_new_tokens, total)  # a batch whose replies all stopped early skips the rest
    return replies


def _decoded(tokenizer: Any, new: list[int], stops: set[int]) -> str:
    """A reply's text: its tokens up to the first stop (what follows is padding)."""
    end = next((i for i, token in enumerate(new) if token in stops), len(new))
    return tokenizer.decode(new[:end], skip_special_tokens=True).strip()


class GeneralKnowledge:
    """Scores a model on the general questions and records it in the run."""

    def __init__(self, tokenizer: Any, plan: Any, run_dir: Any, questions: list[GeneralQuestion] | None = None,
                 warn: Callable[[str], None] = lambda text: None, max_new_tokens: int = MAX_NEW_TOKENS,
                 batch_size: int | None = None):
        self.tokenizer, self.plan, self.run_dir, self.warn = tokenizer, plan, run_dir, warn
        self.questions = load_questions() if questions is None else questions
        self.max_new_tokens, self.batch_size = max_new_tokens, batch_size
        self.reused = False  # whether the last answers were the base model's, kept from an earlier run

    def score(self, model: Any, step: int, label: str, stopped: Callable[[], bool] = lambda: False,
              counted: Callable[[int, int], None] = lambda done, total: None) -> dict[str, Any] | None:
        """`model`'s score (in eval mode while answering), recorded under `label`
        and returned; None, with a warning, if answering fails (out of memory,
        ...), and None, silently, once `stopped()` says so. `counted`: as in `answer_questions`."""
        started, self.reused = time.perf_counter(), False
        was_training = model.training
        model.eval()
        questions = [q.question for q in self.questions]
        try:
            key = answers_key("general", self.plan, self.tokenizer, model, [q + BRIEFLY for q in questions],
                              {"max_new_tokens": self.max_new_tokens, "batch_size": self.batch_size}
                              ) if label == "base" else None
            kept = kept_answers(self.run_dir.path.resolve().parent, key, len(questions))
            self.reused = kept is not None and all(isinstance(reply, str) for reply in kept[0])
            replies = kept[0] if self.reused else answer_questions(
                model, self.tokenizer, self.plan, questions, self.max_new_tokens, self.batch_size, stopped, counted)
        except StopRequested:
            return None
        except Exception as error:  # noqa: BLE001 - whatever it was, training goes on
            self.warn(f"general questions ({label}) skipped ({type(error).__name__}: {error})")
            return None
        finally:
            model.train(was_training)
        rows = [{"step": step, "label": label, "question": q.question, "reply": reply,
                 "right": is_right(reply, q.answers)} for q, reply in zip(self.questions, replies)]
        seconds = kept[1] if self.reused else round(time.perf_counter() - started, 2)
        score = {"right": sum(r["right"] for r in rows), "asked": len(rows), "seconds": seconds}
        if self.reused:
            score["reused"] = True  # `seconds`: what generating them took in the run that kept them
        elif self.run_dir.writable:
            keep_answers(self.run_dir.path.resolve().parent, key, replies, seconds, "general", self.plan)
        self._record(label, score, rows)
        return score

    def _record(self, label: str, score: dict[str, Any], rows: list[dict[str, Any]]) -> None:
        """The score into status.json; the rows into general.jsonl, in place of the label's earlier ones."""
        run_dir = self.run_dir
        if not run_dir.writable:
            return
        status = run_dir.read_status()
        scores = status.get("general_knowledge")
        scores = {k: v for k, v in scores.items() if k != label} if isinstance(scores, dict) else {}
        run_dir.write_status(status.get("status", "running"), general_knowledge={**scores, label: score})
        kept = [r for r in read_general_rows(run_dir.path) if r.get("label") != label]
        try:
            replace_file(run_dir.path / GENERAL_FILE, "".join(json.dumps(r) + "\n" for r in kept + rows))
        except OSError as error:  # a full disk: the score is in status.json, the rows are a detail
            self.warn(f"{GENERAL_FILE} not written ({error.strerror or error})")


def general_check(prepared: PreparedRun, run_dir: Any, warn: Callable[[str], None]) -> GeneralKnowledge | None:
    """The forgetting check of a run with evaluation rows (`preparation.PreparedRun`), or None without."""
    if not prepared.plan.eval_rows:
        return None
    return GeneralKnowledge(prepared.tokenizer, prepared.plan, run_dir, warn=warn)


def read_general_rows(run_path: Path) -> list[dict[str, Any]]:
    """general.jsonl's readable rows (none when there is no file)."""
    path = run_path / GENERAL_FILE
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows
