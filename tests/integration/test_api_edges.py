"""The public API at its edges, as a demanding user drives it: what statistics() adds up to
across crashes, recycling and shutdown; await_termination before and after shutdown, from
several threads; a pool or a future sent to a task; the pool's futures next to the stdlib's
(wait, as_completed, callbacks, the executor-only setters); map's timeout; which ids are one
id (equal ids, NaN); what current_task() says in plain tasks, timed tasks and children."""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import math
import multiprocessing
import os
import pickle
import signal
import threading
import time
from typing import Any

import pytest

import mpsched
from mpsched import Pool, PoolStatistics, TaskPicklingError, TaskState, WorkerCrashedError

from . import api_edge_tasks as at
from . import tasks
from .conditions import Fifos, wait_until

RESULT_TIMEOUT = 20.0  # s; a future of these tests must end within this (a hang fails)
FAR = 3600.0  # s; a run_at this far ahead never comes during a test


def _executed(stats: PoolStatistics) -> int:
    return sum(w.executed for w in stats.per_worker)


# ---------------------------------------------------------------- pools and futures in tasks
def test_a_pool_sent_to_a_task_fails_at_submit_with_a_clear_error() -> None:
    """A task cannot use the pool (it runs in another process): a call that would carry it
    (its bound method, an argument, a submitter, a closure) fails in the caller, saying so."""
    with Pool(1) as pool:
        for submit in (
            lambda: pool.submit(pool.shutdown),
            lambda: pool.submit(tasks.ident, pool),
            lambda: pool.submit(tasks.ident, pool.with_options(timeout=1)),
            lambda: pool.submit(lambda: pool.statistics()),
            lambda: pool.schedule("s", 0.0, 0, pool.cancel, "s"),
        ):
            with pytest.raises(TaskPicklingError, match=r"mpsched\.Pool.*mpsched\.submit"):
                submit()
        with pytest.raises(TaskPicklingError, match=r"mpsched\.Pool"):
            next(pool.map(pool.state, ["s"]))
        with pytest.raises(TypeError, match=r"mpsched\.Pool"):
            pickle.dumps(pool)
        assert pool.state("s") is None  # nothing was scheduled
        assert pool.submit(tasks.ident, 3).result(RESULT_TIMEOUT) == 3  # not poisoned


def test_a_future_sent_to_a_task_fails_at_submit_with_a_clear_error() -> None:
    """A pool's future belongs to the pool's process, pending or done (a done one pickled,
    a pending one failed on whatever it referred to)."""
    with Pool(1, timed_after_shutdown=False) as pool:
        pending = pool.schedule("p", time.monotonic() + FAR, 0, tasks.ident, 1)
        done = pool.submit(tasks.ident, 2)
        done.result(RESULT_TIMEOUT)
        fresh = pool.submit(tasks.ident, 3)
        for future in (pending, done, fresh):
            with pytest.raises(TaskPicklingError, match=r"mpsched\.Future"):
                pool.submit(tasks.ident, future)
            with pytest.raises(TypeError, match=r"mpsched\.Future"):
                pickle.dumps(future)
        assert fresh.result(RESULT_TIMEOUT) == 3
        assert pending.cancel()


# ---------------------------------------------------------------- futures vs the stdlib's
def test_set_running_or_notify_cancel_is_refused() -> None:
    """An executor's method, not a user's: on a pool's future it made the future RUNNING,
    after which cancel() withdrew the task but reported False, and the future never ended
    (result() waited for ever, also after shutdown)."""
    with Pool(1, timed_after_shutdown=False) as pool:
        future = pool.schedule("r", time.monotonic() + FAR, 0, tasks.ident, 1)
        with pytest.raises(RuntimeError, match="set_running_or_notify_cancel"):
            future.set_running_or_notify_cancel()
        assert not future.running()
        assert future.cancel() is True
        with pytest.raises(cf.CancelledError):
            future.result(RESULT_TIMEOUT)
        assert pool.state("r") is TaskState.CANCELLED


