"""The mpsched exception hierarchy; every class here is public through ``mpsched``.

The two that are also ``concurrent.futures``' (``BrokenPoolError``, ``WorkerCrashedError``) are
in ``_pool_errors``: this module is the zygote's and the workers', which must not import
``concurrent.futures`` (~15-30 ms of their start-up, for its logging).

Messages say what happened, the likely causes and what to do next. ``timeout_error`` makes the
``TimeoutError`` of a wait or a task out of time, of the class a ``Future`` raises.
"""

from __future__ import annotations

import os
import sys

# Where mpsched's own code lives: a frame of a file elsewhere runs user code (the worker's
# classification of an error, ``_worker._raised_by_user_code``; a shutdown called back inside
# a pool call, ``_lifecycle.interrupted_pool_call``).
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


class MpschedError(Exception):
    """Base class of the errors about the pool, its tasks and their outcomes that mpsched
    raises on its own behalf. Not of those it raises as ``concurrent.futures`` or the
    standard library would: a wait or a task out of time raises ``TimeoutError`` (the class
    a ``Future`` raises), a cancelled future's result ``CancelledError``, a bad argument
    ``TypeError`` or ``ValueError``, and a call where it cannot work (``mpsched.submit``
    outside a task) ``RuntimeError``."""


class SchedulerClosed(MpschedError, RuntimeError):
    """``Scheduler.schedule()`` was called after ``Scheduler.close()``."""


class PoolClosedError(MpschedError, RuntimeError):
    """Work was submitted to a pool that is shutting down or has shut down."""


POOL_CLOSED_MESSAGE = "the pool is shutting down or shut down: it takes no new tasks"
POOL_NOT_PICKLABLE_MESSAGE = (
    "an mpsched.Pool cannot be pickled: it belongs to the process that created it. A task "
    "cannot use the pool; inside a task, use mpsched.submit() for child tasks and return what "
    "the caller should do with the pool"
)


class TaskCancelled(MpschedError):
    """Raised inside a task to acknowledge a cancel request; its future ends cancelled."""


class TaskOutcomeError(MpschedError, RuntimeError):
    """A task ended, but its outcome could not come back as it was: its result or its
    exception did not unpickle in the process that reads it, or its exception did not pickle
    in the worker. The original error, or the worker's traceback, is the cause. A
    ``RuntimeError`` too, as it was before it had a class of its own."""


class InvalidTransition(MpschedError, RuntimeError):
    """A task state change that the state machine forbids (e.g. finishing a stale version)."""


class ProtocolError(MpschedError):
    """Internal: a malformed or unexpected message between processes (mpsched bug)."""


class InternalError(MpschedError):
    """An mpsched bug; the pool's invariants may no longer hold."""


def timeout_error(message: str) -> Exception:
    """The ``TimeoutError`` that a ``concurrent.futures.Future`` raises, for a wait (or a task)
    out of time: the builtin one since Python 3.11, and on 3.10 ``concurrent.futures``' own,
    which is not a subclass of the builtin (a user's ``except concurrent.futures.TimeoutError``
    must catch ours, as it catches a ``Future.result(timeout)``'s)."""
    if sys.version_info >= (3, 11):
        return TimeoutError(message)
    # Imported here: the zygote (which imports this module) must not load concurrent.futures.
    from concurrent.futures import TimeoutError as FuturesTimeoutError

    return FuturesTimeoutError(message)
