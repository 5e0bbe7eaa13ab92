"""Integration tests of mpsched.Pool: submit, map, errors, nested tasks, shutdown."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import importlib
import math
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, wait
from pathlib import Path
from typing import Any

import pytest

import mpsched
from mpsched import BrokenPoolError, Pool, PoolClosedError, _map, _protocol
from mpsched._chunks import run_chunk

from . import edge_tasks as et
from . import tasks
from .conditions import CONDITION_TIMEOUT, Fifos, start_every_worker, wait_until

START_METHODS = ["forkserver", "spawn", "fork"]


@pytest.fixture(params=START_METHODS)
def start_method(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def pool2() -> Pool:
    with Pool(2) as pool:
        yield pool


# ---------------------------------------------------------------- basics, every start method
@pytest.mark.timeout(60)
def test_submit_map_and_nested_under_each_start_method(start_method: str) -> None:
    with Pool(2, start_method=start_method) as pool:
        assert pool.submit(tasks.add, 2, b=3).result() == 5
        assert list(pool.map(tasks.add, range(100), range(100))) == [2 * i for i in range(100)]
        assert pool.submit(tasks.fib, 12).result() == 144
        assert pool.submit(lambda x: x * 2, 21).result() == 42
        pids = {pool.submit(tasks.pid_of).result() for _ in range(20)}
        assert os.getpid() not in pids


@pytest.mark.timeout(60)
def test_tasks_see_the_same_process_context_under_each_start_method(start_method: str) -> None:
    # Under fork the zygote is a bare os.fork() (ForkedZygote), not a multiprocessing.Process:
    # its workers must still look like the children of a daemonic Process, stdin closed.
    read_end, write_end = os.pipe()  # a stdin that would hand "input" to a child reading it
    saved = os.dup(0)
    os.write(write_end, b"input")
    os.close(write_end)
    os.dup2(read_end, 0)
    try:
        with Pool(2, start_method=start_method) as pool:
            context = pool.submit(tasks.process_context).result(timeout=30)
    finally:
        os.dup2(saved, 0)
        os.close(saved)
        os.close(read_end)
    assert context == ("mpsched-zygote", True, os.getpid(), True, "")


@pytest.mark.timeout(60)
def test_local_functions_and_lambdas_work(pool2: Pool) -> None:
    def local(x: int) -> int:
        return x + 1

    offset = 10
    assert pool2.submit(local, 1).result() == 2
    assert pool2.submit(lambda: offset + 1).result() == 11


@pytest.mark.timeout(60)
def test_a_builtin_method_of_an_object_sees_the_objects_state_at_each_submit(
    pool2: Pool,
) -> None:
    """``d.get`` is of the builtins' type, but pickles with a copy of ``d``: it was tabled
    once as the builtins are, so every later ``d.get`` ran on the first copy (1 after
    ``d["k"] = 2``), which the table kept for the pool's life. Builtins of a module or a class
    stay tabled."""
    d, items = {"k": 1}, [10]
    assert pool2.submit(d.get, "k").result(timeout=30) == 1
    assert pool2.submit(items.__getitem__, 0).result(timeout=30) == 10
    d["k"], items[0] = 2, 20
    assert pool2.submit(d.get, "k").result(timeout=30) == 2
    assert pool2.submit(items.__getitem__, 0).result(timeout=30) == 20
    assert len(pool2._views.functions) == 0
    assert pool2.submit(len, "abc").result(timeout=30) == 3
    assert pool2.submit(dict.fromkeys, "ab").result(timeout=30) == {"a": None, "b": None}
    assert len(pool2._views.functions) == 2


@pytest.mark.timeout(60)
def test_task_exception_carries_remote_traceback_and_pool_goes_on(pool2: Pool) -> None:
    future = pool2.submit(tasks.boom, "bad input")
    with pytest.raises(ValueError, match="bad input") as info:
        future.result()
    assert "in boom" in str(info.value.__cause__)
    assert pool2.submit(tasks.add, 1, 1).result() == 2


@pytest.mark.timeout(60)
def test_system_exit_and_keyboard_interrupt_in_a_task_are_errors(pool2: Pool) -> None:
    with pytest.raises(SystemExit):
        pool2.submit(tasks.exit_task, 3).result()
    with pytest.raises(KeyboardInterrupt):
        pool2.submit(tasks.raise_keyboard_interrupt).result()
    assert pool2.submit(tasks.add, 2, 2).result() == 4


@pytest.mark.timeout(60)
def test_unpicklable_argument_fails_at_submit(pool2: Pool) -> None:
    with pytest.raises(TypeError, match="pickle"):
        pool2.submit(tasks.ident, threading.Lock())
    assert pool2.submit(tasks.ident, 7).result() == 7


@pytest.mark.timeout(60)
def test_unpicklable_result_fails_that_future_only(pool2: Pool) -> None:
    with pytest.raises(Exception, match="pickle"):
        pool2.submit(tasks.unpicklable_result).result()
    assert pool2.submit(tasks.ident, 8).result() == 8


@pytest.mark.timeout(60)
def test_non_callable_is_a_type_error(pool2: Pool) -> None:
    with pytest.raises(TypeError, match="callable"):
        pool2.submit(42)  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_big_arguments_and_results_cross_the_stash(pool2: Pool) -> None:
    big = os.urandom(300_000)
    assert pool2.submit(tasks.echo_size, big).result() == len(big)
    assert pool2.submit(tasks.make_bytes, 500_000).result() == b"x" * 500_000
    assert pool2.submit(tasks.nested_big, 200_000).result() == 200_000


@pytest.mark.timeout(60)
def test_submit_outside_a_worker_is_an_error(pool2: Pool) -> None:
    with pytest.raises(RuntimeError, match="inside a task"):
        mpsched.submit(tasks.ident, 1)
    assert pool2.submit(tasks.submit_outside).result() is None  # inside a task it works


# ---------------------------------------------------------------- map
@pytest.mark.timeout(60)
def test_map_keeps_order_with_any_chunksize(pool2: Pool) -> None:
    data = list(range(5000))
    assert list(pool2.map(tasks.ident, data)) == data
    assert list(pool2.map(tasks.ident, data, chunksize=7)) == data
    assert list(pool2.map(tasks.add, data, data, chunksize=1000)) == [2 * x for x in data]
    assert list(pool2.map(tasks.add, data, data[:10])) == [2 * x for x in data[:10]]  # as zip
    assert list(pool2.map(tasks.ident, [(1, 2), None])) == [(1, 2), None]  # items as they are
    assert list(pool2.map(tasks.ident, [])) == []


RANGES = [
    range(0),
    range(3),
    range(20_000),
    range(5, 100_000, 7),
    range(100, -100, -3),
    range(10**30, 10**30 + 5000),  # beyond a C long: len() of the whole still works
    range(-(10**20), 10**20, 10**17),
]


def spy_on_chunks(pool: Pool, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The items of every map chunk that ``pool`` sends from now on, as sent to the workers
    (the arguments of ``run_chunk`` that ``Pool._submit`` pickles)."""
    sent: list[Any] = []
    submit = pool._submit

    def spy(owner: Any, fn: Any, args: tuple[Any, ...], *rest: Any) -> Any:
        if fn is run_chunk:
            sent.append(args[1])
        return submit(owner, fn, args, *rest)

    monkeypatch.setattr(pool, "_submit", spy)
    return sent


@pytest.mark.timeout(60)
@pytest.mark.parametrize("budget", ["default budget", "budget 0"])
def test_a_range_input_goes_as_sub_ranges_and_gives_the_results_of_its_items(
    pool2: Pool, monkeypatch: pytest.MonkeyPatch, budget: str
) -> None:
    """A range is read as sub-ranges, and its chunks go so (``_map``, "A range input"); with a
    budget of 0 every chunk stops after one item and its rest, a sub-range too, goes again."""
    if budget == "budget 0":
        monkeypatch.setattr(_map, "MAP_CHUNK_BUDGET", 0.0)
    sent = spy_on_chunks(pool2, monkeypatch)
    for whole in RANGES:
        # With a budget of 0, each item is a round trip (the rest goes once the reader takes
        # the chunk): a slice, a range of the same start, step and bounds, keeps it short.
        numbers = whole[:200] if budget == "budget 0" else whole
        for chunksize in (None, 7):
            del sent[:]
            assert list(pool2.map(tasks.ident, numbers, chunksize=chunksize)) == list(numbers)
            assert all(type(items) is range for items in sent), (numbers, chunksize, sent)
            if budget == "budget 0" and chunksize is None and len(numbers) > 1:
                assert sum(map(len, sent)) > len(numbers), sent  # the rests went again


@pytest.mark.timeout(60)
def test_a_range_maps_dropped_unread_runs_the_rest_of_a_chunk_after_an_item_that_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rest of a chunk that ended at an item's error goes again as a sub-range."""
    log = tmp_path / "log"
    log.touch()
    with Pool(1) as pool:
        sent = spy_on_chunks(pool, monkeypatch)
        record = functools.partial(et.record_then_raise_at, str(log), bad=5)
        results = pool.map(record, range(300))
        del results
        wait_until(lambda: not pool._unread_maps, "the pool let the map go")
    assert sorted(tasks.read_log(str(log))) == list(range(300))
    assert all(type(items) is range for items in sent), sent
    assert any(items.start == 6 for items in sent), sent  # the rest after item 5


@pytest.mark.timeout(60)
def test_a_maps_chunks_go_at_the_call_to_a_worker_that_runs_nothing(tmp_path: Path) -> None:
    """A chunk is handed to a worker's inbox by the caller's thread also while tasks are in
    flight (not queued for the coordinator thread, which waited for the GIL while the caller
    pickled the next chunks), and to a worker that runs nothing, asleep or not, before one
    that is busy (the busy one was taken first while its peer slept)."""
    fifos = Fifos(tmp_path)
    with Pool(2) as pool:
        start_every_worker(pool)
        blocker = pool.submit(tasks.started_then_gated, fifos.started, fifos.gate, "blocker")
        tasks.wait_started(fifos.started)
        slots = pool._coordinator.slots
        # (not blocker._slot: the inbox it went to, whose worker a peer may have stolen it from)
        busy = next(k for k in (0, 1) if slots[k].run_depth())
        idle = 1 - busy
        wait_until(lambda: slots[idle].is_sleeping(), "the other worker sleeps")
        handed: list[bool] = []
        dispatch_one = pool._coordinator.dispatch_one

        def spy(future: Any) -> bool:
            handed.append(dispatch_one(future))
            return handed[-1]

        pool._coordinator.dispatch_one = spy  # type: ignore[method-assign]
        pool._coordinator.next_slot = busy  # the rotation's turn: it must not decide
        try:
            results = pool.map(tasks.ident, range(10), chunksize=5)
            run = next(r for r in pool._maps.live() if r.reader and r.reader() is results)
            first = run.in_flight[0][0]
            assert handed == [True, True], handed  # both at the call, by this thread
            assert first._slot == idle
            assert list(results) == list(range(10))
        finally:
            tasks.open_gate(fifos.gate)
        assert blocker.result(CONDITION_TIMEOUT) == "blocker"


class Endless:
    """An endless input for ``map``: ``make(1)``, ``make(2)``, ...; ``pulled`` counts the
    items read from it."""

    def __init__(self, make: Callable[[int], Any]) -> None:
        self.make = make
        self.pulled = 0

    def __iter__(self) -> Iterator[Any]:
        while True:
            self.pulled += 1
            yield self.make(self.pulled)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("chunksize", "most_pulled"),
    [
        (10, 1000),
        # Default chunking: nothing was measured when the first result came, so every chunk so
        # far is a first guess.
        (None, _map.MAP_PREFETCH_PER_WORKER * 2 * _map.MAP_FIRST_CHUNK),
    ],
)
def test_map_reads_its_input_lazily(pool2: Pool, chunksize: int | None, most_pulled: int) -> None:
    numbers = Endless(int)
    results = pool2.map(tasks.ident, numbers, chunksize=chunksize)
    assert [next(results) for _ in range(5)] == [1, 2, 3, 4, 5]
    assert numbers.pulled <= most_pulled  # bounded read-ahead
    results.close()


@pytest.mark.timeout(60)
def test_map_bounds_the_read_ahead_of_big_items_by_their_bytes_from_the_first_chunk(
    pool2: Pool,
) -> None:
    """Default chunks hold about ``MAP_CHUNK_BYTES`` pickled, from the bytes of the first
    items: the first window was chunks of ``MAP_FIRST_CHUNK`` items whatever their size, so a
    map of 1 MB items read 512 of them (and stashed them) before its first result."""
    item = 100_000  # bytes: about 5 per chunk
    blobs = Endless(lambda _: bytes(item))  # a new object each: pickle shares repeated ones
    results = pool2.map(len, blobs)
    assert next(results) == item
    per_chunk = _map.MAP_CHUNK_BYTES // item
    first = _map.MAP_SAMPLE_ITEMS  # the first chunk holds the items its size is read from
    assert blobs.pulled <= first + (_map.MAP_PREFETCH_PER_WORKER * 2 - 1) * per_chunk
    results.close()


@pytest.mark.timeout(60)
def test_map_bounds_its_chunks_by_the_bytes_of_their_results(
    pool2: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once results came, default chunks hold about ``MAP_CHUNK_BYTES`` of pickled results too:
    sized from their small arguments only, they grew to thousands of items each, and a map of
    small inputs with big results returned one huge list per chunk (a reviewer measured
    240-320 MB in the caller for 1 MB results)."""
    monkeypatch.setattr(_map, "MAP_CHUNK_BYTES", 64 * 1024)  # small, to keep this test light
    item = 8 * 1024  # bytes per result: about 8 per chunk
    sizes = Endless(lambda _: item)
    results = pool2.map(tasks.make_bytes, sizes)
    # The first window is sized from the arguments alone (nothing came back yet); every chunk
    # read after it was sized from results.
    first_window = _map.MAP_PREFETCH_PER_WORKER * 2 * _map.MAP_FIRST_CHUNK
    per_chunk = _map.MAP_CHUNK_BYTES // item
    consumed = 0
    for _ in range(first_window + _map.MAP_PREFETCH_PER_WORKER * 2 * per_chunk):
        assert len(next(results)) == item
        consumed += 1
    assert sizes.pulled - consumed <= _map.MAP_PREFETCH_PER_WORKER * 2 * per_chunk  # in flight
    results.close()


def test_map_sends_one_chunk_per_worker_until_the_size_of_its_results_is_known(
    pool2: Pool,
) -> None:
    """Before any result came back, a default chunk's results have no known size: a full
    window of chunks (``MAP_PREFETCH_PER_WORKER`` per worker) of small inputs with 1 MB
    results was 512 MB on its way back before the first result."""
    item = 64 * 1024  # bytes per result
    sizes = Endless(lambda _: item)
    results = pool2.map(tasks.make_bytes, sizes)
    assert len(next(results)) == item
    assert sizes.pulled <= 2 * _map.MAP_FIRST_CHUNK  # one chunk per worker
    results.close()


@pytest.mark.timeout(60)
def test_map_stops_a_first_chunk_by_the_bytes_of_its_results(
    pool2: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first chunk is sized by its small arguments alone (64 items), so 64 KiB results made
    one list of 4 MiB; the chunk stops once its pickled results pass ``MAP_CHUNK_STOP_BYTES``,
    and its other items go again."""
    monkeypatch.setattr(_map, "MAP_CHUNK_BUDGET", math.inf)  # only the bytes may stop a chunk
    chunks: list[mpsched.Future] = []
    submit = Pool._submit  # what a map's sends call

    def recording_submit(self: Pool, options: Any, fn: Any, *rest: Any) -> mpsched.Future:
        future = submit(self, options, fn, *rest)
        if fn is run_chunk:
            chunks.append(future)
        return future

    monkeypatch.setattr(Pool, "_submit", recording_submit)
    item = 64 * 1024  # bytes per result
    assert [len(r) for r in pool2.map(tasks.make_bytes, [item] * 200)] == [item] * 200
    returned = [sum(map(len, future.result()[0])) for future in chunks]
    assert max(returned) <= 2 * _map.MAP_CHUNK_STOP_BYTES, returned


@pytest.mark.timeout(60)
def test_map_sends_again_what_a_chunk_left_at_its_budget(
    pool2: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_map, "MAP_CHUNK_BUDGET", 0.0)  # every chunk stops after one item
    data = list(range(300))
    assert list(pool2.map(tasks.ident, data)) == data
    assert list(pool2.map(tasks.add, data, data)) == [2 * x for x in data]
    results = pool2.map(tasks.boom, ["first", "second"])
    with pytest.raises(ValueError, match="first"):
        next(results)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunking", ["chunksize 1", "default, 0.5 ms items", "budget 0"])
def test_a_map_with_a_timeout_works_on_while_its_reader_pauses(
    pool2: Pool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunking: str
) -> None:
    """Its timeout counts from the call, as ProcessPoolExecutor.map's, which submits the whole
    input then: a reader that paused between results left the workers idle once the read-ahead
    was done (the rest of a chunk stopped at its budget waited for the reader too), and the
    results still to come timed out. An input with a length now goes on as chunks end."""
    if chunking == "budget 0":
        monkeypatch.setattr(_map, "MAP_CHUNK_BUDGET", 0.0)  # every chunk stops after one item
    log = tmp_path / "log"
    log.touch()
    n = 400 if chunking.startswith("default") else 60
    seconds = 0.0005 if chunking.startswith("default") else 0.0
    results = pool2.map(
        tasks.spin_record,
        [str(log)] * n,
        range(n),
        [seconds] * n,
        chunksize=1 if chunking == "chunksize 1" else None,
        timeout=10 * CONDITION_TIMEOUT,
    )
    assert next(results) == 0
    wait_until(lambda: len(tasks.read_log(str(log))) == n, "every item ran, its reader paused")
    assert list(results) == list(range(1, n))
    assert sorted(tasks.read_log(str(log))) == list(range(n))  # each once


@pytest.mark.timeout(60)
@pytest.mark.parametrize("timeout", [0.0, None])
def test_a_map_works_ahead_of_its_reader_only_until_its_deadline(
    pool2: Pool, timeout: float | None
) -> None:
    """Past the deadline, or with none, chunks go only as the reader takes results: the
    results the reader can no longer get (or has not asked for) are not worked on."""
    results = pool2.map(tasks.ident, range(60), chunksize=1, timeout=timeout)
    (run,) = pool2._maps.live()
    assert run.eager is (timeout is not None)
    window = _map.MAP_PREFETCH_PER_WORKER * 2
    wait_until(lambda: all(f.done() for f, _ in list(run.in_flight)), "the first window ran")
    wait_until(lambda: run.unfinished == 0, "its chunks' callbacks ran")
    assert len(run.in_flight) == window
    if timeout is None:
        assert list(results) == list(range(60))
    else:
        with pytest.raises(concurrent.futures.TimeoutError):
            list(results)


@pytest.mark.timeout(60)
def test_map_raises_the_task_error_in_order(pool2: Pool) -> None:
    results = pool2.map(tasks.boom, ["first", "second"], chunksize=1)
    with pytest.raises(ValueError, match="first"):
        next(results)


@pytest.mark.timeout(60)
def test_a_pool_is_an_executor_that_asyncio_can_run_in(pool2: Pool) -> None:
    assert isinstance(pool2, concurrent.futures.Executor)

    async def run_all() -> list[int]:
        loop = asyncio.get_running_loop()
        return list(
            await asyncio.gather(*(loop.run_in_executor(pool2, tasks.add, i, 1) for i in range(5)))
        )

    assert asyncio.run(run_all()) == [1, 2, 3, 4, 5]


@pytest.mark.timeout(60)
def test_map_starts_its_work_at_the_call_and_splits_a_short_input_over_the_workers(
    pool2: Pool,
) -> None:
    """As ProcessPoolExecutor.map: the work starts at the call, not at the first ``next()``
    (a map never iterated ran nothing, and its timeout ran from the call while no work ran).
    A short input goes as a chunk a worker: sent from the front in chunks of 64, it ran on one
    worker while the other idled."""
    before = pool2.statistics()
    results = pool2.map(tasks.ident, iter(range(10)))
    wait_until(
        lambda: pool2.statistics().completed - before.completed == 2,
        "both chunks ran before any next()",
    )
    assert pool2.statistics().submitted - before.submitted == 2
    assert list(results) == list(range(10))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunksize", [1, 25, None])
def test_map_lets_go_of_each_big_result_once_the_caller_did(
    pool2: Pool, chunksize: int | None
) -> None:
    """As the stdlib's map (bpo-14406): a result is freed once the caller drops it (a chunk's
    list kept all of its results, and their memory, until its last was yielded)."""
    seen = 0
    for blob in pool2.map(tasks.make_blob, [4096] * 60, chunksize=chunksize):
        ref = weakref.ref(blob)
        del blob
        assert ref() is None
        seen += 1
    assert seen == 60


@pytest.mark.timeout(60)
def test_map_chunksize_beyond_sys_maxsize_is_one_chunk(pool2: Pool) -> None:
    """A positive int is valid at the call, so it must not fail later (islice's limit)."""
    results = pool2.map(tasks.add, range(10), range(10), chunksize=sys.maxsize + 1)
    assert list(results) == [2 * x for x in range(10)]
    assert list(pool2.map(tasks.ident, range(10), chunksize=2**64)) == list(range(10))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("chunksize", "error"),
    [
        (0, ValueError),
        (-1, ValueError),
        (1.5, TypeError),
        ("2", TypeError),
        (True, TypeError),
        (False, TypeError),
    ],
    ids=repr,
)
def test_map_bad_chunksize(pool2: Pool, chunksize: object, error: type[Exception]) -> None:
    """At the call, not at the first ``next()``; a wrong type is a TypeError (as for
    ``timeout``), a value below 1 a ValueError; a bool is not a chunk size (True is 1)."""
    with pytest.raises(error, match="chunksize"):
        pool2.map(tasks.ident, [1], chunksize=chunksize)  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_map_without_an_iterable_yields_nothing_as_executor_map(pool2: Pool) -> None:
    """A Pool is a ``concurrent.futures.Executor``, whose ``map(fn)`` is an empty iterator
    (not the builtin ``map(fn)``'s TypeError: code written for an executor may call it with
    no iterables, e.g. ``map(fn, *columns)`` of an empty table). Its arguments are still
    checked at the call."""
    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        assert list(executor.map(tasks.ident)) == []
    results = pool2.map(tasks.ident)
    assert list(results) == []
    results.close()
    assert list(pool2.map(tasks.ident, timeout=1, chunksize=2)) == []
    with pytest.raises(TypeError, match="fn must be callable"):
        pool2.map(5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunksize"):
        pool2.map(tasks.ident, chunksize=0)


# ---------------------------------------------------------------- ChildFuture
@pytest.mark.timeout(60)
def test_a_child_future_has_the_future_query_methods_and_cannot_be_cancelled() -> None:
    """Pool(1): no peer can steal the child, so it waits in the deque until ``result()``."""
    with Pool(1) as pool:
        before, after = pool.submit(tasks.child_future_states).result(timeout=30)
    assert before == {"done": False, "running": False, "cancel": False, "cancelled": False}
    assert after == {"done": True, "running": False, "cancel": False, "cancelled": False}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [1, 2])
def test_children_belong_to_the_thread_that_runs_the_task(workers: int) -> None:
    """A task's other threads get a RuntimeError from ``mpsched.submit`` and from an unsettled
    child future: the worker's children are that thread's state, without locks on its side,
    and two threads at it broke the pool (InternalError) or left a join asleep for good."""
    with Pool(workers) as pool:
        assert pool.submit(tasks.children_from_another_thread).result(timeout=30) == [
            True,
            True,
            True,
            5,
        ]
        assert pool.submit(tasks.fib, 10).result(timeout=30) == 55  # the pool goes on


@pytest.mark.timeout(60)
def test_a_join_never_runs_a_top_level_task_nested_above_the_waiting_task(tmp_path: Path) -> None:
    """A join helps with children only: a top-level task run nested above the waiting task
    made that task wait for it, and one that waited for the waiting task's progress (a child
    future it keeps, a file it writes after its join) hung the worker and the shutdown."""
    joining, gate_path = str(tmp_path / "joining"), str(tmp_path / "gate")
    opened = str(tmp_path / "opened")
    os.mkfifo(joining)
    os.mkfifo(gate_path)
    with Pool(2) as pool:
        parent = pool.submit(tasks.join_a_stolen_child, joining, gate_path)
        with open(joining, "rb") as fifo:
            assert fifo.read(1) == b"j"
        # The parent's worker sleeps in its join, its peer runs the gated child: the task goes
        # to an inbox, and only a run nested in the join could start it before the gate opens.
        later = pool.submit(tasks.flag_seen, opened)
        wait_until(lambda: pool.statistics().pending == 0, "the task was handed to a worker")
        Path(opened).touch()
        tasks.open_gate(gate_path)
        parent_pid = parent.result(timeout=20)
        pid, seen = later.result(timeout=20)
        assert seen, f"ran before the child ended (worker {pid}, the joining one: {parent_pid})"


@pytest.mark.timeout(60)
def test_a_child_future_is_running_once_a_peer_started_it(tmp_path: Path) -> None:
    fifos = Fifos(tmp_path)
    with Pool(2) as pool:
        states = pool.submit(tasks.child_running_states, fifos.started, fifos.gate).result(
            timeout=30
        )
    assert states == {"running": True, "cancel": False, "result": 7, "after": False}


# ---------------------------------------------------------------- nested tasks
@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [1, 2])
def test_fork_join_finishes_with_one_or_two_workers(workers: int) -> None:
    with Pool(workers) as pool:
        assert pool.submit(tasks.fib, 16).result() == 987
        assert pool.submit(tasks.rsum, 0, 100_000, 1000).result() == sum(range(100_000))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [1, 2])
def test_a_chain_of_nested_joins_goes_as_deep_as_plain_recursion(workers: int) -> None:
    """900 tasks, each joining the child it spawns. mpsched's own frames (four a level: the
    join's and the nested run's, or the inline run's three), counted against the default
    recursion limit of 1,000, stopped such a chain at ~230 levels with a RecursionError, where
    the same recursion in one process goes ~990 deep. The limit is back to its value after."""
    with Pool(workers) as pool:
        default = pool.submit(tasks.recursion_limit).result(timeout=60)
        assert pool.submit(tasks.chain, 900).result(timeout=120) == 900
        after = [pool.submit(tasks.recursion_limit).result(timeout=60) for _ in range(4)]
        assert after == [default] * 4


@pytest.mark.timeout(120)
def test_an_error_through_a_deep_chain_of_joins_keeps_its_root_in_a_bounded_traceback(
    pool2: Pool,
) -> None:
    """300 nested tasks, each joining its child; the last raises. Each level re-raised its
    child's error, embedding the child's whole traceback text in its own: the text grew with the
    square of the depth (517 KB and 3.3 s at 900 levels). It is cut to ``TRACEBACK_TEXT_MAX``
    characters, and still shows the root error first."""
    with pytest.raises(ValueError, match="leaf") as info:
        pool2.submit(tasks.chain_raise, 300).result(timeout=120)
    text = str(info.value.__cause__)
    assert len(text) < _protocol.TRACEBACK_TEXT_MAX + 100
    assert "characters left out" in text
    assert "ValueError: leaf" in text[: _protocol.TRACEBACK_TEXT_MAX // 2]


@pytest.mark.timeout(60)
def test_fire_and_forget_children_finish_before_shutdown(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "log")
    open(path, "wb").close()
    with Pool(2) as pool:
        futures = [pool.submit(tasks.fire_and_forget, path, i) for i in range(200)]
        assert sorted(f.result() for f in futures) == list(range(200))
    assert sorted(tasks.read_log(path)) == list(range(200))


# ---------------------------------------------------------------- shutdown
@pytest.mark.timeout(60)
def test_submit_after_shutdown_is_refused(pool2: Pool) -> None:
    pool2.shutdown()
    pool2.shutdown()  # a no-op
    with pytest.raises(PoolClosedError):
        pool2.submit(tasks.ident, 1)
    with pytest.raises(RuntimeError):
        pool2.submit(tasks.ident, 1)
    assert pool2.await_termination(0)


@pytest.mark.timeout(60)
def test_shutdown_from_two_threads(pool2: Pool) -> None:
    futures = [pool2.submit(tasks.spin, 0.001) for _ in range(200)]
    barrier = threading.Barrier(2)

    def stop() -> None:
        barrier.wait()
        pool2.shutdown(wait=True)

    threads = [threading.Thread(target=stop) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(f.result() == 0.001 for f in futures)


@pytest.mark.timeout(120)
def test_shutdown_while_tasks_spawn_children(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "log")
    open(path, "wb").close()
    pool = Pool(2)
    futures = [pool.submit(tasks.record_with_children, path, i, 5) for i in range(1, 301)]
    pool.shutdown(wait=True)
    assert all(f.done() for f in futures)
    log = tasks.read_log(path)
    assert len(log) == len(set(log)) == 300 * 6


@pytest.mark.timeout(60)
def test_shutdown_cancel_futures_cancels_unclaimed_work(tmp_path: object) -> None:
    fifo = os.path.join(str(tmp_path), "gate")
    started = os.path.join(str(tmp_path), "started")
    os.mkfifo(fifo)
    os.mkfifo(started)
    pool = Pool(1)
    blocker = pool.submit(tasks.started_then_gated, started, fifo, "blocker")
    queued = [pool.submit(tasks.ident, i) for i in range(1000)]
    tasks.wait_started(started)  # the blocker runs: everything else is unclaimed
    stopper = threading.Thread(target=pool.shutdown, kwargs={"cancel_futures": True})
    stopper.start()
    # The gate opens once the shutdown has cancelled: else the worker may run its inbox, and
    # the loop refill it, before the shutdown is asked for (more than 128 run: rightly).
    wait_until(queued[-1].cancelled, "the shutdown cancelled the last task queued")
    tasks.open_gate(fifo)
    stopper.join()
    assert blocker.result() == "blocker"
    _done, not_done = wait(queued, timeout=10)
    assert not not_done
    cancelled = [f for f in queued if f.cancelled()]
    ran = [f for f in queued if not f.cancelled()]
    assert len(cancelled) + len(ran) == 1000
    assert len(cancelled) >= 1000 - 128  # at most the inbox's content can have been claimed
    for f in cancelled:
        with pytest.raises(CancelledError):
            f.result()


@pytest.mark.timeout(60)
def test_future_cancel_before_a_worker_claims_it(tmp_path: object) -> None:
    fifo = os.path.join(str(tmp_path), "gate")
    os.mkfifo(fifo)
    path = os.path.join(str(tmp_path), "log")
    open(path, "wb").close()
    with Pool(1) as pool:
        blocker = pool.submit(tasks.gated_ident, fifo, "blocker")
        queued = [pool.submit(tasks.record, path, i) for i in range(300)]
        cancelled = [f.cancel() for f in queued]
        tasks.open_gate(fifo)
        assert blocker.result() == "blocker"
        assert pool.submit(tasks.ident, 5).result() == 5
        slab = pool._views.slab
        assert slab.free_count() == slab.capacity  # no block leaked or injected without a task
    ran = set(tasks.read_log(path))
    for i, (f, ok) in enumerate(zip(queued, cancelled, strict=True)):
        assert ok == f.cancelled()
        assert (i in ran) != ok  # exactly one of: cancelled, or ran


@pytest.mark.timeout(60)
def test_an_internal_error_breaks_the_pool_loudly_and_it_still_shuts_down() -> None:
    pool = Pool(2)
    trigger = pool.submit(tasks.send_fatal)
    assert pool._coordinator.finished.wait(30), "the coordinator did not stop on FATAL"
    assert trigger.done()  # its result, or BrokenPoolError if the FATAL was read first
    with pytest.raises(BrokenPoolError, match="simulated bug"):
        pool.submit(tasks.ident, 1)
    pool.shutdown(wait=True)  # no hang; the no_leaks fixture checks processes and fds


@pytest.mark.timeout(60)
def test_ctrl_c_in_the_with_block_cancels_unclaimed_work() -> None:
    futures: list[mpsched.Future] = []

    def interrupted_block() -> None:
        with Pool(1) as pool:
            futures.extend(pool.submit(tasks.spin, 0.001) for _ in range(2000))
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        interrupted_block()
    assert all(f.done() for f in futures)
    assert sum(f.cancelled() for f in futures) >= 1000  # not run to the end (~2 s of work)
    assert all(f.result() == 0.001 for f in futures if not f.cancelled())


@pytest.mark.timeout(60)
def test_ctrl_c_in_the_with_block_stops_the_children_of_running_tasks(fifos: Fifos) -> None:
    """Leaving on Ctrl-C kills the workers running tasks, so that the exit never waits for a
    long task: nor for their children, running on a peer or queued behind the killed task
    (the drain waited until every child of the killed parent had run to its end, here for
    ever: they wait at a gate that is never opened)."""
    futures: list[mpsched.Future] = []
    open(fifos.log, "wb").close()

    def interrupted_block() -> None:
        with Pool(2) as pool:
            futures.append(pool.submit(et.parent_of_gated_children, fifos.log, fifos.gate, 4))
            # One child runs in the parent's worker (its join), one on the peer (stolen).
            wait_until(lambda: len(tasks.read_log(fifos.log)) == 2, "two children run")
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        interrupted_block()
    assert futures[0].cancelled()
    assert len(tasks.read_log(fifos.log)) == 2  # the queued children never ran


@pytest.mark.timeout(60)
def test_a_result_is_not_held_back_by_the_next_long_task(tmp_path: object) -> None:
    fifo = os.path.join(str(tmp_path), "gate")
    os.mkfifo(fifo)
    with Pool(1) as pool:
        quick = pool.submit(tasks.ident, "quick")
        blocker = pool.submit(tasks.gated_ident, fifo, "blocker")  # runs until the gate opens
        assert quick.result(timeout=20) == "quick"  # while the same worker is still blocked
        tasks.open_gate(fifo)
        assert blocker.result() == "blocker"


@pytest.mark.timeout(60)
def test_statistics(pool2: Pool) -> None:
    for f in [pool2.submit(tasks.ident, i) for i in range(500)]:
        f.result()
    stats = pool2.statistics()
    assert stats.workers == 2
    assert stats.submitted == 500
    assert stats.completed == 500
    assert sum(w.executed for w in stats.per_worker) == 500


@pytest.mark.timeout(60)
def test_a_result_call_that_stalled_past_the_pools_end_returns() -> None:
    """``Future.result()`` that saw the future pending, then lost the CPU until the pool had
    settled it, drained and released its memory, goes on into ``help_wait``: it must find
    nothing to do (it raised ValueError on the released memory)."""
    pool = Pool(1)
    f = pool.submit(tasks.ident, 1)
    assert f.result(timeout=20) == 1
    pool.shutdown()
    pool._coordinator.help_wait(f)  # the stalled caller's next step
    assert f.result(timeout=0) == 1


@pytest.mark.timeout(90)
@pytest.mark.parametrize("inner", ["fork", "forkserver", "spawn"])
def test_a_pool_in_a_task_starts_under_fork_and_says_why_not_otherwise(
    pool2: Pool, inner: str
) -> None:
    """A worker is a daemonic process, which multiprocessing lets start no child: a pool in a
    task works under fork (its zygote is a bare fork) and otherwise fails with a message that
    says so, not multiprocessing's bare AssertionError."""
    future = pool2.submit(tasks.nested_pool, inner)
    if inner == "fork":
        assert future.result(timeout=60) == 42
    else:
        with pytest.raises(RuntimeError, match=r"daemonic process .* mpsched\.submit") as raised:
            future.result(timeout=60)
        assert "body of module" not in str(raised.value)  # no module was being imported


@pytest.mark.timeout(60)
def test_a_pool_started_by_a_module_body_in_a_worker_names_that_module(pool2: Pool) -> None:
    """A module that starts a pool as it is imported, imported in a worker (as the worker
    imports a task's module to load its function): the error names that module and the way
    out, not only the daemonic process (a user saw a deadlock elsewhere, gh-155890)."""
    future = pool2.submit(importlib.import_module, "tests.integration.pool_at_import")
    with pytest.raises(RuntimeError, match=r"daemonic process") as raised:
        future.result(timeout=60)
    message = str(raised.value)
    assert "body of module 'tests.integration.pool_at_import'" in message
    assert "if __name__ == '__main__':" in message


@pytest.mark.timeout(60)
def test_map_yields_the_results_before_one_that_does_not_pickle(pool2: Pool) -> None:
    """As the builtin ``map`` does before an error: the results before the bad one, from the
    same chunk, come out first (the chunk's task failing dropped them)."""
    results = pool2.map(tasks.lock_at, [1, 2, 3, 4], chunksize=4)
    assert [next(results), next(results)] == [1, 2]
    with pytest.raises(TypeError, match=r"cannot pickle the result <.*return picklable values"):
        next(results)
