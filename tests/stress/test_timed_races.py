"""Threaded race tests of the timed-task API: schedule, cancel by id, ``Future.cancel()``,
``state()``, recurrences and ``shutdown(cancel_futures=True)`` called from several threads.

How: each round releases two (or three) threads together with a ``threading.Barrier`` so that
their calls overlap, with ``sys.setswitchinterval(1e-6)`` so that the GIL changes hands between
almost any two bytecodes (the coordinator thread is one of the racers too). Thousands of rounds;
after each round, or at the end, the outcome of every call is checked against the others and
against side effects: tasks append a line to a log with one ``O_APPEND`` write
(``timed_tasks.log``), so "never ran" and "ran once" are facts, not inferences. A failing round
aborts the barrier (the partner thread must not wait forever), every pool with far-future tasks
is shut down with ``cancel_futures=True`` in a ``finally``, and the switch interval is restored.

Nothing waits by sleeping: threads meet at barriers and wait on futures or on conditions of the
pool (``state()``) polled in a bounded loop.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import wait
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest

import mpsched
from mpsched import Pool, PoolClosedError, TaskState
from tests.integration import tasks
from tests.integration import timed_tasks as tt
from tests.integration.conditions import start_every_worker

pytestmark = pytest.mark.slow

CONDITION_TIMEOUT = 20.0  # seconds a barrier or a polled condition may take before failing
FAR = 600.0  # seconds: "never due" within a test


@contextmanager
def fast_switching() -> Iterator[None]:
    """Hand the GIL over every microsecond: many more interleavings per round."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


def race(
    rounds: int, *players: Callable[[int], Any], prepare: Callable[[int], Any] | None = None
) -> list[list[Any]]:
    """Run ``players[j](i)`` for every round ``i``, each player in its own thread, all of them
    released together at a barrier per round (``prepare(i)`` runs before round ``i``'s barrier,
    while the other players wait there). Returns each player's results by round; an exception
    in a player aborts the barrier and is raised here."""
    barrier = threading.Barrier(len(players), timeout=CONDITION_TIMEOUT)
    results: list[list[Any]] = [[] for _ in players]
    errors: list[BaseException] = []

    def play(j: int) -> None:
        try:
            for i in range(rounds):
                if j == 0 and prepare is not None:
                    prepare(i)
                barrier.wait()
                results[j].append(players[j](i))
        except threading.BrokenBarrierError:
            pass  # another player failed: its error is the one reported
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=play, args=(j,)) for j in range(1, len(players))]
    for thread in threads:
        thread.start()
    try:
        play(0)
    finally:
        for thread in threads:
            thread.join(timeout=CONDITION_TIMEOUT)
    if errors:
        raise errors[0]
    assert all(len(r) == rounds for r in results), "a player stopped early"
    return results


def wait_for_state(pool: Pool, task_id: Any, states: tuple[TaskState, ...]) -> TaskState:
    """Poll ``pool.state(task_id)`` (a condition of the pool) until it is one of ``states``."""
    deadline = time.monotonic() + CONDITION_TIMEOUT
    while True:
        state = pool.state(task_id)
        if state in states:
            return state
        if time.monotonic() > deadline:
            pytest.fail(f"{task_id!r} stayed {state} instead of reaching one of {states}")


# ---------------------------------------------------------------- pending versions
@pytest.mark.timeout(60)
def test_future_cancel_races_cancel_by_id_and_reschedule_cleanly() -> None:
    """``Future.cancel()`` of a version due in ten minutes against ``pool.cancel(id)`` (odd
    ids) or a reschedule of the id (even ids). Both take the version out of the heap under the
    coordinator's lock and mark its future after releasing it; whatever the interleaving,
    nothing raises, ``Future.cancel()`` says True, the version is cancelled, and the id ends
    CANCELLED or with its new version PENDING. (``pool.cancel(id)`` may say either: the
    future's cancel may have taken the version first.) On the old code this raised
    AttributeError (a heap record ended as if handed out) or returned False."""
    rounds = 2000
    with fast_switching(), Pool(1) as pool:
        try:
            far = time.monotonic() + FAR
            futures = [pool.schedule(i, far, 0, tasks.ident, i) for i in range(rounds)]

            def by_id(i: int) -> Any:
                if i % 2:
                    return pool.cancel(i)
                return pool.schedule(i, far, 0, tasks.ident, -i)

            mine, theirs = race(rounds, lambda i: futures[i].cancel(), by_id)
            assert [i for i, ok in enumerate(mine) if not ok] == []
            assert [i for i, f in enumerate(futures) if not f.cancelled()] == []
            for i in range(rounds):
                if i % 2:
                    assert pool.state(i) is TaskState.CANCELLED, i
                else:
                    assert isinstance(theirs[i], mpsched.Future)
                    assert not theirs[i].done(), i
                    assert pool.state(i) is TaskState.PENDING, i
        finally:  # the versions are due in ten minutes: never wait for them
            pool.shutdown(cancel_futures=True)


# ---------------------------------------------------------------- cancel after the run
@pytest.mark.timeout(60)
def test_future_cancel_after_the_run_is_refused(tmp_path: Path) -> None:
    """A version that ran must never be reported cancelled: once ``state(id)`` says COMPLETED,
    ``Future.cancel()`` must return False and the future must give the result.

    The cancel races the coordinator thread's settlement: it ends a collected batch of versions
    in the timetable under its lock (``end_runs``: ``state()`` says COMPLETED from then on),
    then resolves their futures one by one with the lock released. Each round schedules a batch
    of due versions, and this thread chases that loop: for each version in order, wait until its
    state is COMPLETED, then cancel its future."""
    rounds, batch = 150, 50
    log = str(tmp_path / "log")
    refused_late: list[int] = []
    with fast_switching(), Pool(1) as pool:
        for r in range(rounds):
            ids = range(r * batch, (r + 1) * batch)
            futures = [pool.schedule(i, 0.0, 0, tt.log, log, i) for i in ids]
            for i, f in zip(ids, futures, strict=True):
                wait_for_state(pool, i, (TaskState.COMPLETED,))
                if f.cancel():
                    refused_late.append(i)
            for i, f in zip(ids, futures, strict=True):
                assert not f.cancelled(), i
                assert f.result(timeout=CONDITION_TIMEOUT) >= 0, i
    ran = tt.read_tags(log)
    assert sorted(ran) == list(range(rounds * batch)), "a version did not run exactly once"
    assert refused_late == [], f"cancel() said True for versions that ran: {refused_late}"


@pytest.mark.timeout(60)
def test_future_cancel_of_a_collected_version_never_hits_a_reused_block(tmp_path: Path) -> None:
    """``Future.cancel()`` of a version that a worker claimed, chased until the future is done,
    while another thread keeps submitting plain tasks: the coordinator collects the version's
    result and frees its slab block before it takes its lock to settle it, and a plain submit
    to an idle pool injects a task at once, into the block just freed. A cancel of the old
    future in that gap must be refused (the version ran), and must not withdraw the new task
    that now holds the block (it would never run, and its future would never end). Checked:
    every cancel after the claim says False, every future ends, every task ran exactly once."""
    rounds = 500
    log = str(tmp_path / "log")
    versions: dict[int, mpsched.Future] = {}
    plain: list[mpsched.Future] = []
    with fast_switching(), Pool(1) as pool:

        def prepare(i: int) -> None:
            versions[i] = pool.schedule(i, 0.0, 0, tt.log, log, i)

        def submitter(i: int) -> None:
            for n in range(40):
                if versions[i].done():
                    return
                plain.append(pool.submit(tt.log, log, (i, n)))

        def canceller(i: int) -> bool:
            wait_for_state(pool, i, (TaskState.RUNNING, TaskState.COMPLETED))  # claimed
            won = False
            while not versions[i].done():
                won = versions[i].cancel() or won
            return won

        _, won = race(rounds, submitter, canceller, prepare=prepare)
        _, not_done = wait([*versions.values(), *plain], timeout=CONDITION_TIMEOUT)
        assert not not_done, f"{len(not_done)} futures never ended (a plain task was withdrawn)"
    assert [i for i in range(rounds) if won[i]] == [], "cancel() said True after the claim"
    assert [i for i, f in versions.items() if f.cancelled()] == []
    ran = tt.read_tags(log)
    assert len(ran) == len(set(ran)), "a task ran twice"
    assert len(ran) == rounds + len(plain), "a task did not run"


# ---------------------------------------------------------------- due versions vs the claim
@pytest.mark.timeout(60)
def test_future_cancel_and_cancel_by_id_race_the_claim(tmp_path: Path) -> None:
    """A due version (``run_at`` in the past), and in the same round ``Future.cancel()`` from one
    thread and ``pool.cancel(id)`` from another, both racing the worker's claim. Exactly one
    outcome: either the version never ran and its future is cancelled (then ``Future.cancel()``
    said True), or it ran once and its future holds the result (then ``Future.cancel()`` said
    False). ``state(id)`` agrees: CANCELLED or COMPLETED at the end, and a third thread's
    ``state(id)`` during the race never raises and never contradicts the outcome (no COMPLETED
    or RUNNING for a version that never ran, no CANCELLED for one that ran)."""
    rounds = 3000
    log = str(tmp_path / "log")
    futures: dict[int, mpsched.Future] = {}
    with fast_switching(), Pool(2) as pool:

        def prepare(i: int) -> None:
            futures[i] = pool.schedule(i, 0.0, 0, tt.log, log, i)

        by_future, by_id, seen = race(
            rounds,
            lambda i: futures[i].cancel(),
            lambda i: pool.cancel(i),
            lambda i: pool.state(i),
            prepare=prepare,
        )
        _, not_done = wait(list(futures.values()), timeout=CONDITION_TIMEOUT)
        assert not not_done, "a future never ended"
        states = {i: pool.state(i) for i in range(rounds)}
    ran = tt.read_tags(log)
    assert len(ran) == len(set(ran)), "a version ran twice"
    assert len(ran) > 20, "the runs were not exercised"
    ran_set = set(ran)
    problems = []
    for i in range(rounds):
        f = futures[i]
        if f.cancelled():
            ok = (
                i not in ran_set
                and states[i] is TaskState.CANCELLED
                and (by_future[i] or by_id[i])
                and seen[i] in (TaskState.PENDING, TaskState.CANCELLED)
            )
        else:
            ok = (
                i in ran_set
                and f.result() >= 0
                and not by_future[i]
                and states[i] is TaskState.COMPLETED
                and seen[i] in (TaskState.PENDING, TaskState.RUNNING, TaskState.COMPLETED)
            )
        if not ok:
            problems.append((i, f, by_future[i], by_id[i], seen[i], states[i], i in ran_set))
    assert problems == [], problems[:10]
    cancelled = sum(f.cancelled() for f in futures.values())
    assert 0 < cancelled < rounds, f"the race was not exercised: {cancelled} cancels won"


# ---------------------------------------------------------------- recurrences
@pytest.mark.timeout(60)
def test_recurrence_future_cancel_races_cancel_by_id_and_reschedule() -> None:
    """A recurrence (its first run due in ten minutes) per round; its public future's
    ``cancel()`` races ``pool.cancel(id)`` (odd rounds) or a plain reschedule of the id (even
    rounds). Whatever the interleaving: ``cancel()`` says True and the future ends cancelled;
    after a cancel by id the id is CANCELLED (the cancel by id may say False: the future's
    cancel may have stopped everything first); a reschedule's new version is untouched (its
    future not done, the id PENDING): stopping the old recurrence must not cancel the version
    that replaced it."""
    rounds = 4000
    far = time.monotonic() + FAR
    recurring: list[mpsched.Future] = []
    with fast_switching(), Pool(1) as pool:
        try:
            every = pool.with_options(every=FAR)

            def prepare(i: int) -> None:
                recurring.append(every.schedule(i, far, 0, tasks.ident, i))

            def other(i: int) -> Any:
                if i % 2:
                    return pool.cancel(i)
                return pool.schedule(i, far, 0, tasks.ident, -i)

            mine, theirs = race(rounds, lambda i: recurring[i].cancel(), other, prepare=prepare)
            problems = []
            for i in range(rounds):
                ok = mine[i] is True and recurring[i].cancelled()
                if i % 2:
                    ok = ok and pool.state(i) is TaskState.CANCELLED
                else:
                    new = theirs[i]
                    ok = ok and not new.done() and pool.state(i) is TaskState.PENDING
                if not ok:
                    problems.append((i, mine[i], recurring[i], theirs[i], pool.state(i)))
            assert problems == [], problems[:10]
        finally:  # the versions are due in ten minutes: never wait for them
            pool.shutdown(cancel_futures=True)


@pytest.mark.timeout(60)
def test_recurrence_stop_races_its_runs(tmp_path: Path) -> None:
    """A recurrence that runs every millisecond (due at once), and in the same round
    ``pool.cancel(id)``, its future's ``cancel()`` and ``state(id)`` from three threads, each
    after a random spin of up to 1 ms (to meet the runs in every phase: queued, in an inbox,
    running, being settled, the next one being scheduled; every outcome is checked). The
    future's ``cancel()`` says True and the future ends cancelled; ``state()`` never raises;
    afterwards the id rests in a terminal state (a recurrence that went on after its stop would
    be PENDING again within a millisecond) and no run of it is logged after that."""
    rounds = 600
    log = str(tmp_path / "log")
    recurrences: list[mpsched.Future] = []
    rng = random.Random(2024)
    spins = [[rng.uniform(0.0, 0.001) for _ in range(3)] for _ in range(rounds)]
    with fast_switching(), Pool(2) as pool:
        try:
            every = pool.with_options(every=0.001)

            def prepare(i: int) -> None:
                recurrences.append(every.schedule(i, 0.0, 0, tt.log, log, i))

            def spin(seconds: float) -> None:  # varies the timing only (see the docstring)
                end = time.perf_counter() + seconds
                while time.perf_counter() < end:
                    pass

            def by_id(i: int) -> bool:
                spin(spins[i][0])
                return pool.cancel(i)

            def by_future(i: int) -> bool:
                spin(spins[i][1])
                return recurrences[i].cancel()

            def look(i: int) -> TaskState | None:
                spin(spins[i][2])
                return pool.state(i)

            _, mine, seen = race(rounds, by_id, by_future, look, prepare=prepare)
            assert [i for i in range(rounds) if not mine[i]] == [], "cancel() said False"
            assert [i for i, f in enumerate(recurrences) if not f.cancelled()] == []
            assert None not in seen
            terminal = (TaskState.COMPLETED, TaskState.CANCELLED, TaskState.FAILED)
            for i in range(rounds):
                wait_for_state(pool, i, terminal)
            runs = len(tt.read_tags(log))
            assert [i for i in range(rounds) if pool.state(i) not in terminal] == []
            assert len(tt.read_tags(log)) == runs, "a stopped recurrence ran again"
        finally:
            pool.shutdown(cancel_futures=True)


# ---------------------------------------------------------------- reschedule while running
@pytest.mark.timeout(60)
def test_reschedules_racing_a_running_version_never_overlap(tmp_path: Path) -> None:
    """Two threads reschedule the same id (due at once) in every round, while its previous
    version often runs (each run takes ~0.3 ms; two ids on two workers). No two versions of an
    id ever run at once (each logs "start" and "end": per id the log alternates start/end of
    one version), each completed future's version ran exactly once, each cancelled one never
    ran, and every future ends."""
    rounds, ids = 3000, 2
    log = str(tmp_path / "log")
    futures: list[mpsched.Future] = []
    with fast_switching(), Pool(2) as pool:
        # Both workers up first: in a loaded CI run the race (~0.3 s) ended before the first
        # worker came up, and only the last version of each id ran.
        start_every_worker(pool)

        def reschedule(i: int) -> mpsched.Future:
            return pool.schedule(i % ids, 0.0, 0, tt.logged_span, log, 0.0003)

        got = race(rounds, reschedule, reschedule)
        futures = got[0] + got[1]
        _, not_done = wait(futures, timeout=CONDITION_TIMEOUT)
        assert not not_done, f"{len(not_done)} futures never ended"
        states = [pool.state(task_id) for task_id in range(ids)]
    assert states == [TaskState.COMPLETED] * ids  # the last version of each id ran
    running: dict[Any, int] = {}
    ran: list[tuple[Any, int]] = []
    for kind, task_id, version in tt.read_tags(log):
        if kind == "start":
            assert task_id not in running, f"{task_id}: v{version} started while v{running}"
            running[task_id] = version
            ran.append((task_id, version))
        else:
            assert running.pop(task_id) == version
    assert running == {}
    assert len(ran) == len(set(ran)), "a version ran twice"
    assert len(ran) > 20, "the runs were not exercised"
    completed = sorted(f.result() for f in futures if not f.cancelled())
    assert completed == sorted(version for _, version in ran), "ran and completed differ"
    assert 0 < len(completed) < len(futures), "the race was not exercised"


# ---------------------------------------------------------------- shutdown
def race_shutdown(
    pool: Pool, log: str, preloaded: dict[int, mpsched.Future]
) -> dict[int, mpsched.Future]:
    """One round: ``shutdown(cancel_futures=True)`` | a thread scheduling (due now, or far)
    and cancelling by id | a thread cancelling the futures scheduled before the round. Returns
    the futures that the racing schedules gave, by id."""
    scheduled: dict[int, mpsched.Future] = {}
    far = time.monotonic() + FAR

    def closer(_: int) -> None:
        pool.shutdown(cancel_futures=True)

    def scheduler(_: int) -> None:
        closed = False
        for n in range(40):
            task_id = 1000 + n
            run_at = far if n % 3 == 2 else 0.0
            try:
                scheduled[task_id] = pool.schedule(task_id, run_at, 0, tt.log, log, task_id)
            except PoolClosedError:
                closed = True
                continue
            assert not closed, "a schedule was accepted after one was refused as closed"
            if n % 4 == 3:
                pool.cancel(task_id - 2)

    def canceller(_: int) -> list[bool]:
        return [f.cancel() for f in preloaded.values()]

    race(1, closer, scheduler, canceller)
    with pytest.raises(PoolClosedError):
        pool.schedule("late", 0.0, 0, tasks.ident, 0)
    return scheduled


@pytest.mark.timeout(120)
def test_shutdown_with_cancel_futures_races_schedule_and_cancel(tmp_path: Path) -> None:
    """Per round a new pool with due and far-future versions; ``shutdown(cancel_futures=True)``
    from one thread while another schedules and cancels by id and a third cancels futures.
    Every future ends (nothing hangs), a schedule after the close fails with PoolClosedError,
    a cancelled future's version never ran, and every other one ran exactly once and
    completed."""
    rounds = 60
    with fast_switching():
        for r in range(rounds):
            log = str(tmp_path / f"log{r}")
            far = time.monotonic() + FAR
            pool = Pool(1)
            try:
                preloaded = {
                    i: pool.schedule(i, far if i % 2 else 0.0, 0, tt.log, log, i) for i in range(20)
                }
                scheduled = race_shutdown(pool, log, preloaded)
            finally:
                pool.shutdown(cancel_futures=True)
            everything = preloaded | scheduled
            _, not_done = wait(everything.values(), timeout=CONDITION_TIMEOUT)
            assert not not_done, f"round {r}: {len(not_done)} futures never ended"
            ran = tt.read_tags(log)
            assert len(ran) == len(set(ran)), f"round {r}: a version ran twice"
            expected = sorted(i for i, f in everything.items() if not f.cancelled())
            assert sorted(ran) == expected, f"round {r}: ran {ran}, completed {expected}"
            assert all(f.result() > 0 for i, f in everything.items() if i in expected)


@pytest.mark.timeout(120)
def test_state_agrees_with_the_future_when_timeouts_race_cancels_and_completion() -> None:
    """Tasks with ids and a timeout about as long as they run, cancelled by id (some with
    ``force``) or by their future at random moments: whatever wins, ``state()`` and the future
    must tell the same outcome."""
    rng = random.Random(7)
    n = 300
    with Pool(2) as pool:
        futures = {}
        for i in range(n):
            opts = pool.with_options(timeout=0.002, timeout_grace=0.01)
            seconds = rng.choice([0.0, 0.001, 0.003, 0.02])
            ack = rng.random() < 0.5
            futures[i] = opts.schedule(i, 0.0, 0, tt.spin_checking_cancel, seconds, ack)
            if i >= 3 and rng.random() < 0.5:
                j = rng.randrange(i - 3, i + 1)
                how = rng.random()
                if how < 0.4:
                    pool.cancel(j)
                elif how < 0.5:
                    pool.cancel(j, force=True)
                else:
                    futures[j].cancel()
        wait(list(futures.values()), timeout=CONDITION_TIMEOUT * 3)
        states = {i: pool.state(i) for i in futures}
    for i, f in futures.items():
        assert f.done(), f"task {i} never settled"
        if f.cancelled():
            expected = TaskState.CANCELLED
        elif f.exception() is not None:
            expected = TaskState.FAILED
        else:
            expected = TaskState.COMPLETED
        assert states[i] is expected, f"task {i}: future says {expected}, state() {states[i]}"


@pytest.mark.timeout(120)
def test_recurrences_with_every_overlap_policy_under_cancels_reschedules_and_shutdown(
    tmp_path: Path,
) -> None:
    """Recurrences (each overlap policy, each misfire policy, some with a timeout, some whose
    runs raise) on ids that are cancelled, rescheduled (as one-shot tasks or new recurrences)
    and finally stopped by the shutdown, from the test thread while their runs go on; runs due
    every 1-3 ms behind spans of up to 6 ms wait in the inboxes past their grace, where the
    workers drop the "skip" ones. Afterwards: every future ended (none lost), no two runs of an
    id overlapped, no version ran twice, and misfires were counted."""
    log = str(tmp_path / "log")
    rng = random.Random(11)
    ids = 12
    futures: list[mpsched.Future] = []
    pool = Pool(2)
    try:
        for step in range(200):
            task_id = rng.randrange(ids)
            action = rng.random()
            if action < 0.55:
                options = pool.with_options(
                    every=rng.choice([0.001, 0.003]),
                    overlap=rng.choice(["skip", "coalesce", "queue"]),
                    timeout=rng.choice([None, 0.002]),
                    timeout_grace=0.005,
                    misfire=rng.choice(["run_late", "skip"]),
                    misfire_grace=rng.choice([0.0, 0.002]),
                )
                seconds = rng.choice([0.0, 0.002, 0.006])
                args = (log, seconds, rng.choice([0, 3]))
                futures.append(options.schedule(task_id, 0.0, 0, tt.span_or_raise, *args))
            elif action < 0.7:
                args = (log, 0.001, 0)
                futures.append(pool.schedule(task_id, 0.0, 0, tt.span_or_raise, *args))
            elif action < 0.9:
                pool.cancel(task_id, force=rng.random() < 0.1)
            elif futures:
                rng.choice(futures).cancel()
            if step % 4 == 0:  # let a run or two happen in between (bounded: maybe none can)
                seen = tt.count_records(log)
                deadline = time.monotonic() + 0.05
                while tt.count_records(log) < seen + 2 and time.monotonic() < deadline:
                    time.sleep(0.0005)
    finally:
        pool.shutdown(wait=True)
    assert pool.statistics().misfires > 0, "the misfire policy was not exercised"
    not_done = [f for f in futures if not f.done()]
    assert not not_done, f"{len(not_done)} futures never ended"
    running: dict[Any, tuple[int, int]] = {}
    ran: list[tuple[Any, int]] = []
    for kind, task_id, version, pid in tt.read_tags(log):
        if kind == "start":
            if task_id in running:  # only if that run's worker was killed (timeout, force)
                other, other_pid = running[task_id]
                assert not psutil.pid_exists(other_pid), f"{task_id}: v{version} overlaps v{other}"
            running[task_id] = (version, pid)
            ran.append((task_id, version))
        else:
            assert running.pop(task_id) == (version, pid)
    assert len(ran) == len(set(ran)), "a version ran twice"
    assert len(ran) > 20, "the runs were not exercised"
