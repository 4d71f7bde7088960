"""What the kit runs on: the card, the driver, torch and CUDA, and every package the project
imports, each imported for real (a wheel carried for the wrong Python fails here, not in the
middle of a benchmark). Prints `RESULT {...}`; exit 1 when a package the kit needs fails.

    python benchmarks/gpu/envcheck.py [--dry-run]
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import platform
import subprocess
import sys
import time

# (module, distribution): imported by llmcustoms or the benchmarks.
PACKAGES = (("torch", "torch"), ("transformers", "transformers"), ("peft", "peft"), ("accelerate", "accelerate"),
            ("bitsandbytes", "bitsandbytes"), ("liger_kernel", "liger-kernel"), ("trl", "trl"),
            ("datasets", "datasets"), ("optuna", "optuna"), ("dotenv", "python-dotenv"),
            ("huggingface_hub", "huggingface_hub"), ("tokenizers", "tokenizers"), ("safetensors", "safetensors"),
            ("typer", "typer"), ("rich", "rich"), ("pynvml", "nvidia-ml-py"), ("psutil", "psutil"),
            ("yaml", "pyyaml"), ("triton", "triton"), ("flash_attn", "flash-attn"), ("llmcustoms", "llmcustoms"))
# Missing these only narrows what is measured (a baseline skipped, a kernel not tried).
OPTIONAL = {"flash_attn", "liger_kernel", "triton"}


def imported(module: str, distribution: str) -> str:
    """The version that imported, or why it did not. Prints how long the import took: on a
    machine just started the first imports read gigabytes from disk, and the log says which."""
    started = time.perf_counter()
    try:
        loaded = importlib.import_module(module)
    except Exception as error:  # any failure to import is what this check is for
        return f"not importable: {type(error).__name__}: {str(error)[:200]}"
    finally:
        print(f"import {module}: {time.perf_counter() - started:.1f} s", flush=True)
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return getattr(loaded, "__version__", "imported (no version)")


def gpu_facts() -> dict:
    import torch

    facts = {"cuda_available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                     compute_capability=f"{props.major}.{props.minor}", multiprocessors=props.multi_processor_count,
                     bf16=torch.cuda.is_bf16_supported())
        try:
            facts["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                             capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            facts["driver"] = "nvidia-smi not found"
    try:
        from torch.nn.attention import varlen  # noqa: F401

        facts["torch_varlen_attn"] = True
    except ImportError:
        facts["torch_varlen_attn"] = False
    return facts


def planner_view() -> dict:
    """What llmcustoms' own detection sees: the planner plans from this."""
    from llmcustoms.training.preflight import usable_hardware

    hardware = usable_hardware()
    return {"gpus": [f"{g.name} ({g.total_bytes / 2**30:.1f} GiB, cc {g.compute_capability})" for g in hardware.gpus],
            "varlen_attention": hardware.varlen_attention, "cpu_cores": hardware.cpu_cores,
            "ram_gib": round(hardware.ram_bytes / 2**30, 1), "torch_note": hardware.torch_note}


def main() -> None:
    dry_run = "--dry-run" in sys.argv
    versions = {module: imported(module, dist) for module, dist in PACKAGES}
    started = time.perf_counter()
    facts = gpu_facts()
    print(f"CUDA's first use: {time.perf_counter() - started:.1f} s", flush=True)
    result = {"python": platform.python_version(), "platform": platform.platform(), "packages": versions, **facts}
    try:
        result["planner_sees"] = planner_view()
    except Exception as error:  # the report goes on: the planner's failure is itself a finding
        result["planner_sees"] = f"failed: {type(error).__name__}: {error}"
    needed = [m for m, _ in PACKAGES if m not in OPTIONAL]
    result["missing"] = [m for m in needed if versions[m].startswith("not importable")]
    if not dry_run and not result["cuda_available"]:
        result["missing"].append("a CUDA GPU torch can use")
    print("RESULT " + json.dumps(result), flush=True)
    raise SystemExit(1 if result["missing"] else 0)


if __name__ == "__main__":
    main()
