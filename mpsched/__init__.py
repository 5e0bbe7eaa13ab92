"""mpsched: a work-stealing process pool with timed, prioritized, cancellable tasks.

Layering rule (enforced by tests/test_public_api.py): the leaf modules (``_task``, ``_clock``,
``_heap``, ``_shm``, ``_shm_deque``, ``_payloads``, ``_protocol``, ``_wakeup``) import nothing from
mpsched except ``_errors`` and ``_task``; ``_scheduler``, ``_worker`` and ``_coordinator`` compose
leaves; only ``_pool`` knows about both sides. Public names come only from this module.
"""

from __future__ import annotations

from mpsched._errors import BrokenPoolError as BrokenPoolError
from mpsched._errors import InvalidTransition as InvalidTransition
from mpsched._errors import MpschedError as MpschedError
from mpsched._errors import PoolClosedError as PoolClosedError
from mpsched._errors import SchedulerClosed as SchedulerClosed
from mpsched._errors import TaskCancelled as TaskCancelled
from mpsched._errors import WorkerCrashedError as WorkerCrashedError
from mpsched._future import Future as Future
from mpsched._pool import Pool as Pool
from mpsched._pool import PoolStatistics as PoolStatistics
from mpsched._pool import WorkerStatistics as WorkerStatistics
from mpsched._scheduler import Scheduler as Scheduler
from mpsched._serialize import TaskPicklingError as TaskPicklingError
from mpsched._task import Due as Due
from mpsched._task import TaskState as TaskState
from mpsched._task import Wait as Wait
from mpsched._worker import ChildFuture as ChildFuture
from mpsched._worker import submit as submit

__version__ = "0.1.0"

__all__ = (
    "BrokenPoolError",
    "ChildFuture",
    "Due",
    "Future",
    "InvalidTransition",
    "MpschedError",
    "Pool",
    "PoolClosedError",
    "PoolStatistics",
    "Scheduler",
    "SchedulerClosed",
    "TaskCancelled",
    "TaskPicklingError",
    "TaskState",
    "Wait",
    "WorkerCrashedError",
    "WorkerStatistics",
    "submit",
)
