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

LAUNCH_OPTIONS = ("--num-processes", "--num-machines", "--machine-rank", "--main-process-ip", "--main-process-port")


def world_size() -> int:
    """Processes in this run, as the launcher (torchrun) says; 1 when not launched."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def inside_launch() -> bool:
    return "LOCAL_RANK" in os.environ and world_size() > 1


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


def relaunch(argv: list[str], processes: int, machines: int, machine_rank: int, main_ip: str | None,
             main_port: int | None) -> int:
    """Run `llmcustoms ARGV` under accelerate's launcher; returns its exit code.
    SIGINT and SIGTERM are passed on, so every process checkpoints once and stops."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
               "--num_processes", str(processes * machines), "--num_machines", str(machines),
               "--machine_rank", str(machine_rank), "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(main_port or _free_port())]
    if main_ip:
        command += ["--main_process_ip", main_ip]
    command += ["-m", "llmcustoms", *argv]
    child = subprocess.Popen(command)
    forwarded = {}

    def forward(signum: int, frame: object) -> None:
        child.send_signal(signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        forwarded[signum] = signal.signal(signum, forward)
    try:
        code = child.wait()
    finally:
        for signum, handler in forwarded.items():
            signal.signal(signum, handler)
    # torchrun reports a worker's exit status; pass on the meaningful ones.
    return code if code >= 0 else 128 - code
