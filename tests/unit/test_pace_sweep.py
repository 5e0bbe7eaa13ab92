"""``Coordinator.pace_sweep`` against a reference model (docs/design.md, "Lazy sweep").

The loop's passes, results, results that only the locked recheck finds, and the conditions that
keep the sweep eager come in any order (hypothesis); a stand-in carries the attributes that
``pace_sweep`` reads. Checked after every pass: the sweep is lazy exactly when the model says,
the header word agrees with it, and the sweep went lazy only through a recheck that took every
done ring under its lock with the word already set.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from mpsched._coordinator import QUIET_SWEEPS, Coordinator

pytestmark = pytest.mark.timeout(120)

# The loop's state that keeps the sweep eager, each with its "on" value (in flight: off).
CONDITIONS: dict[str, Any] = {
    "ready": [1],
    "watched": {1: None},
    "requests": [1],
    "deferred_cancels": [1],
    "unread": [1],
    "draining": True,
}


def _off(name: str) -> Any:
    return False if name == "draining" else type(CONDITIONS[name])()


class FakeHeader:
    def __init__(self) -> None:
        self.word = False

    def lazy_sweep(self) -> bool:
        return self.word

    def set_lazy_sweep(self, on: bool) -> None:
        self.word = on


class Loop:
    """What ``pace_sweep`` reads of the coordinator."""

    pace_sweep = Coordinator.pace_sweep
    may_sweep_lazily = Coordinator.may_sweep_lazily

    def __init__(self) -> None:
        self.header = FakeHeader()
        self.collect_lock = threading.Lock()
        self.completed = 0
        self.completed_seen = 0
        self.quiet_sweeps = 0
        self.sweep_lazy = False
        self.by_handle: dict[int, None] = {1: None}
        for name in CONDITIONS:
            setattr(self, name, _off(name))
        self.behind_lock = 0  # results that only a take under the ring's lock finds
        self.rechecks: list[tuple[bool, bool, bool, bool]] = []

    def collect_locked(self, in_loop: bool, every: bool = False) -> None:
        self.rechecks.append((self.collect_lock.locked(), self.header.word, every, in_loop))
        self.completed += self.behind_lock
        self.behind_lock = 0


class PaceMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = Loop()
        self.lazy = False  # the model
        self.quiet = 0
        self.seen = 0
        self.eager_reasons: set[str] = set()

    def conditions_hold(self) -> bool:
        return bool(self.loop.by_handle) and not self.eager_reasons

    def model_pass(self, timer: bool) -> None:
        loop = self.loop
        if loop.completed != self.seen or not self.conditions_hold():
            self.seen = loop.completed
            self.lazy = False
            self.quiet = 0
            return
        if not timer or self.lazy:
            return
        self.quiet += 1
        if self.quiet < QUIET_SWEEPS:
            return
        if loop.behind_lock:  # the recheck collects it: results came, the sweep stays eager
            self.seen = loop.completed + loop.behind_lock
            self.quiet = 0
        else:
            self.lazy = True

    def run_pass(self, timer: bool) -> None:
        before = len(self.loop.rechecks)
        was_lazy = self.loop.sweep_lazy
        self.model_pass(timer)
        self.loop.pace_sweep(timer=timer)
        assert self.loop.sweep_lazy == self.lazy
        if self.lazy and not was_lazy:
            # Went lazy at this pass: through one recheck, under collect_lock, with the word
            # set, of every ring, in the loop's thread.
            assert self.loop.rechecks[before:] == [(True, True, True, True)]

    @rule()
    def timer_pass(self) -> None:
        self.run_pass(timer=True)

    @rule()
    def event_pass(self) -> None:
        self.run_pass(timer=False)

    @rule(n=st.integers(1, 3))
    def results_collected(self, n: int) -> None:
        """By the loop's collection at the start of a pass, or a user thread's help_wait."""
        self.loop.completed += n

    @rule()
    def result_behind_the_lock_free_read(self) -> None:
        self.loop.behind_lock += 1

    @rule(name=st.sampled_from(sorted(CONDITIONS)), on=st.booleans())
    def condition(self, name: str, on: bool) -> None:
        setattr(self.loop, name, CONDITIONS[name] if on else _off(name))
        (self.eager_reasons.add if on else self.eager_reasons.discard)(name)

    @rule(in_flight=st.booleans())
    def tasks_in_flight(self, in_flight: bool) -> None:
        self.loop.by_handle = {1: None} if in_flight else {}

    @invariant()
    def the_word_follows_the_state(self) -> None:
        # Between passes the header word is set exactly while the sweep is lazy.
        assert self.loop.header.word == self.loop.sweep_lazy


PaceMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
TestPaceSweep = PaceMachine.TestCase


def test_a_loop_that_only_times_out_goes_lazy_after_the_quiet_sweeps() -> None:
    loop = Loop()
    for _ in range(QUIET_SWEEPS - 1):
        loop.pace_sweep(timer=True)
        assert not loop.sweep_lazy
    loop.pace_sweep(timer=True)
    assert loop.sweep_lazy
    assert loop.header.word
    loop.completed += 1
    loop.pace_sweep(timer=False)
    assert not loop.sweep_lazy
    assert not loop.header.word
