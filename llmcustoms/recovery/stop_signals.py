"""`StopSignals`: Ctrl-C (SIGINT), SIGTERM and SIGHUP while training.

SIGHUP is what closing the terminal sends: it once killed the run on the
spot, with no checkpoint and status.json left saying `running`. It is a stop
like the others now (exit 129), with two differences: what was written to the
terminal goes nowhere from then on (a write to a closed terminal fails, and
ended the run as a bug after its checkpoint; train.log still has it all), and
a second SIGHUP does not quit at once (the shell and the kernel may each send
one, and no one is there to press Ctrl-C twice).

The first asks the loop to stop: at the next micro-batch with one process
(`FineTuner` drops the unfinished step and checkpoints the last whole one),
after the step with several (the stop is agreed in `Processes`). The long
passes outside steps (an evaluation, DPO's reference pass) stop between
micro-batches with any number of processes: they agree before each one
(`stop_agreed`). Sample replies stop at the next token. A second signal quits
at once, after writing status.json (`record_quit`) if it can within
QUIT_WRITE_S.

Python runs a signal handler only between bytecodes of the main thread, and a
backward pass is one long call into C++: a handler alone would say nothing
for the rest of the micro-batch, so users pressed again and lost the
checkpoint. `signal.set_wakeup_fd` has the C-level handler write the signal
number to a socket at once; a thread waiting on it acknowledges the request
immediately, and quits at once on the second.
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import threading
from typing import Any, Callable

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# A second signal waits at most this long for status.json to be written: a stuck disk must not keep the process.
QUIT_WRITE_S = 2.0
ACKNOWLEDGEMENT = ("stopping: the last finished step is saved as a checkpoint; "
                   "press Ctrl-C again to quit at once, without it")
ACKNOWLEDGEMENT_NO_CHECKPOINT = "stopping after this micro-batch; press Ctrl-C again to stop sooner"


class StopRequested(Exception):
    """Raised between micro-batches (of a step, an evaluation, the reference pass)
    or tokens (of sample replies) when a stop was asked for."""


class StopSignals:
    """A context manager: the handlers and the watching thread are installed on
    entry (from the main thread only; Python allows no other) and the previous
    handlers put back on exit; an entry inside another changes nothing.
    `received` is the first signal, if any, from any entry."""

    def __init__(self, warn: Callable[[str], None], checkpoints: bool = True,
                 quitting: Callable[[int], None] = lambda signum: None):
        """`checkpoints`: a stop saves one, and a second signal quits the process at
        once, after `quitting(signum)` (from the watching thread; best effort: it
        may fail, and is given up on after QUIT_WRITE_S); else (tuning) the second
        raises KeyboardInterrupt for the caller."""
        self.warn = warn
        self.checkpoints = checkpoints
        self.quitting = quitting
        self.received: int | None = None
        self.count = 0
        self.hung_up = False  # a SIGHUP arrived: the terminal is gone
        self._depth = 0  # entered this many times: the handlers are installed by the outermost
        self._previous: dict[int, Any] = {}
        self._previous_fd = -1
        self._sockets: tuple[socket.socket, socket.socket] | None = None

    def __enter__(self) -> StopSignals:
        # A signal received in an earlier `with` (DPO's reference pass, before the
        # loop's) still counts: the loop stops for it.
        self._depth += 1
        if self._depth > 1 or threading.current_thread() is not threading.main_thread():
            return self
        self._previous = {signum: signal.signal(signum, self._handle) for signum in SIGNALS}
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._sockets = (reader, writer)
        self._previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(reader,), name="stop-signals", daemon=True).start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._depth -= 1
        if self._depth:
            return
        for signum, handler in self._previous.items():
            # After a hang-up the terminal is gone: the kernel's or the shell's late
            # SIGHUP must not kill the process while it writes its ending.
            signal.signal(signum, signal.SIG_IGN if signum == signal.SIGHUP and self.hung_up else handler)
        self._previous = {}
        if self._sockets is not None:
            signal.set_wakeup_fd(self._previous_fd)
            reader, writer = self._sockets
            writer.close()  # the watching thread reads end-of-file and returns
            self._sockets = None

    def _handle(self, signum: int, frame: Any) -> None:
        # The watching thread has said so already; this runs once the main thread is back in Python.
        if self.received is None:
            self.received = signum
        elif not self.checkpoints and signum == signal.SIGINT:
            raise KeyboardInterrupt

    def _watch(self, reader: socket.socket) -> None:
        with reader:
            while data := reader.recv(16):
                for signum in data:
                    if signum in SIGNALS:
                        self._arrived(signum)

    def _arrived(self, signum: int) -> None:
        if signum == signal.SIGHUP:
            self.hung_up = True
            _leave_terminal()
            if self.count:
                return
        self.count += 1
        if self.count == 1:
            self.received = signum
            try:
                self.warn(ACKNOWLEDGEMENT if self.checkpoints else ACKNOWLEDGEMENT_NO_CHECKPOINT)
            except Exception:  # a closed terminal: the stop itself still happens
                pass
            return
        if self.checkpoints:
            _quit_at_once(signum, self.quitting)


def _leave_terminal() -> None:
    """Standard output and error, where they are a terminal (a character
    device: a closed terminal fails even `isatty`), write to /dev/null from now
    on; a pipe or a file keeps its output."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            try:
                if stat.S_ISCHR(os.fstat(fd).st_mode):
                    os.dup2(null, fd)
            except OSError:
                continue
    finally:
        os.close(null)


def _quit_at_once(signum: int, quitting: Callable[[int], None]) -> None:
    """The second signal: no checkpoint, no interpreter shutdown (it could wait
    for the step). Written to the file descriptors themselves: the live display
    has replaced sys.stdout and sys.stderr, and hid the cursor."""
    for fd in (1, 2):
        if os.isatty(fd):
            os.write(fd, b"\x1b[?25h")
    os.write(2, b"\nquitting at once, without saving; `llmcustoms resume` continues from the last checkpoint\n")
    writer = threading.Thread(target=_quietly, args=(quitting, signum), name="stop-signals-status", daemon=True)
    writer.start()
    writer.join(QUIT_WRITE_S)
    os._exit(128 + signum)


def _quietly(quitting: Callable[[int], None], signum: int) -> None:
    try:
        quitting(signum)
    except BaseException:  # noqa: BLE001 - the process quits either way; status.json is a courtesy
        pass


def stopped_by(signum: int) -> str:
    """status.json's reason for a stop."""
    return f"stopped by {signal.Signals(signum).name}"


def record_quit(run_dir: Any, signum: int, step: int, checkpoints: Any) -> None:
    """status.json after a second signal: `interrupted`, at `step`, saying the
    process quit at once and what the newest checkpoint (`CheckpointManager`) holds."""
    saved = max((c.step for c in checkpoints.all()), default=None)
    since = f"not saved after step {saved}" if saved is not None else "no checkpoint saved"
    run_dir.write_status("interrupted", step=step,
                         reason=f"quit at once by a second {signal.Signals(signum).name}; {since}")


def stop_agreed(processes: Any) -> str | None:
    """Between two micro-batches of a pass every process makes alike (an
    evaluation, DPO's reference pass): "stop" when a stop was asked for, a
    failure another process agreed on ("oom"), or None to go on. With several
    processes each asks every time (one small all-reduce), so all stop
    before the same micro-batch; with one it asks nobody."""
    failure = processes.agree(None)
    if failure is not None:
        return failure
    return "stop" if processes.stopping() is not None else None
