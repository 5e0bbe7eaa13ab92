"""Model test: random schedule / reschedule / cancel / advance / next / finish sequences drive
mpsched.Scheduler and a plain sorted-list reference side by side; every answer must agree. A
second machine drives the VersionedHeap underneath as the pool does (withdraw by version, finish
of a withdrawn version, discard, the memory of the last ``remember`` ended ids) and checks every
query against the same model."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mpsched import Due, Scheduler, TaskCancelled, TaskState, Wait
from mpsched._heap import (
    COMPACT_FACTOR,
    PRUNE_FACTOR,
    PRUNE_SLACK,
    RECORD_TASK_ID,
    RECORD_VERSION,
    VersionedHeap,
)
from mpsched.testing import FakeClock

IDS = st.integers(0, 7)
TIMES = st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 10.0])
PRIORITIES = st.integers(-2, 2)


def f() -> None:
    pass


@dataclass
class Pending:
    task_id: int
    version: int
    run_at: float
    priority: int
    seq: int


@dataclass
class Model:
    """The obvious, slow scheduler: a list scanned in full on every call.

    With ``remember``, the ended-id memory as the rule states it: an id whose latest version
    ended (not running, nothing pending) is remembered; past ``remember`` such ids, the one
    whose latest end is the oldest is forgotten."""

    remember: int = 0
    now: float = 0.0
    seq: int = 0
    pending: dict[int, Pending] = field(default_factory=dict)  # one live version per id
    running: dict[int, tuple[int, bool]] = field(default_factory=dict)  # id -> (version, cancel?)
    versions: dict[int, int] = field(default_factory=dict)
    states: dict[int, TaskState] = field(default_factory=dict)
    ended: dict[int, None] = field(default_factory=dict)  # remembered ids, oldest end first

    def _end(self, task_id: int) -> None:
        if self.remember:
            assert task_id not in self.ended  # it was pending or running: no end is remembered
            self.ended[task_id] = None
            if len(self.ended) > self.remember:
                self.forget(next(iter(self.ended)))

    def schedule(self, task_id: int, run_at: float, priority: int) -> int:
        version = self.versions.get(task_id, 0) + 1
        self.versions[task_id] = version
        self.pending[task_id] = Pending(task_id, version, run_at, priority, self.seq)
        self.seq += 1
        self.states[task_id] = TaskState.PENDING
        self.ended.pop(task_id, None)
        return version

    def withdraw(self, task_id: int, version: int) -> bool:
        pending = self.pending.get(task_id)
        if pending is None or (version and pending.version != version):
            return False
        del self.pending[task_id]
        self.states[task_id] = TaskState.CANCELLED
        if task_id not in self.running:  # else the id ends when its running version does
            self._end(task_id)
        return True

    def forget(self, task_id: int) -> None:
        assert self.states[task_id].is_terminal
        assert task_id not in self.running
        del self.states[task_id], self.versions[task_id]
        self.ended.pop(task_id, None)

    def discard(self, task_id: int) -> bool:
        state = self.states.get(task_id)
        if state is None or not state.is_terminal or task_id in self.running:
            return False
        self.forget(task_id)
        return True

    def cancel(self, task_id: int) -> bool:
        found = False
        if task_id in self.pending:
            del self.pending[task_id]
            self.states[task_id] = TaskState.CANCELLED
            if task_id not in self.running:
                self._end(task_id)
            found = True
        if task_id in self.running:
            self.running[task_id] = (self.running[task_id][0], True)
            found = True
        return found

    def next(self) -> tuple[int, int] | float | None:
        eligible = [p for p in self.pending.values() if p.task_id not in self.running]
        due = [p for p in eligible if p.run_at <= self.now]
        if due:
            p = min(due, key=lambda p: (p.run_at, -p.priority, p.seq))
            del self.pending[p.task_id]
            self.running[p.task_id] = (p.version, False)
            self.states[p.task_id] = TaskState.RUNNING
            return (p.task_id, p.version)
        if eligible:
            return min(p.run_at for p in eligible) - self.now
        return math.inf if self.pending else None

    def finish(
        self, task_id: int, version: int, error: BaseException | None, cancelled: bool = False
    ) -> TaskState:
        assert self.running[task_id][0] == version
        cancel_requested = self.running.pop(task_id)[1]
        if cancelled:
            outcome = TaskState.CANCELLED
        elif error is None:
            outcome = TaskState.COMPLETED
        elif isinstance(error, TaskCancelled) and cancel_requested:
            outcome = TaskState.CANCELLED
        else:
            outcome = TaskState.FAILED
        if self.versions[task_id] == version:
            self.states[task_id] = outcome
        if task_id not in self.pending:  # else a newer version waited behind this one
            self._end(task_id)
        return outcome


class HeapBound:
    """The heap's memory bound (``_heap`` module doc, "The prune check"), checked after every
    step: a ``schedule``, and a ``pop_due`` that hands a version out (the live count falls),
    leave at most ``PRUNE_FACTOR * live + slack`` entries; every other call adds none, but for
    the deferred version that a ``finish`` lets into the heap. (A cancel rebuilds nothing: the
    next schedule does.) So the heap cannot grow past the bound. (An audit took ``pop_due``'s
    prune out and no test failed: it was checked after a schedule only.)"""

    def __init__(self, slack: int) -> None:
        self.slack = slack
        self.bounded = False  # set by the rules after which the bound holds
        self.size = 0  # the heap's length after the last step

    def check(self, heap: VersionedHeap) -> None:
        size = heap.heap_size
        if self.bounded:
            assert size <= PRUNE_FACTOR * len(heap) + self.slack
        else:
            assert size <= self.size + 1
        self.size, self.bounded = size, False


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock(0.0)
        self.sched = Scheduler(clock=self.clock)
        self.model = Model()
        self.handed_out: list[Due] = []
        self.bound = HeapBound(PRUNE_SLACK)

    @rule(task_id=IDS, run_at=TIMES, priority=PRIORITIES)
    def schedule(self, task_id: int, run_at: float, priority: int) -> None:
        assert self.sched.schedule(task_id, run_at, priority, f) == self.model.schedule(
            task_id, run_at, priority
        )
        self.bound.bounded = True

    @rule(task_id=IDS)
    def cancel(self, task_id: int) -> None:
        assert self.sched.cancel(task_id) == self.model.cancel(task_id)

    @rule(dt=st.sampled_from([0.0, 0.25, 0.5, 1.0, 5.0]))
    def advance(self, dt: float) -> None:
        self.clock.advance(dt)
        self.model.now += dt

    @rule()
    def next(self) -> None:
        got = self.sched.next()
        want = self.model.next()
        if want is None:
            assert got is None
        elif isinstance(want, tuple):
            assert isinstance(got, Due), (got, want)
            assert (got.task_id, got.version) == want
            self.handed_out.append(got)
            self.bound.bounded = True
        else:
            assert isinstance(got, Wait), (got, want)
            assert got.seconds == want

    @precondition(lambda self: self.handed_out)
    @rule(data=st.data(), error=st.sampled_from([None, "cancel", "fail"]))
    def finish(self, data: st.DataObject, error: str | None) -> None:
        due = self.handed_out.pop(data.draw(st.integers(0, len(self.handed_out) - 1)))
        exc = {None: None, "cancel": TaskCancelled(), "fail": ValueError()}[error]
        assert self.sched.finish(due, exc) == self.model.finish(due.task_id, due.version, exc)

    @invariant()
    def agrees(self) -> None:
        assert len(self.sched) == len(self.model.pending)
        for task_id in range(8):
            assert self.sched.state(task_id) == self.model.states.get(task_id)
            assert (
                self.sched.cancel_requested(task_id)
                == self.model.running.get(task_id, (0, False))[1]
            )

    @invariant()
    def heap_is_bounded(self) -> None:
        self.bound.check(self.sched._heap)


SchedulerMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=60, deadline=None
)
TestScheduler = SchedulerMachine.TestCase


class SmallPruneMachine(SchedulerMachine):
    """The same model with pruning after every few stale entries, so rebuilds happen often."""

    def __init__(self) -> None:
        super().__init__()
        import mpsched._heap as heap_module

        self._saved = heap_module.PRUNE_SLACK
        heap_module.PRUNE_SLACK = 1
        self.bound = HeapBound(1)

    def teardown(self) -> None:
        import mpsched._heap as heap_module

        heap_module.PRUNE_SLACK = self._saved


SmallPruneMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=60, deadline=None
)
TestSchedulerFrequentPrune = SmallPruneMachine.TestCase


REMEMBER = 2  # ended ids the heap below keeps (the pool keeps 100,000)


class HeapMachine(RuleBasedStateMachine):
    """``VersionedHeap`` as the pool's coordinator drives it, against ``Model``."""

    def __init__(self) -> None:
        super().__init__()
        self.heap = VersionedHeap(remember=REMEMBER)
        self.model = Model(remember=REMEMBER)
        self.items: dict[int, object] = {}  # the item of each id's latest version
        self.handed_out: list[Due] = []
        self.bound = HeapBound(PRUNE_SLACK)

    @rule(task_id=IDS, run_at=TIMES, priority=PRIORITIES)
    def schedule(self, task_id: int, run_at: float, priority: int) -> None:
        item = self.items[task_id] = object()
        want = self.model.schedule(task_id, run_at, priority)
        record = self.heap.schedule(task_id, run_at, priority, item)
        assert (record[RECORD_TASK_ID], record[RECORD_VERSION]) == (task_id, want)
        self.bound.bounded = True

    @rule(task_id=IDS)
    def cancel(self, task_id: int) -> None:
        assert self.heap.cancel(task_id) == self.model.cancel(task_id)

    @rule(task_id=IDS, version=st.integers(0, 3))
    def withdraw(self, task_id: int, version: int) -> None:
        item = self.items.get(task_id)
        got = self.heap.withdraw(task_id, version)
        assert got is (item if self.model.withdraw(task_id, version) else None)

    @rule(task_id=IDS)
    def discard(self, task_id: int) -> None:
        assert self.heap.discard(task_id) == self.model.discard(task_id)

    @rule(dt=st.sampled_from([0.0, 0.5, 5.0]))
    def advance(self, dt: float) -> None:
        self.model.now += dt

    @rule()
    def pop_due(self) -> None:
        got = self.heap.pop_due(self.model.now)
        want = self.model.next()
        if isinstance(want, tuple):
            assert isinstance(got, Due), (got, want)
            assert (got.task_id, got.version) == want
            assert got.fn is self.items[got.task_id]
            self.handed_out.append(got)
            self.bound.bounded = True
        elif want is None:
            assert got is None
        else:
            assert got == Wait(want)

    @precondition(lambda self: self.handed_out)
    @rule(data=st.data(), error=st.sampled_from([None, "cancel", "fail", "withdrawn"]))
    def finish(self, data: st.DataObject, error: str | None) -> None:
        due = self.handed_out.pop(data.draw(st.integers(0, len(self.handed_out) - 1)))
        withdrawn = error == "withdrawn"
        exc = {"cancel": TaskCancelled(), "fail": ValueError()}.get(error or "")
        want = self.model.finish(due.task_id, due.version, exc, withdrawn)
        assert self.heap.finish(due, exc, cancelled=withdrawn) == want

    @invariant()
    def agrees(self) -> None:
        heap, model = self.heap, self.model
        assert len(heap) == len(model.pending)
        assert sorted(heap.pending_ids()) == sorted(model.pending)  # type: ignore[type-var]
        for task_id in range(8):
            assert heap.state(task_id) == model.states.get(task_id)
            assert heap.version(task_id) == model.versions.get(task_id, 0)
            running = model.running.get(task_id, (0, False))
            assert heap.running_version(task_id) == running[0]
            assert heap.cancel_requested(task_id) == running[1]
            pending = task_id in model.pending
            assert heap.pending_item(task_id) is (self.items[task_id] if pending else None)

    @invariant()
    def memory_is_bounded(self) -> None:
        heap = self.heap
        assert len(heap._finished) <= COMPACT_FACTOR * REMEMBER
        # the remembered ids are the deque's live entries (in end order: agrees checks which)
        assert len(heap._finished) - heap._stale == len(self.model.ended) <= REMEMBER
        self.bound.check(heap)


HeapMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
TestHeap = HeapMachine.TestCase
