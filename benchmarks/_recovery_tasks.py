"""Task body of ``bench_recovery.py`` (module-level and light: every pool pickles it by reference,
and a fresh worker imports it quickly)."""

from __future__ import annotations

import os


def report_pid_then_block(started: str, gate: str) -> int:
    """Write this worker's pid into the FIFO ``started``, then block on the FIFO ``gate``, which
    nobody opens for writing: the task runs until its worker is killed."""
    with open(started, "wb") as fifo:
        fifo.write(str(os.getpid()).encode())
    with open(gate, "rb") as fifo:
        fifo.read(1)
    return os.getpid()
