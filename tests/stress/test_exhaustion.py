"""Every bounded shared-memory structure pushed to its limit, and long runs with bounded memory.

The pool's structures have fixed sizes (docs/design.md, "Shared-memory layout"): a slab of
``BLOCKS_PER_WORKER * workers`` task blocks, per-worker deques (``DEQUE_CAPACITY``), inboxes
(the dispatch window), done rings, a run stack (``MAX_NESTING``), a function table
(``FTAB_MAX_FIDS``) and the coordinator's stash for what does not fit. Each test drives one to
its limit and checks that nothing hangs, every future ends with the right outcome, the pool
stays usable, and every block and stash entry is returned.
"""

from __future__ import annotations

import collections
import gc
import os
import threading
import time
import weakref
from concurrent.futures import CancelledError
from pathlib import Path

import psutil
import pytest

from mpsched import Pool, TaskState
from mpsched._function_table import FTAB_MAX_FIDS
from mpsched._heap import COMPACT_FACTOR
from mpsched._payloads import BLOCK_BYTES, BLOCK_HEADER_BYTES, CHAIN_BYTES_MAX, MAX_CHAIN_BLOCKS
from mpsched._serialize import dumps
from mpsched._slot_region import MAX_NESTING
from mpsched._timed import FINISHED_IDS_KEPT
from tests.integration.conditions import CONDITION_TIMEOUT, start_every_worker, wait_until
from tests.stress import exhaustion_tasks as tasks

pytestmark = pytest.mark.slow  # a stress test: `-m 'not slow'` skips it, as the README says


def _hold_collect(pool: Pool) -> tuple[threading.Event, threading.Event]:
    """Hold the coordinator thread at the start of its next loop pass (in ``collect``, the
    first call of every pass; a user thread's collection is not held). Returns (in_hold,
    go_on): set go_on to let it continue."""
    coordinator = pool._coordinator
    collect = coordinator.collect
    in_hold, go_on = threading.Event(), threading.Event()

    def held_collect() -> None:
        if not go_on.is_set() and threading.get_ident() == coordinator.thread_id:
            in_hold.set()
            go_on.wait(CONDITION_TIMEOUT)
        collect()

    coordinator.collect = held_collect  # type: ignore[method-assign]
    pool._wakeup.wakeup()
    assert in_hold.wait(CONDITION_TIMEOUT), "the coordinator loop did not come round"
    return in_hold, go_on


def _assert_all_returned(pool: Pool) -> None:
    """Once the pool is quiet: every slab block is free again and nothing is left stashed."""
    slab = pool._views.slab
    coordinator = pool._coordinator
    wait_until(lambda: slab.free_count() == slab.capacity, "every slab block is free again")
    assert not coordinator.stash
    assert not coordinator.by_handle


def _wait_no_live_children(pool: Pool) -> None:
    """A child's executor publishes DONE (its parent may then return, and free its block)
    before it counts the child out of ``live_children``: the count reaches 0 a moment after
    the last result, not with it."""
    header = pool._views.header
    wait_until(lambda: header.live_children() == 0, "no child is counted live")


# ---------------------------------------------------------------- regressions
def test_a_batch_the_slab_can_only_partly_hold_loses_no_task() -> None:
    """Found here: when the slab had some free blocks but fewer than a dispatch batch needed,
    ``inject`` cut the batch only if NO block was free; otherwise the tasks past the last block
    were injected with handle -1 (a worker then claimed "block -1") and their futures never
    ended. Reached naturally by tasks with big results (they hold chains of blocks until
    collected: 3,000 results of 100 KB lost dozens of futures).

    Made deterministic: the coordinator thread is held while the test takes all but a few
    blocks and queues a batch bigger than that; once let go, its pass dispatches the batch."""
    pool = Pool(2)
    slab = pool._views.slab
    taken: list[int] = []
    try:
        assert pool.submit(tasks.ident, 0).result(CONDITION_TIMEOUT) == 0
        _, go_on = _hold_collect(pool)
        spare = 5
        taken = slab.alloc_many(slab.free_count() - spare)
        futures = [pool.submit(tasks.ident, i) for i in range(40)]
        go_on.set()
        # 5 blocks suffice: each result read frees its block for the next task.
        assert [f.result(CONDITION_TIMEOUT) for f in futures] == list(range(40))
        slab.free_many(taken)
        taken = []
        assert pool.submit(tasks.ident, 1).result(CONDITION_TIMEOUT) == 1
        _assert_all_returned(pool)
    finally:
        if taken:
            slab.free_many(taken)
        pool.shutdown(cancel_futures=True)


def test_submitted_closures_and_what_they_capture_are_not_kept() -> None:
    """Found here: the submitting side's function cache (``FunctionCache``) remembered every
    function it could not table (a lambda, a closure) with a strong reference, so every closure
    ever submitted, and all it captured, lived as long as the pool: a loop submitting
    ``lambda: work(chunk)`` kept every chunk."""
    with Pool(1) as pool:
        refs = []
        for _ in range(20):
            obj = tasks.Captured(100_000)
            refs.append(weakref.ref(obj))
            assert pool.submit(tasks.closure_over(obj)).result(CONDITION_TIMEOUT) == 100_000
            del obj
        gc.collect()
        kept = sum(ref() is not None for ref in refs)
        assert kept == 0, f"{kept} captured objects are still alive after their tasks ended"


def test_uids_still_name_their_worker_after_two_billion() -> None:
    """Found here: a worker numbers its children and stash keys ``pid << 31 | counter`` and the
    crash recovery finds a dead worker's children (and stashed bytes) by ``uid >> 31 == pid``;
    the counter was never bounded, so after 2**31 spawns in one worker's life (hours of a busy
    pool without max_tasks_per_worker) uids named another pid: a crash then left that
    worker's children unfound (their parents waited forever) and keys could collide with a
    peer's. Made deterministic by setting the counter near the limit. (Past 2**31 alone, an
    odd pid hides the overlap: bit 31 is one of its own; far past it, counter bits fall on
    the pid's low 14 bits, which are all ones for no pid but one in 16,384.)"""
    with Pool(1) as pool:
        for start in (2**31 - 2, 2**45 - 2):
            uids = pool.submit(tasks.uids_past_the_counter_limit, start)
            assert uids.result(CONDITION_TIMEOUT) == [True] * 4, start
        assert pool.submit(tasks.spawn_past_the_counter_limit).result(CONDITION_TIMEOUT) == 15
        _assert_all_returned(pool)


# ---------------------------------------------------------------- the slab
def test_more_tasks_in_flight_than_slab_blocks_with_small_and_chained_payloads() -> None:
    """20,000 tasks submitted at once: five times the slab's 4,096 blocks (2 workers), so most
    wait in the coordinator's ready queue; one in ten has arguments and a result of 3 KB (a
    chain of 4 blocks each way). 20,000 is enough: the in-flight bound (1,024) and the slab are
    each passed many times over; more only adds seconds."""
    n = 20_000
    pad = b"p" * 3000
    with Pool(2) as pool:
        futures = [
            pool.submit(tasks.blob, 3000) if i % 10 == 0 else pool.submit(tasks.ident, i)
            for i in range(n)
        ]
        big = [pool.submit(tasks.size_of, pad) for _ in range(n // 10)]
        for i, f in enumerate(futures):
            assert f.result(CONDITION_TIMEOUT) == (tasks.blob(3000) if i % 10 == 0 else i)
        assert all(f.result(CONDITION_TIMEOUT) == 3000 for f in big)
        _assert_all_returned(pool)
        assert pool.submit(tasks.ident, "still usable").result(CONDITION_TIMEOUT) == "still usable"


CHAINED = 50_000  # bytes: a payload in a 53-block chain, under MAX_CHAIN_BLOCKS


def test_results_that_fill_the_slab_go_through_the_stash() -> None:
    """2,400 results of 50 KB (a 53-block chain each): 78 of them fill the slab, so results
    wait in chains while later ones must go through the coordinator's stash, and dispatch
    meets a slab with fewer free blocks than a batch needs (the regression above, reached
    without any hold). 2,400 passes the slab ~30 times over in about a second."""
    assert CHAINED < CHAIN_BYTES_MAX
    with Pool(2) as pool:
        futures = [pool.submit(tasks.blob, CHAINED, i % 251) for i in range(2400)]
        for i, f in enumerate(futures):
            assert f.result(CONDITION_TIMEOUT) == tasks.blob(CHAINED, i % 251)
        _assert_all_returned(pool)


def test_arguments_that_fill_the_slab_go_through_the_stash() -> None:
    """The same for arguments (read and released by the worker before it runs the task), and
    huge keyword arguments (5 MB: past a chain's ~60 KB, always stashed)."""
    with Pool(2) as pool:
        pad = b"a" * CHAINED
        futures = [pool.submit(tasks.size_of, pad) for _ in range(1200)]
        huge = pool.submit(tasks.kwargs_sizes, x=b"x" * 5_000_000, y=b"y" * 3_000_000)
        assert all(f.result(CONDITION_TIMEOUT) == CHAINED for f in futures)
        assert huge.result(CONDITION_TIMEOUT) == {"x": 5_000_000, "y": 3_000_000}
        _assert_all_returned(pool)


def _result_of_pickled_size(target: int) -> int:
    """The length of a bytes result whose pickle (as a worker writes it) is ``target`` long."""
    n = target - (len(dumps(b"\0" * target)) - target)
    assert len(dumps(b"\0" * n)) == target, target
    return n


def test_results_at_and_just_past_a_block_and_a_chain() -> None:
    """A result exactly filling one block's data area, one byte more (a chain of 2), exactly
    the longest chain (MAX_CHAIN_BLOCKS blocks), and one byte more (the stash)."""
    cap = BLOCK_BYTES - BLOCK_HEADER_BYTES
    with Pool(1) as pool:
        for target in (cap, cap + 1, MAX_CHAIN_BLOCKS * cap, MAX_CHAIN_BLOCKS * cap + 1):
            n = _result_of_pickled_size(target)
            assert pool.submit(tasks.blob, n, 3).result(CONDITION_TIMEOUT) == tasks.blob(n, 3)
            # The argument side: a payload about as long (the call's own bytes add a little).
            assert pool.submit(tasks.size_of, b"q" * n).result(CONDITION_TIMEOUT) == n
        _assert_all_returned(pool)


# ---------------------------------------------------------------- children: deque and slab
def test_children_beyond_the_deque_and_the_slab_run_inline() -> None:
    """Each of two tasks spawns children without joining any, then joins them all: 3,000 small
    children (past DEQUE_CAPACITY = 1,024: the rest run inline), then 1,500 with 3 KB of
    arguments (4 blocks each: 1,024 queued per worker want 8,192 blocks, twice the slab, so
    spawns also meet a full slab and run inline)."""
    with Pool(2) as pool:
        small = [pool.submit(tasks.spawn_then_join, 3000, 0) for _ in range(2)]
        big = [pool.submit(tasks.spawn_then_join, 1500, 3000) for _ in range(2)]
        assert [f.result(CONDITION_TIMEOUT) for f in small] == [sum(range(3000))] * 2
        assert [f.result(CONDITION_TIMEOUT) for f in big] == [sum(range(1500)) + 1500 * 3000] * 2
        _assert_all_returned(pool)
        _wait_no_live_children(pool)


@pytest.mark.parametrize("workers", [1, 2])
def test_nesting_deeper_than_the_run_stack(workers: int) -> None:
    """Children joined 100 deep: past MAX_NESTING (64) run-stack entries the spawns run inline
    (a pushed child could wait forever for a joiner that may not help any more). 100 is past
    the limit by half as much again while staying within Python's recursion limit (each
    level costs a few frames)."""
    depth = MAX_NESTING + 36
    with Pool(workers) as pool:
        futures = [pool.submit(tasks.nest, depth) for _ in range(2 * workers)]
        assert [f.result(CONDITION_TIMEOUT) for f in futures] == [depth] * (2 * workers)
        _assert_all_returned(pool)
        _wait_no_live_children(pool)


# ---------------------------------------------------------------- done rings
def test_done_rings_fill_while_the_coordinator_does_not_collect() -> None:
    """The coordinator thread skips its collection while the workers finish every task it may
    have in flight (max_inflight): the done rings, sized for that bound, take them all, and
    everything is read once collection resumes."""
    pool = Pool(2)
    coordinator = pool._coordinator
    collect = coordinator.collect
    skipping = threading.Event()
    skipping.set()

    def skipped_collect() -> None:
        if not (skipping.is_set() and threading.get_ident() == coordinator.thread_id):
            collect()

    try:
        coordinator.collect = skipped_collect  # type: ignore[method-assign]
        n = 3 * coordinator.max_inflight
        futures = [pool.submit(tasks.ident, i) for i in range(n)]
        slots = pool._views.slots
        wait_until(
            lambda: sum(s.done_depth() for s in slots) == coordinator.max_inflight,
            "the done rings hold every task in flight",
        )
        assert not any(f.done() for f in futures[coordinator.max_inflight :])
        skipping.clear()
        pool._wakeup.wakeup()
        assert [f.result(CONDITION_TIMEOUT) for f in futures] == list(range(n))
        _assert_all_returned(pool)
    finally:
        skipping.clear()
        pool.shutdown(cancel_futures=True)


# ---------------------------------------------------------------- function table
def test_more_distinct_functions_than_the_function_table_holds() -> None:
    """4,296 distinct module functions: the first FTAB_MAX_FIDS (4,096) are tabled, the rest
    go inline; every one runs right, in both workers (each loads the tabled ones it meets)."""
    with Pool(2) as pool:
        futures = [pool.submit(tasks.numbered(i), 1) for i in range(tasks.NUMBERED)]
        assert [f.result(CONDITION_TIMEOUT) for f in futures] == [
            i + 1 for i in range(tasks.NUMBERED)
        ]
        assert pool._views.functions._w[0] == FTAB_MAX_FIDS  # count: the table is full
        again = [pool.submit(tasks.numbered(i), 2) for i in (0, FTAB_MAX_FIDS, tasks.NUMBERED - 1)]
        assert [f.result(CONDITION_TIMEOUT) for f in again] == [
            2,
            FTAB_MAX_FIDS + 2,
            tasks.NUMBERED + 1,
        ]
        _assert_all_returned(pool)


# ---------------------------------------------------------------- long runs, bounded memory
_CONTAINERS = (dict, set, list, collections.deque)


def _container_sizes(pool: Pool) -> dict[str, int]:
    """The length of every container the pool's bookkeeping holds (the coordinator, its
    ready queue and timetable, the heap, the function cache): all bounded once quiet."""
    coordinator = pool._coordinator
    owners = {
        "coordinator": coordinator,
        "ready": coordinator.ready,
        "timetable": coordinator.timetable,
        "heap": coordinator.timetable.heap,
        "functions": pool._functions,
    }
    sizes = {}
    for name, owner in owners.items():
        attrs = set(getattr(owner, "__dict__", ()))
        for cls in type(owner).__mro__:
            attrs.update(getattr(cls, "__slots__", ()))
        for attr in attrs:
            value = getattr(owner, attr, None)
            if isinstance(value, _CONTAINERS):
                sizes[f"{name}.{attr}"] = len(value)
    return sizes


def _open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def _rss() -> int:
    return int(psutil.Process().memory_info().rss)


def test_a_long_run_of_tiny_tasks_keeps_memory_bounded() -> None:
    """100,000 tiny tasks in batches of 10,000 (each batch waited for). After the first two
    batches (warm-up: caches, pymalloc arenas), no bookkeeping container grows, the count of
    live Python objects stays put and RSS grows by less than 8 MB: a per-task leak of one
    object or 80 bytes would show (100 objects per 1,000 tasks / 8 MB over 80,000 tasks). The
    brief's 200,000 would take ~10 s on 2 cores; 100,000 catches any per-task residue as
    well."""
    batch, batches = 10_000, 10
    with Pool(2) as pool:
        for b in range(batches):
            futures = [pool.submit(tasks.ident, i) for i in range(batch)]
            assert sum(f.result(CONDITION_TIMEOUT) for f in futures) == sum(range(batch))
            del futures
            if b == 1:
                gc.collect()
                sizes, objects, rss = _container_sizes(pool), len(gc.get_objects()), _rss()
        _assert_all_returned(pool)
        gc.collect()
        grown = {k: v for k, v in _container_sizes(pool).items() if v > sizes[k]}
        assert not grown, grown
        assert len(gc.get_objects()) - objects < 1000
        assert _rss() - rss < 8 * 1024 * 1024
        assert pool.statistics().completed == batch * batches


def test_many_scheduled_then_cancelled_ids_are_forgotten_past_the_cap() -> None:
    """FINISHED_IDS_KEPT + 10,000 ids scheduled far ahead and cancelled: the heap prunes its
    stale entries as it goes (it never holds them all), the records of ended ids are capped at
    FINISHED_IDS_KEPT (the oldest are forgotten: state() is None), and the pool still runs a
    scheduled task. Past the cap by 10,000 is enough to see the oldest forgotten."""
    n = FINISHED_IDS_KEPT + 10_000
    later = time.monotonic() + 600.0
    with Pool(1) as pool:
        heap = pool._coordinator.timetable.heap
        biggest_heap = 0
        for start in range(0, n, 10_000):
            futures = [
                pool.schedule(i, later, 0, tasks.ident, i) for i in range(start, start + 10_000)
            ]
            for i in range(start, start + 10_000):
                assert pool.cancel(i)
            assert all(f.cancelled() for f in futures)
            biggest_heap = max(biggest_heap, heap.heap_size)
        assert biggest_heap < 3 * 10_000, biggest_heap  # pruned: never all n entries
        assert len(heap) == 0
        assert len(heap._records) == len(heap._finished) == FINISHED_IDS_KEPT
        assert pool.state(0) is None  # forgotten, oldest first
        assert pool.state(n - 1) is TaskState.CANCELLED
        assert pool.schedule("after", 0.0, 0, tasks.ident, 5).result(CONDITION_TIMEOUT) == 5
        _assert_all_returned(pool)


def test_a_recurring_task_run_thousands_of_times_leaves_no_residue(tmp_path: Path) -> None:
    """A recurrence every 0.1 ms, run ~2,000 times (each run is a version of the id, with its
    own future and block): once cancelled, nothing of its runs is left in the coordinator
    beyond the one id's record. 2,000 runs take about a second."""
    log = str(tmp_path / "runs")
    open(log, "wb").close()
    with Pool(2) as pool:
        assert pool.submit(tasks.count, log).result(CONDITION_TIMEOUT) == 0  # tables count
        start_every_worker(pool)
        wait_until(lambda: len(pool._coordinator.by_fd) == 2, "both workers started")
        before = _container_sizes(pool)
        rec = pool.with_options(every=0.0001).schedule("r", 0.0, 0, tasks.count, log)
        wait_until(lambda: os.path.getsize(log) >= 2000, "the recurrence ran 2,000 times")
        assert pool.cancel("r")
        with pytest.raises(CancelledError):
            rec.result(CONDITION_TIMEOUT)
        # A collection takes the last run out of by_handle before it records the run's end in
        # the timetable (end_runs), the cancel request for that run waits for the loop's next
        # pass, and a next run that the cancel withdrew leaves its entry, stale, in the heap
        # until the loop's pass at its due time pops it, or in the ready queue until the next
        # dispatch does (lazy deletion): all are transient (a leak still fails this wait).
        coordinator = pool._coordinator
        heap = coordinator.timetable.heap
        wait_until(
            lambda: (
                not (
                    coordinator.by_handle
                    or coordinator.timetable.handed
                    or coordinator.requests
                    or heap.heap_size
                    or coordinator.ready
                )
            ),
            "the last run ended and the coordinator is done with it",
        )
        _assert_all_returned(pool)
        after = _container_sizes(pool)
        # The ended-id memory takes an entry per end, stale once the id runs again, until it
        # compacts at twice the cap (_heap, "ended-id memory"); nothing else holds anything
        # per run.
        assert after.pop("heap._finished") <= COMPACT_FACTOR * FINISHED_IDS_KEPT
        grown = {k: (before[k], v) for k, v in after.items() if v > before[k]}
        assert grown == {"heap._records": (0, 1)}, grown  # the id's one record
        # CANCELLED if the cancel found the next run waiting, COMPLETED if it found one running.
        assert pool.state("r") in (TaskState.CANCELLED, TaskState.COMPLETED)


def test_fifty_pools_in_a_row_leave_nothing_behind() -> None:
    """Pools created and shut down one after another: after each, the process has the same
    open fds, threads and children as before the first (the conftest checks the end too;
    checking after each pool shows a per-pool leak 50 times over)."""
    me = psutil.Process()
    fds, threads = _open_fds(), threading.active_count()
    children = {p.pid for p in me.children()}  # multiprocessing's session-long helpers
    for i in range(50):
        with Pool(2) as pool:
            assert pool.submit(tasks.ident, i).result(CONDITION_TIMEOUT) == i
        assert _open_fds() == fds, i
        assert threading.active_count() == threads, i
        wait_until(
            lambda: {p.pid for p in me.children()} <= children, "the pool's processes exited"
        )
