"""What each field of a plan.json must hold, checked before a `Plan` is made of it.

plan.json is a file people open and edit. A value of the wrong type ("lr":
"5e-4", a list where a number belongs) or out of range ("micro_batch_size":
0) used to end far from its cause: a traceback in the model card's number
format, in the batching's range(), or a run resumed with nonsense. So each
field is checked against the dataclass's annotation (an int is a float too,
a bool is neither), the sizes against the least they can be, and the few
words against the values the code knows; what is wrong is one sentence that
names the field. Nothing here raises on any JSON value.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from typing import Any

from llmcustoms.planning.options import BY_NAME

# Every whole number of a plan counts something, so none is below 0; these are
# what a step divides by or loops over, and are at least 1.
AT_LEAST_ONE = ("micro_batch_size", "grad_accum", "effective_batch_size", "max_seq_len", "steps_per_epoch",
                "total_steps", "world_size", "save_every", "lora.r", "lora.alpha")
# Numbers that are not below 0 either.
NOT_NEGATIVE = ("weight_decay", "max_grad_norm", "estimated_seconds", "eval_split", "lora.dropout")
# Fields that must be above zero, and below one.
ABOVE_ZERO = ("lr", "epochs", "beta")
BELOW_ONE = ("eval_split", "lora.dropout")
# The words the code acts on: anything else would take no branch, or the wrong one.
WORDS = {name: BY_NAME[name].choices for name in ("method", "lr_scheduler", "mixed_precision", "optimizer",
                                                     "objective")}
WORDS["distributed"] = ("none", *BY_NAME["distributed"].choices)


class PlanDamaged(ValueError):
    """What is wrong with a plan.json, as the sentence a message gives."""


def plan_problem(cls: Any, data: Any, complete: bool = True, prefix: str = "") -> str | None:
    """What is wrong with `data` as the fields of the dataclass `cls`, or None.
    `complete`: every field without a default must be there (a listing of runs
    reads what is there, and checks only that). Unknown keys are left alone:
    a newer version's plan.json may hold more."""
    if not isinstance(data, dict):
        where = f'"{prefix.rstrip(".")}"' if prefix else "it"
        return f"{where} is {_kind(data)}, where an object of fields belongs"
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        name = prefix + field.name
        if field.name not in data:
            required = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
            if complete and required:
                return f'"{name}" is missing'
            continue
        problem = _value_problem(name, data[field.name], hints[field.name], complete)
        if problem is not None:
            return problem
    return None


def _value_problem(name: str, value: Any, hint: Any, complete: bool) -> str | None:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        [hint] = [a for a in args if a is not type(None)]  # Plan's unions are "X | None"
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return plan_problem(hint, value, complete, prefix=name + ".")
    return _type_problem(name, value, hint, origin, args) or _range_problem(name, value)


# What belongs in a field of each simple type, in words, and whether a value is that.
SIMPLE = {bool: ("true or false", lambda v: type(v) is bool), int: ("a whole number", lambda v: type(v) is int),
          # JSON has NaN and Infinity, which no field may hold
          float: ("a number", lambda v: type(v) in (int, float) and math.isfinite(v)),
          str: ("text", lambda v: isinstance(v, str))}


def _type_problem(name: str, value: Any, hint: Any, origin: Any, args: tuple[Any, ...]) -> str | None:
    if hint in SIMPLE:
        wanted, fits = SIMPLE[hint]
        return None if fits(value) else f'"{name}" is {_kind(value)}, where {wanted} belongs'
    if origin is tuple:  # tuple[str, ...], a list in JSON
        if not isinstance(value, list):
            return f'"{name}" is {_kind(value)}, where a list of text belongs'
        wrong = [v for v in value if not isinstance(v, str)]
        return f'"{name}" holds {_kind(wrong[0])}, where only text belongs' if wrong else None
    if origin is dict:
        if not (isinstance(value, dict) and all(isinstance(k, str) for k in value)):
            return f'"{name}" is {_kind(value)}, where an object belongs'
        if args[1] in (int, float, str):  # memory's byte counts, the duration's seconds; sources' words
            wanted, fits = SIMPLE[str if args[1] is str else float]
            wrong = [(k, v) for k, v in value.items() if not fits(v)]
            return f'"{name}.{wrong[0][0]}" is {_kind(wrong[0][1])}, where {wanted} belongs' if wrong else None
    return None  # Any


def _range_problem(name: str, value: Any) -> str | None:
    least = 1 if name in AT_LEAST_ONE else 0 if type(value) is int or name in NOT_NEGATIVE else None
    if least is not None and value < least:
        return f'"{name}" is {_kind(value)}, where it must be at least {least}'
    if name in ABOVE_ZERO and value <= 0:
        return f'"{name}" is {_kind(value)}, where it must be above 0'
    if name in BELOW_ONE and value >= 1:
        return f'"{name}" is {_kind(value)}, where it must be below 1'
    if name in WORDS and value not in WORDS[name]:
        return f'"{name}" is {_kind(value)}, where one of {", ".join(WORDS[name])} belongs'
    return None


def _kind(value: Any) -> str:
    """A value as a message names it: short, its type plain."""
    if isinstance(value, str):
        shown = value if len(value) <= 24 else value[:21] + "..."
        return f"the text {json.dumps(shown)}"
    if isinstance(value, (list, dict)):
        return "a list" if isinstance(value, list) else "an object"
    return json.dumps(value)  # null, true, 5, 0.5 as plan.json writes them
