"""Per-task options that are not arguments of the task's function, and the recurrence rules.

Owns ``TaskOptions`` (public, validated at construction) and the pure arithmetic of recurring
tasks: when the next run of an id is due after a run ends (``next_run_at``, the overlap policy)
and whether a due run is too late to start (``is_misfire``, the misfire policy). Pure functions
of their arguments and a ``now``, so the rules are unit-tested with plain numbers; the pool's
coordinator thread calls them.

Why an options object: ``pool.submit(fn, *args, **kwargs)`` passes every keyword to ``fn``, so a
``timeout=`` keyword there would steal ``fn``'s own argument of that name. Options travel on a
separate call, ``pool.with_options(...)``, which returns a submitter bound to them.

Recurrence (fixed rate): runs are due at ``first + k * every``, where ``first`` is the ``run_at``
given to ``schedule``, or the time of that call if ``run_at`` has passed (due at once: the time
before the call holds no due times). A run of an id never overlaps the previous run of that id;
when a run ends after one or more later due times have passed, the overlap policy decides what
happens to those missed times:

    "skip"      the missed times are dropped; the next run is due at the first grid time after
                now (the count of skipped times is returned, for the pool's statistics);
    "coalesce"  the missed times become one run, due at once; the grid goes on after it;
    "queue"     every missed time runs, one after the other, each due at once, until the
                recurrence has caught up with the grid.

Misfire: a run that could not *start* within ``misfire_grace`` seconds of its due time (the pool
was busy) is a misfire. "run_late" (the default) runs it anyway; "skip" drops that run, counts it
in ``PoolStatistics.misfires`` and logs a warning: never silently; the due times that passed
while it waited are dropped with it, whatever the overlap policy (the next run is due at the
first grid time after now; they count in ``PoolStatistics.skipped_runs``). A run that the
coordinator hands to a worker as soon as it finds it due is never a misfire, whatever the grace
(zero included): the coordinator's own wake-up after the due time is not the pool being busy. The
check is made twice: as a run leaves the pool's ready queue, and, under "skip", by the worker
that claims it from an inbox (up to ``dispatch_window`` tasks may wait there ahead of it): one
that waited there behind other work past its grace is dropped unstarted; one claimed first
thing after the worker's idle wait is not (it started at that worker's first chance: the
worker's wake-up is not the pool being busy either). Such a run's state is RUNNING from the
claim until the coordinator has counted it; the task's function is never called.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from mpsched._clock import is_real

OverlapPolicy = Literal["skip", "coalesce", "queue"]
MisfirePolicy = Literal["run_late", "skip"]

OVERLAP_POLICIES = ("skip", "coalesce", "queue")
MISFIRE_POLICIES = ("run_late", "skip")
DEFAULT_TIMEOUT_GRACE = 1.0  # seconds between the cooperative cancel of a timeout and the kill
DEFAULT_MISFIRE_GRACE = 1.0  # seconds late a recurring run may start before it is a misfire
# TaskOptions' fields of seconds: (name, may be None, must be positive).
_SECONDS_FIELDS = (
    ("timeout", True, True),
    ("timeout_grace", False, False),
    ("every", True, True),
    ("misfire_grace", False, False),
)
# next_run_at: grid steps counted exactly up to here (floats hold every integer below 2**53);
# beyond, the grid is finer than a float resolves at now, and now is the last time passed.
_EXACT_STEPS = 2**53


def check_seconds(name: str, value: object, *, allow_none: bool, positive: bool) -> float | None:
    """``value`` as a float of seconds (None if it is None and ``allow_none``), or TypeError if
    it is not a real number (a bool is not; a ``Fraction`` or a numpy scalar is), ValueError
    if it is not finite, negative, or zero where it must be ``positive``."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not is_real(value):
        raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
    try:
        seconds = float(value)  # type: ignore[arg-type]  # a numbers.Real
    except OverflowError:  # an int (or a Fraction) past the float range is not finite either
        seconds = math.nan
        beyond = True
    else:
        beyond = False
    if not math.isfinite(seconds) or seconds < 0 or (positive and seconds == 0):
        qualifier = "positive" if positive else "non-negative"
        raise ValueError(
            f"{name} must be a finite {qualifier} number of seconds, not "
            + _shown(value, seconds, beyond)
        )
    return seconds


def _shown(value: object, seconds: float, beyond: bool) -> str:
    """``value`` in an error message. Not by ``repr`` if it is past the float range, or not an
    int or a float: an int's or a Fraction's repr of more than 4,300 digits is refused, and
    its error ("Exceeds the limit ... for integer string conversion") named no option."""
    if type(value) in (int, float) and not beyond:
        return repr(value)
    kind = type(value).__name__
    kind = f"{'an' if kind[0].lower() in 'aeiou' else 'a'} {kind}"
    return f"{kind} beyond floats" if beyond else f"{kind} that is {seconds!r} as a float"


@dataclass(frozen=True)
class TaskOptions:
    """How the pool runs one task, apart from its arguments.

    Attributes:
        timeout: seconds a run may take once started; then it is asked to cancel (its
            ``current_task().cancel_requested`` turns True) and, ``timeout_grace`` seconds
            later, its worker is killed and replaced. The future fails with
            ``concurrent.futures.TimeoutError`` (the builtin ``TimeoutError`` since Python
            3.11) unless the task returned first. None: no limit.
        timeout_grace: seconds between the cooperative cancel and the kill.
        retries: how many times the task runs again if its worker dies while running it
            (out of memory, a crash in native code); 0: it fails with ``WorkerCrashedError``.
            A run that was asked to stop (``pool.cancel``, or its timeout) is not retried. A
            retry that has not started can be cancelled (``cancel()``, ``pool.cancel``), as a
            task no worker claimed: its state goes from RUNNING to CANCELLED.
        every: seconds between the due times of a recurring task (``schedule`` only); None:
            one run.
        overlap: what a recurring task does with due times that passed while its previous run
            was still going: ``"skip"``, ``"coalesce"`` or ``"queue"`` (module doc).
        misfire: ``"run_late"`` or ``"skip"`` for a recurring run that could not start within
            ``misfire_grace`` seconds of its due time (judged as it leaves the pool's ready
            queue, and again as a worker claims it: see the module doc). ``"skip"`` also drops
            the due times that passed while that run waited, whatever ``overlap`` (``"queue"``
            too): the next run is due at the first grid time after now (counted in
            ``PoolStatistics.skipped_runs``).
        misfire_grace: seconds; see ``misfire``.
    """

    timeout: float | None = None
    timeout_grace: float = DEFAULT_TIMEOUT_GRACE
    retries: int = 0
    every: float | None = None
    overlap: OverlapPolicy = "coalesce"
    misfire: MisfirePolicy = "run_late"
    misfire_grace: float = DEFAULT_MISFIRE_GRACE

    def __post_init__(self) -> None:
        # Kept as floats (frozen: set through object's own __setattr__), whatever real number
        # type they came as.
        for name, allow_none, positive in _SECONDS_FIELDS:
            seconds = check_seconds(
                name, getattr(self, name), allow_none=allow_none, positive=positive
            )
            object.__setattr__(self, name, seconds)
        if isinstance(self.retries, bool) or not isinstance(self.retries, int):
            raise TypeError(f"retries must be an int, not {type(self.retries).__name__}")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, not {self.retries}")
        if self.overlap not in OVERLAP_POLICIES:
            raise ValueError(f"overlap must be one of {OVERLAP_POLICIES}, not {self.overlap!r}")
        if self.misfire not in MISFIRE_POLICIES:
            raise ValueError(f"misfire must be one of {MISFIRE_POLICIES}, not {self.misfire!r}")

    @property
    def is_plain(self) -> bool:
        """True if these options change nothing (the pool then takes its fast path)."""
        return self == _PLAIN


_PLAIN = TaskOptions()


def next_run_at(due: float, every: float, now: float, overlap: OverlapPolicy) -> tuple[float, int]:
    """When the run after the one due at ``due`` is due, given that it ended at ``now``.

    Returns:
        ``(run_at, skipped)``: the next due time (it may be <= now: due at once) and how many
        grid times the policy dropped.
    """
    following = due + every
    if following > now:  # the run ended before the next grid time: nothing was missed
        return following, 0
    if overlap == "queue":
        return following, 0
    # The last grid time that has passed: following + m * every <= now.
    steps = (now - following) // every
    if steps < _EXACT_STEPS:
        missed = int(steps) + 1
        last_passed = following + (missed - 1) * every
    else:  # a grid finer than floats resolve at now (a subnormal every: steps is inf)
        missed = _EXACT_STEPS
        last_passed = now
    if overlap == "coalesce":
        return last_passed, missed - 1
    return last_passed + every, missed  # "skip"


def is_misfire(run_at: float, now: float, grace: float) -> bool:
    """True if a run due at ``run_at`` that starts at ``now`` is later than ``grace`` allows."""
    return now - run_at > grace
