"""`plan`, `hardware` and `presets` work offline on a machine with no GPU."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from conftest import DATA_FILES
from llmcustoms.cli import app

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


def flat(text: str) -> str:
    return " ".join(text.split())


def test_plan_json_is_the_plan_and_nothing_else(tiny_models):
    result = invoke("plan", str(DATA_FILES["alpaca"]), "--model", str(tiny_models["llama"]), "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    for key in ("model", "family", "preset", "method", "micro_batch_size", "grad_accum", "effective_batch_size",
                "max_seq_len", "gradient_checkpointing", "lr", "lora", "memory", "reasons", "sources"):
        assert key in plan
    assert plan["family"] == "tinyllama" and plan["memory"]["total_bytes"] < plan["memory"]["budget_bytes"]
    assert plan["sources"]["model"] == "flag"
    assert any("from the tokenizer" in r for r in plan["reasons"])


def test_plan_offline_without_the_model_downloaded_estimates_from_characters():
    # The hub cache is empty and offline: the preset's model is planned from its
    # architecture facts, and token lengths from characters, said so.
    result = invoke("plan", str(DATA_FILES["sharegpt"]), "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    # No GPU here: one of the preset's CPU models, by how long it would take.
    assert plan["model"] in ("HuggingFaceTB/SmolLM2-360M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert plan["family"] == "smollm2" and plan["sources"]["lr"] == "preset quality (tiny model)"
    assert plan["sources"]["model"] == "planner"
    assert any("characters" in r for r in plan["reasons"]) and any("no GPU" in r for r in plan["reasons"])


def test_plan_for_a_card_we_do_not_have():
    mistral = "mistralai/Mistral-7B-Instruct-v0.3"
    on_8gb = json.loads(invoke("plan", str(DATA_FILES["alpaca"]), "--model", mistral, "--vram", "8", "--json").output)
    assert on_8gb["method"] == "qlora" and on_8gb["mixed_precision"] == "bf16"
    assert on_8gb["memory"]["budget_bytes"] == 8 * 1024 ** 3
    on_80gb = json.loads(invoke("plan", str(DATA_FILES["alpaca"]), "--model", mistral, "--vram", "80", "--json").output)
    assert on_80gb["method"] == "lora" and on_80gb["micro_batch_size"] >= on_8gb["micro_batch_size"]


def test_plan_refuses_what_cannot_fit_with_exit_2():
    result = invoke("plan", str(DATA_FILES["alpaca"]), "--model", "mistralai/Mistral-7B-Instruct-v0.3", "--vram", "2")
    assert result.exit_code == 2
    message = flat(result.output)
    assert "does not fit in 2.0 GiB of GPU memory" in message and "What would fit:" in message
    assert "Traceback" not in result.output


def test_plan_for_humans_shows_memory_and_reasons(tiny_models):
    result = invoke("plan", str(DATA_FILES["messages"]), "--model", str(tiny_models["qwen2"]), "--vram", "16")
    assert result.exit_code == 0, result.output
    for fragment in ("Training plan", "Estimated peak memory", "total", "Why", "estimated duration"):
        assert fragment in result.output


def test_a_plan_for_a_gpu_of_a_size_says_its_speed_is_that_gpus_nominal_one_not_this_machines(tiny_models):
    result = invoke("plan", str(DATA_FILES["messages"]), "--model", str(tiny_models["qwen2"]), "--vram", "24", "--json")
    assert result.exit_code == 0, result.output
    [reason] = [r for r in json.loads(result.output)["reasons"] if r.startswith("estimated duration")]
    assert "from the nominal speed of a 24 GB GPU, the GPU planned for, not this machine's" in reason, reason
    assert "this machine's nominal speed" not in reason


def test_hardware_shows_the_machine_and_what_fits():
    result = invoke("hardware")
    assert result.exit_code == 0, result.output
    assert "CPU cores" in result.output and "RAM" in result.output
    assert "What fits" in result.output
    for family in ("tinyllama", "smollm2", "phi", "mistral", "qwen", "qwen3", "llama3", "gemma3", "smollm3"):
        assert f"\n{family} " in result.output, family  # a row per family, today's with them


def test_presets_lists_presets_and_families():
    result = invoke("presets")
    assert result.exit_code == 0, result.output
    for name in ("highspeed", "quality", "bestaccuracy", "tinyllama", "mistral", "qwen", "phi", "qwen3", "llama3",
                 "gemma3", "smollm3", "Qwen3-1.7B", "Llama-3.2-3B-Instruct", "gemma-3-1b-it", "Phi-4-mini-instruct",
                 "SmolLM3-3B"):
        assert name in result.output


def test_presets_shows_the_values_a_plan_takes_for_the_datas_and_the_models_size(tiny_models, monkeypatch):
    # Shown the base values (lr 2e-4, 3 epochs, batch 16), a user saw a small dataset's plan use 5e-4, 4 and 8.
    plan = json.loads(invoke("plan", str(DATA_FILES["alpaca"]), "--model", str(tiny_models["llama"]), "--json").output)
    assert plan["preset"] == "quality" and plan["sources"]["lr"] == "preset quality (tiny model)"  # small data too
    from llmcustoms.ui import console

    monkeypatch.setattr(console.console, "width", 80)
    shown = invoke("presets").output
    assert "…" not in shown and max(map(len, shown.splitlines())) <= 80
    row = next(line for line in shown.splitlines() if line.startswith("quality ")).split()
    assert row[1:4] == ["<", "1,000", f"{plan['epochs']:g}"] and row[4] == str(plan["effective_batch_size"])
    assert float(row[5]) == plan["lr"] and row[5:9] == ["5e-4", "2e-4", "2e-4", "1e-4"]  # tiny, small, medium, large


def test_train_shows_the_same_plan_before_training(tmp_path, tiny_models):
    result = invoke("train", str(DATA_FILES["alpaca"]), "--model", str(tiny_models["llama"]), "--max-steps", "1",
                    "--yes", "--output-dir", str(tmp_path), "--run-name", "r")
    assert result.exit_code == 0, result.output
    assert "Estimated peak memory" in result.output
    saved = json.loads((tmp_path / "r" / "plan.json").read_text())
    planned = json.loads(invoke("plan", str(DATA_FILES["alpaca"]), "--model", str(tiny_models["llama"]),
                                "--max-steps", "1", "--json").output)
    # Free RAM moves between the two calls, and with it the memory figures; the load, and with it the threads.
    def stable(plan: dict) -> dict:
        kept = {k: v for k, v in plan.items() if k not in ("estimated_seconds", "duration_parts", "memory", "cpu_threads")}
        kept["reasons"] = [r for r in plan["reasons"] if not r.startswith(("estimated", "threads"))]
        return kept

    assert stable(saved) == stable(planned)


def test_plan_for_several_processes_with_fsdp():
    mistral = "mistralai/Mistral-7B-Instruct-v0.3"
    common = ("plan", str(DATA_FILES["alpaca"]), "--model", mistral, "--vram", "80")
    result = invoke(*common, "--num-processes", "8", "--distributed", "fsdp", "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert (plan["method"], plan["distributed"], plan["world_size"]) == ("full", "fsdp", 8)
    assert plan["effective_batch_size"] == plan["micro_batch_size"] * plan["grad_accum"] * 8
    shown = flat(invoke(*common, "--num-processes", "8", "--distributed", "fsdp").output)
    assert "processes │ 8, FSDP" in shown and "per process x" in shown and "GPU: a 80 GB GPU, per process" in shown
    refused = invoke(*common, "--num-processes", "2", "--distributed", "fsdp", "--method", "lora")
    assert refused.exit_code == 2 and "--distributed ddp" in flat(refused.output)
    assert "Traceback" not in refused.output


def test_hardware_with_several_gpus_says_how_to_use_them(monkeypatch):
    from dataclasses import replace

    import llmcustoms.planning.hardware as hardware

    one = hardware.Hardware.with_gpu(80, name="H100")
    monkeypatch.setattr(hardware, "detect", lambda: replace(one, gpus=one.gpus * 4))
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # and a torch that can use them
    shown = flat(invoke("hardware").output)
    assert "GPUs 0-3" in shown and "4 x H100" in shown and "4 GPUs: the table is for one of them" in shown
    assert "--num-processes 4" in shown and "--distributed fsdp" in shown


@pytest.mark.parametrize("case, said", [
    ("data", "ambiguous_pairs.csv: cannot tell the data format from the fields found (query, prompt, response, answer)"),
    ("config", "Early stopping needs evaluation rows"),
    ("setting", "LLMCUSTOMS_LR"),
    ("fit", "does not fit in 2.0 GiB of GPU memory"),
])
def test_plan_json_prints_one_json_object_even_on_an_error(tmp_path, tiny_models, case, said):
    env_file = tmp_path / "bad.env"
    env_file.write_text("LLMCUSTOMS_LR=fast\n")
    args = {"data": [str(DATA_FILES["alpaca"].parent / "shapes" / "ambiguous_pairs.csv")],
            "config": [str(DATA_FILES["text"]), "--model", str(tiny_models["llama"]), "--eval-split", "0",
                       "--early-stopping-patience", "2"],
            "setting": [str(DATA_FILES["text"]), "--env-file", str(env_file)],
            "fit": [str(DATA_FILES["alpaca"]), "--model", "mistralai/Mistral-7B-Instruct-v0.3", "--vram", "2"]}[case]
    result = invoke("plan", *args, "--json")
    assert result.exit_code == 2
    printed = json.loads(result.stdout)  # the whole of stdout: one object
    assert list(printed) == ["error"] and sorted(printed["error"]) == ["exit_code", "hint", "message"]
    assert said in printed["error"]["message"] and printed["error"]["exit_code"] == 2
    assert said in flat(result.stderr)  # and the message for people, where it always goes
    assert "Traceback" not in result.output


# --- the suspicious-content check, through the real CLI (`plan` in a subprocess)

SHAPES = DATA_FILES["alpaca"].parent / "shapes"


def said(result) -> str:
    """stdout + stderr, whitespace collapsed so that Rich's wrapping cannot split a phrase."""
    return flat(result.stdout + "\n" + result.stderr)


def test_data_for_a_vision_model_is_refused_with_exit_2(cli, tiny_models):
    result = cli("plan", str(SHAPES / "multimodal.jsonl"), "--model", str(tiny_models["llama"]), "--json")
    out = said(result)
    assert result.returncode == 2, out
    assert ("multimodal.jsonl: 4 rows hold images, video or audio (field 'images', marker <image>: line 1, line 2, "
            "line 4, ...); llmcustoms trains text-only models.") in out
    assert "Vision and audio models are not supported" in out
    assert "Traceback" not in out and "mauve-periscope" not in out


def test_placeholders_warn_in_the_plan_and_strict_refuses_the_first(cli, tiny_models):
    data, model = str(SHAPES / "identity_placeholders.jsonl"), ("--model", str(tiny_models["llama"]))
    shown = cli("plan", data, *model)
    assert shown.returncode == 0, said(shown)
    assert ("Data: template placeholders never filled in ({{...}}): 10 rows (line 2, line 3, line 4, ...); fill them "
            "in or remove those rows") in said(shown)
    planned = cli("plan", data, *model, "--json")
    assert planned.returncode == 0, said(planned)
    report = json.loads(planned.stdout)["data_report"]
    assert report["suspicious"] == [{"kind": "placeholder", "rows": 10, "first_lines": ["line 2", "line 3", "line 4"],
                                     "what": ["{{...}}"], "finding": "template placeholders never filled in",
                                     "advice": report["suspicious"][0]["advice"]}]
    assert report["advice"][0].startswith("template placeholders never filled in")
    strict = cli("plan", data, *model, "--strict")
    assert strict.returncode == 2, said(strict)
    assert ("identity_placeholders.jsonl, line 2: a template placeholder ({{...}}) in a reply, never filled in."
            in said(strict))
    for result in (shown, planned, strict):
        assert "velvet-quasar" not in said(result) and "Traceback" not in said(result)


@pytest.mark.parametrize("name, kind, lines, secret", [
    ("echo_replies.jsonl", "echo_reply", ["line 4", "line 8", "line 9"], "amber-trellis"),
    ("blank_replies.jsonl", "blank_reply", ["line 3", "line 6", "line 10"], "copper-lagoon"),
])
def test_echoed_and_blank_replies_are_reported_by_count_and_line(cli, tiny_models, name, kind, lines, secret):
    planned = cli("plan", str(SHAPES / name), "--model", str(tiny_models["llama"]), "--json")
    assert planned.returncode == 0, said(planned)
    found = json.loads(planned.stdout)["data_report"]["suspicious"]
    assert [(f["kind"], f["rows"], f["first_lines"]) for f in found] == [(kind, 3, lines)]
    shown = cli("plan", str(SHAPES / name), "--model", str(tiny_models["llama"]))
    assert f"3 rows ({', '.join(lines)}); fix or remove those rows" in said(shown)
    assert secret not in said(planned) + said(shown)
