"""One worker slot's queues in shared memory: a work-stealing deque and a FIFO inbox.

What this module owns: ``SlotQueues``, every operation on the rings of one slot region (deque,
inbox, done ring) and the claim rule. The region's layout, its constants and hints are in
``_slot_region``; ``SlotQueues`` also carries the coordinator's crash repair (``_slot_repair``)
and the child-block handshake (``_block_state``), so that one object per slot serves every
caller. Slots hold fixed-width int64 handles only (non-negative; their meaning belongs to
``_payloads``), never payload bytes. Names follow crossbeam-deque: the owner works at the
``back`` (LIFO), thieves at the ``front`` (FIFO); never "top"/"bottom", which Chase-Lev and
Java's ForkJoinPool use for opposite ends. Sources: crossbeam-deque ``deque.rs`` (roles,
``Steal::Retry``), Chase & Lev 2005 and FJP's "WorkQueues" overview (index arithmetic, masks,
hints), although this deque is lock-based: every operation holds the slot's one lock.

Who calls what, from which process:
    owner (the worker that owns the slot):  push, pop, take_inbox, pop_or_take,
        mark_running, finish_running, count_inline_run, complete, announce_sleep, bind_owner
    coordinator (thread in the user's process): inject, inject_wake, cancel_injected,
        take_done, and after a worker died: break_dead_holder, take_running, drain
        (``_slot_repair``)
    thieves (any other worker): steal, probe
    anyone: clear_sleeping (wakers), exchange_block_state / block_state (``_block_state``: a
        block word under this slot's lock, the child-task handshake), depths / __len__ / ...
        (``_slot_region``: hints only)

Indices are never wrapped: they are masked on access (``index & (cap - 1)``; 2**63 operations
never happen). Every operation publishes its new index with ONE final store, its commit point:
a process that dies holding the lock leaves either the old or the new state, never a torn one.

The claim rule (the invariant everything else rests on):
    Removing a handle from a ring under the slot lock IS the claim. Each handle comes out of a
    ring exactly once, and a TOMBSTONE never comes out. Why:
    * Every read and write of a ring or its indices happens with the slot lock held, and every
      operation re-reads the indices after acquiring. The lock totally orders the commits.
    * A handle enters a ring once (the commit of push/inject) at a position outside the live
      range [front, back); capacity checks guarantee no live position is overwritten.
    * A removal takes a position inside [front, back) and its commit moves that end past it,
      so any later operation sees the position outside the live range. Owner (``back - 1``)
      and thief (``front``) both test ``front < back`` first, so a last element goes to one.
    * ``cancel_injected`` overwrites a live inbox position with TOMBSTONE under the same lock;
      every remover skips TOMBSTONEs (moving front past them, returning nothing). Cancel and
      claim thus race under one lock: the first to commit wins, the other sees the result
      (outside the range, or a TOMBSTONE). Exactly one wins.
    * A crash in the lock leaves the pre- or post-commit state; an aligned 8-byte store is atomic.

Recording the claim (so a crash never loses a task): with ``mark_running=True`` (owner) or
``steal(into=own_slot)`` (thief) the handle is written into the claimer's own run_stack in the
SAME lock hold, BEFORE the commit; ``complete`` commits done_back, THEN pops the run_stack. What
a crash at each step leaves, and its repair: ``_slot_repair``.

Memory ordering: no fence exists outside the SemLock's atomic operations, so every
publication happens under the lock (safe on ARM too). Unlocked reads (``__len__``, the peek in
``steal``, ``running``) are hints: two racy words are no snapshot, so differences are clamped.

Not handled here: which victim to steal from, when to sleep, waking (eventfd writes), what a
handle means, and lock timeouts (the caller's policy; ``acquire`` here blocks, except steal).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence

from mpsched._block_state import BlockHandshake
from mpsched._constants import Constants
from mpsched._errors import InternalError
from mpsched._slot_region import (
    DEQUE_BACK,
    DEQUE_FRONT,
    DONE_BACK,
    DONE_FRONT,
    EMPTY_HANDLE,
    EXECUTED,
    HOLDER_PID,
    INBOX_BACK,
    INBOX_FRONT,
    INJECTED_TAKEN,
    MAX_NESTING,
    OWNER_PID,
    PUSHED,
    RUN_DEPTH,
    RUN_STACK,
    SLEEPING,
    STOLEN,
    TOMBSTONE,
    _find,
    _record_running,
    _segments,
    track_pid,
)
from mpsched._slot_repair import SlotRepair

# typing.TYPE_CHECKING without importing typing at run time (why: mpsched/__init__.py).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Final

__all__ = (
    "SlotQueues",
    "StealResult",
)

ARRAY_FILL_MIN = 8  # inject: from this many handles, one array slice store beats a loop

# Our pid for holder_pid, without an os.getpid() syscall (0.17 us) per operation.
_pid = track_pid(globals())


class StealResult(Constants):
    """Outcome of ``SlotQueues.steal`` (crossbeam ``Steal``)."""

    EMPTY: Final = 0  # nothing to steal (a hint when the unlocked peek says so; exact once locked)
    SUCCESS: Final = 1  # a handle was claimed; it is the second element of the tuple
    RETRY: Final = 2  # the victim's lock was busy; try another victim, then this one again


# Preallocated results: a steal that finds nothing allocates no tuple.
_STEAL_EMPTY = (StealResult.EMPTY, EMPTY_HANDLE)
_STEAL_RETRY = (StealResult.RETRY, EMPTY_HANDLE)
_SUCCESS = StealResult.SUCCESS

_OWNER_METHODS = (
    "push",
    "pop",
    "take_inbox",
    "pop_or_take",
    "mark_running",
    "finish_running",
    "count_inline_run",
    "complete",
)


class SlotQueues(SlotRepair, BlockHandshake):
    """The deque and inbox of one worker slot; see the module docstring for roles and layout.

    Every method but ``steal`` may block briefly on the slot lock (spin, then sleep).
    """

    # Owner (the worker that owns the slot).

    def bind_owner(self) -> None:
        """Owner, once at start: record this process as the slot's owner."""
        self._w[OWNER_PID] = _pid

    def push(self, handle: int) -> bool:
        """Owner only: push ``handle`` at the back of the deque.

        Returns:
            False if the deque is full; the caller then runs the child inline.
        """
        w = self._w
        if not self._acquire(False):
            self._acquire_contended()
        try:
            w[HOLDER_PID] = _pid
            back = w[DEQUE_BACK]
            if back - w[DEQUE_FRONT] >= self._dcap:
                return False
            self._deque[back & self._dmask] = handle
            w[DEQUE_BACK] = back + 1  # commit
        finally:
            w[HOLDER_PID] = 0
            self._release()
        w[PUSHED] += 1
        return True

    def pop(self, mark_running: bool = False) -> int:
        """Owner only: claim the back of the deque (LIFO); -1 if it is empty.

        Args:
            mark_running: record the handle in this slot's run_stack before the commit.
        """
        w = self._w
        if not self._acquire(False):
            self._acquire_contended()
        try:
            w[HOLDER_PID] = _pid
            back = w[DEQUE_BACK] - 1
            if back < w[DEQUE_FRONT]:
                return EMPTY_HANDLE
            handle = self._deque[back & self._dmask]
            if mark_running:
                _record_running(w, handle)
            w[DEQUE_BACK] = back  # commit
        finally:
            w[HOLDER_PID] = 0
            self._release()
        return handle

    def take_inbox(self, mark_running: bool = False) -> int:
        """Owner only: claim the front of the inbox (FIFO), skipping TOMBSTONEs; -1 if none."""
        w = self._w
        if not self._acquire(False):
            self._acquire_contended()
        try:
            w[HOLDER_PID] = _pid
            handle = self._claim_inbox(w if mark_running else None)
        finally:
            w[HOLDER_PID] = 0
            self._release()
        if handle >= 0:
            w[INJECTED_TAKEN] += 1
        return handle

    def pop_or_take(self, mark_running: bool = False, take_inbox: bool = True) -> int:
        """Owner only, one lock round: the deque's back if any, else the inbox's front (not
        with ``take_inbox`` False: a join helps with children only, see ``Worker.join``).

        "Finish what we started before we take on something new" (rayon): children first.
        Returns -1 if both are empty.
        """
        w = self._w
        if not self._acquire(False):
            self._acquire_contended()
        try:
            w[HOLDER_PID] = _pid
            # The worker's main claim: _claim_inbox and _record_running are inlined here, as
            # a Python call costs about 50 ns on this path.
            back = w[DEQUE_BACK] - 1
            if back >= w[DEQUE_FRONT]:
                handle = self._deque[back & self._dmask]
                if mark_running:
                    depth = w[RUN_DEPTH]
                    if depth >= MAX_NESTING:
                        _record_running(w, handle)  # raises
                    w[RUN_STACK + depth] = handle
                    w[RUN_DEPTH] = depth + 1
                w[DEQUE_BACK] = back  # commit
                return handle
            if not take_inbox:
                return EMPTY_HANDLE
            front = w[INBOX_FRONT]
            back = w[INBOX_BACK]
            handle = EMPTY_HANDLE
            while front < back:
                handle = self._inbox[front & self._imask]
                front += 1
                if handle != TOMBSTONE:
                    if mark_running:
                        depth = w[RUN_DEPTH]
                        if depth >= MAX_NESTING:
                            _record_running(w, handle)  # raises
                        w[RUN_STACK + depth] = handle
                        w[RUN_DEPTH] = depth + 1
                    break
            else:
                if front == w[INBOX_FRONT]:
                    return EMPTY_HANDLE
                handle = EMPTY_HANDLE
            w[INBOX_FRONT] = front  # commit (also drops the tombstones skipped)
        finally:
            w[HOLDER_PID] = 0
            self._release()
        if handle >= 0:
            w[INJECTED_TAKEN] += 1
        return handle

    def mark_running(self, handle: int) -> None:
        """Owner only: record a task run without a claim (e.g. inline after a failed push)."""
        _record_running(self._w, handle)

    def count_inline_run(self) -> None:
        """Owner only: count a child that ran inline, on no run stack (``Worker.run_inline``)."""
        self._w[EXECUTED] += 1

    def uncount_run(self) -> None:
        """Owner only: the next ``complete`` counts no run: a recurring run dropped unstarted
        as a misfire (``Worker.run``), whose function is never called. Counted, the slot's
        ``executed`` summed past the pool's ``completed`` (found in review)."""
        self._w[EXECUTED] -= 1

    def finish_running(self) -> int:
        """Owner only: the innermost running task ended; pop its record, count it, return it."""
        w = self._w
        depth = w[RUN_DEPTH] - 1
        if depth < 0:
            raise InternalError("finish_running() with an empty run_stack")
        handle = w[RUN_STACK + depth]
        w[RUN_DEPTH] = depth
        w[EXECUTED] += 1
        return handle

    def complete(self, handle: int) -> bool:
        """Owner only: the innermost running task, top-level ``handle``, has its result in its
        block: move it from the run_stack to the done ring in one lock round. Returns whether
        the done ring was empty before (a lazy sweep wants such a push poked: ``Worker.run``)."""
        w = self._w
        # Counted before the commit: once the coordinator has the result (and the caller its
        # future), statistics() counts the run (a death in between counts a failed run).
        w[EXECUTED] += 1
        if not self._acquire(False):
            self._acquire_contended()
        try:
            w[HOLDER_PID] = _pid
            depth = w[RUN_DEPTH] - 1
            if depth < 0 or w[RUN_STACK + depth] != handle:
                raise InternalError(f"complete({handle}) but it is not the innermost running task")
            back = w[DONE_BACK]
            queued = back - w[DONE_FRONT]
            if queued >= self._ccap:
                raise InternalError(f"done ring full ({self._ccap}): too many tasks in flight")
            self._done[back & self._cmask] = handle
            w[DONE_BACK] = back + 1  # commit: the coordinator owns the handle now
            w[RUN_DEPTH] = depth  # the record went stale at the commit
        finally:
            w[HOLDER_PID] = 0
            self._release()
        return queued == 0

    def announce_sleep(self, children_only: bool = False) -> bool:
        """Owner only: set ``sleeping`` if, under the lock, both rings are empty (the deque,
        with ``children_only``: a joining worker takes nothing from its inbox).

        The "announce" of "announce, then recheck": a waker that injects (``inject_wake``) or
        clears the flag (``clear_sleeping``) afterwards sees it under the same lock and must
        write the owner's wake fd. Tombstones count as work here (taking them drops them).

        Returns:
            True if announced (the owner may now block on its wake fd).
        """
        w = self._w
        if not self._acquire(False):
            self._acquire_contended()
        try:
            w[HOLDER_PID] = _pid
            if w[DEQUE_BACK] > w[DEQUE_FRONT] or (
                not children_only and w[INBOX_BACK] > w[INBOX_FRONT]
            ):
                return False
            w[SLEEPING] = 1
        finally:
            w[HOLDER_PID] = 0
            self._release()
        return True

    # Coordinator.

    def inject(self, handles: Sequence[int]) -> int:
        """Coordinator only: append handles at the inbox back in one lock round.

        Returns:
            How many fit: that prefix of ``handles`` was injected, the rest was not.
        """
        return self.inject_wake(handles, False)[0]

    def inject_wake(self, handles: Sequence[int], wake: bool = True) -> tuple[int, bool]:
        """Coordinator only: ``inject``, and in the same lock round clear ``sleeping``.

        Returns:
            (how many fit, whether the owner had announced sleep: then write its wake fd).
        """
        w = self._w
        n = len(handles)
        if not self._acquire(False):
            self._acquire_contended()
        try:
            w[HOLDER_PID] = _pid
            back = w[INBOX_BACK]
            room = self._icap - (back - w[INBOX_FRONT])
            if n > room:  # not min(): a builtin call costs ~100 ns on this interpreter
                n = room
                handles = handles[:room]
            inbox, mask = self._inbox, self._imask
            lo = back & mask
            if n >= ARRAY_FILL_MIN and lo + n <= mask + 1:
                inbox[lo : lo + n] = array("q", handles)
            else:
                i = back
                for handle in handles:
                    inbox[i & mask] = handle
                    i += 1
            w[INBOX_BACK] = back + n  # commit
            woke = wake and n > 0 and w[SLEEPING] != 0
            if woke:
                w[SLEEPING] = 0
        finally:
            w[HOLDER_PID] = 0
            self._release()
        return n, woke

    def cancel_injected(self, handle: int) -> bool:
        """Coordinator only: turn a still-queued inbox entry into a TOMBSTONE.

        Returns:
            True if ``handle`` was in [inbox_front, inbox_back) and now nobody will ever claim
            it; False if it was already claimed (or never injected here).
        """
        w = self._w
        if not self._acquire(False):
            self._acquire_contended()
        try:
            w[HOLDER_PID] = _pid
            pos = _find(self._inbox, self._imask, w[INBOX_FRONT], w[INBOX_BACK], handle)
            if pos < 0:
                return False
            self._inbox[pos & self._imask] = TOMBSTONE  # commit
        finally:
            w[HOLDER_PID] = 0
            self._release()
        return True

    def in_inbox(self, handle: int) -> bool:
        """Whether ``handle`` still waits in the inbox (unclaimed), under the lock."""
        return self._ring_holds(self._inbox, self._imask, INBOX_FRONT, INBOX_BACK, handle)

    def in_deque(self, handle: int) -> bool:
        """Whether ``handle`` still waits in the deque (not popped or stolen), under the lock.
        A child leaves its spawner's deque only to run (a pop or a steal records it on a run
        stack in the same lock hold), so for a child this tells queued from started."""
        return self._ring_holds(self._deque, self._dmask, DEQUE_FRONT, DEQUE_BACK, handle)

    def _ring_holds(self, ring: memoryview, mask: int, front: int, back: int, handle: int) -> bool:
        """Whether ``ring`` (its indices in header words ``front``/``back``) holds ``handle``."""
        w = self._w
        if not self._acquire(False):
            self._acquire_contended()
        try:
            w[HOLDER_PID] = _pid
            return _find(ring, mask, w[front], w[back], handle) >= 0
        finally:
            w[HOLDER_PID] = 0
            self._release()

    def take_done(self, into: list[int] | None = None) -> list[int]:
        """Coordinator only: collect every completed handle (FIFO), one lock round, into
        ``into`` (a new list if None); returns it. ``into`` gets them at the commit, with no
        call in between (Python raises a signal handler's exception only at a call, a return
        or a backward jump): a Ctrl-C raised once the ring's front moved (as the lock's
        release or this call returns) finds them in the caller's list, not lost with this
        frame (their futures then ended cancelled at the drain, though their tasks ran)."""
        w = self._w
        out = [] if into is None else into
        if not self._acquire(False):
            self._acquire_contended()
        try:
            w[HOLDER_PID] = _pid
            back = w[DONE_BACK]
            taken = []
            for lo, hi in _segments(w[DONE_FRONT], back, self._cmask):
                taken += self._done[lo:hi].tolist()
            w[DONE_FRONT] = back  # commit
            out += taken
        finally:
            w[HOLDER_PID] = 0
            self._release()
        return out

    # Thieves (any process but the owner).

    def steal(self, into: SlotQueues | None = None, take_inbox: bool = True) -> tuple[int, int]:
        """Claim the deque's front, else the inbox's front. Never blocks: one try-lock.

        Args:
            into: the thief's OWN slot; the handle is recorded in its run_stack before the
                victim's commit (so a thief's crash cannot lose it), and counted as stolen.
            take_inbox: False for a joining thief, which helps with children only.

        Returns:
            ``(SUCCESS, handle)``, ``(EMPTY, -1)`` or ``(RETRY, -1)``.
        """
        w = self._w
        # hint only: racy, maybe stale; a false EMPTY is a missed steal, never a lost task
        if w[DEQUE_BACK] <= w[DEQUE_FRONT] and (not take_inbox or w[INBOX_BACK] <= w[INBOX_FRONT]):
            return _STEAL_EMPTY
        if not self._acquire(False):
            return _STEAL_RETRY
        record_in = None if into is None else into._w
        try:
            w[HOLDER_PID] = _pid
            front = w[DEQUE_FRONT]
            if front < w[DEQUE_BACK]:
                handle = self._deque[front & self._dmask]
                if record_in is not None:  # _record_running, inlined (a call costs ~50 ns)
                    depth = record_in[RUN_DEPTH]
                    if depth >= MAX_NESTING:
                        _record_running(record_in, handle)  # raises
                    record_in[RUN_STACK + depth] = handle
                    record_in[RUN_DEPTH] = depth + 1
                w[DEQUE_FRONT] = front + 1  # commit
            elif take_inbox:
                handle = self._claim_inbox(record_in)
            else:
                handle = EMPTY_HANDLE
        finally:
            w[HOLDER_PID] = 0
            self._release()
        if handle < 0:
            return _STEAL_EMPTY
        if record_in is not None:
            record_in[STOLEN] += 1
        return _SUCCESS, handle

    def probe(self, children_only: bool = False) -> bool:
        """Whether a live handle is queued (in the deque only, with ``children_only``), read
        under the lock (a fence, unlike ``len``).

        Use it as the "recheck" of announce-then-recheck before sleeping.
        """
        w = self._w
        if not self._acquire(False):
            self._acquire_contended()
        try:
            w[HOLDER_PID] = _pid
            if w[DEQUE_BACK] > w[DEQUE_FRONT]:
                return True
            return not children_only and any(
                h != TOMBSTONE
                for lo, hi in _segments(w[INBOX_FRONT], w[INBOX_BACK], self._imask)
                for h in self._inbox[lo:hi].tolist()
            )
        finally:
            w[HOLDER_PID] = 0
            self._release()

    # Anyone.

    def clear_sleeping(self) -> bool:
        """Wakers (or the owner once awake): clear ``sleeping`` under the lock.

        Returns:
            True if it was set: the caller must then write the owner's wake fd.
        """
        w = self._w
        if not self._acquire(False):
            self._acquire_contended()
        try:
            w[HOLDER_PID] = _pid
            was = w[SLEEPING] != 0
            w[SLEEPING] = 0
        finally:
            w[HOLDER_PID] = 0
            self._release()
        return was

    # Internals.

    def _claim_inbox(self, record_in: memoryview | None) -> int:
        """Claim the inbox front, skipping TOMBSTONEs. The caller holds the lock."""
        w = self._w
        front = start = w[INBOX_FRONT]
        back = w[INBOX_BACK]
        while front < back:
            handle = self._inbox[front & self._imask]
            front += 1
            if handle != TOMBSTONE:
                if record_in is not None:
                    _record_running(record_in, handle)
                w[INBOX_FRONT] = front  # commit (also drops the tombstones skipped)
                return handle
        if front != start:
            w[INBOX_FRONT] = front  # only tombstones: drop them
        return EMPTY_HANDLE

    def _install_debug_checks(self) -> None:
        for name in _OWNER_METHODS:
            setattr(self, name, _owner_checked(self, getattr(self, name), name))
        plain_push, plain_inject_wake = self.push, self.inject_wake

        def push(handle: int) -> bool:
            _check_handles((handle,))
            return plain_push(handle)

        def inject_wake(handles: Sequence[int], wake: bool = True) -> tuple[int, bool]:
            _check_handles(handles)
            return plain_inject_wake(handles, wake)

        self.push = push  # type: ignore[method-assign]
        self.inject_wake = inject_wake  # type: ignore[method-assign]


def _check_handles(handles: Sequence[int]) -> None:
    if any(h < 0 for h in handles):
        raise InternalError(f"handles must be non-negative (TOMBSTONE is {TOMBSTONE})")


def _owner_checked(sq: SlotQueues, method: Callable[..., Any], name: str) -> Callable[..., Any]:
    def checked(*args: Any) -> Any:
        owner = sq._w[OWNER_PID]
        if owner != _pid:
            raise InternalError(f"SlotQueues.{name}() is owner-only: owner {owner}, caller {_pid}")
        return method(*args)

    return checked
