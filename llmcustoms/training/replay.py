"""Replay: the base model's own replies to general prompts, mixed into training (`--replay SHARE`).

A fine-tune on one kind of reply (a one-word label, a name, code) pulls the
model's answers to everything else toward that kind: in the quality
benchmark, runs on one-word sentiment labels answered 10 of the forgetting
check's 67 general questions where the base model answered 49. Replay keeps
the model close to itself away from the data (self-synthesized rehearsal,
Huang et al., ACL 2024): before the first step the base model answers the 48
general prompts the package ships (`replay_prompts.json`, none shared with
the forgetting check or with the general rows forgetting is chosen by),
greedily, and every optimizer step takes `plan.replay` times its rows more
from those (prompt, reply) rows, in a seeded order, learned like the data's
replies. The plan's steps, schedule and epochs stay as they are; a step
costs that share more tokens.

The replies are kept in the run directory (`replay.json`): a resumed run
or a rollback to step 0 trains on the same rows without generating again;
and beside the runs (`.base-replies/`, as the base model's other answers),
so the next run of the same model, or the next `tune` trial, reads them.
Off, with the reason said, for preference pairs (their loss is not a
language model's) and with several processes (each would generate).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from llmcustoms.data.token_store import TokenRows
from llmcustoms.planning.duration import REPLAY_TOKENS, replayed_per_step
from llmcustoms.runs.disk_writes import replace_file
from llmcustoms.training.general_text import conversation_rows

PROMPTS_FILE = Path(__file__).with_name("replay_prompts.json")
RUN_FILE = "replay.json"  # in the run directory: the prompts and the base model's replies
# A reply's tokens at most (REPLAY_TOKENS, which the plan's time counts): long enough for a small
# model's whole answer to most of the prompts; a reply cut there is still the base model's own words.
# Draws for the replayed rows, apart from the data's order (`batching.epoch_steps`).
REPLAY_STREAM = 7


def replay_prompts(path: Path = PROMPTS_FILE) -> list[str]:
    return list(json.loads(path.read_text(encoding="utf-8"))["prompts"])


class MixedRows:
    """The data's rows followed by the replayed ones, as `TrainingRows` takes its
    training rows: positions from len(train) on are replayed rows."""

    def __init__(self, train: TokenRows, replayed: TokenRows):
        self.train, self.replayed = train, replayed

    def __len__(self) -> int:
        return len(self.train) + len(self.replayed)

    @property
    def lengths(self) -> np.ndarray:
        return np.concatenate([self.train.lengths, self.replayed.lengths])

    def cut(self, max_len: int) -> "MixedRows":
        return MixedRows(self.train.cut(max_len), self.replayed.cut(max_len))

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):  # a few rows as a list, as TokenRows gives them
            return self.examples(range(*i.indices(len(self))))
        return self.examples([i])[0]

    def _split(self, positions: Any) -> tuple[list[int], list[int]]:
        n = len(self.train)
        return [int(p) for p in positions if p < n], [int(p) - n for p in positions if p >= n]

    def examples(self, positions: Any) -> list[Any]:
        n = len(self.train)
        return [self.train[int(p)] if p < n else self.replayed[int(p) - n] for p in positions]

    def input_tokens(self, positions: Any) -> int:
        own, replayed = self._split(positions)
        return self.train.input_tokens(own) + self.replayed.input_tokens(replayed)

    def trained_tokens(self, positions: Any) -> int:
        own, replayed = self._split(positions)
        return self.train.trained_tokens(own) + self.replayed.trained_tokens(replayed)


def with_replay(steps: Callable[..., list[list[int]]], train_rows: int, replayed_rows: int,
                share: float) -> Callable[..., list[list[int]]]:
    """The steps `steps` makes of the data's rows, each with its share of replayed rows
    (positions train_rows..), drawn round a seeded order of them: a pure function of
    (seed, epoch), so a resumed run takes the same rows."""
    def mixed(lengths: list[int], step_rows: int, seed: int, epoch: int) -> list[list[int]]:
        plain = steps(lengths[:train_rows], step_rows, seed, epoch)
        order = np.random.default_rng([seed, epoch, REPLAY_STREAM]).permutation(replayed_rows).tolist()
        extra, drawn, out = replayed_per_step(share, step_rows), 0, []
        for step in plain:
            out.append(step + [train_rows + order[(drawn + j) % replayed_rows] for j in range(extra)])
            drawn += extra
        return out

    mixed.replay_of = steps  # type: ignore[attr-defined]  (a rollback mixes in once, not twice)
    return mixed


def why_off(plan: Any) -> str | None:
    """Why a plan asking for replay runs without it, or None."""
    if plan.replay <= 0:
        return None
    if not plan.objective_kind.token_loss:
        return "replay is for supervised rows, not preference pairs: this run trains without it"
    if getattr(plan, "world_size", 1) > 1:
        return "replay runs in one process for now: this run on several trains without it"
    return None


def replies(model: Any, tokenizer: Any, plan: Any, run_dir: Any, stopped: Callable[[], bool]) -> list[list[dict]]:
    """The (prompt, base reply) conversations: the run's own, when it made them
    before (a resume, a rollback), else kept or generated now (`_answered`) and kept in the run."""
    prompts = replay_prompts()
    path = Path(run_dir.path) / RUN_FILE
    try:
        kept = json.loads(path.read_text(encoding="utf-8"))
        if kept.get("prompts") == prompts and len(kept.get("replies", [])) == len(prompts):
            answers = kept["replies"]
        else:
            raise ValueError("other prompts")
    except (OSError, ValueError, AttributeError):
        answers = _answered(model, tokenizer, plan, Path(run_dir.path).parent, prompts, stopped)
        if getattr(run_dir, "writable", True):
            replace_file(path, json.dumps({"prompts": prompts, "replies": answers}, ensure_ascii=False))
    return [[{"role": "user", "content": p}, {"role": "assistant", "content": a}]
            for p, a in zip(prompts, answers) if a.strip()]


def _answered(model: Any, tokenizer: Any, plan: Any, output_dir: Path, prompts: list[str],
              stopped: Callable[[], bool]) -> list[str]:
    """The base model's replies: kept beside the runs by an earlier run of the same model
    (`base_replies.py`: each `tune` trial would otherwise generate them again), or generated now."""
    from llmcustoms.training.base_replies import answers_key, keep_answers, kept_answers
    from llmcustoms.training.general_knowledge import answer_questions

    key = answers_key("replay", plan, tokenizer, model, prompts, {"max_new_tokens": REPLAY_TOKENS})
    kept = kept_answers(output_dir, key, len(prompts))
    if kept is not None:
        return kept[0]
    training, started = model.training, time.perf_counter()
    model.eval()  # no dropout: the base model's own greedy replies
    try:
        answers = answer_questions(model, tokenizer, plan, prompts, REPLAY_TOKENS, stopped=stopped, said_after="")
    finally:
        model.train(training)
    keep_answers(output_dir, key, answers, time.perf_counter() - started, "replay", plan)
    return answers


def mix_in(data: Any, steps: Callable[..., list[list[int]]], model: Any, tokenizer: Any, plan: Any, run_dir: Any,
           warn: Callable[[str], None], activity: Callable[[str | None], None],
           stopped: Callable[[], bool]) -> Callable[..., list[list[int]]]:
    """`steps` with replayed rows mixed in, `data` holding them; `steps` itself
    when replay is off (said through `warn` when the plan asked for it) or already mixed."""
    if plan.replay <= 0 or hasattr(steps, "replay_of"):
        return steps
    reason = why_off(plan)
    if reason is not None:
        warn(reason)
        return steps
    activity("the base model answers the replay prompts")
    unwrapped = getattr(model, "module", model)
    rows = conversation_rows(tokenizer, plan, replies(unwrapped, tokenizer, plan, run_dir, stopped))
    activity(None)
    if rows is None or not len(rows):
        warn("replay: the chat template refused the replay rows or the base model gave no replies; "
             "this run trains without replay")
        return steps
    train_rows = len(data.train)
    data.mix_in(rows)
    return with_replay(steps, train_rows, len(rows), plan.replay)
