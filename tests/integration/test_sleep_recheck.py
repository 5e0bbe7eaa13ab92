"""A worker about to sleep looks at its peers' deques once more after it announced its sleep
(docs/design.md, "Sleeping without lost wake-ups": announce, recheck, then block). A peer that
pushes a child before the announcement wakes nobody (no sleeper is counted yet), so without
the recheck the child waits for its parent's join while the idle worker sleeps. An audit took
the recheck out and no test but a slow model test (2 runs in 5) failed; this one makes the
window certain: under fork the workers inherit the test's wrapper of ``add_sleepers``, which
holds the idle worker just before its announcement until the child is pushed. And the other
way round: a child's end wakes its parent asleep in the join."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import mpsched._worker
from mpsched import Pool
from mpsched._layout import GlobalHeader

from . import tasks
from .conditions import CONDITION_TIMEOUT, start_every_worker, wait_until


def _fifos(folder: Path, *names: str) -> None:
    for name in names:
        os.mkfifo(folder / name)


@pytest.mark.timeout(60)
def test_a_child_pushed_just_before_a_peer_announces_its_sleep_is_stolen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fifos(tmp_path, "push", "join", "hold")
    armed = tmp_path / "armed"  # holds the pid not to hold (the pushing worker's)
    test_pid = os.getpid()
    add_sleepers = GlobalHeader.add_sleepers

    def held_add_sleepers(header: GlobalHeader, delta: int) -> int:
        pid = os.getpid()
        if delta == 1 and pid != test_pid and armed.exists() and armed.read_text() != str(pid):
            armed.unlink()  # once
            tasks.write_atomically(tmp_path / "held", str(pid))
            tasks.gate(str(tmp_path / "hold"))
        return add_sleepers(header, delta)

    monkeypatch.setattr(GlobalHeader, "add_sleepers", held_add_sleepers)
    with Pool(2, start_method="fork") as pool:  # fork: the workers inherit the wrapper
        parent = pool.submit(tasks.push_a_child_between_gates, str(tmp_path))
        wait_until((tmp_path / "worker").exists, "the parent task runs")
        pusher = (tmp_path / "worker").read_text()
        tasks.write_atomically(armed, pusher)
        # A second task starts the other worker (a task waits for it); once it ran, that
        # worker finds nothing and is held on its way to sleep.
        idle: Any = pool.submit(tasks.pid_of).result(timeout=20)
        wait_until((tmp_path / "held").exists, "the idle worker is held before its sleep")
        assert (tmp_path / "held").read_text() == str(idle) != pusher
        tasks.open_gate(str(tmp_path / "push"))
        wait_until((tmp_path / "pushed").exists, "the child is pushed")
        tasks.open_gate(str(tmp_path / "hold"))  # it announces its sleep, rechecks: steals
        wait_until((tmp_path / "child").exists, "the child ran before its parent's join")
        tasks.open_gate(str(tmp_path / "join"))
        ran_child, parent_pid = parent.result(timeout=20)
    assert (ran_child, parent_pid) == (idle, int(pusher))


@pytest.mark.timeout(60)
def test_a_parent_asleep_in_its_join_is_woken_by_its_child_ending_on_a_peer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A join's sleep ends at the latest after ``JOIN_SLEEP_MAX_MS`` (1 s), which hid a lost
    wake-up: a mutation that took out the child's wake of its sleeping parent
    (``Children.finish_child``) passed every test, each such join a second late. Here that
    limit is gone (fork: the workers inherit it), so only the wake-up ends the join."""
    _fifos(tmp_path, "joining", "gate")
    monkeypatch.setattr(mpsched._worker, "JOIN_SLEEP_MAX_MS", -1)  # poll(-1): no limit
    with Pool(2, start_method="fork") as pool:
        start_every_worker(pool)
        # Its own time limit: without the wake-up, its worker is killed and the result fails.
        parent = pool.with_options(timeout=CONDITION_TIMEOUT).submit(
            tasks.join_a_stolen_child, str(tmp_path / "joining"), str(tmp_path / "gate")
        )
        try:
            with open(tmp_path / "joining", "rb") as fifo:
                assert fifo.read(1) == b"j"  # a peer runs the child, held at the gate
            # So the one worker that can sleep is the parent's, in its join.
            slots = pool._coordinator.slots
            wait_until(lambda: any(s.is_sleeping() for s in slots), "the parent sleeps")
        finally:
            tasks.open_gate(str(tmp_path / "gate"))
        assert parent.result(timeout=2 * CONDITION_TIMEOUT) > 0
