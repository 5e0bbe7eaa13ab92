"""The coordinator's dispatch: handing due tasks to the workers' inboxes (``Dispatching``).

Owns: the direct dispatch of a task submitted to an idle pool (``dispatch_one``, from the
submitting thread), the loop's batched dispatch (``dispatch``: the ready queue into every inbox
with room, in priority order), taking lower-priority tasks back from the inboxes
(``take_back_lower``), writing tasks into slab blocks and injecting them with at most one
wake-up per batch (``inject``, and ``inject_interrupted`` when an exception hits it), and
waking sleeping workers (``wake_sleepers``). docs/design.md has the window ("Dispatch window")
and the order ("Order among due tasks, and the window").

Called from: any thread under ``self.lock`` (``dispatch_one``, through ``Coordinator.submit``),
the coordinator thread (``dispatch``; ``wake_sleepers`` also after a death).

Invariants: at most ``window`` handles wait in an inbox and at most ``max_inflight`` dispatched
tasks are unfinished; a task is in ``by_handle`` before its handle is injected (a result may
come at once); an inbox's back moves only under ``self.lock``, so an injection is committed or
not as a whole, and every committed one owes its sleeping worker a wake-up.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from mpsched._coord_state import _NBYTES, _NO_LOW, _UID_PID_SHIFT, CoordinatorState
from mpsched._future import Future
from mpsched._payloads import BlockField
from mpsched._pool_errors import BrokenPoolError
from mpsched._ready import NO_LEVEL
from mpsched._serialize import with_version
from mpsched._slot_region import INBOX_BACK, INBOX_FRONT

# A top-level task's block: the uid names no process, so orphan_children never takes it for a
# dead worker's child (the block's handle identifies the task; no per-task number is needed).
TOP_LEVEL_UID = 0
# A block the coordinator allocated for one task and has not written yet (see inject): the uid
# names no process either (pid 0), and no live block keeps it past the write.
IN_HAND_UID = 1
_UID = BlockField.UID


class Dispatching(CoordinatorState):
    def keeps_order(self, priority: int) -> bool:
        """Under ``self.lock``: whether a task of ``priority`` may go past ``dispatch``'s guards
        (``dispatch_one``) while tasks are in flight: no inbox holds a lower one, which
        ``take_back_lower`` would take back first, nor a higher one that has not started,
        ahead of which ``waiting_highs`` keeps the other inboxes free (a map's chunks, handed
        so, ran after lower tasks that waited in the inbox, and before a higher one waiting in
        a busy worker's: found in review). The marks may be stale (the tasks they note may
        have started): then the task is only queued for the loop, as it was."""
        slots = self.slots
        for k, low in enumerate(self.inbox_low):
            if low < priority and slots[k].inbox_depth():
                return False
        return not any(levels and levels[0][0] > priority for levels in self.inbox_high)

    def dispatch_one(self, future: Future[Any]) -> bool:
        """Under ``self.lock``: inject one task into the next inbox with room; False if none.
        For a task submitted to an idle pool, and for a chunk of ``Pool.map`` while nothing is
        queued and ``keeps_order`` (``Coordinator.submit``'s ``direct``)."""
        if len(self.by_handle) >= self.max_inflight:
            return False
        # Tasks in flight: noted (``note_levels``), as ``dispatch`` notes its batches, so that
        # the loop keeps lower tasks out of the other inboxes while this one waits.
        note = bool(self.by_handle)
        n = self.n_workers
        slots = self.slots
        workers = self.workers
        # An awake worker that runs nothing first (it may still be spinning after its last
        # task: no wake-up), then one that runs nothing (asleep: woken), then any worker (it
        # runs the task after its current one, unless a sleeper woken by ``inject`` steals it;
        # a map's chunk was handed so to a busy worker while its idle peer slept), then a
        # worker still starting: it finds the task when it starts (right after the pool's
        # creation, the first task does not wait for the SPAWNED round trip). A worker running
        # the pool's initializer (registered, its slot not yet bound) counts as starting: it
        # looks awake, and a task handed to it waited for its initializer's end while a ready
        # peer slept.
        for rank in (0, 1, 2, 3):
            for i in range(n):
                k = (self.next_slot + i) % n
                if rank < 3:
                    if self.not_ready(k):
                        continue
                elif workers[k] is None and k not in self.starting:
                    continue
                slot = slots[k]
                if slot.inbox_depth() >= self.window:
                    continue
                if rank < 2 and (slot.run_depth() or (rank == 0 and slot.is_sleeping())):
                    continue
                self.next_slot = (k + 1) % n
                taken = self.inject(k, [future], future._priority)
                if taken and note:
                    self.note_levels(k, [future], taken)
                return taken == 1
        return False

    def not_ready(self, k: int) -> bool:
        """Under ``self.lock``: slot ``k``'s worker is starting (not registered yet) or runs the
        pool's initializer (registered, its slot not yet bound): it looks awake, but takes no
        task before it is done."""
        worker = self.workers[k]
        return worker is None or (self.has_initializer and self.slots[k].owner_pid() != worker.pid)

    def dispatch(self) -> None:
        n = self.n_workers
        with self.lock:
            due = self.next_due
            if due is not None and due <= (now := time.monotonic()):
                # A version fell due (or was scheduled due at the call) since this pass read
                # next_due: released first, or the submits queued since would be injected
                # ahead of it, though it became due before them.
                self.release_due_locked(now)
            top = self.ready.top_priority()
            highs = None
            if top is not None:
                self.take_back_lower(top)
                highs = self.waiting_highs(self.ready.bottom_priority())
            for i in range(n):
                k = (self.next_slot + i) % n
                if self.workers[k] is None or not self.ready:
                    continue
                depth = self.slots[k].inbox_depth()
                if depth == 0:
                    self.inbox_low[k] = _NO_LOW
                    self.inbox_high[k] = []
                room = min(self.window - depth, self.max_inflight - len(self.by_handle))
                if room > 0:
                    floor = NO_LEVEL
                    if highs is not None:
                        floor = max((h for j, h in enumerate(highs) if j != k), default=NO_LEVEL)
                    batch, lowest = self.take_ready(room, floor)
                    taken = self.inject(k, batch, lowest)
                    if taken:  # waiting there now, unclaimed: the next inboxes get no lower
                        self.note_levels(k, batch, taken)
                        high = batch[0]._priority
                        if highs is None:
                            rest = self.ready.top_priority()
                            if rest is not None and rest < high:
                                highs = [NO_LEVEL] * n
                        if highs is not None:
                            highs[k] = max(highs[k], high)
                    if taken < len(batch):  # slab full: the rest waits for results
                        self.ready.putback(batch[taken:])
                        break
            self.next_slot = (self.next_slot + 1) % n
            self.dispatches += 1

    def waiting_highs(self, bottom: float) -> list[float] | None:
        """Under ``self.lock``: for each inbox, the highest priority of the tasks that wait in
        it unclaimed (``NO_LEVEL`` if none); None if no inbox holds one above ``bottom``, the
        lowest level of the ready queue (one priority in use: no scan). ``dispatch`` gives
        the other inboxes nothing lower: the workers take from their own inbox before they
        steal, so a high task handed with lower ones to a worker busy with a long task waited
        there while its peer ran the lower ones, handed to it after (seconds, with hundreds of
        them: found by a review). Its peer, with nothing in its inbox, steals it instead.
        Known by the last task injected at each priority (``inbox_high``, highest first: an
        inbox is taken from its front, so once that task left, every task injected before it
        did): a cancel that withdrew that one leaves the others of its priority unguarded.
        Base priorities (``_priority``): with aging, a promoted task is held back by its base
        priority."""
        inbox_high = self.inbox_high
        if not any(levels and levels[0][0] > bottom for levels in inbox_high):
            return None
        highs: list[float] = []
        by_handle = self.by_handle
        for k, levels in enumerate(inbox_high):
            while levels:
                priority, handle = levels[0]
                future = by_handle.get(handle)
                if (
                    future is not None
                    and future._slot == k
                    and future._priority == priority
                    and self.slots[k].in_inbox(handle)
                ):
                    break
                levels.pop(0)  # (a few levels: priorities in use)
            highs.append(levels[0][0] if levels else NO_LEVEL)
        return highs

    def take_back_lower(self, top: int) -> None:
        """Under ``self.lock``: a due task of priority ``top`` must not wait behind lower ones
        in the inboxes: take them back (unclaimed entries, under the slot lock: the same race
        as cancel, decided by the lock) to the front of the ready queue, to be re-injected in
        priority order. Costs nothing unless priorities are mixed."""
        for k, low in enumerate(self.inbox_low):
            if low >= top:
                continue
            self.inbox_low[k] = _NO_LOW
            self.inbox_high[k] = []
            futures = [self.by_handle[h] for h in self.slots[k].drain(include_deque=False)]
            # (which marks them queued: out of the inbox), at their aged levels
            self.ready.putback(futures, time.monotonic(), self.aging)

    def note_levels(self, k: int, batch: list[Future[Any]], taken: int) -> None:
        """Under ``self.lock``, as ``dispatch`` put ``batch[:taken]`` into inbox ``k`` (in priority
        order, behind what waits there, which is no lower: ``take_back_lower``): note the last
        task of each of its priorities (``inbox_high``, see ``waiting_highs``). Also for
        ``dispatch_one``'s task while tasks are in flight (a map's chunk), not for one that
        goes to an idle pool, with nothing in flight to wait behind (noted there, the round
        trip of one task took ~3x as long in the benchmark's median, 150-240 us against 60-70:
        the cost was not found, the path kept bare)."""
        levels = self.inbox_high[k]
        last = taken - 1
        one_priority = batch[0]._priority == batch[last]._priority
        for i in range(last if one_priority else 0, taken):  # (one priority: one step)
            future = batch[i]
            priority = future._priority
            if levels and levels[-1][0] == priority:
                levels[-1] = (priority, future._handle)
            else:
                levels.append((priority, future._handle))

    def take_ready(self, n: int, floor: float = NO_LEVEL) -> tuple[list[Future[Any]], float]:
        """Under ``self.lock``: up to ``n`` due tasks of priority ``floor`` and above, minus
        recurring runs that misfired."""
        batch, lowest = self.ready.take(n, floor)
        if self.timetable.recurring:
            batch = [f for f in batch if not self.misfired(f)]
        return batch, lowest

    def inject(self, k: int, batch: list[Future[Any]], lowest: float) -> int:
        """Under ``self.lock``: write ``batch`` into slab blocks (tasks taken back already have
        theirs) and inject them into inbox ``k`` in one lock round, waking a sleeper. Returns
        how many went (the slab may be full)."""
        if not batch:
            return 0
        slab = self.slab
        new = [f for f in batch if f._handle < 0]
        handles: list[int] = []
        back = -1  # the inbox's back before the inject: did an interrupted one commit?
        try:
            if new:
                # A single block is stamped IN_HAND_UID until written: an exception just after
                # alloc() committed it (a Ctrl-C at its lock's release) loses the index, and
                # the stamp is how inject_interrupted finds the block.
                handles = slab.alloc_many(len(new)) if len(new) > 1 else [slab.alloc(IN_HAND_UID)]
                if not handles or handles[0] < 0:
                    handles = []
                if len(handles) < len(new):
                    # Slab short: only the tasks before the first new one left without a block
                    # go (those taken back keep theirs); the caller puts the rest back in
                    # order. (A batch cut only when no block at all was free injected the rest
                    # as handle -1: lost futures, and a worker claiming block -1.)
                    batch = batch[: batch.index(new[len(handles)])]
                    if not batch:
                        return 0
                    new = new[: len(handles)]
                for future, handle in zip(new, handles, strict=False):
                    payload = future._payload
                    due = future._due
                    run = future._run
                    if due is not None:  # a version of an id: its number follows the call
                        deadline = None if run is None else self.misfire_deadline(future)
                        payload = with_version(payload, due.version, deadline)
                    if not slab.write(handle, payload, uid=TOP_LEVEL_UID, state=0):
                        slab.write(handle, b"", uid=TOP_LEVEL_UID, state=0)
                        slab.set_word(handle, _NBYTES, -self.stash_put(payload))
                    if run is None:
                        future._payload = b""
                    else:  # a task taken back keeps its watch: only new ones are registered
                        if not run.retries_left:
                            future._payload = b""  # kept only to run the task again after a crash
                        if run.options.timeout is not None:
                            self.watched[handle] = future
                    future._handle = handle
                    self.by_handle[handle] = future  # before the inject: a result may come at once
            queued = []
            for future in batch:
                future._slot = k
                queued.append(future._handle)
            slot = self.slots[k]
            w = slot._w  # the inbox's back is written only under self.lock, which we hold
            back = w[INBOX_BACK]
            queued_before = back - w[INBOX_FRONT]  # inbox_depth(), with the back kept
            injected, was_sleeping = slot.inject_wake(queued)
            if injected != len(queued):
                raise BrokenPoolError("inbox overflow: the dispatch window is broken")
            self.inbox_low[k] = min(self.inbox_low[k], lowest)
        except BaseException:
            self.inject_interrupted(k, new, handles, back)
            raise
        if was_sleeping:
            os.eventfd_write(self.wake_fds[k], 1)
        elif (
            queued_before + injected > 1 or slot.run_depth() or self.not_ready(k)
        ) and self.header.sleepers():
            # The worker is busy, gets more than it takes at once, or is not ready yet: a
            # sleeper may steal some. (One task handed to an idle, awake worker needs no help:
            # a woken peer would find nothing, and its wake-up costs a CPU that the round trip
            # needs.) Not ready: injected while no worker was (right after Pool()), a task
            # waited in the inbox of one still in its initializer while a peer that had become
            # ready meanwhile (its slot bound, before its registration reached this thread)
            # slept with nothing to wake it, for ever if that initializer waited for the task.
            self.wake_sleepers()
        return len(queued)

    def inject_interrupted(
        self, k: int, new: list[Future[Any]], handles: list[int], back: int
    ) -> None:
        """Under ``self.lock``: an exception hit ``inject`` (in a user thread, a Ctrl-C's
        KeyboardInterrupt in ``submit``'s direct dispatch; in the coordinator thread an
        internal error, which breaks the pool: its sweep of ``by_handle`` ends the tasks).

        Committed (the inbox's back moved: only a holder of ``self.lock`` moves it), the tasks
        are the workers': ``inject_wake`` may have cleared the worker's sleep flag, and a
        wake-up not written then left it asleep for ever with tasks in its inbox (nothing
        woke it again: its flag said awake); a spare one costs a sleeping worker one look.
        Not committed (hit before, or inside ``inject_wake`` before its commit), in a user
        thread: the new tasks are withdrawn and their blocks freed, as by a cancel (their
        futures are then cancelled: ``submit`` raises, the caller never had them). Left
        recorded, such a task waited for the drain's ``cancel_lost``, its block taken, the
        direct dispatch off (``by_handle`` not empty) and the loop sweeping every 5 ms; a
        block allocated and not yet recorded leaked for the pool's life. A slot lock taken
        by the interrupted call before it recorded its holder is released as an orphan: the
        workers wait for it unguarded, and no thread of this process waited for it, so the
        pool, and its drain, hung."""
        slot = self.slots[k]
        if back >= 0 and slot._w[INBOX_BACK] != back:
            os.eventfd_write(self.wake_fds[k], 1)
            return
        if threading.get_ident() == self.thread_id:
            return
        locks = self.locks
        if back >= 0 and locks is not None:
            # Hit inside inject_wake, maybe between its acquire and its holder store: a guarded
            # acquire repairs such an orphan (on_lock_stall, after ORPHAN_WAIT).
            lock = locks.slots[k]
            lock.acquire()
            lock.release()
        slab = self.slab
        if new and self.stash:  # hit between the stash of the arguments and its key's store
            key = (os.getpid() << _UID_PID_SHIFT) | self.stash_counter
            if any(self.stash.get(key) is future._payload for future in new):
                del self.stash[key]
        recorded = []
        for future in new:
            handle = future._handle
            if handle >= 0 and self.by_handle.get(handle) is future:
                del self.by_handle[handle]
                self.watched.pop(handle, None)
                recorded.append(handle)
            future._handle = -1
            future._slot = -1
            future._withdrawn = True
            future._payload = b""
        # Allocated and not recorded yet (maybe written, its arguments stashed); or allocated
        # inside alloc(), the index lost. (An unwritten block's byte count is its previous
        # task's: a key that left the stash with that task, dropped again for nothing.)
        lost = [h for h in handles if h >= 0 and h not in recorded]
        if not handles and new:
            free = set(slab.free_indices())
            lost = [
                h
                for h in range(slab.capacity)
                if slab.get_word(h, _UID) == IN_HAND_UID and h not in free
            ]
        for handle in lost:
            slab.set_uid(handle, TOP_LEVEL_UID)
        self.drop_stashed(recorded + lost)
        slab.free_tasks(recorded + lost)

    def wake_sleepers(self, every: bool = False) -> None:
        """Wake one sleeping worker, or with ``every`` all of them (after a death: the dead
        worker may have died between a publication and its wake-up: a child's DONE published
        and its parent, asleep in ``join``, not woken, which nothing else wakes in an idle
        pool, or a push with the sleeper it owed a wake-up not woken). A woken worker rechecks
        and sleeps again if it has nothing to do; the dead slot's own flag is cleared with the
        rest (its replacement rechecks once).

        With ``every``, each eventfd is written whatever its slot's flag says: the dead worker
        may have cleared a sleeper's flag (which says "a waker writes my fd") and died before
        its write, and that sleeper, no longer flagged, slept on for ever (a task closing the
        worker's copy of that fd made it so every time). A worker that was awake finds its
        eventfd readable at its next sleep and rechecks once."""
        for k, slot in enumerate(self.slots):
            if every:
                slot.clear_sleeping()
                os.eventfd_write(self.wake_fds[k], 1)
            elif slot.is_sleeping() and slot.clear_sleeping():
                os.eventfd_write(self.wake_fds[k], 1)
                return
