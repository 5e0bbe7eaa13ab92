"""The coordinator's results: done rings, stashed results, settling futures (``Collecting``).

Owns: reading the done rings (``collect``, ``collect_locked``, ``read_results``), results too big
for a block (``stash_take``; the bytes come in a STASH message before the done-ring push),
failing what cannot be read (``fail_unread``), and settling futures: the timetable first, then the
future (``settle``, ``end_runs``, ``resolve``, ``settle_loaded``, ``unpickle_result``).
``help_wait``/``help_spin``: a user thread about to block in ``result()`` collects for a short
while itself, one cross-process hop instead of two (docs/design.md, "Round-trip latency").

Called from: the coordinator thread (every loop pass, a recovery), and a user thread in
``Future.result()`` (``help_wait``). One collector at a time: ``collect_lock``.

Invariants: only the coordinator thread reads sockets; a user-thread collector leaves a result
whose STASH has not arrived (and the rest of its batch, if an exception hits it) to the loop in
``unread``, blocks kept, futures still in ``by_handle``. Every handle taken from a done ring
ends its future, even when reading one raised. A task leaves ``by_handle`` before its block is
freed, and the drain's decision (``drained``) and the timeout and cancel-request checks hold
``collect_lock`` so that they never see a block between the two. A user thread runs the
done-callbacks of what it settled only after it released ``collect_lock``.
"""

from __future__ import annotations

import pickle
import threading
import time
from concurrent.futures import InvalidStateError
from typing import TYPE_CHECKING, Any

from mpsched._coord_state import (
    _CANCELLED,
    _ERROR,
    _MISFIRED,
    _OK,
    _RESULT_NBYTES,
    CoordinatorState,
)
from mpsched._errors import (
    InternalError,
    ProtocolError,
    timeout_error,
)
from mpsched._future import FINISHING, SETTLING, Future, defer_callbacks, invoke_all, take
from mpsched._payloads import BlockField
from mpsched._pool_errors import BrokenPoolError
from mpsched._protocol import (
    Buffer,
    dump_exception,
    load_exception,
    recv_message,
    unpickling_failed,
)
from mpsched._timed import TaskRun

if TYPE_CHECKING:
    from mpsched._shm_deque import SlotQueues

_RESULT_STATUS = BlockField.RESULT_STATUS
_FAILED = RuntimeError("the task failed")  # stands for any error in Timetable.end
# help_wait: how long a caller of result() collects done rings itself before it blocks; a
# round trip of a tiny task takes well under this. After HELP_MISSES_MAX misses in a row (long
# tasks), only one call in HELP_RETRY_EVERY spins, so waiting on slow tasks burns no CPU.
HELP_SPIN = 300e-6  # seconds
HELP_MISSES_MAX = 3
HELP_RETRY_EVERY = 32


class Collecting(CoordinatorState):
    def help_wait(self, future: Future[Any], timeout: float | None = None) -> None:
        """A user thread about to block in ``future.result(timeout)``: while the pool is lightly
        loaded, spin for a short while collecting done rings itself. The result then reaches the
        caller with one cross-process hop (worker -> this thread) instead of two (worker ->
        coordinator thread -> this thread, ~40 us each here). Adaptive: after repeated misses
        (long tasks) it spins only now and then. Not for a ``timeout`` under the spin: a poll
        (``result(timeout=0)``) spun 0.3 ms and ran the callbacks of the other futures it
        settled, for as long as they took (found in review)."""
        if (
            (timeout is not None and timeout < HELP_SPIN)
            or future._slot < 0
            or future._slot in self.starting  # a fork away at least: spinning takes its CPU
            or self.ready  # queued work: the coordinator must go on dispatching anyway
            or len(self.by_handle) > self.n_workers
            # Not in a collection: a handler or finalizer that interrupted this thread's, which
            # holds collect_lock (see _future.SETTLING).
            or (me := threading.get_ident()) == self.thread_id
            or me in SETTLING
            or self.disowned  # a fork child's copy: the done rings are the parent's
            or (self.help_misses >= HELP_MISSES_MAX and self.help_calls % HELP_RETRY_EVERY)
        ):
            self.help_calls += 1
            return
        self.help_calls += 1
        try:
            lazy = self.help_spin(future)
        except ValueError:
            # The caller saw the future pending, then lost the CPU while the pool settled it,
            # drained and released its memory (only after ``finished``): nothing to help with.
            if not self.finished.is_set():
                raise
            return
        if lazy or not future.done():
            # A worker may have skipped its poke meanwhile (``collector``): the loop must
            # sweep, and a lazy loop would sweep only after LAZY_SWEEP_INTERVAL.
            self.wakeup()

    def help_spin(self, future: Future[Any]) -> bool:
        """``help_wait``'s spin: collect done rings until ``future`` is done or time is up.
        Returns whether the loop sweeps lazily (read after the spin)."""
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
        return header.lazy_sweep()

    def collect(self) -> None:
        """Any thread (the coordinator's, or a user thread in ``help_wait``), one at a time.

        The done-callbacks of what a user thread settled go to the pool's callback thread
        (``CallbackRunner.put``), queued under ``collect_lock``, and called by this thread only
        if that thread is closed or cannot start, once ``collect_lock`` is released: under it, a
        callback that waits for another future's result (whose collection needs that lock) or
        shuts the pool down (whose drain decides under it) would wait for this thread; in the
        callback thread, none runs inside the caller's ``result()``, under whatever lock the
        caller holds. (The coordinator thread's sink is the same ``CallbackRunner``.) Queued
        after the lock's release, they found the runner closed when the loop ended in between,
        and ran in this thread after ``shutdown(wait=True)`` had returned (found in review)."""
        if threading.get_ident() == self.thread_id:
            with self.collect_lock:
                self.collect_locked(True)
            return
        settled: list[Future[Any]] = []
        box = [settled]
        queued = False
        previous = defer_callbacks(settled.append)
        try:
            with self.collect_lock:
                me = threading.get_ident()
                SETTLING.add(me)
                try:
                    self.collect_locked(False)
                finally:
                    SETTLING.discard(me)
                    if settled:  # before the drain (decided under this lock) can end the loop
                        queued = self.callbacks.put(box)
        finally:
            defer_callbacks(previous)
            if settled and not queued:
                invoke_all(take(box))

    def collect_locked(self, in_loop: bool, every: bool = False) -> None:
        """Under ``collect_lock``: read every done ring (``in_loop``: in the coordinator
        thread, the only one that reads sockets; see ``read_results``). ``every``: take each
        ring under its lock, even one that a plain read shows empty (``pace_sweep``)."""
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
                    self.read_results(-1, unread, in_loop)
            finally:
                self.unread += unread  # the entries an exception kept this pass from reading
        for k, slot in enumerate(self.slots):
            if every or slot.done_depth():
                self.read_results(k, slot, in_loop)

    def read_results(
        self, k: int, source: SlotQueues | list[tuple[int, list[int]]], in_loop: bool
    ) -> None:
        """Under ``collect_lock``: settle the tasks whose handles it takes from ``source`` (slot
        ``k``'s done ring; or the last entry ``(k, handles)`` of a list that a collector left
        unread), and free their blocks. Only the coordinator thread reads sockets: a user
        thread (``help_wait``) leaves a handle whose stashed result has not arrived to the loop
        (``unread``), and so the rest of its batch when an exception (a Ctrl-C's
        KeyboardInterrupt) hits it: those results are fine, and the pool is not broken. The
        handles are taken inside the ``try``, straight into ``handles``, with no call between
        the take and that list (``take_done``'s commit; the entry's removal here), so that an
        exception raised as the take returns finds them there: taken before, one raised as
        ``take_done`` returned (or at this call's start) dropped them, and their futures ended
        cancelled at the drain, though their tasks ran."""
        slab = self.slab
        outcomes: list[tuple[Future[Any], int, Buffer]] = []
        unknown: list[int] = []
        later: list[int] = []  # a user thread's: left to the loop, their blocks kept
        by_handle = self.by_handle
        get_word = slab.get_word
        future = None
        handles: list[int] = []
        try:
            if isinstance(source, list):
                k, taken = source[-1]
                handles += taken
                del source[-1]
            else:
                source.take_done(handles)
            for handle in handles:
                future = by_handle.get(handle)
                if future is None:
                    unknown.append(handle)
                    continue
                status = get_word(handle, _RESULT_STATUS)
                nbytes = get_word(handle, _RESULT_NBYTES)
                data: Buffer
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
                elif handles:  # (none: a ring that a plain read showed empty, or an interrupt)
                    slab.free_tasks(handles)
            finally:  # a free that raised (a corrupt free stack) breaks the pool: these
                # futures left by_handle above, so its sweep would not end them
                self.completed += len(outcomes)
                try:
                    self.settle(outcomes)
                except BaseException as exc:
                    # (An Exception here is an internal error, which breaks the pool: its sweep
                    # fails what is still handed out, as it should, the outcome unknown.)
                    if not isinstance(exc, Exception):
                        self.settle_interrupted(outcomes)
                    raise
        if unknown:
            raise InternalError(f"worker {k} completed unknown task blocks {unknown}")

    def fail_unread(
        self,
        handles: list[int],
        slot: int,
        exc: BaseException,
        outcomes: list[tuple[Future[Any], int, Buffer]],
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

    def settle(self, outcomes: list[tuple[Future[Any], int, Buffer]]) -> None:
        """Resolve futures; tasks with an id or options first update the timetable (so that a
        caller woken by ``result()`` sees the final ``state()``)."""
        special: list[tuple[Future[Any], int, Buffer]] = []
        loaded: list[tuple[bool, Any] | None] = []  # per special entry: its unpickled result
        for outcome in outcomes:
            future = outcome[0]
            run = future._run
            if future._due is None and run is None:
                resolve(*outcome)
            elif run is not None and run.timed_out and outcome[1] not in (_OK, _MISFIRED):
                # It ran out of time: whatever it raised (TaskCancelled, acknowledging the
                # timeout's cooperative cancel, included) it fails with TimeoutError. Converted
                # here, before end_runs, so that state() says FAILED as the future does (not
                # CANCELLED: no cancel was asked for), and a recurrence ends with that error.
                error = dump_exception(timeout_error(timeout_message(run)))
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

    def settle_interrupted(self, outcomes: list[tuple[Future[Any], int, Buffer]]) -> None:
        """``settle(outcomes)`` raised: a Ctrl-C's KeyboardInterrupt in a user thread's
        collection (``help_wait``), at any call in a setter, an unpickling, a waiter's notify
        or ``end_runs``. These futures left ``by_handle`` and their blocks were freed, so no
        later pass would find them: the future stayed pending for ever, and a version with an
        id stayed handed out (``busy()`` true: the drain waited for ever, an interrupted
        ``with`` block's exit too). Each step is redone where it was not done: ``end_runs``
        ends a version once (``Timetable.end`` clears ``_due`` first), a setter settles a
        future once (``done()``), and a recurring run's end began once its owner was cleared
        (``end_recurring_run``). A settled future's waiters are notified again: the
        interrupt may have come inside the notify (a wake-up too many costs a look at the
        state). A second interrupt in here goes on, as elsewhere."""
        for outcome in outcomes:
            future = outcome[0]
            run = future._run
            if run is not None and run.recurrence is not None:
                if future._owner is not None:
                    self.settle([outcome])
            elif not future.done():
                self.settle([outcome])
            elif future._cond is not None:
                with future._condition:
                    future._condition.notify_all()

    def stash_take(self, key: int, slot: int) -> Buffer:
        """Coordinator thread: stashed result bytes; the STASH message was sent before the
        done-ring push, so it is complete in the worker's socket if it has not been read yet."""
        while key not in self.stash:
            worker = self.workers[slot]
            if worker is None and slot in self.starting:  # its SPAWNED (and socket) is on the way
                self.on_zygote_message(block=True)
                continue
            if worker is None:
                raise ProtocolError(f"stashed result {key} lost with worker {slot}")
            self.on_worker_message(worker, *recv_message(worker.conn))
        return self.stash.pop(key)

    def end_runs(self, outcomes: list[tuple[Future[Any], int, Buffer]]) -> None:
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
                    if status == _MISFIRED:  # dropped unstarted by its worker, as by misfired()
                        self.timetable.end(future, None, cancelled=True)
                    else:
                        self.timetable.end(
                            future,
                            None if status == _OK else _FAILED,
                            cancelled=status == _CANCELLED,
                        )
            self.note_heap_due()


def timeout_message(run: TaskRun) -> str:
    return f"the task ran longer than its timeout of {run.options.timeout} s" + (
        f" and was killed {run.options.timeout_grace} s later" if run.forced else ""
    )


def unpickle_result(data: Buffer) -> tuple[bool, Any]:
    """``(True, value)``, or ``(False, RuntimeError)`` if the result cannot be unpickled."""
    try:  # user code runs here (__setstate__, __reduce__): SystemExit included
        return True, pickle.loads(data)
    except BaseException as exc:
        return False, unpickling_failed(exc)


# resolve (and settle_loaded) run once per task, on the coordinator's GIL time: ``try``/``except``
# rather than ``contextlib.suppress`` (three Python frames per use: ~0.6 us of ~1.5 us a task),
# and one look at done() per task (resolve's, then _store).


def settle_loaded(future: Future[Any], ok: bool, value: Any) -> None:
    """Settle a task's future with an unpickled result (``unpickle_result``'s pair)."""
    future._owner = FINISHING
    if not future.done():  # else cancelled meanwhile: a race the claim decided
        _store(future, ok, value)


def _store(future: Future[Any], ok: bool, value: Any) -> None:
    """``settle_loaded`` once ``future`` was found not done (``resolve`` checked already)."""
    if ok:
        try:  # noqa: SIM105  (see above)
            future.set_result(value)
        except InvalidStateError:  # cancelled meanwhile
            pass
    else:
        try:  # noqa: SIM105
            future.set_exception(value)
        except Exception:  # cancelled meanwhile
            pass


def resolve(future: Future[Any], status: int, data: Buffer) -> None:
    """Settle a task's future from its result bytes (coordinator thread, no lock held)."""
    future._owner = FINISHING
    if future.done():  # cancelled meanwhile: a race the claim decided; nothing to report
        return
    if status == _OK:
        _store(future, *unpickle_result(data))
    elif status == _CANCELLED:
        future._mark_cancelled()
    else:
        try:  # noqa: SIM105
            future.set_exception(load_exception(data))
        except InvalidStateError:  # cancelled meanwhile
            pass
