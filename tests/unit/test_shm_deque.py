"""Spec tests of mpsched._shm_deque (with its parts _slot_region, _slot_repair, _block_state),
modelled on crossbeam-deque's tests.

Single-process tests use one SlotQueues object in every role (the lock is a semaphore, so the
same process may play owner, coordinator and thief in turn). Multi-process tests run under
fork, forkserver and spawn and order themselves with pipes only; the long owner/thief runs
live in tests/stress/test_deque_stampede.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest

from mpsched import _slot_region as sr
from mpsched._errors import InternalError
from mpsched._shm import AnonSegment, create_lock
from mpsched._shm_deque import SlotQueues, StealResult
from mpsched._slot_region import MAX_NESTING, TOMBSTONE, slot_bytes

PIPE_TIMEOUT = 30.0  # seconds a child may take to answer
DCAP, ICAP, CCAP = 16, 8, 4
EMPTY, SUCCESS, RETRY = StealResult.EMPTY, StealResult.SUCCESS, StealResult.RETRY
CANCEL_ROUNDS = 3000  # inject+cancel races against a stealing process


class Region:
    """A segment with a few slots and their locks, attachable in children."""

    def __init__(self, n_slots: int = 2, dcap: int = DCAP, icap: int = ICAP) -> None:
        self.dcap, self.icap, self.n_slots = dcap, icap, n_slots
        self.stride = slot_bytes(dcap, icap, CCAP)
        self.seg = AnonSegment.create(n_slots * self.stride + 64)
        self.locks = [create_lock() for _ in range(n_slots)]
        self.slots = [self.attach(k, init=True) for k in range(n_slots)]

    def attach(self, k: int, *, init: bool = False, debug: bool = False) -> SlotQueues:
        sq = SlotQueues(
            self.seg.buf[k * self.stride :],
            self.locks[k],
            self.dcap,
            self.icap,
            done_capacity=CCAP,
            init=init,
            debug=debug,
        )
        self.seg.track(sq)
        return sq

    def flag(self) -> memoryview:
        """A test-only word after the slots (a racy 'done' flag)."""
        return self.seg.view(self.n_slots * self.stride, 8, "q")

    def unlink(self) -> None:
        for lock in self.locks:
            lock.unlink()

    def close(self) -> None:
        self.unlink()
        self.seg.close()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "slots"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


@pytest.fixture
def region() -> Iterator[Region]:
    r = Region()
    yield r
    r.close()


@pytest.fixture
def sq(region: Region) -> SlotQueues:
    return region.slots[0]


def test_layout_constants() -> None:
    assert sr.RING_WORD * 8 == 704
    assert slot_bytes(16, 8) % 64 == 0
    assert slot_bytes(1, 1) == 768
    assert slot_bytes(1, 1, 8) == 832
    assert sr.RUN_STACK * 8 % 64 == 0
    assert sr.EXECUTED * 8 % 64 == 0


def test_smoke(sq: SlotQueues) -> None:
    assert sq.pop() == -1
    assert sq.steal() == (EMPTY, -1)
    assert sq.push(1)
    assert sq.push(2)
    assert sq.pop() == 2
    assert sq.push(3)
    assert sq.steal() == (SUCCESS, 1)
    assert sq.pop() == 3
    assert sq.pop() == -1
    assert sq.steal() == (EMPTY, -1)


def test_is_empty(sq: SlotQueues) -> None:
    assert sq.is_empty()
    assert len(sq) == 0
    sq.push(1)
    assert not sq.is_empty()
    assert sq.depths() == (1, 0)
    sq.inject([5, 6])
    assert len(sq) == 3
    assert sq.depths() == (1, 2)
    sq.pop()
    sq.take_inbox()
    sq.take_inbox()
    assert sq.is_empty()


def test_a_joiner_sees_the_deque_only(sq: SlotQueues) -> None:
    """``take_inbox``/``children_only`` False: a join helps with children, never with the
    inbox's top-level tasks, and may sleep while they wait there (for its peers)."""
    sq.inject([5, 6])
    assert sq.pop_or_take(take_inbox=False) == -1
    assert sq.steal(take_inbox=False) == (EMPTY, -1)
    assert not sq.probe(children_only=True)
    assert sq.probe()
    sq.push(1)
    assert sq.probe(children_only=True)
    assert sq.pop_or_take(take_inbox=False) == 1
    assert sq.announce_sleep(children_only=True)
    assert sq.clear_sleeping()
    assert not sq.announce_sleep()  # an ordinary sleep: the inbox is work
    assert sq.steal() == (SUCCESS, 5)
    assert sq.pop_or_take() == 6


def test_owner_sees_lifo_thieves_see_fifo(sq: SlotQueues) -> None:
    for h in range(10):
        assert sq.push(h)
    assert [sq.pop() for _ in range(5)] == [9, 8, 7, 6, 5]
    assert [sq.steal()[1] for _ in range(5)] == [0, 1, 2, 3, 4]


def test_full_deque_refuses_push_and_indices_wrap(sq: SlotQueues) -> None:
    for round_ in range(3):  # indices grow past the capacity: masking, not modulo state
        for h in range(DCAP):
            assert sq.push(round_ * 100 + h)
        assert not sq.push(999)
        assert sq.steal() == (SUCCESS, round_ * 100)
        assert sq.push(555)
        assert [sq.pop() for _ in range(DCAP)] == [
            555,
            *range(round_ * 100 + DCAP - 1, round_ * 100, -1),
        ]


def test_inbox_fifo_with_tombstones(sq: SlotQueues) -> None:
    assert sq.inject(list(range(6))) == 6
    assert sq.cancel_injected(1)
    assert sq.cancel_injected(2)
    assert sq.cancel_injected(4)
    assert not sq.cancel_injected(4)  # already a tombstone
    assert not sq.cancel_injected(77)  # never injected
    assert sq.take_inbox() == 0
    assert not sq.cancel_injected(0)  # already claimed: the claim won
    assert sq.take_inbox() == 3  # tombstones 1, 2 skipped
    assert sq.steal() == (SUCCESS, 5)  # thieves skip them too
    assert sq.take_inbox() == -1
    assert sq.depths() == (0, 0)


def test_inbox_only_tombstones_is_empty(sq: SlotQueues) -> None:
    sq.inject([1, 2])
    sq.cancel_injected(1)
    sq.cancel_injected(2)
    assert not sq.probe()
    assert sq.steal() == (EMPTY, -1)  # the peek saw entries; the locked look found none
    assert sq.depths() == (0, 0)  # and dropped the tombstones
    assert sq.pop_or_take() == -1


def test_inject_returns_how_many_fit_and_wraps(sq: SlotQueues) -> None:
    assert sq.inject(list(range(ICAP + 3))) == ICAP
    assert sq.inject([99]) == 0
    assert [sq.take_inbox() for _ in range(3)] == [0, 1, 2]
    assert sq.inject([100, 101, 102, 103]) == 3  # wraps around the ring end
    assert sq.cancel_injected(101)  # found across the wrap
    got = []
    while (h := sq.take_inbox()) != -1:
        got.append(h)
    assert got == [3, 4, 5, 6, 7, 100, 102]


def test_pop_or_take_prefers_own_deque(sq: SlotQueues) -> None:
    sq.inject([10, 11])
    sq.push(1)
    sq.push(2)
    assert [sq.pop_or_take() for _ in range(5)] == [2, 1, 10, 11, -1]
    assert sq.counters() == {"executed": 0, "stolen": 0, "pushed": 2, "injected_taken": 2}


def test_claims_are_recorded_in_the_claimers_run_stack(region: Region) -> None:
    owner, thief = region.slots
    owner.push(1)
    owner.push(2)
    owner.inject([3])
    assert owner.pop(mark_running=True) == 2
    assert thief.steal(into=thief) == (EMPTY, -1)
    assert owner.steal(into=thief) == (SUCCESS, 1)
    assert owner.steal(into=thief) == (SUCCESS, 3)
    assert owner.running() == [2]
    assert thief.running() == [1, 3]
    assert thief.counters()["stolen"] == 2
    assert thief.finish_running() == 3
    assert thief.finish_running() == 1
    assert thief.counters()["executed"] == 2
    with pytest.raises(InternalError, match="empty run_stack"):
        thief.finish_running()
    owner.mark_running(42)  # run inline, without a claim
    assert owner.running() == [2, 42]
    owner.inject([4])
    assert owner.take_inbox(mark_running=True) == 4
    assert owner.pop_or_take(mark_running=True) == -1
    assert owner.running() == [2, 42, 4]


def test_run_stack_overflow_raises_and_leaves_the_handle_queued(region: Region) -> None:
    owner, thief = region.slots
    for h in range(MAX_NESTING):
        thief.mark_running(h)
    owner.push(7)
    with pytest.raises(InternalError, match="run_stack full"):
        owner.steal(into=thief)
    assert owner.holder_pid() == 0
    for h in range(MAX_NESTING):
        owner.mark_running(h)
    owner.inject([8])
    with pytest.raises(InternalError, match="run_stack full"):
        owner.pop_or_take(mark_running=True)
    assert owner.pop() == 7
    with pytest.raises(InternalError, match="run_stack full"):
        owner.pop_or_take(mark_running=True)
    assert owner.take_inbox() == 8  # neither attempt claimed it, and the lock is free


def test_steal_retries_on_a_busy_lock_and_peeks_without_it(region: Region, sq: SlotQueues) -> None:
    lock = region.locks[0]
    assert lock.acquire(False)
    try:
        assert sq.steal() == (EMPTY, -1)  # the peek needs no lock
        # fake a queued entry without the lock, to reach the try-lock
        sq._w[sr.DEQUE_BACK] += 1
        assert sq.steal() == (RETRY, -1)
        sq._w[sr.DEQUE_BACK] -= 1
    finally:
        lock.release()


def test_racy_lengths_are_clamped(sq: SlotQueues) -> None:
    # what a torn racy read can look like: front past back
    sq._w[sr.DEQUE_FRONT] = 5
    sq._w[sr.INBOX_FRONT] = 3
    assert len(sq) == 0
    assert sq.depths() == (0, 0)
    assert sq.is_empty()
    assert sq.steal() == (EMPTY, -1)


def test_sleep_flag_protocol(sq: SlotQueues) -> None:
    sq.push(1)
    assert not sq.announce_sleep()  # work queued: no sleep
    sq.pop()
    assert sq.announce_sleep()
    assert sq.is_sleeping()
    assert sq.inject_wake([]) == (0, False)  # nothing injected: nobody to wake
    assert sq.inject_wake([5]) == (1, True)  # the waker must write the wake fd
    assert not sq.is_sleeping()
    assert sq.inject_wake([6]) == (1, False)
    assert sq.probe()
    assert sq.announce_sleep() is False
    assert sq.clear_sleeping() is False
    sq.take_inbox()
    sq.take_inbox()
    assert sq.announce_sleep()
    assert sq.clear_sleeping() is True
    assert sq.clear_sleeping() is False


def test_attach_checks_the_header(region: Region) -> None:
    again = region.attach(1)
    assert again.steal() == (EMPTY, -1)
    with pytest.raises(InternalError, match="header mismatch"):
        SlotQueues(region.seg.buf[64:], region.locks[0], DCAP, ICAP, done_capacity=CCAP)
    with pytest.raises(InternalError, match="header mismatch"):
        SlotQueues(region.seg.buf, region.locks[0], DCAP * 2, ICAP, done_capacity=CCAP)
    with pytest.raises(InternalError, match="header mismatch"):
        SlotQueues(region.seg.buf, region.locks[0], DCAP, ICAP)  # no done ring
    with pytest.raises(ValueError, match="powers of two"):
        SlotQueues(region.seg.buf, region.locks[0], 12, ICAP)
    with pytest.raises(ValueError, match="needs"):
        SlotQueues(region.seg.buf[:100], region.locks[0], DCAP, ICAP)


def test_debug_mode_checks_owner_and_handles(region: Region) -> None:
    checked = region.attach(0, debug=True)
    with pytest.raises(InternalError, match="owner-only"):
        checked.push(1)
    checked.bind_owner()
    assert checked.owner_pid() == os.getpid()
    assert checked.push(1)
    assert checked.pop() == 1
    with pytest.raises(InternalError, match="non-negative"):
        checked.push(TOMBSTONE)
    with pytest.raises(InternalError, match="non-negative"):
        checked.inject([1, -1])


def test_complete_moves_the_task_to_the_done_ring(sq: SlotQueues) -> None:
    sq.inject([1, 2, 3])
    # complete() tells whether the done ring was empty before (the lazy sweep's poke).
    firsts = [sq.complete(sq.pop_or_take(mark_running=True)) for _ in range(3)]
    assert firsts == [True, False, False]
    assert sq.running() == []
    assert sq.done_depth() == 3
    assert sq.take_done() == [1, 2, 3]
    assert sq.take_done() == []
    assert sq.counters()["executed"] == 3
    sq.mark_running(7)
    sq.mark_running(8)
    with pytest.raises(InternalError, match="not the innermost"):
        sq.complete(7)
    for h in (9, 10, 11):
        sq.mark_running(h)
    for h in (11, 10, 9, 8):  # the ring wraps: indices grow past CCAP
        assert sq.complete(h) is (h == 11)
    with pytest.raises(InternalError, match="done ring full"):
        sq.complete(7)
    assert sq.running() == [7]  # untouched by the refused complete
    assert sq.take_done() == [11, 10, 9, 8]


class FakeBlocks:
    def __init__(self) -> None:
        self.states: dict[int, int] = {}

    def get_state(self, index: int) -> int:
        return self.states.get(index, 0)

    def set_state(self, index: int, value: int) -> None:
        self.states[index] = value


def test_exchange_block_state_pops_the_executors_record(region: Region) -> None:
    parent, executor = region.slots
    blocks = FakeBlocks()
    parent.push(5)
    assert parent.steal(into=executor) == (SUCCESS, 5)
    assert parent.exchange_block_state(blocks, 5, 2, finished_by=executor) == 0
    assert executor.running() == []
    assert executor.counters()["executed"] == 1
    assert parent.block_state(blocks, 5) == 2
    assert parent.exchange_block_state(blocks, 5, 3) == 2  # e.g. ABANDONED after DONE
    with pytest.raises(InternalError, match="innermost"):
        parent.exchange_block_state(blocks, 5, 2, finished_by=executor)
    assert parent.holder_pid() == 0


def test_exchange_block_state_leaves_the_unless_state_and_still_pops(region: Region) -> None:
    parent, executor = region.slots
    blocks = FakeBlocks()
    blocks.set_state(5, 3)  # e.g. ABANDONED: the executor frees the block, nobody else
    parent.push(5)
    assert parent.steal(into=executor) == (SUCCESS, 5)
    assert parent.exchange_block_state(blocks, 5, 2, finished_by=executor, unless=3) == 3
    assert parent.block_state(blocks, 5) == 3
    assert executor.running() == []
    assert parent.exchange_block_state(blocks, 5, 1, unless=3) == 3
    assert parent.exchange_block_state(blocks, 5, 2, unless=1) == 3
    assert parent.block_state(blocks, 5) == 2


def test_take_running_clears_the_slot_for_a_replacement(sq: SlotQueues) -> None:
    sq.bind_owner()
    sq.mark_running(4)
    sq.mark_running(6)
    assert sq.take_running() == [4, 6]
    assert sq.running() == []
    assert sq.owner_pid() == 0


def test_drain_takes_everything_in_order(sq: SlotQueues) -> None:
    sq.push(1)
    sq.push(2)
    sq.inject([7, 8, 9])
    sq.cancel_injected(8)
    assert sq.drain() == [1, 2, 7, 9]
    assert sq.is_empty()
    assert sq.drain() == []


# ---- crash repair (a child dies holding the lock, mid-claim) --------------------------------


def _die_mid_complete(region: Region) -> None:
    """Run ``complete`` up to its commit, then die before popping the run_stack."""
    me = region.attach(0)
    handle = me.pop_or_take(mark_running=True)
    me._acquire()
    me._w[sr.HOLDER_PID] = os.getpid()
    back = me._w[sr.DONE_BACK]
    me._done[back & me._cmask] = handle
    me._w[sr.DONE_BACK] = back + 1
    os._exit(0)


@pytest.mark.timeout(60)
def test_break_dead_holder_after_complete_committed(ctx: Any, region: Region) -> None:
    me = region.slots[0]
    me.inject([7])
    proc = ctx.Process(target=_die_mid_complete, args=(region,))
    proc.start()
    proc.join(PIPE_TIMEOUT)
    dead = proc.pid
    proc.close()
    assert me.running() == [7]
    assert me.break_dead_holder(dead, me)
    assert me.take_running() == []  # completed: not to be failed
    assert me.take_done() == [7]


def _die_mid_claim(region: Region, victim: int, thief: int, committed: bool) -> None:
    """Run steps 1-3 of a steal (and, if ``committed``, step 4), then die holding the lock."""
    v = region.attach(victim)
    t = region.attach(thief)
    v._acquire()
    v._w[sr.HOLDER_PID] = os.getpid()
    front = v._w[sr.DEQUE_FRONT]
    sr._record_running(t._w, v._deque[front & v._dmask])
    if committed:
        v._w[sr.DEQUE_FRONT] = front + 1
    os._exit(0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("committed", [False, True], ids=["before-commit", "after-commit"])
def test_break_dead_holder_keeps_exactly_one_owner_of_the_handle(
    ctx: Any, region: Region, committed: bool
) -> None:
    victim, thief = region.slots
    victim.push(41)
    victim.push(42)
    proc = ctx.Process(target=_die_mid_claim, args=(region, 0, 1, committed))
    proc.start()
    proc.join(PIPE_TIMEOUT)
    dead = proc.pid
    proc.close()
    assert victim.holder_pid() == dead
    assert victim.steal() == (RETRY, -1)  # the lock is stuck
    assert thief.running() == [41]
    assert not victim.break_dead_holder(dead + 1, thief)  # someone else: not ours to break
    assert victim.break_dead_holder(dead, thief)
    assert victim.holder_pid() == 0
    if committed:
        assert thief.running() == [41]  # claimed: the engine fails or re-runs it
        assert victim.drain() == [42]
    else:
        assert thief.running() == []  # not claimed: still queued, nobody lost it
        assert victim.drain() == [41, 42]


# ---- cancel vs claim, racing across processes -----------------------------------------------


def _steal_until_flag(region: Region, conn: Connection) -> None:
    victim = region.attach(0)
    flag = region.flag()
    conn.send("ready")
    got = []
    steal = victim.steal
    while True:
        result, handle = steal()
        if result is SUCCESS:
            got.append(handle)
        elif result is EMPTY and flag[0] and not victim.probe():
            break
    conn.send(got)
    conn.close()


def _inject_all(sq: SlotQueues, handles: list[int]) -> None:
    done = 0
    while done < len(handles):  # spins while full: the thief makes room
        done += sq.inject(handles[done:])


@pytest.mark.timeout(60)
def test_cancel_injected_vs_claim_exactly_one_wins(ctx: Any) -> None:
    region = Region(n_slots=1, icap=64)
    coordinator = region.slots[0]
    flag = region.flag()
    parent_end, child_end = ctx.Pipe()
    proc = ctx.Process(target=_steal_until_flag, args=(region, child_end))
    try:
        proc.start()
        child_end.close()
        assert parent_end.recv() == "ready"
        region.unlink()
        cancelled = set()
        for h in range(0, 2 * CANCEL_ROUNDS, 2):
            _inject_all(coordinator, [h, h + 1])
            # cancel the later one first: the thief is racing toward it from the front
            cancelled.update(x for x in (h + 1, h) if coordinator.cancel_injected(x))
        flag[0] = 1
        assert parent_end.poll(PIPE_TIMEOUT)
        stolen = parent_end.recv()
        proc.join(PIPE_TIMEOUT)
        assert proc.exitcode == 0
    finally:
        parent_end.close()
        if proc.is_alive():
            proc.kill()
            proc.join()
        proc.close()
        region.close()
    assert len(stolen) == len(set(stolen)), "a handle came out twice"
    assert not cancelled & set(stolen), "a cancelled handle was claimed"
    assert cancelled | set(stolen) == set(range(2 * CANCEL_ROUNDS)), "a handle was lost"


@pytest.mark.parametrize("state", [2, 1], ids=["done-stored", "not-stored"])
def test_break_dead_holder_drops_the_record_of_a_finish_committed_but_not_popped(
    region: Region, state: int
) -> None:
    """An executor died inside ``exchange_block_state(finished_by=...)`` holding the parent's
    lock: after the state store (the record goes, before the lock is released: the parent may
    then free and reuse the block) or before it (the record stays: the task did not finish)."""
    parent, executor = region.slots
    blocks = FakeBlocks()
    blocks.set_state(5, 1)
    parent.push(5)
    assert parent.steal(into=executor) == (SUCCESS, 5)
    dead = 999_999  # the breaker only compares the recorded holder with it
    parent._acquire()
    parent._w[sr.HOLDER_PID] = dead
    blocks.set_state(5, state)
    assert parent.break_dead_holder(dead, executor, blocks, 2)
    assert parent.holder_pid() == 0
    assert executor.running() == ([] if state == 2 else [5])
