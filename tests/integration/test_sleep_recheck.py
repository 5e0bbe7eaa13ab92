"""A worker about to sleep looks at its peers' deques once more after it announced its sleep
(docs/design.md, "Sleeping without lost wake-ups": announce, recheck, then block). A peer that
pushes a child before the announcement wakes nobody (no sleeper is counted yet), so without
the recheck the child waits for its parent's join while the idle worker sleeps. An audit took
the recheck out and no test but a slow model test (2 runs in 5) failed; this one makes the
window certain: under fork the workers inherit the test's wrapper of ``add_sleepers``, which
holds the idle worker just before its announcement until the child is pushed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from mpsched import Pool
from mpsched._layout import GlobalHeader

from . import tasks
from .conditions import wait_until


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
