"""Every bounded shared-memory structure pushed to its limit, and long runs with bounded memory.

The pool's structures have fixed sizes (docs/design.md, "Shared-memory layout"): a slab of
``BLOCKS_PER_WORKER * workers`` task blocks, per-worker deques (``DEQUE_CAPACITY``), inboxes
(the dispatch window), done rings, a run stack (``MAX_NESTING``), a function table
(``FTAB_MAX_FIDS``) and the coordinator's stash for what does not fit. Each test drives one to
its limit and checks that nothing hangs, every future ends with the right outcome, the pool
stays usable, and every block and stash entry is returned.
"""

from __future__ import annotations

import gc
import threading
import weakref

from mpsched import Pool
from tests.integration.conditions import CONDITION_TIMEOUT, wait_until
from tests.stress import exhaustion_tasks as tasks


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
