"""``_clock.wait_interruptibly``: the main thread waits in slices of ``INTERRUPT_CHECK_S``, so
that a signal's handler runs during a long wait; other threads wait in one call.

The waits are fakes that only record their timeouts, and the clock that the slicing reads is
advanced by them: nothing here waits for real.
"""

from __future__ import annotations

import math
import threading
import types

import pytest

from mpsched import _clock
from mpsched._clock import INTERRUPT_CHECK_S, thread_joined, wait_interruptibly, wait_seconds

pytestmark = pytest.mark.timeout(60)


class FakeWait:
    """A wait that is satisfied at its ``succeed_at``-th call (never if 0) and records each
    timeout; the clock moves on by each timeout it was given."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, succeed_at: int = 0) -> None:
        self.now = 1000.0
        self.timeouts: list[float | None] = []
        self.succeed_at = succeed_at
        fake_time = types.SimpleNamespace(monotonic=lambda: self.now)
        monkeypatch.setattr(_clock, "time", fake_time)

    def __call__(self, timeout: float | None) -> bool:
        self.timeouts.append(timeout)
        if timeout is not None:
            self.now += timeout
        return len(self.timeouts) == self.succeed_at


def test_the_main_thread_waits_without_limit_in_slices_until_it_is_satisfied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wait = FakeWait(monkeypatch, succeed_at=5)
    assert wait_interruptibly(wait, None) is True
    assert wait.timeouts == [INTERRUPT_CHECK_S] * 5


def test_the_main_thread_waits_to_its_deadline_in_slices_then_reports_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wait = FakeWait(monkeypatch)
    timeout = 3.5 * INTERRUPT_CHECK_S
    assert wait_interruptibly(wait, timeout) is False
    assert wait.timeouts[:3] == [INTERRUPT_CHECK_S] * 3
    assert wait.timeouts[3] == pytest.approx(0.5 * INTERRUPT_CHECK_S)
    assert sum(t for t in wait.timeouts if t is not None) == pytest.approx(timeout)
    assert wait.timeouts[-1] == 0  # the last look, once the deadline passed


@pytest.mark.parametrize("timeout", [0.0, -1.0, INTERRUPT_CHECK_S / 2, INTERRUPT_CHECK_S])
def test_a_wait_no_longer_than_a_slice_is_one_call(
    monkeypatch: pytest.MonkeyPatch, timeout: float
) -> None:
    wait = FakeWait(monkeypatch)
    assert wait_interruptibly(wait, timeout) is False
    assert wait.timeouts == [timeout]


@pytest.mark.parametrize("timeout", [None, 10 * INTERRUPT_CHECK_S])
def test_another_thread_waits_in_one_call(
    monkeypatch: pytest.MonkeyPatch, timeout: float | None
) -> None:
    wait = FakeWait(monkeypatch, succeed_at=1)
    outcome: list[bool] = []
    thread = threading.Thread(target=lambda: outcome.append(wait_interruptibly(wait, timeout)))
    thread.start()
    thread.join()
    assert outcome == [True]
    assert wait.timeouts == [timeout]


def test_thread_joined_reports_whether_the_thread_ended() -> None:
    release = threading.Event()
    thread = threading.Thread(target=release.wait)
    thread.start()
    joined = thread_joined(thread)
    assert joined(0) is False
    release.set()
    assert joined(None) is True


def test_an_int_past_the_float_range_keeps_its_sign_as_a_timeout() -> None:
    """``float()`` overflows for such an int: a huge positive one is no limit (None), a huge
    negative one stays negative (-inf: the wait times out at once, as for any negative
    timeout), not "no limit", which waited for ever (a mutation hunt found the sign
    unpinned)."""
    assert wait_seconds(10**400) is None
    assert wait_seconds(-(10**400)) == -math.inf
