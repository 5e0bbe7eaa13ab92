"""The coordinator's state: what every part of the ``Coordinator`` reads and writes.

The coordinator (one thread in the pool's process, see ``_coordinator``) is one object whose
methods are split by responsibility into parts, each a class in a module of its own:
``_coordinator`` (start-up, ``submit``, the loop, stashes, messages), ``_coord_dispatch``
(handing tasks to the inboxes, waking workers), ``_coord_timed`` (tasks with an id:
schedule, supersede, due versions, recurrences), ``_coord_cancel`` (withdrawing queued tasks and
stopping running ones: cancel, forced cancel, timeouts), ``_coord_collect`` (results: done rings,
stashes, settling futures), ``_coord_recovery`` (a worker's death: settling what it ran, freeing
what it held) and ``_coord_drain`` (shutdown: the drain condition and handshake, a broken pool).
``Coordinator`` combines them; methods stay methods of that one object (no indirection on the
per-task paths).

Owns: ``CoordinatorState.__init__``, which declares every attribute (each with who writes and
reads it, and under which lock), the constants and the ``WorkerHandle`` that more than one part
uses. Under ``TYPE_CHECKING`` only, it also declares the methods a part calls on ``self`` but
another part defines, so that mypy checks each part alone; at run time they are looked up on
``Coordinator`` as any method. Invariant: the parts share no state but these attributes, and
each attribute's lock discipline (below, and docs/design.md's lock inventory) holds in every part.
"""

from __future__ import annotations

import collections
import logging
import math
import select
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from mpsched._future import CallbackRunner, Future
from mpsched._layout import SegmentLocks, SegmentViews
from mpsched._payloads import BlockField
from mpsched._protocol import Buffer, ResultStatus
from mpsched._ready import ReadyQueue
from mpsched._shm import SharedFd
from mpsched._timed import Timetable

_NBYTES = BlockField.NBYTES
_RESULT_NBYTES = BlockField.RESULT_NBYTES
_OK = ResultStatus.OK
_CANCELLED = ResultStatus.CANCELLED
_MISFIRED = ResultStatus.MISFIRED
_UID_PID_SHIFT = 31  # a child's uid is (spawning worker's pid << 31) | counter (_children.next_uid)
_ERROR = ResultStatus.ERROR
_STATE = BlockField.STATE
_NO_LOW = math.inf  # inbox_low of an inbox with nothing low in it (above every int priority)
logger = logging.getLogger("mpsched")


@dataclass
class WorkerHandle:
    slot: int
    pid: int
    conn: Connection
    pidfd: int
    frame_waiting: Callable[[], object]  # _protocol.frame_watch(conn)
    drained: bool = False
    retiring: bool = False  # max_tasks_per_worker reached: its exit is not a crash
    # It retired with children whose futures had not settled (kept past their task): nobody
    # will collect those children, so their blocks are settled as a dead worker's are.
    left_children: bool = False


def signal_description(exitcode: int | None) -> str:
    if exitcode is None:
        return "unknown exit"
    if exitcode < 0:
        try:
            return f"{signal.Signals(-exitcode).name}({exitcode})"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


class CoordinatorState:
    def __init__(
        self,
        views: SegmentViews,
        wake_fds: list[SharedFd],
        zygote_conn: Connection,
        wakeup_fd: int,
        wakeup: Any,
        clear_wakeup: Any,
        n_workers: int,
        window: int,
        max_inflight: int,
        locks: SegmentLocks | None = None,
        aging: float | None = None,
        timed_after_shutdown: bool = True,
        recurring_after_shutdown: bool = False,
        wakeup_nowait: Any = None,
        has_initializer: bool = False,
        workers_await_start: bool = False,
        zygote_status: Callable[[float], int | None] | None = None,
    ) -> None:
        self.slots = views.slots
        self.slab = views.slab
        self.header = views.header
        self.wake_fds = [f.fd for f in wake_fds]
        self.zygote = zygote_conn
        # The zygote's exit code once it exited within the seconds given (None: not yet, or
        # not known): for the message of the pool's error at its death.
        self.zygote_status = zygote_status
        # Whether START was sent (or is not awaited: ZygoteConfig.await_start). Read and written
        # under zygote_send_lock, which orders every write to the zygote (START comes from a
        # submitting thread or the drain's start, SPAWN and STOP from the coordinator thread).
        # Reentrant: a signal handler's submission inside the first one's send of START sends
        # its own, whole (a frame this small is one write), and the zygote ignores the second.
        self.workers_released = not workers_await_start
        # START's modules (set before its send, under zygote_send_lock), which the zygote
        # imports before its first fork; and whether it forked (SPAWNED or SPAWN_FAILED came):
        # a death in between was in those imports (``zygote_died``).
        self.start_modules: tuple[str, ...] = ()
        self.forked_any = False
        self.zygote_send_lock = threading.RLock()
        self.wakeup = wakeup
        self.clear_wakeup = clear_wakeup
        self.wakeup_nowait = wakeup if wakeup_nowait is None else wakeup_nowait
        # Futures to cancel on the loop's next pass (cancel_later). Written by: any thread,
        # without a lock (append). Read by: the coordinator thread (popleft).
        self.deferred_cancels: collections.deque[Future[Any]] = collections.deque()
        self.n_workers = n_workers
        self.window = window
        self.max_inflight = max_inflight
        self.aging = aging
        self.has_initializer = has_initializer  # workers run the pool's initializer first
        self.locks = locks  # the guarded locks of the segment (orphan release after a crash)
        self.repair_lock = threading.Lock()  # one lock repair at a time, from any thread
        self.collect_lock = threading.Lock()  # one collector at a time (help_wait: any thread)
        # Calls the done-callbacks of the futures this thread settles (never this thread: a
        # callback that blocks here would stop the loop that must collect what it waits for).
        self.callbacks = CallbackRunner()
        self.thread_id = 0  # the coordinator thread's ident, once it runs
        # Warnings noted under the pool's locks, logged by the loop with none held
        # (``log_deferred``): each is ``logger.warning``'s arguments.
        self.deferred_logs: collections.deque[tuple[Any, ...]] = collections.deque()
        self.help_calls = 0
        self.help_misses = 0  # help_wait spins in a row that ended without the result
        # The loop's timer sweep of the done rings (Coordinator.pace_sweep), coordinator thread
        # only: lazy or not, timer passes in a row that collected nothing, and ``completed``
        # as the last pass saw it.
        self.sweep_lazy = False
        self.quiet_sweeps = 0
        self.completed_seen = 0
        self.timed_after_shutdown = timed_after_shutdown
        self.recurring_after_shutdown = recurring_after_shutdown
        # Guards ready, timetable, requests, records' location fields and the draining flag
        # against user threads.
        self.lock = threading.Lock()
        self.ready = ReadyQueue()
        self.timetable = Timetable()
        self.next_due: float | None = None  # earliest run_at waiting in the timetable
        self.sleep_until = math.inf  # the loop sleeps until then unless woken (under lock)
        self.requests: list[tuple[Future[Any], bool]] = []  # running tasks to signal / kill (force)
        self.watched: dict[int, Future[Any]] = {}  # handle -> in-flight task with a timeout
        # The lowest priority injected since the inbox emptied (_NO_LOW: none).
        self.inbox_low: list[float] = [_NO_LOW] * n_workers
        # Per inbox, highest first: each priority injected since it was last taken back, with
        # the handle of the last task injected at it (not the task: its future would be kept
        # alive): while one waits there unclaimed, no other inbox gets a lower task
        # (Dispatching.waiting_highs).
        self.inbox_high: list[list[tuple[int, int]]] = [[] for _ in range(n_workers)]
        self.by_handle: dict[int, Future[Any]] = {}  # dispatched, unfinished
        # Bytes too big for a block chain, by key (STASH; taken by FETCH or a collector).
        # Written by: the coordinator thread. A user-thread collector pops its results.
        self.stash: dict[int, Buffer] = {}
        # (slot, handles) taken from a done ring by a user-thread collector whose stashed
        # results had not arrived (or that an exception hit): their blocks are kept, their
        # futures stay in by_handle; the next collector reads them first. Under collect_lock.
        self.unread: list[tuple[int, list[int]]] = []
        # Keys of stashed child results dropped before their STASH was read (orphan_children:
        # a live executor's socket may still hold it): dropped when they come.
        self.unwanted_stash: set[int] = set()
        self.parked_fetches: dict[int, list[WorkerHandle]] = {}
        # pid -> the stash key last answered to that worker's FETCH, until its death is
        # recovered: a fetcher dies between the answer and the store that zeroes the key in
        # its block, and its recovery must not wait for bytes already taken (unwanted_stash).
        self.fetched: dict[int, int] = {}
        self.workers: list[WorkerHandle | None] = [None] * n_workers
        # Slots whose worker was asked for (SPAWN) and not registered yet (SPAWNED not read).
        self.starting: set[int] = set()
        # Slots whose first worker was never asked for: the zygote forks the initial ones only,
        # and the loop asks for these as tasks outnumber the workers asked for, or all once a
        # task spawns a child (``Coordinator.wake_dormant``). Coordinator thread only, after go.
        self.dormant: list[int] = []
        self.peers_wanted = False  # a worker with dormant peers pushed a child (WANT_PEERS)
        # A worker could not start (Coordinator.spawn_failed): when to ask again (monotonic
        # seconds; 0: no wait), whether this run of failures was told, and since when no
        # worker runs while every try fails (None: one runs, or the last try worked).
        self.spawn_retry_at = 0.0
        self.spawn_warned = False
        self.stranded_since: float | None = None
        self.by_fd: dict[int, WorkerHandle] = {}
        self.exit_codes: dict[int, int] = {}  # pid -> exit code, from the zygote
        self.draining = False  # set once shutdown began: no task may come in after it
        # Set by a shutdown with cancel_futures: nothing may start from now on, a retry neither.
        self.cancelling = False
        # Set by abort_running ("stop now"): the drain waits for no child, and stops every worker.
        self.aborted = False
        # When Draining.poll_orphans last looked for orphaned locks (coordinator thread only).
        self.orphans_polled_at = -math.inf
        # A shutdown asked for without taking any lock (PoolResources.ask_shutdown): by the
        # drop callback (the Pool was garbage-collected), or by a shutdown() called back
        # inside a pool call of its own thread (a signal handler's, a finalizer's), which may
        # hold the locks it would take. The loop begins it, as shutdown(wait=False) does.
        # Only ever set, cancel_asked first: the loop that reads shutdown_asked then reads
        # the cancel_asked that came with it.
        self.shutdown_asked = False
        self.cancel_asked = False  # with cancel_futures
        # A copy in a child of the user's os.fork() (PoolResources.disown): the pool and its
        # shared memory are the parent's. Cancels and help_wait from the child's copies of the
        # futures must not touch the parent's queues and slab (a cancel there tombstoned the
        # parent's task and freed its block: the parent's future never settled, and its
        # shutdown waited for ever). Written once, in the child, before it runs user code.
        self.disowned = False
        self.broken: BaseException | None = None
        self.submitted = 0
        self.next_slot = 0
        self.stash_counter = 0
        self.crashes = 0
        self.respawns = 0
        self.completed = 0
        # Workers SIGKILLed in the initializer since a task last completed, and ``completed``
        # at the first of them (Recovering.survives_initializer_kill).
        self.init_kills = 0
        self.init_kills_completed = 0
        self.retried = 0
        self.recycled = 0
        self.retired_pids: set[int] = set()  # their EXITED reports are not crash reports
        self.misfires = 0
        # Dispatch passes ended (``dispatch``): a recurring run made ready since the last one
        # ended is in its first dispatch, which is never a misfire (``misfired``).
        self.dispatches = 0
        self.skipped_runs = 0
        self.final_stats: dict[int, dict[str, int]] = {}
        self.epoll = select.epoll()
        self.wakeup_fd = wakeup_fd
        self.epoll.register(wakeup_fd, select.EPOLLIN)
        self.epoll.register(zygote_conn.fileno(), select.EPOLLIN)
        # The thread is started while the zygote starts up and waits for this before its loop
        # (only the pool's thread reads the zygote's READY); start_aborted: it returns at once.
        self.go = threading.Event()
        self.start_aborted = False
        self.finished = threading.Event()

    if TYPE_CHECKING:
        # Defined by the other parts (see the module docstring); each is called on ``self``
        # by a part that does not define it. Not defined at run time: Coordinator's are found.
        # _coordinator
        def spawn(self, slot: int) -> None: ...
        def release_workers(self, modules: tuple[str, ...] = ()) -> None: ...
        def send_to_zygote(self, tag: int, *fields: Any) -> None: ...
        def check_usable(self) -> None: ...
        def drop_stashed(self, handles: list[int], field: int = _NBYTES) -> None: ...
        def stash_put(self, data: bytes) -> int: ...
        def on_worker_readable(self, worker: WorkerHandle) -> None: ...
        def on_worker_message(
            self, worker: WorkerHandle, tag: int, fields: tuple[Any, ...]
        ) -> None: ...
        def on_zygote_message(self, block: bool) -> None: ...

        # _coord_dispatch
        def wake_sleepers(self, every: bool = False) -> None: ...

        # _coord_timed
        def note_heap_due(self) -> None: ...
        def end_recurring_run(self, future: Future[Any], status: int, data: Buffer) -> None: ...
        def release_due_locked(self, now: float) -> None: ...
        def misfired(self, future: Future[Any]) -> bool: ...
        def misfire_deadline(self, future: Future[Any]) -> float | None: ...

        # _coord_cancel
        def cancel(self, future: Future[Any]) -> bool: ...
        def withdraw(self, future: Future[Any]) -> bool: ...
        def end_withdrawn(self, future: Future[Any]) -> None: ...

        # _coord_collect
        def help_wait(self, future: Future[Any], timeout: float | None = None) -> None: ...
        def collect(self) -> None: ...
        def settle(self, outcomes: list[tuple[Future[Any], int, Buffer]]) -> None: ...

        # _coord_recovery
        def forget_worker(self, worker: WorkerHandle) -> None: ...

        # _coord_drain
        def all_done(self) -> bool: ...
