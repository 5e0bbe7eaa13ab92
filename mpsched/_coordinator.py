"""The coordinator: one thread in the pool's process that feeds the workers and reaps results.

Owns (as a whole): the ready queue (due tasks not yet handed out, by priority), the timetable
(tasks with an id: the scheduler heap and the versions handed out), the records of dispatched
tasks (by slab block), the stash of payloads too big for a block, the worker handles (pid,
socket, pidfd), the cancel requests and timeout watch of running tasks, and the drain
handshake. Called from: user threads through ``Pool`` (``submit``, ``schedule``, ``cancel``,
``cancel_id``, ``state``, ``begin_shutdown``; each takes ``self.lock`` briefly and wakes the
loop if needed), and its own thread (``run``, from ``_lifecycle.run_coordinator``). Everything
else runs in the coordinator thread only, but for ``help_wait`` (a user thread collecting) and
``on_lock_stall`` (any thread). Nothing here references the ``Pool`` (a dropped pool must be
collectable): when it is collected, ``shutdown_asked`` is set and the loop begins the
shutdown (as for a shutdown called back inside a pool call: ``_lifecycle.interrupted_pool_call``).

``Coordinator`` is one object made of parts, one module each (``_coord_state`` lists them and
holds the attributes): this module keeps start-up, ``submit``, the loop, the stash and the
messages from the zygote and the workers; ``_coord_dispatch`` hands tasks to the inboxes,
``_coord_timed`` the tasks with an id,
``_coord_cancel`` withdrawing and stopping tasks, ``_coord_collect`` the results,
``_coord_recovery`` a worker's death and ``_coord_drain`` the shutdown.

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
"""

from __future__ import annotations

import contextlib
import errno
import math
import multiprocessing.process
import os
import select
import signal
import sys
import threading
import time
import warnings
from multiprocessing.connection import Connection
from typing import Any

from mpsched._coord_cancel import Cancelling
from mpsched._coord_collect import Collecting
from mpsched._coord_dispatch import Dispatching
from mpsched._coord_drain import Draining
from mpsched._coord_recovery import Recovering
from mpsched._coord_state import (
    _NBYTES,
    _UID_PID_SHIFT,
    WorkerHandle,
    signal_description,
)
from mpsched._coord_timed import Timing
from mpsched._errors import (
    POOL_CLOSED_MESSAGE,
    POOL_NOT_PICKLABLE_MESSAGE,
    PoolClosedError,
    ProtocolError,
)
from mpsched._future import SETTLING, Future, defer_callbacks, release_if_left
from mpsched._pool_errors import BrokenPoolError
from mpsched._protocol import (
    Tag,
    decode,
    encode,
    frame_watch,
    load_exception,
    recv_fd,
    recv_message,
    send_data,
    sigpipe_blocked,
)
from mpsched._shm import SELECT_FD_LIMIT
from mpsched._stdio import above_stdio

_UID_COUNTER_MASK = (1 << _UID_PID_SHIFT) - 1  # counters wrap: see _children.UID_COUNTER_MASK
RESULT_SWEEP_INTERVAL = 0.005  # seconds between done-ring sweeps while tasks are in flight
# The sweep goes lazy after this many timer passes in a row that collected nothing (the tasks
# run longer than a sweep's period, so most sweeps would wake the process for nothing) ...
QUIET_SWEEPS = 2
# ... and then sweeps this often (seconds), the workers poking each result that finds its done
# ring empty: a safety net (the orphaned-lock poll, ORPHAN_POLL_INTERVAL, rides on it), ~10
# wake-ups a second instead of 200 while long tasks run (docs/design.md, "Lazy sweep").
LAZY_SWEEP_INTERVAL = 0.1
# While draining with nothing in flight, the loop re-checks the drain condition this often: the
# last children may finish without waking it (a child's DONE wakes its parent, not the loop).
DRAIN_POLL_INTERVAL = 0.05  # seconds
# Seconds the coordinator waits, at the zygote's EOF, for its exit status (the message of the
# pool's error names it): it closes its socket as it exits, so this is only a bound.
ZYGOTE_STATUS_WAIT = 1.0
# A poll timeout shorter than this is waited with select() on the epoll fd: epoll rounds its
# timeout up to whole milliseconds, which would make every timed task ~0.5 ms late on average.
FINE_WAIT = 0.002  # seconds
# The longest single wait (s): epoll takes at most 2**31 - 1 ms (~24.8 days; a task due further
# ahead raised OverflowError in the loop and broke the pool), so a far due time is waited for in
# waits of at most this, each followed by a pass that finds nothing due and waits again.
MAX_WAIT = 3600.0
# SPAWNs sent and not answered yet. The zygote answers each with SPAWNED and the worker's
# socket, an SCM_RIGHTS message whose room in a socket buffer (~1 KiB each) is far above its
# bytes: ~600 SPAWNs sent in one pass (a map that woke every dormant worker of Pool(600))
# filled the zygote's way back while it forked, it stopped reading, and the rest of the SPAWNs
# filled the way there: both sides waited for ever (found in review). The rest wait for the
# next passes, which the answers wake.
SPAWNS_IN_FLIGHT_MAX = 32
# A worker that could not start for now (the pool's process or the zygote out of fds, or a
# process limit: SPAWN_FAILED) is asked for again after this many seconds, as its slot's work
# still wants it; with no worker running, the pool breaks once every try failed for
# SPAWN_GIVE_UP seconds (its tasks could not run).
SPAWN_RETRY_INTERVAL = 0.5
SPAWN_GIVE_UP = 10.0
# fds that the pool's process takes for a new worker: its socket and its pidfd (``recv_fd``
# takes no duplicate of the zygote's socket, as ``recv_handle`` did).
FDS_PER_NEW_WORKER = 2


class Coordinator(Timing, Dispatching, Cancelling, Collecting, Recovering, Draining):
    def __reduce__(self) -> Any:
        # A pool's bound ``cancel`` is this object's (see Pool.__init__): sent to a task, it
        # fails as the pool would, not on whichever lock the pickler meets first.
        raise TypeError(POOL_NOT_PICKLABLE_MESSAGE)

    # ------------------------------------------------------------------ start-up
    def mark_starting(self, initial: list[int]) -> None:
        """Before the loop runs: the ``initial`` workers are starting (the zygote forks them
        from its config after READY, or after START, with no SPAWN); the others are dormant
        (``wake_dormant``). The loop registers each worker as its SPAWNED comes; until then a
        task may already be injected into its inbox (``dispatch_one``), where the worker finds
        it when it starts, or a peer steals it. Nothing waits for the round trip."""
        self.starting.update(initial)
        self.dormant = [k for k in range(self.n_workers) if k not in self.starting]

    def wake_dormant(self) -> None:
        """Coordinator thread, each loop pass: ask for dormant workers once they are wanted:
        one for each top-level task (in flight or queued) beyond the workers asked for, or all
        of them once a worker pushed a child (WANT_PEERS: its children are for peers to steal,
        and the coordinator does not see them). Not for a result: a pool used one task at a
        time needs one worker, and forking the others as a result comes would take the CPUs
        that its way to the caller needs (docs/design.md, "Dormant workers")."""
        if self.spawn_retry_at and self.spawn_retry_at > time.monotonic():
            return
        if self.peers_wanted:
            wanted = len(self.dormant)
        else:
            asked = self.n_workers - len(self.dormant)
            wanted = len(self.by_handle) + len(self.ready) - asked
            if wanted <= 0:
                return
        wanted = min(wanted, SPAWNS_IN_FLIGHT_MAX - len(self.starting))
        if wanted <= 0:
            return
        slots, self.dormant = self.dormant[:wanted], self.dormant[wanted:]
        for slot in slots:
            self.spawn(slot)  # while some stay dormant, its first child asks for them

    def spawn(self, slot: int) -> None:
        # Room for the workers still starting too: each takes its fds as its SPAWNED comes,
        # and a pass that woke several dormant ones checked each alone, so the last ones'
        # sockets could not be received, which broke the pool (found in review).
        short = _fds_short(self.zygote.fileno(), FDS_PER_NEW_WORKER * (len(self.starting) + 1))
        if short is not None:  # the worker's socket could not be received: see spawn_failed
            self.spawn_failed(slot, f"no fd free in the pool's process: {short}")
            return
        self.starting.add(slot)
        try:
            # With whether peers are still dormant: a replacement asks for them (WANT_PEERS)
            # at its first child, as the first worker does.
            self.send_to_zygote(Tag.SPAWN, slot, bool(self.dormant))
        except OSError as exc:  # EPIPE: it died, its EOF not read yet (e.g. during a recovery)
            raise self.zygote_death() from exc

    def spawn_failed(self, slot: int, error: str) -> None:
        """Coordinator thread: ``slot``'s worker could not start for now (``error``): the slot
        is dormant again, asked for again after ``SPAWN_RETRY_INTERVAL`` if its work still
        wants it. The pool broke for good at the first such failure, even while another
        worker ran (found in review); now only once no worker runs and every try failed for
        ``SPAWN_GIVE_UP`` seconds. The first failure of a run of them is told as a warning."""
        self.starting.discard(slot)
        self.dormant.append(slot)
        if self.slots[slot].inbox_depth():  # tasks handed to it while it was starting:
            self.wake_sleepers()  # a sleeping peer steals them
        now = time.monotonic()
        self.spawn_retry_at = now + SPAWN_RETRY_INTERVAL
        if not self.spawn_warned:
            self.spawn_warned = True
            # Told, not raised: under ``-W error`` the warning raised here, out of the loop,
            # and broke the pool that the retry keeps.
            with contextlib.suppress(Warning):
                warnings.warn(
                    f"mpsched: a worker of the pool could not start ({error}); trying again",
                    RuntimeWarning,
                    2,
                )
        # The clock of the give-up runs only while no worker runs: it counted from the first
        # failure, so after failures while a worker ran, that worker's death broke the pool
        # at the first failed try of its replacement (found in review).
        if self.starting or any(self.workers):
            self.stranded_since = None
        elif self.stranded_since is None:
            self.stranded_since = now
        elif now - self.stranded_since > SPAWN_GIVE_UP:
            raise BrokenPoolError(f"no worker could start for {SPAWN_GIVE_UP:g} s: {error}")

    def release_workers(self, modules: tuple[str, ...] = ()) -> None:
        """Any thread: let a zygote that awaits START fork the initial workers, after it
        imported ``modules`` (the pool's first task's, which every worker then inherits).
        Sent by the pool's first submission, or by the drain's start (workers must answer it)
        if none came; a no-op once sent. Noted as sent only after the send: a Ctrl-C between
        the two makes a later call send a second START, which the zygote ignores."""
        with self.zygote_send_lock:
            if self.workers_released:
                return
            # Before the send: the zygote's answer to it (SPAWNED) may be read first.
            self.start_modules = tuple(m for m in modules if m not in sys.builtin_module_names)
            try:
                with sigpipe_blocked():
                    self.zygote.send_bytes(encode(Tag.START, modules, process_state()))
            except OSError:  # EPIPE: the zygote died; the loop reads its EOF, breaks the pool
                self.start_modules = ()
            self.workers_released = True

    def zygote_death(self) -> BrokenPoolError:
        """Once the zygote's socket is at its end: the pool's error (``zygote_died``), with the
        modules that it was importing (START's, until it forked) and its exit code, waited for
        ``ZYGOTE_STATUS_WAIT`` at most (it closes the socket as it exits)."""
        status = self.zygote_status
        return zygote_died(
            () if self.forked_any else self.start_modules,
            None if status is None else status(ZYGOTE_STATUS_WAIT),
        )

    def send_to_zygote(self, tag: int, *fields: Any) -> None:
        """Coordinator thread: one command to the zygote, never in the middle of a submitting
        thread's START. Raises OSError if the zygote is gone."""
        with self.zygote_send_lock, sigpipe_blocked():
            self.zygote.send_bytes(encode(tag, *fields))

    def wait_ready(self, timeout: float) -> tuple[str, ...]:
        """Before the loop runs, in the pool's thread: wait for the zygote's READY (it has
        opened the locks: their names may go; a zygote that cannot start fails the pool's
        creation here). Returns the names in the zygote's ``__main__``, its workers'."""
        if not self.zygote.poll(timeout):
            raise BrokenPoolError(f"the pool's zygote did not start within {timeout} s")
        tag, fields = self.read_zygote()
        if tag != Tag.READY:
            raise ProtocolError(f"the zygote sent {Tag.name(tag)} before READY")
        return fields[0]  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ user-thread API
    def check_usable(self) -> None:
        """Under ``self.lock``: may a new task come in? (Not once the pool broke or began to
        shut down: the drain must not see a task arrive after it began.)"""
        broken = self.broken
        if broken is not None:
            # Caused by what broke it, as its futures' errors are: the cause of a
            # BrokenPoolError that says so (the initializer's exception), not that error.
            if isinstance(broken, BrokenPoolError):
                raise BrokenPoolError(f"the pool is broken: {broken}") from (
                    broken.__cause__ or broken
                )
            raise BrokenPoolError(f"the pool is broken: {broken!r}") from broken
        if self.draining:
            raise PoolClosedError(POOL_CLOSED_MESSAGE)

    def submit(self, future: Future[Any], direct: bool = False) -> bool:
        """Any thread: when the pool is idle (nothing queued or in flight), hand the task to a
        worker at once, one thread hop less on the latency path; otherwise queue it for the
        coordinator, which dispatches in batches with at most one wake-up per batch (a burst
        injected task by task would pay one eventfd write per task to workers that keep
        falling asleep). ``direct`` (a chunk of ``Pool.map``: milliseconds of work, a few at a
        time): at once also while tasks are in flight, if nothing is queued and the inboxes hold
        no task of another priority (``keeps_order``). Queued, a map's
        chunks waited for the coordinator thread, which waited for the GIL while the caller
        pickled the next chunks, and the workers idled (docs/design.md, "Pool.map"). Returns
        True if the coordinator loop must be woken.

        Raises:
            PoolClosedError, BrokenPoolError: see ``check_usable``.
        """
        lock = self.lock
        try:
            lock.acquire()  # not ``with``: see _future.LEFT_LOCK_WAIT
        except BaseException:  # a Ctrl-C may leave it taken: see _future.LEFT_LOCK_WAIT
            release_if_left(lock)
            raise
        try:
            try:
                if self.broken is not None or self.draining:
                    self.check_usable()
                self.submitted += 1
                # When it became due: a timed version released later queues ahead of it if it
                # became due first (ReadyQueue.append_due); and aging reads it, also for a task
                # injected here and taken back (take_back_lower): left at 0.0 it read as waiting
                # since the clock's epoch and jumped above every priority.
                future._due_at = now = time.monotonic()
                # Not past a timed version that is due and not yet out of the heap (the loop
                # moves it to the ready queue, ahead of this task: it became due first).
                due = self.next_due
                if (
                    not self.ready
                    and (not self.by_handle or (direct and self.keeps_order(future._priority)))
                    and (due is None or due > now)
                    and self.dispatch_one(future)
                ):
                    return future._run is not None  # a timeout needs the loop's watch
                self.ready.append(future, future._priority)
            finally:
                lock.release()
        except BaseException:
            if future._withdrawn:  # an interrupted direct dispatch withdrew it: see inject
                future._mark_cancelled()
            raise
        return True

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        self.thread_id = threading.get_ident()
        self.go.wait()
        if self.start_aborted:  # the pool's creation failed: nothing to run or to clean here
            self.finished.set()
            return
        SETTLING.add(self.thread_id)  # until the finally below
        defer_callbacks(self.callbacks.append)  # for this thread's whole life
        try:
            self.loop()
        except BaseException as exc:
            self.break_pool(exc)
        finally:
            try:
                self.log_deferred()  # (the last pass's)
            finally:
                SETTLING.discard(self.thread_id)
                self.callbacks.close()  # before ``finished``: whoever sees it may join it
                # From here on (the teardown) this thread calls callbacks itself, as any
                # thread outside the loop does: the runner takes nothing after close().
                defer_callbacks(None)
                self.finished.set()

    def loop(self) -> None:
        while True:
            fds = self.wait()
            for fd in fds:
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
            if self.by_handle or self.draining:
                # A shared lock that a user thread's Ctrl-C left taken with no holder recorded
                # stops the workers that wait for it (unguarded) until this process waits too.
                self.poll_orphans()
            if self.requests:
                self.apply_requests()
            due = self.next_due
            if (due is not None and due <= time.monotonic()) or self.aging is not None:
                self.release_due()
            if self.ready:
                self.dispatch()
            if self.dormant:
                self.wake_dormant()
            if self.deferred_logs:  # a misfire's, from collect or dispatch
                self.log_deferred()
            if self.watched:
                # Under collect_lock: a user thread's collection frees a task's block before
                # end_runs takes it out of ``watched``; in between, the block may carry a new
                # task, and a timeout check would then flag or kill that task's worker.
                with self.collect_lock:
                    self.check_timeouts()
            if self.shutdown_asked and (
                not self.draining or (self.cancel_asked and not self.cancelling)
            ):
                self.begin_shutdown(self.cancel_asked)  # as the Pool's shutdown(wait=False)
            if self.draining and self.drained():
                self.drain_workers()
                return
            if self.draining and self.by_handle and self.quiescent():
                self.cancel_lost()
            self.pace_sweep(timer=not fds)

    def pace_sweep(self, timer: bool) -> None:
        """After each pass: how often ``wait`` sweeps the done rings while tasks are in flight.

        Every RESULT_SWEEP_INTERVAL while results come, or while another check of the loop's
        needs its timer (a task's timeout, a queued task, a cancel request, the drain);
        lazily, every LAZY_SWEEP_INTERVAL, after QUIET_SWEEPS timer passes in a row that
        collected nothing. While the header's ``lazy_sweep`` is set, a worker pokes each
        result that it pushed into an empty done ring (before its next task, or at idle); one
        pushed behind another is collected with it. Going lazy, the word is set first, then
        every done ring is taken under its lock: a push after that take reads the word set (a
        worker reads it after its push's lock round), and one before it is collected here.
        Any result collected, by this thread or a user thread's ``help_wait``, makes the
        sweep eager again."""
        completed = self.completed
        if completed != self.completed_seen or not self.may_sweep_lazily():
            self.completed_seen = completed
            self.quiet_sweeps = 0
            if self.sweep_lazy:
                self.sweep_lazy = False
                self.header.set_lazy_sweep(False)
            return
        if not timer or self.sweep_lazy:
            return
        self.quiet_sweeps += 1
        if self.quiet_sweeps < QUIET_SWEEPS:
            return
        self.header.set_lazy_sweep(True)
        with self.collect_lock:
            self.collect_locked(True, every=True)
        if self.completed == completed:
            self.sweep_lazy = True
        else:  # results came after all: stay eager
            self.header.set_lazy_sweep(False)
            self.completed_seen = self.completed
            self.quiet_sweeps = 0

    def may_sweep_lazily(self) -> bool:
        return bool(self.by_handle) and not (
            self.ready
            or self.watched
            or self.requests
            or self.deferred_cancels
            or self.unread
            or self.draining
        )

    def wait(self) -> list[int]:
        """The loop's one blocking point: until an fd is readable or the next due time.

        While tasks are in flight, also wake on a timer: a worker announces results per batch,
        when idle, or after its next task, so a result followed on the same worker by a long
        task would otherwise wait for that task to end (its period: ``pace_sweep``)."""
        timeout = math.inf
        if self.by_handle:
            timeout = LAZY_SWEEP_INTERVAL if self.sweep_lazy else RESULT_SWEEP_INTERVAL
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
        if due is not None and due - time.monotonic() < min(timeout, MAX_WAIT):
            timeout = max(0.0, due - time.monotonic())
            if timeout < FINE_WAIT:  # epoll would round up to whole ms; select() waits in us
                fd = self.epoll.fileno()
                if fd < SELECT_FD_LIMIT:
                    select.select([fd], [], [], timeout)
                else:  # no wait in us takes this fd: an event waits for the due time's pass
                    time.sleep(timeout)
                timeout = 0.0
            else:  # wake up to 1 ms early (epoll rounds up), then wait the rest with select()
                timeout -= 0.001
        elif due is not None:  # far ahead: wake before it, to wait again (see MAX_WAIT)
            timeout = min(timeout, MAX_WAIT)
        events = self.epoll.poll(-1 if timeout == math.inf else timeout)
        return [fd for fd, _ in events]

    # ------------------------------------------------------------------ stash
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

    # ------------------------------------------------------------------ messages
    def on_worker_readable(self, worker: WorkerHandle) -> None:
        conn = worker.conn
        try:
            while worker.frame_waiting():
                self.on_worker_message(worker, *recv_message(conn))
        except (EOFError, OSError):
            self.on_worker_gone(worker)

    def on_worker_message(self, worker: WorkerHandle, tag: int, fields: tuple[Any, ...]) -> None:
        if tag == Tag.RESULTS:
            return  # the done rings are collected after every wake
        if tag == Tag.STASH:
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
        elif tag == Tag.FETCH:
            key = fields[0]
            if key in self.stash:
                self.answer_fetch(worker, key)
            else:
                self.parked_fetches.setdefault(key, []).append(worker)
        elif tag == Tag.DRAINED:
            worker.drained = True
            self.final_stats[worker.slot] = fields[1]
        elif tag == Tag.WANT_PEERS:
            self.peers_wanted = True  # the loop's wake_dormant, after this pass's messages
        elif tag == Tag.RETIRING:
            worker.retiring = True
            worker.left_children = bool(fields[1])
            # Its EXITED comes on the zygote's socket, which the loop may read first: then
            # its code is dropped here (a clean exit is no crash report), else EXITED finds
            # the pid in ``retired_pids``. Either way neither keeps an entry for it (both
            # did, for ever, at ~5% of recycles: a later worker reusing the pid then
            # crashed with this exit code, and its own EXITED was dropped).
            if self.exit_codes.pop(worker.pid, None) is None:
                self.retired_pids.add(worker.pid)
        elif tag == Tag.INIT_FAILED:
            error = BrokenPoolError(
                f"the pool's initializer raised in worker {fields[0]}; no task can run (the "
                "initializer's exception is the cause)"
            )
            raise error from load_exception(fields[1])
        elif tag == Tag.FATAL:
            raise BrokenPoolError(f"worker {fields[0]} hit an internal error:\n{fields[1]}")
        else:
            raise ProtocolError(f"unexpected {Tag.name(tag)} from worker {worker.slot}")

    def answer_fetch(self, fetcher: WorkerHandle, key: int) -> None:
        # Out of the stash before the send: taken out after it, the bytes stayed in the stash
        # while this thread waited for the GIL, after the fetcher had read them, run its task
        # and a user thread had collected the result (a quiet pool with a stash entry).
        # ``fetched`` first: the recovery of a fetcher that dies from here on must not wait for
        # these bytes (note_unwanted), whether or not the send reached it.
        data = self.stash.pop(key)
        self.fetched[fetcher.pid] = key
        with sigpipe_blocked():
            send_data(fetcher.conn, Tag.PAYLOAD, key, data)

    def on_zygote_message(self, block: bool) -> None:
        if not block and not self.zygote.poll():
            return
        tag, fields = self.read_zygote()
        if tag == Tag.SPAWNED:
            slot, pid = fields
            # What is kept under this pid is a previous process's: the zygote reaped it and
            # sent its EXITED, on this socket, before the pid could be reused (an exit code
            # that came after its crash's recovery stopped waiting for it, wait_exit_code).
            self.exit_codes.pop(pid, None)
            self.retired_pids.discard(pid)
            self.starting.discard(slot)
            self.forked_any = True
            self.spawn_warned = False
            self.stranded_since = None
            try:
                fd = recv_fd(self.zygote)
            except RuntimeError as exc:  # the fd cut off the message: none free here
                raise _no_fd_free(slot, "socket", exc) from exc
            except (EOFError, OSError) as exc:  # it died between SPAWNED and the fd's message
                raise self.zygote_death() from exc
            # Both above 2: a program may have closed its stdout, and a C library's write to
            # it then went to the worker (see _stdio). An initial worker's fds are not counted
            # before (spawn's _fds_short): at the limit the pool breaks, saying so.
            try:
                conn = Connection(above_stdio(fd))
            except OSError as exc:
                raise _no_fd_free(slot, "socket", exc) from exc
            try:
                pidfd = above_stdio(os.pidfd_open(pid))
            except ProcessLookupError:
                pidfd = -1
            except OSError as exc:
                conn.close()
                raise _no_fd_free(slot, "pidfd", exc) from exc
            worker = WorkerHandle(slot, pid, conn, pidfd, frame_watch(conn))
            self.workers[slot] = worker
            self.by_fd[conn.fileno()] = worker
            self.epoll.register(conn.fileno(), select.EPOLLIN)
        elif tag == Tag.SPAWN_FAILED:
            self.forked_any = True  # past its imports: it tried a fork
            self.spawn_failed(*fields)
        elif tag == Tag.EXITED:
            _, pid, code = fields
            if pid in self.retired_pids:
                self.retired_pids.discard(pid)
            else:
                self.exit_codes[pid] = code
        else:
            raise ProtocolError(f"unexpected {Tag.name(tag)} from the zygote")

    def read_zygote(self) -> tuple[int, tuple[Any, ...]]:
        try:
            return decode(self.zygote.recv_bytes())
        except (EOFError, OSError) as exc:
            raise self.zygote_death() from exc


def _no_fd_free(slot: int, what: str, error: BaseException) -> OSError:
    return OSError(
        errno.EMFILE,
        f"the pool's process had no file descriptor free for worker {slot}'s {what} (the "
        f"open-file limit, RLIMIT_NOFILE, reached?): {error}",
    )


def process_state() -> tuple[str | None, list[str], dict[str, str]]:
    """What the workers should see of this process, taken as the first task comes (START):
    the working directory (None if it was removed), ``sys.path`` and the environment, as
    ProcessPoolExecutor's workers see those of the moment they start (multiprocessing's
    preparation data; the environment at their start). The zygote takes them before it forks
    the workers (``_zygote._take_state``): a path added to ``sys.path`` after ``Pool()``, and a
    module imported from it, failed in the workers (ModuleNotFoundError; found in review).

    ``''`` in ``sys.path`` (``python -c``, the REPL, a notebook) stands for the current
    directory, which the workers enter, as it does here, followed by the directory that the
    program started in (multiprocessing's preparation data has that one alone): ``''`` alone
    lost the modules that the program imported before an ``os.chdir`` (found in review), and
    the start directory first gave a worker its module of a name that the program had imported
    from the current one (a diff review)."""
    try:
        cwd: str | None = os.getcwd()
    except OSError:
        cwd = None
    path = list(sys.path)
    if "" in path:
        i = path.index("")
        started_in = getattr(multiprocessing.process, "ORIGINAL_DIR", None)  # (untyped)
        dirs = dict.fromkeys(d for d in (cwd, started_in) if d)
        path[i : i + 1] = list(dirs) or [""]
    return cwd, path, dict(os.environ)


def _fds_short(fd: int, count: int) -> OSError | None:
    """The error if this process cannot open ``count`` more fds now (duplicates of ``fd``,
    closed at once), else None."""
    taken: list[int] = []
    try:
        taken.extend(os.dup(fd) for _ in range(count))  # those made stay listed on a raise
    except OSError as exc:
        return exc
    finally:
        for dup in taken:
            os.close(dup)
    return None


def zygote_died(importing: tuple[str, ...] = (), exitcode: int | None = None) -> BrokenPoolError:
    """The pool's error at its zygote's death, which ended it with ``exitcode`` (None: not
    known). ``importing``: it died after START and before its first fork, so in the import of
    the first task's modules, which it imports once for every worker (under forkserver and
    spawn). An exception there is ignored (the worker's own import reports it), so such a
    death is a crash or an exit in the import: a C extension that is not fork-safe, say. It
    was blamed on the main module's import (found in review). A SIGKILL comes from outside (the
    OOM killer, a ``kill -9``): it was blamed on the import too, and a death without its status
    pointed to a traceback above that a killed process never prints (crash hunt)."""
    status = signal_description(exitcode)
    if exitcode == -signal.SIGKILL:
        return BrokenPoolError(
            f"the pool's zygote process was killed ({status}: by the OOM killer, or a kill -9)"
        )
    if importing:
        names = ", ".join(repr(m) for m in importing)
        return BrokenPoolError(
            f"the pool's zygote process died ({status}) before it forked a worker: the import "
            f"of the first task's module(s) {names}, which the zygote imports once for every "
            "worker (under forkserver and spawn), crashed or exited in that child process"
        )
    return BrokenPoolError(
        f"the pool's zygote process died ({status}; if that was at start-up, its traceback is "
        "above, if it printed one: under spawn, say, the main module could not be imported)"
    )
