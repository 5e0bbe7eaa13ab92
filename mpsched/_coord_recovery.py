"""The coordinator's crash recovery: a worker died or retired (``Recovering``).

Owns: what happens after a worker's socket hit EOF (``on_worker_gone``, ``recover_worker``,
``forget_worker``): its exit code from the zygote (``wait_exit_code``), repair of the shared
locks it held or left orphaned (``break_dead_holder``, ``release_orphans``, ``on_lock_stall``),
the tasks on its run stack (``recover_slot``: retried, cancelled, timed out, or failed with
``WorkerCrashedError``; a child via ``fail_child``), the children its tasks spawned that nobody
will collect (``orphan_children``), and stashed bytes nobody will take or that will come for
nobody (``drop_stashed_results``, ``drop_unfetched_args``, ``note_unwanted``,
``drop_parked_fetches``). docs/design.md, "Failure model and recovery", has the argument.

Called from: the coordinator thread (the loop's socket EOF, the drain, a broken pool), except
``on_lock_stall``: any thread of the pool's process whose wait on a guarded lock stalls. Every
repair of a cross-process lock, the coordinator's after a death too, holds ``repair_lock``.

Invariants: the dead worker's socket is read to EOF before its recovery, so every STASH it sent
is in; its locks are repaired before its rings and blocks are read; a block is judged by its
uid (the dead worker's pid from its allocation on), never by stale parent or state words of a
block a live worker reuses; what the recovery frees, nobody else frees (a child still queued or
running elsewhere is marked ABANDONED for its executor to free).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any

from mpsched._coord_collect import timeout_message
from mpsched._coord_state import (
    _CANCELLED,
    _ERROR,
    _NBYTES,
    _RESULT_NBYTES,
    _STATE,
    _UID_PID_SHIFT,
    CoordinatorState,
    WorkerHandle,
    logger,
    signal_description,
)
from mpsched._errors import ProtocolError, timeout_error
from mpsched._future import Future
from mpsched._payloads import BlockField
from mpsched._pool_errors import BrokenPoolError, WorkerCrashedError
from mpsched._protocol import (
    USER_ERROR_EXIT,
    Buffer,
    ChildState,
    dump_exception,
)
from mpsched._shm import release_if_orphaned
from mpsched._shm_deque import SlotQueues

_CHILD_DONE = ChildState.DONE
_CHILD_QUEUED = ChildState.QUEUED
_PARENT = BlockField.PARENT
_UID = BlockField.UID
_CHILD_ABANDONED = ChildState.ABANDONED
# A lock still taken this long with no holder recorded is released (its taker never reached the
# pid store: it died, or an exception hit it in between; see _shm.release_if_orphaned). Holders
# keep locks for microseconds, so a second is far beyond any live holder's preemption.
ORPHAN_WAIT = 1.0  # seconds
# SIGKILLed workers in a row, inside the pool's initializer with no task completed meanwhile,
# that break the pool (survives_initializer_kill): an external kill (the OOM killer) is
# survived, an initializer killed by its own memory use every time is not retried for ever.
INIT_KILLS_MAX = 3


class Recovering(CoordinatorState):
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
        if (
            self.has_initializer
            and self.slots[worker.slot].owner_pid() != worker.pid
            and not self.survives_initializer_kill(code)
        ):
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

    def survives_initializer_kill(self, code: int | None) -> bool:
        """A worker died before ``bind_owner``, in (or before) the initializer: count it, and
        return True if that was a SIGKILL from outside (the OOM killer, a user's ``kill -9``),
        to be survived with a replacement. Only SIGKILL: an exit code or another signal is the
        initializer's own doing, the same in every replacement. Survived ``INIT_KILLS_MAX - 1``
        times in a row without a task completing in between: an initializer that is itself
        OOM-killed every time still breaks the pool, after that many respawns.
        (Every such death broke the pool: under ``max_tasks_per_worker=1`` a worker is nearly
        always starting, and one kill of a fresh worker failed every later task.)"""
        if code != -signal.SIGKILL:
            return False
        if self.completed != self.init_kills_completed:  # a task ended since: it works
            self.init_kills_completed = self.completed
            self.init_kills = 0
        self.init_kills += 1
        return self.init_kills < INIT_KILLS_MAX

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
        slot = self.slot_repaired(worker)
        self.release_orphans()
        self.collect()
        outcomes: list[tuple[Future[Any], int, Buffer]] = []
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
                # crash, or with its TimeoutError), as one killed on purpose (forced) is not,
                # nor once shutdown(cancel_futures=True) cancelled all that had not started.
                # Decided under the lock, where cancel_id sets cancel_requested (and
                # begin_shutdown sets cancelling; a retry put back before it is withdrawn there).
                with self.lock:
                    retry = (
                        run is not None
                        and not self.cancelling
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
                        run.started_at = None
                        self.ready.putback([future])  # (which marks it queued)
                if retry:
                    continue
                if run is not None and run.forced and not run.timed_out:
                    status, data = _CANCELLED, b""
                elif run is not None and run.timed_out:
                    status, data = _ERROR, dump_exception(timeout_error(timeout_message(run)))
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

    def slot_repaired(self, worker: WorkerHandle) -> SlotQueues:
        """Release every lock the dead ``worker`` held (its own slot's first), under
        ``repair_lock``: a user thread stalled on one of them may be repairing it at once
        (``on_lock_stall``), and two repairs of one lock both dropped a run-stack record and
        both released it (a lock that no longer excludes). Returns the worker's slot."""
        slot = self.slots[worker.slot]
        slab = self.slab
        with self.repair_lock:
            slot.break_dead_holder(worker.pid, slot, slab, _CHILD_DONE)
            for other in self.slots:
                if other is not slot:
                    other.break_dead_holder(worker.pid, slot, slab, _CHILD_DONE)
            slab.break_dead_holder(worker.pid)
            self.header.break_dead_holder(worker.pid)
        return slot

    def orphan_children(self, k: int, pid: int) -> None:
        """The worker of slot ``k`` died: nobody will collect the children its tasks spawned.
        Each such child block (parent ``k``, in use) is settled so that its block is freed:
        a child still queued or running elsewhere is marked ABANDONED under slot ``k``'s lock
        (its executor frees it when it finishes, as for a dropped ChildFuture); one already
        DONE, or one never published (the worker died inside ``mpsched.submit``, between the
        alloc and the push) or run unrecorded by its own join past the helping depth
        (``Children.join``): in no ring and on no run stack, is freed now. A block allocated
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
        # A result count is zero in a block never published; one that the dead worker ran
        # unrecorded (``Children.join``) may hold the key of a result stashed before its DONE.
        self.drop_stashed_results(done + unpublished, pid)
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
        release_orphaned_locks(self, suspects_only=False)

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
            logger.warning(ORPHAN_RELEASED)  # as in release_orphans: no lock held
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
        if not slab.write_result(handle, _ERROR, dump_exception(error)):
            raise ProtocolError("a crash report does not fit in a block")
        parent = slab.get_word(handle, _PARENT)
        previous = self.slots[parent].exchange_block_state(slab, handle, _CHILD_DONE)
        self.header.add_live_children(-1)
        if previous == _CHILD_ABANDONED:
            slab.free_children([handle])
        elif self.slots[parent].clear_sleeping():
            os.eventfd_write(self.wake_fds[parent], 1)


# A lock taken with no holder recorded: a worker that died between its acquire and its pid
# store, or a thread of this process that an exception (a Ctrl-C) hit there.
ORPHAN_RELEASED = "mpsched: released a shared lock left taken with no holder recorded"


def release_orphaned_locks(state: CoordinatorState, suspects_only: bool) -> None:
    """Coordinator thread: release every cross-process lock left taken with no holder recorded
    for ``ORPHAN_WAIT`` (``_shm.release_if_orphaned``). ``suspects_only``: wait only on a lock
    seen taken with no holder recorded (a free lock, or one whose holder is recorded, costs a
    try-lock, or nothing), so that the drain may poll for orphans: a user thread's Ctrl-C
    between its acquire and its pid store leaves one that no worker repairs (workers wait
    unguarded), and only a guarded wait of this process would find it."""
    locks = state.locks
    if locks is None:
        return
    structures: list[Any] = [*state.slots, state.slab, state.header]
    for lock, structure in zip(locks.all(), structures, strict=True):
        if suspects_only:
            if structure.holder_pid() != 0:
                continue
            if lock.acquire(False):
                lock.release()
                continue
        # One repair at a time (``on_lock_stall`` may be releasing the same orphan): a timed
        # acquire here never calls on_lock_stall, and a stalled thread waits at most the
        # ``ORPHAN_WAIT`` of each lock for it.
        with state.repair_lock:
            released = release_if_orphaned(lock, structure.holder_pid, ORPHAN_WAIT)
        if released:  # logged with no lock held: a logging handler may call the pool
            logger.warning(ORPHAN_RELEASED)


def crash_message(worker: WorkerHandle, code: int | None) -> str:
    if code == USER_ERROR_EXIT:
        causes = (
            "if it was the worker's own exit (its reason and traceback are on its stderr), "
            "user code raised outside a task or inside mpsched's code in one (a signal handler "
            "that a task installed, a finalizer), or a task closed one of the worker's file "
            "descriptors; else os._exit() by a task"
        )
    else:
        causes = (
            "it ran out of memory and was killed (check dmesg for the OOM killer), a crash in "
            "native code (a C extension), or os._exit() / a signal sent to it"
        )
    return (
        f"the worker process (pid {worker.pid}, slot {worker.slot}) running this task died "
        f"with {signal_description(code)}. Likely causes: {causes}. The pool goes on, and "
        "replaces the worker unless it is shutting down with nothing left to run."
    )


def pid_is_dead(pid: int) -> bool:
    """True if ``pid`` has exited (a zombie counts as dead: it runs no more code)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] in (b"Z", b"X")
