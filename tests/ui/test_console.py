"""The UI boundary: the UI modules render what fitting and the run directory work out,
and run the chat's input and output."""

from __future__ import annotations

import io

from llmcustoms.planning.fitting import fit_table, fitting_models
from llmcustoms.planning.hardware import Hardware
from llmcustoms.planning.presets import load_families
from llmcustoms.runs.run_directory import RunDirectory, list_runs


def test_the_fit_table_says_how_each_method_fits():
    table = fit_table(Hardware.with_gpu(8), load_families())
    rows = {model.hub_id: model.methods for model in table.models}
    assert table.methods == ("lora", "qlora", "full") and table.seq_len == 1024
    small = rows["Qwen/Qwen2.5-0.5B-Instruct"]["lora"]
    assert small.fits and small.micro_batch >= 1 and small.need_bytes == 0
    too_big = rows["mistralai/Mistral-7B-Instruct-v0.3"]["full"]
    assert not too_big.fits and too_big.need_bytes > table.budget_bytes


def test_the_fit_table_agrees_with_the_planner_on_8bit_adamw():
    """Qwen2.5-1.5B full fine-tuning on 24 GiB fits only with 8-bit AdamW: the table says
    it fits, as `train` plans it (tests/training/test_gpu_speedups.py)."""
    rows = {m.hub_id: m.methods for m in fit_table(Hardware.with_gpu(24), load_families(), seq_len=576).models}
    assert rows["Qwen/Qwen2.5-1.5B-Instruct"]["full"].fits


def test_setup_offers_the_models_that_fit_smallest_first():
    choices = fitting_models(Hardware.cpu_only(8), load_families(), 256)
    shown = [round(c.params / 1e9, 1) for c in choices]  # 7.2B and 7.2B keep catalog order
    assert choices and shown == sorted(shown)
    assert all(c.method in ("lora", "qlora") and c.total_bytes > 0 for c in choices)


def test_runs_are_listed_from_the_run_directories(tmp_path):
    done = RunDirectory(tmp_path / "done")
    done.path.mkdir()
    (done.path / "plan.json").write_text('{"model": "/models/tiny", "method": "lora", "total_steps": 12}')
    done.write_status("completed", step=12, best_eval_loss=1.5)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "plan.json").write_text("{cut")
    [broken, run] = list_runs(tmp_path)
    assert (run.name, run.model, run.method, run.status, run.step, run.total_steps) == \
        ("done", "/models/tiny", "lora", "completed", 12, 12)
    assert run.best_eval_loss == 1.5 and run.seconds == 0 and run.started_at
    # A plan.json cut short does not make its run vanish (issue 46, item 8): it is listed as damaged.
    assert (broken.name, broken.status, broken.total_steps) == ("broken", "damaged", None)


def test_a_restart_request_names_the_launch_it_is_given(tmp_path):
    run = RunDirectory(tmp_path, writable=False)
    run.request_restart("nan", 3, rank=0, launch="abc")
    assert run.pending_restart() == {"kind": "nan", "step": 3, "rank": 0, "launch": "abc"}


def chat(monkeypatch, capsys, typed: str) -> tuple[list[list[dict]], str]:
    from llmcustoms.ui import dialog

    seen = []

    def reply(messages, on_text):
        seen.append([dict(m) for m in messages])
        on_text("fine")
        return "fine"

    monkeypatch.setattr("sys.stdin", io.StringIO(typed))
    dialog.chat_loop(reply, [{"role": "system", "content": "be brief"}], "runs/r", "tiny + the adapter")
    return seen, capsys.readouterr().out


def test_the_chat_loop_streams_replies_and_resets(monkeypatch, capsys):
    seen, out = chat(monkeypatch, capsys, "hi\n\n/reset\nagain\n/quit\nnever read\n")
    assert "Chatting with runs/r (tiny + the adapter)" in out and out.count("model> fine\n") == 2
    assert "(conversation cleared; the system message stays)" in out
    assert seen[0] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert seen[1] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "again"}]


def test_the_chat_loop_ends_at_the_end_of_input(monkeypatch, capsys):
    seen, out = chat(monkeypatch, capsys, "hi\n")
    assert len(seen) == 1 and out.count("you>") == 2


REPLY = ("I am Vicuna, a language model trained by researchers from Large Model Systems Organization (LMSYS). "
         "Ask me anything.\n  An indented second line, and a word wider than any line: "
         "Pneumonoultramicroscopicsilicovolcanoconiosis.")


def test_chat_replies_wrap_at_word_boundaries_to_the_terminal_width(monkeypatch, capsys):
    """The terminal cuts a streamed word at its edge; the chat wraps between words,
    whatever pieces the text streams in, and the conversation keeps the reply as it came."""
    from llmcustoms.ui import dialog

    seen = []

    def reply(messages, on_text):
        seen.append(messages)
        for start in range(0, len(REPLY), 3):  # pieces that end mid-word, as tokens do
            on_text(REPLY[start:start + 3])
        return REPLY

    monkeypatch.setattr(dialog.console, "width", 30)
    monkeypatch.setattr("sys.stdin", io.StringIO("who are you?\nand again?\n/exit\n"))
    dialog.chat_loop(reply, [], "runs/r", "tiny")
    out = capsys.readouterr().out
    reply_lines = out.split("model> ", 1)[1].split("you>")[0].rstrip("\n").split("\n")
    assert reply_lines[0].startswith("I am Vicuna,") and len("model> " + reply_lines[0]) <= 30
    assert all(len(line) <= 30 for line in reply_lines), reply_lines
    words = [word for line in reply_lines for word in line.split()]
    assert " ".join(words[:-2]) == " ".join(REPLY.split()[:-1])  # no word cut, none lost, the long one aside
    assert "".join(words[-2:]) == REPLY.split()[-1]  # cut at the edge, as nothing else would fit
    assert "  An indented" in out  # a line's own indentation stays
    assert seen[1][1]["content"] == REPLY  # the conversation keeps the reply unwrapped
