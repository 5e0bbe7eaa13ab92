"""One worker slot's region in shared memory: its layout, attaching to it, and its hints.

What this module owns: the layout of one slot region (header, running stack, deque ring, inbox
ring, done ring), the word indices and constants every slot module uses, ``slot_bytes``,
``SlotRegion`` (format or attach, the lock's bound methods, the contended acquire, the racy
hints and statistics, ``release``) and the ring helpers (``_segments``, ``_find``,
``_record_running``). The region lives inside the pool's ``AnonSegment``; ``_layout`` decides
where. Slots hold fixed-width int64 handles only (non-negative; their meaning belongs to
``_payloads``), never payload bytes.

The operations on a region are split by role across the modules whose classes
``_shm_deque.SlotQueues`` combines: ``_shm_deque`` (the deque, inbox and done rings: push, pop,
steal, inject, complete, ...), ``_slot_repair`` (the coordinator's repair after a worker died)
and ``_block_state`` (a child block's state word under this slot's lock). Here, only what they
all share; who calls what from which process is in ``_shm_deque``'s docstring.

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
    #  128       8   executed        owner                      tasks finished (complete,
    #                                                           finish_running, a child's DONE,
    #                                                           count_inline_run)
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


Invariants: every read and write of a ring or its indices happens with the slot lock held
(``holder_pid`` stored right after the acquire, cleared right before the release); the hints
here are the only unlocked reads, and two racy words are no snapshot, so they are clamped.

Each module that stamps ``holder_pid`` keeps this process's pid in its own global ``_pid``
(``track_pid``): a global of the module itself is the cheapest read on the per-task paths, and
a name imported from here would be a copy, stale in a forked child.

Not handled here: any operation on the rings (``_shm_deque``), crash repair (``_slot_repair``).
"""

from __future__ import annotations

import os
from array import array

from mpsched._errors import InternalError

# typing.TYPE_CHECKING without importing typing at run time (why: mpsched/__init__.py).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Protocol

__all__ = (
    "EMPTY_HANDLE",
    "MAX_NESTING",
    "SLOT_MAGIC",
    "TOMBSTONE",
    "SlotRegion",
    "slot_bytes",
    "track_pid",
)

TOMBSTONE = -1  # a cancelled inbox entry; handles are >= 0, so it never collides with one
EMPTY_HANDLE = -1  # returned when nothing was claimed (same value as TOMBSTONE, other meaning)
MAX_NESTING = 64  # run_stack entries: join-helping runs tasks inside tasks; 64 deep is plenty
SPIN_ACQUIRES = 200  # try-locks (about 50 ns each, 10 us in all) before a blocking acquire
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


def track_pid(namespace: dict[str, Any]) -> int:
    """Keep ``namespace["_pid"]`` (a module's globals) this process's pid; return it now.

    The pid is stored in holder_pid without an os.getpid() syscall (0.17 us) per operation. The
    zygote os.fork()s workers that already imported the slot modules; each must write its own
    pid, so every fork's child refreshes it.
    """

    def refresh() -> None:
        namespace["_pid"] = os.getpid()

    os.register_at_fork(after_in_child=refresh)
    return os.getpid()


if TYPE_CHECKING:  # structural types, for annotations only

    class LockLike(Protocol):
        """A cross-process lock: ``_shm.SemLockHandle``, or ``multiprocessing.Lock`` in tests."""

        def acquire(self, block: bool = ..., timeout: float | None = ..., /) -> bool: ...

        def release(self) -> None: ...


def slot_bytes(deque_capacity: int, inbox_capacity: int, done_capacity: int = 0) -> int:
    """Size of one slot region in bytes, a multiple of 64."""
    raw = RING_WORD * 8 + 8 * (deque_capacity + inbox_capacity + done_capacity)
    return -(-raw // _LINE) * _LINE


class SlotRegion:
    """One slot region: the words, the rings' views, the lock's bound methods; hints only.

    ``_shm_deque.SlotQueues`` is the class to instantiate; this base holds what its parts share.
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

    def release(self) -> None:
        """Release this object's views of the segment (before ``AnonSegment.close``)."""
        self._deque.release()
        self._inbox.release()
        self._done.release()
        self._w.release()

    # Internals.

    def _install_debug_checks(self) -> None:
        """Wrap the owner methods in checks; ``SlotQueues`` has them (a region has none)."""

    def _acquire_contended(self) -> None:
        # A blocked sem_wait sleeps in the kernel and costs a futex wake-up plus a reschedule
        # (tens of us to ms on 2 busy cores), while holders keep the lock for well under 1 us:
        # retry cheaply first, then block (FEASIBILITY 3a: 2-4x faster under contention).
        acquire = self._acquire
        for _ in range(SPIN_ACQUIRES):
            if acquire(False):
                return
        acquire()


def _record_running(w: memoryview, handle: int) -> None:
    """Steps 2 and 3 of the claim protocol (``_slot_repair``), in the claimer's slot words ``w``."""
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
