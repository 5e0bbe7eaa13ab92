"""Value types that describe one task to the scheduler core and its callers.

Owns ``TaskState`` (the lifecycle, an ``IntEnum`` because it crosses process boundaries in the
pool) and the two answers of ``Scheduler.next()``: ``Due`` and ``Wait``. They are named tuples,
not dataclasses: ``next()`` builds one per task on the coordinator's hot path, and a named tuple
is the cheapest immutable record CPython offers (a frozen dataclass costs ~3x to construct).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple


class TaskState(enum.IntEnum):
    """Lifecycle of one version of a task, in lifecycle order.

    Legal moves (nothing ever goes back)::

        PENDING -> RUNNING | CANCELLED
        RUNNING -> COMPLETED | FAILED | CANCELLED   (CANCELLED only if the task acknowledged a
                                                     cancel request by raising TaskCancelled;
                                                     in a Pool also after a forced cancel, and
                                                     for a cancel or a supersede while the
                                                     retry of a run whose worker died waits
                                                     to start)
    """

    PENDING = 0  # scheduled, waiting in the heap (or behind a running older version)
    RUNNING = 1  # handed out by next(); not yet finished
    COMPLETED = 2  # finished without error
    FAILED = 3  # finished with an error
    CANCELLED = 4  # cancelled before it ran, or acknowledged a cancel request while running

    @property
    def is_terminal(self) -> bool:
        """True for COMPLETED, FAILED and CANCELLED: the version will not change state again."""
        return self >= TaskState.COMPLETED


class Due(NamedTuple):
    """A task that ``next()`` handed out and marked RUNNING; give it back to ``finish()``."""

    task_id: Hashable
    version: int
    run_at: float
    priority: int
    fn: Callable[..., Any]


class Wait(NamedTuple):
    """Tasks are pending but none is due: the earliest is due in ``seconds``.

    ``seconds`` is ``math.inf`` when every pending task waits for a running older version of its
    own id to finish: only a ``finish()`` can make one eligible, not the passing of time.
    """

    seconds: float
