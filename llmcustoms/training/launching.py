"""Past one process: `--num-processes N` relaunches the command through
accelerate's launcher (`accelerate launch --multi_gpu ...`), which starts one
process per GPU (per CPU process with gloo on a machine without GPUs), on one
machine or several (`--num-machines`, `--machine-rank`, `--main-process-ip`,
`--main-process-port`). `accelerate launch -m llmcustoms train ...` works too:
a command already inside a launch is not relaunched.

Nothing here imports torch: the parent process only checks and relaunches.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

LAUNCH_OPTIONS = ("--num-processes", "--num-machines", "--machine-rank", "--main-process-ip", "--main-process-port")


def world_size() -> int:
    """Processes in this run, as the launcher (torchrun) says; 1 when not launched."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def inside_launch() -> bool:
    return "LOCAL_RANK" in os.environ and world_size() > 1


# The exit code of a process that asked for a restart of all of them.
EXIT_RESTART = 75
# Set for the processes `relaunch` starts: it restarts them when one asks.
RESTARTS_ENV = "LLMCUSTOMS_RESTARTS_ON_REQUEST"


def restarts_on_request() -> bool:
    return bool(launch_token())


def launch_token() -> str | None:
    """Which start of the processes by `relaunch` this is; None outside one.
    A restart request names it, so a launcher acts only on requests of the
    processes it started, never on an old file."""
    return os.environ.get(RESTARTS_ENV) or None


def resume_hint(run_dir: Path) -> str:
    """The command that continues this distributed run, with its launch options."""
    per_machine = int(os.environ.get("LOCAL_WORLD_SIZE", world_size()))
    machines = max(1, world_size() // max(1, per_machine))
    hint = f"llmcustoms resume {run_dir} --num-processes {per_machine}"
    if machines > 1:
        hint += f" --num-machines {machines} (on every machine, with its --machine-rank and the main process's address)"
    return hint


def process_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def strip_launch_options(argv: list[str]) -> list[str]:
    """The command line without the launch options (each with its value)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in LAUNCH_OPTIONS:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Restarts after a process asked for one (an out-of-memory error inside FSDP's
# collectives). Recovery shrinks the plan each time (micro-batch, then
# checkpointing, then sequence length), so this many cover the whole ladder.
MAX_RESTARTS = 16


def relaunch(argv: list[str], processes: int, machines: int, machine_rank: int, main_ip: str | None,
             main_port: int | None, run_dir: Path | None = None, resume_options: list[str] | None = None) -> int:
    """Run `llmcustoms ARGV` under accelerate's launcher; returns its exit code.
    SIGINT and SIGTERM are passed on, so every process checkpoints once and stops.

    When a process of the run in `run_dir` leaves a restart request (see
    `RunDirectory.request_restart`), every process is started again with
    `llmcustoms resume RUN_DIR RESUME_OPTIONS`: the resumed run applies the
    recovery first, then continues from the last checkpoint. On one machine
    only: with several, each machine's launcher would have to restart in step
    with the others; the failing process says to resume on every machine."""
    if machines > 1:
        run_dir = None
    port = main_port or _free_port()
    token = uuid.uuid4().hex[:12]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
               "--num_processes", str(processes * machines), "--num_machines", str(machines),
               "--machine_rank", str(machine_rank), "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(port)]
    if main_ip:
        command += ["--main_process_ip", main_ip]
    child: list[subprocess.Popen] = []
    signalled: list[int] = []

    def forward(signum: int, frame: object) -> None:
        signalled.append(signum)  # the user wants it to stop: no restart after this
        if child:
            child[-1].send_signal(signum)

    def start(arguments: list[str], attempt: int) -> int:
        env = {**os.environ, RESTARTS_ENV: f"{token}-{attempt}" if run_dir is not None else ""}
        child.append(subprocess.Popen(command + ["-m", "llmcustoms", *arguments], env=env))
        return child[-1].wait()

    forwarded = {signum: signal.signal(signum, forward) for signum in (signal.SIGINT, signal.SIGTERM,
                                                                        signal.SIGHUP)}
    try:
        code = start(argv, 0)
        resume = ["resume", str(run_dir), *(resume_options or [])]
        for attempt in range(1, MAX_RESTARTS + 2):
            request = _restart_request(run_dir) if code != 0 and not signalled else None
            if request is None or request.get("launch") != f"{token}-{attempt - 1}":
                break  # finished, stopped, or failed without asking for a restart
            if attempt > MAX_RESTARTS:
                print(f"llmcustoms: {MAX_RESTARTS} restarts did not get past the failures; stopping. "
                      f"Continue with: llmcustoms {' '.join(resume)}", file=sys.stderr)
                break
            print(f"llmcustoms: process {request.get('rank')} failed ({request.get('kind')} at step "
                  f"{request.get('step')}); restarting every process from the last checkpoint", file=sys.stderr)
            code = start(resume, attempt)
    finally:
        for signum, handler in forwarded.items():
            signal.signal(signum, handler)
    # torchrun reports a worker's exit status; pass on the meaningful ones.
    return code if code >= 0 else 128 - code


def _restart_request(run_dir: Path | None) -> dict | None:
    from llmcustoms.runs.run_directory import RunDirectory

    return RunDirectory(run_dir).pending_restart() if run_dir is not None else None
