"""Crash repair of a slot region: what the coordinator does after a worker died.

What this module owns: ``SlotRepair``, the part of ``_shm_deque.SlotQueues`` that only the
coordinator calls once a worker is known to be dead (or a lock's recorded holder is: a lock
stall, ``Coordinator.on_lock_stall``): breaking the dead holder's lock and repairing the half-done
operation it left (``break_dead_holder``), taking a dead owner's running tasks and clearing its
slot for a replacement (``take_running``), and claiming or listing everything queued (``drain``).
The slab's and the global header's repairs are theirs (``_slab_repair``, ``_layout``).

Who calls what, from which process: the coordinator (a thread in the user's process, the single
breaker) only; never a worker. ``break_dead_holder`` runs on every slot whose lock the dead
worker may hold, BEFORE ``take_running`` on its own slot and before anything reads its run
stack as exact (``running``).

Recording the claim (so a crash never loses a task):
    With ``mark_running=True`` (owner) or ``steal(into=own_slot)`` (thief) the handle is written
    into the claimer's own run_stack in the SAME lock hold, BEFORE the commit. A thief needs no
    lock of its own for that: only its own process writes its slot's run_stack. A crash after
    each step leaves:
        0. acquire                   lock stuck, holder_pid 0: the breaker may release it only
                                     after a grace period once the death is known
        1. holder_pid = me           nothing changed; ``break_dead_holder`` releases the lock
        2. run_stack[depth] = h      a record beyond run_depth: ignored
        3. run_depth = depth + 1     h both queued and recorded: ``break_dead_holder`` drops the
                                     record because h is still queued (the claim never happened)
        4. index commit              h claimed and recorded: running; fail or re-run it
        5. holder_pid = 0            as 4, with the lock stuck at holder 0 (as 0)
        6. release
    push/inject write the ring slot(s), then commit the index: a crash before the commit leaves
    the handles out of the ring (a dying owner takes its unpushed child with it). ``complete``
    commits done_back, THEN pops the run_stack: a crash in between leaves the handle in both,
    and ``break_dead_holder`` drops the stale record (found in the done ring). Likewise
    ``exchange_block_state(finished_by=...)`` commits the state word, then pops the executor's
    run_stack: after a crash in between, ``break_dead_holder`` (given the block states and the
    "done" value) drops the record, before it releases the lock (after it, the block may be
    freed and reused). All this needs handles to be unique while
    live: the engine must not reuse a block index while that task is queued, running or done
    but uncollected. ``drain`` (coordinator only) commits twice, once per ring.

Invariants: a dead process never releases its locks, so while ``holder_pid`` reads the dead pid
nobody else has moved this slot's indices since it died, and the repair may read them without
the lock; it decides on the stale record BEFORE the release (after it, a parent may free the
block and a new task reuse it).

Not handled here: telling a worker died (the coordinator's sentinels), the grace period for a
lock stuck at holder 0 (``_shm.release_if_orphaned``), and failing or re-running the tasks
``take_running`` returns.
"""

from __future__ import annotations

from mpsched._slot_region import (
    DEQUE_BACK,
    DEQUE_FRONT,
    DONE_BACK,
    DONE_FRONT,
    HOLDER_PID,
    INBOX_BACK,
    INBOX_FRONT,
    MAX_NESTING,
    OWNER_PID,
    RUN_DEPTH,
    RUN_STACK,
    TOMBSTONE,
    SlotRegion,
    _find,
    _segments,
    track_pid,
)

# typing.TYPE_CHECKING without importing typing at run time (why: mpsched/__init__.py).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from mpsched._block_state import BlockStates

__all__ = ("SlotRepair",)

_pid = track_pid(globals())


class SlotRepair(SlotRegion):
    """The coordinator's repair of a slot after a worker died; see the module docstring."""

    def break_dead_holder(
        self,
        dead_pid: int,
        dead_slot: SlotRegion,
        states: BlockStates | None = None,
        finished: int = -1,
    ) -> bool:
        """One breaker at a time (the pool's process, under ``Coordinator.repair_lock``), once
        ``dead_pid`` is known to be dead.

        If ``dead_pid`` holds this slot's lock: drop ``dead_slot``'s innermost run_stack record
        if its handle is still queued here (step 3 done, commit not), already in the done ring
        (``complete`` committed, pop not) or its block's state in ``states`` already reads
        ``finished`` (``exchange_block_state(finished_by=dead_slot)`` committed, pop not),
        clear holder_pid and release the lock from here.

        The last one is decided here, before the release: once the lock is free, the block's
        owner (a parent that reads its child's state under this lock) may free the block and
        reuse it, and a record left behind would then name another task's block.

        Args:
            dead_pid: the dead worker's pid.
            dead_slot: the slot that worker owned (may be ``self``).
            states: where block state words live (the slab), with ``finished``: the state a
                finished task's exchange stores (a value no task that runs ever has).

        Returns:
            True if the lock was released.
        """
        w = self._w
        if dead_pid <= 0 or w[HOLDER_PID] != dead_pid:
            return False
        dw = dead_slot._w
        depth = dw[RUN_DEPTH]
        if 0 < depth <= MAX_NESTING:
            h = dw[RUN_STACK + depth - 1]
            if (
                (states is not None and states.get_state(h) == finished)
                or _find(self._deque, self._dmask, w[DEQUE_FRONT], w[DEQUE_BACK], h) >= 0
                or _find(self._inbox, self._imask, w[INBOX_FRONT], w[INBOX_BACK], h) >= 0
                or _find(self._done, self._cmask, w[DONE_FRONT], w[DONE_BACK], h) >= 0
            ):
                dw[RUN_DEPTH] = depth - 1
        w[HOLDER_PID] = 0
        self._release()
        return True

    def take_running(self) -> list[int]:
        """Coordinator only, once the owner is dead and ``break_dead_holder`` ran on every slot:
        return the run_stack (outermost first; these tasks were running) and clear the slot's
        ownership for a replacement."""
        handles = self.running()
        self._w[RUN_DEPTH] = 0
        self._w[OWNER_PID] = 0
        return handles

    def drain(self, include_deque: bool = True, remove: bool = True) -> list[int]:
        """Coordinator only: claim everything queued, one lock round (the inbox only, to take
        injected tasks back for re-ordering: the same race against claims as a cancel); with
        ``remove=False``, only list it (a snapshot; nothing is claimed).

        Returns:
            The deque's handles front to back (if included), then the inbox's live handles in
            FIFO order.
        """
        w = self._w
        if not self._acquire(False):
            self._acquire_contended()
        try:
            w[HOLDER_PID] = _pid
            out = []
            rings = [(self._inbox, self._imask, INBOX_FRONT, w[INBOX_BACK])]
            if include_deque:
                rings.insert(0, (self._deque, self._dmask, DEQUE_FRONT, w[DEQUE_BACK]))
            for ring, mask, front_word, back in rings:
                for lo, hi in _segments(w[front_word], back, mask):
                    out += [h for h in ring[lo:hi].tolist() if h != TOMBSTONE]
                if remove:
                    w[front_word] = back  # commit of this ring
        finally:
            w[HOLDER_PID] = 0
            self._release()
        return out
