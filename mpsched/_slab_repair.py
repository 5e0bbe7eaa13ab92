"""Crash repair of the slab: what the coordinator does after a process died holding its lock.

What this module owns: ``SlabRepair``, the part of ``_payloads.Slab`` that only the coordinator
calls once a worker is known to be dead (or the lock's recorded holder is: a lock stall,
``Coordinator.on_lock_stall``): ``break_dead_holder`` releases the allocator lock the dead
process held and repairs the half-done operation it left. The slot regions' and the global
header's repairs are theirs (``_slot_repair``, ``_layout``).

Who calls what, from which process: the pool's process only (the coordinator thread after a
death, or a thread whose wait on the lock stalled), one breaker at a time under
``Coordinator.repair_lock``; never a worker.

What a death under the allocator lock can leave (the operations are ``_payloads``'s):
    * ``alloc``/``alloc_many``/``free``/``free_many`` commit with ONE store of free_top: the
      free stack holds the old or the new state, never a torn one.
    * ``alloc`` stamps the block on top of the free stack (uid, zero state, links) before its
      commit: a death in between leaves that block free with a child's uid; ``free_many``
      clears the freed children's uid and state after its commit: a death in between leaves
      free blocks with a child's words. The repair clears the uid and state of every free
      block (were one reused, it would read as a child of the dead pid).
    * ``_attach``/``_detach`` (a chain hung on or taken off a block) record the op in the
      header's ``pending_*`` words (the link word, its value, the free_top after the commit),
      commit, store the link and clear the record: a death between the commit and the link
      store leaves the record, and the repair completes the store.

Invariants: a dead process never releases its locks, so while ``holder_pid`` reads the dead pid
nobody else has moved free_top since it died, and the repair may read the header without the
lock: the chain op committed iff free_top reads the recorded ``pending_top``. The repair
releases the lock last, after its stores.

Not handled here: telling a worker died (the coordinator's sentinels), the grace period for a
lock stuck at holder 0 (``_shm.release_if_orphaned``), and freeing the dead worker's blocks
(the coordinator's crash recovery, ``_coord_recovery``: by uid).
"""

from __future__ import annotations

from mpsched._slab_region import (
    _FREE_TOP,
    _HOLDER_PID,
    _PENDING_TOP,
    _PENDING_VALUE,
    _PENDING_WORD,
    _STATE,
    _UID,
    SlabRegion,
)

__all__ = ("SlabRepair",)


class SlabRepair(SlabRegion):
    """The coordinator's repair of the slab after a lock holder died; see the module docstring."""

    def break_dead_holder(self, dead_pid: int) -> bool:
        """The single breaker (coordinator) only: release the allocator lock if ``dead_pid``
        died holding it; the free stack is consistent by the one-store commit."""
        w = self._w
        if dead_pid <= 0 or w[_HOLDER_PID] != dead_pid:
            return False
        # A free block's uid is 0 (a child's free clears it; other blocks carry 0), but for one
        # that ``alloc`` stamped and did not commit (on top of the free stack) and the children
        # that ``free_many`` committed and did not clear (anywhere below). Every free block is
        # cleared (crash path only: one pass over at most ``capacity`` blocks), so that none
        # reads as a child of this pid, were it reused.
        top = w[_FREE_TOP]
        if 0 < top <= self.capacity:
            for index in self._stack[:top]:
                base = self._blocks_word + index * self._block_words
                w[base + _STATE] = 0
                w[base + _UID] = 0
        # A chain op that committed and died before its link store: complete the store.
        if w[_PENDING_WORD] and w[_PENDING_TOP] == top:
            w[w[_PENDING_WORD]] = w[_PENDING_VALUE]
        w[_PENDING_WORD] = 0
        w[_HOLDER_PID] = 0
        self._release()
        return True
