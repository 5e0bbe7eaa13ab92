"""The coordinator: one thread in the pool's process that feeds the workers and reaps results.

Owns: the ready queue (due tasks not yet handed out, by priority), the timetable (tasks with an
id: the scheduler heap and the versions handed out), the records of dispatched tasks (by slab
block), the stash of payloads too big for a block, the worker handles (pid, socket, pidfd), the
cancel requests and timeout watch of running tasks, and the drain handshake. Called from: user
threads through ``Pool`` (``submit``, ``schedule``, ``cancel``, ``cancel_id``, ``state``,
``begin_shutdown``; each takes ``self.lock`` briefly and wakes the loop if needed), and its own
thread (``run``, from ``_lifecycle.run_coordinator``). Everything else below runs in the
coordinator thread only. Nothing here references the ``Pool`` (a dropped pool must be
collectable): when it is collected, ``owner_dropped`` is set and the loop begins the shutdown.

The loop has one blocking point (``wait``), an ``epoll`` over: the wakeup pipe (user calls), the
zygote's control socket (spawns and exits), and every worker's socket (result pokes, stashes,
fetches, drained, fatal; EOF when a worker dies), with a timeout at the next due time. Each wake
is classified and handled in a small named method; then results are collected from every done
ring, cancel requests applied, due versions released, the inboxes refilled and timeouts checked.

Dispatch window: at most ``window`` handles wait in a worker's inbox, and at most
``max_inflight`` dispatched tasks are unfinished in all; the rest wait here, in order. A due task
of a higher priority than one waiting in an inbox takes the lower ones back (``take_back_lower``)
so that it never waits behind them. The done rings are sized for ``max_inflight``, so they
cannot overflow.

Deferred cancels (``cancel_later``): a cleanup that may run inside any critical section of its
own thread (a ``Pool.map`` generator finalized by the cyclic garbage collector, which runs
inside any allocation) must take no lock: it appends the futures to ``deferred_cancels`` (a
``collections.deque``: append and popleft are atomic under the GIL) and wakes the loop without
a lock (``wakeup_nowait``); the loop cancels them on its next pass, before it dispatches.

Cancel (``withdraw``): a task in the timetable or the ready queue is dropped; a task in an inbox
is cancelled with ``cancel_injected`` under the slot lock, where it races the claim and exactly
one wins; a claimed task gets the cooperative flag in its block (``apply_requests``), or, forced,
its worker is stopped, checked and killed (``kill_running``). docs/design.md section 3 has the
argument.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
import pickle
import select
import signal
import threading
import time
from collections.abc import Hashable, Iterable, Sequence
from concurrent.futures import InvalidStateError
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from typing import Any

from mpsched._errors import (
    POOL_CLOSED_MESSAGE,
    BrokenPoolError,
    InternalError,
    PoolClosedError,
    ProtocolError,
    WorkerCrashedError,
)
from mpsched._future import FINISHING, CallbackRunner, Future, defer_callbacks, invoke_all
from mpsched._layout import SegmentLocks, SegmentViews
from mpsched._options import TaskOptions, is_misfire, next_run_at
from mpsched._payloads import BlockField
from mpsched._protocol import (
    ChildState,
    ResultStatus,
    Tag,
    TopState,
    decode,
    dump_exception,
    encode,
    load_exception,
    unpickling_failed,
)
from mpsched._ready import ReadyQueue
from mpsched._serialize import with_version
from mpsched._shm import SharedFd, release_if_orphaned
from mpsched._task import TaskState
from mpsched._timed import Recurrence, TaskRun, Timetable

_NBYTES = int(BlockField.NBYTES)
_RESULT_STATUS = int(BlockField.RESULT_STATUS)
_RESULT_NBYTES = int(BlockField.RESULT_NBYTES)
_OK = int(ResultStatus.OK)
_CANCELLED = int(ResultStatus.CANCELLED)
_CHILD_DONE = int(ChildState.DONE)
_CHILD_QUEUED = int(ChildState.QUEUED)
_PARENT = int(BlockField.PARENT)
_UID = int(BlockField.UID)
_UID_PID_SHIFT = 31  # a child's uid is (spawning worker's pid << 31) | counter (_worker.next_uid)
_UID_COUNTER_MASK = (1 << _UID_PID_SHIFT) - 1  # counters wrap: see _worker.UID_COUNTER_MASK
# A top-level task's block: the uid names no process, so orphan_children never takes it for a
# dead worker's child (the block's handle identifies the task; no per-task number is needed).
TOP_LEVEL_UID = 0
_CHILD_ABANDONED = int(ChildState.ABANDONED)
_ERROR = int(ResultStatus.ERROR)
_CANCEL_REQUESTED = int(TopState.CANCEL_REQUESTED)
_STATE = int(BlockField.STATE)
_DRAIN = encode(Tag.DRAIN)
_FAILED = RuntimeError("the task failed")  # stands for any error in Timetable.end
_NO_LOW = 2**63  # inbox_low of an inbox with nothing low in it

DRAIN_TIMEOUT = 10.0  # seconds a worker gets to answer DRAIN before it is killed
RESULT_SWEEP_INTERVAL = 0.005  # seconds between done-ring sweeps while tasks are in flight
# While draining with nothing in flight, the loop re-checks the drain condition this often: the
# last children may finish without waking it (a child's DONE wakes its parent, not the loop).
DRAIN_POLL_INTERVAL = 0.05  # seconds
# A poll timeout shorter than this is waited with select() on the epoll fd: epoll rounds its
# timeout up to whole milliseconds, which would make every timed task ~0.5 ms late on average.
FINE_WAIT = 0.002  # seconds
STOP_WAIT = 0.2  # seconds a SIGSTOPped worker gets to show as stopped before a forced cancel
# A lock still taken this long with no holder recorded is released (its taker never reached the
# pid store: it died, or an exception hit it in between; see _shm.release_if_orphaned). Holders
# keep locks for microseconds, so a second is far beyond any live holder's preemption.
ORPHAN_WAIT = 1.0  # seconds
# help_wait: how long a caller of result() collects done rings itself before it blocks; a
# round trip of a tiny task takes well under this. After HELP_MISSES_MAX misses in a row (long
# tasks), only one call in HELP_RETRY_EVERY spins, so waiting on slow tasks burns no CPU.
HELP_SPIN = 300e-6  # seconds
HELP_MISSES_MAX = 3
HELP_RETRY_EVERY = 32
logger = logging.getLogger("mpsched")


@dataclass
class WorkerHandle:
    slot: int
    pid: int
    conn: Connection
    pidfd: int
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


class Coordinator:
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
    ) -> None:
        self.slots = views.slots
        self.slab = views.slab
        self.header = views.header
        self.wake_fds = [f.fd for f in wake_fds]
        self.zygote = zygote_conn
        self.wakeup = wakeup
        self.clear_wakeup = clear_wakeup
        self.wakeup_nowait = wakeup if wakeup_nowait is None else wakeup_nowait
        # Futures to cancel on the loop's next pass (cancel_later). Written by: any thread,
        # without a lock (append). Read by: the coordinator thread (popleft).
        self.deferred_cancels: collections.deque[Future] = collections.deque()
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
        self.help_calls = 0
        self.help_misses = 0  # help_wait spins in a row that ended without the result
        self.timed_after_shutdown = timed_after_shutdown
        self.recurring_after_shutdown = recurring_after_shutdown
        # Guards ready, timetable, requests, records' location fields and the draining flag
        # against user threads.
        self.lock = threading.Lock()
        self.ready = ReadyQueue()
        self.timetable = Timetable()
        self.next_due: float | None = None  # earliest run_at waiting in the timetable
        self.sleep_until = math.inf  # the loop sleeps until then unless woken (under lock)
        self.requests: list[tuple[Future, bool]] = []  # running tasks to signal / kill (force)
        self.watched: dict[int, Future] = {}  # handle -> in-flight task with a timeout
        self.inbox_low = [_NO_LOW] * n_workers  # lowest priority injected since inbox emptied
        self.by_handle: dict[int, Future] = {}  # dispatched, unfinished
        # Bytes too big for a block chain, by key (STASH; taken by FETCH or a collector).
        # Written by: the coordinator thread. A user-thread collector pops its results.
        self.stash: dict[int, bytes] = {}
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
        self.by_fd: dict[int, WorkerHandle] = {}
        self.exit_codes: dict[int, int] = {}  # pid -> exit code, from the zygote
        self.draining = False  # set once shutdown began: no task may come in after it
        # The Pool was garbage-collected: the loop begins a shutdown(wait=False) itself.
        # Written by: the drop callback (_lifecycle; takes no lock). Read by: the loop.
        self.owner_dropped = False
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
        self.retried = 0
        self.recycled = 0
        self.retired_pids: set[int] = set()  # their EXITED reports are not crash reports
        self.misfires = 0
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

    # ------------------------------------------------------------------ start-up
    def mark_all_starting(self) -> None:
        """Before the loop runs: every worker is starting (the zygote forks the initial ones
        from its config after READY, with no SPAWN). The loop registers each worker as its
        SPAWNED comes; until then a task may already be injected into its inbox
        (``dispatch_one``), where the worker finds it when it starts, or a peer steals it.
        Nothing waits for the round trip."""
        self.starting.update(range(self.n_workers))

    def spawn(self, slot: int) -> None:
        self.starting.add(slot)
        try:
            self.zygote.send_bytes(encode(Tag.SPAWN, slot))
        except OSError as exc:  # EPIPE: it died, its EOF not read yet (e.g. during a recovery)
            raise zygote_died() from exc

    def wait_ready(self, timeout: float) -> None:
        """Before the loop runs, in the pool's thread: wait for the zygote's READY (it has
        opened the locks: their names may go; a zygote that cannot start fails the pool's
        creation here)."""
        if not self.zygote.poll(timeout):
            raise BrokenPoolError(f"the pool's zygote did not start within {timeout} s")
        tag = self.read_zygote()[0]
        if tag is not Tag.READY:
            raise ProtocolError(f"the zygote sent {tag.name} before READY")

    # ------------------------------------------------------------------ user-thread API
    def check_usable(self) -> None:
        """Under ``self.lock``: may a new task come in? (Not once the pool broke or began to
        shut down: the drain must not see a task arrive after it began.)"""
        if self.broken is not None:
            raise BrokenPoolError(f"the pool is broken: {self.broken!r}") from self.broken
        if self.draining:
            raise PoolClosedError(POOL_CLOSED_MESSAGE)

    def submit(self, future: Future) -> bool:
        """Any thread: when the pool is idle (nothing queued or in flight), hand the task to a
        worker at once, one thread hop less on the latency path; otherwise queue it for the
        coordinator, which dispatches in batches with at most one wake-up per batch (a burst
        injected task by task would pay one eventfd write per task to workers that keep
        falling asleep). Returns True if the coordinator loop must be woken.

        Raises:
            PoolClosedError, BrokenPoolError: see ``check_usable``.
        """
        lock = self.lock
        lock.acquire()  # not ``with``: see _future._acquire (the per-task paths)
        try:
            if self.broken is not None or self.draining:
                self.check_usable()
            self.submitted += 1
            if self.aging is not None:
                # Before the direct dispatch too: a task injected here may be taken back to the
                # ready queue (take_back_lower), whose aging reads this; left at 0.0 it read as
                # waiting since the clock's epoch and jumped above every priority.
                future._due_at = time.monotonic()
            if not self.ready and not self.by_handle and self.dispatch_one(future):
                return future._run is not None  # a timeout needs the loop's watch
            self.ready.append(future, future._priority)
        finally:
            lock.release()
        return True

    def dispatch_one(self, future: Future) -> bool:
        """Under ``self.lock``: inject one task into the next inbox with room; False if none."""
        if len(self.by_handle) >= self.max_inflight:
            return False
        n = self.n_workers
        slots = self.slots
        workers = self.workers
        # An awake worker first (it may still be spinning after its last task: no wake-up), then
        # any worker, then a worker still starting: it finds the task when it starts (right
        # after the pool's creation, the first task does not wait for the SPAWNED round trip).
        for rank in (0, 1, 2):
            for i in range(n):
                k = (self.next_slot + i) % n
                if (
                    (workers[k] is not None if rank < 2 else k in self.starting)
                    and slots[k].inbox_depth() < self.window
                    and not (rank == 0 and slots[k].is_sleeping())
                ):
                    self.next_slot = (k + 1) % n
                    return self.inject(k, [future], future._priority) == 1
        return False

    def schedule(
        self,
        task_id: Hashable,
        run_at: float,
        priority: int,
        future: Future,
        recurrence: Recurrence | None = None,
    ) -> bool:
        """Any thread: add a version of ``task_id`` (``future`` holds its call, encoded with its
        meta). The version handed out earlier, if no worker has claimed it, and the pending one
        are superseded: cancelled, never run.
        Returns True if the loop must be woken (the new task is due before it would wake)."""
        superseded: Sequence[Future] = ()  # no list for a new id (the measured path)
        timetable = self.timetable
        lock = self.lock
        lock.acquire()  # not ``with``: see _future._acquire (the per-task paths)
        try:
            if self.broken is not None or self.draining:
                self.check_usable()
            self.submitted += 1
            if timetable.known(task_id):  # an id seen before: supersede what it has
                superseded = self.supersede(task_id, recurrence)
            if recurrence is not None:
                timetable.recurring[task_id] = recurrence
            timetable.schedule(task_id, run_at, priority, future)
            if self.next_due is None or run_at < self.next_due:
                self.next_due = run_at
            wake = run_at < self.sleep_until
            if wake:
                self.sleep_until = run_at
        finally:
            lock.release()
        for old_future in superseded:
            old_future._mark_cancelled()
        return wake

    def supersede(self, task_id: Hashable, recurrence: Recurrence | None) -> list[Future]:
        """Under ``self.lock``: a new version of ``task_id`` comes; cancel the handed-out version
        if no worker claimed it, the pending one, and a recurrence other than ``recurrence``.
        Returns their futures, to be marked cancelled once the lock is released."""
        timetable = self.timetable
        superseded = []
        handed = self.withdraw_handed(task_id)
        if handed is not None:
            superseded.append(handed)
        pending = timetable.pending_future(task_id)
        if pending is not None:
            superseded.append(pending)  # the heap drops it when the new version comes
        old = timetable.recurring.get(task_id)
        if old is not None and old is not recurrence:
            del timetable.recurring[task_id]
            old.active = False
            superseded.append(old.future)
        return superseded

    def withdraw_handed(self, task_id: Hashable) -> Future | None:
        """Under ``self.lock``: withdraw and end the version of ``task_id`` that the timetable
        handed out (ready queue or inbox) if no worker claimed it; returns its future, to be
        marked cancelled once the lock is released, or None."""
        handed = self.timetable.handed.get(task_id)
        if handed is None or not self.withdraw(handed):
            return None
        self.timetable.end(handed, None, cancelled=True)
        return handed

    def cancel(self, future: Future) -> bool:
        """Any thread (``Future.cancel``): withdraw a task no worker has claimed. True if it
        will never run."""
        if self.disowned:  # a fork child's copy: the task is the parent's (see __init__)
            return False
        with self.lock:
            if not self.withdraw(future):
                return False
            if future._due is None or not self.timetable.withdrawn(future):
                return True
            # It ended a retry with a newer version of its id waiting behind it: that one
            # entered the heap, and the loop must learn its due time (else it stayed there,
            # its future never settled and the drain waited for it for ever).
            self.note_heap_due()
            due = self.next_due
            wake = False
            if due is not None and due < self.sleep_until:  # as schedule() does
                self.sleep_until = due
                wake = True
        if wake:
            self.wakeup()
        return True

    def cancel_later(self, futures: Iterable[Future]) -> None:
        """Any thread, in any context: have the loop cancel ``futures`` (``Future.cancel``) on
        its next pass. Takes no lock, so it may run inside a critical section of the calling
        thread: a generator finalized by the garbage collector while this thread holds
        ``self.lock``, the futures' module lock, a slot lock or the wakeup's lock would wait for
        itself in ``Future.cancel``. For futures without user callbacks (``Pool.map``'s): the
        loop's cancel would hand them to the pool's callback thread."""
        if self.finished.is_set():  # every future is settled: nothing is left to cancel
            return
        if self.disowned:  # a fork child's copy: the parent's futures (see __init__)
            return
        self.deferred_cancels.extend(futures)
        self.wakeup_nowait()

    def cancel_deferred(self) -> None:
        """Coordinator thread, no lock held: cancel what ``cancel_later`` handed over."""
        deferred = self.deferred_cancels
        while deferred:
            deferred.popleft().cancel()

    def withdraw(self, future: Future) -> bool:
        """Under ``self.lock``: make sure a task no worker has claimed never runs. True if it
        will not run (withdrawn now or before); False if it was claimed or has finished."""
        if future._owner is FINISHING:  # it ran; its outcome is being set (end_runs)
            return False
        if future._handle < 0:  # in the ready queue or the timetable: dispatch skips it
            if future._withdrawn or future.done():
                # Cancelled by a racing cancel by id or reschedule (which mark the future
                # after taking its version out of the heap): it will not run either.
                return future._withdrawn or future.cancelled()
            future._withdrawn = True
            future._payload = b""
            return True
        if self.by_handle.get(future._handle) is not future:
            # Collected (collect pops it, then frees its block, without this lock): it ran. Its
            # block may already carry another task, injected into the same inbox: the
            # cancel_injected below would tombstone that one. (While this lock is held, no
            # block is injected, so the check stays true until the cancel is decided.)
            return False
        if future._slot >= 0 and not self.slots[future._slot].cancel_injected(future._handle):
            return False  # a worker claimed it first
        # Withdrawn from its inbox, or taken back (queued here with its block): free the block.
        self.by_handle.pop(future._handle, None)
        self.watched.pop(future._handle, None)
        self.drop_stashed([future._handle])
        self.slab.free_tasks([future._handle])
        future._handle = -1
        future._withdrawn = True
        future._payload = b""
        return True

    def cancel_id(
        self, task_id: Hashable, force: bool, recurrence: Recurrence | None = None
    ) -> bool:
        """Any thread (``Pool.cancel``): cancel every version of ``task_id`` that has not
        started, stop its recurrence, and ask a running version to stop (cooperatively, or by
        killing its worker with ``force``). True if anything was cancelled or asked to stop.

        With ``recurrence`` (its future's ``cancel()``): only while it is still the id's
        recurrence."""
        if self.disowned:  # a fork child's copy: the versions are the parent's (see __init__)
            return False
        timetable = self.timetable
        rec = handed = None
        wake = False
        lock = self.lock
        lock.acquire()  # not ``with``: see _future._acquire (the per-task paths)
        try:
            if recurrence is not None and timetable.recurring.get(task_id) is not recurrence:
                # Stopped already: by a racing cancel by id, reschedule or shutdown, which mark
                # its future cancelled after releasing the lock (so True, as they will), or by a
                # run's error (its future's owner is FINISHING then: False). Going on would
                # cancel the id's versions, which may belong to the schedule that replaced it.
                return recurrence.future._owner is not FINISHING
            pending = timetable.cancel_pending(task_id)
            if timetable.recurring:
                rec = timetable.recurring.pop(task_id, None)
                if rec is not None:
                    rec.active = False
            if timetable.handed:
                handed = timetable.handed.get(task_id)
                if handed is not None and self.withdraw(handed):
                    timetable.end(handed, None, cancelled=True)
                elif handed is not None:  # claimed: running (or finished, not collected yet)
                    if handed._run is not None:  # if its worker dies, it is not retried
                        handed._run.cancel_requested = True
                    self.requests.append((handed, force))
                    wake = True
                    handed = None
        finally:
            lock.release()
        if pending is not None:
            pending._mark_cancelled()
        if rec is not None:
            rec.future._mark_cancelled()
        if handed is not None:
            handed._mark_cancelled()
        if wake:  # only this thread may touch a running task's block: see apply_requests
            self.wakeup()
        return pending is not None or rec is not None or handed is not None or wake

    def state(self, task_id: Hashable) -> TaskState | None:
        with self.lock:
            return self.timetable.state(task_id, self.claimed)

    def claimed(self, future: Future) -> bool:
        """Under ``self.lock``: whether a handed-out task was claimed by a worker."""
        if future._handle < 0 or future._slot < 0:
            return False
        return not self.slots[future._slot].in_inbox(future._handle)

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        self.thread_id = threading.get_ident()
        self.go.wait()
        if self.start_aborted:  # the pool's creation failed: nothing to run or to clean here
            self.finished.set()
            return
        defer_callbacks(self.callbacks.append)  # for this thread's whole life
        try:
            self.loop()
        except BaseException as exc:
            self.break_pool(exc)
        finally:
            self.callbacks.close()  # before ``finished``: whoever sees it may join the runner
            # From here on (the teardown) this thread calls callbacks itself, as any thread
            # outside the loop does: the runner takes nothing after close().
            defer_callbacks(None)
            self.finished.set()

    def loop(self) -> None:
        while True:
            for fd in self.wait():
                if fd == self.wakeup_fd:
                    self.clear_wakeup()
                elif fd == self.zygote.fileno():
                    self.on_zygote_message(block=False)
                else:
                    worker = self.by_fd.get(fd)
                    if worker is not None:
                        self.on_worker_readable(worker)
            if self.deferred_cancels:  # before dispatch: a cancelled chunk is never injected
                self.cancel_deferred()
            self.collect()
            if self.requests:
                self.apply_requests()
            due = self.next_due
            if (due is not None and due <= time.monotonic()) or self.aging is not None:
                self.release_due()
            if self.ready:
                self.dispatch()
            if self.watched:
                # Under collect_lock: a user thread's collection frees a task's block before
                # end_runs takes it out of ``watched``; in between, the block may carry a new
                # task, and a timeout check would then flag or kill that task's worker.
                with self.collect_lock:
                    self.check_timeouts()
            if self.owner_dropped and not self.draining:
                self.begin_shutdown(False)  # what the Pool's shutdown(wait=False) does
            if self.draining and self.drained():
                self.drain_workers()
                return
            if self.draining and self.by_handle and self.quiescent():
                self.cancel_lost()

    def wait(self) -> list[int]:
        """The loop's one blocking point: until an fd is readable or the next due time.

        While tasks are in flight, also wake on a timer: a worker announces results per batch,
        when idle, or after its next task, so a result followed on the same worker by a long
        task would otherwise wait for that task to end."""
        timeout = RESULT_SWEEP_INTERVAL if self.by_handle else math.inf
        if self.draining and not self.by_handle:  # the drain's condition is polled too
            timeout = DRAIN_POLL_INTERVAL
        if self.ready and not self.by_handle:
            # Queued, with nothing in flight, after dispatch: no inbox had room (or no worker
            # is registered yet; its SPAWNED wakes us). Cancelled entries (TOMBSTONEs) fill
            # them, and their workers drop those without a word to this thread: nothing else
            # would wake it to dispatch again (the tasks never ran).
            timeout = RESULT_SWEEP_INTERVAL
        if self.aging is not None and self.ready:
            timeout = min(timeout, self.aging / 4)
        with self.lock:  # sleep_until under the lock: see schedule()
            due = self.next_due
            self.sleep_until = math.inf if due is None else due
        if due is not None and due - time.monotonic() < timeout:
            timeout = max(0.0, due - time.monotonic())
            if timeout < FINE_WAIT:  # epoll would round up to whole ms; select() waits in us
                select.select([self.epoll.fileno()], [], [], timeout)
                timeout = 0.0
            else:  # wake up to 1 ms early (epoll rounds up), then wait the rest with select()
                timeout -= 0.001
        events = self.epoll.poll(-1 if timeout == math.inf else timeout)
        return [fd for fd, _ in events]

    def drained(self) -> bool:
        """Draining: has all work ended? Decided under ``collect_lock``: a user thread that
        collects in ``help_wait`` pops a task from ``by_handle`` before it frees the task's
        block and settles its future. Seen empty in between, the drain ended and the teardown
        (of a dropped pool, or after ``shutdown``) released the memory under that collector,
        whose ``free_tasks`` then raised and whose future never settled
        (tests/stress/test_lifecycle_races.py, the waiting thread's collection)."""
        with self.collect_lock:
            return self.all_done()

    def all_done(self) -> bool:
        return (
            not self.ready
            and not self.by_handle
            and not self.timetable.busy()
            and (self.header.live_children() == 0 or self.children_phantom())
        )

    def quiescent(self) -> bool:
        """Every slot has a worker that announced sleep with empty rings, an empty run stack
        and an empty done ring: no task runs or waits anywhere in shared memory, and none can
        appear but through this thread (or a user thread's direct dispatch: callers hold
        ``self.lock`` or check again under it)."""
        if any(w is None for w in self.workers):
            return False
        return all(
            s.is_sleeping() and s.is_empty() and not s.run_depth() and not s.done_depth()
            for s in self.slots
        )

    def cancel_lost(self) -> None:
        """Draining, with dispatched tasks left although the pool is quiescent: they were lost
        by an exception (a Ctrl-C's KeyboardInterrupt) that hit a user thread inside an inject
        or a cancel, between the bookkeeping here and the shared-memory step. Such a task is in
        no ring and on no run stack, so it never ran and never will: cancel it, so that the
        drain (and the interpreter's exit) cannot wait for it forever.

        Under ``collect_lock``: a user-thread collector holds handles it took from a done ring
        (in no ring, on no run stack) until it settles them, and ``unread`` keeps some for the
        loop: those tasks ran, they are not lost."""
        with self.collect_lock, self.lock:
            if self.unread or not self.quiescent():
                return
            lost = list(self.by_handle.items())
            self.by_handle.clear()
            for handle, future in lost:
                self.watched.pop(handle, None)
                future._handle = -1
                future._withdrawn = True
            self.drop_stashed([h for h, _ in lost])
            self.slab.free_tasks([h for h, _ in lost])
        logger.warning("mpsched: cancelled %d task(s) lost by an interrupt", len(lost))
        for _, future in lost:
            if future._due is not None:
                with self.lock:
                    self.timetable.end(future, None, cancelled=True)
                    # A version deferred behind it enters the heap: the loop must learn its
                    # due time, or it never ran and the drain waited for it for ever.
                    self.note_heap_due()
            future._mark_cancelled()

    def children_phantom(self) -> bool:
        """After a crash, ``live_children`` may count a child that never was: a worker that
        died inside ``mpsched.submit`` after counting the child and before pushing it. The
        count is then not trusted when the pool is provably quiescent: nothing can spawn then
        (a push needs a running task, and a sleeper wakes only when something is pushed)."""
        return self.crashes > 0 and self.quiescent()

    def release_due(self) -> None:
        """Move the timetable's due versions to the ready queue (and age the ready queue)."""
        now = time.monotonic()
        with self.lock:
            self.next_due = self.timetable.release_due(now, self.make_ready)
            if self.aging is not None and self.ready:
                self.ready.age(now, self.aging)

    def make_ready(self, future: Future, priority: int) -> None:
        """Under ``self.lock``: a version came due (the timetable hands it out)."""
        future._due_at = time.monotonic()
        self.ready.append(future, priority)

    # ------------------------------------------------------------------ dispatch
    def dispatch(self) -> None:
        n = self.n_workers
        with self.lock:
            top = self.ready.top_priority()
            if top is not None:
                self.take_back_lower(top)
            for i in range(n):
                k = (self.next_slot + i) % n
                if self.workers[k] is None or not self.ready:
                    continue
                depth = self.slots[k].inbox_depth()
                if depth == 0:
                    self.inbox_low[k] = _NO_LOW
                room = min(self.window - depth, self.max_inflight - len(self.by_handle))
                if room > 0:
                    batch, lowest = self.take_ready(room)
                    taken = self.inject(k, batch, lowest)
                    if taken < len(batch):  # slab full: the rest waits for results
                        self.ready.putback(batch[taken:])
                        break
            self.next_slot = (self.next_slot + 1) % n

    def take_back_lower(self, top: int) -> None:
        """Under ``self.lock``: a due task of priority ``top`` must not wait behind lower ones
        in the inboxes: take them back (unclaimed entries, under the slot lock: the same race
        as cancel, decided by the lock) to the front of the ready queue, to be re-injected in
        priority order. Costs nothing unless priorities are mixed."""
        for k, low in enumerate(self.inbox_low):
            if low >= top:
                continue
            self.inbox_low[k] = _NO_LOW
            futures = [self.by_handle[h] for h in self.slots[k].drain(include_deque=False)]
            for future in futures:
                future._slot = -1
            self.ready.putback(futures)

    def take_ready(self, n: int) -> tuple[list[Future], int]:
        """Under ``self.lock``: up to ``n`` due tasks, minus recurring runs that misfired."""
        batch, lowest = self.ready.take(n)
        if self.timetable.recurring:
            batch = [f for f in batch if not self.misfired(f)]
        return batch, lowest

    def misfired(self, future: Future) -> bool:
        """Under ``self.lock``: drop a recurring run that is too late, if its policy says so."""
        run = future._run
        if run is None or run.recurrence is None:
            return False
        options = run.options
        if (
            options.misfire != "skip"
            # A retry (its worker died): the run started on time, so it runs again, as the
            # retries option says. Dropped, it continued a recurrence that a schedule of the id
            # may have replaced meanwhile: that next version superseded the new schedule's,
            # whose future never settled (test_a_retried_run_of_a_superseded_recurrence_...).
            or run.retries_left != options.retries
            or not is_misfire(run.run_at, time.monotonic(), options.misfire_grace)
        ):
            return False
        self.misfires += 1
        logger.warning(
            "mpsched: recurring task %r missed its run due at %.3f (more than %.3f s late); "
            "skipped by its misfire policy",
            run.recurrence.task_id,
            run.run_at,
            options.misfire_grace,
        )
        # Taken back from an inbox (take_back_lower): it still holds its slab block and its
        # entry in by_handle. Withdraw it (frees both), or the pool would count it in flight
        # for ever (found by test_misfire_of_a_run_taken_back_from_an_inbox_frees_its_block).
        if future._handle >= 0:
            self.withdraw(future)
        future._withdrawn = True
        self.timetable.end(future, None, cancelled=True)
        if run.recurrence.active:  # else a schedule of the id replaced it: never continue it
            self.continue_recurrence(future, skipped=True)
        return True

    def inject(self, k: int, batch: list[Future], lowest: int) -> int:
        """Under ``self.lock``: write ``batch`` into slab blocks (tasks taken back already have
        theirs) and inject them into inbox ``k`` in one lock round, waking a sleeper. Returns
        how many went (the slab may be full)."""
        if not batch:
            return 0
        slab = self.slab
        new = [f for f in batch if f._handle < 0]
        if new:
            handles = slab.alloc_many(len(new)) if len(new) > 1 else [slab.alloc()]
            if not handles or handles[0] < 0:
                handles = []
            if len(handles) < len(new):
                # Slab short: only the tasks before the first new one left without a block go
                # (those taken back keep theirs); the caller puts the rest back in order. (A
                # batch cut only when no block at all was free injected the rest as handle -1:
                # lost futures, and a worker claiming block -1.)
                batch = batch[: batch.index(new[len(handles)])]
                if not batch:
                    return 0
                new = new[: len(handles)]
            for future, handle in zip(new, handles, strict=False):
                payload = future._payload
                due = future._due
                if due is not None:  # a version of an id: its number follows the call
                    payload = with_version(payload, due.version)
                if not slab.write(handle, payload, uid=TOP_LEVEL_UID, state=0):
                    slab.write(handle, b"", uid=TOP_LEVEL_UID, state=0)
                    slab.set_word(handle, _NBYTES, -self.stash_put(payload))
                run = future._run
                if run is None:
                    future._payload = b""
                else:  # a task taken back keeps its watch: only new ones are registered
                    if not run.retries_left:
                        future._payload = b""  # kept only to run the task again after a crash
                    if run.options.timeout is not None:
                        self.watched[handle] = future
                future._handle = handle
                self.by_handle[handle] = future  # before the inject: a result may come at once
        handles = []
        for future in batch:
            future._slot = k
            handles.append(future._handle)
        slot = self.slots[k]
        queued_before = slot.inbox_depth()
        injected, was_sleeping = slot.inject_wake(handles)
        if injected != len(handles):
            raise BrokenPoolError("inbox overflow: the dispatch window is broken")
        self.inbox_low[k] = min(self.inbox_low[k], lowest)
        if was_sleeping:
            os.eventfd_write(self.wake_fds[k], 1)
        elif (queued_before + injected > 1 or slot.run_depth()) and self.header.sleepers():
            # The worker is busy or gets more than it takes at once: a sleeper may steal some.
            # (One task handed to an idle, awake worker needs no help: a woken peer would find
            # nothing, and its wake-up costs a CPU that the round trip needs.)
            self.wake_sleepers()
        return len(handles)

    def wake_sleepers(self, every: bool = False) -> None:
        """Wake one sleeping worker, or with ``every`` all of them (after a death: the dead
        worker may have died between a publication and its wake-up: a child's DONE published
        and its parent, asleep in ``join``, not woken, which nothing else wakes in an idle
        pool, or a push with the sleeper it owed a wake-up not woken). A woken worker rechecks
        and sleeps again if it has nothing to do; the dead slot's own flag is cleared with the
        rest (its replacement rechecks once)."""
        for k, slot in enumerate(self.slots):
            if slot.is_sleeping() and slot.clear_sleeping():
                os.eventfd_write(self.wake_fds[k], 1)
                if not every:
                    return

    def drop_stashed(self, handles: list[int], field: int = _NBYTES) -> None:
        """Before freeing blocks whose stashed bytes nobody will take: drop them. ``_NBYTES``:
        the arguments of top-level tasks that will not fetch them (withdrawn, lost, or their
        worker died; only a claimer's FETCH takes them out otherwise, so each cancelled task
        with big arguments leaked them here). ``_RESULT_NBYTES``: the result of a task on a
        dead worker's run stack (``recover_slot``, ``fail_child``): a worker sends a big
        result's STASH before the push that hands the key over (the done ring, or DONE in a
        child's block), so one that died in between left bytes that nobody will take; its
        socket was read to EOF before the recovery, so the STASH is in. (A block's result
        words are cleared when it is written, so a negative count is this run's key.)"""
        slab = self.slab
        for handle in handles:
            nbytes = slab.get_word(handle, field)
            if nbytes < 0:
                self.stash.pop(-nbytes, None)

    def stash_put(self, data: bytes) -> int:
        self.stash_counter = counter = (self.stash_counter + 1) & _UID_COUNTER_MASK
        key = (os.getpid() << _UID_PID_SHIFT) | counter  # the counter must not reach the pid
        self.stash[key] = data
        return key

    # ------------------------------------------------------------------ running tasks
    def apply_requests(self) -> None:
        """Cancel requests for running tasks: set the flag the task polls, or kill its worker
        (``force``). Here, not in the user's thread, and under ``collect_lock``: only a
        collector frees top-level blocks, so a block whose future is still in ``by_handle`` is
        still that task's while no collector runs."""
        with self.lock:
            requests, self.requests = self.requests, []
        later = []
        # Under collect_lock, as the timeout check: a user thread's collection (help_wait)
        # pops a task from by_handle and frees its block, and a submit may put a new task
        # into that block at once; between the check below and the write, the flag (or the
        # kill) would reach that task (test_a_cancel_request_never_flags_the_next_task_...).
        with self.collect_lock:
            for future, force in requests:
                handle = future._handle
                if handle < 0 or self.by_handle.get(handle) is not future:
                    continue  # finished meanwhile
                self.slab.set_word(handle, _STATE, _CANCEL_REQUESTED)
                if force and not self.kill_running(future):
                    later.append((future, force))
        if later:  # retried at the next pass (the 5 ms sweep: these tasks are in flight)
            with self.lock:
                self.requests[:0] = later

    def check_timeouts(self) -> None:
        """Tasks with a timeout: note when each is first seen running (claims are not reported;
        the sweep timer bounds the error at RESULT_SWEEP_INTERVAL), ask it to cancel once its
        time is up, and kill its worker after the grace period."""
        now = time.monotonic()
        running = {h for slot in self.slots for h in slot.running()}
        for handle, future in list(self.watched.items()):
            run = future._run
            if handle not in running:
                continue
            if run.started_at is None:
                run.started_at = now
                continue
            overdue = now - run.started_at - run.options.timeout
            if overdue < 0:
                continue
            if not run.timed_out:
                run.timed_out = True
                self.slab.set_word(handle, _STATE, _CANCEL_REQUESTED)
            elif overdue >= run.options.timeout_grace and not run.forced:
                self.kill_running(future)

    def kill_running(self, future: Future) -> bool:
        """Kill the worker running ``future``'s task, and no other: the worker is stopped
        first, and killed only if the task is still on its run stack (else it continues).

        Why the check after the stop is exact, even when the kernel does not show the stop
        within ``STOP_WAIT``: once SIGSTOP is queued, every thread of the worker stops on its
        next return to user mode, so the worker runs no more user code (a thread running on
        another CPU at that instant runs on until the kernel's interrupt reaches it: the few
        microseconds ``wait_stopped`` waits out). Only the worker's own code moves a task off
        its run stack (this thread's recovery aside), so the stack read after the wait is the
        one the SIGKILL hits. A worker that has not shown as stopped after ``STOP_WAIT`` sits in
        the kernel (an uninterruptible wait, or runnable but not scheduled): it has not moved.
        SIGCONT and a later retry instead would keep such a worker's task running and block
        this loop for ``STOP_WAIT`` per pass.

        Returns False if the task runs on a worker not registered yet (its SPAWNED not read:
        a worker takes tasks before that, see ``dispatch_one``): its pid is unknown, so the
        caller must try again later; dropping the request would let the task run on."""
        handle = future._handle
        for k, slot in enumerate(self.slots):
            if handle not in slot.running():
                continue
            worker = self.workers[k]
            if worker is None:
                return False
            try:
                send_signal(worker, signal.SIGSTOP)
                # A worker that died on its own meanwhile (a zombie, or already reaped by the
                # zygote: its run stack still holds the task until the crash path runs) is not
                # stopped: reading its /proc entry raised FileNotFoundError here, out of the
                # loop, and broke the pool (found by
                # test_forced_cancel_of_a_task_whose_worker_dies_meanwhile_keeps_the_pool).
                if not wait_stopped(worker.pid):
                    return True  # dead: the crash path reports it
                if handle in slot.running():
                    if future._run is None:
                        future._run = TaskRun(TaskOptions())
                    future._run.forced = True
                    send_signal(worker, signal.SIGKILL)
                else:
                    send_signal(worker, signal.SIGCONT)
            except ProcessLookupError:
                pass  # it died on its own: the crash path reports it
            return True
        return True

    # ------------------------------------------------------------------ results
    def help_wait(self, future: Future) -> None:
        """A user thread about to block in ``future.result()``: while the pool is lightly
        loaded, spin for a short while collecting done rings itself. The result then reaches the
        caller with one cross-process hop (worker -> this thread) instead of two (worker ->
        coordinator thread -> this thread, ~40 us each here). Adaptive: after repeated misses
        (long tasks) it spins only now and then."""
        if (
            future._slot < 0
            or future._slot in self.starting  # a fork away at least: spinning takes its CPU
            or self.ready  # queued work: the coordinator must go on dispatching anyway
            or len(self.by_handle) > self.n_workers
            or threading.get_ident() == self.thread_id
            or self.disowned  # a fork child's copy: the done rings are the parent's
            or (self.help_misses >= HELP_MISSES_MAX and self.help_calls % HELP_RETRY_EVERY)
        ):
            self.help_calls += 1
            return
        self.help_calls += 1
        try:
            self.help_spin(future)
        except ValueError:
            # The caller saw the future pending, then lost the CPU while the pool settled it,
            # drained and released its memory (only after ``finished``): nothing to help with.
            if not self.finished.is_set():
                raise
            return
        if not future.done():  # a worker may have skipped its poke: the loop must sweep
            self.wakeup()

    def help_spin(self, future: Future) -> None:
        """``help_wait``'s spin: collect done rings until ``future`` is done or time is up."""
        slots = self.slots
        header = self.header
        # Idle workers skip their poke meanwhile: a poke would wake the coordinator thread,
        # which would then take the GIL from this thread for a loop pass (measured: +150 us).
        header.set_collector(True)
        try:
            deadline = time.perf_counter() + HELP_SPIN
            while not future.done():
                if any(slot.done_depth() for slot in slots):
                    self.collect()
                elif time.perf_counter() > deadline:
                    self.help_misses += 1
                    break
            else:
                self.help_misses = 0
        finally:
            header.set_collector(False)

    def collect(self) -> None:
        """Any thread (the coordinator's, or a user thread in ``help_wait``), one at a time.

        A user thread calls the done-callbacks of what it settled once it released
        ``collect_lock``: a callback that waits for another future's result (whose collection
        needs that lock) or shuts the pool down (whose drain decides under it) would otherwise
        wait for this thread. (The coordinator thread's sink is its ``CallbackRunner``.)"""
        if threading.get_ident() == self.thread_id:
            with self.collect_lock:
                self.collect_locked(True)
            return
        settled: list[Future] = []
        previous = defer_callbacks(settled.append)
        try:
            with self.collect_lock:
                self.collect_locked(False)
        finally:
            defer_callbacks(previous)
            if settled:
                invoke_all(settled)

    def collect_locked(self, in_loop: bool) -> None:
        """Under ``collect_lock``: read every done ring (``in_loop``: in the coordinator
        thread, the only one that reads sockets; see ``read_results``)."""
        # First the handles a user-thread collector left (their STASH was not read yet), each
        # entry once: a user thread leaves one whose STASH is still unread to a new list, not
        # to this pass (it would spin, holding collect_lock, for a STASH that only the loop
        # reads, while the loop waits for that lock). One entry at a time, so that an entry is
        # never dropped when reading another one raised.
        unread = self.unread
        if unread:
            self.unread = []
            try:
                while unread:
                    k, handles = unread.pop()
                    self.read_results(k, handles, in_loop)
            finally:
                self.unread += unread  # the entries an exception kept this pass from reading
        for k, slot in enumerate(self.slots):
            if slot.done_depth():
                self.read_results(k, slot.take_done(), in_loop)

    def read_results(self, k: int, handles: list[int], in_loop: bool) -> None:
        """Under ``collect_lock``: settle the tasks of ``handles``, taken from slot ``k``'s done
        ring, and free their blocks. Only the coordinator thread reads sockets: a user thread
        (``help_wait``) leaves a handle whose stashed result has not arrived to the loop
        (``unread``), and so the rest of its batch when an exception (a Ctrl-C's
        KeyboardInterrupt) hits it: those results are fine, and the pool is not broken."""
        slab = self.slab
        outcomes: list[tuple[Future, int, bytes]] = []
        unknown: list[int] = []
        later: list[int] = []  # a user thread's: left to the loop, their blocks kept
        by_handle = self.by_handle
        get_word = slab.get_word
        future = None
        try:
            for handle in handles:
                future = by_handle.get(handle)
                if future is None:
                    unknown.append(handle)
                    continue
                status = get_word(handle, _RESULT_STATUS)
                nbytes = get_word(handle, _RESULT_NBYTES)
                if nbytes >= 0:
                    data = slab.read_result(handle)[1]
                elif in_loop:
                    data = self.stash_take(-nbytes, k)
                else:
                    # Read, and taken out only with the task (below): a handle an exception
                    # leaves to the loop must find its bytes there (taken first, a Ctrl-C
                    # after the take left the loop waiting for a STASH that had come: a hang)
                    stashed = self.stash.get(-nbytes)
                    if stashed is None:  # still in the worker's socket: its arrival wakes the loop
                        later.append(handle)
                        continue
                    data = stashed
                    del by_handle[handle]
                    self.stash.pop(-nbytes, None)
                    outcomes.append((future, status, data))
                    continue
                del by_handle[handle]  # only once read: fail_unread ends it otherwise
                outcomes.append((future, status, data))
        except BaseException as exc:
            # Every handle taken from the ring ends its future, even when reading one raised
            # (in the loop: a stash lost with its worker; the pool then breaks): its block is
            # freed below, so a future left out would never settle and its waiter would hang.
            read = len(outcomes) + len(unknown) + len(later)
            if in_loop:
                self.fail_unread(handles[read:], k, exc, outcomes, unknown)
            else:
                if (
                    read < len(handles)
                    and future is not None
                    and future._handle == handles[read]
                    and handles[read] not in by_handle
                ):
                    # Hit (a Ctrl-C) between taking the task out of by_handle and keeping its
                    # outcome: read already, and no later pass would find it (the loop took
                    # it for an unknown block, and the pool broke)
                    outcomes.append((future, status, data))
                    if nbytes < 0:
                        self.stash.pop(-nbytes, None)
                    read += 1
                later += handles[read:]
            raise
        finally:
            if later:
                self.unread.append((k, later))
            try:
                if unknown or later:
                    kept = {*unknown, *later}
                    slab.free_tasks([h for h in handles if h not in kept])
                else:
                    slab.free_tasks(handles)
            finally:  # a free that raised (a corrupt free stack) breaks the pool: these
                # futures left by_handle above, so its sweep would not end them
                self.completed += len(outcomes)
                self.settle(outcomes)
        if unknown:
            raise InternalError(f"worker {k} completed unknown task blocks {unknown}")

    def fail_unread(
        self,
        handles: list[int],
        slot: int,
        exc: BaseException,
        outcomes: list[tuple[Future, int, bytes]],
        unknown: list[int],
    ) -> None:
        """``read_results`` in the coordinator thread, after reading ``handles[0]``'s result
        raised ``exc`` (the pool then breaks): every one of ``handles`` gets an outcome.
        Results in their blocks are still read (that cannot block); the others fail with the
        error, without waiting for another stash, and their stashed bytes, if they came, are
        dropped."""
        # BrokenPoolError: the exception goes on to break the pool, and every other unfinished
        # future fails with that error too.
        error = BrokenPoolError(
            f"the result of this task could not be read: reading the results of worker "
            f"{slot} raised {exc!r}"
        )
        error.__cause__ = exc
        failed = dump_exception(error)
        slab = self.slab
        for i, handle in enumerate(handles):
            future = self.by_handle.pop(handle, None)
            if future is None:
                unknown.append(handle)
                continue
            nbytes = slab.get_word(handle, _RESULT_NBYTES)
            if i and nbytes >= 0:
                status = slab.get_word(handle, _RESULT_STATUS)
                outcomes.append((future, status, slab.read_result(handle)[1]))
                continue
            if nbytes < 0:
                self.stash.pop(-nbytes, None)
            outcomes.append((future, _ERROR, failed))

    def settle(self, outcomes: list[tuple[Future, int, bytes]]) -> None:
        """Resolve futures; tasks with an id or options first update the timetable (so that a
        caller woken by ``result()`` sees the final ``state()``)."""
        special = []
        loaded: list[tuple[bool, Any] | None] = []  # per special entry: its unpickled result
        for outcome in outcomes:
            future = outcome[0]
            run = future._run
            if future._due is None and run is None:
                resolve(*outcome)
            elif run is not None and run.timed_out and outcome[1] != _OK:
                # It ran out of time: whatever it raised (TaskCancelled, acknowledging the
                # timeout's cooperative cancel, included) it fails with TimeoutError. Converted
                # here, before end_runs, so that state() says FAILED as the future does (not
                # CANCELLED: no cancel was asked for), and a recurrence ends with that error.
                error = dump_exception(TimeoutError(timeout_message(run)))
                special.append((future, _ERROR, error))
                loaded.append(None)
            elif outcome[1] == _OK and (run is None or run.recurrence is None):
                # Unpickled before end_runs: a result that cannot be unpickled fails the
                # future, and state() must then say FAILED, not COMPLETED.
                ok, value = unpickle_result(outcome[2])
                loaded.append((ok, value))
                special.append(outcome if ok else (future, _ERROR, b""))
            else:
                special.append(outcome)
                loaded.append(None)
        if not special:
            return
        self.end_runs(special)
        if threading.get_ident() != self.thread_id:
            self.wakeup()  # a user thread collected: the loop may have new due times
        for (future, status, data), result in zip(special, loaded, strict=True):
            run = future._run
            if run is not None and run.recurrence is not None:
                self.end_recurring_run(future, status, data)
            elif result is not None:
                settle_loaded(future, *result)
            else:
                resolve(future, status, data)

    def stash_take(self, key: int, slot: int) -> bytes:
        """Coordinator thread: stashed result bytes; the STASH message was sent before the
        done-ring push, so it is complete in the worker's socket if it has not been read yet."""
        while key not in self.stash:
            worker = self.workers[slot]
            if worker is None and slot in self.starting:  # its SPAWNED (and socket) is on the way
                self.on_zygote_message(block=True)
                continue
            if worker is None:
                raise ProtocolError(f"stashed result {key} lost with worker {slot}")
            self.on_worker_message(worker, worker.conn.recv_bytes())
        return self.stash.pop(key)

    def end_runs(self, outcomes: list[tuple[Future, int, bytes]]) -> None:
        with self.lock:
            for future, status, _ in outcomes:
                if future._handle >= 0:
                    self.watched.pop(future._handle, None)
                future._handle = -1
                # Kept only to run it again after a crash (retries): a settled future kept its
                # pickled call (arguments of any size) for as long as its caller kept it.
                future._payload = b""
                # Settled from here on: a racing Future.cancel() (which may have read the owner
                # before this) must be refused, not withdraw a version that ran (withdraw reads
                # _handle -1 as "queued here"); resolve() sets the same owner later, unlocked.
                future._owner = FINISHING
                if future._due is not None:
                    self.timetable.end(
                        future, None if status == _OK else _FAILED, cancelled=status == _CANCELLED
                    )
            self.note_heap_due()

    def note_due(self, run_at: float | None) -> None:
        """Under ``self.lock``: the loop must wake at ``run_at`` (None: nothing new)."""
        if run_at is not None and (self.next_due is None or run_at < self.next_due):
            self.next_due = run_at

    def note_heap_due(self) -> None:
        """Under ``self.lock``, after a version ended: a newer version deferred behind it may
        have entered the heap, so the loop must learn the heap's next due time."""
        self.note_due(self.timetable.heap.next_deadline())

    def end_recurring_run(self, future: Future, status: int, data: bytes) -> None:
        """One run of a recurring id ended: schedule the next, or end the recurrence."""
        rec: Recurrence = future._run.recurrence
        if status == _OK and rec.active:
            with self.lock:
                continued = rec.active
                if continued:
                    self.continue_recurrence(future, skipped=False)
            if continued:
                # A user thread's collection (help_wait) woke the loop before this (settle),
                # and the loop may have gone to sleep since without this run's due time.
                if threading.get_ident() != self.thread_id:
                    self.wakeup()
                return
        if status == _OK:
            return  # stopped meanwhile: its future was cancelled then
        with self.lock:
            rec.active = False
            if self.timetable.recurring.get(rec.task_id) is rec:
                del self.timetable.recurring[rec.task_id]
            if status != _CANCELLED:  # it ends with the run's error: refuse a racing cancel
                rec.future._owner = FINISHING  # (cancel_id reads it under this lock)
        if status == _CANCELLED:
            rec.future._mark_cancelled()
        else:  # a run failed: the recurrence ends with its error (as Java's scheduled tasks)
            resolve(rec.future, status, data)

    def continue_recurrence(self, run_future: Future, skipped: bool) -> None:
        """Under ``self.lock``: schedule the run after ``run_future``'s (ended or skipped)."""
        rec: Recurrence = run_future._run.recurrence
        options = rec.options
        # A skipped misfire goes to the grid after now, whatever the overlap policy.
        policy = "skip" if skipped else options.overlap
        every: float = options.every  # type: ignore[assignment]  # set on every recurrence
        run_at, dropped = next_run_at(run_future._run.run_at, every, time.monotonic(), policy)
        self.skipped_runs += dropped
        future = Future(self, rec.call, rec.priority)
        future._run = TaskRun(options, rec, run_at)
        # Each run is a task of its own (``completed`` counts each): submitted counted only
        # the schedule() call, and a recurrence made completed exceed submitted.
        self.submitted += 1
        self.timetable.schedule(rec.task_id, run_at, rec.priority, future)
        self.note_due(run_at)

    # ------------------------------------------------------------------ messages
    def on_worker_readable(self, worker: WorkerHandle) -> None:
        conn = worker.conn
        try:
            while conn.poll():
                self.on_worker_message(worker, conn.recv_bytes())
        except (EOFError, OSError):
            self.on_worker_gone(worker)

    def on_worker_message(self, worker: WorkerHandle, frame: bytes) -> None:
        tag, fields = decode(frame)
        if tag is Tag.RESULTS:
            return  # the done rings are collected after every wake
        if tag is Tag.STASH:
            key, data = fields
            if self.unwanted_stash and key in self.unwanted_stash:
                self.unwanted_stash.discard(key)
                return
            self.stash[key] = data
            for fetcher in self.parked_fetches.pop(key, []):
                # A fetcher that died (its EOF not read yet): the error is its own, not this
                # sender's (on_worker_readable would take this live worker for dead). The
                # bytes stay: its recovery drops them (fail_child).
                with contextlib.suppress(OSError):
                    self.answer_fetch(fetcher, key)
        elif tag is Tag.FETCH:
            key = fields[0]
            if key in self.stash:
                self.answer_fetch(worker, key)
            else:
                self.parked_fetches.setdefault(key, []).append(worker)
        elif tag is Tag.DRAINED:
            worker.drained = True
            self.final_stats[worker.slot] = fields[1]
        elif tag is Tag.RETIRING:
            worker.retiring = True
            worker.left_children = bool(fields[1])
            self.retired_pids.add(worker.pid)  # before its exit, so EXITED finds it here
        elif tag is Tag.INIT_FAILED:
            error = BrokenPoolError(
                f"the pool's initializer raised in worker {fields[0]}; no task can run (the "
                "initializer's exception is the cause)"
            )
            raise error from load_exception(fields[1])
        elif tag is Tag.FATAL:
            raise BrokenPoolError(f"worker {fields[0]} hit an internal error:\n{fields[1]}")
        else:
            raise ProtocolError(f"unexpected {tag.name} from worker {worker.slot}")

    def answer_fetch(self, fetcher: WorkerHandle, key: int) -> None:
        fetcher.conn.send_bytes(encode(Tag.PAYLOAD, key, self.stash[key]))
        del self.stash[key]  # once sent: a dead fetcher's recovery drops what it never got
        self.fetched[fetcher.pid] = key

    def on_zygote_message(self, block: bool) -> None:
        if not block and not self.zygote.poll():
            return
        tag, fields = self.read_zygote()
        if tag is Tag.SPAWNED:
            slot, pid = fields
            self.starting.discard(slot)
            fd = recv_handle(self.zygote)
            conn = Connection(fd)
            try:
                pidfd = os.pidfd_open(pid)
            except ProcessLookupError:
                pidfd = -1
            worker = WorkerHandle(slot, pid, conn, pidfd)
            self.workers[slot] = worker
            self.by_fd[conn.fileno()] = worker
            self.epoll.register(conn.fileno(), select.EPOLLIN)
        elif tag is Tag.EXITED:
            _, pid, code = fields
            if pid in self.retired_pids:
                self.retired_pids.discard(pid)
            else:
                self.exit_codes[pid] = code
        else:
            raise ProtocolError(f"unexpected {tag.name} from the zygote")

    def read_zygote(self) -> tuple[Tag, tuple[Any, ...]]:
        try:
            return decode(self.zygote.recv_bytes())
        except (EOFError, OSError) as exc:
            raise zygote_died() from exc

    # ------------------------------------------------------------------ worker death
    def on_worker_gone(self, worker: WorkerHandle) -> None:
        """The worker's socket hit EOF: it exited (after DRAINED) or died."""
        try:
            self.recover_worker(worker)
        finally:
            self.fetched.pop(worker.pid, None)  # read by its recovery only

    def recover_worker(self, worker: WorkerHandle) -> None:
        self.forget_worker(worker)
        if worker.drained:
            return
        if worker.retiring:  # a clean exit: nothing ran, nothing is held; replace it
            self.recycled += 1
            if worker.left_children:  # else their DONE blocks were never freed
                self.orphan_children(worker.slot, worker.pid)
            if not self.draining or not self.all_done():
                self.spawn(worker.slot)
            return
        self.crashes += 1
        code = self.wait_exit_code(worker.pid)
        if self.has_initializer and self.slots[worker.slot].owner_pid() != worker.pid:
            # It died before bind_owner, i.e. inside the initializer (os._exit, a signal, a
            # crash in native code): an initializer that raises breaks the pool (INIT_FAILED),
            # and so must this one, or every replacement died the same way, in a respawn loop
            # that never ended the pool's futures nor its shutdown.
            raise BrokenPoolError(
                f"worker {worker.slot} (pid {worker.pid}) died with {signal_description(code)} "
                "while it ran the pool's initializer; no task can run. Check the initializer "
                "for os._exit(), a crash in native code, or memory use (the OOM killer)."
            )
        self.recover_slot(worker, code)
        if not self.draining or not self.all_done():
            self.respawns += 1
            self.spawn(worker.slot)

    def forget_worker(self, worker: WorkerHandle) -> None:
        fd = worker.conn.fileno()
        self.by_fd.pop(fd, None)
        with contextlib.suppress(OSError, ValueError):
            self.epoll.unregister(fd)
        # Unlisted before the close: the child of an os.fork() closes its copies of the listed
        # workers' sockets (_lifecycle's disown). os.close releases the GIL before Connection
        # marks itself closed, so a fork by another thread (a new pool's zygote, under fork)
        # could see this socket listed and open while its number was already reused by that
        # pool's control pipe: the zygote closed its own socket and died at start-up
        # (tests/stress/test_lifecycle_races.py, a pool started while another forgets a worker).
        if self.workers[worker.slot] is worker:
            self.workers[worker.slot] = None
        if self.parked_fetches:
            self.drop_parked_fetches(worker)
        worker.conn.close()
        if worker.pidfd >= 0:
            os.close(worker.pidfd)
            worker.pidfd = -1

    def drop_parked_fetches(self, gone: WorkerHandle) -> None:
        """A worker is gone: its FETCHes that wait for a STASH will never be answered (an
        answer would go to a closed socket, and its error was taken for the sender's death).
        Nobody else fetches those keys (one reader per key: the child's claimer, or its
        parent), so their bytes are dropped when they come."""
        for key, fetchers in list(self.parked_fetches.items()):
            if any(f is gone for f in fetchers):
                fetchers[:] = [f for f in fetchers if f is not gone]
                self.unwanted_stash.add(key)
                if not fetchers:
                    del self.parked_fetches[key]

    def wait_exit_code(self, pid: int, timeout: float = 2.0) -> int | None:
        deadline = time.monotonic() + timeout
        while pid not in self.exit_codes and time.monotonic() < deadline:
            if self.zygote.poll(max(0.0, deadline - time.monotonic())):
                self.on_zygote_message(block=True)
        return self.exit_codes.pop(pid, None)

    def recover_slot(self, worker: WorkerHandle, code: int | None) -> None:
        """Settle what the dead worker was running; its queues stay in shared memory.

        A task killed on purpose (forced cancel, timeout) ends cancelled or with TimeoutError;
        one with retries left goes back to the front of the ready queue; any other fails with
        WorkerCrashedError."""
        slot = self.slots[worker.slot]
        slab = self.slab
        slot.break_dead_holder(worker.pid, slot, slab, _CHILD_DONE)
        for other in self.slots:
            if other is not slot:
                other.break_dead_holder(worker.pid, slot, slab, _CHILD_DONE)
        self.slab.break_dead_holder(worker.pid)
        self.header.break_dead_holder(worker.pid)
        self.release_orphans()
        self.collect()
        outcomes: list[tuple[Future, int, bytes]] = []
        taken = []  # freed after the loop: a free that raises must not lose their futures
        try:
            for handle in slot.take_running():
                future = self.by_handle.pop(handle, None)
                if future is None:  # a child: its parent waits on the block
                    self.fail_child(handle, worker, code)
                    continue
                self.drop_stashed([handle])  # it may have died before it fetched them
                self.drop_stashed([handle], _RESULT_NBYTES)
                taken.append(handle)
                run = future._run
                # Retried only if nothing asked it to stop: a run asked to cancel (pool.cancel) or
                # whose timeout expired must not start again after its worker died (it ends as a
                # crash, or with its TimeoutError), as one killed on purpose (forced) is not.
                # Decided under the lock, where cancel_id sets cancel_requested.
                with self.lock:
                    retry = (
                        run is not None
                        and not run.forced
                        and not run.timed_out
                        and not run.cancel_requested
                        and run.retries_left
                        and future._payload
                    )
                    if retry:
                        run.retries_left -= 1
                        self.retried += 1
                        self.watched.pop(handle, None)
                        future._handle = -1
                        future._slot = -1
                        run.started_at = None
                        self.ready.putback([future])
                if retry:
                    continue
                if run is not None and run.forced and not run.timed_out:
                    status, data = _CANCELLED, b""
                elif run is not None and run.timed_out:
                    status, data = _ERROR, dump_exception(TimeoutError(timeout_message(run)))
                else:
                    error = WorkerCrashedError(crash_message(worker, code), code)
                    status, data = _ERROR, dump_exception(error)
                outcomes.append((future, status, data))
            if taken:
                self.slab.free_tasks(taken)
            self.orphan_children(worker.slot, worker.pid)
            self.wake_sleepers(every=True)
        finally:  # a free that raised (a corrupt free stack) breaks the pool: these futures
            # left by_handle above, so its sweep would not end them (as in read_results)
            self.settle(outcomes)

    def orphan_children(self, k: int, pid: int) -> None:
        """The worker of slot ``k`` died: nobody will collect the children its tasks spawned.
        Each such child block (parent ``k``, in use) is settled so that its block is freed:
        a child still queued or running elsewhere is marked ABANDONED under slot ``k``'s lock
        (its executor frees it when it finishes, as for a dropped ChildFuture); one already
        DONE, or one never published (the worker died inside ``mpsched.submit``, between the
        alloc and the push: in no ring and on no run stack), is freed now. A block allocated
        and not yet written (``state`` 0: ``Slab.alloc`` stamps the uid and a zero state
        before its commit, with both chain links -1; ``write_child`` stores the state last) is
        freed too, with the chain it may have (``Slab._attach`` hangs a chain on its block
        whole).

        Snapshots: queued handles first, then run stacks, so that a child moving from a ring to
        a run stack between the two is seen in one of them; a child only moves forward (ring ->
        run stack -> DONE), and DONE is decided under slot ``k``'s lock by the exchange."""
        slab = self.slab
        free = set(slab.free_indices())
        reachable = {h for slot in self.slots for h in slot.drain(remove=False)}
        reachable.update(h for slot in self.slots for h in slot.running())
        parent_slot = self.slots[k]
        done = []  # their results, if stashed, are in the stash: only a FETCH empties it
        unpublished = []  # their arguments, if stashed, too
        unwritten = []
        for handle in range(slab.capacity):
            # A child's uid holds its spawner's pid from its allocation on, and free_children
            # clears it: a block that a live worker is reusing (its parent and state words
            # still stale, or half rewritten) never carries the dead worker's pid.
            if handle in free or slab.get_word(handle, _UID) >> _UID_PID_SHIFT != pid:
                continue
            state = slab.get_word(handle, _STATE)
            if state == 0:
                unwritten.append(handle)
            elif state == _CHILD_ABANDONED and handle not in reachable:
                # Past its run: the dead worker was freeing it, as the parent that saw DONE
                # when it dropped the future (release_abandoned) or as the executor that saw
                # ABANDONED (finish_child stamps its own uid then, in the exchange's hold, so a
                # live executor's block never carries a dead parent's uid; it may be any
                # slot's child, hence no parent check).
                done.append(handle)
            elif slab.get_word(handle, _PARENT) != k:
                continue
            elif state == _CHILD_DONE:
                done.append(handle)
            elif state == _CHILD_QUEUED and handle not in reachable:
                unpublished.append(handle)
            elif state == _CHILD_QUEUED:
                previous = parent_slot.exchange_block_state(slab, handle, _CHILD_ABANDONED)
                if previous == _CHILD_DONE:  # it finished meanwhile: nobody else will free it
                    parent_slot.exchange_block_state(slab, handle, 0)
                    done.append(handle)
        # The spawner wrote the block (uid, NBYTES 0) before it stashed the arguments and
        # stored their key; its socket was read to EOF before this runs, so its STASH is in.
        self.drop_stashed(unpublished)
        self.drop_stashed_results(done, pid)
        to_free = done + unpublished + unwritten
        if to_free:
            slab.free_children(to_free)

    def drop_stashed_results(self, handles: list[int], pid: int) -> None:
        """Before freeing DONE child blocks that nobody will read (``orphan_children``): drop
        their stashed results, as a worker's ``free_unread_child`` does. The executor sent the
        STASH before it marked the child DONE; a live executor's may still be unread in its
        socket: its key is noted and the bytes are dropped when they come. So may that of an
        executor not registered yet (its SPAWNED unread: its pid is unknown here, and a
        worker steals before that): while any slot is starting, a missing key is noted too.
        ``pid``: the dead (or retired) worker that would have read them."""
        slab = self.slab
        live = {w.pid for w in self.workers if w is not None}
        starting = bool(self.starting)
        for handle in handles:
            nbytes = slab.get_word(handle, _RESULT_NBYTES)
            if nbytes >= 0:
                continue
            key = -nbytes
            if self.stash.pop(key, None) is None and (starting or key >> _UID_PID_SHIFT in live):
                self.note_unwanted(key, pid)

    def drop_unfetched_args(self, handle: int, pid: int) -> None:
        """A child on the run stack of dead worker ``pid`` (``fail_child``): arguments stashed
        by its spawner that the dead executor did not get (a worker zeroes the count once its
        FETCH is answered) are dropped; if their STASH has not been read yet (the spawner's
        socket; the executor's FETCH was parked), they are dropped when they come."""
        nbytes = self.slab.get_word(handle, _NBYTES)
        if nbytes < 0 and self.stash.pop(-nbytes, None) is None:
            self.note_unwanted(-nbytes, pid)

    def note_unwanted(self, key: int, pid: int) -> None:
        """Drop the bytes of ``key`` when they come, unless dead worker ``pid`` got them: it
        died between the answer to its FETCH and the store that zeroes the key in its block.
        Those bytes will not come again, and the key stayed in ``unwanted_stash`` for good."""
        if self.fetched.get(pid) != key:
            self.unwanted_stash.add(key)

    def release_orphans(self) -> None:
        """After a death: free locks the dead worker took but died before recording."""
        locks = self.locks
        if locks is None:
            return
        holders = [
            *(s.holder_pid for s in self.slots),
            self.slab.holder_pid,
            self.header.holder_pid,
        ]
        for lock, holder_pid in zip(locks.all(), holders, strict=True):
            if release_if_orphaned(lock, holder_pid, ORPHAN_WAIT):
                logger.warning("mpsched: released a lock left taken by a dead worker")

    def on_lock_stall(self, kind: str, index: int, lock: Any, waited: float) -> None:
        """Any thread of this process, while a guarded lock stays taken (``GuardedLock``): if
        its recorded holder is a dead process, repair the lock (the same repair as after a
        death, which may not have run yet: this thread may be the one that must run it); if no
        holder is recorded for ``ORPHAN_WAIT``, release it as an orphan
        (``_shm.release_if_orphaned`` has the argument)."""
        structure: Any = (
            self.slots[index] if kind == "slot" else self.slab if kind == "slab" else self.header
        )
        holder = structure.holder_pid()
        # No holder recorded for that long: its taker never reached the pid store (it died,
        # or it is a thread of this process that an exception such as a Ctrl-C's
        # KeyboardInterrupt hit between the acquire and the store): it changed nothing.
        if holder == 0 and waited >= ORPHAN_WAIT:
            with self.repair_lock:  # one repair: a second stalled thread finds it free
                if structure.holder_pid() != 0:
                    return
                if lock.acquire(False):  # it came free meanwhile: give it back
                    lock.release()
                    return
                lock.release()
                logger.warning("mpsched: released a lock left taken by a dead worker")
            return
        if holder <= 0 or holder == os.getpid() or not pid_is_dead(holder):
            return
        with self.repair_lock:
            if kind != "slot":
                structure.break_dead_holder(holder)
                return
            owned = [q for q in self.slots if q.owner_pid() == holder]
            if owned:
                structure.break_dead_holder(holder, owned[0], self.slab, _CHILD_DONE)
            else:  # its slot was recovered (ownership cleared): no record of its to check
                structure.break_dead_holder(holder, structure)

    def fail_child(self, handle: int, worker: WorkerHandle, code: int | None) -> None:
        """A child was running in the dead worker: settle it with the crash, wake its parent.
        (A child whose DONE the dead worker published without popping its run-stack record,
        dying in between inside the parent's lock, is not here: ``break_dead_holder`` drops
        that record before it releases the lock, after which the parent may free the block
        and a new task take it. Read here, its state named that task's.)"""
        slab = self.slab
        if slab.get_word(handle, _STATE) == _CHILD_DONE:
            return
        self.drop_unfetched_args(handle, worker.pid)
        self.drop_stashed([handle], _RESULT_NBYTES)  # overwritten below
        slab.release_result_chain(handle)  # a result the dead worker wrote: overwritten too
        error = WorkerCrashedError(crash_message(worker, code), code)
        if not slab.write_result(handle, int(ResultStatus.ERROR), dump_exception(error)):
            raise ProtocolError("a crash report does not fit in a block")
        parent = slab.get_word(handle, int(BlockField.PARENT))
        previous = self.slots[parent].exchange_block_state(slab, handle, _CHILD_DONE)
        self.header.add_live_children(-1)
        if previous == _CHILD_ABANDONED:
            slab.free_children([handle])
        elif self.slots[parent].clear_sleeping():
            os.eventfd_write(self.wake_fds[parent], 1)

    # ------------------------------------------------------------------ shutdown
    def begin_shutdown(self, cancel_futures: bool) -> None:
        """Any thread: no more submissions reach here (the pool checks); drain from now on.

        Recurring tasks stop unless ``recurring_after_shutdown``; timed one-shot tasks still run
        when due unless ``timed_after_shutdown`` is False; ``cancel_futures`` cancels all that
        has not started."""
        with self.lock:
            self.draining = True
            # cancel_futures stops kept recurrences too: their next runs are tasks not started,
            # and a recurrence left going would keep the drain (and an interrupted ``with``
            # block's exit) waiting for a cancel that nothing will send.
            keep = self.recurring_after_shutdown and not cancel_futures
            stopped = [] if keep else self.timetable.stop_recurrences()
            cancelled = [r.future for r in stopped]
            for rec in stopped:  # withdraw their next runs that no worker has claimed
                pending = self.timetable.pending_future(rec.task_id)
                if pending is not None and self.timetable.withdraw_pending(pending):
                    cancelled.append(pending)
                # While ``rec`` is its id's recurrence, the id's handed-out version is a run of
                # it, or an older version already running (a schedule replacing the recurrence
                # would have stopped it): an unclaimed one is ``rec``'s next run.
                handed = self.withdraw_handed(rec.task_id)
                if handed is not None:
                    cancelled.append(handed)
            if cancel_futures or not self.timed_after_shutdown:
                # Not the next runs of kept recurrences (only left in ``recurring`` by ``keep``):
                # withdrawn here, such a run would leave its recurrence with no next run and its
                # future pending for ever.
                cancelled += self.timetable.cancel_all_pending()
        for future in cancelled:
            future._mark_cancelled()
        if cancel_futures:
            self.cancel_everything_unclaimed()

    def abort_running(self) -> None:
        """Any thread (an interrupted ``with`` block, after ``begin_shutdown``): stop every
        running task by killing its worker (``kill_running``, in the coordinator thread)."""
        with self.lock:
            self.requests.extend((future, True) for future in self.by_handle.values())
        self.wakeup()

    def cancel_everything_unclaimed(self) -> None:
        with self.lock:
            queued = self.ready.drain()
            injected = list(self.by_handle.values())
            for future in queued:
                if future._handle >= 0:  # taken back from an inbox: holds a block
                    self.withdraw(future)
                future._withdrawn = True
                if future._due is not None:
                    self.timetable.end(future, None, cancelled=True)
        for future in queued:
            future._mark_cancelled()
        for future in injected:
            future.cancel()  # wins only against a claim that has not happened

    def drain_workers(self) -> None:
        """The handshake: DRAIN to every worker, read until DRAINED or EOF, then STOP.

        A worker still starting (its SPAWN was sent, so the zygote forks it before it reads
        STOP) is waited for and drained too: STOP first would leave the zygote's SPAWNED
        unread and that worker undrained."""
        live: list[WorkerHandle] = []
        deadline = time.monotonic() + DRAIN_TIMEOUT
        while True:
            for worker in self.workers:
                if worker is not None and not any(worker is w for w in live):
                    live.append(worker)
                    with contextlib.suppress(OSError):
                        worker.conn.send_bytes(_DRAIN)
            if not self.starting and not any(self.workers[w.slot] is w for w in live):
                break
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                break
            for fd, _ in self.epoll.poll(timeout):
                if fd == self.zygote.fileno():
                    try:
                        self.on_zygote_message(block=False)
                    except BrokenPoolError:  # the zygote is gone: no worker will start
                        self.epoll.unregister(fd)
                        self.starting.clear()
                elif (readable := self.by_fd.get(fd)) is not None:
                    self.on_worker_readable(readable)
        for worker in live:
            if self.workers[worker.slot] is worker:  # did not answer in time
                self.forget_worker(worker)
        with contextlib.suppress(OSError):
            self.zygote.send_bytes(encode(Tag.STOP))

    def break_pool(self, exc: BaseException) -> None:
        """An internal error: fail every unfinished future with BrokenPoolError."""
        if isinstance(exc, BrokenPoolError):  # already says what broke (e.g. the initializer)
            error = exc
        else:
            error = BrokenPoolError(f"the pool broke: {exc!r}")
            error.__cause__ = exc
        with self.lock:
            self.broken = exc  # under the lock: no submit can queue behind the sweep below
            self.draining = True
            futures = self.ready.drain() + list(self.by_handle.values())
            futures += [r.future for r in self.timetable.stop_recurrences()]
            # Every version of an id ends FAILED, as its future does (withdrawn, a pending one
            # read CANCELLED and a handed-out one PENDING or RUNNING for ever, and state() then
            # read the released shared memory once the pool had ended).
            futures += self.timetable.fail_all()
            self.by_handle.clear()
        for future in futures:
            future._owner = FINISHING
            settle_error(future, error)
        for worker in list(self.workers):
            if worker is not None:
                self.forget_worker(worker)
        with contextlib.suppress(OSError):
            self.zygote.send_bytes(encode(Tag.STOP))

    def close(self) -> None:
        self.epoll.close()


def zygote_died() -> BrokenPoolError:
    return BrokenPoolError(
        "the pool's zygote process died (if this happened at start-up, its traceback is above: "
        "e.g. the main module could not be imported under spawn)"
    )


def crash_message(worker: WorkerHandle, code: int | None) -> str:
    return (
        f"the worker process (pid {worker.pid}, slot {worker.slot}) running this task died "
        f"with {signal_description(code)}. Likely causes: it ran out of memory and was killed "
        "(check dmesg for the OOM killer), a crash in native code (a C extension), or "
        "os._exit() / a signal sent to it. The pool goes on, and replaces the worker unless "
        "it is shutting down with nothing left to run."
    )


def timeout_message(run: TaskRun) -> str:
    return f"the task ran longer than its timeout of {run.options.timeout} s" + (
        f" and was killed {run.options.timeout_grace} s later" if run.forced else ""
    )


def pid_is_dead(pid: int) -> bool:
    """True if ``pid`` has exited (a zombie counts as dead: it runs no more code)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] in (b"Z", b"X")


def send_signal(worker: WorkerHandle, sig: int) -> None:
    """Signal the worker through its pidfd (never another process that reused its pid once the
    zygote reaped it). ProcessLookupError if it was reaped. A worker without a pidfd was reaped
    before its registration (``pidfd_open`` found no such process): it is never signalled by
    pid, which may name another process by now; its socket's EOF reports the death."""
    if worker.pidfd < 0:
        raise ProcessLookupError(worker.pid)
    signal.pidfd_send_signal(worker.pidfd, sig)


def wait_stopped(pid: int) -> bool:
    """Wait (bounded) until ``pid`` shows as stopped: SIGSTOP is delivered asynchronously.
    False if it is dead (a zombie, or reaped: it runs no more code)."""
    deadline = time.monotonic() + STOP_WAIT
    path = f"/proc/{pid}/stat"
    while time.monotonic() < deadline:
        try:
            with open(path, "rb") as f:
                stat = f.read()
        except (FileNotFoundError, ProcessLookupError):
            return False
        state = stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3]
        if state in (b"T", b"t"):
            return True
        if state in (b"Z", b"X"):
            return False
        os.sched_yield()
    return True  # not shown as stopped in time: still frozen (see kill_running)


def settle_error(future: Future, error: BaseException) -> None:
    future._owner = FINISHING
    with contextlib.suppress(Exception):
        if not future.done():
            future.set_exception(error)


def unpickle_result(data: bytes) -> tuple[bool, Any]:
    """``(True, value)``, or ``(False, RuntimeError)`` if the result cannot be unpickled."""
    try:  # user code runs here (__setstate__, __reduce__): SystemExit included
        return True, pickle.loads(data)
    except BaseException as exc:
        return False, unpickling_failed(exc)


def settle_loaded(future: Future, ok: bool, value: Any) -> None:
    """Settle a task's future with an unpickled result (``unpickle_result``'s pair)."""
    future._owner = FINISHING
    if future.done():  # cancelled meanwhile: a race the claim decided; nothing to report
        return
    if ok:
        with contextlib.suppress(InvalidStateError):  # cancelled meanwhile
            future.set_result(value)
    else:
        with contextlib.suppress(Exception):
            future.set_exception(value)


def resolve(future: Future, status: int, data: bytes) -> None:
    """Settle a task's future from its result bytes (coordinator thread, no lock held)."""
    future._owner = FINISHING
    if future.done():  # cancelled meanwhile: a race the claim decided; nothing to report
        return
    if status == _OK:
        settle_loaded(future, *unpickle_result(data))
    elif status == _CANCELLED:
        future._mark_cancelled()
    else:
        with contextlib.suppress(InvalidStateError):
            future.set_exception(load_exception(data))
