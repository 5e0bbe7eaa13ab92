"""Pool: the public process pool; a thin façade over the coordinator, zygote and workers.

Owns the pool's lifecycle (start-up, the coordinator thread, shutdown) and the user-facing calls.
Called from any user thread; every call that changes state goes through the coordinator's lock
or queue and wakes the coordinator loop.

Start-up, in order (the reasons are in docs/design.md):
  1. sweep semaphore names left by a process that died inside the start-up window;
  2. create the memfd segment (no name), the locks (named for now), one wake eventfd per slot,
     and format the segment but for the slab's free stack;
  3. start the zygote through the start method (under fork: a bare fork, see ForkedZygote);
     it opens the locks and maps the segment; meanwhile build the coordinator, mark every
     worker as starting, fill the free stack and start the coordinator thread (it waits);
  4. on READY, unlink every lock name (from here on nothing of the pool has a name), let the
     coordinator thread go and return: the workers are not waited for;
  5. the zygote forks the workers (listed in its config: no SPAWN message each); the
     coordinator thread registers each as its SPAWNED comes. A task submitted before may wait
     in a starting worker's inbox.

Lifecycle: RUNNING -> DRAINING (shutdown called: no new work; the coordinator drains) ->
CLOSED (workers and zygote gone, resources released). ``shutdown`` is idempotent and may be
called from several threads; only the first starts the drain, every caller with ``wait=True``
waits for its end. A pool nobody references any more is collected and ends like
``shutdown(wait=False)``; what it owns lives in ``_lifecycle.PoolResources``, which the
coordinator thread releases (docs/design.md, "Lifecycle").
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import functools
import itertools
import math
import multiprocessing
import os
import pickle
import sys
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from mpsched._chunks import run_chunk
from mpsched._coordinator import Coordinator
from mpsched._errors import POOL_CLOSED_MESSAGE, PoolClosedError
from mpsched._future import Future
from mpsched._layout import SegmentLayout, SegmentLocks, SegmentViews, attach, create_locks
from mpsched._lifecycle import (
    PoolResources,
    coordinator_fds,
    disown_all,
    join_dropped,
    run_coordinator,
)
from mpsched._options import TaskOptions, check_seconds
from mpsched._protocol import PICKLE_PROTOCOL, load_exception
from mpsched._scheduler import check_priority, check_run_at, check_task_id
from mpsched._serialize import FunctionCache, dumps, portable
from mpsched._shm import AnonSegment, SharedFd, create_eventfd, sweep_stale_names
from mpsched._task import TaskState
from mpsched._timed import Recurrence, TaskRun
from mpsched._wakeup import Wakeup
from mpsched._worker import WorkerOptions
from mpsched._zygote import ZYGOTE_NAME, ForkedZygote, ZygoteConfig, zygote_main

DISPATCH_WINDOW = 128  # tasks per worker inbox; larger = fewer wake-ups, longer cancel window
DISPATCH_WINDOW_MAX = 4096  # the inbox ring is sized for the window
INFLIGHT_PER_WORKER = 4 * DISPATCH_WINDOW  # dispatched-unfinished tasks, per worker
BLOCKS_PER_WORKER = 2048  # slab blocks per worker: in-flight tasks plus their children
DEQUE_CAPACITY = 1024  # children queued per worker before they run inline
STARTUP_TIMEOUT = 60.0  # seconds for the zygote to come up (spawn imports the main module)
# Pool.map's default chunking (docs/design.md, "Pool.map").
MAP_TARGET_CHUNK_SECONDS = 0.002  # map: aim for chunks of about this much work
# Items per chunk, at most. A chunk costs ~0.3 ms of hand-offs (inject, wake, poke, collect)
# whatever its size: 20,000 no-ops took 7.3 ms at 4096 and 9.0 ms at 1024 (medians of 9).
MAP_MAX_CHUNK = 4096
# Pickled bytes per chunk, about. 20,000 strings of 1 KB: 64 ms in 512 KiB chunks, 71 ms in
# 1 MiB, 128 ms in 4 MiB (the stash through the coordinator's socket) and 134 ms in 128 KiB
# (hand-offs); medians of 5, interleaved.
MAP_CHUNK_BYTES = 512 * 1024
MAP_SAMPLE_ITEMS = 8  # items of the first chunk pickled to estimate bytes per item
MAP_PREFETCH_PER_WORKER = 4  # chunks in flight per worker (bounded read-ahead of lazy input)
MAP_GROWTH = 64  # chunks grow at most this much per measured chunk
MAP_FIRST_CHUNK = 64  # items per chunk before any chunk was measured (bounded by the budget)
# A default-sized chunk stops after about this much work (s) and map sends the rest of its
# items again: a first guess or a mis-measured chunk of slow items costs at most this much
# imbalance. 5x the target, so that a chunk sized by the target does not stop early.
MAP_CHUNK_BUDGET = 0.01

_INF = float("inf")
_MAX_SEGMENT_BYTES = 1 << 63  # off_t: ftruncate's limit
_NO_COUNTERS = {"executed": 0, "stolen": 0}

# Pools started and not released. Weak: a dropped pool is collected, and then ends by itself
# (docs/design.md, "Lifecycle"); its resources stay in _lifecycle's registry until released.
_live_pools: weakref.WeakSet[Pool] = weakref.WeakSet()


@dataclass(frozen=True)
class WorkerStatistics:
    """One worker slot's counters (``PoolStatistics.per_worker``).

    ``executed`` counts the tasks that ran to their end in this slot: top-level tasks (a
    ``map`` chunk is one) and children, wherever they were spawned; a run its worker died in is
    not counted. ``stolen``: tasks it took from a peer's queues. Both add up over every worker
    that ran in the slot (a replacement after a crash or a recycling goes on counting). A run
    is counted just before its result is published, so a snapshot taken after a future is
    done counts its run (a worker that dies in between counts a run whose task then fails).
    ``pid`` is 0 while the slot's worker is starting and after the pool ended.
    """

    slot: int
    pid: int
    executed: int
    stolen: int
    inbox_depth: int
    deque_depth: int


@dataclass(frozen=True)
class PoolStatistics:
    """A snapshot of the pool's counters (racy reads of shared counters: hints).

    ``submitted`` counts the top-level tasks the pool took: each ``submit`` and ``schedule``
    (a superseded or cancelled one too), each chunk of a ``map`` and each run of a recurring
    task. ``completed`` counts the runs a worker ended (returned or raised; a retried task
    once), so ``completed <= submitted``; children are in ``per_worker[k].executed`` only.
    """

    workers: int
    submitted: int  # top-level tasks taken (see above)
    completed: int  # top-level runs that ended in a worker
    pending: int  # due, not yet handed to a worker
    scheduled: int  # versions waiting for their run_at (or behind a running version)
    steals: int
    crashes: int
    respawns: int
    retried: int  # runs started again after their worker died (the retries option)
    recycled: int  # workers replaced after max_tasks_per_worker tasks
    misfires: int  # recurring runs skipped by the misfire policy
    skipped_runs: int  # recurring due times dropped by the overlap policy "skip"/"coalesce"
    per_worker: tuple[WorkerStatistics, ...]


def _default_start_method() -> str:
    return "forkserver" if sys.platform.startswith("linux") else "spawn"


class Pool:
    """A pool of worker processes with work stealing and nested tasks.

    Args:
        workers: number of worker processes (default ``os.cpu_count()``).
        start_method: ``"forkserver"`` (default on Linux), ``"spawn"`` or ``"fork"``: how the
            pool's zygote process starts; workers are forked from the zygote.
        dispatch_window: tasks handed ahead to each worker's inbox (default 128). A newly due
            task of a *higher* priority never waits behind them (the coordinator takes lower
            ones back); one of equal priority waits behind at most this many per worker. A
            smaller window makes ``cancel`` and order reach more tasks in the coordinator; a
            larger one keeps workers fed with tiny tasks.
        aging: None (default: strict priority) or seconds: a due task that has waited this long
            gains one priority level, and one more per further period, so that low priorities
            cannot starve.
        timed_after_shutdown: whether timed one-shot tasks still pending at ``shutdown`` run
            when due (default True, as Java's ScheduledThreadPoolExecutor); False cancels them.
        recurring_after_shutdown: whether recurring tasks go on after ``shutdown`` (default
            False: they stop and their futures are cancelled). If True, ``shutdown(wait=True)``
            returns only once they are cancelled (``cancel_futures=True`` cancels them).
        max_tasks_per_worker: None (default) or a positive int: a worker that has run this many
            tasks (children not counted) exits cleanly and is replaced; what waits in its queues
            stays in shared memory for the successor.
        initializer, initargs: ``initializer(*initargs)`` runs once in each worker (and each
            replacement) before it takes a task. If it raises, the pool breaks: every future and
            later ``submit`` fail with ``BrokenPoolError``, whose cause is the initializer's
            exception (no respawn loop).

    A pool that is neither shut down nor used in a ``with`` block, once nothing references it,
    is garbage-collected and shut down like ``shutdown(wait=False)``: its pending tasks still
    run and their futures resolve, then its processes exit. (A done-callback that refers to
    the pool keeps it alive until its future is done and dropped.)
    """

    # Aliases of what self._resources holds (set once at start-up; the hot paths read them
    # here). Nothing the coordinator thread reaches may reference the Pool: see _lifecycle.
    _resources: PoolResources
    _coordinator: Coordinator
    _thread: threading.Thread
    _views: SegmentViews
    _functions: FunctionCache
    _wakeup: Wakeup

    def __init__(
        self,
        workers: int | None = None,
        *,
        start_method: str | None = None,
        dispatch_window: int = DISPATCH_WINDOW,
        aging: float | None = None,
        timed_after_shutdown: bool = True,
        recurring_after_shutdown: bool = False,
        max_tasks_per_worker: int | None = None,
        initializer: Callable[..., Any] | None = None,
        initargs: tuple[Any, ...] = (),
    ) -> None:
        if workers is None:
            workers = os.cpu_count() or 1
        if isinstance(workers, bool) or not isinstance(workers, int):
            raise TypeError(f"workers must be an int, not {type(workers).__name__}")
        if workers < 1:
            raise ValueError(f"workers must be at least 1, not {workers}")
        given: object = start_method  # typed str | None; a caller may pass anything
        if given is not None and not isinstance(given, str):
            raise TypeError(f"start_method must be a str or None, not {type(given).__name__}")
        method = _default_start_method() if start_method is None else start_method
        if method not in multiprocessing.get_all_start_methods():
            raise ValueError(
                f"start_method must be one of {multiprocessing.get_all_start_methods()}, "
                f"not {method!r}"
            )
        if isinstance(dispatch_window, bool) or not isinstance(dispatch_window, int):
            raise TypeError(f"dispatch_window must be an int, not {type(dispatch_window).__name__}")
        if not 1 <= dispatch_window <= DISPATCH_WINDOW_MAX:
            raise ValueError(f"dispatch_window must be in 1..{DISPATCH_WINDOW_MAX}")
        # A finite positive number of seconds, checked under its own name (the error named
        # "timeout" when this borrowed TaskOptions' check).
        check_seconds("aging", aging, allow_none=True, positive=True)
        if max_tasks_per_worker is not None and (
            isinstance(max_tasks_per_worker, bool)
            or not isinstance(max_tasks_per_worker, int)
            or max_tasks_per_worker < 1
        ):
            raise ValueError(
                f"max_tasks_per_worker must be a positive int or None, not {max_tasks_per_worker!r}"
            )
        if initializer is not None and not callable(initializer):
            raise TypeError(f"initializer must be callable, not {type(initializer).__name__}")
        try:  # a tuple, or another iterable of the arguments (the stdlib's pools take any)
            args = tuple(initargs)
        except TypeError:
            raise TypeError(
                f"initargs must be a tuple of the initializer's arguments, "
                f"not {type(initargs).__name__}"
            ) from None
        self._worker_options = WorkerOptions(
            max_tasks=max_tasks_per_worker or 0,
            initializer=b"" if initializer is None else dumps((portable(initializer), args)),
        )
        self._workers = workers
        self._start_method = method
        self._window = dispatch_window
        self._aging = None if aging is None else float(aging)
        self._timed_after_shutdown = bool(timed_after_shutdown)
        self._recurring_after_shutdown = bool(recurring_after_shutdown)
        self._shutdown_lock = threading.Lock()
        self._closed = False
        self._closed_message = POOL_CLOSED_MESSAGE  # another one in a forked child
        self._started = False
        self._start()

    # ------------------------------------------------------------------ start-up
    def _start(self) -> None:
        sweep_stale_names()
        n = self._workers
        layout = SegmentLayout(
            n_slots=n,
            deque_capacity=DEQUE_CAPACITY,
            inbox_capacity=_pow2(self._window),
            done_capacity=_pow2(max(INFLIGHT_PER_WORKER, 4 * self._window) * n),
            block_count=BLOCKS_PER_WORKER * n,
        )
        if layout.total_bytes >= _MAX_SEGMENT_BYTES:  # else an OverflowError deep in ftruncate
            raise ValueError(
                f"workers={n} is too many: the pool's shared memory would take "
                f"{layout.total_bytes:.3e} bytes"
            )
        segment = AnonSegment.create(layout.total_bytes)
        self._wakeup = Wakeup()
        res = self._resources = PoolResources(segment, self._wakeup)
        locks = create_locks(n)
        try:
            res.wake_fds = [SharedFd(create_eventfd()) for _ in range(n)]
            # The stall callback is the resources' (not a method of the Pool: the locks are
            # the coordinator's, and nothing it reaches may keep the Pool alive).
            guarded = locks.guarded(res.on_lock_stall)
            # Format the segment, which the zygote checks when it attaches; the bulk of it,
            # the slab's free stack, is filled below while the zygote starts up.
            self._views = attach(segment, layout, guarded, init=True, fill_slab=False)
            zygote_conn = self._start_zygote(layout, locks)
            # While the zygote starts up: build the coordinator, mark every worker as starting
            # (the zygote forks them after READY), fill the free stack (no block is allocated
            # before Pool() returns) and start the coordinator thread (it waits for go). None
            # of it is then on the path to the first result.
            self._functions = res.functions = FunctionCache(self._views.functions.add)
            self._coordinator = res.coordinator = Coordinator(
                self._views,
                res.wake_fds,
                zygote_conn,
                self._wakeup.fileno(),
                self._wakeup.wakeup,
                self._wakeup.clear,
                n,
                self._window,
                max(INFLIGHT_PER_WORKER, 4 * self._window) * n,
                locks=guarded,
                aging=self._aging,
                timed_after_shutdown=self._timed_after_shutdown,
                recurring_after_shutdown=self._recurring_after_shutdown,
                wakeup_nowait=self._wakeup.wakeup_nowait,
                has_initializer=bool(self._worker_options.initializer),
            )
            self._coordinator.mark_all_starting()
            self._views.slab.fill_free_stack()
            self._thread = res.thread = threading.Thread(
                target=run_coordinator, args=(res,), name="mpsched-coordinator", daemon=True
            )
            self._thread.start()
            # READY: the zygote opened the locks, so their names can go. The workers are not
            # waited for: a first task waits in a starting worker's inbox (see dispatch_one).
            self._coordinator.wait_ready(STARTUP_TIMEOUT)
        except BaseException:
            self._abort_start()
            raise
        finally:
            locks.unlink_names()  # from here on, nothing of the pool has a name
        self._coordinator.go.set()
        self._coordinator_pid = os.getpid()
        self._started = True
        _live_pools.add(self)
        res.watch(self)

    def _abort_start(self) -> None:
        """Start-up failed: end the waiting coordinator thread, then undo the rest."""
        res = self._resources
        if res.coordinator is not None:
            res.coordinator.start_aborted = True
            res.coordinator.go.set()
        if res.thread is not None and res.thread.ident is not None:
            res.thread.join()
        res.teardown()

    @property
    def _zygote(self) -> Any:
        """The zygote's Process (or ForkedZygote): tests signal it and read its pid."""
        return self._resources.zygote

    def _start_zygote(self, layout: SegmentLayout, locks: SegmentLocks) -> Connection:
        ctx: Any = multiprocessing.get_context(self._start_method)
        parent_conn: Connection
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        res = self._resources
        res.zygote_conn = parent_conn
        coordinator_fds.add(parent_conn.fileno())
        fork = self._start_method == "fork"
        cfg = ZygoteConfig(
            conn=child_conn,
            segment=res.segment,
            layout=layout,
            locks=locks,
            wake_fds=res.wake_fds,
            coordinator_pid=os.getpid(),
            worker_options=self._worker_options,
            close_fds=sorted(coordinator_fds) if fork else [],
            initial_slots=list(range(self._workers)),
            # Under fork the zygote inherits the workers' views: attaching here costs ~0.1 ms,
            # in the zygote (copy-on-write faults after the fork) ~0.7 ms on the start-up path.
            views=attach(res.segment, layout, locks) if fork else None,
        )
        try:
            if fork:  # a bare fork, lighter than a Process (see ForkedZygote)
                res.zygote = ForkedZygote(cfg)
            else:
                res.zygote = ctx.Process(
                    target=zygote_main, args=(cfg,), name=ZYGOTE_NAME, daemon=True
                )
                res.zygote.start()
        finally:
            child_conn.close()
        return parent_conn

    # ------------------------------------------------------------------ submitting
    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        """Run ``fn(*args, **kwargs)`` in a worker; returns its future.

        The call is pickled here, so an unpicklable function or argument raises at once.

        Raises:
            PoolClosedError: the pool is shutting down or shut down.
            TaskPicklingError: the function or an argument cannot be pickled.
        """
        return self._submit(None, fn, args, kwargs)

    def _submit(
        self,
        options: TaskOptions | None,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Future:
        if not callable(fn):
            raise TypeError(f"fn must be callable, not {type(fn).__name__}")
        if self._closed:  # early, before pickling; the coordinator decides under its lock
            raise PoolClosedError(self._closed_message)
        payload = self._functions.encode(fn, args, kwargs)
        future = Future(self._coordinator, payload)
        if options is not None and not options.is_plain:
            future._run = TaskRun(options)
        if self._coordinator.submit(future):
            self._wakeup.wakeup()
        return future

    def schedule(
        self,
        task_id: Hashable,
        run_at: float,
        priority: int,
        fn: Callable[..., Any],
        /,
        *args: Any,
        **kwargs: Any,
    ) -> Future:
        """Run ``fn(*args, **kwargs)`` as version of ``task_id`` due at ``run_at``.

        ``run_at`` is an absolute ``time.monotonic()`` time (in the past: due at once). Among
        due tasks, the higher ``priority`` starts first, then the earlier ``run_at``, then
        the earlier call. Scheduling an id again supersedes its previous version: one that has
        not started is cancelled (its future too) and never runs; one that runs is not
        interrupted, and the new version starts only after it ended.

        Ids are matched as dict keys: equal ids are one id (``1``, ``1.0`` and ``True``;
        ``0.0`` and ``-0.0``), and an id not equal to itself (``float('nan')``) is found by
        ``state``, ``cancel`` and a later ``schedule`` only through the very same object.

        Raises:
            PoolClosedError: the pool is shutting down or shut down.
            TypeError: unhashable or unpicklable ``task_id``, non-real ``run_at``, non-int
                ``priority``, non-callable ``fn``.
            ValueError: ``run_at`` is NaN or infinite.
            TaskPicklingError: the function or an argument cannot be pickled.
        """
        return self._schedule(None, task_id, run_at, priority, fn, args, kwargs)

    def _schedule(
        self,
        options: TaskOptions | None,
        task_id: Hashable,
        run_at: float,
        priority: int,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Future:
        if type(run_at) is not float or not -_INF < run_at < _INF:  # fast path: finite float
            run_at = check_run_at(run_at)
        if type(priority) is not int:
            priority = check_priority(priority)
        if not callable(fn):
            raise TypeError(f"fn must be callable, not {type(fn).__name__}")
        try:
            hash(task_id)  # here, not under the coordinator's lock
        except Exception as exc:
            raise TypeError(f"task_id must be hashable and picklable: {exc!r}") from exc
        if self._closed:  # early, before pickling; the coordinator decides under its lock
            raise PoolClosedError(self._closed_message)
        coordinator = self._coordinator
        call = self._functions.encode(fn, args, kwargs, (task_id,))
        future = Future(coordinator, call, priority)
        recurrence = None
        if options is not None and not options.is_plain:
            grid_start = run_at
            if options.every is not None:
                recurrence = Recurrence(
                    task_id,
                    priority,
                    call,
                    options,
                    functools.partial(coordinator.cancel_id, task_id, False),
                )
                # Due in the past is due at once: the grid (and the first run's misfire grace)
                # starts now. From the run_at given, the time since then was a backlog of due
                # times that never passed during a run: "queue" ran all of them back to back,
                # "coalesce" once more, "skip" counted them, and a misfire policy "skip"
                # dropped the first run.
                grid_start = max(run_at, time.monotonic())
            future._run = TaskRun(options, recurrence, grid_start)
        if coordinator.schedule(task_id, run_at, priority, future, recurrence):
            self._wakeup.wakeup()
        return future if recurrence is None else recurrence.future

    def with_options(self, options: TaskOptions | None = None, /, **fields: Any) -> TaskSubmitter:
        """A submitter whose ``submit``/``schedule`` run tasks with these options.

        Options are not arguments of ``fn``, so they travel here rather than as keywords of
        ``submit``, where they would collide with ``fn``'s own::

            pool.with_options(timeout=5, retries=2).submit(fn, x, timeout=30)  # fn gets 30
            pool.with_options(every=1.0, overlap="skip").schedule("tick", t0, 0, poll)

        Takes a ``TaskOptions`` or its fields (fields override the given options).
        """
        if options is None:
            options = TaskOptions(**fields)
        elif not isinstance(options, TaskOptions):  # before replace(), whose error says less
            raise TypeError(f"options must be a TaskOptions, not {type(options).__name__}")
        elif fields:
            options = dataclasses.replace(options, **fields)
        return TaskSubmitter(self, options)

    def cancel(self, task_id: Hashable, *, force: bool = False) -> bool:
        """Cancel ``task_id``: a version that has not started never runs (its future is
        cancelled; this holds even for one already handed to a worker's queue); a recurrence
        stops; a running version is asked to stop (``current_task().cancel_requested``), or,
        with ``force``, its worker is killed (and replaced) and its future is cancelled.

        Returns:
            True if a version was cancelled or asked to stop; False for an id with nothing
            pending or running.
        """
        try:  # no check before: in 3.11 a try costs nothing until it catches
            return self._coordinator.cancel_id(task_id, force)
        except TypeError:
            check_task_id(task_id)  # unhashable: say so, as state() does
            raise

    def state(self, task_id: Hashable) -> TaskState | None:
        """The state of the latest version of ``task_id``: PENDING until a worker claims it,
        RUNNING, then COMPLETED, FAILED or CANCELLED; None for an unknown id (ids that ended
        are forgotten after the 100,000 more recent ones)."""
        check_task_id(task_id)
        return self._coordinator.state(task_id)

    def map(
        self,
        fn: Callable[..., Any],
        *iterables: Iterable[Any],
        chunksize: int | None = None,
        timeout: float | None = None,
    ) -> Iterator[Any]:
        """Like ``map(fn, *iterables)``, run in the pool; results in input order.

        The input is read lazily, at most a few chunks per worker ahead of the results.
        ``chunksize=None`` adapts: chunks of 64 items first, then chunks of about 2 ms of
        work each (at most 4096 items); every chunk holds about 512 KiB pickled at most (but
        for the first, which holds the first 8 items); a chunk that runs longer than 10 ms
        stops, and the rest of its items go again.

        Raises:
            TypeError: no iterable (as the builtin ``map``); ``fn`` is not callable;
                ``timeout`` is not a number (a bool is not) or None.
            ValueError: ``chunksize`` is not a positive int (a bool is not) or None;
                ``timeout`` is NaN.
            PoolClosedError: the pool is shutting down or shut down (from the iterator too,
                where a chunk could not be sent, after the results of those sent before).
            TimeoutError: from the iterator, if a result is not ready ``timeout`` seconds
                after this call (infinite: no limit; zero or negative: at once).
            Exception: from the iterator, in input order (after the results before it, as the
                builtin ``map``): an item's error, an input iterable's (an Exception), or
                the error of submitting a chunk (TaskPicklingError: an item does not pickle;
                the results of its chunk's other items are lost with it).
        """
        if not iterables:  # as the builtin map: at the call, not at the first next()
            raise TypeError("Pool.map() needs at least one iterable")
        if chunksize is not None and (
            isinstance(chunksize, bool) or not isinstance(chunksize, int) or chunksize < 1
        ):
            raise ValueError(f"chunksize must be a positive int or None, not {chunksize!r}")
        if not callable(fn):  # as submit: at the call, not from the first chunk
            raise TypeError(f"fn must be callable, not {type(fn).__name__}")
        if timeout is not None:
            timeout = _wait_timeout(timeout)
        if self._closed:
            raise PoolClosedError(self._closed_message)
        deadline = None if timeout is None else time.monotonic() + timeout
        if len(iterables) == 1:  # the items go as they are (see _chunks)
            return self._map(fn, iter(iterables[0]), False, chunksize, deadline)
        return self._map(fn, zip(*iterables, strict=False), True, chunksize, deadline)

    def _map(
        self,
        fn: Callable[..., Any],
        items: Iterator[Any],
        star: bool,
        chunksize: int | None,
        deadline: float | None,
    ) -> Iterator[Any]:
        # In input order: each chunk's future and its items (a chunk that stopped at its budget
        # leaves the rest of its items to go again, before every later chunk's results).
        in_flight: collections.deque[tuple[Future, list[Any]]] = collections.deque()
        # islice takes at most sys.maxsize: a bigger chunksize means the same (one chunk).
        size = min(chunksize, sys.maxsize) if chunksize else MAP_FIRST_CHUNK
        budget = _INF if chunksize else MAP_CHUNK_BUDGET
        per_item = None
        cap = 0  # largest default chunk, from the first chunk's bytes per item; 0: not yet
        limit = MAP_PREFETCH_PER_WORKER * self._workers
        exhausted = False
        # fn travels in each chunk's arguments, not through the function table: a __main__
        # function needs its copy by value there too (see _serialize.portable).
        fn = portable(fn)

        def send(piece: list[Any]) -> tuple[Future, bool]:
            # An error met ahead of the results (the input's, a submit's: an item that does
            # not pickle, the pool shut down) takes the place of its items: the results before
            # it come first, as with the builtin map (and ProcessPoolExecutor.map).
            try:
                return self.submit(run_chunk, fn, piece, star, budget), True
            except Exception as exc:  # a BaseException (Ctrl-C) goes on at once
                return _failed(exc), False

        try:
            while True:
                while not exhausted and len(in_flight) < limit:
                    chunk: list[Any] = []
                    try:
                        if not cap and chunksize is None:
                            # The bytes per item bound every chunk from the first on: big
                            # items read 64 to a chunk made a read-ahead of 64 items per
                            # chunk in flight (512 MB of 1 MB items) before the first result.
                            chunk.extend(itertools.islice(items, MAP_SAMPLE_ITEMS))
                            if chunk:
                                cap = _max_chunk(chunk)
                                size = min(size, cap)
                        # keeps what came before an error of the input
                        chunk.extend(itertools.islice(items, max(0, size - len(chunk))))
                    except Exception as exc:
                        if chunk:
                            in_flight.append((send(chunk)[0], chunk))
                        in_flight.append((_failed(exc), []))
                        exhausted = True
                        break
                    if not chunk:
                        exhausted = True
                        break
                    future, sent = send(chunk)
                    in_flight.append((future, chunk))
                    exhausted = not sent  # failed to go: nothing after it is read
                if not in_flight:
                    return
                future, chunk = in_flight.popleft()
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    results, seconds, error = future.result(remaining)
                except BaseException:
                    # Popped from in_flight, so the finally below does not see it: on a
                    # timeout (or a Ctrl-C) its chunk may still be unclaimed, and an abandoned
                    # map must not run it (the stdlib's gh-95166). A no-op if it failed.
                    future.cancel()
                    raise
                if error is not None:  # an item raised after these: they come first (_chunks)
                    del chunk
                    yield from results
                    raise load_exception(error)
                if chunksize is None:
                    sample = seconds / len(results)
                    per_item = sample if per_item is None else 0.5 * per_item + 0.5 * sample
                    size = _next_chunksize(per_item, len(results), cap)
                done = len(results)
                if done < len(chunk):  # stopped at its budget: the rest goes again, first
                    rest = chunk[done:]
                    pieces = [rest[i : i + size] for i in range(0, len(rest), size)]
                    for piece in reversed(pieces):
                        in_flight.appendleft((send(piece)[0], piece))
                del chunk
                yield from results
        except GeneratorExit:
            # close(): by the caller, or by the garbage collector finalizing the generator,
            # which may run inside any allocation, also while this thread holds a lock that
            # future.cancel() takes (Coordinator.lock, the futures' module lock, a slot lock):
            # cancelling here would wait for this thread forever. The coordinator thread
            # cancels them instead, on its next pass (docs/design.md, Pool.map).
            self._coordinator.cancel_later([future for future, _ in in_flight])
            in_flight.clear()
            raise
        finally:
            # The map's own error, timeout or Ctrl-C, raised in this frame (every lock taken
            # below it was released on the way out): cancel at once.
            for future, _ in in_flight:
                future.cancel()

    # ------------------------------------------------------------------ shutdown
    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Refuse new work, let what was submitted finish (or cancel what no worker has
        claimed, with ``cancel_futures``), then stop the workers. A second call is a no-op,
        except that ``wait=True`` waits for the end, including the done-callbacks of the
        futures the pool settled (docs/design.md, "Where done-callbacks run"). Called from such
        a callback, it waits for the end but not for the callbacks that come after it in the
        pool's callback thread (they would wait for it)."""
        self._closed = True  # the fast early check; the coordinator's draining flag decides
        if self._started:
            self._coordinator.begin_shutdown(cancel_futures)
            self._wakeup.wakeup()
            # Not from the coordinator thread (no done-callback runs there, but a finalizer
            # may): it would wait for its own end, forever.
            if wait and threading.get_ident() != self._coordinator.thread_id:
                try:
                    self.await_termination()
                except BaseException as exc:
                    # Ctrl-C (a non-Exception) while waiting for the drain means "stop now",
                    # as when it leaves a ``with`` block: cancel what has not started and kill
                    # the workers running tasks. Else the interpreter's exit (the atexit hook,
                    # or __exit__ after this) would wait for every running task to end.
                    if not isinstance(exc, Exception) and not self._coordinator.finished.is_set():
                        self._coordinator.begin_shutdown(True)
                        self._coordinator.abort_running()
                    raise

    def await_termination(self, timeout: float | None = None) -> bool:
        """Wait until all work is done, the workers are gone and the done-callbacks of the
        futures the pool settled were called (from one of those, not the ones after it);
        False on timeout. It does not shut the pool down: called before ``shutdown``, it waits
        for a shutdown from another thread (or returns False at the timeout; ``timeout=0``
        polls). Several threads may wait at once; after a broken pool ended, True.

        Raises:
            TypeError: ``timeout`` is not a number (a bool is not) or None.
            ValueError: ``timeout`` is NaN. (Infinite: no limit, as None.)
        """
        if timeout is not None:
            timeout = _wait_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._started:
            if not self._coordinator.finished.wait(timeout):
                return False
            with self._shutdown_lock:
                self._release()
        # After the release too (a second caller finds the pool released): the runner is
        # closed once ``finished`` is set, so this join ends with its last callback.
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self._coordinator.callbacks.join(left)

    def _release(self) -> None:
        """After the coordinator's loop ended: let its thread reap the zygote and free every
        resource (PoolResources.teardown), and wait for that."""
        if not self._started:
            return
        # The last look at the slots' counters: the loop has ended, so they are final. A worker
        # that died in the drain sent no DRAINED (and one recycled or crashed before counted
        # in its slot, which its successor goes on from): its slot kept what it ran.
        final = self._coordinator.final_stats
        for k, slot in enumerate(self._views.slots):
            final[k] = slot.counters()
        self._resources.request_release()
        self._thread.join()
        # Cleared only now (statistics() reads no shared memory from here on; it takes the
        # lock, as we hold it): shutdown() and await_termination() read it without the lock,
        # and cleared before the join, a shutdown(wait=True) racing this one returned while
        # the teardown was still going on (tests/stress/test_lifecycle_races.py).
        self._started = False
        _live_pools.discard(self)

    def statistics(self) -> PoolStatistics:
        """A snapshot of the counters (racy reads while the pool runs: hints).

        A slot's ``executed`` and ``stolen`` count every worker that ever ran in it: a worker
        that crashed or was recycled keeps its counts, and its replacement adds to them. After
        ``shutdown`` (once ``await_termination`` returned True), the final counters: queue
        depths and pids read 0 then."""
        with self._shutdown_lock:  # the memory is not released while we read it
            return self._statistics()

    def _statistics(self) -> PoolStatistics:
        coord = self._coordinator
        live = self._started
        with coord.lock:
            pending = coord.ready.live()
        per_worker = []
        for k, slot in enumerate(self._views.slots):
            counters = coord.final_stats.get(k) or (slot.counters() if live else _NO_COUNTERS)
            worker = coord.workers[k]
            deque_, inbox = slot.depths() if live else (0, 0)
            per_worker.append(
                WorkerStatistics(
                    slot=k,
                    pid=worker.pid if worker is not None else 0,
                    executed=counters["executed"],
                    stolen=counters["stolen"],
                    inbox_depth=inbox,
                    deque_depth=deque_,
                )
            )
        return PoolStatistics(
            workers=self._workers,
            submitted=coord.submitted,
            completed=coord.completed,
            pending=pending,
            scheduled=len(coord.timetable.heap),
            steals=sum(w.stolen for w in per_worker),
            crashes=coord.crashes,
            respawns=coord.respawns,
            retried=coord.retried,
            recycled=coord.recycled,
            misfires=coord.misfires,
            skipped_runs=coord.skipped_runs,
            per_worker=tuple(per_worker),
        )

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        # Leaving on Ctrl-C (or another non-Exception interrupt) means "stop now": what no
        # worker has claimed is cancelled, and running tasks are stopped too (their workers are
        # killed, as by cancel(force=True); their futures end cancelled), so that the exit
        # cannot wait on a long task. Workers ignore SIGINT, so none prints a traceback.
        interrupted = exc_type is not None and not issubclass(exc_type, Exception)
        if interrupted and self._started:
            self.shutdown(wait=False, cancel_futures=True)
            self._coordinator.abort_running()
        self.shutdown(wait=True, cancel_futures=interrupted)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running"
        return f"<mpsched.Pool {state} workers={self._workers} start_method={self._start_method}>"

    def __reduce__(self) -> Any:
        # What a task would get is a copy of the object in another process, without the
        # coordinator, its thread or its memory: say so at submit (the TaskPicklingError then
        # names this), rather than fail on whichever lock the pickler meets first.
        raise TypeError(
            "an mpsched.Pool cannot be pickled: it belongs to the process that created it. A "
            "task cannot use the pool; inside a task, use mpsched.submit() for child tasks and "
            "return what the caller should do with the pool"
        )


class TaskSubmitter:
    """``pool.with_options(...)``: ``submit`` and ``schedule`` with fixed task options."""

    __slots__ = ("_options", "_pool")

    def __init__(self, pool: Pool, options: TaskOptions) -> None:
        self._pool = pool
        self._options = options

    @property
    def options(self) -> TaskOptions:
        return self._options

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        """``Pool.submit`` with these options (a recurrence needs an id: use ``schedule``)."""
        if self._options.every is not None:
            raise ValueError("a recurring task needs a task id: use schedule(), not submit()")
        return self._pool._submit(self._options, fn, args, kwargs)

    def schedule(
        self,
        task_id: Hashable,
        run_at: float,
        priority: int,
        fn: Callable[..., Any],
        /,
        *args: Any,
        **kwargs: Any,
    ) -> Future:
        """``Pool.schedule`` with these options. With ``every``, the task recurs, and the
        returned future ends only when the recurrence does: cancelled by ``cancel``/shutdown,
        or with the error of a run that raised (later runs do not happen then)."""
        return self._pool._schedule(self._options, task_id, run_at, priority, fn, args, kwargs)


def _wait_timeout(timeout: object) -> float | None:
    """A caller's ``timeout`` (not None) for a wait: TypeError if not a number (a bool is not),
    ValueError if NaN; infinite is None (no limit: a wait that long overflows the clock). Zero
    or negative stays: the wait times out at once, as the stdlib's waits do."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds or None, not {timeout!r}")
    if math.isnan(timeout):
        raise ValueError("timeout must be a number of seconds or None, not nan")
    return None if timeout == _INF else float(timeout)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _next_chunksize(per_item: float, measured: int, cap: int) -> int:
    """Items in the next default chunk, from the mean ``per_item`` seconds and the items of the
    last measured chunk; at most ``cap`` (``_max_chunk``)."""
    target = int(MAP_TARGET_CHUNK_SECONDS / per_item) if per_item > 0 else cap
    # Bounded growth, so one mis-measured fast chunk cannot make a huge slow one; 64x reaches
    # the largest chunk from the first one in one result, so a map of tiny tasks ramps up fast.
    return max(1, min(target, MAP_GROWTH * measured, cap))


def _failed(error: Exception) -> Future:
    """A future that failed with ``error``: an error in ``Pool.map``'s input order."""
    future = Future()
    future.set_exception(error)
    return future


def _max_chunk(chunk: list[Any]) -> int:
    """The largest default chunk for items like the first few of ``chunk``: at most
    ``MAP_MAX_CHUNK`` items and about ``MAP_CHUNK_BYTES`` pickled."""
    sample = chunk[:MAP_SAMPLE_ITEMS]
    try:
        nbytes = len(pickle.dumps(sample, PICKLE_PROTOCOL))
    except Exception:  # submit says why, with cloudpickle's help; size by count meanwhile
        return MAP_MAX_CHUNK
    return max(1, min(MAP_MAX_CHUNK, MAP_CHUNK_BYTES * len(sample) // max(1, nbytes)))


FORKED_CHILD_MESSAGE = (
    "this pool belongs to the process that created it (pid {pid}); this process is a child of "
    "os.fork() and cannot use it: create a new Pool here"
)


def _disown_pools_in_forked_child() -> None:
    """``os.fork()`` (by user code, or a zygote under the fork start method): the child has
    copies of the pools' objects but not their coordinator threads, and shares their memory
    with the parent. The pools stay the parent's: here a submit would write into the parent's
    shared memory behind its coordinator's back (which then breaks on a block it never
    handed out), and a shutdown (the atexit hook at the child's exit) would wait forever for a
    coordinator thread that this process does not have. So the child's copies refuse work
    with a clear error and their shutdown does nothing (the parent's pool goes on). The
    child also closes its copies of the coordinator's sockets: the zygote learns of its
    coordinator's death by EOF on the control socket, which a copy here kept open, so the
    parent's workers outlived a SIGKILLed parent as long as this child lived."""
    for pool in list(_live_pools):
        pool._closed_message = FORKED_CHILD_MESSAGE.format(pid=pool._coordinator_pid)
        pool._closed = True
        pool._started = False
    disown_all()  # every pool's, referenced or dropped: sockets, zygote processes
    _live_pools.clear()


os.register_at_fork(after_in_child=_disown_pools_in_forked_child)


def _exiting_on_ctrl_c() -> bool:
    """The interpreter exits because a KeyboardInterrupt reached the top of the main module:
    its report there set ``sys.last_value``. Not in an interactive session, where that is
    whatever failed last at the prompt."""
    return isinstance(getattr(sys, "last_value", None), KeyboardInterrupt) and not hasattr(
        sys, "ps1"
    )


@atexit.register
def _shutdown_all_pools() -> None:
    """Interpreter exit: finish and stop every pool the user did not shut down; after a Ctrl-C
    that ended the program, stop them now, as leaving a ``with`` block on it does (the
    interrupted wait was outside one: the exit waited for every running task)."""
    stop = _exiting_on_ctrl_c()
    for pool in list(_live_pools):
        with contextlib.suppress(Exception):
            if stop and pool._started:
                pool.shutdown(wait=False, cancel_futures=True)
                pool._coordinator.abort_running()
            pool.shutdown(wait=True)
    join_dropped(stop)
