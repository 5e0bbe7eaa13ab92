"""The futures a pool hands out: ``Future`` (coordinator side) and ``ChildFuture`` (in workers).

``Future`` is a ``concurrent.futures.Future``, so ``wait``, ``as_completed`` and callbacks work.
Its ``cancel()`` asks the pool: a task that no worker has claimed is cancelled for certain (it
will never run); once claimed, ``cancel()`` returns False, as for a running stdlib future.
``running()`` stays False: the claim happens in a worker and is not reported (one message per
task would halve throughput).

``ChildFuture`` is returned by ``mpsched.submit`` inside a task. Its state lives in the child's
slab block in shared memory; ``result()`` does not block the worker: it runs other tasks until
the child is done (join-helping), see ``_worker``.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any


class Future(concurrent.futures.Future[Any]):
    """The future of a task submitted to an ``mpsched.Pool``."""

    def __init__(self) -> None:
        super().__init__()
        # Set by the pool; called with no lock held; True if the task was withdrawn for certain.
        self._cancel_hook: Callable[[], bool] | None = None

    def cancel(self) -> bool:
        """Cancel the task if no worker has claimed it yet; then it never runs.

        Returns:
            True if the future is cancelled; False if the task was claimed or has finished.
        """
        if self.done():
            return self.cancelled()
        hook = self._cancel_hook
        if hook is not None and not hook():
            return False
        if not super().cancel():
            return False
        # The task will never run, so notify now: wait() and as_completed() count only
        # CANCELLED_AND_NOTIFIED as done (ProcessPoolExecutor forgets this after
        # shutdown(cancel_futures=True), leaving its waiters blocked).
        self.set_running_or_notify_cancel()
        self._detach()
        return True

    def _detach(self) -> None:
        """Drop the pool reference once the outcome is known (so a done future pins nothing)."""
        self._cancel_hook = None
