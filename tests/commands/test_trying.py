"""Trying a run's model: `generate` and `chat` on a run that has not finished
(--checkpoint), the chat loop's Ctrl-C and /reset, and waits shown on stderr."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch
from typer.testing import CliRunner

from conftest import DATA_FILES
from llmcustoms.ui import dialog
from llmcustoms.cli import app
from llmcustoms.errors import ConfigError
from llmcustoms.models.generation import generate, load_trained
from llmcustoms.runs.run_directory import RunDirectory
from llmcustoms.runs.run_weights import choose_weights
from tiny_models import WIDE

runner = CliRunner()
PROMPT = "What do bees make?"


def invoke(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False, env={"COLUMNS": WIDE})


@pytest.fixture(scope="module")
def finished(tiny_models, tmp_path_factory):
    """A finished run of the tiny Llama with a checkpoint every 2 steps, all kept."""
    root = tmp_path_factory.mktemp("trying")
    result = invoke("train", str(DATA_FILES["alpaca"]), "--model", str(tiny_models["llama"]), "--max-steps", "8",
                    "--save-every", "2", "--keep", "10", "--eval-every", "3", "--lr", "1e-2", "--yes", "--quiet",
                    "--output-dir", str(root), "--run-name", "done")
    assert result.exit_code == 0, result.output
    return root / "done"


@pytest.fixture(scope="module")
def unfinished(finished):
    """The same run as an interruption after step 8 leaves it: checkpoints and
    best/, no adapter/ yet."""
    run = finished.parent / "unfinished"
    shutil.copytree(finished, run, ignore=shutil.ignore_patterns("adapter", "adapter-last"))
    RunDirectory(run).write_status("interrupted", reason="stopped by SIGINT")
    return run


@pytest.fixture
def on_cpu(monkeypatch):
    """Load in float32 on the CPU, as the weights compared with were: on a GPU,
    `generate` would load in 16 bits."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def last_step_adapter(finished):
    """The directory `save_pretrained` wrote the last step's (step 8's) adapter to."""
    return finished / (json.loads((finished / "status.json").read_text()).get("last_output") or "adapter")


def step_8_file(run):
    return run / "checkpoints" / "step-000008" / "model.safetensors"


def logits(model, tokenizer):
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return model(ids).logits


def test_an_unfinished_run_is_refused_at_once_naming_its_checkpoints(unfinished):
    code = ("import sys\nfrom llmcustoms import cli\n"
            f"sys.argv = ['llmcustoms', 'generate', {str(unfinished)!r}, 'hi']\n"
            "try:\n    cli.main()\nexcept SystemExit as end:\n    code = end.code\n"
            "print('loaded:', [m for m in ('torch', 'transformers', 'peft') if m in sys.modules], code)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "COLUMNS": WIDE})
    assert result.stdout.strip() == "loaded: [] 2", result.stdout + result.stderr
    message = " ".join(result.stderr.split())
    assert "has no trained adapter yet: it was interrupted at step 8 of 8" in message
    assert "Its checkpoints: step-2, step-4, step-6, step-8; best evaluation: step" in message
    assert "To try its newest checkpoint, add --checkpoint latest" in message
    assert "Traceback" not in result.stderr


def test_a_checkpoint_holds_the_weights_of_its_step(finished, unfinished, tiny_models, on_cpu):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    step_8 = load_trained(choose_weights(RunDirectory(unfinished), "step-8"))
    assert "checkpoint step-8" in step_8.description
    # The same step's weights, as `save_pretrained` wrote them and PEFT reads them.
    base = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32)
    saved = PeftModel.from_pretrained(base, last_step_adapter(finished)).eval()
    assert torch.allclose(logits(step_8.model, step_8.tokenizer), logits(saved, step_8.tokenizer), atol=1e-5)
    step_2 = load_trained(choose_weights(RunDirectory(unfinished), "step-2"))
    assert not torch.allclose(logits(step_2.model, step_2.tokenizer), logits(saved, step_2.tokenizer), atol=1e-3)
    # `latest` is step 8; `best` the best evaluation's weights, which the finished run kept as adapter/.
    assert choose_weights(RunDirectory(unfinished), "latest").tensors == step_8_file(unfinished)
    best = load_trained(choose_weights(RunDirectory(unfinished), "best"))
    kept = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32),
                                     finished / "adapter").eval()
    assert torch.allclose(logits(best.model, best.tokenizer), logits(kept, best.tokenizer), atol=1e-5)


def test_generate_with_a_checkpoint_replies_as_those_weights_do(finished, unfinished, tiny_models, on_cpu):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = invoke("generate", str(unfinished), PROMPT, "--checkpoint", "step-8", "--temperature", "0",
                    "--max-new-tokens", "12")
    assert result.exit_code == 0, result.output
    adapter = last_step_adapter(finished)
    base = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter).eval()
    plan = RunDirectory(finished).read_plan()
    expected = generate(model, AutoTokenizer.from_pretrained(adapter), plan, [{"role": "user", "content": PROMPT}],
                        12, 0.0)
    assert expected and result.stdout.strip() == expected
    # The reply alone on stdout; what was loaded, and how long it took, on stderr.
    assert "Loading tiny-llama + checkpoint step-8" in result.stderr and "done in" in result.stderr
    assert "Loading" not in result.stdout


@pytest.mark.parametrize("checkpoint,problem", [("step-5", "has no checkpoint of step 5"),
                                                ("newest", "--checkpoint newest is not one of latest, best or step-N")])
def test_a_checkpoint_that_is_not_there_is_one_message_naming_those_that_are(unfinished, checkpoint, problem):
    result = invoke("chat", str(unfinished), "--checkpoint", checkpoint)
    assert result.exit_code == 2
    message = " ".join(result.stderr.split())
    assert problem in message and "Its checkpoints: step-2, step-4, step-6, step-8" in message
    assert message.count("Error:") == 1 and "Traceback" not in result.output


def test_latest_skips_a_damaged_checkpoint_and_says_so(unfinished, tmp_path):
    run = tmp_path / "damaged"
    shutil.copytree(unfinished, run)
    with open(step_8_file(run), "r+b") as weights:
        weights.truncate(100)
    warnings = []
    chosen = choose_weights(RunDirectory(run), "latest", warn=warnings.append)
    assert chosen.label == "checkpoint step-6" and "step-000008 is unusable" in warnings[0]
    with pytest.raises(ConfigError, match="step-8 .* is unusable"):
        choose_weights(RunDirectory(run), "step-8")


def test_a_finished_run_still_loads_its_adapter_by_default(finished):
    assert choose_weights(RunDirectory(finished), None).directory == finished / "adapter"
    assert choose_weights(RunDirectory(finished), "best").directory == finished / "adapter"


def test_a_damaged_adapter_is_refused_offering_the_checkpoints(finished, tmp_path):
    """adapter_config.json's rank is not the weights' (issue 46, item 7): peft's size-mismatch
    traceback before; now one message, and generate can still try the checkpoints."""
    run = tmp_path / "damaged-adapter"
    shutil.copytree(finished, run)
    config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    (run / "adapter" / "adapter_config.json").write_text(json.dumps({**config, "r": config["r"] * 2}))
    with pytest.raises(ConfigError) as refused:
        choose_weights(RunDirectory(run), None)
    assert refused.value.message.startswith("The run's adapter is damaged (adapter_config.json says rank")
    assert "step-8" in refused.value.hint and "--checkpoint latest" in refused.value.hint
    assert choose_weights(RunDirectory(run), "latest").label == "checkpoint step-8"
    result = runner.invoke(app, ["export", str(run), "--output", str(tmp_path / "out")], env={"COLUMNS": WIDE})
    assert result.exit_code == 2 and "adapter is damaged" in result.output and not (tmp_path / "out").exists()


def test_a_run_being_rewritten_says_so_not_to_convert_a_pickle(finished, tmp_path):
    """`generate` while `train --overwrite` rewrites the run: its adapter is missing for now.
    It advised converting a pickle adapter there was none of (issue 46, 19a)."""
    from llmcustoms.errors import LlmcustomsError
    from llmcustoms.models.generation import open_trained
    from llmcustoms.runs import run_lock

    run = tmp_path / "rewritten"
    shutil.copytree(finished, run)
    (run / "adapter" / "adapter_model.safetensors").unlink()
    waiting = lambda what: pytest.fail("nothing is loaded")  # noqa: E731
    with pytest.raises(LlmcustomsError) as missing:
        open_trained(run, None, waiting, print)
    assert "its weights are missing" in missing.value.message and "Convert" not in missing.value.hint
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom llmcustoms.runs import run_lock\n"
                               "with run_lock.owning(sys.argv[1], 'training it'):\n    print(flush=True)\n"
                               "    time.sleep(60)", str(run)], stdout=subprocess.PIPE, text=True)
    try:
        holder.stdout.readline()  # it holds the lock now
        with pytest.raises(ConfigError) as busy:
            open_trained(run, None, waiting, print)
        assert "is being trained or rewritten right now" in busy.value.message
        assert busy.value.hint.startswith("Wait for it to finish") and "Convert" not in busy.value.hint
    finally:
        holder.kill()
        holder.wait()
    assert run_lock.holder(run) is None


# ------------------------------------------------------------ the chat loop

def typed(monkeypatch, *lines: str) -> None:
    """The user types `lines` at the chat's prompts (then Ctrl-D)."""
    answers = iter(lines)

    def read(prompt: str = "") -> str:
        try:
            return next(answers)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(dialog.console, "input", read)


def chat(reply, start=()) -> None:
    try:
        dialog.chat_loop(reply, list(start), "runs/x", "tiny + the adapter")
    except KeyboardInterrupt:  # would end the whole test session
        pytest.fail("Ctrl-C ended the chat")


class Model:
    """A reply function: streams its `replies` word by word; `stop_after` words
    into a reply, raises KeyboardInterrupt, as Ctrl-C during generation does."""

    def __init__(self, replies: list[str], stop_after: dict[int, int]):
        self.replies, self.stop_after, self.seen = replies, stop_after, []

    def __call__(self, messages, on_text):
        call = len(self.seen)
        self.seen.append([dict(m) for m in messages])
        words = self.replies[call].split(" ")
        for index, word in enumerate(words):
            if self.stop_after.get(call) == index:
                raise KeyboardInterrupt
            on_text(word + " ")
        return self.replies[call]


def test_ctrl_c_during_a_reply_stops_it_and_the_chat_goes_on(monkeypatch, capsys):
    typed(monkeypatch, PROMPT, "And wasps?", "/exit")
    model = Model(["Bees make honey and wax.", "Wasps make paper nests."], stop_after={0: 2})
    chat(model)
    # The reply stopped after two words; those stay in the conversation, as on the screen.
    assert model.seen[1] == [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "Bees make"},
                             {"role": "user", "content": "And wasps?"}]
    shown = capsys.readouterr().out
    assert re.search(r"Bees make\s*\n\(stopped; the reply so far stays in the conversation\)", shown), shown
    assert "Wasps make paper nests." in shown


def test_ctrl_c_before_any_word_drops_the_unanswered_message(monkeypatch, capsys):
    typed(monkeypatch, PROMPT, "And wasps?")
    model = Model(["Bees make honey.", "Paper nests."], stop_after={0: 0})
    chat(model, [{"role": "system", "content": "Be brief."}])
    assert model.seen[1] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "And wasps?"}]
    assert "(stopped; your message is left out of the conversation)" in capsys.readouterr().out


def test_a_message_that_is_not_utf8_is_said_and_not_sent(monkeypatch, capsys):
    """A Latin-1 terminal's b"caf\\xe9": lone surrogates (surrogateescape), or a strict UTF-8 stdin's
    UnicodeDecodeError; either is said, never sent, and the chat goes on (issue 46, 11)."""
    lines = iter(["caf\udce9", UnicodeDecodeError("utf-8", b"\xe9", 0, 1, "invalid"), PROMPT, "/exit"])

    def read(prompt: str = "") -> str:
        line = next(lines)
        if isinstance(line, Exception):
            raise line
        return line

    monkeypatch.setattr(dialog.console, "input", read)
    model = Model(["Honey."], stop_after={})
    chat(model)
    assert model.seen == [[{"role": "user", "content": PROMPT}]]
    assert flat(capsys.readouterr().out).count("is not UTF-8 text, so it was not sent: set your terminal to UTF-8") == 2


def test_a_setup_answer_a_strict_stdin_cannot_decode_is_asked_again(monkeypatch, capsys):
    answers = iter([UnicodeDecodeError("utf-8", b"\xe9", 0, 1, "invalid"), "runs"])

    def prompt(*args, **kwargs) -> str:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(dialog.Prompt, "ask", prompt)
    assert dialog.ask("Where to put runs", "runs") == "runs"
    assert "What you typed is not UTF-8 text: set your terminal to UTF-8" in flat(capsys.readouterr().out)


@pytest.mark.parametrize("argv", [["hi", "--system", "caf\udce9"], ["caf\udce9"], ["--prompt", "caf\udce9"]])
def test_a_prompt_that_is_not_utf8_is_refused_before_anything_loads(argv, tmp_path):
    """`generate runs/x $'caf\\xe9'`: the argument reaches Python as lone surrogates (issue 46, 11)."""
    command = "chat" if "--system" in argv else "generate"
    result = runner.invoke(app, [command, str(tmp_path), *[a for a in argv if command == "generate" or a != "hi"]],
                           env={"COLUMNS": WIDE})
    assert result.exit_code == 2 and "is not UTF-8 text: set your terminal to UTF-8" in flat(result.output), result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def flat(text: str) -> str:
    return " ".join(text.split())


def test_reset_says_so_and_ctrl_c_at_the_prompt_ends_the_chat(monkeypatch, capsys):
    answers = iter([PROMPT, "/reset", "Hello?"])

    def read(prompt: str = "") -> str:
        for answer in answers:
            return answer
        raise KeyboardInterrupt  # Ctrl-C at the prompt

    monkeypatch.setattr(dialog.console, "input", read)
    model = Model(["Honey.", "Hi."], stop_after={})
    chat(model)
    assert "(conversation cleared)" in capsys.readouterr().out
    assert model.seen[1] == [{"role": "user", "content": "Hello?"}]


def test_keys_typed_during_a_reply_are_not_echoed_into_it_and_are_dropped_after():
    import pty
    import termios

    from llmcustoms.ui.dialog import typing_held

    keyboard, terminal = pty.openpty()
    try:
        assert termios.tcgetattr(terminal)[3] & termios.ECHO
        with typing_held(terminal) as dropped:
            assert not termios.tcgetattr(terminal)[3] & termios.ECHO  # typed keys do not land in the reply
            os.write(keyboard, b"next question\n")
            time.sleep(0.1)
        assert dropped == [True]
        assert termios.tcgetattr(terminal)[3] & termios.ECHO  # echo is back for the prompt
        with typing_held(terminal) as dropped:  # the dropped line is not read as the next message
            pass
        assert dropped == []
    finally:
        os.close(keyboard)
        os.close(terminal)


def test_holding_keys_changes_nothing_when_input_is_not_a_terminal(tmp_path):
    from llmcustoms.ui.dialog import typing_held

    with open(tmp_path / "typed", "w+") as file, typing_held(file.fileno()) as dropped:
        pass
    assert dropped == []
