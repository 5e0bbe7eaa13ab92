"""The loop's lazy sweep: while only long tasks run, the coordinator sweeps the done rings every
``LAZY_SWEEP_INTERVAL`` instead of every ``RESULT_SWEEP_INTERVAL``, and the workers poke each
result that finds its done ring empty, so that no result waits for the slow sweep
(docs/design.md, "Lazy sweep")."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from mpsched import Pool, _coordinator

from . import tasks
from .conditions import CONDITION_TIMEOUT, start_every_worker, wait_until

METHODS = ["fork", "forkserver"]


class PollRecorder:
    """Stands in for the coordinator's epoll object: records each ``poll`` timeout."""

    def __init__(self, epoll: Any) -> None:
        self._epoll = epoll
        self._lock = threading.Lock()
        self.timeouts: list[float] = []

    def poll(self, timeout: float = -1) -> Any:
        with self._lock:
            self.timeouts.append(timeout)
        return self._epoll.poll(timeout)

    def take(self) -> list[float]:
        with self._lock:
            out, self.timeouts = self.timeouts, []
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._epoll, name)


def _fifos(tmp_path: Path, *names: str) -> list[str]:
    paths = [str(tmp_path / name) for name in names]
    for path in paths:
        os.mkfifo(path)
    return paths


def _lazy(pool: Pool) -> bool:
    return bool(pool._coordinator.sweep_lazy and pool._views.header.lazy_sweep())


@pytest.mark.timeout(60)
def test_a_long_task_makes_the_sweep_lazy_and_its_result_eager_again(tmp_path: Path) -> None:
    started, gate, started_2, gate_2 = _fifos(tmp_path, "s", "g", "s2", "g2")
    with Pool(2, start_method="fork") as pool:
        coordinator = pool._coordinator
        recorder = PollRecorder(coordinator.epoll)
        coordinator.epoll = recorder
        future = pool.submit(tasks.report_pid_then_gate, started, gate)
        other = pool.submit(tasks.report_pid_then_gate, started_2, gate_2)  # wakes the loop
        pid = tasks.read_pid(started)
        pid_2 = tasks.read_pid(started_2)
        wait_until(lambda: _lazy(pool), "the sweep goes lazy")
        recorder.take()
        wait_until(lambda: len(recorder.timeouts) >= 2, "the loop waits twice more")
        # Lazy: every wait of the loop is the slow sweep's (the first one may have been
        # computed before the switch, and one is shortened by at most the ms epoll rounds to).
        waits = recorder.take()
        assert all(t == _coordinator.LAZY_SWEEP_INTERVAL for t in waits[1:]), waits
        tasks.open_gate(gate)
        assert future.result(timeout=CONDITION_TIMEOUT) == pid
        # The result made it eager (``other`` still runs): a 5 ms sweep comes.
        wait_until(
            lambda: _coordinator.RESULT_SWEEP_INTERVAL in recorder.timeouts, "an eager sweep"
        )
        tasks.open_gate(gate_2)
        assert other.result(timeout=CONDITION_TIMEOUT) == pid_2
        wait_until(lambda: not pool._views.header.lazy_sweep(), "nothing in flight: eager")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", METHODS)
def test_a_result_that_a_long_task_follows_is_poked_while_the_sweep_is_lazy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, start_method: str
) -> None:
    """Worker X runs A (long), worker Y runs S, then B (long): S's result finds Y's done ring
    empty while the sweep is lazy, so Y pokes it. With the slow sweep an hour apart, nothing
    else would collect it (three tasks in flight: ``result()`` does not help with the
    collection) until B ended, and B's gate opens only after S's result came."""
    monkeypatch.setattr(_coordinator, "LAZY_SWEEP_INTERVAL", 3600.0)
    started_a, gate_a, started_s, gate_s, started_b, gate_b = _fifos(
        tmp_path, "sa", "ga", "ss", "gs", "sb", "gb"
    )
    with Pool(2, start_method=start_method) as pool:
        start_every_worker(pool)
        coordinator = pool._coordinator
        # Two tasks: the second one wakes the loop, which then sweeps (the first one went
        # to an idle worker's inbox straight from this thread: the loop slept on).
        a = pool.submit(tasks.report_pid_then_gate, started_a, gate_a)
        s = pool.submit(tasks.report_pid_then_gate, started_s, gate_s)
        pid_x = tasks.read_pid(started_a)
        pid_y = tasks.read_pid(started_s)
        assert pid_x != pid_y
        wait_until(lambda: _lazy(pool), "the sweep goes lazy")
        b = pool.submit(tasks.report_pid_then_gate, started_b, gate_b)
        wait_until(lambda: len(coordinator.by_handle) == 3, "B is handed out")
        assert _lazy(pool), "new tasks keep the sweep lazy"
        tasks.open_gate(gate_s)
        assert tasks.read_pid(started_b) == pid_y  # Y went on to B, X still runs A
        assert s.result(timeout=CONDITION_TIMEOUT) == pid_y
        tasks.open_gate(gate_b)
        tasks.open_gate(gate_a)
        assert b.result(timeout=CONDITION_TIMEOUT) == pid_y
        assert a.result(timeout=CONDITION_TIMEOUT) == pid_x


@pytest.mark.timeout(60)
def test_a_task_with_a_timeout_keeps_the_sweep_eager(tmp_path: Path) -> None:
    """The timeout check rides on the sweep (a task's start is noted at a pass): a watched
    task keeps it at ``RESULT_SWEEP_INTERVAL``."""
    started, gate = _fifos(tmp_path, "s", "g")
    with Pool(1, start_method="fork") as pool:
        coordinator = pool._coordinator
        recorder = PollRecorder(coordinator.epoll)
        coordinator.epoll = recorder
        future = pool.with_options(timeout=600.0).submit(tasks.report_pid_then_gate, started, gate)
        pid = tasks.read_pid(started)
        recorder.take()
        wait_until(lambda: len(recorder.timeouts) >= 3 * _coordinator.QUIET_SWEEPS, "sweeps")
        assert not pool._views.header.lazy_sweep()
        waits = recorder.take()
        assert max(waits) <= _coordinator.RESULT_SWEEP_INTERVAL, waits
        tasks.open_gate(gate)
        assert future.result(timeout=CONDITION_TIMEOUT) == pid
