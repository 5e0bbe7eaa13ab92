"""One worker slot's queues in shared memory: a work-stealing deque and a FIFO inbox.

What this module owns: the layout of one slot region (header, running stack, deque ring, inbox
ring) and every operation on it. The region lives inside the pool's ``AnonSegment``; ``_layout``
decides where. Slots hold fixed-width int64 handles only (non-negative; their meaning belongs to
``_payloads``), never payload bytes. Names follow crossbeam-deque: the owner works at the
``back`` (LIFO), thieves at the ``front`` (FIFO); never "top"/"bottom", which Chase-Lev and
Java's ForkJoinPool use for opposite ends. Sources: crossbeam-deque ``deque.rs`` (roles,
``Steal::Retry``), Chase & Lev 2005 and FJP's "WorkQueues" overview (index arithmetic, masks,
hints), although this deque is lock-based: every operation holds the slot's one lock.

Who calls what, from which process:
    owner (the worker that owns the slot):  push, pop, take_inbox, pop_or_take,
        mark_running, finish_running, complete, announce_sleep, bind_owner
    coordinator (thread in the user's process): inject, inject_wake, cancel_injected,
        take_done, and after a worker died: break_dead_holder, take_running, drain
    thieves (any other worker): steal, probe
    anyone: clear_sleeping (wakers), exchange_block_state / block_state (a block word under
        this slot's lock: the child-task handshake), depths / __len__ / ... (hints only)

Region layout (int64 words; one lock per slot, passed in by the caller):

    # offset   size  field           writer                     meaning
    #    0       8   holder_pid      lock holder                pid holding the slot lock, 0 = none;
    #                                                           stored right after acquire, cleared
    #                                                           right before release (crash repair)
    #    8       8   deque_front     lock holder (thieves)      next index to steal; only grows
    #   16       8   deque_back      lock holder (owner)        next index to push; pop lowers it,
    #                                                           never below deque_front
    #   24       8   inbox_front     lock holder (owner,        next inbox index to take; only grows
    #                                thieves)
    #   32       8   inbox_back      lock holder (coordinator)  next inbox index to fill; only grows
    #   40       8   sleeping        lock holder (owner sets,   1 = owner announced it sleeps on its
    #                                wakers clear)              wake fd; 0 = awake
    #   48       8   done_front      lock holder (coordinator)  next done index to collect; grows
    #   56       8   done_back       lock holder (owner)        next done index to fill; grows
    #   64       8   magic           creator, const             SLOT_MAGIC (catches a wrong offset)
    #   72       8   deque_capacity  creator, const             D, a power of two
    #   80       8   inbox_capacity  creator, const             I, a power of two
    #   88       8   owner_pid       owner (bind_owner);        pid of the owning worker, 0 = none
    #                                coordinator clears
    #   96       8   done_capacity   creator, const             C, a power of two (0: no done ring)
    #  104      24   (spare)
    #  128       8   executed        owner                      tasks finished (finish_running)
    #  136       8   stolen          owner                      handles it stole (steal(into=own))
    #  144       8   pushed          owner                      successful push() calls
    #  152       8   injected_taken  owner                      handles taken from its own inbox
    #  160       8   run_depth       owner                      used entries of run_stack
    #  168      24   (spare)
    #  192     512   run_stack       owner (also while          handles it is running, outermost
    #                                stealing, into its own)    first; [0, run_depth) meaningful
    #  704     8*D   deque ring      owner (push)               slot = index & (D-1); [front, back)
    #  704+8D  8*I   inbox ring      coordinator (inject,       slot = index & (I-1); [front, back);
    #                                cancel)                    TOMBSTONE (-1) = cancelled entry
    #  ..+8I   8*C   done ring       owner (complete)           finished top-level tasks, result in
    #                                                           their block; [front, back)
    # Invariants (under the lock): 0 <= deque_back - deque_front <= D,
    #   0 <= inbox_back - inbox_front <= I, 0 <= done_back - done_front <= C.
    # Lines 0 (lock-holder words) and 2-10 (owner-only words) are separate 64-byte lines, so the
    # owner's unlocked counter stores do not bounce the line that thieves read.

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

Memory ordering: no fence exists outside the SemLock's atomic operations, so every
publication happens under the lock (safe on ARM too). Unlocked reads (``__len__``, the peek in
``steal``, ``running``) are hints: two racy words are no snapshot, so differences are clamped.

Not handled here: which victim to steal from, when to sleep, waking (eventfd writes), what a
handle means, and lock timeouts (the caller's policy; ``acquire`` here blocks, except steal).
"""

from __future__ import annotations

import enum
import os
from array import array
from collections.abc import Callable, Sequence

from mpsched._errors import InternalError

# typing.TYPE_CHECKING without importing typing at run time (why: mpsched/__init__.py).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Protocol

__all__ = (
    "MAX_NESTING",
    "SLOT_MAGIC",
    "TOMBSTONE",
    "SlotQueues",
    "StealResult",
    "slot_bytes",
)

TOMBSTONE = -1  # a cancelled inbox entry; handles are >= 0, so it never collides with one
EMPTY_HANDLE = -1  # returned when nothing was claimed (same value as TOMBSTONE, other meaning)
MAX_NESTING = 64  # run_stack entries: join-helping runs tasks inside tasks; 64 deep is plenty
SPIN_ACQUIRES = 200  # try-locks (about 50 ns each, 10 us in all) before a blocking acquire
ARRAY_FILL_MIN = 8  # inject: from this many handles, one array slice store beats a loop
SLOT_MAGIC = 0x6D70_7363_6864_7131  # "mpschdq1": written at init, checked on attach
_LINE = 64  # bytes; cache line, also the alignment unit of regions

# Word indices into the region (see the layout table).
HOLDER_PID = 0
DEQUE_FRONT = 1
DEQUE_BACK = 2
INBOX_FRONT = 3
INBOX_BACK = 4
SLEEPING = 5
DONE_FRONT = 6
DONE_BACK = 7
MAGIC = 8
DEQUE_CAPACITY = 9
INBOX_CAPACITY = 10
OWNER_PID = 11
DONE_CAPACITY = 12
EXECUTED = 16
STOLEN = 17
PUSHED = 18
INJECTED_TAKEN = 19
RUN_DEPTH = 20
RUN_STACK = 24
RING_WORD = RUN_STACK + MAX_NESTING  # 88 words = 704 bytes, a multiple of _LINE

# Our pid for holder_pid, without an os.getpid() syscall (0.17 us) per operation.
_pid = os.getpid()


def _refresh_pid() -> None:
    global _pid
    _pid = os.getpid()


# The zygote os.fork()s workers that already imported this module; each must write its own pid.
os.register_at_fork(after_in_child=_refresh_pid)


if TYPE_CHECKING:  # structural types, for annotations only

    class LockLike(Protocol):
        """A cross-process lock: ``_shm.SemLockHandle``, or ``multiprocessing.Lock`` in tests."""

        def acquire(self, block: bool = ..., timeout: float | None = ..., /) -> bool: ...

        def release(self) -> None: ...

    class BlockStates(Protocol):
        """Where block state words live (``_payloads.Slab``); a leaf does not import another."""

        def get_state(self, index: int, /) -> int: ...

        def set_state(self, index: int, value: int, /) -> None: ...

        def set_uid(self, index: int, value: int, /) -> None: ...


class StealResult(enum.IntEnum):
    """Outcome of ``SlotQueues.steal`` (crossbeam ``Steal``)."""

    EMPTY = 0  # nothing to steal (a hint when the unlocked peek says so; exact once locked)
    SUCCESS = 1  # a handle was claimed; it is the second element of the tuple
    RETRY = 2  # the victim's lock was busy; try another victim, then this one again


# Preallocated results: a steal that finds nothing allocates no tuple.
_STEAL_EMPTY = (StealResult.EMPTY, EMPTY_HANDLE)
_STEAL_RETRY = (StealResult.RETRY, EMPTY_HANDLE)
_SUCCESS = StealResult.SUCCESS


def slot_bytes(deque_capacity: int, inbox_capacity: int, done_capacity: int = 0) -> int:
    """Size of one slot region in bytes, a multiple of 64."""
    raw = RING_WORD * 8 + 8 * (deque_capacity + inbox_capacity + done_capacity)
    return -(-raw // _LINE) * _LINE


SLOT_BYTES = slot_bytes  # the name used in the engine's design notes

_OWNER_METHODS = (
    "push",
    "pop",
    "take_inbox",
    "pop_or_take",
    "mark_running",
    "finish_running",
    "complete",
)


class SlotQueues:
    """The deque and inbox of one worker slot; see the module docstring for roles and layout.

    Every method but ``steal`` may block briefly on the slot lock (spin, then sleep).
    """

    def __init__(
        self,
        buf: memoryview,
        lock: LockLike,
        deque_capacity: int,
        inbox_capacity: int,
        *,
        done_capacity: int = 0,
        init: bool = False,
        debug: bool = False,
    ) -> None:
        """Attach to (with ``init=True``: format) a slot region.

        Args:
            buf: a byte view of the region, at least ``slot_bytes(...)`` long.
            lock: this slot's lock, used for nothing else.
            deque_capacity: D, a power of two.
            inbox_capacity: I, a power of two.
            done_capacity: C, a power of two, or 0 for no done ring (``complete`` then raises).
                The engine must keep the top-level tasks in flight at or below C.
            init: format the header (the creator, once, before any other process attaches).
            debug: owner methods check that the caller ran ``bind_owner()`` (about 40 ns a
                call), and ``push``/``inject`` refuse negative handles.

        Raises:
            InternalError: not ``init`` and the header does not match (wrong offset or sizes).
        """
        for cap in (deque_capacity, inbox_capacity, done_capacity or 1):
            if cap <= 0 or cap & (cap - 1):
                raise ValueError(f"capacities must be powers of two, got {cap}")
        size = slot_bytes(deque_capacity, inbox_capacity, done_capacity)
        if buf.nbytes < size:
            raise ValueError(f"slot region needs {size} bytes, got {buf.nbytes}")
        region = buf[:size]
        self._w = w = region.cast("q")
        region.release()
        self._deque = w[RING_WORD : RING_WORD + deque_capacity]
        at = RING_WORD + deque_capacity
        self._inbox = w[at : at + inbox_capacity]
        at += inbox_capacity
        self._done = w[at : at + done_capacity]
        self._dcap, self._dmask = deque_capacity, deque_capacity - 1
        self._icap, self._imask = inbox_capacity, inbox_capacity - 1
        self._ccap, self._cmask = done_capacity, done_capacity - 1
        # Bound C methods: ``with lock:`` costs about 5x (FEASIBILITY section 2).
        self._acquire = lock.acquire
        self._release = lock.release
        if init:
            w[0:RING_WORD] = array("q", bytes(8 * RING_WORD))
            w[DEQUE_CAPACITY] = deque_capacity
            w[INBOX_CAPACITY] = inbox_capacity
            w[DONE_CAPACITY] = done_capacity
            w[MAGIC] = SLOT_MAGIC
        found = (w[MAGIC], w[DEQUE_CAPACITY], w[INBOX_CAPACITY], w[DONE_CAPACITY])
        expected = (SLOT_MAGIC, deque_capacity, inbox_capacity, done_capacity)
        if found != expected:
            raise InternalError(
                f"slot header mismatch: magic and capacities {found}, expected {expected}; "
                "wrong offset or layout"
            )
        if debug:
            self._install_debug_checks()

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

    def pop_or_take(self, mark_running: bool = False) -> int:
        """Owner only, one lock round: the deque's back if any, else the inbox's front.

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

    def complete(self, handle: int) -> None:
        """Owner only: the innermost running task, top-level ``handle``, has its result in its
        block: move it from the run_stack to the done ring in one lock round."""
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
            if back - w[DONE_FRONT] >= self._ccap:
                raise InternalError(f"done ring full ({self._ccap}): too many tasks in flight")
            self._done[back & self._cmask] = handle
            w[DONE_BACK] = back + 1  # commit: the coordinator owns the handle now
            w[RUN_DEPTH] = depth  # the record went stale at the commit
        finally:
            w[HOLDER_PID] = 0
            self._release()

    def announce_sleep(self) -> bool:
        """Owner only: set ``sleeping`` if, under the lock, both rings are empty.

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
            if w[DEQUE_BACK] > w[DEQUE_FRONT] or w[INBOX_BACK] > w[INBOX_FRONT]:
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

    def take_done(self) -> list[int]:
        """Coordinator only: collect every completed handle (FIFO), one lock round."""
        w = self._w
        if not self._acquire(False):
            self._acquire_contended()
        try:
            w[HOLDER_PID] = _pid
            back = w[DONE_BACK]
            out = []
            for lo, hi in _segments(w[DONE_FRONT], back, self._cmask):
                out += self._done[lo:hi].tolist()
            w[DONE_FRONT] = back  # commit
        finally:
            w[HOLDER_PID] = 0
            self._release()
        return out

    # Thieves (any process but the owner).

    def steal(self, into: SlotQueues | None = None) -> tuple[StealResult, int]:
        """Claim the deque's front, else the inbox's front. Never blocks: one try-lock.

        Args:
            into: the thief's OWN slot; the handle is recorded in its run_stack before the
                victim's commit (so a thief's crash cannot lose it), and counted as stolen.

        Returns:
            ``(SUCCESS, handle)``, ``(EMPTY, -1)`` or ``(RETRY, -1)``.
        """
        w = self._w
        # hint only: racy, maybe stale; a false EMPTY is a missed steal, never a lost task
        if w[DEQUE_BACK] <= w[DEQUE_FRONT] and w[INBOX_BACK] <= w[INBOX_FRONT]:
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
            else:
                handle = self._claim_inbox(record_in)
        finally:
            w[HOLDER_PID] = 0
            self._release()
        if handle < 0:
            return _STEAL_EMPTY
        if record_in is not None:
            record_in[STOLEN] += 1
        return _SUCCESS, handle

    def probe(self) -> bool:
        """Whether a live handle is queued, read under the lock (a fence, unlike ``len``).

        Use it as the "recheck" of announce-then-recheck before sleeping.
        """
        w = self._w
        if not self._acquire(False):
            self._acquire_contended()
        try:
            w[HOLDER_PID] = _pid
            if w[DEQUE_BACK] > w[DEQUE_FRONT]:
                return True
            return any(
                h != TOMBSTONE
                for lo, hi in _segments(w[INBOX_FRONT], w[INBOX_BACK], self._imask)
                for h in self._inbox[lo:hi].tolist()
            )
        finally:
            w[HOLDER_PID] = 0
            self._release()

    # Anyone: a block's state word under this slot's lock (the child-task handshake).

    def exchange_block_state(
        self,
        states: BlockStates,
        handle: int,
        value: int,
        finished_by: SlotQueues | None = None,
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

    # Hints: racy reads of two words are no snapshot (the difference can even come out
    # negative), so each is clamped at 0; not with max(), a builtin call costs ~100 ns here.

    def depths(self) -> tuple[int, int]:
        """(deque length, inbox length with tombstones). Hint only."""
        w = self._w
        d = w[DEQUE_BACK] - w[DEQUE_FRONT]
        i = w[INBOX_BACK] - w[INBOX_FRONT]
        return d if d > 0 else 0, i if i > 0 else 0

    def inbox_depth(self) -> int:
        """Inbox entries, tombstones included. Hint only."""
        n = self._w[INBOX_BACK] - self._w[INBOX_FRONT]
        return n if n > 0 else 0

    def done_depth(self) -> int:
        """Done handles not yet collected. Hint only."""
        n = self._w[DONE_BACK] - self._w[DONE_FRONT]
        return n if n > 0 else 0

    def __len__(self) -> int:
        """Entries in both rings. Hint only: racy, clamped at 0."""
        return sum(self.depths())

    def is_empty(self) -> bool:
        """Hint only: racy."""
        return self.depths() == (0, 0)

    def is_sleeping(self) -> bool:
        """Hint only: racy."""
        return self._w[SLEEPING] != 0

    def holder_pid(self) -> int:
        """Pid recorded as holding the lock, 0 if none. Hint only: racy."""
        return self._w[HOLDER_PID]

    def owner_pid(self) -> int:
        """Pid of the owner (``bind_owner``), 0 if none."""
        return self._w[OWNER_PID]

    def run_depth(self) -> int:
        """Tasks the owner is running now (join-helping nests them). Hint only: racy."""
        return self._w[RUN_DEPTH]

    def running(self) -> list[int]:
        """Handles on the owner's run_stack, outermost first.

        Racy while the owner lives; exact once it is dead and ``break_dead_holder`` has run
        on every slot whose lock it held.
        """
        depth = min(max(self._w[RUN_DEPTH], 0), MAX_NESTING)
        return self._w[RUN_STACK : RUN_STACK + depth].tolist()

    def counters(self) -> dict[str, int]:
        """Owner-written statistics (racy): executed, stolen, pushed, injected_taken."""
        w = self._w
        names = ("executed", "stolen", "pushed", "injected_taken")
        return dict(zip(names, (w[EXECUTED], w[STOLEN], w[PUSHED], w[INJECTED_TAKEN]), strict=True))

    # Coordinator, after a worker died.

    def break_dead_holder(
        self,
        dead_pid: int,
        dead_slot: SlotQueues,
        states: BlockStates | None = None,
        finished: int = -1,
    ) -> bool:
        """The single breaker (coordinator) only, once ``dead_pid`` is known to be dead.

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

    def release(self) -> None:
        """Release this object's views of the segment (before ``AnonSegment.close``)."""
        self._deque.release()
        self._inbox.release()
        self._done.release()
        self._w.release()

    # Internals.

    def _acquire_contended(self) -> None:
        # A blocked sem_wait sleeps in the kernel and costs a futex wake-up plus a reschedule
        # (tens of us to ms on 2 busy cores), while holders keep the lock for well under 1 us:
        # retry cheaply first, then block (FEASIBILITY 3a: 2-4x faster under contention).
        acquire = self._acquire
        for _ in range(SPIN_ACQUIRES):
            if acquire(False):
                return
        acquire()

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


def _record_running(w: memoryview, handle: int) -> None:
    """Steps 2 and 3 of the claim protocol, in the claimer's own slot words ``w``."""
    depth = w[RUN_DEPTH]
    if depth >= MAX_NESTING:
        raise InternalError(f"run_stack full ({MAX_NESTING} nested tasks); stop helping deeper")
    w[RUN_STACK + depth] = handle
    w[RUN_DEPTH] = depth + 1


def _segments(front: int, back: int, mask: int) -> list[tuple[int, int]]:
    """The (at most two) contiguous ring slices holding indices [front, back)."""
    if front >= back:
        return []
    lo, n = front & mask, back - front
    if lo + n <= mask + 1:
        return [(lo, lo + n)]
    return [(lo, mask + 1), (0, lo + n - mask - 1)]


def _find(ring: memoryview, mask: int, front: int, back: int, handle: int) -> int:
    """The index in [front, back) whose slot holds ``handle``, or -1. The caller holds the lock."""
    offset = front
    for lo, hi in _segments(front, back, mask):
        values = ring[lo:hi].tolist()  # a C-speed scan; cancels and repairs are rare
        if handle in values:
            return offset + values.index(handle)
        offset += hi - lo
    return -1


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
