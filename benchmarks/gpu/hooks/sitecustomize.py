"""Loaded at start-up by every Python process the GPU kit starts (kit.env puts this folder first
on PYTHONPATH). With KIT_STACKS set, SIGUSR1 writes every thread's stack to KIT_STACKS/PID.txt:
the kit sends it before killing a step at its cap, so a step that ran out of time says where."""

import faulthandler
import os
import signal
import sys

_folder = os.environ.get("KIT_STACKS")
if _folder:
    os.makedirs(_folder, exist_ok=True)
    _stacks = open(os.path.join(_folder, f"{os.getpid()}.txt"), "w")  # kept open: faulthandler writes to its fd
    _stacks.write(f"pid {os.getpid()}: {' '.join(getattr(sys, 'orig_argv', []))[:500]}\n")
    _stacks.flush()
    faulthandler.register(signal.SIGUSR1, file=_stacks, all_threads=True)
