"""The coordinator's shutdown: the drain condition, the handshake, a broken pool (``Draining``).

Owns: ``begin_shutdown`` (no task comes in after it; recurrences stop and timed tasks run or not,
as the pool's options say; ``cancel_futures`` cancels all that has not started), the loop's
decision that all work has ended (``drained``, ``all_done``, ``quiescent``,
``children_phantom``), tasks lost by an interrupt (``cancel_lost``), stopping running tasks
(``abort_running``), the handshake with the workers (``drain_workers``: DRAIN, DRAINED or EOF,
then STOP to the zygote), and failing everything when the pool breaks (``break_pool``, which
also has the zygote kill every worker).
docs/design.md, "Shutdown: the drain handshake and why it cannot hang", has the argument.

Called from: any thread (``begin_shutdown``, ``abort_running``, through ``Pool``), and the
coordinator thread (the rest, from its loop and from ``run`` when the loop raised).

Invariants: ``draining`` and ``broken`` are set under ``self.lock``, so no submit queues behind
the decision; the drain ends only when nothing is queued, in flight or pending in the timetable
and no child lives (or the pool is provably quiescent after a crash), decided under
``collect_lock``; every worker is drained, or forgotten after ``DRAIN_TIMEOUT``, before STOP.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import time
from typing import Any

from mpsched._coord_cancel import send_signal
from mpsched._coord_recovery import release_orphaned_locks
from mpsched._coord_state import (
    CoordinatorState,
    WorkerHandle,
    logger,
)
from mpsched._future import (
    FINISHING,
    Future,
    callbacks_after_all,
    cancel_all,
    mark_all_cancelled,
)
from mpsched._pool_errors import BrokenPoolError
from mpsched._protocol import (
    Tag,
    encode,
    sigpipe_blocked,
)

_DRAIN = encode(Tag.DRAIN)
DRAIN_TIMEOUT = 10.0  # seconds a worker gets to answer DRAIN before it is killed
# While draining, locks left taken with no holder recorded are looked for this often (a
# try-lock of each lock seen without a holder); see Draining.poll_orphans.
ORPHAN_POLL_INTERVAL = 0.25  # seconds


class Draining(CoordinatorState):
    def drained(self) -> bool:
        """Draining: has all work ended? Decided under ``collect_lock``: a user thread that
        collects in ``help_wait`` pops a task from ``by_handle`` before it frees the task's
        block and settles its future. Seen empty in between, the drain ended and the teardown
        (of a dropped pool, or after ``shutdown``) released the memory under that collector,
        whose ``free_tasks`` then raised and whose future never settled
        (tests/stress/test_lifecycle_races.py, the waiting thread's collection)."""
        with self.collect_lock:
            return self.all_done()

    def poll_orphans(self) -> None:
        """Coordinator thread, while tasks are in flight (the loop) or draining, at most every
        ``ORPHAN_POLL_INTERVAL``: release a cross-process lock left
        taken with no holder recorded (``release_orphaned_locks``). A Ctrl-C's
        KeyboardInterrupt that hits a user thread between a slot's (or the slab's, or the
        global) lock acquire and its pid store leaves such a lock; a worker then waits for it
        for ever (unguarded), and only a guarded wait of this process released it: with none
        coming (the interrupt caught, then the ``with`` block left), the drain waited for
        ever for a task queued behind it, or ``drain_workers`` for the worker's answer to
        DRAIN until ``DRAIN_TIMEOUT``; and before, a task queued behind it waited as long
        (a notebook's interrupted cell went on with a worker stuck). A clock read per pass of
        the loop otherwise, nothing per task."""
        now = time.monotonic()
        if now - self.orphans_polled_at < ORPHAN_POLL_INTERVAL:
            return
        release_orphaned_locks(self, suspects_only=True)
        self.orphans_polled_at = time.monotonic()

    def all_done(self) -> bool:
        return (
            not self.ready
            and not self.by_handle
            and not self.timetable.busy()
            and (self.header.live_children() == 0 or self.aborted or self.children_phantom())
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
                self.ready.note_withdrawn(future)
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

    def begin_shutdown(self, cancel_futures: bool) -> None:
        """Any thread: no more submissions reach here (the pool checks); drain from now on.

        Recurring tasks stop unless ``recurring_after_shutdown``; timed one-shot tasks still run
        when due unless ``timed_after_shutdown`` is False; ``cancel_futures`` cancels all that
        has not started."""
        self.release_workers()  # they must answer the handshake, even with no task run
        # Callbacks once all are marked: one that waited for a later future of the batch found
        # it withdrawn and pending, and the shutdown waited for ever (found in review).
        with callbacks_after_all():
            self.withdraw_for_shutdown(cancel_futures)

    def withdraw_for_shutdown(self, cancel_futures: bool) -> None:
        cancelled: list[Future[Any]] = []
        injected: list[Future[Any]] = []
        try:
            with self.lock:
                try:
                    self.draining = True
                    self.cancelling = self.cancelling or cancel_futures
                    # cancel_futures stops kept recurrences too: their next runs are tasks not
                    # started, and a recurrence left going would keep the drain (and an
                    # interrupted ``with`` block's exit) waiting for a cancel that nothing will
                    # send.
                    keep = self.recurring_after_shutdown and not cancel_futures
                    if not keep:
                        self.withdraw_recurrences(cancelled)
                    if cancel_futures or not self.timed_after_shutdown:
                        # Not the next runs of kept recurrences (only left in ``recurring`` by
                        # ``keep``): withdrawn here, such a run would leave its recurrence with
                        # no next run and its future pending for ever.
                        self.timetable.cancel_all_pending(cancelled)
                    if cancel_futures:
                        injected = self.withdraw_queued(cancelled)
                except BaseException:
                    # A Ctrl-C's KeyboardInterrupt in the middle (a million pending versions
                    # take seconds to cancel): the futures withdrawn so far are in
                    # ``cancelled``, and the heap keeps the one it hit in a withdrawal; left
                    # pending, they stayed so for ever (a shutdown after it withdraws the rest).
                    lost = self.timetable.heap.take_interrupted()
                    if lost is not None:
                        cancelled.append(lost)
                    raise
        finally:
            try:
                mark_all_cancelled(cancelled)
            except BaseException:  # a Ctrl-C at its very entry marked none (twice is a no-op)
                try:
                    mark_all_cancelled(cancelled)
                finally:
                    with contextlib.suppress(BaseException):  # the first error goes on
                        cancel_all(injected)
                raise
        cancel_all(injected)

    def withdraw_recurrences(self, cancelled: list[Future[Any]]) -> None:
        """Under ``self.lock`` (``begin_shutdown``): stop every recurrence and withdraw its next
        run if no worker has claimed it, appending the futures to end cancelled to
        ``cancelled`` as it goes. A recurrence leaves ``recurring`` only after its last step,
        and a second pass may redo each step: so a shutdown after an exception here (a
        Ctrl-C's KeyboardInterrupt) finishes the job. (Stopped all at once first, those not
        yet withdrawn were found stopped or gone: their next runs waited in the heap, and the
        drain with them until they were due, their futures pending.)"""
        timetable = self.timetable
        recurring = timetable.recurring
        for task_id in list(recurring):
            rec = recurring[task_id]
            rec.active = False
            cancelled.append(rec.future)
            pending = timetable.pending_future(task_id)
            if pending is not None and timetable.withdraw_pending(pending):
                cancelled.append(pending)
            # While ``rec`` is its id's recurrence, the id's handed-out version is a run of
            # it, or an older version already running (a schedule replacing the recurrence
            # would have stopped it): an unclaimed one is ``rec``'s next run.
            handed = timetable.handed.get(task_id)
            if handed is not None and self.withdraw(handed):
                cancelled.append(handed)  # before end(): marked, whatever happens there
                timetable.end(handed, None, cancelled=True)
            del recurring[task_id]

    def abort_running(self) -> None:
        """Any thread (an interrupted ``with`` block, after ``begin_shutdown``): stop every
        running task by killing its worker (``kill_running``, in the coordinator thread)."""
        with self.lock:
            # Children of the killed tasks (queued, or running on a peer) and fire-and-forget
            # ones are nobody's to wait for: the drain stops their workers (drain_workers).
            self.aborted = True
            self.requests.extend((future, True) for future in self.by_handle.values())
        self.wakeup()

    def withdraw_queued(self, cancelled: list[Future[Any]]) -> list[Future[Any]]:
        """Under ``self.lock`` (``begin_shutdown`` with ``cancel_futures``): withdraw every task
        in the ready queue, appending each future to ``cancelled`` as it goes; returns the
        futures of the tasks in inboxes (to cancel once the lock is released: each races its
        claim)."""
        queued = self.ready.drain()
        done = 0
        try:
            for future in queued:
                if future._handle >= 0:  # taken back from an inbox: holds a block
                    self.withdraw(future)
                future._withdrawn = True
                if future._due is not None:
                    self.timetable.end(future, None, cancelled=True)
                cancelled.append(future)
                done += 1
        except BaseException:
            # A Ctrl-C's KeyboardInterrupt: those not done go back to the queue, for the next
            # shutdown to withdraw (each step may be done twice); drained all at once first,
            # they were in no queue and not withdrawn, pending for ever, the drain waiting.
            self.ready.putback(queued[done:])
            raise
        return list(self.by_handle.values())

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
                    with sigpipe_blocked(), contextlib.suppress(OSError):
                        worker.conn.send_bytes(_DRAIN)
                    if self.aborted:  # it may be running (or about to steal) a child for long
                        worker.drained = True  # its EOF is no crash: nothing to recover
                        with contextlib.suppress(ProcessLookupError):
                            send_signal(worker, signal.SIGKILL)
            if not self.starting and not any(self.workers[w.slot] is w for w in live):
                break
            self.poll_orphans()  # a worker waiting for an orphaned lock never answers DRAIN
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                break
            for fd, _ in self.epoll.poll(min(timeout, ORPHAN_POLL_INTERVAL)):
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
            self.send_to_zygote(Tag.STOP)

    def break_pool(self, exc: BaseException) -> None:
        """The pool cannot go on (an initializer raised, the zygote died, an internal error):
        fail every unfinished future with BrokenPoolError, and end the pool's processes."""
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
        # The control socket shut down (not closed: its number stays this pool's until the
        # teardown): at that EOF the zygote kills every worker and exits, as ProcessPoolExecutor
        # kills its workers when it breaks. It was sent STOP, which let each worker end its task
        # first; but one forked just before the break, whose SPAWNED (with its socket) was still
        # unread here, never saw its socket close and lived on, idle, until the shutdown.
        with self.zygote_send_lock, contextlib.suppress(OSError):
            control = socket.fromfd(self.zygote.fileno(), socket.AF_UNIX, socket.SOCK_STREAM)
            with control:  # a duplicate fd: the shutdown is the socket's, for every fd of it
                control.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.epoll.close()


def settle_error(future: Future[Any], error: BaseException) -> None:
    future._owner = FINISHING
    with contextlib.suppress(Exception):
        if not future.done():
            future.set_exception(error)
