"""Dormant workers: a pool forks its first worker at start-up and the others once work waits
for them (more tasks than workers, or a task's child for a peer to steal), not before
(docs/design.md, "Dormant workers")."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest

from mpsched import Pool, WorkerCrashedError

from . import tasks
from .conditions import CONDITION_TIMEOUT, wait_until

METHODS = ["fork", "forkserver"]


def _fifos(tmp_path: Path, *names: str) -> list[str]:
    paths = [str(tmp_path / name) for name in names]
    for path in paths:
        os.mkfifo(path)
    return paths


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", METHODS)
def test_one_task_at_a_time_leaves_the_other_workers_dormant(start_method: str) -> None:
    with Pool(3, start_method=start_method) as pool:
        pids = {pool.submit(tasks.pid_of).result(timeout=CONDITION_TIMEOUT) for _ in range(20)}
        assert len(pids) == 1
        assert [w.pid for w in pool.statistics().per_worker] == [pids.pop(), 0, 0]
        assert len(psutil.Process(pool._zygote.pid).children()) == 1
    stats = pool.statistics()
    assert stats.completed == 20
    assert [w.executed for w in stats.per_worker] == [20, 0, 0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", METHODS)
def test_more_tasks_than_workers_wake_the_dormant_ones(tmp_path: Path, start_method: str) -> None:
    """Two tasks that run at once (each tells its pid, then waits at its gate): the second
    needs the dormant worker."""
    started_a, gate_a, started_b, gate_b = _fifos(tmp_path, "sa", "ga", "sb", "gb")
    with Pool(2, start_method=start_method) as pool:
        a = pool.submit(tasks.report_pid_then_gate, started_a, gate_a)
        b = pool.submit(tasks.report_pid_then_gate, started_b, gate_b)
        running = {tasks.read_pid(started_a), tasks.read_pid(started_b)}
        assert len(running) == 2
        tasks.open_gate(gate_a)
        tasks.open_gate(gate_b)
        assert {a.result(CONDITION_TIMEOUT), b.result(CONDITION_TIMEOUT)} == running
        assert pool._coordinator.dormant == []


@pytest.mark.timeout(60)
def test_tasks_at_once_wake_one_worker_each_not_every_dormant_one(tmp_path: Path) -> None:
    """Pool(4): two tasks running at once need two workers, a third one three; the fourth
    slot stays dormant."""
    fifos = _fifos(tmp_path, "s0", "g0", "s1", "g1", "s2", "g2")
    started, gates = fifos[0::2], fifos[1::2]
    with Pool(4, start_method="fork") as pool:
        running = []
        pids: set[int] = set()
        for k in range(3):
            running.append(pool.submit(tasks.report_pid_then_gate, started[k], gates[k]))
            pids.add(tasks.read_pid(started[k]))  # each one runs while the earlier ones wait
            assert len(pids) == k + 1
            assert pool._coordinator.dormant == list(range(k + 1, 4))
            wait_until(
                lambda: {w.pid for w in pool.statistics().per_worker} - {0} == pids,
                "the running workers are registered",
            )
        for gate in gates:
            tasks.open_gate(gate)
        assert {f.result(CONDITION_TIMEOUT) for f in running} == pids


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", METHODS)
def test_a_child_of_the_first_task_wakes_a_dormant_peer_to_steal_it(
    tmp_path: Path, start_method: str
) -> None:
    """The pool's only task spawns a child and waits until a peer runs it (it does not run it
    itself): with the peer left dormant, nobody would (``join_a_stolen_child`` times out)."""
    joining, gate = _fifos(tmp_path, "joining", "gate")
    with Pool(2, start_method=start_method) as pool:
        parent = pool.submit(tasks.join_a_stolen_child, joining, gate)
        with open(joining, "rb") as fifo:
            assert fifo.read(1) == b"j"
        tasks.open_gate(gate)
        parent_pid = parent.result(timeout=CONDITION_TIMEOUT)
        stats = pool.statistics()
    assert stats.steals == 1
    assert sorted(w.pid != parent_pid and w.stolen == 1 for w in stats.per_worker) == [
        False,
        True,
    ]


@pytest.mark.timeout(60)
def test_a_replacement_of_the_first_worker_wakes_its_dormant_peers_too(tmp_path: Path) -> None:
    """The first worker crashed with its peer still dormant: its replacement is forked with
    the same duty (SPAWN says the peers are dormant), and its first child wakes them."""
    joining, gate = _fifos(tmp_path, "joining", "gate")
    with Pool(2, start_method="fork") as pool:
        with pytest.raises(WorkerCrashedError):
            pool.submit(tasks.exit_at_once, 3).result(timeout=CONDITION_TIMEOUT)
        wait_until(lambda: pool.statistics().per_worker[0].pid != 0, "the replacement is up")
        assert pool._coordinator.dormant == [1]
        parent = pool.submit(tasks.join_a_stolen_child, joining, gate)
        with open(joining, "rb") as fifo:
            assert fifo.read(1) == b"j"
        tasks.open_gate(gate)
        parent.result(timeout=CONDITION_TIMEOUT)
        assert pool._coordinator.dormant == []
        assert pool.statistics().steals == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", METHODS)
def test_a_map_that_wakes_hundreds_of_dormant_workers_at_once_ends(start_method: str) -> None:
    """A map of 600 items on ``Pool(600)`` woke every dormant worker in one pass: ~600 SPAWNs
    at once, whose answers (each with a socket, an SCM_RIGHTS message) filled the zygote's way
    back while the SPAWNs filled the way there, and both sides waited for ever (found in
    review). At most ``SPAWNS_IN_FLIGHT_MAX`` go unanswered now."""
    with Pool(600, start_method=start_method) as pool:
        assert list(pool.map(tasks.ident, range(600), chunksize=1)) == list(range(600))
    assert pool.statistics().completed == 600
