"""Pool: the public process pool; a thin façade over the coordinator, zygote and workers.

Owns the pool's lifecycle (start-up, the coordinator thread, shutdown) and the user-facing calls.
Called from any user thread; every call that changes state goes through the coordinator's lock
or queue and wakes the coordinator loop. Parts of it live in their own modules: the start-up
(``_startup``), ``map``'s iterator (``_map``), the ``statistics`` snapshot (``_statistics``) and
what the pool owns, with the process-wide fork and exit hooks (``_lifecycle``).

Lifecycle: RUNNING -> DRAINING (shutdown called: no new work; the coordinator drains) ->
CLOSED (workers and zygote gone, resources released). ``shutdown`` is idempotent and may be
called from several threads; only the first starts the drain, every caller with ``wait=True``
waits for its end. A pool nobody references any more is collected and ends like
``shutdown(wait=False)``; what it owns lives in ``_lifecycle.PoolResources``, which the
coordinator thread releases (docs/design.md, "Lifecycle").
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import functools
import multiprocessing
import os
import queue
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable, Generator, Hashable, Iterable, Iterator, Sized
from typing import Any, ParamSpec, TypeVar

from mpsched._clock import join_interruptibly, wait_interruptibly, wait_seconds
from mpsched._coordinator import Coordinator
from mpsched._errors import POOL_CLOSED_MESSAGE, POOL_NOT_PICKLABLE_MESSAGE, PoolClosedError
from mpsched._function_cache import FunctionCache
from mpsched._future import Future
from mpsched._initializer import pickled_initializer
from mpsched._layout import SegmentViews
from mpsched._lifecycle import (
    PoolResources,
    interrupted_pool_call,
    live_pools,
    shutdown_all_pools,
)
from mpsched._map import SHARED_INPUTS, MapRun, let_dropped_maps_go, no_results
from mpsched._options import MisfirePolicy, OverlapPolicy, TaskOptions, check_seconds
from mpsched._payloads import CHAIN_BYTES_MAX
from mpsched._scheduler import check_priority, check_run_at, check_task_id
from mpsched._serialize import module_by_name
from mpsched._startup import DISPATCH_WINDOW, DISPATCH_WINDOW_MAX, start
from mpsched._statistics import PoolStatistics, snapshot
from mpsched._task import TaskState
from mpsched._timed import Recurrence, TaskRun
from mpsched._wakeup import Wakeup
from mpsched._weakset import QuietWeakSet
from mpsched._worker import WorkerOptions

_INF = float("inf")
_T = TypeVar("_T")  # a task's result
_P = ParamSpec("_P")  # a task function's parameters
_PoolT = TypeVar("_PoolT", bound="Pool")  # typing.Self, which Python 3.10 lacks
_OPTION_FIELDS = tuple(field.name for field in dataclasses.fields(TaskOptions))


class _NotGiven(enum.Enum):
    """The default of ``with_options``' keywords: the option was not given."""

    NOT_GIVEN = "NOT_GIVEN"

    def __repr__(self) -> str:
        return "<not given>"


NOT_GIVEN = _NotGiven.NOT_GIVEN
# Bytes: a payload longer than a slab chain holds goes through the coordinator's stash, and the
# worker that runs it waits for the coordinator thread to answer its FETCH. A caller submitting
# such tasks one after another holds the GIL while it pickles the next (~0.5 ms a MiB), so that
# thread got it only at the interpreter's switch interval (5 ms); ``submit`` lets it go once
# after each (``time.sleep(0)``, ~1 us). 1,000 tasks of 1 MiB arguments: 1.86-1.93 s instead
# of 1.96-2.45 s (ProcessPoolExecutor 2.02-2.11 s in the same runs).
YIELD_AFTER_BYTES = CHAIN_BYTES_MAX


def _importing_module() -> str | None:
    """The name of the module whose body, as it is imported, called ``Pool()``, or None. Only
    a module being imported counts (its spec's ``_initializing``, which importlib sets while
    it runs the body): a process's own main code (``python -c``, a spawned child's bootstrap)
    is no import."""
    frame: Any = sys._getframe(2)  # Pool() or its caller: the walk goes up from there
    while frame is not None and not (
        frame.f_code.co_name == "<module>"
        and getattr(frame.f_globals.get("__spec__"), "_initializing", False)
    ):
        frame = frame.f_back
    return None if frame is None else str(frame.f_globals.get("__name__"))


def _module_body_hint() -> str:
    """For the daemonic-process error: a pool created by a module's body as it is imported.
    A worker imports a task's module to load its function or arguments (and a task may
    import one), so a module that starts a pool at import time tries it in every worker."""
    name = _importing_module()
    if name is None:
        return ""
    return (
        f" This Pool() runs in the body of module {name!r} as it is imported here (a worker "
        "imports a task's module to load its function or arguments): create the pool under "
        "`if __name__ == '__main__':` or in a function."
    )


def _default_start_method() -> str:
    return "forkserver" if sys.platform.startswith("linux") else "spawn"


class Pool(concurrent.futures.Executor):
    """A pool of worker processes with work stealing and nested tasks.

    A ``concurrent.futures.Executor``: code written for one (``asyncio``'s
    ``loop.run_in_executor``, libraries that take an executor) takes a pool.

    Args:
        workers: number of worker processes (default ``os.cpu_count()``). Unless there is an
            initializer, one starts with the pool and the others as work waits for them: one
            for each task in flight or queued beyond the workers started, or all of them at a
            task's first child (for them to steal).
        start_method: ``"forkserver"`` (default on Linux), ``"spawn"`` or ``"fork"``: how the
            pool's zygote process starts; workers are forked from the zygote. Under forkserver
            and spawn, unless there is an initializer, the first one is forked at the first
            ``submit``, ``schedule`` or ``map``, once the zygote imported the module of its
            function, which every worker (replacements too) then inherits, as it does the main
            module's imports.
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
            exception (no respawn loop). ``initargs`` may hold multiprocessing's ``Lock``,
            ``Value``, ``Queue`` and pipe ends, made from the context of the pool's start
            method (``multiprocessing.get_context("forkserver")`` for the default pool): they go
            to the workers as they start, as ProcessPoolExecutor's do (a ``Connection`` cannot
            go in a task's arguments). The globals that the initializer sets are its module's in
            the worker: a task reads them if it is a function of a module; a lambda, or under
            forkserver and spawn a function of the main script's ``if __name__ == "__main__":``
            block, goes as a copy with the caller's globals and reads the caller's values (reach
            the worker's state through a module's function).

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
    _coordinator_pid: int  # the process that started the pool (a fork child is not it)
    # The zygote awaits the first submission to fork the workers (see _release_workers).
    _workers_deferred: bool

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
        if getattr(multiprocessing.current_process(), "_inheriting", False):
            # multiprocessing's own refusal comes from the zygote's start, deep in its code,
            # and tells a user whose main module is guarded to guard it (found in review).
            module = _importing_module()
            where = "the main module" if module is None else f"module {module!r}"
            raise RuntimeError(
                "mpsched.Pool() cannot start while multiprocessing starts this process: under "
                "spawn and forkserver a new process (a pool's zygote, as ProcessPoolExecutor's "
                f"workers) imports the main module again, and {where} makes a pool as it is "
                "imported. Make it in a function called at first use, or under "
                "`if __name__ == '__main__':`."
            )
        if method != "fork" and multiprocessing.current_process().daemon:
            # multiprocessing's own refusal is an AssertionError that names neither the pool
            # nor a way out (its Process.start, for the zygote).
            raise RuntimeError(
                f"mpsched.Pool(start_method={method!r}) cannot start in a daemonic process (a "
                "task in a pool's worker, or a multiprocessing daemon): multiprocessing lets "
                "such a process start no child. Inside a task, use mpsched.submit for nested "
                "tasks; a pool there needs start_method='fork'." + _module_body_hint()
            )
        if isinstance(dispatch_window, bool) or not isinstance(dispatch_window, int):
            raise TypeError(f"dispatch_window must be an int, not {type(dispatch_window).__name__}")
        if not 1 <= dispatch_window <= DISPATCH_WINDOW_MAX:
            raise ValueError(f"dispatch_window must be in 1..{DISPATCH_WINDOW_MAX}")
        # A finite positive number of seconds, checked under its own name (the error named
        # "timeout" when this borrowed TaskOptions' check).
        aging_s = check_seconds("aging", aging, allow_none=True, positive=True)
        if max_tasks_per_worker is not None:
            if isinstance(max_tasks_per_worker, bool) or not isinstance(max_tasks_per_worker, int):
                raise TypeError(  # as workers and dispatch_window: a wrong type is a TypeError
                    "max_tasks_per_worker must be an int or None, "
                    f"not {type(max_tasks_per_worker).__name__}"
                )
            if max_tasks_per_worker < 1:
                raise ValueError(
                    f"max_tasks_per_worker must be positive, not {max_tasks_per_worker!r}"
                )
        _check_flags(
            timed_after_shutdown=timed_after_shutdown,
            recurring_after_shutdown=recurring_after_shutdown,
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
            initializer=(
                b"" if initializer is None else pickled_initializer(initializer, args, method)
            ),
        )
        self._workers = workers
        self._start_method = method
        self._window = dispatch_window
        self._aging = aging_s
        self._timed_after_shutdown = timed_after_shutdown
        self._recurring_after_shutdown = recurring_after_shutdown
        self._shutdown_lock = threading.Lock()
        # Maps of inputs with a length, whose rest shutdown sends (see there): weakly held once
        # their iterator is read (a map dropped then is abandoned), strongly until then (one
        # dropped unread is fire-and-forget: it runs to its end, as ProcessPoolExecutor's).
        self._maps: QuietWeakSet[MapRun] = QuietWeakSet()  # not a WeakSet: see _weakset
        self._unread_maps: set[MapRun] = set()
        # Maps whose iterator was dropped unread (the callback of MapRun.start's weak
        # reference, which may run in the garbage collector, anywhere: a SimpleQueue's put
        # takes no lock there), for the callback thread or the next map() to take up.
        self._dropped_maps: queue.SimpleQueue[weakref.ref[MapRun]] = queue.SimpleQueue()
        self._maps_lock = threading.Lock()
        self._maps_closed = False  # shutdown took the list of maps: no map joins it now
        # shutdown(wait=False)'s thread that sends the maps' rests, then begins the drain.
        self._rests: threading.Thread | None = None
        self._closed = False
        self._closed_message = POOL_CLOSED_MESSAGE  # another one in a forked child
        self._started = False
        start(self)
        if type(self).cancel is Pool.cancel:  # never over a subclass's own cancel
            # A Python frame less on a measured path (cancel 10,000 pending tasks no slower
            # than the fastest peer): ~0.1-0.3 us of a ~1.3-2.5 us cancel. The behaviour of
            # the method, which documents it; its name, docstring and signature too. Bound
            # twice to the coordinator (as ``self``, then as its positional-only
            # ``recurrence``: none), so that it takes only the method's arguments (bound once,
            # it took ``recurrence=`` and failed on it); the second binding costs ~5-15 ns.
            by_id = types.MethodType(_CANCEL_BY_ID, self._coordinator)
            self.cancel = types.MethodType(by_id, self._coordinator)  # type: ignore[method-assign]

    # ------------------------------------------------------------------ start-up (_startup)
    @property
    def _zygote(self) -> Any:
        """The zygote's Process (or ForkedZygote): tests signal it and read its pid."""
        return self._resources.zygote

    def _release_workers(self, fn: Callable[..., Any] | None) -> None:
        """The pool's first submission: the zygote forks the first worker now, after importing
        the module that each would import to load ``fn`` (see _startup, step 5; None: none)."""
        module = None if fn is None else module_by_name(fn)
        self._coordinator.release_workers(() if module is None else (module,))
        self._workers_deferred = False  # after: a Ctrl-C before the send leaves it to the next

    # ------------------------------------------------------------------ submitting
    def submit(self, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> Future[_T]:
        """Run ``fn(*args, **kwargs)`` in a worker; returns its future.

        The call is pickled here, so an unpicklable function or argument raises at once.

        Raises:
            TypeError: ``fn`` is not callable.
            PoolClosedError: the pool is shutting down or shut down.
            BrokenPoolError: the pool is broken (its initializer raised, or an internal
                error); the cause says what broke it.
            TaskPicklingError: the function or an argument cannot be pickled.
        """
        return self._submit(None, fn, args, kwargs)

    def _submit(
        self,
        options: TaskOptions | None,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        rest: bool = False,
        direct: bool = False,
    ) -> Future[Any]:
        """``submit`` and ``with_options(...).submit``, and ``Pool.map``'s chunks: ``rest``, a
        chunk that the shutdown sends; ``direct``, see ``Coordinator.submit``."""
        if not callable(fn):
            raise TypeError(f"fn must be callable, not {type(fn).__name__}")
        # Early, before pickling; the coordinator decides under its lock. Not for ``rest``: a
        # map's chunk that the shutdown sends (MapRun.send_rest), before the drain begins.
        if self._closed and not rest:
            raise PoolClosedError(self._closed_message)
        if self._workers_deferred:
            self._release_workers(fn)
        payload = self._functions.encode(fn, args, kwargs)
        future: Future[Any] = Future(self._coordinator, payload)
        if options is not None and not options.is_plain:
            future._run = TaskRun(options)
        try:
            if self._coordinator.submit(future, direct):
                self._wakeup.wakeup()
        except BaseException:
            # A Ctrl-C after submit() took the task (queued, or injected with a timeout to
            # watch) and before the wake-up: the loop slept on (the task waited, or ran past its
            # timeout) until something else woke it. A spare wake-up costs the loop one pass.
            self._wakeup.wakeup()
            raise
        if len(payload) > YIELD_AFTER_BYTES:
            time.sleep(0)  # the GIL to the coordinator thread: see YIELD_AFTER_BYTES
        return future

    def schedule(
        self,
        task_id: Hashable,
        run_at: float,
        priority: int,
        fn: Callable[_P, _T],
        /,
        *args: _P.args,
        **kwargs: _P.kwargs,
    ) -> Future[_T]:
        """Run ``fn(*args, **kwargs)`` as version of ``task_id`` due at ``run_at``.

        ``run_at`` is an absolute ``time.monotonic()`` time (in the past: due at once, at the
        call). Among due tasks, the higher ``priority`` starts first, then the one that became
        due first (at its ``run_at``, or at the call if that had passed), then the earlier
        call. Scheduling an id again supersedes its previous version: one that has
        not started is cancelled (its future too) and never runs; one that runs is not
        interrupted, and the new version starts only after it ended. A version whose worker
        died and whose retry (the ``retries`` option) waits to start is cancelled too, as by
        ``cancel``: its retry never runs (a supersede that comes before the pool saw the death
        waits for the retry's end, as for a run).

        Ids are matched as dict keys: equal ids are one id (``1``, ``1.0`` and ``True``;
        ``0.0`` and ``-0.0``), and an id not equal to itself (``float('nan')``) is found by
        ``state``, ``cancel`` and a later ``schedule`` only through the very same object.

        Raises:
            PoolClosedError: the pool is shutting down or shut down.
            BrokenPoolError: the pool is broken (see ``submit``).
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
    ) -> Future[Any]:
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
        if self._workers_deferred:
            # Not the module of a task due later: its import (which may take long, or crash
            # the zygote) held up every task due before it, an hour's for an hourly job (a
            # hunt). Its workers then import it as it comes.
            self._release_workers(fn if run_at <= time.monotonic() else None)
        coordinator = self._coordinator
        call = self._functions.encode(fn, args, kwargs, (task_id,))
        future: Future[Any] = Future(coordinator, call, priority)
        recurrence = None
        if options is not None and not options.is_plain:
            grid_start = run_at
            if options.every is not None:
                recurrence = Recurrence(
                    task_id,
                    priority,
                    call,
                    options,
                    coordinator.cancel_id,
                )
                # Due in the past is due at once: the grid (and the first run's misfire grace)
                # starts now. From the run_at given, the time since then was a backlog of due
                # times that never passed during a run: "queue" ran all of them back to back,
                # "coalesce" once more, "skip" counted them, and a misfire policy "skip"
                # dropped the first run.
                grid_start = max(run_at, time.monotonic())
            future._run = TaskRun(options, recurrence, grid_start)
        try:
            if coordinator.schedule(task_id, run_at, priority, future, recurrence):
                self._wakeup.wakeup()
        except BaseException:  # as in _submit: the version's due time may be the loop's next
            self._wakeup.wakeup()
            raise
        return future if recurrence is None else recurrence.future

    def with_options(
        self,
        options: TaskOptions | None = None,
        /,
        *,
        # TaskOptions' fields, for type checkers to check them (the Literal policies); kept
        # equal to them by tests/integration/test_api_edges.py.
        timeout: float | _NotGiven | None = NOT_GIVEN,
        timeout_grace: float | _NotGiven = NOT_GIVEN,
        retries: int | _NotGiven = NOT_GIVEN,
        every: float | _NotGiven | None = NOT_GIVEN,
        overlap: OverlapPolicy | _NotGiven = NOT_GIVEN,
        misfire: MisfirePolicy | _NotGiven = NOT_GIVEN,
        misfire_grace: float | _NotGiven = NOT_GIVEN,
    ) -> TaskSubmitter:
        """A submitter whose ``submit``/``schedule`` run tasks with these options.

        Options are not arguments of ``fn``, so they travel here rather than as keywords of
        ``submit``, where they would collide with ``fn``'s own::

            pool.with_options(timeout=5, retries=2).submit(fn, x, timeout=30)  # fn gets 30
            pool.with_options(every=1.0, overlap="skip").schedule("tick", t0, 0, poll)

        Takes a ``TaskOptions`` or its fields (fields given override the given options; the
        others keep their value there, or ``TaskOptions``' default).
        """
        given = locals()
        fields = {name: given[name] for name in _OPTION_FIELDS if given[name] is not NOT_GIVEN}
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

        Raises:
            TypeError: unhashable ``task_id``, or a ``force`` that is not a bool.
        """
        coordinator = self._coordinator
        return coordinator.cancel_id(coordinator, task_id, force=force)

    def state(self, task_id: Hashable) -> TaskState | None:
        """The state of the latest version of ``task_id``: PENDING until a worker claims it,
        RUNNING (also while a retry after its worker's death waits), then COMPLETED, FAILED or
        CANCELLED; None for an unknown id (ids that ended are forgotten after the 100,000 more
        recent ones).

        Raises:
            TypeError: unhashable ``task_id``.
            PoolClosedError: in the child of an ``os.fork()`` (the pool is the parent's).
        """
        check_task_id(task_id)
        if self._coordinator.disowned:
            # The lock it takes is a copy, which a thread of the parent's may have held at the
            # fork: it hung there (found by a review, in 14 of 40 children).
            raise PoolClosedError(self._closed_message)
        return self._coordinator.state(task_id)

    def map(
        self,
        fn: Callable[..., _T],
        *iterables: Iterable[Any],
        chunksize: int | None = None,
        timeout: float | None = None,
    ) -> Generator[_T, None, None]:
        """Like ``map(fn, *iterables)``, run in the pool; results in input order. With no
        iterable, an empty iterator (as ``concurrent.futures.Executor.map``; the builtin
        ``map`` raises TypeError).

        The work starts at the call, as ``ProcessPoolExecutor.map``'s. The input is read
        lazily, at most a few chunks per worker ahead of the results (with a finite
        ``timeout``, inputs that are all built-in containers, such as lists and ranges, go on
        as chunks end, until the deadline, so that a reader who pauses does not time out the
        results to come; they wait to be read). At ``shutdown`` (also the
        end of a ``with`` block) the rest of an input with a length is sent, and its results
        come after the pool ended too. An iterator's rest cannot be read then (it may be
        endless): its results come as far as it was read, then PoolClosedError. To abandon a
        map, close its iterator once a result was read (or drop it then). Dropped unread
        (called for its side effects), a map of built-in containers runs to its end, its
        results dropped as they come, as ``ProcessPoolExecutor.map``'s, which submits it all
        at the call (but for a chunk whose first item raised: its other items do not run;
        nobody sees the errors, as nobody sees a dropped future's); one of other
        inputs runs its first chunks, and, if an input has a length, the rest at ``shutdown``
        (not if the pool is dropped too: then only what went before runs).
        ``chunksize=None`` adapts: chunks of 64 items first (a chunk a worker; an input that
        ends sooner is split evenly over the workers), then chunks of about 2 ms of
        work each (at most 4096 items); every chunk holds about 512 KiB of pickled arguments
        at most, as estimated from the first 8 items (items that grow later make bigger
        chunks), and, once results came
        back, returns about 512 KiB of pickled results at most (one item at least); a chunk
        stops once it ran longer than 10 ms, or once its pickled results passed 1 MiB (the
        chunks sent before the first result can only be sized from their arguments), and the
        rest of its items go again. Both are checked between runs of 1, 1, 2, 4, ... items,
        so a chunk of uniform items stops within about twice the bound; items that turn
        slower or bigger partway through a chunk can overrun it by up to half the chunk. The
        results are unpickled in the thread that iterates.

        Raises:
            TypeError: ``fn`` is not callable;
                ``chunksize`` is not an int (a bool is not) or None; ``timeout`` is not a
                number (a bool is not) or None.
            ValueError: ``chunksize`` is less than 1; ``timeout`` is NaN.
            PoolClosedError: the pool is shutting down or shut down (from the iterator too,
                where a chunk could not be sent, after the results of those sent before).
            TimeoutError: from the iterator, if a result is not ready ``timeout`` seconds
                after this call (infinite: no limit; zero or negative: at once).
            CancelledError: from the iterator, for a chunk that ``shutdown(cancel_futures=
                True)`` (or a Ctrl-C that stopped the pool) cancelled, as in
                ``ProcessPoolExecutor.map``.
            Exception: from the iterator, in input order (after the results before it, as the
                builtin ``map``): an item's error, an input iterable's (an Exception), or
                the error of submitting a chunk (TaskPicklingError: an item, or ``fn``,
                does not pickle; the results of the items before it come first).
        """
        if chunksize is not None:
            if isinstance(chunksize, bool) or not isinstance(chunksize, int):
                raise TypeError(f"chunksize must be an int or None, not {type(chunksize).__name__}")
            if chunksize < 1:
                raise ValueError(f"chunksize must be at least 1, not {chunksize}")
        if not callable(fn):  # as submit: at the call, not from the first chunk
            raise TypeError(f"fn must be callable, not {type(fn).__name__}")
        if timeout is not None:
            timeout = wait_seconds(timeout)
        if not iterables:  # nothing to run (as Executor.map), so nothing a closed pool refuses
            return no_results()
        if self._closed:
            raise PoolClosedError(self._closed_message)
        if self._workers_deferred:
            self._release_workers(fn)
        if not self._dropped_maps.empty():  # those the callback thread did not take up
            let_dropped_maps_go(self._dropped_maps)
        deadline = None if timeout is None else time.monotonic() + timeout
        # An input with a length is finite (zip stops at the shortest): shutdown sends the
        # rest of it (see shutdown). Only built-in containers may be read in another thread
        # than the reader's, as chunks end (an iterator may be bound to its thread).
        sized = any(isinstance(it, Sized) for it in iterables)
        shared = all(type(it) in SHARED_INPUTS for it in iterables)  # (a subclass: its own)
        star = len(iterables) > 1  # else the items go as they are (see _chunks)
        items: Iterator[Any] | range
        if star:
            items = zip(*iterables, strict=False)
        elif type(iterables[0]) is range:  # read as sub-ranges (``_map``, "A range input")
            items = iterables[0]
        else:
            items = iter(iterables[0])
        run = MapRun(self, fn, items, star, chunksize, deadline, sized, shared)
        # Known to shutdown before its first chunk goes: a map started while a shutdown had
        # taken its list of maps sent its first window and lost the rest (PoolClosedError
        # after 128 of 1,000 results).
        with self._maps_lock:
            if self._maps_closed:
                raise PoolClosedError(self._closed_message)
            self._maps.add(run)
            if sized:
                self._unread_maps.add(run)
        try:
            return run.start()
        except BaseException:  # a Ctrl-C while the first window went: the map is not read,
            run.closed = True  # and sends no more (its iterator dropped, it ran the whole input)
            with self._maps_lock:
                self._unread_maps.discard(run)
            raise

    # ------------------------------------------------------------------ shutdown
    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Refuse new work, let what was submitted finish (or cancel what no worker has
        claimed, with ``cancel_futures``), then stop the workers. A second call is a no-op,
        except that ``cancel_futures=True`` still cancels what no worker has claimed yet, and
        ``wait=True`` waits for the end, including the done-callbacks of the
        futures the pool settled (docs/design.md, "Where done-callbacks run"). Called from such
        a callback, it waits for the end but not for the callbacks that come after it in the
        pool's callback thread (they would wait for it).

        Called back inside a call of the pool's in the same thread (by a signal handler that
        interrupted it, or by a finalizer the garbage collector ran there), it only asks for
        the shutdown and returns, with ``wait=True`` too: the interrupted call may hold the
        locks a shutdown takes, and goes on once the handler returned. The rest of the input
        of a ``map`` is not sent then (its iterator raises PoolClosedError where it is
        needed). A later ``shutdown(wait=True)`` (the end of a ``with`` block) waits.

        Raises:
            TypeError: ``wait`` or ``cancel_futures`` is not a bool (``cancel_futures="no"``
                cancelled the work, as ``Pool()`` refuses for its flags).
        """
        _check_flags(wait=wait, cancel_futures=cancel_futures)
        try:
            caller = sys._getframe(1)
        except ValueError:  # called straight from C (atexit, _thread.start_new_thread)
            caller = None
        if interrupted_pool_call(caller, _SHUTDOWN_CALLERS):
            # Such a shutdown waited for ever for a lock its own thread held (a SIGTERM
            # handler's, in one of three runs of a loop of submits). No lock, no wait here.
            self._closed = True
            if self._started:
                self._resources.ask_shutdown(self._coordinator, cancel_futures)
            return
        if not cancel_futures and self._started and not self._closed:
            # What a map was given is work submitted, as ProcessPoolExecutor.map submits it
            # all at the call: a map of an input with a length sends the rest of it now, so
            # that its iterator yields every result after the pool ended (the usual
            # ``with Pool() as p: results = p.map(f, items)``, read after the block), and
            # every map what its chunks in flight leave at their budget (MapRun.send_rest).
            # A map called from here on is refused (_maps_closed). One of an iterator cannot
            # be read to its end here (it may be endless): its iterator raises
            # PoolClosedError once it needs to send more than it had read.
            with self._maps_lock:
                self._maps_closed = True
                maps = self._maps.live()
                self._unread_maps.clear()
            wait_chunks = threading.get_ident() != self._coordinator.thread_id
            try:
                left = [run for run in maps if run.send_rest(wait_chunks, wait)]
            except BaseException as exc:
                # A Ctrl-C while waiting for a map's chunks: stop now, as below (the pool
                # stayed open, and the exit waited for everything).
                if not isinstance(exc, Exception):
                    self._stop_now()
                raise
            if left:
                # Without waiting: a thread waits for the claimed chunks that may stop, sends
                # what they leave and then begins the drain. This call waited for them (one
                # whose item waited for the caller: for ever), where ProcessPoolExecutor's
                # returns at once. The user's work is refused from now on. Started before it
                # is published: another thread's shutdown(wait=True) joins it.
                thread = threading.Thread(
                    target=self._shut_down_after_rests,
                    args=(left,),
                    name="mpsched-map-rests",
                    daemon=True,
                )
                thread.start()
                self._rests = thread
                self._closed = True
                return
        rests = self._rests
        if rests is not None and not cancel_futures and rests is not threading.current_thread():
            # That thread begins the drain once the maps' rests went (begun now, it would
            # refuse them). Joined only with ``wait``, and not from the coordinator's thread,
            # which collects the chunks that thread waits for. (From that thread itself: a
            # done-callback of a future its begin_shutdown cancelled; the drain is begun.)
            if not wait or threading.get_ident() == self._coordinator.thread_id:
                return
            try:
                join_interruptibly(rests)
            except BaseException as exc:
                if not isinstance(exc, Exception):
                    self._stop_now()
                raise
        self._closed = True  # the fast early check; the coordinator's draining flag decides
        if self._started:
            self._coordinator.begin_shutdown(cancel_futures)
            # The thread tears down once its loop ended, without waiting for
            # await_termination: after shutdown(wait=False) it stayed blocked, with the
            # pool's fds and memory, until then, the pool's collection or the exit.
            self._resources.request_release()
        # Not from the coordinator thread (no done-callback runs there, but a finalizer may):
        # it would wait for its own end, forever. Also once another call released the pool
        # (``_started`` cleared), whose callbacks may still run: it returned at once then.
        if wait and threading.get_ident() != self._coordinator.thread_id:
            try:
                self.await_termination()
            except BaseException as exc:
                # Ctrl-C (a non-Exception) while waiting for the drain means "stop now", as
                # when it leaves a ``with`` block: cancel what has not started and kill the
                # workers running tasks. Else the interpreter's exit (the atexit hook, or
                # __exit__ after this) would wait for every running task to end.
                if not isinstance(exc, Exception) and not self._coordinator.finished.is_set():
                    self._coordinator.begin_shutdown(True)
                    self._coordinator.abort_running()
                raise

    def _shut_down_after_rests(self, runs: list[MapRun]) -> None:
        """``shutdown(wait=False)``'s thread: the maps' rests (``MapRun.settle_rests``), then
        the drain, as ``shutdown`` begins it."""
        try:
            for run in runs:
                run.settle_rests()
        finally:
            self._coordinator.begin_shutdown(False)
            self._resources.request_release()

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
            timeout = wait_seconds(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._started:
            if not wait_interruptibly(self._coordinator.finished.wait, timeout):
                return False
            # The teardown's end is waited for before the lock, which a shutdown(wait=True) in
            # another thread holds while it waits for the same (for a zygote that does not
            # exit, 5 s: the timeout was not kept; found in review). Once it ended, a holder
            # lets go at once. (A timed acquire instead had a window where a Ctrl-C left the
            # lock taken, and every later shutdown waited for ever; a diff review.)
            if not self._release_joined(deadline):
                return False
            with self._shutdown_lock:
                self._release(deadline)
        # After the release too (a second caller finds the pool released): the runner is
        # closed once ``finished`` is set, so this join ends with its last callback.
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self._coordinator.callbacks.join(left)

    def _release_joined(self, deadline: float | None) -> bool:
        """Ask the coordinator thread to tear down and end (its loop ended), and wait for that
        until ``deadline`` (monotonic; None: no limit); whether it ended."""
        self._resources.request_release()
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return join_interruptibly(self._thread, left)

    def _release(self, deadline: float | None) -> bool:
        """After the coordinator's loop ended: let its thread reap the zygote and free every
        resource (PoolResources.teardown), and wait for that until ``deadline`` (monotonic;
        None: no limit); whether it ended. (The teardown waits up to ZYGOTE_JOIN_TIMEOUT for
        a zygote that does not exit: ``await_termination(1)`` took 5 s then.)"""
        if not self._started:
            return True
        if not self._release_joined(deadline):
            return False
        # Cleared only now: shutdown() and await_termination() read it without the lock,
        # and cleared before the join, a shutdown(wait=True) racing this one returned while
        # the teardown was still going on (tests/stress/test_lifecycle_races.py).
        self._started = False
        live_pools.discard(self)
        return True

    def statistics(self) -> PoolStatistics:
        """A snapshot of the counters (racy reads while the pool runs: hints).

        A slot's ``executed`` and ``stolen`` count every worker that ever ran in it: a worker
        that crashed or was recycled keeps its counts, and its replacement adds to them. After
        ``shutdown`` (once ``await_termination`` returned True), the final counters: queue
        depths and pids read 0 then.

        Raises:
            PoolClosedError: in the child of an ``os.fork()`` (the pool is the parent's).
        """
        if self._coordinator.disowned:  # its locks are copies: see state()
            raise PoolClosedError(self._closed_message)
        return snapshot(self)  # reads the memory under PoolResources.memory_lock

    def __enter__(self: _PoolT) -> _PoolT:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        # Leaving on Ctrl-C (or another non-Exception interrupt: SystemExit, asyncio's
        # CancelledError, which is how Ctrl-C reaches a coroutine under asyncio.run) means
        # "stop now": what no worker has claimed is cancelled, and running tasks are stopped
        # too (their workers are killed, as by cancel(force=True); their futures end
        # cancelled), so that the exit cannot wait on a long task. Workers ignore SIGINT, so
        # none prints a traceback. GeneratorExit is no interrupt: a generator closed by its
        # consumer or by the garbage collector (it killed the running tasks of a generator
        # whose consumer stopped early).
        interrupted = exc_type is not None and not issubclass(exc_type, (Exception, GeneratorExit))
        if interrupted and self._started:
            self._stop_now()
        self.shutdown(wait=True, cancel_futures=interrupted)

    def _stop_now(self) -> None:
        """What a Ctrl-C means: cancel what no worker has claimed and kill the workers that
        run tasks (their futures end cancelled)."""
        self.shutdown(wait=False, cancel_futures=True)
        self._coordinator.abort_running()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running"
        return f"<mpsched.Pool {state} workers={self._workers} start_method={self._start_method}>"

    def __reduce__(self) -> Any:
        # What a task would get is a copy of the object in another process, without the
        # coordinator, its thread or its memory: say so at submit (the TaskPicklingError then
        # names this), rather than fail on whichever lock the pickler meets first.
        raise TypeError(POOL_NOT_PICKLABLE_MESSAGE)


def _cancel_by_id() -> types.FunctionType:
    """``Coordinator.cancel_id`` dressed as ``Pool.cancel``: what each pool binds, to its
    coordinator twice (``self``, and ``recurrence``: none), as its ``cancel`` (``Pool.__init__``).
    The same code, so no frame is added; the public name and docstring, so that
    ``help(pool.cancel)`` shows the method, not the coordinator's internals. Its signature
    once bound is the method's, ``(task_id, *, force=False)``: no ``__wrapped__``, whose
    signature (``Pool.cancel``'s) the two bindings would cut twice."""
    impl = Coordinator.cancel_id
    fn = types.FunctionType(impl.__code__, impl.__globals__, "cancel", impl.__defaults__)
    fn.__kwdefaults__ = impl.__kwdefaults__
    for name in functools.WRAPPER_ASSIGNMENTS:  # as functools.update_wrapper, bar __wrapped__
        setattr(fn, name, getattr(Pool.cancel, name))
    return fn


_CANCEL_BY_ID = _cancel_by_id()
# The pool's own callers of ``shutdown``, none of them inside another call of the pool's (see
# ``interrupted_pool_call``).
_SHUTDOWN_CALLERS = frozenset(
    (Pool.__exit__.__code__, Pool._stop_now.__code__, shutdown_all_pools.__code__)
)


def _check_flags(**flags: object) -> None:
    """TypeError for a flag that is not a bool: "no" was taken as True."""
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, not {type(flag).__name__}")


class TaskSubmitter:
    """``pool.with_options(...)``: ``submit`` and ``schedule`` with fixed task options."""

    __slots__ = ("_options", "_pool")

    def __init__(self, pool: Pool, options: TaskOptions) -> None:
        self._pool = pool
        self._options = options

    @property
    def options(self) -> TaskOptions:
        """The options every task submitted or scheduled through this submitter runs with."""
        return self._options

    def __repr__(self) -> str:
        return f"<mpsched.TaskSubmitter {self._options!r} of {self._pool!r}>"

    def submit(self, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> Future[_T]:
        """``Pool.submit`` with these options (a recurrence needs an id: use ``schedule``)."""
        if self._options.every is not None:
            raise ValueError("a recurring task needs a task id: use schedule(), not submit()")
        return self._pool._submit(self._options, fn, args, kwargs)

    def schedule(
        self,
        task_id: Hashable,
        run_at: float,
        priority: int,
        fn: Callable[_P, _T],
        /,
        *args: _P.args,
        **kwargs: _P.kwargs,
    ) -> Future[_T]:
        """``Pool.schedule`` with these options. With ``every``, the task recurs, and the
        returned future ends only when the recurrence does: cancelled by ``cancel``/shutdown,
        or with the error of a run that raised (later runs do not happen then). Its
        ``cancel()`` stops the recurrence, and returns True, even while a run is in progress:
        that run goes on to its end (``Pool.cancel(id)`` also asks it to stop). A caller's
        ``set_result``/``set_exception`` on it ends the future only: the recurrence goes on
        until ``Pool.cancel(id)`` or the shutdown stops it."""
        return self._pool._schedule(self._options, task_id, run_at, priority, fn, args, kwargs)
