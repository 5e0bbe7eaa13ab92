"""Unit tests of the pure rules behind timed tasks: options, recurrence arithmetic, the ready
queue's order, take/putback and aging (explicit ``now``: no clock, no processes)."""

from __future__ import annotations

import math
from decimal import Decimal
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpsched import TaskOptions
from mpsched._future import Future
from mpsched._options import is_misfire, next_run_at
from mpsched._ready import MAX_AGED_LEVELS, NO_LEVEL, ReadyQueue


# ---------------------------------------------------------------- TaskOptions
@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"timeout": 0}, ValueError),
        ({"timeout": -1.0}, ValueError),
        ({"timeout": math.nan}, ValueError),
        ({"timeout": math.inf}, ValueError),
        ({"timeout": "1"}, TypeError),
        ({"timeout": True}, TypeError),
        ({"timeout_grace": -0.1}, ValueError),
        ({"retries": -1}, ValueError),
        ({"retries": 1.5}, TypeError),
        ({"retries": True}, TypeError),
        ({"every": 0}, ValueError),
        ({"every": math.inf}, ValueError),
        ({"every": 10**400}, ValueError),  # past the float range (it raised OverflowError)
        ({"timeout": -(10**400)}, ValueError),
        ({"overlap": "parallel"}, ValueError),
        ({"misfire": "drop"}, ValueError),
        ({"misfire_grace": math.nan}, ValueError),
        ({"every": Fraction(10**400)}, ValueError),
        ({"timeout": Fraction(0)}, ValueError),
        ({"timeout": Decimal("1")}, TypeError),  # not a numbers.Real
    ],
)
def test_bad_options_fail_at_construction(fields: dict[str, object], error: type) -> None:
    with pytest.raises(error):
        TaskOptions(**fields)  # type: ignore[arg-type]


def test_seconds_may_be_any_real_number_and_are_kept_as_floats() -> None:
    """As ``run_at`` takes any ``numbers.Real``: a Fraction was refused as "not a number"
    (found in review)."""
    options = TaskOptions(timeout=Fraction(1, 2), every=1, timeout_grace=Fraction(1, 4))
    assert (options.timeout, options.every, options.timeout_grace) == (0.5, 1.0, 0.25)
    # Its repr would be refused (over 4,300 digits): it is not needed unless in an error.
    assert TaskOptions(timeout=Fraction(10**5000 + 1, 10**5000)).timeout == 1.0
    with pytest.raises(ValueError, match=r"not a Fraction that is 0\.0 as a float"):
        TaskOptions(timeout=Fraction(1, 10**400))
    assert all(type(x) is float for x in (options.timeout, options.every, options.misfire_grace))


def test_default_options_are_plain() -> None:
    assert TaskOptions().is_plain
    assert not TaskOptions(retries=1).is_plain


# ---------------------------------------------------------------- recurrence
@pytest.mark.parametrize("overlap", ["skip", "coalesce", "queue"])
def test_a_run_that_ends_before_the_next_grid_time_keeps_the_grid(overlap: str) -> None:
    assert next_run_at(10.0, 2.0, 11.5, overlap) == (12.0, 0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overlap", "expected"),
    [
        # A run due at 10 ended at 17.5 with every=2: 12, 14 and 16 passed meanwhile.
        ("skip", (18.0, 3)),  # all three dropped; next on the grid after now
        ("coalesce", (16.0, 2)),  # one run for the three, due at once; two dropped
        ("queue", (12.0, 0)),  # each missed time runs, the first at once
    ],
)
def test_overlap_policies_after_a_long_run(overlap: str, expected: tuple[float, int]) -> None:
    assert next_run_at(10.0, 2.0, 17.5, overlap) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("overlap", ["skip", "coalesce"])
def test_a_grid_finer_than_floats_resolve_continues_from_now(overlap: str) -> None:
    """A subnormal ``every``: the count of passed grid times is infinite as a float (int() of
    it raised OverflowError in the coordinator and broke the pool); now is the last one."""
    run_at, skipped = next_run_at(10.0, 5e-324, 17.5, overlap)  # type: ignore[arg-type]
    assert run_at == 17.5
    assert skipped == 2**53 - (overlap == "coalesce")


def test_queue_catches_up_one_run_at_a_time() -> None:
    due, runs = 10.0, []
    now = 17.5  # each queued run ends at once (now does not move)
    while due + 2.0 <= now:
        due, dropped = next_run_at(due, 2.0, now, "queue")
        assert dropped == 0
        runs.append(due)
    assert runs == [12.0, 14.0, 16.0]
    assert next_run_at(due, 2.0, now, "queue") == (18.0, 0)


def test_a_run_ending_exactly_on_a_grid_time_counts_it_as_passed() -> None:
    assert next_run_at(0.0, 1.0, 1.0, "skip") == (2.0, 1)
    assert next_run_at(0.0, 1.0, 1.0, "coalesce") == (1.0, 0)


def test_misfire_is_strictly_later_than_the_grace() -> None:
    assert not is_misfire(10.0, 11.0, 1.0)
    assert is_misfire(10.0, 11.001, 1.0)
    assert not is_misfire(10.0, 9.0, 0.0)


# ---------------------------------------------------------------- ReadyQueue
def _future(priority: int, due_at: float = 0.0, name: str = "") -> Future:
    f = Future(None, name.encode(), priority)
    f._due_at = due_at
    return f


def _names(futures: list[Future]) -> list[str]:
    return [f._payload.decode() for f in futures]


def test_ready_queue_takes_highest_priority_first_then_fifo() -> None:
    q = ReadyQueue()
    for name, prio in [("a", 0), ("b", 5), ("c", 0), ("d", 5), ("e", -3), ("f", 9)]:
        q.append(_future(prio, name=name), prio)
    assert len(q) == 6
    batch, lowest = q.take(4)
    assert _names(batch) == ["f", "b", "d", "a"]
    assert lowest == 0
    batch, lowest = q.take(10)
    assert _names(batch) == ["c", "e"]
    assert lowest == -3
    assert q.take(1) == ([], NO_LEVEL)
    assert not q


def test_a_released_version_queues_behind_what_became_due_before_it_only() -> None:
    """``append_due``: a timed version that came out of the heap after submits of its level
    queues ahead of those that became due after it, behind those that became due no later
    (ties keep arrival order), and at the back when it is the latest."""
    q = ReadyQueue()
    for name, due_at in [("s1", 1.0), ("s2", 2.0), ("s3", 3.0), ("s4", 4.0)]:
        q.append(_future(0, due_at, name), 0)
    q.append(_future(9, 0.5, "high"), 9)
    q.append_due(_future(0, 2.0, "t2"), 0)  # tie with s2: behind it
    q.append_due(_future(0, 0.5, "t0"), 0)  # before everything of its level
    q.append_due(_future(0, 9.0, "t9"), 0)  # the latest: at the back
    q.append_due(_future(3, 1.0, "new level"), 3)
    batch, _ = q.take(10)
    assert _names(batch) == ["high", "new level", "t0", "s1", "s2", "t2", "s3", "s4", "t9"]
    assert not q


def test_ready_queue_skips_withdrawn_items_and_counts_them_out() -> None:
    q = ReadyQueue()
    futures = [_future(0, name=str(i)) for i in range(4)]
    for f in futures:
        q.append(f, 0)
    futures[1]._withdrawn = True
    futures[2]._withdrawn = True
    batch, _ = q.take(2)
    assert _names(batch) == ["0", "3"]
    assert len(q) == 0


def test_putback_restores_the_front_in_original_order() -> None:
    q = ReadyQueue()
    for name, prio in [("a", 0), ("b", 0), ("c", 7)]:
        q.append(_future(prio, name=name), prio)
    taken, _ = q.take(2)  # c, a
    q.append(_future(7, name="d"), 7)
    q.putback(taken)
    batch, _ = q.take(10)
    assert _names(batch) == ["c", "d", "a", "b"]


def test_drain_empties_highest_first() -> None:
    q = ReadyQueue()
    for name, prio in [("a", 0), ("b", 2), ("c", 1)]:
        q.append(_future(prio, name=name), prio)
    assert _names(q.drain()) == ["b", "c", "a"]
    assert len(q) == 0
    assert q.top_priority() is None


def test_a_level_emptied_by_take_or_age_is_dropped_at_once() -> None:
    """A quiet pool's ready queue holds no level (an emptied one stayed until the next take
    found it, and a memory test saw the bookkeeping grow by one)."""
    q = ReadyQueue()
    q.append(_future(3, name="a"), 3)
    q.append(_future(0, name="b"), 0)
    q.take(1)
    assert q._order == [0]
    assert list(q._levels) == [0]
    q.take(1)
    assert (q._order, q._levels) == ([], {})
    q.append(_future(0, due_at=0.0, name="c"), 0)
    assert q.age(now=2.0, aging=1.0) == 1  # to level 2: level 0 is empty
    assert (q._order, list(q._levels)) == ([2], [2])


class _SlotSetInterrupted(Future):
    """A future whose ``_slot`` store raises a Ctrl-C's KeyboardInterrupt once ``armed`` (as
    one landing at the head of ``drain``'s loop over the items, which sets each elsewhere)."""

    armed = False

    @property  # type: ignore[override]
    def _slot(self) -> int:
        return int(self.__dict__["slot"])

    @_slot.setter
    def _slot(self, value: int) -> None:
        if self.armed:
            raise KeyboardInterrupt
        self.__dict__["slot"] = value


def test_a_drain_interrupted_before_it_returns_leaves_the_queue_as_it_was() -> None:
    """An interrupt in ``drain`` before it returned its list: it had emptied the queue first,
    so the items were in no queue and nowhere else (a cancelling shutdown lost them: their
    futures pending for ever, the drain waiting for their versions)."""
    q = ReadyQueue()
    q.append(_future(1, name="a"), 1)
    interrupting = _SlotSetInterrupted(None, b"b", 0)
    q.append(interrupting, 0)
    interrupting.armed = True
    with pytest.raises(KeyboardInterrupt):
        q.drain()
    interrupting.armed = False
    assert len(q) == 2
    assert _names(q.take(5)[0]) == ["a", "b"]


def test_aging_promotes_one_level_per_period_waited() -> None:
    q = ReadyQueue()
    old = _future(0, due_at=0.0, name="old")
    q.append(old, 0)
    for i in range(3):
        q.append(_future(2, due_at=1.0, name=f"hi{i}"), 2)
    assert q.age(now=1.5, aging=1.0) == 1  # old waited 1.5 periods: level 1
    assert q.top_priority() == 2
    # At 2.0: old reaches level 2, and the others, due at 1.0, have aged to level 3.
    assert q.age(now=2.0, aging=1.0) == 4
    batch, _ = q.take(10)
    assert _names(batch) == ["hi0", "hi1", "hi2", "old"]


@pytest.mark.parametrize("passes", [[0.95, 1.2, 1.45, 1.7, 1.95, 2.2, 2.45, 2.5], [0.95, 2.5]])
def test_aging_keeps_priority_order_among_tasks_due_within_a_period(passes: list[float]) -> None:
    """``b`` (priority 1) became due 0.9 s after ``a`` (priority 0), less than the aging
    period: ``b`` goes first, whether the loop ages every quarter period or comes late (a pass
    at 2.5 s moved ``a`` from level 0 to 2 first, then ``b`` from 1 to 2 behind it)."""
    q = ReadyQueue()
    q.append(_future(0, due_at=0.0, name="a"), 0)
    q.append(_future(1, due_at=0.9, name="b"), 1)
    for now in passes:
        q.age(now, aging=1.0)
    assert _names(q.take(10)[0]) == ["b", "a"]


def test_a_tiny_aging_promotes_by_at_most_max_aged_levels() -> None:
    """``aging`` a subnormal float: the wait over it was infinite, and ``int()`` of it raised
    OverflowError in the coordinator's loop, which broke the pool (found in review)."""
    q = ReadyQueue()
    q.append(_future(0, due_at=0.0, name="old"), 0)
    assert q.age(now=1.0, aging=5e-324) == 1
    assert q.top_priority() == MAX_AGED_LEVELS
    q.putback(q.take(10)[0], now=2.0, aging=5e-324)
    assert q.top_priority() == MAX_AGED_LEVELS


@pytest.mark.parametrize("option", ["timeout", "every", "timeout_grace", "misfire_grace"])
def test_an_option_of_an_int_beyond_floats_is_named_in_its_error(option: str) -> None:
    """Its repr was refused (past 4,300 digits), and the error said so, naming no option."""
    with pytest.raises(ValueError, match=f"{option} must be a finite .* not an int beyond floats"):
        TaskOptions(**{option: 10**5000})


def test_a_task_taken_back_from_an_inbox_keeps_its_aging() -> None:
    """A low task waiting in an inbox is taken back when a higher one comes: at its base
    level, it went behind every such one again, and a stream of them starved it."""
    q = ReadyQueue()
    low = _future(0, due_at=0.0, name="low")
    q.append(_future(3, due_at=4.5, name="high"), 3)
    q.putback([low], now=5.0, aging=1.0)  # waited 5 periods: level 5
    assert _names(q.take(10)[0]) == ["low", "high"]
    q.putback([low])  # no aging: its base level
    q.append(_future(3, due_at=4.5, name="high"), 3)
    assert _names(q.take(10)[0]) == ["high", "low"]


def test_aging_lets_a_long_waiting_task_overtake_a_stream_of_higher_ones() -> None:
    q = ReadyQueue()
    q.append(_future(0, due_at=0.0, name="low"), 0)
    q.append(_future(3, due_at=3.5, name="high"), 3)
    q.age(now=4.0, aging=1.0)  # low: 0 + 4 periods = level 4 > 3
    batch, _ = q.take(10)
    assert _names(batch) == ["low", "high"]


def test_without_enough_wait_aging_changes_nothing() -> None:
    q = ReadyQueue()
    q.append(_future(0, due_at=0.0, name="a"), 0)
    q.append(_future(1, due_at=0.0, name="b"), 1)
    assert q.age(now=0.9, aging=1.0) == 0
    assert _names(q.take(10)[0]) == ["b", "a"]


_QUEUE_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(-2, 2)),
        st.tuples(st.just("take"), st.integers(0, 4)),
        st.tuples(st.just("putback"), st.integers(0, 4)),
        st.tuples(st.just("withdraw_queued"), st.integers(0, 50)),
        st.tuples(st.just("withdraw_taken"), st.integers(0, 50)),
        st.tuples(st.just("age"), st.floats(0.0, 10.0)),
        st.tuples(st.just("drain"), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(_QUEUE_OPS)
def test_live_count_matches_a_scan_of_the_queue(ops: list[tuple[str, float]]) -> None:
    """``live()`` (``statistics().pending``) is a count kept by append, putback, take, drain
    and ``note_withdrawn``: after every operation it equals a scan of the deques (what it was
    before), whatever the mix of withdrawals of queued and of taken (in-flight) items."""
    q = ReadyQueue()
    taken: list[Future] = []  # popped by take (live), as the coordinator's in-flight batch

    def in_queue() -> list[Future]:
        return [f for level in q._levels.values() for f in level]

    for op, arg in ops:
        if op == "append":
            q.append(_future(int(arg), due_at=0.0), int(arg))
        elif op == "take":
            batch, _ = q.take(int(arg))
            assert not any(f._withdrawn for f in batch)
            taken.extend(batch)
        elif op == "putback":
            back, taken = taken[: int(arg)], taken[int(arg) :]
            q.putback(back)
        elif op in ("withdraw_queued", "withdraw_taken"):
            pick = in_queue() if op == "withdraw_queued" else taken
            if pick:
                f = pick[int(arg) % len(pick)]
                f._withdrawn = True  # as Cancelling.withdraw does, then the note
                q.note_withdrawn(f)
        elif op == "age":
            q.age(now=arg, aging=1.0)
        else:
            q.drain()
        queued = in_queue()
        assert len(q) == len(queued)
        assert q.live() == sum(not f._withdrawn for f in queued)
        assert all(f._slot < -1 for f in queued)  # marked queued: never read as an inbox
