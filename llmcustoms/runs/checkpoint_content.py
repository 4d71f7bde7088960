"""What a checkpoint's files must hold before anything reads them, checked without torch.

A checkpoint whose checksums match can still be unusable: written by a buggy
or older version, edited by hand and re-hashed, or the manifest itself may be
JSON of another shape. Reading such files would end in a traceback far from
the cause (a UnicodeDecodeError, a SafetensorError, a KeyError in the
optimizer) or, worse, restore silently (a [1, n] tensor broadcast into an
[r, n] weight). So every file is read as untrusted bytes here, and each check
returns what is wrong as a sentence, or None; nothing here raises on any bytes.

`generate` lists checkpoints without importing torch, so neither does this:
safetensors headers are parsed by hand (an 8-byte little-endian length, then
a JSON header). Whether the tensors fit the model being trained is decided in
`processes.Processes.checkpoint_problem`, which compares these headers with it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Bytes per element of each safetensors dtype torch writes.
DTYPE_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
# torch's dtype names (str(dtype) without "torch.") as safetensors writes them.
TORCH_DTYPES = {"bool": "BOOL", "uint8": "U8", "int8": "I8", "float8_e5m2": "F8_E5M2", "float8_e4m3fn": "F8_E4M3",
                "int16": "I16", "uint16": "U16", "float16": "F16", "bfloat16": "BF16", "int32": "I32",
                "uint32": "U32", "float32": "F32", "int64": "I64", "uint64": "U64", "float64": "F64"}
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
SHA256 = re.compile(r"[0-9a-f]{64}")
# The loop position's counters (`position.Position`), which are never negative.
COUNTERS = ("epoch", "index", "tokens", "evals_since_best")


class Unusable(Exception):
    """What is wrong with a file, as the sentence a warning gives."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # as safetensors names it: "F32", "BF16", ...
    shape: tuple[int, ...]

    def describe(self) -> str:
        return f"{self.dtype} {list(self.shape)}"


def torch_dtype_name(dtype: Any) -> str:
    """A torch dtype as safetensors names it (the name itself if it has none)."""
    name = str(dtype).removeprefix("torch.")
    return TORCH_DTYPES.get(name, name)


def _shown(value: Any) -> str:
    """A value of a damaged file, short enough for a warning."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _count(value: Any) -> bool:
    """A non-negative int (bool is an int to Python, not to a count)."""
    return type(value) is int and value >= 0


def _number(value: Any) -> bool:
    return type(value) in (int, float)


def _finite(value: Any) -> bool:
    return _number(value) and math.isfinite(value)


def read_json(path: Path) -> Any:
    """The JSON in `path`, from untrusted bytes; Unusable if there is none."""
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as error:
        raise Unusable(f"{path.name} cannot be read ({error.strerror or error})") from None
    except UnicodeDecodeError:
        raise Unusable(f"{path.name} is not text") from None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        raise Unusable(f"{path.name} is not valid JSON") from None


def manifest_problem(manifest: Any, step: int | None, names: tuple[str, ...]) -> str | None:
    """What is wrong with a parsed manifest: {"step": N, "files": {name: {"size", "sha256"}}}."""
    if not isinstance(manifest, dict):
        return "the manifest is not a JSON object"
    if type(manifest.get("step")) is not int or (step is not None and manifest["step"] != step):
        return f"the manifest names step {_shown(manifest.get('step'))}, not {step}"
    files = manifest.get("files")
    if not isinstance(files, dict):
        return "the manifest has no object of files"
    for name in names:
        entry = files.get(name)
        if entry is None:
            return f"{name} is not in the manifest"
        if not isinstance(entry, dict) or not _count(entry.get("size")):
            return f"the manifest's size of {name} is not a byte count"
        if not isinstance(entry.get("sha256"), str) or not SHA256.fullmatch(entry["sha256"]):
            return f"the manifest's sha256 of {name} is not 64 hex digits"
    return None


# ------------------------------------------------------------ safetensors

def safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors a safetensors file holds, by name, from its header alone;
    Unusable unless the header is well-formed and its offsets cover the data
    exactly (what safetensors itself insists on before loading)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            prefix = f.read(8)
            length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
            if length < 0 or length > min(size - 8, MAX_HEADER_BYTES):
                raise Unusable(f"{path.name} has no safetensors header")
            raw = f.read(length)
    except OSError as error:
        raise Unusable(f"{path.name} cannot be read ({error.strerror or error})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        raise Unusable(f"the safetensors header of {path.name} is not JSON") from None
    if not isinstance(header, dict):
        raise Unusable(f"the safetensors header of {path.name} is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise Unusable(f"the safetensors metadata of {path.name} is not text")
    tensors, spans = {}, []
    for name, entry in header.items():
        info, span = _tensor_entry(path.name, name, entry)
        tensors[name] = info
        spans.append(span)
    end = 0
    for begin, stop in sorted(spans):
        if begin != end:
            raise Unusable(f"the tensors of {path.name} overlap or leave gaps")
        end = stop
    if end != size - 8 - length:
        raise Unusable(f"{path.name} holds {size - 8 - length} bytes of tensors, its header {end}")
    return tensors


def _tensor_entry(file: str, name: str, entry: Any) -> tuple[TensorInfo, tuple[int, int]]:
    """One header entry: its dtype and shape, and the byte span its data_offsets give."""
    if not isinstance(entry, dict) or entry.get("dtype") not in DTYPE_SIZES:
        raise Unusable(f"{file}: tensor {name} has no known dtype")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(_count(n) for n in shape):
        raise Unusable(f"{file}: tensor {name}'s shape is not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_count(n) for n in offsets)
            and offsets[0] <= offsets[1]):
        raise Unusable(f"{file}: tensor {name}'s data_offsets are not a byte range")
    expected = math.prod(shape) * DTYPE_SIZES[entry["dtype"]]
    if offsets[1] - offsets[0] != expected:
        raise Unusable(f"{file}: tensor {name} takes {offsets[1] - offsets[0]} bytes, its shape and dtype {expected}")
    return TensorInfo(entry["dtype"], tuple(shape)), (offsets[0], offsets[1])


# ------------------------------------------------------------- state.json

def state_problem(state: Any, step: int | None) -> str | None:
    """What is wrong with a parsed state.json (see `FineTuner._save_checkpoint`):
    only what is there is checked, and a key an older version did not write is
    no problem, but `step` must be the checkpoint's."""
    if not isinstance(state, dict):
        return "state.json is not a JSON object"
    if type(state.get("step")) is not int or state["step"] < 0 or (step is not None and state["step"] != step):
        return f"state.json's step is {_shown(state.get('step'))}, not {step}"
    for key in COUNTERS:
        if key in state and not _count(state[key]):
            return f"state.json's {key} is {_shown(state[key])}, not a count"
    best_step = state.get("best_step")
    if best_step is not None and not (_count(best_step) and best_step <= state["step"]):
        return f"state.json's best_step is {_shown(best_step)}, not a step up to {state['step']}"
    # A step's loss and the best eval loss were finite when kept; another evaluation may not have been.
    for key, finite in (("final_loss", True), ("best_eval", True), ("last_eval", False), ("base_eval", False)):
        value = state.get(key)
        if value is not None and not (_finite(value) if finite else _number(value)):
            return f"state.json's {key} is {_shown(value)}, not a{' finite' if finite else ''} number"
    if "micro_batch_size" in state and not (_count(state["micro_batch_size"]) and state["micro_batch_size"] > 0):
        return f"state.json's micro_batch_size is {_shown(state['micro_batch_size'])}"
    for key, check in (("scheduler", _scheduler_problem), ("optimizer_groups", _groups_problem), ("rng", _rng_problem)):
        problem = check(state[key]) if key in state else None
        if problem is not None:
            return f"state.json's {key}: {problem}"
    return None


def _scheduler_problem(scheduler: Any) -> str | None:
    """A torch LR scheduler's state_dict, as JSON."""
    if not isinstance(scheduler, dict):
        return "not an object"
    if not _count(scheduler.get("last_epoch")):
        return "last_epoch is not a count"
    for key in ("base_lrs", "_last_lr"):
        if key in scheduler and not (isinstance(scheduler[key], list) and all(map(_finite, scheduler[key]))):
            return f"{key} is not a list of finite numbers"
    if not isinstance(scheduler.get("lr_lambdas"), list):
        return "lr_lambdas is not a list"
    return None


def _groups_problem(groups: Any) -> str | None:
    """An optimizer's param_groups, as JSON: each numbers its parameters, none twice."""
    if not isinstance(groups, list) or not all(isinstance(group, dict) for group in groups):
        return "not a list of objects"
    if not all(isinstance(group.get("params"), list) for group in groups):
        return "a group has no list of params"
    numbers = [number for group in groups for number in group["params"]]
    if not all(_count(number) for number in numbers) or len(set(numbers)) != len(numbers):
        return "a group's params are not distinct parameter numbers"
    for group in groups:
        for key in ("lr", "eps", "weight_decay"):
            if key in group and not _finite(group[key]):
                return f"{key} is not a finite number"
        betas = group.get("betas", [0.0, 0.0])
        if not (isinstance(betas, list) and len(betas) == 2 and all(map(_finite, betas))):
            return "betas are not two finite numbers"
    return None


def _rng_problem(rng: Any) -> str | None:
    """Python's and numpy's generator states (`checkpoints.rng_state`)."""
    if not isinstance(rng, dict):
        return "not an object"
    python, numpy = rng.get("python"), rng.get("numpy")
    if not (isinstance(python, list) and len(python) == 3 and type(python[0]) is int
            and isinstance(python[1], list) and len(python[1]) == 625
            and all(_count(n) and n < 2 ** 32 for n in python[1]) and python[1][-1] <= 624
            and (python[2] is None or _finite(python[2]))):
        return "python is not a Mersenne Twister state"
    if not (isinstance(numpy, list) and len(numpy) == 4 and isinstance(numpy[0], str) and _count(numpy[1])
            and numpy[1] <= 624 and numpy[2] in (0, 1) and _number(numpy[3])):
        return "numpy is not a Mersenne Twister state"
    return None


# ------------------------------------------ against the model being trained

def fit_problem(file: str, tensors: dict[str, TensorInfo], expected: dict[str, TensorInfo],
                whose: str = "the model's") -> str | None:
    """Whether a file's tensors are exactly `expected` (the model's trainable
    weights): the same names, each of the same shape and dtype."""
    for name, want in expected.items():
        have = tensors.get(name)
        if have is None:
            return f"{file} lacks {name}"
        if have != want:
            return f"{file}: {name} is {have.describe()}, {whose} is {want.describe()}"
    extra = sorted(set(tensors) - set(expected))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        return f"{file} holds {extra[0]}{more}, which the model does not train"
    return None


OPTIMIZER_ENTRY = re.compile(r"state\.([0-9]+)\.(.+)")


def optimizer_fit_problem(tensors: dict[str, TensorInfo], groups: list[dict[str, Any]],
                          live: list[list[TensorInfo]]) -> str | None:
    """Whether an optimizer's saved state fits the optimizer it would be loaded
    into, whose groups hold parameters of `live`'s shapes: the same groups of the
    same sizes (torch matches parameters by their order in them), AdamW's
    moments of their parameter's shape and dtype, `step` a scalar."""
    if len(groups) != len(live) or any(len(g["params"]) != len(p) for g, p in zip(groups, live)):
        return (f"the optimizer saved groups of {[len(g['params']) for g in groups]} parameters, "
                f"the model's has {[len(p) for p in live]}")
    parameters = {number: info for group, infos in zip(groups, live) for number, info in zip(group["params"], infos)}
    for name, have in sorted(tensors.items()):
        match = OPTIMIZER_ENTRY.fullmatch(name)
        want = parameters.get(int(match.group(1))) if match else None
        if want is None:
            return f"optimizer.safetensors holds {name}, which is of no parameter"
        if match.group(2) == "step":
            if have.shape != ():
                return f"optimizer.safetensors: {name} is {have.describe()}, not a scalar"
        elif match.group(2).startswith(BNB_STATE + "."):
            problem = _bnb_state_problem(name, match.group(2).split(".", 1)[1], have, want)
            if problem:
                return problem
        elif have != want:
            return f"optimizer.safetensors: {name} is {have.describe()}, its parameter's is {want.describe()}"
    return None


# Where bitsandbytes' optimizers nest their per-parameter tensors in a state_dict.
BNB_STATE = "__bnb_optimizer_quant_state__"


def _bnb_state_problem(name: str, key: str, have: TensorInfo, want: TensorInfo) -> str | None:
    """bitsandbytes' moments (state1, state2) have their parameter's shape (8-bit or
    fp32 values); its quantization maps and block scales are 1-D."""
    if key in ("state1", "state2"):
        if have.shape != want.shape:
            return f"optimizer.safetensors: {name} is {have.describe()}, its parameter's is {want.describe()}"
    elif len(have.shape) != 1:
        return f"optimizer.safetensors: {name} is {have.describe()}, not a list of scales"
    return None


def rng_fit_problem(tensors: dict[str, TensorInfo], cpu: TensorInfo) -> str | None:
    """Whether the generator states are what `checkpoints.set_rng_state` puts back:
    torch's CPU one of `cpu`'s shape, numpy's 624 keys, CUDA's bytes."""
    cuda = {name: info for name, info in tensors.items() if name.startswith("cuda_")}
    if any(info.dtype != "U8" or len(info.shape) != 1 for info in cuda.values()):
        return "rng.safetensors: a CUDA generator state is not bytes"
    expected = {"torch_cpu": cpu, "numpy_keys": TensorInfo("I64", (624,))}
    known = {name: info for name, info in tensors.items() if name in expected}  # others are never read
    return fit_problem("rng.safetensors", known, expected, "this torch's")
