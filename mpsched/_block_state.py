"""The block-state handshake: a child block's state word, exchanged under its parent's slot lock.

What this module owns: ``BlockHandshake``, the part of ``_shm_deque.SlotQueues`` that reads and
writes a slab block's ``state`` word (and, taking a block over, its ``uid``) under THIS slot's
lock, and the structural type ``BlockStates`` of where those words live (``_payloads.Slab``; a
leaf does not import another). The values are ``_protocol.ChildState``'s (QUEUED, DONE,
ABANDONED); what they mean to the engine is decided in ``_children`` and ``_coordinator``.

Who calls what, from which process (the slot is always the child's PARENT's, i.e. its
spawner's: a child's state word is guarded by the lock of the slot it was spawned from):
    executor of a child (any worker): ``exchange_block_state(DONE, finished_by=own slot,
        unless=ABANDONED, taker=uid)`` once the child's result is in its block
        (``Worker.finish_child``)
    parent (the worker that owns the slot): ``block_state`` before it collects a child it saw
        DONE (``Worker.collect_child``, ``Worker.idle``), ``exchange_block_state(ABANDONED)``
        when it drops a child's future (``Worker.release_abandoned``)
    coordinator, after a worker died: ``exchange_block_state`` to mark a dead parent's queued
        children ABANDONED (``orphan_children``), or to publish DONE, with the crash as its
        error, for a child that was running in the dead worker (``fail_child``)

Invariants:
    * The state word of a child changes only under its parent's slot lock, so the exchanges are
      totally ordered: of DONE (executor) and ABANDONED (parent), whoever stores second sees
      the other's value and frees the block; nobody frees it twice.
    * ``finished_by``: the executor's run_stack record of the child is popped in the SAME lock
      hold, after the state store (the commit). The parent frees the block only after reading
      DONE under this lock, so a handle is never both on a run stack and free. A crash between
      the commit and the pop leaves a stale record, which ``SlotRepair.break_dead_holder``
      (given the block states and the DONE value) drops before it releases the lock.
    * ``taker``: an executor that finds the child ABANDONED leaves it ABANDONED and, in the same
      hold and before the pop, stores its own uid in the block: from the pop on, the block is
      the executor's to free, and the crash recovery of the parent no longer takes it for the
      parent's.
    * Like every slot operation, these store ``holder_pid`` right after the acquire and clear
      it right before the release (``_slot_region``).

Not handled here: what the engine does with the previous state (free, wake, collect), and top-
level tasks' state words (``_protocol.TopState``, written by the coordinator without this lock).
"""

from __future__ import annotations

from mpsched._errors import InternalError
from mpsched._slot_region import EXECUTED, HOLDER_PID, RUN_DEPTH, RUN_STACK, SlotRegion, track_pid

# typing.TYPE_CHECKING without importing typing at run time (why: mpsched/__init__.py).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Protocol

__all__ = ("BlockHandshake",)

_pid = track_pid(globals())


if TYPE_CHECKING:  # structural types, for annotations only

    class BlockStates(Protocol):
        """Where block state words live (``_payloads.Slab``); a leaf does not import another."""

        def get_state(self, index: int, /) -> int: ...

        def set_state(self, index: int, value: int, /) -> None: ...

        def set_uid(self, index: int, value: int, /) -> None: ...


class BlockHandshake(SlotRegion):
    """A block's state word under this slot's lock; see the module docstring."""

    def exchange_block_state(
        self,
        states: BlockStates,
        handle: int,
        value: int,
        finished_by: SlotRegion | None = None,
        unless: int = -1,
        taker: int = 0,
    ) -> int:
        """Under this slot's lock, set block ``handle``'s state to ``value``; return the old one.

        Args:
            states: the slab holding the block.
            finished_by: the caller's OWN slot, when the caller just ran ``handle``: its run_stack
                record is popped in the same lock hold, after the state store.
            unless: a state that stays as it is (returned, not overwritten).
            taker: with ``unless``, if the state reads ``unless``: stored as the block's uid in
                the same hold, before the pop (the caller takes the block over to free it, and
                a crash recovery must find it as the caller's from then on).
        """
        w = self._w
        if finished_by is not None:  # counted before the commit, as in complete()
            finished_by._w[EXECUTED] += 1
        if not self._acquire(False):
            self._acquire_contended()
        try:
            w[HOLDER_PID] = _pid
            if finished_by is not None:
                fw = finished_by._w
                depth = fw[RUN_DEPTH] - 1
                if depth < 0 or fw[RUN_STACK + depth] != handle:
                    raise InternalError(f"block {handle} is not its executor's innermost task")
            previous = states.get_state(handle)
            if previous != unless:
                states.set_state(handle, value)  # commit
            elif taker:
                states.set_uid(handle, taker)
            if finished_by is not None:
                fw[RUN_DEPTH] = depth  # the record went stale at the commit
        finally:
            w[HOLDER_PID] = 0
            self._release()
        return previous

    def block_state(self, states: BlockStates, handle: int) -> int:
        """Block ``handle``'s state, read under this slot's lock (ordered with the exchanges)."""
        w = self._w
        if not self._acquire(False):
            self._acquire_contended()
        try:
            w[HOLDER_PID] = _pid
            return states.get_state(handle)
        finally:
            w[HOLDER_PID] = 0
            self._release()
