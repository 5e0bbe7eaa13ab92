"""Ordering helpers shared by the timed-task tests: FIFO gates and bounded polls of the pool's
state (never a sleep standing in for an event)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

CONDITION_TIMEOUT = 20.0  # seconds a polled condition may take before the test fails


def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Poll ``condition`` (a state of the pool, not a time) until true; fail after a bound."""
    deadline = time.monotonic() + CONDITION_TIMEOUT
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting until {what}")
        time.sleep(0.001)


class Fifos:
    """A task announces itself on ``started`` and waits at ``gate``; ``log`` collects side
    effects (O_APPEND writes)."""

    def __init__(self, tmp: Path) -> None:
        self.gate = str(tmp / "gate")
        self.started = str(tmp / "started")
        self.log = str(tmp / "log")
        os.mkfifo(self.gate)
        os.mkfifo(self.started)
