"""mpsched: a work-stealing process pool with timed, prioritized, cancellable tasks.

Layering rule (enforced by tests/test_quality.py): the leaf modules (``_constants``, ``_task``,
``_clock``, ``_heap``, ``_shm``, ``_shm_deque``, ``_payloads``, ``_protocol``, ``_wakeup``,
``_stdio``) import nothing from mpsched except ``_constants``, ``_errors``, ``_task`` and
``_stdio`` (``_shm_deque`` is one
leaf in four modules, with ``_slot_region``, ``_slot_repair`` and ``_block_state``, and
``_payloads`` one with ``_slab_region``, ``_slab_repair`` and ``_function_table``: a leaf's parts
import one another);
``_scheduler``, ``_worker`` (with its part ``_children``) and ``_coordinator`` (with its parts,
``_coord_*``) compose leaves; only ``_pool`` (with its parts ``_startup``, ``_lifecycle``, ``_map``
and ``_statistics``) knows about both sides. Public names come only from this module.
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing.util  # noqa: F401  # its exit hook first: see atexit.register below
import sys

from mpsched._errors import InvalidTransition as InvalidTransition
from mpsched._errors import MpschedError as MpschedError
from mpsched._errors import PoolClosedError as PoolClosedError
from mpsched._errors import SchedulerClosed as SchedulerClosed
from mpsched._errors import TaskCancelled as TaskCancelled
from mpsched._errors import TaskOutcomeError as TaskOutcomeError

# typing.TYPE_CHECKING without importing typing: the zygote imports this package and the
# worker-side modules, and typing would add a few ms to every pool's start-up (the modules the
# zygote imports use typing only in annotations). Type checkers treat any name TYPE_CHECKING
# in a condition as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from mpsched._children import ChildFuture as ChildFuture
    from mpsched._children import TaskContext as TaskContext
    from mpsched._children import current_task as current_task
    from mpsched._children import submit as submit
    from mpsched._future import Future as Future
    from mpsched._options import TaskOptions as TaskOptions
    from mpsched._pool import Pool as Pool
    from mpsched._pool import TaskSubmitter as TaskSubmitter
    from mpsched._pool_errors import BrokenPoolError as BrokenPoolError
    from mpsched._pool_errors import WorkerCrashedError as WorkerCrashedError
    from mpsched._scheduler import Scheduler as Scheduler
    from mpsched._serialize import TaskPicklingError as TaskPicklingError
    from mpsched._statistics import PoolStatistics as PoolStatistics
    from mpsched._statistics import WorkerStatistics as WorkerStatistics
    from mpsched._task import Due as Due
    from mpsched._task import TaskState as TaskState
    from mpsched._task import Wait as Wait

# Imported on first use: the zygote and the workers import this package too, and must not pay
# for the coordinator's side (concurrent.futures, threads, the pool, the scheduler's types,
# the enum and named tuple classes they build, the errors that are concurrent.futures') on
# every start-up.
_LAZY = {
    "BrokenPoolError": "mpsched._pool_errors",
    "ChildFuture": "mpsched._children",
    "Due": "mpsched._task",
    "Future": "mpsched._future",
    "Pool": "mpsched._pool",
    "PoolStatistics": "mpsched._statistics",
    "Scheduler": "mpsched._scheduler",
    "TaskContext": "mpsched._children",
    "TaskOptions": "mpsched._options",
    "TaskPicklingError": "mpsched._serialize",
    "TaskState": "mpsched._task",
    "TaskSubmitter": "mpsched._pool",
    "Wait": "mpsched._task",
    "WorkerCrashedError": "mpsched._pool_errors",
    "WorkerStatistics": "mpsched._statistics",
    "current_task": "mpsched._children",
    "submit": "mpsched._children",
}


def _at_exit() -> None:
    """The interpreter's exit: shut down the pools (``_lifecycle.shutdown_all_pools``). Hooked
    here, as the package is imported, not where the pools are: ``Pool`` is imported on first
    use, and a hook registered then (a first ``Pool()`` in an atexit handler) was never run
    (its pool, dropped, was cut off with its work), or ran before the handlers registered
    after ``import mpsched`` (whose pools it had shut down)."""
    lifecycle = sys.modules.get("mpsched._lifecycle")
    if lifecycle is not None:  # else no pool was ever made here
        lifecycle.shutdown_all_pools()


# After multiprocessing's own exit hook is registered (the import above), so that it runs after
# this one: it terminates the daemonic children (the zygote, under forkserver and spawn), which
# broke a pool before this hook could drain it.
atexit.register(_at_exit)


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
    "TaskContext",
    "TaskOptions",
    "TaskOutcomeError",
    "TaskPicklingError",
    "TaskState",
    "TaskSubmitter",
    "Wait",
    "WorkerCrashedError",
    "WorkerStatistics",
    "current_task",
    "submit",
)

# Hidden from type checkers (which take TYPE_CHECKING as true): a module-level __getattr__ they
# can see makes every unknown attribute of the package Any to them, so ``from mpsched import
# Pol`` and ``mpsched.curent_task()`` passed mypy --strict. They see the lazy names imported
# above instead.
if not TYPE_CHECKING:

    def __getattr__(name: str) -> object:
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module 'mpsched' has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value

    def __dir__() -> list[str]:
        # The public names and the module's dunders, not the imports and helpers of this file.
        return sorted({name for name in globals() if name.startswith("__")} | set(__all__))
