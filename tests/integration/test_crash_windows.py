"""A worker killed at the worst moments of mpsched's own code (found by tests/stress/test_chaos.py,
reproduced here deterministically, see ``window_tasks``): inside a shared lock, with its pid
recorded as the holder or not yet; inside ``mpsched.submit``; with orphaned children queued;
between a child's DONE and the wake-up of its parent.

In each, the pool must fail only the dead worker's task, replace the worker, keep running tasks,
leak no slab block, and shut down. Every wait is bounded: a hang fails the test.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import select
import signal
import threading
import time
from collections.abc import Callable

import pytest

from mpsched import Pool, WorkerCrashedError, _lifecycle

from . import tasks
from . import window_tasks as wt

TIMEOUT = 20.0  # s; every future, wait and shutdown here must end within this
POLL = 0.002  # s; period of the bounded polls of shared-memory words


def wait_dead(pid: int) -> None:
    """Until process ``pid`` has exited (its pidfd turns readable), at most TIMEOUT."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # exited and reaped already
    try:
        readable, _, _ = select.select([fd], [], [], TIMEOUT)
        assert readable, f"process {pid} did not die"
    finally:
        os.close(fd)


def peer_slot(pool: Pool, pid: int) -> int:
    """The slot of a Pool(2) whose worker is not ``pid``, once both workers are registered."""
    deadline = time.monotonic() + TIMEOUT
    while not all(w.pid for w in pool.statistics().per_worker):
        assert time.monotonic() < deadline, "the workers were never registered"
        time.sleep(POLL)
    return next(w.slot for w in pool.statistics().per_worker if w.pid != pid)


def shut_down(pool: Pool) -> None:
    """Shut the pool down; fail (instead of hanging) if even ``shutdown(wait=False)`` blocks,
    as it does when the coordinator thread is stuck holding its lock."""
    stopper = threading.Thread(target=pool.shutdown, kwargs={"wait": False}, daemon=True)
    stopper.start()
    stopper.join(TIMEOUT)
    ended = not stopper.is_alive() and pool.await_termination(TIMEOUT)
    if not ended:  # take it down by force, and keep the interpreter's exit from hanging on it
        pool._zygote.kill()
        if not pool.await_termination(TIMEOUT):
            _lifecycle.live_pools.discard(pool)
    assert not stopper.is_alive(), "shutdown() is stuck: the coordinator holds its lock"
    assert ended, "the pool did not shut down"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("record_pid", [True, False], ids=["holder-recorded", "holder-unrecorded"])
def test_a_worker_killed_inside_its_slot_lock_does_not_hang_the_pool(
    tmp_path: object, record_pid: bool
) -> None:
    """The worker dies holding its slot lock while the coordinator has not seen the death yet
    (a helper process keeps the worker's socket open): the coordinator, dispatching a new task
    into that slot, must get past the lock instead of waiting forever. ``holder-unrecorded``:
    the death came between ``acquire`` and ``holder_pid = pid``."""
    started = os.path.join(str(tmp_path), "started")
    release = os.path.join(str(tmp_path), "release")
    os.mkfifo(started)
    os.mkfifo(release)
    pool = Pool(1)
    released = False
    stuck = False  # the coordinator waits forever for the dead worker's lock
    try:
        dier = pool.submit(wt.die_holding_own_slot_lock, started, release, record_pid)
        with open(started, "rb") as fifo:
            pid = int(fifo.read())
        wait_dead(pid)
        probe = pool.submit(tasks.add, 1, 2)  # dispatched into the dead worker's inbox
        slot = pool._views.slots[0]
        deadline = time.monotonic() + TIMEOUT
        while slot.inbox_depth() == 0:  # the coordinator got past the lock
            stuck = time.monotonic() > deadline
            assert not stuck, "the coordinator is stuck on the dead worker's lock"
            time.sleep(POLL)
        with open(release, "wb") as fifo:  # now the coordinator sees the death
            fifo.write(b"x")
        released = True
        with pytest.raises(WorkerCrashedError, match=r"SIGKILL\(-9\)"):
            dier.result(TIMEOUT)
        assert probe.result(TIMEOUT) == 3  # run by the replacement
        assert pool.submit(tasks.pid_of).result(TIMEOUT) != pid
        stats = pool.statistics()
        assert (stats.crashes, stats.respawns) == (1, 1)
    finally:
        if stuck:  # undo the damage by hand (the lock is the dead worker's), or nothing ends
            pool._views.slots[0]._release()
        if not released:  # let the helper go, whatever happened (it holds the read end)
            with contextlib.suppress(OSError):
                fd = os.open(release, os.O_WRONLY | os.O_NONBLOCK)
                os.write(fd, b"x")
                os.close(fd)
        shut_down(pool)


@pytest.mark.timeout(60)
def test_the_recovery_of_a_death_waits_for_a_repair_under_way_in_another_thread(
    tmp_path: object,
) -> None:
    """A worker dies holding its slot lock (its pid recorded). While a user thread of the pool's
    process repairs a lock (it holds ``repair_lock``, as ``on_lock_stall`` does), the
    coordinator's recovery of that death must not repair at the same time: two repairs of one
    lock both dropped a run-stack record of the dead worker and both released the lock. The
    lock stays the dead worker's until that repair is over, then the recovery goes on."""
    started = os.path.join(str(tmp_path), "started")
    release = os.path.join(str(tmp_path), "release")
    os.mkfifo(started)
    os.mkfifo(release)
    pool = Pool(1)
    repair_lock = pool._coordinator.repair_lock
    held = False
    try:
        dier = pool.submit(wt.die_holding_own_slot_lock, started, release, True)
        with open(started, "rb") as fifo:
            pid = int(fifo.read())
        wait_dead(pid)
        slot = pool._views.slots[0]
        held = repair_lock.acquire(timeout=TIMEOUT)
        assert held
        with open(release, "wb") as fifo:  # now the coordinator sees the death
            fifo.write(b"x")
        # Unfixed, the recovery releases the lock at once; fixed, not while the repair runs
        # (the outcome does not depend on this wait's length, only how soon a bug shows).
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            assert slot.holder_pid() == pid, "the recovery repaired beside another repair"
            time.sleep(POLL)
        repair_lock.release()
        held = False
        with pytest.raises(WorkerCrashedError, match=r"SIGKILL\(-9\)"):
            dier.result(TIMEOUT)
        assert pool.submit(tasks.add, 1, 2).result(TIMEOUT) == 3
    finally:
        if held:
            repair_lock.release()
        shut_down(pool)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "task",
    [wt.die_inside_submit, wt.die_between_a_childs_alloc_and_its_write],
    ids=["after-counting-it-live", "between-alloc-and-write"],
)
def test_a_worker_killed_inside_submit_leaks_no_block_and_does_not_hang_shutdown(
    task: Callable[[], object],
) -> None:
    """Killed in ``mpsched.submit``, with a child's block taken but the child in no deque:
    nobody will run that child, so its block must be freed, and the drain at shutdown must not
    wait for it. Two windows: after the block was written and the child counted live, before
    the push; and after the allocator's commit, before the block was written (the block must
    name its dead spawner already, or the recovery cannot tell it from a block a live worker
    holds: about one leak per 40 kills in a nested chaos run)."""
    pool = Pool(1)
    try:
        slab = pool._views.slab
        with pytest.raises(WorkerCrashedError, match=r"exit code 1\b"):
            pool.submit(task).result(TIMEOUT)
        assert pool.submit(tasks.add, 2, 2).result(TIMEOUT) == 4
        assert slab.free_count() == slab.capacity, "the child's block leaked"
    finally:
        shut_down(pool)


@pytest.mark.timeout(60)
def test_the_blocks_of_a_dead_parents_children_are_freed() -> None:
    """A parent dies with 5 children queued on its deque; the replacement runs them (before the
    next task: the deque comes first), and nobody is left to collect them: their blocks must be
    freed all the same."""
    pool = Pool(1)
    try:
        slab = pool._views.slab
        with pytest.raises(WorkerCrashedError, match=r"exit code 3\b"):
            pool.submit(wt.spawn_then_die, 5).result(TIMEOUT)
        assert pool.submit(tasks.add, 1, 1).result(TIMEOUT) == 2
        assert slab.free_count() == slab.capacity, "orphaned children's blocks leaked"
    finally:
        shut_down(pool)


@pytest.mark.timeout(60)
def test_a_parent_asleep_in_a_join_wakes_when_its_childs_executor_dies_after_done(
    tmp_path: object,
) -> None:
    """The executor of a stolen child publishes DONE and dies before it wakes the parent,
    which sleeps in ``join``: the recovery must wake it (nothing else will, in an idle pool).
    The child finished, so the parent gets its result."""
    started = os.path.join(str(tmp_path), "started")
    gate = os.path.join(str(tmp_path), "gate")
    os.mkfifo(started)
    os.mkfifo(gate)
    pool = Pool(2)
    try:
        parent = pool.submit(wt.join_a_stolen_child, started, gate, 42)
        with open(started, "rb") as fifo:
            executor = int(fifo.read())
        joiner = peer_slot(pool, executor)
        slot = pool._views.slots[joiner]
        deadline = time.monotonic() + TIMEOUT
        while not slot.is_sleeping():  # the parent found nothing to help with
            assert time.monotonic() < deadline, "the parent never slept in its join"
            time.sleep(POLL)
        with open(gate, "wb") as fifo:
            fifo.write(b"x")
        assert parent.result(TIMEOUT) == 42
        assert pool.submit(tasks.add, 1, 2).result(TIMEOUT) == 3
        stats = pool.statistics()
        assert (stats.crashes, stats.respawns) == (1, 1)
        slab = pool._views.slab
        assert slab.free_count() == slab.capacity
    finally:
        shut_down(pool)


@pytest.mark.timeout(60)
def test_a_dead_parents_abandoned_child_freed_by_its_executor_is_freed_once(
    tmp_path: object,
) -> None:
    """The parent dropped a child's future (ABANDONED: the executor frees the block) and dies
    while the executor is between publishing the child's end and freeing its block: the
    recovery of the parent must not free the block too (a double free: two tasks would then
    share one block; here the executor's free overflows the free stack and breaks the pool)."""
    names = ("started", "gate", "window", "release", "parent")
    started, gate, window, release, parent_fifo = (os.path.join(str(tmp_path), n) for n in names)
    for path in (started, gate, window, release, parent_fifo):
        os.mkfifo(path)
    pool = Pool(2)
    try:
        parent = pool.submit(wt.abandon_a_stolen_child, started, gate, window, release, parent_fifo)
        with open(started, "rb") as fifo:
            fifo.read()
        with open(parent_fifo, "rb") as fifo:
            parent_pid = int(fifo.read())
        with open(gate, "wb") as fifo:  # the child ends; its executor stops before the free
            fifo.write(b"x")
        with open(window, "rb") as fifo:
            fifo.read()
        os.kill(parent_pid, signal.SIGKILL)
        with pytest.raises(WorkerCrashedError, match=r"SIGKILL\(-9\)"):
            parent.result(TIMEOUT)
        deadline = time.monotonic() + TIMEOUT
        while pool.statistics().respawns < 1:  # the parent's recovery is over
            assert time.monotonic() < deadline, "the parent's death was never recovered"
            time.sleep(POLL)
        with open(release, "wb") as fifo:  # now the executor frees the child's block
            fifo.write(b"x")
        assert [pool.submit(tasks.add, i, i).result(TIMEOUT) for i in range(4)] == [0, 2, 4, 6]
        assert pool.statistics().crashes == 1
        slab = pool._views.slab
        deadline = time.monotonic() + TIMEOUT
        while slab.free_count() != slab.capacity:  # the executor's free comes after its task
            assert time.monotonic() < deadline, "the child's block leaked"
            time.sleep(POLL)
        free = slab.free_indices()
        assert len(set(free)) == len(free) == slab.capacity, "a block was freed twice"
    finally:
        shut_down(pool)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nbytes", [8, 400_000], ids=["in-block", "stashed"])
def test_a_parent_killed_freeing_a_joined_childs_block_leaks_it_not(nbytes: int) -> None:
    """The parent read its child's result and dies in the free of the child's block, before
    the free commits: the block is its dead spawner's DONE child, which the recovery frees;
    a stashed result was fetched already, so nothing waits for its bytes."""
    pool = Pool(2)
    try:
        slab = pool._views.slab
        with pytest.raises(WorkerCrashedError, match=r"exit code 3\b"):
            pool.submit(wt.die_freeing_a_joined_child, nbytes).result(TIMEOUT)
        assert pool.submit(tasks.add, 1, 1).result(TIMEOUT) == 2
        assert slab.free_count() == slab.capacity, "the joined child's block leaked"
        coordinator = pool._coordinator
        assert (coordinator.stash, coordinator.unwanted_stash) == ({}, set())
    finally:
        shut_down(pool)


@pytest.mark.timeout(60)
def test_a_parent_killed_between_a_fetch_and_its_zeroing_leaves_no_unwanted_key() -> None:
    """The parent fetched its child's stashed result and died before it zeroed the block's
    ``result_nbytes``: the recovery frees the DONE block and finds a key whose bytes it does
    not have. They were taken (the answer to the dead worker's FETCH), so they will not come:
    noted in ``unwanted_stash`` (for a STASH still in the executor's socket), the key stayed
    there for good."""
    pool = Pool(2)
    try:
        slab = pool._views.slab
        with pytest.raises(WorkerCrashedError, match=r"exit code 3\b"):
            pool.submit(wt.die_between_a_fetch_and_its_zeroing, 400_000).result(TIMEOUT)
        assert pool.submit(tasks.add, 1, 1).result(TIMEOUT) == 2
        assert slab.free_count() == slab.capacity, "the joined child's block leaked"
        coordinator = pool._coordinator
        assert (coordinator.stash, coordinator.unwanted_stash) == ({}, set())
    finally:
        shut_down(pool)


@pytest.mark.timeout(60)
def test_a_worker_killed_after_a_full_deque_refused_a_stashed_child_leaves_no_stash() -> None:
    """A child whose arguments went to the stash found the deque full: ``mpsched.submit``
    frees its block and runs it inline, and must take the stashed bytes back (a FETCH) for
    nobody else will. It freed the block first: killed in between, it left the bytes in the
    stash for good, named by no block."""
    pool = Pool(1)
    try:
        with pytest.raises(WorkerCrashedError, match=r"exit code 3\b"):
            pool.submit(wt.die_after_a_full_deque_refused_a_stashed_child, 400_000).result(TIMEOUT)
        assert_recovered_with_no_stash(pool)
    finally:
        shut_down(pool)


def assert_recovered(pool: Pool) -> None:
    """The pool runs a task again and every block comes free."""
    assert pool.submit(tasks.add, 1, 1).result(TIMEOUT) == 2
    wait_all_blocks_free(pool)


def assert_recovered_with_no_stash(pool: Pool) -> None:
    """``assert_recovered``, and no stash entry is left."""
    assert_recovered(pool)
    coordinator = pool._coordinator
    assert (coordinator.stash, coordinator.unwanted_stash) == ({}, set())


def wait_all_blocks_free(pool: Pool) -> None:
    """Until every slab block is free (a free may come after a task's end), once each."""
    slab = pool._views.slab
    deadline = time.monotonic() + TIMEOUT
    while slab.free_count() != slab.capacity:
        assert time.monotonic() < deadline, f"{slab.capacity - slab.free_count()} block(s) leaked"
        time.sleep(POLL)
    free = slab.free_indices()
    assert len(set(free)) == len(free) == slab.capacity, "a block was freed twice"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nbytes", [8, 400_000], ids=["in-block", "stashed"])
def test_an_executor_killed_freeing_an_abandoned_childs_block_leaks_it_not(
    tmp_path: object, nbytes: int
) -> None:
    """The parent dropped a child's future (ABANDONED: the executor frees the block); the
    executor dies in that free, before the commit. The block is in no ring, on no run stack,
    and its uid named the parent (alive): the executor's recovery must free it (and drop a
    stashed result), and the parent must not free it as well."""
    started = os.path.join(str(tmp_path), "started")
    gate = os.path.join(str(tmp_path), "gate")
    os.mkfifo(started)
    os.mkfifo(gate)
    pool = Pool(2)
    try:
        parent = pool.submit(wt.drop_a_stolen_child, started, gate, nbytes)
        with open(started, "rb") as fifo:
            executor = int(fifo.read())
        assert parent.result(TIMEOUT) is None  # the child is ABANDONED now
        tasks.open_gate(gate)
        wait_dead(executor)
        deadline = time.monotonic() + TIMEOUT
        while pool.statistics().respawns < 1:  # the executor's recovery is over
            assert time.monotonic() < deadline, "the executor's death was never recovered"
            time.sleep(POLL)
        assert [pool.submit(tasks.add, i, i).result(TIMEOUT) for i in range(4)] == [0, 2, 4, 6]
        assert pool.statistics().crashes == 1
        wait_all_blocks_free(pool)
        coordinator = pool._coordinator
        assert (coordinator.stash, coordinator.unwanted_stash) == ({}, set())
    finally:
        shut_down(pool)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nbytes", [8, 400_000], ids=["in-block", "stashed"])
def test_a_parent_killed_freeing_a_dropped_done_childs_block_leaks_it_not(nbytes: int) -> None:
    """The parent drops the future of a child that a peer already ran (DONE: the parent frees
    the block, as ABANDONED) and dies in that free, before the commit: the recovery must free
    the block (and drop a stashed result the parent did not fetch)."""
    pool = Pool(2)
    try:
        with pytest.raises(WorkerCrashedError, match=r"exit code 3\b"):
            pool.submit(wt.die_freeing_a_dropped_done_child, nbytes).result(TIMEOUT)
        assert_recovered_with_no_stash(pool)
    finally:
        shut_down(pool)


LONG = 3000  # bytes: a chain of four blocks


@pytest.mark.timeout(60)
def test_a_worker_killed_writing_a_childs_long_arguments_leaks_no_block() -> None:
    """Killed in ``mpsched.submit`` while it copies a child's arguments into a chain of blocks,
    the chain taken but not yet (wholly) linked, nor the child's state written: the recovery
    must free the child's block and every block of its chain."""
    pool = Pool(1)
    try:
        with pytest.raises(WorkerCrashedError, match=r"exit code 1\b"):
            pool.submit(wt.die_writing_a_childs_long_arguments, LONG).result(TIMEOUT)
        assert_recovered(pool)
    finally:
        shut_down(pool)


@pytest.mark.timeout(60)
def test_a_worker_killed_writing_a_long_result_frees_exactly_its_chain() -> None:
    """Killed while it copies a top-level task's result into a chain of blocks: the recovery
    frees the task's block with its result chain, which must hold exactly the blocks taken
    (linked one by one, a chain ended in a block whose link was still its previous use's, and
    the recovery followed it into blocks it had no business freeing)."""
    pool = Pool(1)
    try:
        with pytest.raises(WorkerCrashedError, match=r"exit code 1\b"):
            pool.submit(wt.return_a_long_result_and_die_writing_it, LONG).result(TIMEOUT)
        assert_recovered(pool)
    finally:
        shut_down(pool)


@pytest.mark.timeout(60)
def test_a_worker_killed_releasing_a_tasks_long_arguments_leaks_no_block() -> None:
    """Killed in ``release_args`` (waiting for the slab's lock) after it read a task's long
    arguments: the chain must still hang on the task's block, which the recovery frees with
    it (unlinked first, the chain leaked)."""
    pool = Pool(1)
    try:
        assert pool.submit(wt.die_at_the_next_slab_lock).result(TIMEOUT) is None
        with pytest.raises(WorkerCrashedError, match=r"exit code 3\b"):
            pool.submit(len, bytes(LONG)).result(TIMEOUT)
        assert_recovered(pool)
    finally:
        shut_down(pool)


@pytest.mark.timeout(120)
def test_a_childs_block_reused_after_its_executor_died_inside_done_is_left_alone(
    tmp_path: pathlib.Path,
) -> None:
    """The executor of a stolen child dies inside the exchange that publishes DONE, after the
    store, before the pop of its run-stack record, holding the parent's slot lock. Once the
    lock is repaired, the parent reads the result, frees the block and a new child takes it:
    the recovery of the executor must not take the stale record for a child it was running
    (it wrote a crash into the new child, which had not even run). A probe task dispatched
    between the free and the new child's spawn may take the block first: that attempt did not
    set the scene, and the next one runs in a fresh pool."""
    for attempt in range(SCENE_ATTEMPTS):
        if _reused_block_scene(tmp_path / str(attempt)):
            return
    pytest.fail(f"the new child never took the freed block in {SCENE_ATTEMPTS} attempts")


SCENE_ATTEMPTS = 5  # a scene whose interleaving a probe task spoiled is tried again


def _reused_block_scene(directory: pathlib.Path) -> bool:
    """One attempt of the test above; False if the new child did not take the freed block."""
    directory.mkdir()
    started, release, report, gate = (str(directory / n) for n in ("s", "r", "p", "g"))
    for path in (started, release, report, gate):
        os.mkfifo(path)
    pool = Pool(2)
    released = gate_open = False
    try:
        parent = pool.submit(
            wt.join_a_child_whose_executor_dies_inside_done, started, release, report, gate
        )
        with open(started, "rb") as fifo:
            executor = int(fifo.read())
        wait_dead(executor)
        joiner = peer_slot(pool, executor)
        slot = pool._views.slots[joiner]
        probes = []
        deadline = time.monotonic() + TIMEOUT
        while slot.inbox_depth() == 0:  # dispatch into the joiner's slot repairs its lock
            assert time.monotonic() < deadline, "the coordinator is stuck on the dead lock"
            probes.append(pool.submit(tasks.add, len(probes), 1))
            until = time.monotonic() + 0.5
            while slot.inbox_depth() == 0 and time.monotonic() < until:
                time.sleep(POLL)
        with open(report, "rb") as fifo:
            reused = fifo.read() == b"1"
        with open(release, "wb") as fifo:  # now the coordinator sees the death
            fifo.write(b"x")
        released = True
        if not reused:
            tasks.open_gate(gate)
            gate_open = True
            assert parent.result(TIMEOUT) == (False, 5)
            return False
        deadline = time.monotonic() + TIMEOUT
        while pool.statistics().respawns < 1:  # the executor's recovery is over
            assert time.monotonic() < deadline, "the executor's death was never recovered"
            time.sleep(POLL)
        tasks.open_gate(gate)
        gate_open = True
        assert parent.result(TIMEOUT) == (True, 5)
        assert [f.result(TIMEOUT) for f in probes] == [i + 1 for i in range(len(probes))]
        assert pool.statistics().crashes == 1
        return True
    finally:
        for path, done in ((release, released), (gate, gate_open)):
            if not done:  # let the tasks that wait there go, so that the pool can end
                with contextlib.suppress(OSError):
                    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
                    os.write(fd, b"x")
                    os.close(fd)
        shut_down(pool)
