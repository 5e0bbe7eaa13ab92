"""Ordering helpers shared by the integration tests: FIFO gates, bounded polls of the pool's
state (never a sleep standing in for an event), and waits for processes to die."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from mpsched import Pool

CONDITION_TIMEOUT = 20.0  # seconds a polled condition may take before the test fails
GATE_RELEASE_WAIT = 2.0  # seconds a failing test's clean-up waits for a task at a gate


def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Poll ``condition`` (a state of the pool, not a time) until true; fail after a bound."""
    deadline = time.monotonic() + CONDITION_TIMEOUT
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting until {what}")
        time.sleep(0.001)


def wait_until_known(pool: Pool, slot: int = 0) -> int:
    """Wait until the pool knows the pid of ``slot``'s worker, and return it. It learns it from
    the zygote, which may tell it after the worker began its first task: until then
    ``statistics()`` says 0 (and ``os.kill(0, ...)`` would signal the test's own process
    group), and the loop hands that worker nothing."""
    wait_until(lambda: pool.statistics().per_worker[slot].pid != 0, f"worker {slot} is known")
    return pool.statistics().per_worker[slot].pid


def start_every_worker(pool: Pool) -> None:
    """Fork a pool's dormant workers now, as a worker's first child would have them forked
    (WANT_PEERS), and wait until every slot has a worker: for a test whose premise is a full
    pool, without the work that would wake them (docs/design.md, "Dormant workers")."""
    coordinator = pool._coordinator
    coordinator.release_workers()  # START before any SPAWN (forkserver and spawn)
    coordinator.peers_wanted = True
    pool._wakeup.wakeup()
    wait_until(lambda: all(w.pid for w in pool.statistics().per_worker), "every worker is up")


def still_running(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait up to ``timeout`` seconds for ``procs`` to die; return those still running.

    A zombie counts as dead: it has exited and holds nothing but its pid until its parent
    reaps it. ``psutil.wait_procs`` counts it alive, and an orphan's zombie waits for init,
    which here (a Firecracker VM's init) reaps it 1.4-2.0 s after its exit: a pool's zygote
    orphaned when the forkserver exited before it failed the 2 s deadlines that way."""
    deadline = time.monotonic() + timeout
    while True:
        running = [p for p in procs if _running(p)]
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.01)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Fifos:
    """A task announces itself on ``started`` and waits at ``gate``; ``log`` collects side
    effects (O_APPEND writes)."""

    def __init__(self, tmp: Path) -> None:
        self.gate = str(tmp / "gate")
        self.started = str(tmp / "started")
        self.log = str(tmp / "log")
        os.mkfifo(self.gate)
        os.mkfifo(self.started)
