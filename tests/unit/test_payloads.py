"""Tests of mpsched._payloads (slab), mpsched._function_table and mpsched._layout (the segment).

Multi-process tests run under fork, forkserver and spawn and order themselves with pipes only.
"""

from __future__ import annotations

import itertools
import os
import pickle
import random
from array import array
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest

from mpsched._errors import InternalError
from mpsched._function_table import FunctionTable
from mpsched._layout import (
    PAGE,
    GlobalField,
    SegmentLayout,
    SegmentLocks,
    SegmentViews,
    attach,
    create_locks,
)
from mpsched._payloads import BLOCK_HEADER_BYTES, MAX_CHAIN_BLOCKS, BlockField, Slab
from mpsched._shm import AnonSegment, SemLockHandle, create_lock

PIPE_TIMEOUT = 30.0  # seconds a child may take to answer
SLAB_CHILDREN = 2
SLAB_ROUNDS = 3000  # alloc/check/free rounds per child
SMALL_SIZES = {
    "n_slots": 2,
    "deque_capacity": 16,
    "inbox_capacity": 8,
    "done_capacity": 8,
    "block_count": 64,
    "ftab_data_bytes": 256,
}
SMALL = SegmentLayout(**SMALL_SIZES)


class Pool:
    """A formatted segment for one layout, as the coordinator holds it."""

    def __init__(self, layout: SegmentLayout = SMALL) -> None:
        self.layout = layout
        self.seg = AnonSegment.create(layout.total_bytes)
        self.locks = create_locks(layout.n_slots)
        self.views = attach(self.seg, layout, self.locks, init=True)

    def close(self) -> None:
        self.locks.unlink_names()
        self.seg.close()

    def __getstate__(self) -> dict[str, Any]:  # views are per process: children re-attach
        return {k: v for k, v in self.__dict__.items() if k != "views"}


@pytest.fixture
def pool() -> Iterator[Pool]:
    p = Pool()
    yield p
    p.close()


@pytest.fixture
def slab(pool: Pool) -> Slab:
    return pool.views.slab


# ---- slab ----------------------------------------------------------------------------------


def test_alloc_until_full_then_free(slab: Slab) -> None:
    assert slab.capacity == 64
    assert slab.data_capacity == 1024 - BLOCK_HEADER_BYTES
    got = [slab.alloc() for _ in range(64)]
    assert got == list(range(64))  # the lowest blocks first: fewer pages touched
    assert slab.alloc() == -1
    assert slab.alloc_many(3) == []
    slab.free(5)
    assert slab.alloc() == 5
    slab.free_many(got)
    assert slab.free_count() == 64
    assert sorted(slab.alloc_many(70)) == list(range(64))
    slab.free_many(list(range(64)))
    assert sorted(slab.free_indices()) == list(range(64))


def test_double_free_and_bad_indices_are_refused(slab: Slab) -> None:
    with pytest.raises(InternalError, match="double free"):
        slab.free(3)  # the stack is already full
    with pytest.raises(InternalError, match="double free"):
        slab.free_many([3])
    i = slab.alloc()
    with pytest.raises(InternalError, match="bad index"):
        slab.free(64)
    with pytest.raises(InternalError, match="out of range"):
        slab.free_many([-1])
    slab.free(i)
    assert slab.free_count() == 64


def test_block_words_data_and_results(slab: Slab) -> None:
    i = slab.alloc()
    payload = pickle.dumps((7, ("arg", 3)))
    assert slab.write(i, payload, uid=1234, parent=1, state=2)
    assert slab.get_word(i, BlockField.UID) == 1234
    assert slab.get_word(i, BlockField.PARENT) == 1
    assert slab.get_word(i, BlockField.STATE) == 2
    assert slab.get_word(i, BlockField.NBYTES) == len(payload)
    assert slab.read(i) == payload
    view = slab.data_view(i)
    assert pickle.loads(view) == (7, ("arg", 3))  # zero-copy load
    view.release()
    slab.set_word(i, BlockField.NEXT_RESULT, -5)
    assert slab.get_word(i, BlockField.NEXT_RESULT) == -5
    assert slab.write_result(i, 1, b"result")
    assert slab.read_result(i) == (1, b"result")
    too_long = b"x" * (MAX_CHAIN_BLOCKS * slab.data_capacity + 1)
    assert not slab.write_result(i, 1, too_long)
    assert slab.read_result(i) == (1, b"result")  # untouched by the refused write
    assert not slab.write(i, too_long, uid=1)
    assert slab.write(i, b"y" * slab.data_capacity, uid=2)  # exactly full fits
    assert slab.read(i) == b"y" * slab.data_capacity
    assert slab.get_word(i, BlockField.PARENT) == -1
    neighbour = slab.alloc()
    assert slab.write(neighbour, b"n", uid=3)
    assert slab.read(i) == b"y" * slab.data_capacity  # blocks do not overlap


def _churn_blocks(pool: Pool, child: int, conn: Connection) -> None:
    views = attach(pool.seg, pool.layout, pool.locks)
    slab = views.slab
    rng = random.Random(child)
    conn.send("ready")
    assert conn.recv() == "go"
    held: list[int] = []
    violations = 0
    for _ in range(SLAB_ROUNDS):
        if held and (rng.random() < 0.5 or slab.free_count() == 0):
            k = rng.randint(1, len(held))
            for i in held[:k]:  # still ours? a double allocation would have overwritten it
                violations += slab.get_word(i, BlockField.UID) != (child << 32 | i)
            if k == 1:
                slab.free(held[0])
            else:
                slab.free_many(held[:k])
            del held[:k]
        else:
            new = [slab.alloc()] if rng.random() < 0.5 else slab.alloc_many(rng.randint(1, 4))
            for i in new:
                if i >= 0:
                    slab.set_word(i, BlockField.UID, child << 32 | i)
                    held.append(i)
    slab.free_many(held)
    conn.send(violations)
    conn.close()


@pytest.mark.timeout(60)
def test_slab_conserves_blocks_across_processes(ctx: Any, pool: Pool) -> None:
    procs, conns = [], []
    try:
        for child in range(1, SLAB_CHILDREN + 1):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=_churn_blocks, args=(pool, child, child_end))
            proc.start()
            child_end.close()
            procs.append(proc)
            conns.append(parent_end)
        for conn in conns:
            assert conn.poll(PIPE_TIMEOUT)
            assert conn.recv() == "ready"
        pool.locks.unlink_names()
        for conn in conns:
            conn.send("go")
        for conn in conns:
            assert conn.poll(PIPE_TIMEOUT)
            assert conn.recv() == 0, "a block was handed to two holders"
        for proc in procs:
            proc.join(PIPE_TIMEOUT)
            assert proc.exitcode == 0
    finally:
        for conn in conns:
            conn.close()
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
            proc.close()
    slab = pool.views.slab
    assert slab.free_count() == slab.capacity
    assert sorted(slab.free_indices()) == list(range(slab.capacity))


def test_slab_breaks_a_dead_holders_lock() -> None:
    """Only the pid recorded as the holder breaks the lock; pid 0 (no holder recorded, as on a
    free lock) never does: a mutation hunt found a break of a free lock (a double release)
    unpinned."""
    lock = create_lock()
    lock.unlink()
    with AnonSegment.create(Slab.region_bytes(4)) as seg:
        slab = Slab(seg.buf, lock, 4, init=True)
        seg.track(slab)
        assert not slab.break_dead_holder(0)  # the lock is free, its holder word 0
        lock.acquire()
        slab._w[1] = 999_999  # the holder word of a process that died holding the lock
        assert not slab.break_dead_holder(4)
        assert slab.break_dead_holder(999_999)
        assert slab.alloc() == 0  # the lock is free again
        with pytest.raises(InternalError, match="header mismatch"):
            Slab(seg.buf, lock, 2)


def test_a_child_block_names_its_spawner_from_its_allocation_on(slab: Slab) -> None:
    uid = (os.getpid() << 31) | 7
    slab.set_word(0, BlockField.STATE, 2)  # words of a previous task
    slab.set_word(0, BlockField.NEXT_ARG, 5)
    slab.set_word(0, BlockField.NEXT_RESULT, 6)
    handle = slab.alloc(uid)
    assert handle == 0
    assert (slab.get_word(handle, BlockField.UID), slab.get_state(handle)) == (uid, 0)
    links = (
        slab.get_word(handle, BlockField.NEXT_ARG),
        slab.get_word(handle, BlockField.NEXT_RESULT),
    )
    assert links == (-1, -1)
    slab.free_children([handle])  # unwritten, yet its chains can be followed
    assert (slab.get_word(handle, BlockField.UID), slab.get_state(handle)) == (0, 0)


def test_breaking_a_dead_allocators_lock_unstamps_the_block_it_did_not_commit() -> None:
    """A spawner that dies inside ``alloc`` between the stamp and the commit leaves the
    stamped block free: the repair clears its uid, so that no free block names a child."""
    lock = create_lock()
    lock.unlink()
    with AnonSegment.create(Slab.region_bytes(4)) as seg:
        slab = Slab(seg.buf, lock, 4, init=True)
        seg.track(slab)
        top = slab.free_indices()[-1]
        lock.acquire()
        slab._w[1] = 999_999  # the holder word of a process that died holding the lock
        slab.set_word(top, BlockField.UID, 999_999 << 31 | 1)  # alloc's stamp
        slab.set_word(top, BlockField.STATE, 0)
        assert slab.break_dead_holder(999_999)
        assert slab.free_count() == 4
        assert [slab.get_word(i, BlockField.UID) for i in range(4)] == [0, 0, 0, 0]


def test_breaking_a_dead_freers_lock_clears_the_children_it_committed() -> None:
    """A parent that dies inside ``free_children`` after the commit, before it cleared the
    freed children's words, leaves free blocks that name it: the repair clears them. (Cleared
    before the commit, a death in between leaked the blocks: in no free stack, naming nobody,
    so no crash recovery freed them.)"""
    lock = create_lock()
    lock.unlink()
    with AnonSegment.create(Slab.region_bytes(4)) as seg:
        slab = Slab(seg.buf, lock, 4, init=True)
        seg.track(slab)
        uid = 999_999 << 31 | 1
        children = [slab.alloc(uid), slab.alloc(uid)]
        for handle in children:
            slab.set_state(handle, 2)  # DONE
        lock.acquire()  # as free_many does, up to its commit; the process dies right after it
        slab._w[1] = 999_999  # holder_pid
        top = slab._w[0]
        slab._stack[top : top + 2] = array("q", children)
        slab._w[0] = top + 2  # the commit; the words are never cleared
        assert slab.break_dead_holder(999_999)
        assert slab.free_count() == 4
        words = [(slab.get_word(h, BlockField.UID), slab.get_state(h)) for h in range(4)]
        assert words == [(0, 0)] * 4
        assert len(slab.alloc_many(4)) == 4  # the lock is free again


@pytest.mark.parametrize("committed", [True, False], ids=["after-the-commit", "before-it"])
def test_breaking_a_dead_writers_lock_hangs_the_chain_it_took_on_its_block(
    committed: bool,
) -> None:
    """A writer that dies inside ``_attach`` after the commit, before the store that hangs the
    chain on its block, leaves a record of that store: the repair completes it, so the chain
    is freed with the block. A death before the commit (the record written, free_top not
    moved) took nothing: the repair must not hang free blocks on the block, which its free
    would free twice (a mutation hunt found this case unpinned)."""
    lock = create_lock()
    lock.unlink()
    with AnonSegment.create(Slab.region_bytes(8)) as seg:
        slab = Slab(seg.buf, lock, 8, init=True)
        seg.track(slab)
        first = slab.alloc()
        slab.set_word(first, BlockField.NEXT_ARG, -1)  # as written: no argument chain
        lock.acquire()  # as _attach does, up to its commit; the process dies right after it
        slab._w[1] = 999_999  # holder_pid
        top = slab._w[0]
        chain = slab._stack[top - 3 : top].tolist()
        for a, b in zip(chain, [*chain[1:], -1], strict=True):
            slab.set_word(a, BlockField.NEXT_RESULT, b)
        slab._w[7] = top - 3  # pending_top
        slab._w[6] = chain[0]  # pending_value
        slab._w[5] = slab._blocks_word + first * slab._block_words + BlockField.NEXT_RESULT
        if committed:
            slab._w[0] = top - 3  # the commit; the link store never happens
        assert slab.break_dead_holder(999_999)
        assert slab._chain(first, BlockField.NEXT_RESULT) == (chain if committed else [])
        assert slab._w[5] == 0  # no record left
        assert slab.free_count() == (4 if committed else 7)
        slab.free_tasks([first])
        assert slab.free_count() == 8
        assert len(slab.alloc_many(3)) == 3  # the lock is free again


# ---- function table ------------------------------------------------------------------------


def test_function_table_append_and_get(pool: Pool) -> None:
    table = pool.views.functions
    assert len(table) == 0
    assert table.add(b"first") == 0
    assert table.add(b"") == 1
    assert table.add(b"third" * 10) == 2
    assert table.get(0) == b"first"
    assert table.get(1) == b""
    assert table.get(2) == b"third" * 10
    with pytest.raises(IndexError):
        table.get(3)
    with pytest.raises(IndexError):
        table.get(-1)
    assert table.add(b"z" * 256) == -1  # bytes full (256 B table)
    assert len(table) == 3


def test_function_table_runs_out_of_fids() -> None:
    with AnonSegment.create(FunctionTable.region_bytes(64, 2)) as seg:
        table = FunctionTable(seg.buf, 64, 2, init=True)
        seg.track(table)
        assert [table.add(b"a"), table.add(b"b"), table.add(b"c")] == [0, 1, -1]
        reader = FunctionTable(seg.buf, 64, 2)
        seg.track(reader)
        assert reader.get(1) == b"b"
        with pytest.raises(InternalError, match="header mismatch"):
            FunctionTable(seg.buf, 64, 4)


def _read_functions(pool: Pool, conn: Connection) -> None:
    views = attach(pool.seg, pool.layout, pool.locks)
    conn.send([views.functions.get(fid) for fid in range(len(views.functions))])
    conn.close()


@pytest.mark.timeout(60)
def test_workers_read_what_the_coordinator_added(ctx: Any, pool: Pool) -> None:
    added = [pickle.dumps(os.getcwd), pickle.dumps(len)]
    for data in added:
        pool.views.functions.add(data)
    parent_end, child_end = ctx.Pipe()
    proc = ctx.Process(target=_read_functions, args=(pool, child_end))
    try:
        proc.start()
        child_end.close()
        assert parent_end.poll(PIPE_TIMEOUT)
        assert parent_end.recv() == added
        proc.join(PIPE_TIMEOUT)
        assert proc.exitcode == 0
    finally:
        parent_end.close()
        proc.close()


# ---- layout --------------------------------------------------------------------------------


def test_layout_regions_are_aligned_and_disjoint() -> None:
    layout = SegmentLayout(n_slots=3)
    spans = [(0, 256)]
    spans += [(layout.slot_offset(k), layout.slot_bytes) for k in range(3)]
    spans += [(layout.slab_offset, layout.slab_bytes), (layout.ftab_offset, layout.ftab_bytes)]
    for (a, n), (b, _) in itertools.pairwise(spans):
        assert a + n <= b
    assert layout.slab_offset % PAGE == 0
    assert layout.ftab_offset % PAGE == 0
    assert layout.total_bytes % PAGE == 0
    assert layout.total_bytes >= layout.ftab_offset + layout.ftab_bytes
    with pytest.raises(IndexError):
        layout.slot_offset(3)
    with pytest.raises(ValueError, match="n_slots"):
        SegmentLayout(n_slots=0)


def test_default_layout_is_sparse() -> None:
    layout = SegmentLayout(n_slots=4)
    with AnonSegment.create(layout.total_bytes) as seg:
        locks = create_locks(4)
        try:
            attach(seg, layout, locks, init=True)
            allocated = os.fstat(seg.fd).st_blocks * 512
            assert layout.total_bytes > 36 * 1024 * 1024
            assert allocated < 1024 * 1024  # the header, slots and free stack only
        finally:
            locks.unlink_names()


def test_attach_checks_the_global_header(pool: Pool) -> None:
    again = attach(pool.seg, pool.layout, pool.locks)
    assert again.header.get(GlobalField.N_SLOTS) == 2
    pool.views.slots[0].inject([5])
    assert again.slots[0].take_inbox() == 5
    other = SegmentLayout(**(SMALL_SIZES | {"deque_capacity": 8}))
    with pytest.raises(InternalError, match="does not match"):
        attach(pool.seg, other, pool.locks)
    bigger = SegmentLayout(**(SMALL_SIZES | {"block_count": 1 << 20}))
    with pytest.raises(InternalError, match="segment of"):
        attach(pool.seg, bigger, pool.locks)
    fewer = SegmentLocks(pool.locks.slots[:1], pool.locks.slab, pool.locks.global_)
    with pytest.raises(InternalError, match="slot locks"):
        attach(pool.seg, pool.layout, fewer)
    extra = create_lock()
    extra.unlink()
    more = SegmentLocks((*pool.locks.slots, extra), pool.locks.slab, pool.locks.global_)
    with pytest.raises(InternalError, match="slot locks"):  # too many is as wrong as too few
        attach(pool.seg, pool.layout, more)


def test_block_state_handshake_through_a_slot(pool: Pool) -> None:
    slab, (parent, executor) = pool.views.slab, pool.views.slots
    child = slab.alloc()
    slab.write(child, b"args", uid=9, parent=0, state=1)
    parent.push(child)
    assert parent.steal(into=executor)[1] == child
    assert parent.exchange_block_state(slab, child, 2, finished_by=executor) == 1
    assert slab.get_word(child, BlockField.STATE) == 2
    assert parent.block_state(slab, child) == 2
    assert executor.running() == []


def test_global_header_words(pool: Pool) -> None:
    header = pool.views.header
    assert header.add_sleepers(1) == 1
    assert header.add_sleepers(1) == 2
    assert header.add_sleepers(-2) == 0
    assert header.sleepers() == 0
    assert header.add_live_children(3) == 3
    assert header.live_children() == 3
    pool.locks.global_.acquire()
    header._w[GlobalField.HOLDER_PID] = 999_999  # a worker that died holding the global lock
    assert not header.break_dead_holder(1)
    assert header.break_dead_holder(999_999)
    pool.locks.global_.acquire()  # a live process takes it next (its pid not yet recorded)
    assert not header.break_dead_holder(999_999)  # the dead pid is no longer the holder
    pool.locks.global_.release()
    assert header.add_live_children(-3) == 0
    header.set(GlobalField.RUN_STATE, 3)
    assert header.get(GlobalField.RUN_STATE) == 3
    with pytest.raises(InternalError, match="lock-guarded"):
        header.set(GlobalField.SLEEPERS, 1)
    with pytest.raises(InternalError, match="constant"):
        header.set(GlobalField.N_SLOTS, 1)
    with pytest.raises(InternalError, match="constant"):
        header.set(GlobalField.MAGIC, 0)


def test_segments_released() -> None:
    # The analogue of crossbeam's `destructors`: after close, no fd, no mapping, no name.
    fds_before = set(os.listdir("/proc/self/fd"))
    p = Pool()
    held: SegmentViews = p.views  # still referenced: close() must release them itself
    p.close()
    with pytest.raises(ValueError, match="released"):
        held.slots[0].push(1)
    with open("/proc/self/maps") as maps:
        assert "memfd:mpsched" not in maps.read()
    assert set(os.listdir("/proc/self/fd")) <= fds_before
    assert not [n for n in os.listdir("/dev/shm") if f"mpsched-{os.getpid()}-" in n]


def test_a_lock_that_cannot_be_made_leaves_no_name_of_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``create_locks`` failing partway (no room in /dev/shm, no fd left): the names of the
    locks made before stayed until a later pool's sweep, after this process ended."""
    from mpsched import _layout

    made = 0

    def third_fails() -> SemLockHandle:
        nonlocal made
        made += 1
        if made == 3:
            raise OSError(28, "No space left on device")
        return create_lock()

    monkeypatch.setattr(_layout, "create_lock", third_fails)
    with pytest.raises(OSError, match="No space"):
        create_locks(4)
    assert made == 3
    assert not [n for n in os.listdir("/dev/shm") if f"mpsched-{os.getpid()}-" in n]


def test_long_bytes_chain_across_blocks_and_free_with_the_task(slab: Slab) -> None:
    free_before = slab.free_count()
    i = slab.alloc()
    args = bytes(range(256)) * 40  # ~10 KiB: 11 blocks
    assert slab.write(i, args, uid=9)
    assert slab.read(i) == args
    assert slab.free_count() == free_before - 1 - (len(args) - 1) // slab.data_capacity
    slab.release_args(i)  # the worker read them: continuation blocks go back at once
    assert slab.free_count() == free_before - 1
    result = b"r" * (3 * slab.data_capacity + 5)
    assert slab.write_result(i, 0, result)
    assert slab.read_result(i) == (0, result)
    slab.free_tasks([i])
    assert slab.free_count() == free_before
    assert sorted(slab.free_indices()) == sorted(set(slab.free_indices()))  # no double free


def test_chain_refused_when_the_slab_is_short(slab: Slab) -> None:
    i = slab.alloc()
    held = slab.alloc_many(slab.free_count() - 1)  # leave one free block
    assert not slab.write(i, b"z" * (3 * slab.data_capacity), uid=1)
    assert slab.free_count() == 1  # the partial allocation was given back
    slab.free_many(held)
    slab.free_tasks([i])
