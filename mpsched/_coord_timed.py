"""The coordinator's timed side: tasks with an id (``Timing``, a part of ``Coordinator``).

Owns: adding a version of an id (``schedule``) and superseding the versions it replaces
(``supersede``), the id's state (``state``), moving due versions from the timetable to the ready
queue (``release_due``, ``make_ready``), the loop's next due time (``note_due``,
``note_heap_due``), and recurrences: the next run after one ends or misfires
(``end_recurring_run``, ``continue_recurrence``, ``misfired``), and the deadline after which a
worker drops a run it claims too late (``misfire_deadline``). The timetable itself (heap,
handed versions, recurrences) is ``_timed.Timetable``; this part decides when its methods run
and keeps ``next_due`` and ``sleep_until`` in step with it.

Called from: user threads (``schedule``, ``state``; through ``Pool``), the coordinator thread
(``release_due`` from the loop, ``misfired`` from dispatch), and whichever thread settles a run
(``end_recurring_run``: the coordinator's, or a user thread collecting in ``help_wait``).

Invariants: the timetable, ``next_due`` and ``sleep_until`` change only under ``self.lock``; a
future is marked cancelled only once that lock is released (its callbacks may call back in).
``next_due`` is never later than the heap's next deadline after a version ends (``note_heap_due``),
or a deferred version would wait for ever and the drain with it. A run that misfired is skipped
only by its policy, never a retry of a run that started on time.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Hashable, Sequence
from typing import Any

from mpsched._coord_collect import resolve
from mpsched._coord_state import (
    _CANCELLED,
    _MISFIRED,
    _OK,
    CoordinatorState,
    logger,
)
from mpsched._future import FINISHING, Future, mark_all_cancelled, release_if_left
from mpsched._options import is_misfire, next_run_at
from mpsched._protocol import Buffer
from mpsched._task import TaskState
from mpsched._timed import Recurrence, TaskRun


def skips_misfires(run: TaskRun) -> bool:
    """A recurring run under the misfire policy "skip", and not a retry. A retry (its worker
    died) started on time, so it runs again, as the retries option says. Dropped, it continued
    a recurrence that a schedule of the id may have replaced meanwhile: that next version
    superseded the new schedule's, whose future never settled
    (test_a_retried_run_of_a_superseded_recurrence_keeps_the_new_schedule)."""
    options = run.options
    return (
        run.recurrence is not None
        and options.misfire == "skip"
        and run.retries_left == options.retries
    )


class Timing(CoordinatorState):
    def schedule(
        self,
        task_id: Hashable,
        run_at: float,
        priority: int,
        future: Future[Any],
        recurrence: Recurrence | None = None,
    ) -> bool:
        """Any thread: add a version of ``task_id`` (``future`` holds its call, encoded with its
        meta). The version handed out earlier, if no worker has claimed it, and the pending one
        are superseded: cancelled, never run.
        Returns True if the loop must be woken (the new task is due before it would wake)."""
        superseded: Sequence[Future[Any]] = ()  # no list for a new id (the measured path)
        timetable = self.timetable
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
                now = time.monotonic()
                if run_at <= now:
                    # Due at the call (the API's words), so it queues behind what became due
                    # before the call and ahead of later submits (make_ready). Left 0.0 for a
                    # run_at ahead: a float per pending future would be one more object for
                    # each full collection to visit in each (see _heap's module doc).
                    future._due_at = now
                if timetable.known(task_id):  # an id seen before: supersede what it has
                    superseded = []
                    self.supersede(task_id, recurrence, superseded)
                if recurrence is not None:
                    timetable.recurring[task_id] = recurrence
                # The loop learns the due time before the version enters the heap: an
                # exception (a Ctrl-C) raised as timetable.schedule returns left a version the
                # loop never woke for; it never ran, and the drain (a ``with`` block's exit)
                # waited for ever. Noted for a version that never came, it costs one early
                # wake-up.
                if self.next_due is None or run_at < self.next_due:
                    self.next_due = run_at
                wake = run_at < self.sleep_until
                if wake:
                    self.sleep_until = run_at
                timetable.schedule(task_id, run_at, priority, future)
                self.submitted += 1  # taken (an id whose __eq__ raised counted, taken or not)
            except BaseException:
                # An exception (a Ctrl-C's KeyboardInterrupt) part of the way: mark what was
                # superseded by then, and only that (a version still pending will run).
                superseded = self.superseded_so_far(task_id, superseded)
                raise
            finally:
                lock.release()
            if superseded:  # (no call on the hot path: most schedules supersede nothing)
                mark_all_cancelled(superseded)
        except BaseException:
            # Before, or during, the marks: each superseded future is marked (a mark done
            # already is a no-op), or it stayed pending for ever with its waiters.
            mark_all_cancelled(superseded)
            raise
        return wake

    def supersede(
        self, task_id: Hashable, recurrence: Recurrence | None, superseded: list[Future[Any]]
    ) -> None:
        """Under ``self.lock``: a new version of ``task_id`` comes; cancel the handed-out version
        if no worker claimed it, the pending one, and a recurrence other than ``recurrence``.
        Appends their futures to ``superseded``, to be marked cancelled once the lock is
        released; each before it is withdrawn, so that an exception on the way finds it there
        (``superseded_so_far``)."""
        timetable = self.timetable
        handed = timetable.handed.get(task_id)
        if handed is not None:
            superseded.append(handed)
            if self.withdraw(handed):
                timetable.end(handed, None, cancelled=True)
            else:  # claimed: it runs on
                superseded.pop()
        pending = timetable.pending_future(task_id)
        if pending is not None:
            superseded.append(pending)  # the heap drops it when the new version comes
        old = timetable.recurring.get(task_id)
        if old is not None and old is not recurrence:
            superseded.append(old.future)
            old.active = False
            del timetable.recurring[task_id]

    def superseded_so_far(
        self, task_id: Hashable, candidates: Sequence[Future[Any]]
    ) -> list[Future[Any]]:
        """Under ``self.lock``, in ``schedule``'s exception handler: which of ``candidates``
        (``supersede``'s list, each added before its withdrawal) were superseded: a handed-out
        version withdrawn (ended here if the exception came before its end: left handed out,
        it kept the drain waiting for ever), a pending version no longer pending (the heap
        dropped it), a recurrence stopped."""
        done = []
        for future in candidates:
            owner = future._owner
            if isinstance(owner, Recurrence):  # a stopped recurrence's future
                if not owner.active:
                    done.append(future)
            elif type(future._due) is tuple:  # a pending version's heap record
                if self.timetable.pending_future(task_id) is not future:
                    done.append(future)
            elif future._withdrawn:
                self.end_withdrawn(future)
                done.append(future)
        return done

    def state(self, task_id: Hashable) -> TaskState | None:
        with self.lock:
            return self.timetable.state(task_id, self.claimed)

    def claimed(self, future: Future[Any]) -> bool:
        """Under ``self.lock``: whether a handed-out task was claimed by a worker. A retry
        (its worker died: ``recover_slot``) was: it started before, and a state never goes
        back (``state()`` said PENDING from the death until the retry's claim)."""
        run = future._run
        if run is not None and run.retries_left < run.options.retries:
            return True
        if future._handle < 0 or future._slot < 0:
            return False
        return not self.slots[future._slot].in_inbox(future._handle)

    def release_due(self) -> None:
        """Move the timetable's due versions to the ready queue (and age the ready queue)."""
        now = time.monotonic()
        with self.lock:
            self.release_due_locked(now)
            if self.aging is not None and self.ready:
                self.ready.age(now, self.aging)

    def release_due_locked(self, now: float) -> None:
        """Under ``self.lock``: ``release_due`` without the aging (also ``dispatch``'s)."""
        self.next_due = self.timetable.release_due(now, self.make_ready)

    def make_ready(self, future: Future[Any], priority: int) -> None:
        """Under ``self.lock``: a version came due (the timetable hands it out, its ``_due``
        set). It became due at its ``run_at``, unless that had passed at its schedule call
        (``_due_at`` set there): it queues behind what became due before it, not behind the
        submits made since (the loop runs this some time after)."""
        if not future._due_at:
            future._due_at = future._due.run_at
        run = future._run
        if run is not None and run.recurrence is not None:
            run.made_ready = self.dispatches
        self.ready.append_due(future, priority)

    def misfired(self, future: Future[Any]) -> bool:
        """Under ``self.lock``: drop a recurring run that is too late, if its policy says so."""
        run = future._run
        if (
            run is None
            or not skips_misfires(run)
            # In the first dispatch since it came due: the pool could start it at once, and
            # only the coordinator's own wake-up (~0.1-1 ms after the due time here) made it
            # late. Counted, any grace under that delay skipped every run of an idle pool
            # (misfire_grace=0: none ever ran).
            or run.made_ready == self.dispatches
            or not is_misfire(run.misfire_from, time.monotonic(), run.options.misfire_grace)
        ):
            return False
        self.note_misfire(run)
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

    def note_misfire(self, run: TaskRun) -> None:
        """Under ``self.lock``: count a run skipped by its misfire policy (``misfired``, or
        dropped by its worker: ``end_recurring_run``) and say so (never silently), once no
        lock is held (``log_deferred``)."""
        self.misfires += 1
        self.deferred_logs.append(
            (
                "mpsched: recurring task %r missed its run due at %.3f (more than %.3f s "
                "late); skipped by its misfire policy",
                run.recurrence.task_id,  # type: ignore[union-attr]  # a recurring run
                run.run_at,
                run.options.misfire_grace,
            )
        )

    def log_deferred(self) -> None:
        """Coordinator thread, no lock held: log the warnings noted under the pool's locks. A
        logging handler is user code, which may call the pool: run under ``self.lock``, one
        that called ``pool.cancel`` or ``pool.state`` on a misfire's warning waited for ever
        for the lock its own thread held, and the pool stopped (found by a hunt)."""
        logs = self.deferred_logs
        while logs:
            # A handler's own error is its own: raised here, it broke the pool, and in the
            # loop's last pass it kept the pool from ending (a diff review). logging's own
            # handlers report theirs (handleError).
            with contextlib.suppress(Exception):
                logger.warning(*logs.popleft())

    def misfire_deadline(self, future: Future[Any]) -> float | None:
        """Under ``self.lock``, as ``future`` is written to its block (``inject``): the time
        after which a worker that claims it behind other work drops it unstarted (see
        ``Worker.run``), or None. Only a run that ``skips_misfires``: it was not late as it
        left the ready queue, but in an inbox it may wait behind the worker's work past its
        grace."""
        run = future._run
        if run is None or not skips_misfires(run):
            return None
        deadline: float = run.misfire_from + run.options.misfire_grace
        return deadline

    def note_due(self, run_at: float | None) -> None:
        """Under ``self.lock``: the loop must wake at ``run_at`` (None: nothing new)."""
        if run_at is not None and (self.next_due is None or run_at < self.next_due):
            self.next_due = run_at

    def note_heap_due(self) -> None:
        """Under ``self.lock``, after a version ended: a newer version deferred behind it may
        have entered the heap, so the loop must learn the heap's next due time."""
        self.note_due(self.timetable.heap.next_deadline())

    def end_recurring_run(self, future: Future[Any], status: int, data: Buffer) -> None:
        """One run of a recurring id ended: schedule the next, or end the recurrence."""
        future._owner = None  # begun (``settle_interrupted`` does not begin it again)
        rec: Recurrence = future._run.recurrence
        if status == _MISFIRED:  # dropped unstarted by its worker: ended as cancelled
            self.completed -= 1  # (collect counted it, under collect_lock: it did not run)
            with self.lock:
                self.note_misfire(future._run)
                if rec.active:  # else stopped, or replaced by a schedule: never continue it
                    self.continue_recurrence(future, skipped=True)
            if threading.get_ident() != self.thread_id:
                self.wakeup()  # its next due time: as for a run that ended, below
            return
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

    def continue_recurrence(self, run_future: Future[Any], skipped: bool) -> None:
        """Under ``self.lock``: schedule the run after ``run_future``'s (ended or skipped)."""
        rec: Recurrence = run_future._run.recurrence
        options = rec.options
        # A skipped misfire goes to the grid after now, whatever the overlap policy.
        policy = "skip" if skipped else options.overlap
        every: float = options.every  # type: ignore[assignment]  # set on every recurrence
        now = time.monotonic()
        run_at, dropped = next_run_at(run_future._run.run_at, every, now, policy)
        self.skipped_runs += dropped
        future: Future[Any] = Future(self, rec.call, rec.priority)
        future._run = run = TaskRun(options, rec, run_at)
        run.misfire_from = max(run_at, now)  # a catch-up run could not start before now
        if run_at <= now:  # due now (a catch-up run): queues behind what is due already
            future._due_at = now
        # Each run is a task of its own (``completed`` counts each): submitted counted only
        # the schedule() call, and a recurrence made completed exceed submitted.
        self.submitted += 1
        self.timetable.schedule(rec.task_id, run_at, rec.priority, future)
        self.note_due(run_at)
