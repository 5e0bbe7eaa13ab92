"""The pool's errors that are ``concurrent.futures``' too: code written for
``ProcessPoolExecutor`` (``except BrokenProcessPool``, ``except BrokenExecutor``) catches them.

Raised by the coordinator's side only (``_coordinator`` and its ``_coord_*`` parts), in the
pool's process, which has ``concurrent.futures`` loaded anyway; a worker loads this module only
to unpickle one (a child task's crash, reported to the worker that joins it). Kept apart from
``_errors`` for the zygote's and the workers' start-up (see there).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from mpsched._errors import MpschedError


@contextlib.contextmanager
def _late_exit_hooks_run() -> Iterator[None]:
    """Around an import of ``concurrent.futures.process``, which registers a threading exit
    hook as it is imported: once the interpreter's exit has run those hooks, that raises
    RuntimeError, and the first ``mpsched.Pool`` used in an atexit handler (imported there)
    failed (leak hunt). A hook registered then runs at once, as it would have at the exit:
    dropped, the module's own (which refuses new work from then on) left a
    ``ProcessPoolExecutor`` of a later handler free to start workers that nothing stopped,
    and the exit hung (diff review)."""
    if not getattr(threading, "_SHUTTING_DOWN", False):
        yield
        return
    register = threading._register_atexit  # type: ignore[attr-defined]
    threading._register_atexit = _run_now  # type: ignore[attr-defined]
    try:
        yield
    finally:
        threading._register_atexit = register  # type: ignore[attr-defined]


def _run_now(hook: Callable[..., object], *args: object, **kwargs: object) -> None:
    hook(*args, **kwargs)


with _late_exit_hooks_run():
    from concurrent.futures.process import BrokenProcessPool


class BrokenPoolError(MpschedError, BrokenProcessPool):
    """The pool cannot be used any more because of an internal failure (see ``__cause__``):
    an initializer that raised, a zygote that died. A ``RuntimeError`` and a
    ``concurrent.futures.process.BrokenProcessPool``, as ``ProcessPoolExecutor`` raises then."""


class WorkerCrashedError(MpschedError, BrokenProcessPool):
    """The worker process running this task died while the task was running.

    Only this task fails: the pool replaces the worker and goes on (where
    ``ProcessPoolExecutor`` fails every pending future with ``BrokenProcessPool``, whose
    subclass this is, so that code written for it catches this too).

    Attributes:
        exitcode: the worker's exit code; negative for a signal (``-9`` is SIGKILL).
    """

    def __init__(self, message: str, exitcode: int | None = None) -> None:
        super().__init__(message)
        self.exitcode = exitcode
