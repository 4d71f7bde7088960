"""`StopSignals`: Ctrl-C (SIGINT) and SIGTERM while training.

The first asks the loop to stop: at the next micro-batch with one process
(`FineTuner` drops the unfinished step and checkpoints the last whole one),
after the step with several (the stop is agreed in `Processes`). A second one
quits at once.

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
import threading
from typing import Any, Callable

SIGNALS = (signal.SIGINT, signal.SIGTERM)
ACKNOWLEDGEMENT = ("stopping: the last finished step is saved as a checkpoint; "
                   "press Ctrl-C again to quit at once, without it")
ACKNOWLEDGEMENT_NO_CHECKPOINT = "stopping after this micro-batch; press Ctrl-C again to stop sooner"


class StopRequested(Exception):
    """Raised inside a step, between micro-batches, when a stop was asked for."""


class StopSignals:
    """A context manager: the handlers and the watching thread are installed on
    entry (from the main thread only; Python allows no other) and the previous
    handlers put back on exit. `received` is the first signal, if any."""

    def __init__(self, warn: Callable[[str], None], checkpoints: bool = True):
        """`checkpoints`: a stop saves one, and a second signal quits the process at
        once; else (tuning) the second raises KeyboardInterrupt for the caller."""
        self.warn = warn
        self.checkpoints = checkpoints
        self.received: int | None = None
        self.count = 0
        self._previous: dict[int, Any] = {}
        self._previous_fd = -1
        self._sockets: tuple[socket.socket, socket.socket] | None = None

    def __enter__(self) -> StopSignals:
        self.received, self.count = None, 0
        if threading.current_thread() is not threading.main_thread():
            return self
        self._previous = {signum: signal.signal(signum, self._handle) for signum in SIGNALS}
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._sockets = (reader, writer)
        self._previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(reader,), name="stop-signals", daemon=True).start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
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
        self.count += 1
        if self.count == 1:
            self.received = signum
            try:
                self.warn(ACKNOWLEDGEMENT if self.checkpoints else ACKNOWLEDGEMENT_NO_CHECKPOINT)
            except Exception:  # a closed terminal: the stop itself still happens
                pass
            return
        if self.checkpoints:
            _quit_at_once(signum)


def _quit_at_once(signum: int) -> None:
    """The second signal: no checkpoint, no interpreter shutdown (it could wait
    for the step). Written to the file descriptors themselves: the live display
    has replaced sys.stdout and sys.stderr, and hid the cursor."""
    for fd in (1, 2):
        if os.isatty(fd):
            os.write(fd, b"\x1b[?25h")
    os.write(2, b"\nquitting at once, without saving; `llmcustoms resume` continues from the last checkpoint\n")
    os._exit(128 + signum)
