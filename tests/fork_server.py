"""A fork server for the CLI tests: `python -m llmcustoms ARGS` without paying the imports each time.

A CLI subprocess spends most of its start importing torch, transformers and peft
(about 6-8 s a command on the reference machine, 2 cores). This server imports them
once, then forks a child per command: the child is a real process of its own (its
own pid, exit code, signal handlers, stdin, stdout and stderr, working directory and
environment), started from a process that has the libraries loaded already.

    server = ForkServer.start()            # once per test session (one per xdist worker)
    result = server.run(["train", ...], env=..., cwd=..., input=..., timeout=300)
    # -> subprocess.CompletedProcess, or None when the command must run as a real subprocess
    process = server.popen(["train", ...], env=..., stdout=subprocess.PIPE, text=True)
    # -> a ForkedProcess (poll, wait, send_signal, communicate as subprocess.Popen), or None

A command runs as a real subprocess instead (`run` returns None) when its
environment differs from the server's in a variable a library reads when it is
imported (anything but LLMCUSTOMS_*, COLUMNS, LINES, HF_TOKEN and the test runner's
own): a forked child would see the server's value. Children run side by side (a test
may start two and signal one); tests that need a terminal keep `subprocess`.

The server never runs torch work before forking (OpenMP's threads do not survive a
fork); a client that times out kills the child.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# Imported once, before any fork: what a CLI command spends its start on.
PRELOADED = ("numpy", "torch", "transformers", "peft", "accelerate", "safetensors", "yaml", "typer", "rich",
             "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
             "transformers.models.mistral.modeling_mistral", "transformers.models.phi3.modeling_phi3",
             "transformers.models.phi.modeling_phi", "transformers.models.qwen3.modeling_qwen3",
             "transformers.optimization", "peft.tuners.lora", "accelerate.utils")
# Variables a forked child may see changed: read when used, not when a library is imported.
# TORCHINDUCTOR_CACHE_DIR: torch sets it in the test process the first time inductor looks for its cache.
PER_COMMAND = ("LLMCUSTOMS_", "COLUMNS", "LINES", "HF_TOKEN", "PYTEST_", "NO_COLOR", "FORCE_COLOR", "TERM",
               "TORCHINDUCTOR_CACHE_DIR")


def differs_at_import(env: dict[str, str], base: dict[str, str]) -> list[str]:
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

    def _send(self, args: list[str], env: dict[str, str], cwd: Path | str | None, fds: list[int],
              timeout: float, new_session: bool = False) -> tuple[socket.socket, int]:
        """Asks for a child with these stdin, stdout and stderr: its connection and pid."""
        request = json.dumps({"args": args, "env": env, "cwd": str(cwd or os.getcwd()), "session": new_session}).encode()
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.connect(self.address)
            socket.send_fds(connection, [struct.pack("!I", len(request)) + request], fds)
            connection.settimeout(timeout)
            return connection, struct.unpack("!i", _exactly(connection, 4))[0]
        except BaseException:
            connection.close()
            raise

    def run(self, args: list[str], env: dict[str, str], cwd: Path | str | None = None, input: str | None = None,
            timeout: float = 300, errors: str = "replace") -> subprocess.CompletedProcess | None:
        """`python -m llmcustoms ARGS` in a forked child; None when it must be a real subprocess.
        `errors`: how text that is not UTF-8 is encoded into stdin and decoded from the output."""
        if self.process.poll() is not None or differs_at_import(env, self.env):
            return None
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, tempfile.TemporaryFile() as stdin:
            stdin.write((input or "").encode(errors=errors))
            stdin.seek(0)
            connection, pid = self._send(args, env, cwd, [stdin.fileno(), out.fileno(), err.fileno()], timeout + 30)
            with connection:
                connection.settimeout(timeout)
                try:
                    returncode = struct.unpack("!i", _exactly(connection, 4))[0]
                except (TimeoutError, socket.timeout):
                    os.kill(pid, signal.SIGKILL)
                    raise subprocess.TimeoutExpired(["llmcustoms", *args], timeout) from None
            out.seek(0), err.seek(0)
            return subprocess.CompletedProcess([sys.executable, "-m", "llmcustoms", *args], returncode,
                                               out.read().decode(errors=errors), err.read().decode(errors=errors))

    def popen(self, args: list[str], env: dict[str, str], cwd: Path | str | None = None, stdout: int | None = None,
              stderr: int | None = None, text: bool = False, stdin: int | None = None,
              new_session: bool = False) -> "ForkedProcess | None":
        """`python -m llmcustoms ARGS` started in a forked child, as `subprocess.Popen` starts it
        (stdout/stderr: PIPE, DEVNULL, STDOUT for stderr, a file descriptor, or None to share this
        process's; stdin: a file descriptor, else empty; new_session: as start_new_session).
        None when it must be a real subprocess."""
        if self.process.poll() is not None or differs_at_import(env, self.env):
            return None
        opened: list[int] = [os.dup(stdin) if stdin is not None else os.open(os.devnull, os.O_RDONLY)]
        mine: list[int | None] = []  # this side's ends of the pipes (opened: the child's, closed once passed on)
        for stream, inherited in ((stdout, 1), (stderr, 2)):
            if stream == subprocess.PIPE:
                read, write = os.pipe()
                opened.append(write)
                mine.append(read)
            elif stream == subprocess.STDOUT:
                opened.append(os.dup(opened[1]))
                mine.append(None)
            elif stream == subprocess.DEVNULL:
                opened.append(os.open(os.devnull, os.O_WRONLY))
                mine.append(None)
            else:
                opened.append(os.dup(inherited if stream is None else stream))
                mine.append(None)
        try:
            connection, pid = self._send(args, env, cwd, opened, 60, new_session)
        finally:
            for fd in opened:
                os.close(fd)
        files = [None if fd is None else open(fd, "r" if text else "rb") for fd in mine]
        return ForkedProcess([sys.executable, "-m", "llmcustoms", *args], pid, connection, *files)


class ForkedProcess:
    """A forked command, as much of `subprocess.Popen` as the tests use: its exit code comes
    from the server (the child is the server's, not this process's)."""

    def __init__(self, args: list[str], pid: int, connection: socket.socket, stdout, stderr):
        self.args, self.pid, self.stdout, self.stderr, self.stdin = args, pid, stdout, stderr, None
        self.returncode: int | None = None
        self._connection = connection

    def poll(self) -> int | None:
        if self.returncode is None:
            ready, _, _ = select.select([self._connection], [], [], 0)
            if ready:
                self._ended()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            ready, _, _ = select.select([self._connection], [], [], timeout)
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._ended()
        return self.returncode

    def _ended(self) -> None:
        self._connection.settimeout(None)
        self.returncode = struct.unpack("!i", _exactly(self._connection, 4))[0]
        self._connection.close()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input=None, timeout: float | None = None):
        """Everything the child writes to its pipes, once it has ended."""
        if input:
            raise ValueError("a forked command reads an empty stdin")
        outputs: dict[str, object] = {}
        readers = [threading.Thread(target=lambda n=name, f=f: outputs.__setitem__(n, f.read()), daemon=True)
                   for name, f in (("stdout", self.stdout), ("stderr", self.stderr)) if f is not None]
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        for f in (self.stdout, self.stderr):
            if f is not None:
                f.close()
        return outputs.get("stdout"), outputs.get("stderr")

    def __enter__(self) -> "ForkedProcess":
        return self

    def __exit__(self, *exc) -> None:
        for f in (self.stdout, self.stderr):
            if f is not None:
                f.close()
        self.wait()


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
        if request.get("session"):
            os.setsid()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
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
    # A child's end wakes the loop: SIGCHLD writes a byte into this pipe (signal.set_wakeup_fd).
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False), os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address + ".tmp")
    listener.listen(8)
    os.rename(address + ".tmp", address)  # the client waits for the name: it appears when the server listens
    parent = os.getppid()
    running: dict[int, socket.socket] = {}  # each child's pid -> the connection that waits for its exit code
    while True:
        ready, _, _ = select.select([listener, wake_read], [], [], 10)
        if wake_read in ready:
            while _drained(wake_read):
                pass
        _reap(running)
        if os.getppid() != parent:  # the test process is gone (killed, not stopped): so is its server
            Path(address).unlink(missing_ok=True)
            return
        if listener in ready:
            _fork_one(listener, running)


def _drained(fd: int) -> bool:
    try:
        return bool(os.read(fd, 512))
    except BlockingIOError:
        return False


def _reap(running: dict[int, socket.socket]) -> None:
    """Tells each ended child's client its exit code."""
    while running:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        connection = running.pop(pid, None)
        if connection is None:
            continue
        returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        try:
            connection.sendall(struct.pack("!i", returncode))
        except OSError:  # the client gave up (a timeout): it killed the child
            pass
        connection.close()


def _fork_one(listener: socket.socket, running: dict[int, socket.socket]) -> None:
    connection, _ = listener.accept()
    connection.settimeout(None)
    message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
    size = struct.unpack("!I", message[:4])[0]
    body = message[4:]
    while len(body) < size:
        body += connection.recv(size - len(body))
    pid = os.fork()
    if pid == 0:
        listener.close()
        for other in running.values():
            other.close()
        connection.close()
        _child(json.loads(body), fds)
    for fd in fds:
        os.close(fd)
    connection.sendall(struct.pack("!i", pid))
    running[pid] = connection


if __name__ == "__main__":
    serve(sys.argv[1])
