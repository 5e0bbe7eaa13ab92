"""Owner + thief PROCESSES hammering one slot: crossbeam-deque's ``stampede`` and ``stress``.

* stampede: the owner (this process) pushes N handles, then pops while several thief processes
  steal: thieves see increasing handles, the owner decreasing ones, and all N come out once.
* stress: an owner process pushes and pops (and runs inline when full), the coordinator (this
  process) injects into the inbox and cancels some entries, >= 2 thief processes steal, each
  recording claims in its own slot's run_stack: every handle comes out exactly once, or was
  cancelled, never both.

Sizes scale with MPSCHED_STRESS_SCALE (default 1: a few seconds per start method on 2 cores).
Ordering uses pipes and, for "no more work will come", flag words in the segment that are set
only after the writer's last locked operation; nothing waits by sleeping.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest

from mpsched._shm import AnonSegment, SemLockHandle, create_lock
from mpsched._shm_deque import SlotQueues, StealResult
from mpsched._slot_region import slot_bytes

SCALE = float(os.environ.get("MPSCHED_STRESS_SCALE", "1"))
STAMPEDE_HANDLES = max(int(20_000 * SCALE), 100)
OWNER_HANDLES = max(int(40_000 * SCALE), 100)  # pushed by the owner process
INJECTED_HANDLES = max(int(20_000 * SCALE), 100)  # injected by the coordinator (this process)
THIEVES = 2
STRESS_DEQUE_CAPACITY = 256  # small, so that push() also fails and the owner runs inline
STRESS_INBOX_CAPACITY = 256
CANCEL_PERCENT = 20  # of injected batches, one entry is cancelled right away
PIPE_TIMEOUT = 60.0  # seconds a child may take to answer
SUCCESS, EMPTY = StealResult.SUCCESS, StealResult.EMPTY
INJECT_DONE, OWNER_DONE = 0, 1  # flag words

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


class Slots:
    """One segment holding ``n`` slots (slot 0 is the victim) and a few flag words."""

    def __init__(self, n: int, dcap: int, icap: int) -> None:
        self.n, self.dcap, self.icap = n, dcap, icap
        self.stride = slot_bytes(dcap, icap)
        self.seg = AnonSegment.create(n * self.stride + 64)
        self.locks: list[SemLockHandle] = [create_lock() for _ in range(n)]
        for k in range(n):
            self.attach(k, init=True)

    def attach(self, k: int, *, init: bool = False) -> SlotQueues:
        at = k * self.stride
        sq = SlotQueues(self.seg.buf[at:], self.locks[k], self.dcap, self.icap, init=init)
        self.seg.track(sq)
        return sq

    def flags(self) -> memoryview:
        return self.seg.view(self.n * self.stride, 64, "q")

    def close(self) -> None:
        for lock in self.locks:
            lock.unlink()
        self.seg.close()


class Children:
    """Child processes that each answer "ready", wait for "go", then send one result."""

    def __init__(self, ctx: Any, target: Callable[..., Any], args: list[tuple[Any, ...]]) -> None:
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        for a in args:
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=_child_main, args=(target, child_end, *a))
            self.procs.append(proc)
            self.conns.append(parent_end)
            proc.start()
            child_end.close()
        for conn in self.conns:
            assert _recv(conn) == "ready"

    def go(self) -> None:
        for conn in self.conns:
            conn.send("go")

    def results(self) -> list[Any]:
        out = [_recv(conn) for conn in self.conns]
        for proc in self.procs:
            proc.join(PIPE_TIMEOUT)
            assert proc.exitcode == 0
        return out

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
            proc.close()


def _recv(conn: Connection) -> Any:
    assert conn.poll(PIPE_TIMEOUT), "child did not answer in time"
    return conn.recv()


def _child_main(target: Callable[..., Any], conn: Connection, *args: Any) -> None:
    conn.send("ready")
    assert conn.recv() == "go"
    conn.send(target(*args))
    conn.close()


@pytest.fixture
def children() -> Iterator[list[Children]]:
    started: list[Children] = []
    yield started
    for group in started:
        group.close()


def _assert_exactly_once(taken: list[list[int]], everything: set[int]) -> None:
    seen: set[int] = set()
    for part in taken:
        assert len(part) == len(set(part)), "a handle came out twice from one taker"
        assert not seen & set(part), "a handle came out twice from two takers"
        seen |= set(part)
    assert seen == everything, f"{len(everything - seen)} handles lost"


# ---- stampede ------------------------------------------------------------------------------


def _steal_all(slots: Slots, own: int) -> list[int]:
    victim, mine = slots.attach(0), slots.attach(own)
    steal, finish = victim.steal, mine.finish_running
    got = []
    while True:
        result, handle = steal(mine)
        if result is SUCCESS:
            got.append(handle)
            finish()
        elif result is EMPTY and not victim.probe():
            return got  # everything was pushed before "go": empty now is empty for good


def test_stampede(ctx: Any, children: list[Children]) -> None:
    dcap = 1 << (STAMPEDE_HANDLES - 1).bit_length()
    slots = Slots(1 + THIEVES, dcap, 1)
    try:
        owner = slots.attach(0)
        for h in range(STAMPEDE_HANDLES):
            assert owner.push(h)
        group = Children(ctx, _steal_all, [(slots, k) for k in range(1, THIEVES + 1)])
        children.append(group)
        group.go()
        popped = []
        while (h := owner.pop(mark_running=True)) != -1:
            popped.append(h)
            owner.finish_running()
        stolen = group.results()
        assert popped == sorted(popped, reverse=True), "the owner must see decreasing handles"
        for got in stolen:
            assert got == sorted(got), "a thief must see increasing handles"
        _assert_exactly_once([popped, *stolen], set(range(STAMPEDE_HANDLES)))
        assert sum(slots.attach(k).counters()["stolen"] for k in range(1, THIEVES + 1)) == sum(
            map(len, stolen)
        )
    finally:
        slots.close()


# ---- stress: owner + coordinator + thieves -------------------------------------------------


def _own(slots: Slots) -> list[int]:
    sq, flags = slots.attach(0), slots.flags()
    sq.bind_owner()
    rng = random.Random(1)
    taken = []
    for h in range(OWNER_HANDLES):
        if not sq.push(h):
            taken.append(h)  # full: run the child inline, as the worker will
        for _ in range(rng.randint(0, 2)):
            got = sq.pop_or_take(mark_running=True)
            if got >= 0:
                taken.append(got)
                sq.finish_running()
    while True:
        done = flags[INJECT_DONE]  # read BEFORE the locked look below
        if not done and sq.is_empty():
            continue  # hint only: poll without taking the lock the coordinator needs
        got = sq.pop_or_take(mark_running=True)
        if got >= 0:
            taken.append(got)
            sq.finish_running()
        elif done:
            break  # empty under the lock, after the last injection: nothing can come any more
    assert sq.running() == []
    flags[OWNER_DONE] = 1
    return taken


def _thieve(slots: Slots, own: int) -> list[int]:
    victim, mine, flags = slots.attach(0), slots.attach(own), slots.flags()
    steal, finish = victim.steal, mine.finish_running
    got = []
    while True:
        done = flags[OWNER_DONE]
        result, handle = steal(mine)
        if result is SUCCESS:
            got.append(handle)
            finish()
        elif done:
            assert mine.running() == []
            return got


def test_stress_conservation(ctx: Any, children: list[Children]) -> None:
    slots = Slots(1 + THIEVES, STRESS_DEQUE_CAPACITY, STRESS_INBOX_CAPACITY)
    try:
        coordinator, flags = slots.attach(0), slots.flags()
        args: list[tuple[Any, ...]] = [(slots,)] + [(slots, k) for k in range(1, THIEVES + 1)]
        owner, thieves = Children(ctx, _own, args[:1]), Children(ctx, _thieve, args[1:])
        children.extend((owner, thieves))
        for lock in slots.locks:
            lock.unlink()  # every child has them open: from now on nothing is named
        owner.go()
        thieves.go()
        rng = random.Random(2)
        cancelled = set()
        next_handle, end = OWNER_HANDLES, OWNER_HANDLES + INJECTED_HANDLES
        while next_handle < end:
            batch = list(range(next_handle, min(next_handle + rng.randint(1, 8), end)))
            done = coordinator.inject(batch)
            while done < len(batch):
                # Full: the takers make room. Poll the racy depth, not the lock, so as not
                # to slow down the very processes that must drain the inbox.
                while coordinator.depths()[1] >= STRESS_INBOX_CAPACITY:
                    pass
                done += coordinator.inject(batch[done:])
            next_handle = batch[-1] + 1
            if rng.randrange(100) < CANCEL_PERCENT:
                victim = rng.choice(batch)
                if coordinator.cancel_injected(victim):
                    cancelled.add(victim)
        flags[INJECT_DONE] = 1
        [owned] = owner.results()
        stolen = thieves.results()
        everything = set(range(OWNER_HANDLES + INJECTED_HANDLES))
        assert not cancelled & set(owned).union(*stolen), "a cancelled handle was claimed"
        _assert_exactly_once([owned, *stolen, sorted(cancelled)], everything)
    finally:
        slots.close()
