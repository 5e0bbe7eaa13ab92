"""Threaded race tests of the engine API: plain ``submit``, ``Future.cancel()``, done-callbacks,
``concurrent.futures.wait``, ``shutdown`` (with and without ``cancel_futures``) from several
threads, and nested tasks.

Same method as ``test_timed_races``: its ``race()`` harness releases the players together at a
``threading.Barrier`` each round under ``fast_switching()`` (the GIL changes hands every
microsecond; the coordinator thread races too). Tasks log each run with one ``O_APPEND`` write
(``timed_tasks.log``), so "never ran" and "ran exactly once" are checked against facts. Tasks
that must stay unclaimed wait behind a blocker task held at a FIFO gate (``tasks.gate``): a
cross-process event, no sleeping. Every pool is shut down in a ``finally`` (the gate opened
first, so nothing waits forever) and a failing player aborts the barrier.
"""

from __future__ import annotations

import os
import random
import threading
from concurrent.futures import FIRST_COMPLETED, as_completed, wait
from pathlib import Path
from typing import Any

import pytest

import mpsched
from mpsched import Pool, PoolClosedError
from tests.integration import tasks
from tests.integration import timed_tasks as tt
from tests.stress.test_timed_races import CONDITION_TIMEOUT, fast_switching, race

pytestmark = pytest.mark.slow


def _jitter() -> None:
    """A tiny random spin: varies which side of the race goes first (outcomes all checked)."""
    for _ in range(random.randrange(0, 200)):
        pass


def _check_runs(path: str, futures: dict[Any, mpsched.Future]) -> None:
    """Every future ended; a cancelled task never ran, any other ran exactly once and its
    future holds its result."""
    _, not_done = wait(list(futures.values()), timeout=CONDITION_TIMEOUT)
    assert not not_done, f"{len(not_done)} future(s) never ended"
    runs: dict[Any, int] = {}
    for tag in tt.read_tags(path):
        runs[tag] = runs.get(tag, 0) + 1
    for tag, future in futures.items():
        if future.cancelled():
            assert runs.get(tag, 0) == 0, f"{tag!r} was cancelled but ran"
        else:
            assert runs.get(tag, 0) == 1, f"{tag!r} ran {runs.get(tag, 0)} times"
            assert isinstance(future.result(), float), tag
    assert set(runs) <= set(futures), "a run nobody submitted"


# ---------------------------------------------------------------- cancel vs claim
@pytest.mark.timeout(60)
def test_cancel_races_the_claim_while_others_submit(tmp_path: Path) -> None:
    """Two threads each submit a logged task and cancel it (after a random spin) while the
    workers claim, run and complete tasks and the slab reuses their blocks. ``cancel()``
    True means the task never ran; False means it ran once and its future has the result."""
    rounds = 4000
    path = str(tmp_path / "log")
    futures: dict[Any, mpsched.Future] = {}
    with fast_switching(), Pool(2) as pool:

        def player(name: str) -> Any:
            def play(i: int) -> bool:
                tag = (name, i)
                future = pool.submit(tt.log, path, tag)
                futures[tag] = future
                _jitter()
                ok = future.cancel()
                assert ok == future.cancelled(), tag
                return ok

            return play

        a, b = race(rounds, player("a"), player("b"))
        _check_runs(path, futures)
        assert any(a + b), "no cancel won a race: the test tests nothing"
        assert not all(a + b), "every cancel won: the test tests nothing"


# ---------------------------------------------------------------- two cancels at once
@pytest.mark.timeout(60)
def test_two_cancels_of_one_waited_on_future(tmp_path: Path) -> None:
    """Two threads cancel the same unclaimed task (queued behind a blocker) while a third
    waits on it with ``concurrent.futures.wait``; the future has a done-callback, so it has
    its Condition and cancel takes the stdlib path. Both cancels say True, nothing raises, the
    callback runs exactly once, the waiter sees the future done, and the task never runs."""
    rounds = 2000
    gate = str(tmp_path / "gate")
    os.mkfifo(gate)
    path = str(tmp_path / "log")
    calls: list[int] = []
    pool = Pool(1)
    blocker = pool.submit(tasks.gated_ident, gate, "blocker")
    try:
        futures: list[mpsched.Future] = []

        def prepare(i: int) -> None:
            future = pool.submit(tt.log, path, i)
            future.add_done_callback(lambda f, i=i: calls.append(i))
            futures.append(future)

        def waiter(i: int) -> bool:
            done, _ = wait([futures[i]], timeout=CONDITION_TIMEOUT, return_when=FIRST_COMPLETED)
            return futures[i] in done

        with fast_switching():
            one, two, seen = race(
                rounds,
                lambda i: futures[i].cancel(),
                lambda i: futures[i].cancel(),
                waiter,
                prepare=prepare,
            )
        assert [i for i in range(rounds) if not (one[i] and two[i])] == []
        assert all(seen)
        assert sorted(calls) == list(range(rounds)), "a callback ran twice or never"
        assert all(f.cancelled() for f in futures)
    finally:
        tasks.open_gate(gate)
        pool.shutdown()
    assert blocker.result() == "blocker"
    assert tt.read_tags(path) == []


# ---------------------------------------------------------------- shutdown vs everything
@pytest.mark.timeout(90)
def test_shutdowns_race_cancels_and_submits(tmp_path: Path) -> None:
    """Per round a fresh pool with tasks queued behind a blocker: one thread calls
    ``shutdown(cancel_futures=True)``, another ``shutdown()``, a third cancels queued tasks,
    a fourth keeps submitting until it gets ``PoolClosedError``. Every future ends, each task
    ran at most once, exactly once unless cancelled, and nothing raises but PoolClosedError."""
    rounds = 40
    log_path = str(tmp_path / "log")
    state: dict[str, Any] = {}
    futures: dict[Any, mpsched.Future] = {}

    def prepare(i: int) -> None:
        gate = str(tmp_path / f"gate{i}")
        started = str(tmp_path / f"started{i}")
        os.mkfifo(gate)
        os.mkfifo(started)
        pool = Pool(1)
        # Holds the one worker; claimed before the round (cancel_futures would cancel it
        # otherwise, and nobody would ever read the gate).
        blockers = [pool.submit(tasks.started_then_gated, started, gate, "blocker")]
        tasks.wait_started(started)
        queued = []
        for j in range(20):
            tag = ("q", i, j)
            futures[tag] = pool.submit(tt.log, log_path, tag)
            queued.append(futures[tag])
        state.update(pool=pool, gate=gate, blockers=blockers, queued=queued)

    def shut_cancel(i: int) -> None:
        try:
            state["pool"].shutdown(wait=False, cancel_futures=True)
        finally:  # the worker is held at the gate: let it go (after the close)
            tasks.open_gate(state["gate"])

    def shut_plain(i: int) -> None:
        _jitter()
        state["pool"].shutdown()

    def canceller(i: int) -> list[bool]:
        return [f.cancel() for f in state["queued"][::3]]

    def submitter(i: int) -> int:
        n = 0
        while True:
            tag = ("s", i, n)
            try:
                futures[tag] = state["pool"].submit(tt.log, log_path, tag)
            except PoolClosedError:
                return n
            n += 1

    with fast_switching():
        try:
            race(rounds, shut_cancel, shut_plain, canceller, submitter, prepare=prepare)
        finally:
            if "pool" in state:
                state["pool"].shutdown(cancel_futures=True)
    _check_runs(log_path, futures)


# ---------------------------------------------------------------- nested
@pytest.mark.timeout(60)
def test_shutdown_waits_for_children_of_running_tasks(tmp_path: Path) -> None:
    """Parents that spawn children race ``shutdown()`` and a cancel of their own futures:
    the drain waits for every child, so every parent that was not cancelled ran once with all
    its children, and a cancelled parent ran neither itself nor any child."""
    rounds = 30
    path = str(tmp_path / "log")
    open(path, "wb").close()
    state: dict[str, Any] = {}
    parents: dict[int, mpsched.Future] = {}

    def prepare(i: int) -> None:
        pool = Pool(2)
        state["pool"] = pool
        state["futures"] = [
            pool.submit(tasks.record_with_children, path, i * 10 + j + 1, 3) for j in range(6)
        ]
        for j, f in enumerate(state["futures"]):
            parents[i * 10 + j + 1] = f

    def shut(i: int) -> None:
        state["pool"].shutdown()

    def cancel(i: int) -> list[bool]:
        _jitter()
        return [f.cancel() for f in state["futures"][::2]]

    with fast_switching():
        try:
            race(rounds, shut, cancel, prepare=prepare)
        finally:
            if "pool" in state:
                state["pool"].shutdown()
    records = tasks.read_log(path)
    for task_id, future in parents.items():
        children = [-(task_id * 100 + k) - 1 for k in range(3)]
        assert future.done()
        if future.cancelled():
            assert task_id not in records, task_id
            assert not set(children) & set(records), task_id
        else:
            assert records.count(task_id) == 1, task_id
            assert sorted(c for c in records if c in children) == sorted(children), task_id
            assert future.result() == sum(children)


# ---------------------------------------------------------------- abandoned map
@pytest.mark.timeout(60)
def test_abandoned_map_while_others_submit(tmp_path: Path) -> None:
    """A ``map`` consumer closes its generator midway while another thread submits and a
    third waits with ``as_completed``: every submitted future ends, the map's results so far
    are right, and the pool shuts down (the leak check covers processes and fds)."""
    rounds = 150
    path = str(tmp_path / "log")
    futures: dict[Any, mpsched.Future] = {}
    with fast_switching(), Pool(2) as pool:

        def mapper(i: int) -> list[int]:
            it = pool.map(tasks.add, range(200), [i] * 200, chunksize=7)
            got = [next(it) for _ in range(random.randrange(1, 50))]
            it.close()
            return got

        def submitter(i: int) -> list[mpsched.Future]:
            mine = []
            for j in range(5):
                futures[(i, j)] = f = pool.submit(tt.log, path, (i, j))
                mine.append(f)
            return mine

        got, submitted = race(rounds, mapper, submitter)
        for i, values in enumerate(got):
            assert values == [x + i for x in range(len(values))]
        every = [f for fs in submitted for f in fs]
        assert len(list(as_completed(every, timeout=CONDITION_TIMEOUT))) == len(every)
        _check_runs(path, futures)
    assert threading.active_count() < 50


# ---------------------------------------------------------------- callbacks vs settlement
@pytest.mark.timeout(60)
def test_callbacks_and_waiters_race_the_settlement(tmp_path: Path) -> None:
    """One thread submits, two others add a done-callback and wait (``result()`` in one,
    ``concurrent.futures.wait`` in the other) as the coordinator settles the same futures
    (the lazy Condition's fast path against its creation). Each callback runs exactly once,
    every waiter sees the result, and ``as_completed`` sees every future."""
    rounds = 3000
    calls: dict[tuple[int, str], int] = {}
    lock = threading.Lock()
    futures: list[mpsched.Future] = []

    def count(key: tuple[int, str]) -> Any:
        def callback(_: mpsched.Future) -> None:
            with lock:
                calls[key] = calls.get(key, 0) + 1

        return callback

    with fast_switching(), Pool(2) as pool:

        def prepare(i: int) -> None:
            futures.append(pool.submit(tasks.ident, i))

        def by_result(i: int) -> Any:
            _jitter()
            futures[i].add_done_callback(count((i, "r")))
            return futures[i].result(timeout=CONDITION_TIMEOUT)

        def by_wait(i: int) -> bool:
            futures[i].add_done_callback(count((i, "w")))
            done, _ = wait([futures[i]], timeout=CONDITION_TIMEOUT)
            return futures[i] in done

        results, seen = race(rounds, by_result, by_wait, prepare=prepare)
        assert results == list(range(rounds))
        assert all(seen)
        assert len(list(as_completed(futures, timeout=CONDITION_TIMEOUT))) == rounds
    with lock:
        wrong = {k: n for k, n in calls.items() if n != 1}
        assert not wrong, f"callbacks ran other than once: {wrong}"
        assert len(calls) == 2 * rounds, "a callback never ran"


# ---------------------------------------------------------------- shutdown from a callback
# tasks a submitter thread submits at most in one round (a bound on the test's work, however
# late the shutdown comes; a round takes a few hundred)
SUBMITS_PER_ROUND_MAX = 5_000


@pytest.mark.timeout(60)
def test_shutdown_from_a_done_callback_while_others_submit(tmp_path: Path) -> None:
    """A done-callback (run by the coordinator thread) calls ``pool.shutdown()`` while two
    threads keep submitting: the pool closes and ends, later submits raise PoolClosedError,
    and every accepted task runs exactly once. (The callback's shutdown used to wait for the
    coordinator thread's own end: a silent hang.)"""
    rounds = 10
    path = str(tmp_path / "log")
    futures: dict[Any, mpsched.Future] = {}
    state: dict[str, Any] = {}

    def prepare(i: int) -> None:
        pool = Pool(1)
        # The worker up first: the race lasts one task's round trip, not a worker's start (the
        # submitters, which go on until the pool closes, gave a slow start ~100,000 tasks).
        assert pool.submit(tasks.ident, -1).result(timeout=CONDITION_TIMEOUT) == -1
        state["pool"] = pool
        state["closed"] = closed = threading.Event()

        def close(_: mpsched.Future) -> None:
            pool.shutdown()
            closed.set()

        state["first"] = first = pool.submit(tasks.ident, i)
        first.add_done_callback(close)

    def submitter(name: str) -> Any:
        def play(i: int) -> int:
            n = 0
            while n < SUBMITS_PER_ROUND_MAX:
                tag = (name, i, n)
                try:
                    futures[tag] = state["pool"].submit(tt.log, path, tag)
                except PoolClosedError:
                    return n
                n += 1
            return n

        return play

    def closer(i: int) -> bool:
        pool = state["pool"]
        # result() may collect in this thread (help_wait): then the callback runs here.
        assert state["first"].result(timeout=CONDITION_TIMEOUT) == i
        assert state["closed"].wait(CONDITION_TIMEOUT), "the callback's shutdown never returned"
        assert pool.await_termination(CONDITION_TIMEOUT), "the pool did not end"
        return True

    race(rounds, closer, submitter("a"), submitter("b"), prepare=prepare)
    _check_runs(path, futures)
