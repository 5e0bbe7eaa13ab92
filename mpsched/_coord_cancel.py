"""The coordinator's cancels: withdrawing queued tasks, stopping running ones (``Cancelling``).

Owns: ``withdraw`` (the one place that makes a task no worker claimed never run: from the
timetable, the ready queue, or an inbox, where ``cancel_injected`` under the slot lock races the
claim and exactly one wins), ``cancel`` (``Future.cancel``), ``cancel_id`` (``Pool.cancel``),
deferred cancels (``cancel_later``, ``cancel_deferred``), and stopping claimed tasks: the
cooperative flag in the block (``apply_requests``), timeouts (``check_timeouts``) and forced
cancels, which stop, check and kill the worker (``kill_running``, ``send_signal``,
``wait_stopped``). docs/design.md section 3 has the argument.

Called from: any thread (``cancel``, ``cancel_id``, ``cancel_later``; each takes ``self.lock``
briefly and wakes the loop if needed), and the coordinator thread (``cancel_deferred``,
``apply_requests``, ``check_timeouts``; ``kill_running`` and every write to a claimed task's
block run there only).

Deferred cancels (``cancel_later``): a cleanup that may run inside any critical section of its
own thread (a ``Pool.map`` generator finalized by the cyclic garbage collector, which runs
inside any allocation) must take no lock: it appends the futures to ``deferred_cancels`` (a
``collections.deque``: append and popleft are atomic under the GIL) and wakes the loop without
a lock (``wakeup_nowait``); the loop cancels them on its next pass, before it dispatches.

Invariants: a claimed task's block is written (cancel flag) or its worker killed only under
``collect_lock`` and while its future is still in ``by_handle`` (a collector frees the block
before anything else may reuse it); a worker is killed only if the task is still on its run
stack after the SIGSTOP; a worker is signalled through its pidfd, never by pid.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Hashable, Iterable
from concurrent.futures._base import PENDING
from typing import Any

from mpsched._coord_state import (
    _STATE,
    CoordinatorState,
    WorkerHandle,
)
from mpsched._future import FINISHING, Future, mark_all_cancelled, release_if_left
from mpsched._options import TaskOptions
from mpsched._protocol import TopState
from mpsched._scheduler import check_task_id
from mpsched._timed import Recurrence, TaskRun

_CANCEL_REQUESTED = TopState.CANCEL_REQUESTED
STOP_WAIT = 0.2  # seconds a SIGSTOPped worker gets to show as stopped before a forced cancel


class Cancelling(CoordinatorState):
    def cancel(self, future: Future[Any]) -> bool:
        """Any thread (``Future.cancel``): withdraw a task no worker has claimed. True if it
        will never run."""
        if self.disowned:  # a fork child's copy: the task is the parent's (see __init__)
            return False
        lock = self.lock
        try:
            lock.acquire()  # not ``with``: see _future.LEFT_LOCK_WAIT
        except BaseException:  # a Ctrl-C may leave it taken: see _future.LEFT_LOCK_WAIT
            release_if_left(lock)
            raise
        try:
            try:
                if not self.withdraw(future):
                    return False
                if future._due is None or not self.timetable.withdrawn(future):
                    return True
            except BaseException:
                self.end_withdrawn(future)
                raise
            # It ended a retry with a newer version of its id waiting behind it: that one
            # entered the heap, and the loop must learn its due time (else it stayed there,
            # its future never settled and the drain waited for it for ever).
            self.note_heap_due()
            due = self.next_due
            wake = False
            if due is not None and due < self.sleep_until:  # as schedule() does
                self.sleep_until = due
                wake = True
        finally:
            lock.release()
        if wake:
            self.wakeup()
        return True

    def end_withdrawn(self, future: Future[Any]) -> None:
        """Under ``self.lock``, in the handler of an exception (a Ctrl-C's KeyboardInterrupt)
        that hit a withdrawal: if ``future`` was withdrawn (it never runs; its caller marks it
        cancelled), take its version out of the timetable as the withdrawal would have. A
        handed-out version left there kept ``busy()`` true, and the drain waited for ever."""
        if not future._withdrawn or future._due is None:
            return  # not withdrawn, or its version has ended (or it has none)
        if self.timetable.withdrawn(future):  # idempotent for a version still in the heap
            self.note_heap_due()

    def cancel_later(self, futures: Iterable[Future[Any]]) -> None:
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

    def withdraw(self, future: Future[Any]) -> bool:
        """Under ``self.lock``: make sure a task no worker has claimed never runs. True if it
        will not run (withdrawn now or before); False if it was claimed or has finished."""
        if future._owner is FINISHING:  # it ran; its outcome is being set (end_runs)
            return False
        if future._handle < 0:  # in the ready queue or the timetable: dispatch skips it
            if future._withdrawn or future._state != PENDING:  # done(), a frame less
                # Cancelled by a racing cancel by id or reschedule (which mark the future
                # after taking its version out of the heap): it will not run either.
                return future._withdrawn or future.cancelled()
            future._withdrawn = True
            future._payload = b""
            self.ready.note_withdrawn(future)  # (one still in the heap is not queued)
            return True
        if self.by_handle.get(future._handle) is not future:
            # Collected (collect pops it, then frees its block, without this lock): it ran. Its
            # block may already carry another task, injected into the same inbox: the
            # cancel_injected below would tombstone that one. (While this lock is held, no
            # block is injected, so the check stays true until the cancel is decided.)
            return False
        handle = future._handle
        if future._slot >= 0 and not self.slots[future._slot].cancel_injected(handle):
            return False  # a worker claimed it first
        # Withdrawn from its inbox, or taken back (queued here with its block): said first (no
        # call before), so that an exception (a Ctrl-C) in the bookkeeping below leaves a
        # future that its caller ends cancelled (it stayed pending, out of by_handle, where
        # cancel_lost would have found it); the block is freed last (at worst never: a
        # second free would corrupt the free stack).
        future._withdrawn = True
        future._payload = b""
        future._handle = -1
        self.ready.note_withdrawn(future)  # taken back, it is queued with its block
        self.by_handle.pop(handle, None)
        self.watched.pop(handle, None)
        self.drop_stashed([handle])
        self.slab.free_tasks([handle])
        return True

    def cancel_id(
        self, recurrence: Recurrence | Cancelling, /, task_id: Hashable, *, force: bool = False
    ) -> bool:
        """Any thread: ``Pool.cancel`` (``recurrence`` is this coordinator: none; each pool
        binds it, to this coordinator twice, as its ``cancel``: see ``_pool._cancel_by_id``),
        and a recurrence's future's ``cancel()`` (``recurrence``: that recurrence). Cancel
        every version of ``task_id`` that has not started, stop its recurrence, and ask a
        running version to stop (cooperatively, or by killing its worker with ``force``). True
        if anything was cancelled or asked to stop.

        With a ``recurrence``: only while it is still the id's recurrence. (Positional-only and
        first, so that the pool's bound ``cancel`` takes no such argument. No recurrence is
        the coordinator, not None: a bound method's object cannot be None, and the pool's
        ``cancel`` pickles as the coordinator's, which refuses, saying why.)"""
        if force is not False and force is not True:  # two tests for the default, no call
            raise TypeError(f"force must be a bool, not {type(force).__name__}")
        if self.disowned:  # a fork child's copy: the versions are the parent's (see __init__)
            return False
        timetable = self.timetable
        pending = rec = handed = candidate = None
        wake = False
        lock = self.lock
        try:
            lock.acquire()  # not ``with``: see _future.LEFT_LOCK_WAIT
        except BaseException:  # a Ctrl-C may leave it taken: see _future.LEFT_LOCK_WAIT
            release_if_left(lock)
            raise
        try:
            try:
                if recurrence is not self and timetable.recurring.get(task_id) is not recurrence:
                    # Stopped already: by a racing cancel by id, reschedule or shutdown, which
                    # mark its future cancelled after releasing the lock (so True, as they
                    # will), or by a run's error (its future's owner is FINISHING then: False).
                    # Going on would cancel the id's versions, which may belong to the schedule
                    # that replaced it.
                    return recurrence.future._owner is not FINISHING  # type: ignore[union-attr]
                pending = timetable.cancel_pending(task_id)
                if timetable.recurring:
                    rec = timetable.recurring.get(task_id)
                    if rec is not None:  # no call in between: stopped and out at once
                        rec.active = False
                        del timetable.recurring[task_id]
                if timetable.handed:
                    candidate = timetable.handed.get(task_id)
                    if candidate is not None and self.withdraw(candidate):
                        handed = candidate
                        timetable.end(handed, None, cancelled=True)
                    elif candidate is not None and recurrence is self:
                        # Claimed: running (or finished, not collected). Not from the
                        # recurrence's future: its cancel() stops the recurrence and lets the
                        # run end (TaskSubmitter.schedule; it asked the run to stop too).
                        if candidate._run is not None:  # if its worker dies, it is not retried
                            candidate._run.cancel_requested = True
                        self.requests.append((candidate, force))
                        wake = True
            except BaseException:
                # An exception (a Ctrl-C's KeyboardInterrupt) between a withdrawal and its
                # bookkeeping: end what was withdrawn, and mark it below (a withdrawn version
                # left handed out kept the drain waiting for ever, and its future pending;
                # one withdrawn from the heap, hit in the heap's bookkeeping, was lost with
                # the withdraw's return value).
                if pending is None:
                    pending = timetable.heap.take_interrupted()
                if candidate is not None and candidate._withdrawn:
                    self.end_withdrawn(candidate)
                    handed = candidate
                raise
            finally:
                lock.release()
            if pending is not None:
                pending._mark_cancelled()
            if rec is not None:
                rec.future._mark_cancelled()
            if handed is not None:
                handed._mark_cancelled()
        except BaseException as exc:
            # Before, or during, the marks: every future withdrawn above is marked (a mark
            # done already is a no-op), or it stayed pending for ever with its waiters.
            withdrawn = (pending, None if rec is None else rec.future, handed)
            mark_all_cancelled([f for f in withdrawn if f is not None])
            if isinstance(exc, TypeError):
                check_task_id(task_id)  # unhashable: say so, as Pool.state does
            raise
        if wake:  # only this thread may touch a running task's block: see apply_requests
            self.wakeup()
        return pending is not None or rec is not None or handed is not None or wake

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

    def kill_running(self, future: Future[Any]) -> bool:
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
