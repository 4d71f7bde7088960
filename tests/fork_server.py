"""A fork server for the CLI tests: `python -m llmcustoms ARGS` without paying the imports each time.

A CLI subprocess spends most of its start importing torch, transformers and peft
(about 6-8 s a command on the reference machine, 2 cores). This server imports them
once, then forks a child per command: the child is a real process of its own (its
own pid, exit code, signal handlers, stdin, stdout and stderr, working directory and
environment), started from a process that has the libraries loaded already.

    server = ForkServer.start()            # once per test session (one per xdist worker)
    result = server.run(["train", ...], env=..., cwd=..., input=..., timeout=300)
    # -> subprocess.CompletedProcess, or None when the command must run as a real subprocess

A command runs as a real subprocess instead (`run` returns None) when its
environment differs from the server's in a variable a library reads when it is
imported (anything but LLMCUSTOMS_*, COLUMNS, LINES, HF_TOKEN and the test runner's
own): a forked child would see the server's value. Tests that signal a process,
start several or need a terminal keep `subprocess` themselves.

The server never runs torch work before forking (OpenMP's threads do not survive a
fork) and handles one command at a time; a client that times out kills the child.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Imported once, before any fork: what a CLI command spends its start on.
PRELOADED = ("numpy", "torch", "transformers", "peft", "accelerate", "safetensors", "yaml", "typer", "rich",
             "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
             "transformers.models.mistral.modeling_mistral", "transformers.models.phi3.modeling_phi3",
             "transformers.models.phi.modeling_phi", "transformers.models.qwen3.modeling_qwen3",
             "transformers.optimization", "peft.tuners.lora", "accelerate.utils")
# Variables a forked child may see changed: read when used, not when a library is imported.
PER_COMMAND = ("LLMCUSTOMS_", "COLUMNS", "LINES", "HF_TOKEN", "PYTEST_", "NO_COLOR", "FORCE_COLOR", "TERM")


def _differs_at_import(env: dict[str, str], base: dict[str, str]) -> list[str]:
    keys = set(env) | set(base)
    return sorted(k for k in keys if env.get(k) != base.get(k) and not k.startswith(PER_COMMAND))


class ForkServer:
    def __init__(self, process: subprocess.Popen, address: str, env: dict[str, str]):
        self.process, self.address, self.env = process, address, env

    @classmethod
    def start(cls, env: dict[str, str] | None = None) -> "ForkServer":
        env = dict(os.environ if env is None else env)
        # /tmp: a socket's path must stay under about 100 bytes, which a long TMPDIR may not.
        address = tempfile.mktemp(prefix="llmcustoms-fork-", suffix=".sock", dir="/tmp" if os.path.isdir("/tmp") else None)
        process = subprocess.Popen([sys.executable, __file__, address], env=env, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while not os.path.exists(address):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the fork server did not start")
            time.sleep(0.05)
        server = cls(process, address, env)
        atexit.register(server.stop)
        return server

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(30)
        Path(self.address).unlink(missing_ok=True)

    def run(self, args: list[str], env: dict[str, str], cwd: Path | str | None = None, input: str | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess | None:
        """`python -m llmcustoms ARGS` in a forked child; None when it must be a real subprocess."""
        if self.process.poll() is not None or _differs_at_import(env, self.env):
            return None
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, tempfile.TemporaryFile() as stdin:
            stdin.write((input or "").encode())
            stdin.seek(0)
            request = json.dumps({"args": args, "env": env, "cwd": str(cwd or os.getcwd())}).encode()
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
                connection.connect(self.address)
                socket.send_fds(connection, [struct.pack("!I", len(request)) + request],
                                [stdin.fileno(), out.fileno(), err.fileno()])
                connection.settimeout(timeout + 30)
                pid = struct.unpack("!i", _exactly(connection, 4))[0]
                connection.settimeout(timeout)
                try:
                    returncode = struct.unpack("!i", _exactly(connection, 4))[0]
                except (TimeoutError, socket.timeout):
                    os.kill(pid, signal.SIGKILL)
                    raise subprocess.TimeoutExpired(["llmcustoms", *args], timeout) from None
            out.seek(0), err.seek(0)
            return subprocess.CompletedProcess([sys.executable, "-m", "llmcustoms", *args], returncode,
                                               out.read().decode(errors="replace"), err.read().decode(errors="replace"))


def _exactly(connection: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the fork server closed the connection")
        data += chunk
    return data


def _child(request: dict, fds: list[int]) -> None:
    """In the forked child: become `python -m llmcustoms ARGS` and never return."""
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        sys.argv = [sys.executable, *request["args"]]
        sys.path[0] = request["cwd"]  # as `python -m` puts the working directory first
        import runpy

        try:
            runpy.run_module("llmcustoms", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as ending:
            code = ending.code if isinstance(ending.code, int) else (0 if ending.code is None else 1)
            if ending.code is not None and not isinstance(ending.code, int):
                print(ending.code, file=sys.stderr)
        except KeyboardInterrupt:
            code = 130
        except BaseException:  # noqa: BLE001 - as Python itself: the traceback, exit 1
            import traceback

            traceback.print_exc()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream: nothing more to say
                pass
        os._exit(code)


def serve(address: str) -> None:
    import importlib

    for name in PRELOADED:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    sys.stdout.flush(), sys.stderr.flush()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address + ".tmp")
    listener.listen(8)
    os.rename(address + ".tmp", address)  # the client waits for the name: it appears when the server listens
    parent = os.getppid()
    listener.settimeout(10)
    while True:
        try:
            connection, _ = listener.accept()
        except (TimeoutError, socket.timeout):
            if os.getppid() != parent:  # the test process is gone (killed, not stopped): so is its server
                Path(address).unlink(missing_ok=True)
                return
            continue
        connection.settimeout(None)
        with connection:
            message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
            size = struct.unpack("!I", message[:4])[0]
            body = message[4:]
            while len(body) < size:
                body += connection.recv(size - len(body))
            pid = os.fork()
            if pid == 0:
                listener.close()
                connection.close()
                _child(json.loads(body), fds)
            for fd in fds:
                os.close(fd)
            connection.sendall(struct.pack("!i", pid))
            _, status = os.waitpid(pid, 0)
            returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            try:
                connection.sendall(struct.pack("!i", returncode))
            except OSError:  # the client gave up (a timeout): it killed the child
                pass


if __name__ == "__main__":
    serve(sys.argv[1])
