"""Edge cases of Pool.map, nested tasks, the stash, retirement and crashes."""

from __future__ import annotations

import functools
import os
import pathlib
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import CancelledError, wait
from concurrent.futures import TimeoutError as FuturesTimeoutError
from typing import Any

import pytest

from mpsched import (
    BrokenPoolError,
    Pool,
    PoolClosedError,
    TaskPicklingError,
    WorkerCrashedError,
    _map,
    _startup,
    _worker,
)
from mpsched._coordinator import Coordinator
from mpsched._errors import InternalError, ProtocolError
from mpsched._future import CallbackRunner, Future
from mpsched._protocol import Tag
from mpsched._slot_region import MAX_NESTING
from mpsched._zygote import FDS_PER_MESSAGE

from . import bad_tasks, tasks
from . import edge_tasks as et
from .conditions import Fifos, wait_until


@pytest.fixture
def gates(tmp_path: object) -> tuple[str, str, str]:
    """A FIFO the blocker announces itself on, the FIFO gate it waits at, and a log file."""
    started = os.path.join(str(tmp_path), "started")
    gate = os.path.join(str(tmp_path), "gate")
    log = os.path.join(str(tmp_path), "log")
    os.mkfifo(started)
    os.mkfifo(gate)
    open(log, "wb").close()
    return started, gate, log


# ---------------------------------------------------------------- map
@pytest.mark.timeout(60)
def test_map_timeout_cancels_the_chunk_it_timed_out_on(gates: tuple[str, str, str]) -> None:
    """A map whose result times out must cancel every chunk not yet claimed, including the
    one it was waiting for (the stdlib fixed the same leak in gh-95166)."""
    started, gate, log = gates
    with Pool(1) as pool:
        blocker = pool.submit(tasks.started_then_gated, started, gate, "blocker")
        tasks.wait_started(started)  # the only worker is busy: every chunk stays queued
        results = pool.map(
            functools.partial(et.record_ident, log), [1, 2, 3], chunksize=1, timeout=0.05
        )
        with pytest.raises(FuturesTimeoutError, match=r"counted from the map\(\) call"):
            next(results)
        tasks.open_gate(gate)
        assert blocker.result(timeout=20) == "blocker"
    assert tasks.read_log(log) == []  # no chunk of the abandoned map ran


def _force_down(pool: Pool) -> None:
    """End a pool that may be stuck: shutdown without waiting, then kill its zygote (its
    workers die with it) if the drain does not end."""
    pool.shutdown(wait=False, cancel_futures=True)
    if not pool.await_termination(10):
        pool._zygote.kill()
        assert pool.await_termination(20)


@pytest.mark.timeout(60)
def test_results_taken_with_one_that_cannot_be_read_all_settle(
    gates: tuple[str, str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A collector takes a batch of handles from a done ring and frees their blocks. When
    reading one result raised (here the stash), the futures of that one and of those after it
    in the batch never settled: a waiter hung, and completed tasks failed with the broken pool's
    error. Now the unreadable one fails (BrokenPoolError) and the rest keep their results."""
    started, gate, _ = gates
    announced = os.path.join(os.path.dirname(started), "announced")
    os.mkfifo(announced)
    collecting = threading.Event()
    real_collect = Coordinator.collect

    def gated_collect(self: Coordinator) -> None:  # skipped until the batch is complete
        if collecting.is_set():
            real_collect(self)

    def lost_stash(self: Coordinator, key: int, slot: int) -> bytes:
        raise ProtocolError(f"stashed result {key} lost (injected)")

    monkeypatch.setattr(Coordinator, "collect", gated_collect)
    monkeypatch.setattr(Coordinator, "stash_take", lost_stash)
    pool = Pool(1, start_method="fork")
    try:
        first = pool.submit(tasks.started_then_gated, started, gate, "first")
        tasks.wait_started(started)  # the one worker is busy: the rest queue in its inbox
        big = pool.submit(tasks.make_bytes, 500_000)  # too big for a block chain: stashed
        small = [pool.submit(tasks.ident, i) for i in range(3)]
        last = pool.submit(et.announce, announced)
        tasks.open_gate(gate)
        # The worker runs them in order: once the last one runs, the others are in the ring.
        tasks.wait_started(announced)
        collecting.set()
        pool._wakeup.wakeup()
        not_done = wait([first, big, *small], timeout=20).not_done
        assert not not_done, "a future of a handle taken from the done ring never settled"
        assert first.result() == "first"
        assert [f.result() for f in small] == [0, 1, 2]
        error = big.exception()
        assert isinstance(error, BrokenPoolError)
        assert "could not be read" in str(error)
        assert "lost (injected)" in str(error)
        assert wait([last], timeout=20).done  # the pool broke (a lost stash) or it ran
    finally:
        collecting.set()
        _force_down(pool)


# ---------------------------------------------------------------- nested tasks
@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [1, 2])
def test_a_chain_of_nested_joins_deeper_than_the_run_stack_finishes(workers: int) -> None:
    """Each task joins its only child; join-helping runs the child inside the parent, so the
    run stack grows by one per level. Deeper than MAX_NESTING (64), the worker stops helping
    and sleeps, while the child it waits for sits in its own deque."""
    pool = Pool(workers)
    try:
        assert pool.submit(et.chain, 200).result(timeout=20) == 200
    finally:
        _force_down(pool)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("siblings", [1, 3])
def test_a_join_past_the_helping_depth_runs_the_own_childs_it_waits_for(siblings: int) -> None:
    """At the helping depth (MAX_NESTING - 1 nested runs) a join claims nothing more on the
    run stack. A child there that joins a sibling's future (kept in a global) found it in its
    own deque, where no peer of Pool(1) could steal it: the worker spun at 100% CPU for ever
    (and the shutdown hung). Now it runs its own children unrecorded. The depths cross the
    limit: the last link of the chain runs at depth ``depth``, its children one deeper."""
    pool = Pool(1)
    try:
        for depth in range(MAX_NESTING - 5, MAX_NESTING + 3):
            future = pool.submit(et.join_siblings_at, depth, siblings)
            assert future.result(timeout=10) == siblings, depth
        assert pool.statistics().per_worker[0].deque_depth == 0
        pool.shutdown(wait=True)
    finally:
        _force_down(pool)


@pytest.mark.timeout(90)
def test_a_worker_killed_in_an_unrecorded_childs_done_leaks_no_block_and_no_stash() -> None:
    """A child run unrecorded (past the helping depth) is in no ring and on no run stack: a
    death of its worker leaves its block to the recovery of its dead parent, which frees it as
    one never published, and drops the result the child had stashed before its DONE (the
    recovery dropped only the stashed arguments of such a block: the result's bytes stayed in
    the coordinator's stash for the pool's life)."""
    with Pool(1) as pool:
        slab = pool._views.slab
        free = slab.free_count()
        future = pool.submit(et.join_siblings_at, MAX_NESTING - 2, 1, 4_000_000, True)
        with pytest.raises(WorkerCrashedError):
            future.result(timeout=30)
        coordinator = pool._coordinator
        wait_until(lambda: slab.free_count() == free, "a block of the dead worker stayed taken")
        assert not coordinator.stash, "the unrecorded child's stashed result stayed"
        assert pool.submit(tasks.ident, 5).result(timeout=20) == 5  # replaced


@pytest.mark.timeout(60)
def test_a_parent_that_raises_after_spawning_children_loses_none(tmp_path: object) -> None:
    log = os.path.join(str(tmp_path), "log")
    open(log, "wb").close()
    with Pool(2) as pool:
        futures = [pool.submit(et.parent_raises_after_children, log, 20) for _ in range(10)]
        for f in futures:
            with pytest.raises(ValueError, match="parent failed"):
                f.result(timeout=20)
    assert sorted(tasks.read_log(log)) == sorted(list(range(20)) * 10)  # every child ran once


@pytest.mark.timeout(60)
def test_a_parent_catches_its_childs_error(pool2: Pool) -> None:
    assert pool2.submit(et.parent_catches_child_error).result(timeout=20) == "caught from child"
    # An unpicklable child result is the child's error, seen by the parent; a big one works.
    text = pool2.submit(et.child_returns_unpicklable).result(timeout=20)
    assert text.startswith("RuntimeError") or "pickle" in text
    assert pool2.submit(et.child_huge, 3_000_000).result(timeout=20) == 3_000_000
    assert len(pool2.submit(et.huge_result, 8_000_000).result(timeout=20)) == 8_000_000


@pytest.fixture
def pool2() -> Pool:
    with Pool(2) as pool:
        yield pool


@pytest.mark.timeout(60)
def test_shutdown_cancel_futures_with_children_pending(gates: tuple[str, str, str]) -> None:
    """Children queued in the deque of a parent that still runs are not the coordinator's to
    cancel: they run, the parent gets their results, and the drain ends."""
    started, gate, log = gates
    pool = Pool(1)
    parent = pool.submit(et.gated_parent_of_children, started, gate, log, 50)
    queued = [pool.submit(tasks.ident, i) for i in range(100)]
    tasks.wait_started(started)
    pool.shutdown(wait=False, cancel_futures=True)
    tasks.open_gate(gate)
    assert pool.await_termination(20)
    assert parent.result(timeout=0) == sum(range(50))
    assert sorted(tasks.read_log(log)) == list(range(50))
    assert all(f.done() for f in queued)


@pytest.mark.timeout(60)
def test_sigkill_of_a_parent_with_children_in_its_deque(gates: tuple[str, str, str]) -> None:
    """The parent fails with WorkerCrashedError; its children, queued in the dead worker's
    deque, are ordinary tasks and still run, exactly once; nothing hangs."""
    started, gate, log = gates
    with Pool(1) as pool:
        parent = pool.submit(et.join_children_then_die, started, gate, log, 30)
        pid = tasks.read_pid(started)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerCrashedError):
            parent.result(timeout=20)
        assert pool.submit(tasks.ident, 5).result(timeout=20) == 5
    assert sorted(tasks.read_log(log)) == list(range(30))
    stats = pool.statistics()
    assert stats.crashes == 1


@pytest.mark.timeout(60)
def test_retirement_while_tasks_with_children_queue() -> None:
    with Pool(2, max_tasks_per_worker=1) as pool:
        futures = [pool.submit(et.spawn_and_join, 10) for _ in range(40)]
        assert [f.result(timeout=30) for f in futures] == [45] * 40
    stats = pool.statistics()
    assert stats.crashes == 0
    # Not 39: a worker joining its children may run further top-level tasks from its inbox
    # (join-helping) before it can retire.
    assert stats.recycled >= 1


@pytest.mark.timeout(60)
def test_os_exit_in_a_task_and_in_a_child(pool2: Pool) -> None:
    with pytest.raises(WorkerCrashedError, match="exit code 7"):
        pool2.submit(et.exit_now, 7).result(timeout=20)
    assert pool2.submit(tasks.fib, 10).result(timeout=20) == 55


@pytest.mark.timeout(60)
def test_statistics_count_every_task_and_child() -> None:
    with Pool(2) as pool:
        futures = [pool.submit(et.spawn_and_join, 5) for _ in range(100)]
        assert [f.result(timeout=30) for f in futures] == [10] * 100
        assert list(pool.map(tasks.ident, range(50), chunksize=10)) == list(range(50))
    stats = pool.statistics()
    assert stats.submitted == stats.completed == 105
    assert sum(w.executed for w in stats.per_worker) == 100 * 6 + 5


# ---------------------------------------------------------------- more map
@pytest.mark.timeout(60)
def test_map_error_at_a_position_with_chunksize_one(pool2: Pool) -> None:
    results = pool2.map(functools.partial(et.fail_at, bad=5), range(10), chunksize=1)
    assert [next(results) for _ in range(5)] == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="bad item 5"):
        next(results)
    with pytest.raises(StopIteration):
        next(results)
    assert pool2.submit(tasks.ident, 1).result(timeout=20) == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunksize", [1, 3, None, 1000])
def test_map_reads_each_item_once_and_passes_input_errors(
    pool2: Pool, chunksize: int | None
) -> None:
    pulled: list[int] = []

    def items():
        for i in range(40):
            pulled.append(i)
            yield i
        raise OSError("input broke")

    results = pool2.map(tasks.ident, items(), chunksize=chunksize)
    got: list[int] = []
    with pytest.raises(OSError, match="input broke"):
        got.extend(results)  # keeps what came before the raise
    assert pulled == list(range(40))  # each item read once, in order
    # As the builtin map: every item read before the error has its result first (the
    # read-ahead met the error while those items' chunks were still in flight, and raised it
    # at once, dropping their results and cancelling what was not claimed yet).
    assert got == list(range(40))
    with pytest.raises(StopIteration):
        next(results)
    assert pool2.submit(tasks.ident, 2).result(timeout=20) == 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunksize", [1, None])
def test_map_input_errors_come_in_input_order(pool2: Pool, chunksize: int | None) -> None:
    def items():
        yield from range(30)
        raise OSError("input broke")

    results = pool2.map(functools.partial(et.fail_at, bad=7), items(), chunksize=chunksize)
    got: list[int] = []
    with pytest.raises(ValueError, match="bad item 7"):  # the task's error comes first
        got.extend(results)
    assert got == list(range(7))
    results = pool2.map(tasks.add, range(100), items(), chunksize=chunksize)  # zip's error
    got = []
    with pytest.raises(OSError, match="input broke"):
        got.extend(results)
    assert got == [2 * i for i in range(30)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("timeout", [None, 60])
def test_an_inputs_own_timeout_error_is_not_taken_for_the_maps(
    pool2: Pool, timeout: float | None
) -> None:
    """A TimeoutError of the input (a socket's read, say) comes as it was raised, not as the
    map's own timeout, whose message it had taken (diff review)."""

    def items() -> Iterator[int]:
        yield from range(3)
        raise TimeoutError("the source timed out")

    results = pool2.map(tasks.ident, items(), timeout=timeout)
    got: list[int] = []
    # The builtin class the input raised (on Python 3.10 not concurrent.futures' TimeoutError).
    with pytest.raises(TimeoutError, match="the source timed out") as info:
        got.extend(results)
    assert type(info.value) is TimeoutError
    assert got == [0, 1, 2]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunksize", [7, None])
def test_map_item_that_does_not_pickle_fails_at_its_position(
    pool2: Pool, chunksize: int | None
) -> None:
    """As the builtin map: every result before it comes first, those of its own chunk too,
    and the error names the item. (The read-ahead's submit raised at once: how many results
    came first depended on how far ahead it read, 30 of 100 here; then the chunk's task
    failed with the item and dropped the results of the items before it in the chunk, 100 //
    size * size results, as with ProcessPoolExecutor.map.)"""
    items: list[Any] = [*range(100), threading.Lock(), *range(50)]
    got: list[int] = []
    with pytest.raises(TaskPicklingError, match=r"cannot pickle <unlocked _thread\.lock"):
        got.extend(pool2.map(tasks.ident, items, chunksize=chunksize))
    assert got == list(range(100))
    assert pool2.submit(tasks.ident, 3).result(timeout=20) == 3


@pytest.mark.timeout(60)
def test_map_with_a_function_that_does_not_pickle_fails_naming_it(
    pool2: Pool,
) -> None:
    """The error names the function (not the task's arguments, which is what map's function
    is to the chunk's task), and nothing was sent."""
    lock = threading.Lock()
    submitted = pool2.statistics().submitted
    results = pool2.map(lambda x: (lock, x), range(10), chunksize=3)
    with pytest.raises(TaskPicklingError, match="cannot pickle <function test_map_with_a"):
        next(results)
    assert pool2.statistics().submitted == submitted


@pytest.mark.timeout(60)
def test_map_across_shutdown_yields_the_results_of_the_chunks_sent_before() -> None:
    """A map reading an iterator (maybe endless: shutdown cannot read it to its end): the
    chunks sent before ``shutdown()`` ran (it lets them finish), their results come, then
    PoolClosedError, where the next chunk could not go. (The read-ahead's submit raised at
    once, dropping them.)"""
    pool = Pool(1)
    results = pool.map(tasks.ident, iter(range(1000)), chunksize=10)
    assert next(results) == 0
    pool.shutdown()
    got: list[int] = []
    with pytest.raises(PoolClosedError):
        got.extend(results)
    assert got == list(range(1, 10 * _map.MAP_PREFETCH_PER_WORKER))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("consumed", [0, 1])
def test_map_of_an_input_with_a_length_yields_every_result_after_shutdown(consumed: int) -> None:
    """``with Pool() as p: results = p.map(f, items)``, read after the block, as with
    ProcessPoolExecutor: shutdown sends the rest of an input with a length (finite), and lets
    it run, and the iterator yields every result (it raised PoolClosedError after the first
    window's)."""
    with Pool(1) as pool:
        results = pool.map(tasks.ident, range(1000), chunksize=10)
        assert [next(results) for _ in range(consumed)] == list(range(consumed))
        mixed = pool.map(tasks.add, range(500), iter(range(10**9)))  # zip ends with the range
    assert list(results) == list(range(consumed, 1000))
    assert list(mixed) == [2 * i for i in range(500)]


@pytest.mark.timeout(60)
def test_a_map_dropped_unread_runs_to_its_end_and_one_dropped_while_read_is_abandoned() -> None:
    """``pool.map(f, items)`` as a statement (for its side effects) runs every item, as with
    ProcessPoolExecutor (its first window ran, the rest never); a map whose reader dropped it
    is abandoned: what was not sent never is (an iterator: one with a length, not read yet,
    goes on as its chunks end, which a reader slow to call ``next()`` would count here)."""
    with Pool(1) as pool:
        pool.map(tasks.ident, range(1000), chunksize=10)  # dropped at once, unread
        read = pool.map(tasks.ident, iter(range(1000)), chunksize=10)
        assert next(read) == 0
        del read
    # the second sent no more than its read-ahead: the chunk read and those in flight
    assert 100 <= pool.statistics().completed <= 100 + 1 + _map.MAP_PREFETCH_PER_WORKER
    with Pool(1) as pool:
        pool.map(tasks.ident, range(1000), chunksize=10)
    assert pool.statistics().completed == 100


@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunks", ["of 10", "stopping at their budget"])
@pytest.mark.parametrize("how", ["dropped", "closed"])
def test_a_map_left_unread_runs_on_before_the_shutdown_and_leaves_the_pool(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, how: str, chunks: str
) -> None:
    """A map called for its side effects in a pool that lives on (a pipeline's) runs on as
    workers finish its chunks, and once done the pool lets it go. It ran its first window at
    the call and the rest only at the shutdown, keeping its input and results until then
    (5,000 such maps of 1,000 items held 150 MB). Default chunks that stop at their budget
    (here after each item) leave rests that go too."""
    chunksize = 10 if chunks == "of 10" else None
    if chunksize is None:
        monkeypatch.setattr(_map, "MAP_CHUNK_BUDGET", 0.0)
    log = tmp_path / "log"
    log.touch()
    with Pool(2) as pool:
        results = pool.map(tasks.record, [str(log)] * 500, range(500), chunksize=chunksize)
        if how == "closed":
            results.close()
        del results
        wait_until(lambda: len(tasks.read_log(str(log))) == 500, "every item ran")
        wait_until(lambda: not pool._unread_maps, "the pool let the map go")
        assert sorted(tasks.read_log(str(log))) == list(range(500))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("taken_up_by", ["callback thread", "next map"])
def test_a_map_dropped_unread_after_its_chunks_ended_is_let_go(
    monkeypatch: pytest.MonkeyPatch, taken_up_by: str
) -> None:
    """No chunk of it is left to find its iterator gone: the iterator's drop has the pool's
    callback thread take it up, or, if that thread does not run, the pool's next ``map()``
    (it stayed, with its input and results, until the shutdown)."""
    if taken_up_by == "next map":
        monkeypatch.setattr(CallbackRunner, "poke", lambda self, call: False)
    with Pool(1) as pool:
        results = pool.map(tasks.ident, range(100), chunksize=10)
        wait_until(lambda: pool.statistics().completed == 4, "the first window ran")
        del results
        if taken_up_by == "next map":
            assert len(pool._unread_maps) == 1
            assert list(pool.map(tasks.ident, [1])) == [1]
        wait_until(lambda: not pool._unread_maps, "the pool let the map go")
        assert pool.statistics().completed == 10 + (taken_up_by == "next map")


class _ThreadsReading:
    """An iterator that notes the threads that read it (a database cursor may be bound to
    the thread that made it)."""

    def __init__(self, n: int) -> None:
        self.items = iter(range(n))
        self.threads: set[str] = set()

    def __iter__(self) -> _ThreadsReading:
        return self

    def __next__(self) -> int:
        self.threads.add(threading.current_thread().name)
        return next(self.items)


class _Table:
    """An input with a length whose iterator is one of the user's (a query's rows)."""

    def __init__(self, n: int) -> None:
        self.rows = _ThreadsReading(n)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> _ThreadsReading:
        return self.rows


class _Rows(list[int]):
    """A list of the user's whose iterator is a cursor's."""

    def __init__(self, n: int) -> None:
        super().__init__(range(n))
        self.rows = _ThreadsReading(n)

    def __iter__(self) -> _ThreadsReading:  # type: ignore[override]
        return self.rows


@pytest.mark.timeout(60)
@pytest.mark.parametrize("timeout", [None, 60.0])
@pytest.mark.parametrize("shape", ["zipped", "sized", "list subclass"])
def test_an_input_of_the_users_is_read_by_the_maps_reader_only(
    shape: str, timeout: float | None
) -> None:
    """A map of built-in containers goes on as its chunks end (read by the thread that
    settles them) until its first read, or its deadline; an input of the user's, with a
    length or not, zipped with a range or not, is read by the reader only: it may be bound to
    its thread (read in the callback thread, a sqlite3 cursor raised ProgrammingError)."""
    with Pool(2) as pool:
        cursor = _ThreadsReading(1000)
        if shape == "zipped":
            results = pool.map(tasks.add, range(1000), cursor, chunksize=10, timeout=timeout)
        else:
            table: _Table | _Rows = _Table(1000) if shape == "sized" else _Rows(1000)
            cursor = table.rows
            results = pool.map(tasks.add, table, table, chunksize=10, timeout=timeout)
        (run,) = pool._maps.live()
        assert not run.eager
        window = 2 * _map.MAP_PREFETCH_PER_WORKER
        wait_until(lambda: pool.statistics().completed == window, "the first window ran")
        assert list(results) == (
            [2 * k for k in range(1000)]
            if shape == "zipped"
            else [k + k + 1 for k in range(0, 1000, 2)]
        )
        assert cursor.threads == {threading.current_thread().name}


@pytest.mark.timeout(60)
def test_a_dropped_maps_chunks_are_sized_from_their_results() -> None:
    """Default chunks are sized from the results' times, which the reader measured: a map
    nobody read went on in chunks of 64 items, one per worker, 20-40 times slower than one
    read at once. (Polled: one measurement that a preemption slowed, on a loaded machine, may
    size a chunk smaller; the next ones size it up again.)"""
    with Pool(2) as pool:
        results = pool.map(tasks.ident, range(100_000))
        (run,) = pool._maps.live()
        del results
        wait_until(lambda: run.size > _map.MAP_FIRST_CHUNK, "chunks sized from their results")
        wait_until(lambda: not pool._unread_maps, "the pool let the map go")


@pytest.mark.timeout(60)
def test_a_map_dropped_unread_runs_the_items_after_one_that_raised(tmp_path: pathlib.Path) -> None:
    """A chunk ends at an item that raises (a read map raises there). Nobody reads a dropped
    one: the items after it in its chunk never ran (some dozens, as the chunking went), where
    ProcessPoolExecutor.map's would all run."""
    log = tmp_path / "log"
    log.touch()
    with Pool(1) as pool:
        results = pool.map(et.record_then_raise_at, [str(log)] * 300, range(300), [5] * 300)
        del results
        wait_until(lambda: len(tasks.read_log(str(log))) == 300, "every item ran")
        wait_until(lambda: not pool._unread_maps, "the pool let the map go")
        assert sorted(tasks.read_log(str(log))) == list(range(300))


@pytest.mark.timeout(60)
def test_a_map_dropped_unread_runs_the_rest_of_a_chunk_whose_first_item_raised(
    tmp_path: pathlib.Path,
) -> None:
    """A chunk whose first item raises fails as a task, with that item's error: the other
    items of a dropped map's chunk never ran (9 of every 10 here)."""
    log = tmp_path / "log"
    log.touch()
    ks = range(300)
    bad = [k if k % 10 == 0 else -1 for k in ks]
    with Pool(1) as pool:
        results = pool.map(et.record_then_raise_at, [str(log)] * 300, ks, bad, chunksize=10)
        del results
        wait_until(lambda: not pool._unread_maps, "the pool let the map go")
    assert sorted(tasks.read_log(str(log))) == list(ks)


@pytest.mark.timeout(60)
def test_a_map_dropped_unread_sends_nothing_again_of_a_chunk_that_did_not_load(
    tmp_path: pathlib.Path,
) -> None:
    """A chunk's task that fails ran no item to its end: an argument that does not unpickle
    in the worker fails it before any runs. Taken for its first item's error, the items
    after that one went again (and a fn that does not load went again item by item)."""
    log = tmp_path / "log"
    log.touch()
    items: list[Any] = [0, 1, 2, bad_tasks.ErrorAtUnpickle(), *range(4, 10)]
    with Pool(1) as pool:
        results = pool.map(tasks.record, [str(log)] * 10, items, chunksize=10)
        del results
        wait_until(lambda: not pool._unread_maps, "the pool let the map go")
        assert pool.statistics().submitted == 1
    assert tasks.read_log(str(log)) == []


@pytest.mark.timeout(60)
def test_a_map_dropped_unread_sends_nothing_again_after_a_crash(tmp_path: pathlib.Path) -> None:
    """A chunk whose worker died fails as a task too, but its items may have run: nothing of
    it goes again (here its first item ran and ended the worker); the rest of the map runs."""
    log = tmp_path / "log"
    log.touch()
    with Pool(1) as pool:
        results = pool.map(
            et.record_then_exit_at, [str(log)] * 300, range(300), [10] * 300, chunksize=10
        )
        del results
        wait_until(lambda: not pool._unread_maps, "the pool let the map go")
    assert sorted(tasks.read_log(str(log))) == [*range(11), *range(20, 300)]


@pytest.mark.timeout(60)
def test_a_map_closed_while_the_shutdown_sends_its_chunks_again_leaves_the_shutdown_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The iterator's close clears the chunks in flight without the run's lock (it may run
    inside the garbage collector); a shutdown sending a withdrawn chunk again met the cleared
    deque (a review saw "deque mutated during iteration", with a delay injected) and raised,
    leaving the pool open. Here the close comes right after the chunk's place was found."""
    found = _map.MapRun._unlist
    closes: list[int | None] = []

    def unlist_then_close(run: _map.MapRun, future: Any) -> int | None:
        index = found(run, future)
        if not closes:
            closes.append(index)
            results.close()
        return index

    pool = Pool(2)
    try:
        results = pool.map(tasks.spin, [0.005] * 400)
        assert next(results) == 0.005
        monkeypatch.setattr(_map.MapRun, "_unlist", unlist_then_close)
        pool.shutdown(wait=True)
    finally:
        monkeypatch.undo()
        pool.shutdown(wait=True, cancel_futures=True)
    assert closes, "no chunk was sent again"
    assert closes[0] is not None
    assert pool.await_termination(0)


@pytest.mark.timeout(120)
def test_a_maps_big_fn_goes_in_few_chunks() -> None:
    """``fn`` travels pickled in every chunk; sized by the items alone, a partial over 10 MB
    went with each of ~500 chunks of 2 ms (23.5 s for 0.5 s of work, a review's case)."""
    table = b"q" * (4 << 20)
    with Pool(2) as pool:
        before = pool.statistics().submitted
        results = list(pool.map(functools.partial(et.spin_plus_len, table), range(2000)))
        chunks = pool.statistics().submitted - before
    assert results == [k + len(table) for k in range(2000)]
    # 5-8 on an idle machine; a loaded one stops more chunks at their time budget (21 seen with
    # a second suite running beside this one). Sized by the items alone: ~500.
    assert chunks <= 60, chunks


class _Stream:
    """A map's input that waits for each item (a queue's ``get``): ``waiting`` is set while it
    waits with nothing queued."""

    def __init__(self, items: list[int]) -> None:
        self.queue: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        for item in items:
            self.queue.put(item)
        self.waiting = threading.Event()

    def __iter__(self) -> _Stream:
        return self

    def __next__(self) -> int:
        if self.queue.empty():
            self.waiting.set()
        item = self.queue.get()
        if item is None:
            raise StopIteration
        return item


@pytest.mark.timeout(60)
@pytest.mark.parametrize("wait", [False, True])
def test_a_shutdown_does_not_wait_for_a_maps_input_that_waits(wait: bool) -> None:
    """The map's thread read its input holding the run's lock, which the shutdown takes: a
    shutdown (``wait=False`` too, in a SIGTERM handler, at the interpreter's exit) hung until
    the stream gave its next item, for ever if it never came."""
    stream = _Stream(list(range(10)))
    got: list[Any] = []
    with Pool(2) as pool:
        reader = threading.Thread(
            target=lambda: got.append(_read_all(pool.map(tasks.ident, stream)))
        )
        reader.start()
        assert stream.waiting.wait(30)
        stopper = threading.Thread(target=pool.shutdown, kwargs={"wait": wait})
        stopper.start()
        stopper.join(10 if not wait else 30)
        returned = not stopper.is_alive()
        stream.queue.put(None)  # (so that a hung shutdown and the reader end, for the report)
        stopper.join()
        reader.join()
    assert returned, "the shutdown waited for the map's input"
    ((results, error),) = got
    assert results == []  # the first window waited for its 11th item: none of it went
    assert isinstance(error, PoolClosedError)


def _read_all(results: Any) -> tuple[list[Any], BaseException | None]:
    out: list[Any] = []
    try:
        out.extend(results)
    except Exception as exc:
        return out, exc
    return out, None


@pytest.mark.timeout(60)
def test_a_map_dropped_unread_past_its_deadline_runs_to_its_end(tmp_path: pathlib.Path) -> None:
    """Past its deadline a map sends only as it is read; dropped unread then, it stopped and
    stayed, with its input, until the shutdown sent the rest."""
    log = tmp_path / "log"
    log.touch()
    with Pool(2) as pool:
        results = pool.map(tasks.record, [str(log)] * 300, range(300), chunksize=1, timeout=0.0)
        (run,) = pool._maps.live()
        wait_until(lambda run=run: run.unfinished == 0, "the first window and its callbacks")
        del results
        del run
        wait_until(lambda: len(tasks.read_log(str(log))) == 300, "every item ran")
        wait_until(lambda: not pool._unread_maps, "the pool let the map go")


class _CtrlCWhenPickled:
    """An item whose first pickling is interrupted (a Ctrl-C while the map's first window
    is sent); pickled again, it is its number."""

    interrupted = False

    def __init__(self, k: int) -> None:
        self.k = k

    def __reduce__(self) -> tuple[type[int], tuple[int]]:
        if not _CtrlCWhenPickled.interrupted:
            _CtrlCWhenPickled.interrupted = True
            raise KeyboardInterrupt
        return int, (self.k,)


@pytest.mark.timeout(60)
def test_a_ctrl_c_in_map_stops_the_map() -> None:
    """A Ctrl-C while ``map()`` sent its first window: the map is not read, and sends nothing
    more, also once its iterator, kept by the exception's frames (a REPL keeps the last one),
    is dropped: taken up as one dropped unread, it sent the whole input."""
    _CtrlCWhenPickled.interrupted = False
    items: list[Any] = [0, 1, 2, _CtrlCWhenPickled(3), *range(4, 1000)]
    with Pool(1) as pool:
        with pytest.raises(KeyboardInterrupt) as excinfo:
            pool.map(tasks.ident, items, chunksize=1)
        (run,) = pool._maps.live()
        del excinfo  # and with it the iterator
        taken_up = threading.Event()
        assert pool._coordinator.callbacks.poke(taken_up.set)  # after the drop's own call
        assert taken_up.wait(timeout=20)
        assert run.closed
        assert pool.statistics().submitted == 3


@pytest.mark.timeout(60)
def test_a_map_whose_chunks_stop_at_their_budget_yields_every_result_after_shutdown(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Default chunks stop at their budget (items slower than ~0.16 ms) and leave the rest to
    go again: shutdown sends those rests too (the iterator did, once read: read after the
    block it raised PoolClosedError, and a map used for its side effects lost all but its
    first window's first items)."""
    monkeypatch.setattr(_map, "MAP_CHUNK_BUDGET", 0.0)  # every chunk stops after one item
    log = tmp_path / "log"
    log.touch()
    with Pool(2) as pool:
        results = pool.map(tasks.ident, range(300))
        pool.map(tasks.record, [str(log)] * 200, range(200))  # unread, for its side effects
    assert list(results) == list(range(300))
    assert sorted(tasks.read_log(str(log))) == list(range(200))


@pytest.mark.timeout(60)
def test_a_maps_chunks_unclaimed_at_shutdown_go_again_whole(tmp_path: pathlib.Path) -> None:
    """Default chunks may stop at their budget, so shutdown withdraws those that no worker
    claimed and sends them again whole (``MapRun.send_rest``): withdrawn and not sent again,
    the map's reader got CancelledError after the pool's end."""
    fifos = Fifos(tmp_path)
    with Pool(1) as pool:
        blocker = pool.submit(tasks.started_then_gated, fifos.started, fifos.gate, "blocker")
        tasks.wait_started(fifos.started)
        try:
            results = pool.map(tasks.ident, range(400))  # its chunks wait behind the blocker
            pool.shutdown(wait=False)
        finally:
            tasks.open_gate(fifos.gate)
        assert blocker.result(timeout=20) == "blocker"
        assert list(results) == list(range(400))


@pytest.mark.timeout(60)
def test_a_map_that_raised_sends_nothing_more_at_shutdown(tmp_path: pathlib.Path) -> None:
    """The error's traceback (kept here by ``excinfo``) keeps the map's frame and its run
    among the pool's maps: leaving the block ran the rest of its input (2,945 of 3,000)."""
    log = tmp_path / "log"
    log.touch()
    paths = [str(log)] * 3000
    paths[5] = str(tmp_path / "missing" / "log")  # item 5 raises FileNotFoundError
    with Pool(2) as pool, pytest.raises(FileNotFoundError) as excinfo:
        list(pool.map(tasks.record, paths, range(3000), chunksize=10))
    assert excinfo.traceback  # alive up to here
    ran = tasks.read_log(str(log))
    assert len(ran) <= 10 * _map.MAP_PREFETCH_PER_WORKER * 2, len(ran)  # what was in flight


class _GatedItems:
    """A sized input whose iteration waits at item ``at`` until ``go`` is set (``reached``
    says it got there): it holds ``Pool.shutdown`` inside its ``send_rest``."""

    def __init__(self, n: int, at: int) -> None:
        self.n, self.at = n, at
        self.reached, self.go = threading.Event(), threading.Event()

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Any:
        for i in range(self.n):
            if i == self.at:
                self.reached.set()
                assert self.go.wait(30)
            yield i


@pytest.mark.timeout(60)
def test_a_map_called_while_a_shutdown_sends_the_rest_of_maps_is_refused() -> None:
    """Shutdown took its list of maps before it closed the pool: a map called between them
    was accepted, sent its first window and lost the rest (128 of 1,000 results, then
    PoolClosedError). It is refused at the call now; the map shutdown holds yields all."""
    pool = Pool(2)
    gated = _GatedItems(1000, 300)  # past the first window (2 chunks of 64)
    held = pool.map(tasks.ident, gated)
    closer = threading.Thread(target=pool.shutdown)
    closer.start()
    try:
        assert gated.reached.wait(30)
        with pytest.raises(PoolClosedError):
            pool.map(tasks.ident, range(1000))
    finally:
        gated.go.set()
        closer.join(30)
    assert list(held) == list(range(1000))


@pytest.mark.timeout(60)
def test_a_ctrl_c_while_shutdown_waits_for_a_maps_chunks_stops_the_pool_now(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shutdown waits for the chunks of a map that may stop at their budget (to send what
    they leave): a Ctrl-C there means "stop now", as in the drain's wait (the pool stayed
    open, its tasks running). The interrupt is raised by the wait itself (``wait_done``): a
    real SIGINT can land inside the stdlib's ``Condition.wait``, which then hangs re-taking
    its lock. Both
    chunks run first: an unclaimed one is not waited for (sent again whole instead). Each
    chunk's first item announces itself on its own FIFO (two on one: both wrote, one byte was
    read and the other lost)."""
    gate = str(tmp_path / "gate")
    started = [str(tmp_path / f"started{k}") for k in range(2)]
    for path in (gate, *started):
        os.mkfifo(path)

    def interrupted_wait(future: Future, timeout: float | None = None) -> bool:
        raise KeyboardInterrupt

    pool = Pool(2)
    announce = [started[0], started[0], started[1], started[1]]  # a chunk of 2 a worker
    results = pool.map(tasks.started_then_gated, announce, [gate] * 4, range(4))
    for path in started:
        tasks.wait_started(path)
    monkeypatch.setattr(Future, "wait_done", interrupted_wait)
    with pytest.raises(KeyboardInterrupt):
        pool.shutdown()
    monkeypatch.undo()
    assert pool.await_termination(30)
    with pytest.raises(CancelledError):
        next(results)


@pytest.mark.timeout(60)
def test_two_maps_interleaved_and_unequal_iterables(pool2: Pool) -> None:
    a = pool2.map(tasks.ident, range(300), chunksize=7)
    b = pool2.map(tasks.add, range(1000), iter(range(250)), chunksize=11)
    assert list(zip(a, b, strict=False)) == [(i, 2 * i) for i in range(250)]
    assert list(a) == list(range(251, 300))  # zip drew one more from a
    a.close()


@pytest.mark.timeout(60)
def test_map_after_and_across_shutdown() -> None:
    pool = Pool(1)
    results = pool.map(tasks.ident, range(10))
    never_read = pool.map(tasks.ident, range(10, 20))
    pool.shutdown()
    with pytest.raises(PoolClosedError):
        pool.map(tasks.ident, range(10))
    assert list(results) == list(range(10))  # sent at the call, run before the pool ended
    del never_read  # it ran all the same, as ProcessPoolExecutor.map's tasks do
    assert pool.statistics().completed == 2


@pytest.mark.timeout(60)
def test_shutdown_without_waiting_returns_with_a_maps_chunk_queued_behind_a_task(
    tmp_path: pathlib.Path,
) -> None:
    """A map's default chunk may stop at its budget, so shutdown saw to what it would leave by
    waiting for it, even with ``wait=False``: for all the work queued ahead of it, and for ever
    when that work waited for the caller (here: for the gate opened after the shutdown). An
    unclaimed chunk is withdrawn and sent again whole instead."""
    fifos = Fifos(tmp_path)
    pool = Pool(1)
    ahead = pool.submit(tasks.started_then_gated, fifos.started, fifos.gate, "ahead")
    tasks.wait_started(fifos.started)
    results = pool.map(tasks.ident, range(100))  # queued behind ``ahead``, on the one worker
    returned = threading.Event()
    thread = threading.Thread(target=lambda: (pool.shutdown(wait=False), returned.set()))
    thread.start()
    returned_at_once = returned.wait(20)
    tasks.open_gate(fifos.gate)  # unblocks a shutdown that waits, too: the thread then ends
    thread.join()
    assert returned_at_once, "shutdown(wait=False) waited for the chunk behind the task"
    assert ahead.result(timeout=20) == "ahead"
    assert list(results) == list(range(100))
    assert pool.await_termination(30)


@pytest.mark.timeout(60)
def test_shutdown_without_waiting_returns_while_a_maps_claimed_chunk_runs(
    tmp_path: pathlib.Path,
) -> None:
    """A claimed chunk that may stop at its budget: the shutdown waited for it to return, to
    send what it left, with ``wait=False`` too, and for ever when its item waited for the
    caller (here: for the gate opened after the shutdown; found in review; ProcessPoolExecutor's
    returns at once). Now a thread of the pool's waits for it, sends its rest and then begins
    the drain: the user's work is refused at once, and every result of the map comes."""
    fifos = Fifos(tmp_path)
    pool = Pool(1)
    try:
        fn = functools.partial(et.second_item_gated, fifos.started, fifos.gate)
        results = pool.map(fn, range(100))  # default chunks, which may stop at their budget
        tasks.wait_started(fifos.started)  # the first chunk's item 1 waits at the gate
        returned = threading.Event()
        thread = threading.Thread(target=lambda: (pool.shutdown(wait=False), returned.set()))
        thread.start()
        returned_at_once = returned.wait(10)
        with pytest.raises(PoolClosedError):
            pool.submit(tasks.ident, 1)
        tasks.open_gate(fifos.gate)  # unblocks a shutdown that waits, too: the thread then ends
        thread.join()
        assert returned_at_once, "shutdown(wait=False) waited for the claimed chunk"
        assert list(results) == list(range(100))
        assert pool.await_termination(30)
    finally:
        pool.shutdown()


@pytest.mark.timeout(60)
def test_a_callback_that_shuts_down_in_the_thread_that_sends_a_maps_rests_waits(
    tmp_path: pathlib.Path,
) -> None:
    """That thread begins the drain once the rests went, and the drain cancels a timed task
    (``timed_after_shutdown=False``): its done-callback runs there, and its
    ``shutdown(wait=True)`` joined that thread, its own ("cannot join current thread", found
    in review). It waits for the end, as a callback's shutdown does."""
    fifos = Fifos(tmp_path)
    pool = Pool(1, timed_after_shutdown=False)
    try:
        later = pool.schedule("later", time.monotonic() + 3600, 0, tasks.ident, 0)
        seen: list[Any] = []

        def shut_down(future: Any) -> None:
            seen.append(future.cancelled())
            pool.shutdown(wait=True)
            seen.append(pool._coordinator.finished.is_set())

        later.add_done_callback(shut_down)
        fn = functools.partial(et.second_item_gated, fifos.started, fifos.gate)
        results = pool.map(fn, range(100))
        tasks.wait_started(fifos.started)  # the first chunk's item 1 waits at the gate
        pool.shutdown(wait=False)  # the rests' thread waits for that chunk
        tasks.open_gate(fifos.gate)
        assert list(results) == list(range(100))
        assert pool.await_termination(30)
        rests = pool._rests
        assert rests is not None
        rests.join(30)  # the callback runs in it, and may still be returning
        assert seen == [True, True]
    finally:
        pool.shutdown()


@pytest.mark.timeout(60)
def test_a_map_of_an_iterator_read_after_the_pool_ended_takes_no_more_of_it() -> None:
    """Its results come as far as it was read, then PoolClosedError; the caller's iterator
    goes on from the first item not sent (a window of items was read, then refused)."""
    items = iter(range(10**6))
    with Pool(1) as pool:
        results = pool.map(tasks.ident, items)
    got = []
    with pytest.raises(PoolClosedError):
        got.extend(results)
    assert got == list(range(len(got)))
    assert next(items) == len(got)


@pytest.mark.timeout(60)
def test_a_map_of_an_iterator_read_after_the_block_yields_all_it_had_sent() -> None:
    """The whole iterator fits in the first window, so all of it went at the call; but its
    chunks stopped at their budget (items of 2 ms), and their rests went again only as the
    map was read, after the pool had ended: 8 results of 100, then PoolClosedError."""
    with Pool(2) as pool:
        results = pool.map(tasks.spin, (0.002 for _ in range(100)))
    assert list(results) == [0.002] * 100


@pytest.fixture
def fifos(tmp_path: object) -> list[str]:
    paths = [os.path.join(str(tmp_path), name) for name in ("a", "b", "c", "d")]
    for p in paths:
        os.mkfifo(p)
    return paths


@pytest.mark.timeout(60)
def test_sigkill_of_the_worker_running_a_stolen_child_fails_the_childs_future(
    fifos: list[str],
) -> None:
    to_parent, to_test, gate, _ = fifos
    with Pool(2) as pool:
        parent = pool.submit(et.parent_of_stolen_child, to_parent, to_test, gate)
        pid = tasks.read_pid(to_test)
        os.kill(pid, signal.SIGKILL)
        assert parent.result(timeout=20) == "WorkerCrashedError"
        assert pool.submit(tasks.fib, 8).result(timeout=20) == 21
        slab = pool._views.slab
        assert slab.free_count() == slab.capacity


@pytest.mark.timeout(60)
def test_sigkill_of_a_parent_whose_child_runs_on_a_peer(fifos: list[str]) -> None:
    to_parent, to_test, gate, parent_pid = fifos
    with Pool(2) as pool:
        parent = pool.submit(
            et.parent_dies_while_child_runs_elsewhere, to_parent, to_test, gate, parent_pid
        )
        child_pid = tasks.read_pid(to_test)
        pid = tasks.read_pid(parent_pid)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerCrashedError):
            parent.result(timeout=20)
        tasks.open_gate(gate)  # the orphaned child ends; its executor frees its block
        assert pool.submit(tasks.fib, 8).result(timeout=20) == 21
        assert child_pid != pid


@pytest.mark.timeout(60)
def test_retiring_workers_leave_fire_and_forget_children_that_still_run(tmp_path: object) -> None:
    log = os.path.join(str(tmp_path), "log")
    open(log, "wb").close()
    with Pool(2, max_tasks_per_worker=1) as pool:
        futures = [pool.submit(et.fire_children, log, i, 5) for i in range(30)]
        assert [f.result(timeout=30) for f in futures] == list(range(30))
    expected = sorted(i * 10 + k for i in range(30) for k in range(5))
    assert sorted(tasks.read_log(log)) == expected
    assert pool.statistics().crashes == 0


@pytest.mark.timeout(60)
def test_map_error_in_the_first_default_chunk_keeps_earlier_results(pool2: Pool) -> None:
    """Like the builtin map: the results before the failing item come first."""
    results = pool2.map(functools.partial(et.fail_at, bad=5), range(10))
    got: list[int] = []
    with pytest.raises(ValueError, match="bad item 5"):
        got.extend(results)  # keeps what came before the raise
    assert got == [0, 1, 2, 3, 4]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunksize", [None, 1, 5, 100])
@pytest.mark.parametrize("star", [False, True], ids=["one iterable", "two iterables"])
def test_map_of_a_function_that_raises_stop_iteration_fails_at_that_item(
    pool2: Pool, chunksize: int | None, star: bool
) -> None:
    """A chunk ran its items through the builtin ``map``, which takes a StopIteration from the
    function for the end of the items: that item's result was missing and the later ones moved
    up a place (``[0, 1, 3, 4, 5, 6, 7, 7]``, no error), a chunk with no time budget (a given
    chunksize) never ended, and a default chunk's first item failing so divided by zero. Now
    it is that item's error, as any other: the earlier results, then (as the map's iterator is
    a generator, PEP 479) RuntimeError from it, as ProcessPoolExecutor.map raises."""
    fn = functools.partial(et.stop_at, bad=2)
    iterables = (range(8), range(0, 80, 10)) if star else (range(8),)
    results = pool2.map(fn, *iterables, chunksize=chunksize)
    got: list[int] = []
    with pytest.raises(RuntimeError, match="StopIteration") as raised:
        got.extend(results)
    assert got == ([0, 11] if star else [0, 1])
    assert isinstance(raised.value.__cause__, StopIteration)
    assert str(raised.value.__cause__) == "no value for 2"
    # Starting at the item that raises: the chunk's own task fails with it.
    results = pool2.map(fn, range(2, 8), chunksize=chunksize)
    with pytest.raises(RuntimeError, match="StopIteration"):
        next(results)


@pytest.mark.timeout(60)
def test_a_child_may_be_a_callable_whose_hash_raises(pool2: Pool) -> None:
    """``mpsched.submit`` looks the function up in the worker's function table by hashing it:
    a callable whose type has a ``__hash__`` that raises (a frozen dataclass with a list)
    raised TypeError there, where ``Pool.submit`` of the same callable works (found in
    review). Now it goes by value, as any callable that is not in the table."""
    adder = et.ListAdder([1, 2])
    assert pool2.submit(adder, 10).result(timeout=30) == 13
    assert pool2.submit(et.run_as_child, adder, 10).result(timeout=30) == 13


@pytest.mark.timeout(60)
def test_current_task_in_a_tasks_thread_during_a_join_is_the_tasks(tmp_path: pathlib.Path) -> None:
    """It answered the innermost context of the worker's thread: while the task joined a child
    (run in the join), its thread got the child's context, with no id and a cancel flag never
    set (found in review)."""
    with Pool(1) as pool:
        f = pool.schedule(
            "p", time.monotonic(), 0, et.context_in_a_thread_during_a_join, str(tmp_path)
        )
        assert f.result(timeout=30) == ("p", 1)


# ---------------------------------------------------------------- big payloads
@pytest.mark.timeout(60)
def test_cancelled_tasks_with_stashed_arguments_leave_no_stash(
    gates: tuple[str, str, str],
) -> None:
    """Arguments too big for the slab's blocks wait in the coordinator's stash until the
    worker that claims the task fetches them; a task cancelled in its inbox never fetches,
    so its cancel must drop them (else each such cancel leaks its arguments' bytes)."""
    started, gate, _ = gates
    big = b"z" * 400_000  # more than a block chain holds: it goes through the stash
    with Pool(1) as pool:
        blocker = pool.submit(tasks.started_then_gated, started, gate, "blocker")
        tasks.wait_started(started)
        queued = [pool.submit(tasks.echo_size, big) for _ in range(5)]
        # Bounded poll: until the coordinator thread has injected them into the inbox.
        deadline = time.monotonic() + 20
        while not all(f._slot >= 0 for f in queued):
            assert time.monotonic() < deadline, "the tasks were never dispatched"
            time.sleep(0.002)
        assert all(f.cancel() for f in queued)
        tasks.open_gate(gate)
        assert blocker.result(timeout=20) == "blocker"
        assert pool.submit(tasks.echo_size, big).result(timeout=20) == len(big)
        assert pool._coordinator.stash == {}


@pytest.mark.timeout(60)
def test_dropped_children_with_stashed_results_leave_no_stash() -> None:
    """A child's result too big for the slab goes to the coordinator's stash, which only the
    parent's collect fetches back; a child nobody waits for (its future dropped) must not
    leave it there."""
    pool = Pool(2)
    try:
        assert pool.submit(et.forget_big_children, 5, 400_000).result(timeout=20) == 5
        assert pool.submit(et.join_big_child_args, 400_000).result(timeout=20) == 400_000
    finally:
        pool.shutdown(wait=True)
    assert pool._coordinator.stash == {}


@pytest.mark.timeout(60)
def test_children_run_inline_on_a_full_deque_leave_no_stash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A child whose arguments went to the stash, then found the deque full, runs inline:
    its stashed arguments must not stay behind."""
    monkeypatch.setattr(_startup, "DEQUE_CAPACITY", 2)
    pool = Pool(1, start_method="fork")  # the zygote inherits the patched layout anyway
    try:
        assert pool.submit(et.spawn_big_children, 6, 300_000).result(timeout=20) == 6 * 300_000
    finally:
        pool.shutdown(wait=True)
    assert pool._coordinator.stash == {}


# ---------------------------------------------------------------- many workers
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("start_method", "workers"),
    [
        ("forkserver", 248),  # 250 fds of ours: over SCM_MAX_FD, EINVAL killed the server
        # The wake fds in two messages after the config's (over "too many fds" before).
        ("forkserver", _startup.WAKE_FDS_IN_CONFIG + FDS_PER_MESSAGE + 2),
        ("spawn", _startup.WAKE_FDS_IN_CONFIG + FDS_PER_MESSAGE + 2),
    ],
)
def test_a_pool_with_more_wake_fds_than_one_fd_message_holds_works(
    start_method: str, workers: int
) -> None:
    """Under forkserver multiprocessing sends a Process's fds in one SCM_RIGHTS message: a
    config with one wake eventfd per worker failed ``Pool(248)`` and more, and killed the
    forkserver, so that the process's next pool failed too. The config now carries the first
    ``WAKE_FDS_IN_CONFIG`` and the others follow on the zygote's socket: the worker has every
    slot's eventfd, in slot order, and a pool made after it works. Cheap: one worker starts
    (the others are dormant)."""
    with Pool(workers, start_method=start_method) as pool:
        expected = et.eventfd_ids([f.fd for f in pool._resources.wake_fds])
        assert len(expected) == workers
        assert pool.submit(et.wake_fd_ids).result(timeout=30) == expected
    with Pool(2, start_method=start_method) as pool:
        assert pool.submit(abs, -1).result(timeout=30) == 1


# ---------------------------------------------------------------- worker lifecycle
@pytest.mark.timeout(60)
def test_an_initializer_failing_in_a_replacement_breaks_the_pool_without_hanging(
    tmp_path: object,
) -> None:
    counter = os.path.join(str(tmp_path), "count")
    open(counter, "wb").close()
    pool = Pool(
        2, max_tasks_per_worker=1, initializer=et.initializer_fails_after, initargs=(counter, 2)
    )
    try:
        futures = [pool.submit(tasks.ident, i) for i in range(20)]
        _done, not_done = wait(futures, timeout=30)
        assert not not_done
        outcomes = [f.exception() for f in futures]
        assert all(e is None or isinstance(e, BrokenPoolError) for e in outcomes)
        assert any(isinstance(e, BrokenPoolError) for e in outcomes)
        with pytest.raises(BrokenPoolError):
            pool.submit(tasks.ident, 0)
    finally:
        pool.shutdown(wait=True)


@pytest.mark.timeout(60)
def test_a_worker_whose_clock_a_task_froze_goes_to_sleep() -> None:
    """The idle spin before a sleep ends at a time on ``time.perf_counter``: frozen by a task,
    the worker spun on a full CPU for ever. It also ends after a number of polls."""
    with Pool(1) as pool:
        pool.submit(et.freeze_clock).result(timeout=20)
        slot = pool._coordinator.slots[0]
        wait_until(slot.is_sleeping, "the worker sleeps")
        assert pool.submit(tasks.ident, 1).result(timeout=20) == 1
        wait_until(slot.is_sleeping, "the worker sleeps again")


@pytest.mark.timeout(60)
def test_a_retiring_worker_whose_exit_blocks_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    """A retiring worker's replacement is forked at its exit; a task left it a ``sys.stdout``
    whose ``flush`` (at the exit) blocked: the slot stayed taken for ever, and ``Pool(1)`` ran
    nothing more. The exit is bounded (``RETIRED_EXIT_TIMEOUT``, shortened here: under fork
    the workers inherit the module's value)."""
    monkeypatch.setattr(_worker, "RETIRED_EXIT_TIMEOUT", 0.2)
    with Pool(1, start_method="fork", max_tasks_per_worker=1) as pool:
        pool.submit(et.block_stdout_flush).result(timeout=20)
        assert pool.submit(tasks.ident, 1).result(timeout=20) == 1
        stats = pool.statistics()
        assert stats.crashes == 0
        assert stats.recycled >= 1


@pytest.mark.timeout(60)
def test_a_retired_workers_exit_read_before_its_retiring_leaves_no_entry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """RETIRING comes on the worker's socket, EXITED on the zygote's, and the loop may read
    EXITED first (~5% of recycles here). Forced for every recycle: the coordinator keeps
    nothing for a retired pid (both ``exit_codes`` and ``retired_pids`` kept an entry for good,
    and a later worker reusing the pid inherited them: see the next test)."""
    on_worker_message = Coordinator.on_worker_message

    def exited_first(self: Coordinator, worker: Any, tag: int, fields: tuple[Any, ...]) -> None:
        if tag == Tag.RETIRING:
            while worker.pid not in self.exit_codes:
                self.on_zygote_message(block=True)
        on_worker_message(self, worker, tag, fields)

    monkeypatch.setattr(Coordinator, "on_worker_message", exited_first)
    with Pool(1, max_tasks_per_worker=1) as pool:
        for i in range(4):
            assert pool.submit(tasks.ident, i).result(timeout=20) == i
        wait_until(lambda: pool.statistics().recycled == 4, "four recycles")
        coordinator = pool._coordinator
        assert (coordinator.exit_codes, coordinator.retired_pids) == ({}, set())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("initializer", [False, True], ids=["task", "initializer"])
def test_a_worker_reusing_a_pid_reports_its_own_death(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path, initializer: bool
) -> None:
    """A worker whose pid a previous worker of the pool had (pids wrap: 32,768 here), and
    whose entries stayed (a retired one's, before the fix above; an exit code that came after
    its crash's recovery stopped waiting): its SIGKILL is its own. It was reported as the
    stale "exit code 0", and in the initializer it broke the pool instead of being survived."""
    read_zygote = Coordinator.read_zygote

    def stale_entries(self: Coordinator) -> tuple[int, tuple[Any, ...]]:
        tag, fields = read_zygote(self)
        if tag == Tag.SPAWNED:  # as if a retired process with this pid had left both
            self.exit_codes[fields[1]] = 0
            self.retired_pids.add(fields[1])
        return tag, fields

    monkeypatch.setattr(Coordinator, "read_zygote", stale_entries)
    if initializer:
        marker = str(tmp_path / "killed")
        with Pool(1, initializer=et.initializer_killed_once, initargs=(marker,)) as pool:
            assert pool.submit(tasks.ident, 1).result(timeout=20) == 1
            assert pool.statistics().crashes == 1
        return
    with Pool(1) as pool:
        with pytest.raises(WorkerCrashedError, match=r"SIGKILL\(-9\)"):
            pool.submit(tasks.kill_self).result(timeout=20)
        assert pool.submit(tasks.ident, 1).result(timeout=20) == 1


@pytest.mark.timeout(60)
def test_a_retired_workers_kept_child_futures_leak_no_block() -> None:
    """A worker that retires (max_tasks_per_worker) while futures of its children are still
    referenced (here: kept in a module global): nobody will collect those children; their
    blocks must be freed as for a worker that died."""
    with Pool(1, max_tasks_per_worker=1) as pool:
        assert pool.submit(et.keep_child_futures, 20).result(timeout=20) == 20
        assert pool.submit(et.keep_child_futures, 20).result(timeout=20) == 20
        assert pool.submit(et.child_futures_in_a_cycle, 20).result(timeout=20) == 20
        assert pool.submit(tasks.ident, 1).result(timeout=20) == 1
        slab = pool._views.slab
        assert pool.statistics().recycled >= 3
        assert slab.free_count() == slab.capacity


@pytest.mark.timeout(60)
@pytest.mark.parametrize("die", [False, True], ids=["retired", "killed"])
def test_a_retired_workers_done_children_leave_no_stashed_results(die: bool) -> None:
    """Children that ran to DONE with results too big for a block (stashed in the coordinator),
    kept unread by futures that outlive the worker: when it retires or dies, the coordinator
    frees their blocks and must drop their stashed results too (only a FETCH empties the
    stash; nobody will send it)."""
    with Pool(1, max_tasks_per_worker=1) as pool:
        parent = pool.submit(et.keep_done_big_children, 3, 300_000, die)
        if die:
            with pytest.raises(WorkerCrashedError):
                parent.result(timeout=20)
        else:
            assert parent.result(timeout=20) == 3
        assert pool.submit(tasks.ident, 1).result(timeout=20) == 1  # after the retirement
        slab = pool._views.slab
        stats = pool.statistics()
        assert stats.crashes == 1 if die else stats.recycled >= 1
        assert slab.free_count() == slab.capacity
        assert pool._coordinator.stash == {}


@pytest.mark.timeout(60)
def test_a_dead_parents_done_child_whose_stash_is_unread_leaves_no_stash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A child stolen by a live peer finished with a stashed result; its parent's worker died
    before reading it. The coordinator frees the block when it recovers the death, but the
    peer's STASH may still be unread in its socket (held here until after that): it must be
    dropped when it comes, not kept for ever."""
    held: list[tuple[Any, int, tuple[Any, ...]]] = []
    real_message = Coordinator.on_worker_message
    real_orphan = Coordinator.orphan_children

    def hold_stashes(self: Coordinator, worker: Any, tag: int, fields: tuple[Any, ...]) -> None:
        if tag == Tag.STASH:
            held.append((worker, tag, fields))
        else:
            real_message(self, worker, tag, fields)

    def orphan_then_deliver(self: Coordinator, k: int, pid: int) -> None:
        real_orphan(self, k, pid)
        monkeypatch.setattr(Coordinator, "on_worker_message", real_message)
        for worker, tag, fields in held:
            real_message(self, worker, tag, fields)

    monkeypatch.setattr(Coordinator, "on_worker_message", hold_stashes)
    monkeypatch.setattr(Coordinator, "orphan_children", orphan_then_deliver)
    with Pool(2) as pool:
        parent = pool.submit(et.die_after_a_peer_ran_a_big_child, 300_000)
        with pytest.raises(WorkerCrashedError):
            parent.result(timeout=20)
        assert len(held) == 1
        assert pool.submit(tasks.ident, 1).result(timeout=20) == 1
        assert pool._coordinator.stash == {}
        assert pool._coordinator.unwanted_stash == set()


# A garbage collection that starts inside a critical section of the coordinator's lock (any
# allocation can start one; seen in Coordinator.submit) and finalizes an abandoned map.
GC_IN_CRITICAL_SECTION = """
import functools, gc, sys, time
from mpsched import Pool
from tests.integration import edge_tasks as et, tasks

started, gate = sys.argv[1], sys.argv[2]
gc.disable()
pool = Pool(1, start_method="fork")
it = pool.map(functools.partial(et.second_item_gated, started, gate), range(100), chunksize=1)
assert next(it) == 0
tasks.wait_started(started)  # item 1 holds the only worker: items 2 and 3 wait unclaimed
cycle = [it]
cycle.append(cycle)  # only the cyclic GC can free the generator now
del it, cycle
with pool._coordinator.lock:
    gc.collect()  # closes the generator, which cancels its unclaimed chunks
# The cancels are deferred to the loop: the gate opens once they are applied (items 2 and 3
# withdrawn, item 1 left in flight), else the freed worker may claim them first (a flake).
deadline = time.monotonic() + 10
while len(pool._coordinator.by_handle) > 1 and time.monotonic() < deadline:
    time.sleep(0.001)
tasks.open_gate(gate)
pool.shutdown(wait=True)
print("ok", pool.statistics().per_worker[0].executed, flush=True)
"""


@pytest.mark.timeout(60)
def test_a_map_finalized_by_a_gc_pass_inside_a_critical_section_does_not_deadlock(
    tmp_path: pathlib.Path,
) -> None:
    """The generator's cleanup cancels its chunks; run by the collector in a thread that holds
    the coordinator's lock, it waited for that lock forever. It now hands them to the
    coordinator thread, which cancels them. (In a subprocess: a hang must not take the test run
    with it.)"""
    started, gate = tmp_path / "started", tmp_path / "gate"
    os.mkfifo(started)
    os.mkfifo(gate)
    root = pathlib.Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root))
    try:
        result = subprocess.run(
            [sys.executable, "-c", GC_IN_CRITICAL_SECTION, str(started), str(gate)],
            env=env,
            capture_output=True,
            text=True,
            timeout=45,  # s: a loaded machine took 2-3 s; a hang takes this long to fail
        )
    except subprocess.TimeoutExpired:
        pytest.fail("deadlock: the map's cleanup waited for a lock its own thread held")
    assert result.returncode == 0, result.stderr
    # Items 0 and 1 ran; the cancels of 2 and 3 (unclaimed) were not lost.
    assert result.stdout.split() == ["ok", "2"]


def _fail_the_next_free(pool: Pool) -> None:
    """The slab's next ``free_tasks`` raises, as on a corrupt free stack (then it works)."""
    slab = pool._views.slab
    free_tasks = slab.free_tasks

    def corrupt(indices: Any, children: bool = False) -> None:
        slab.free_tasks = free_tasks  # type: ignore[method-assign]
        raise InternalError("free_many: double free (simulated)")

    slab.free_tasks = corrupt  # type: ignore[method-assign]


@pytest.mark.timeout(60)
def test_a_free_that_raises_in_a_collection_still_settles_what_it_took() -> None:
    """The slab's free stack is corrupt (a double free elsewhere): the loop's collection raises
    and the pool breaks; the futures it took from the done ring (out of ``by_handle``, where
    the break's sweep looks) must still end, not wait for ever."""
    pool = Pool(1)
    try:
        _fail_the_next_free(pool)
        future = pool.submit(tasks.add, 1, 2)
        done, _ = wait([future], timeout=20)  # not result(): the loop collects, not this thread
        assert done, "the future taken by the failed collection never ended"
        assert future.result() == 3
        with pytest.raises(BrokenPoolError, match="double free"):
            pool.submit(tasks.add, 1, 1)
    finally:
        pool.shutdown(wait=True)


@pytest.mark.timeout(60)
def test_a_free_that_raises_in_a_crash_recovery_still_settles_what_it_took() -> None:
    """The slab's free stack is corrupt when a worker dies: the recovery's free raises and the
    pool breaks; the dead worker's task, taken out of ``by_handle`` (where the break's sweep
    looks) by the recovery, must still end, not wait for ever."""
    pool = Pool(1)
    try:
        _fail_the_next_free(pool)
        future = pool.submit(et.exit_now, 3)  # the first free is the recovery's
        done, _ = wait([future], timeout=20)  # not result(): the loop recovers, not this thread
        assert done, "the future taken by the failed recovery never ended"
        with pytest.raises(WorkerCrashedError):
            future.result()
        with pytest.raises(BrokenPoolError, match="double free"):
            pool.submit(tasks.add, 1, 1)
    finally:
        pool.shutdown(wait=True)
