"""The whole pool segment: where each region sits, its global header, and attaching views.

What this module owns: ``SegmentLayout`` (offsets computed from the pool's sizes), the global
header at offset 0, the set of locks a pool needs (``SegmentLocks``) and ``attach()``, which
builds every view object (one ``SlotQueues`` per worker slot, the ``Slab``, the
``FunctionTable``, the ``GlobalHeader``) over an ``AnonSegment`` and registers each with the
segment so that ``AnonSegment.close()`` releases them first. It composes the leaves
``_shm``, ``_shm_deque`` (with ``_slot_region``) and ``_payloads`` (with ``_slab_region``,
``_slab_repair`` and ``_function_table``) and is used by the
coordinator, zygote and workers.

Who calls what:
    coordinator: ``SegmentLayout(...)``, ``AnonSegment.create(layout.total_bytes)``,
        ``create_locks(n_slots)``, ``attach(..., init=True, fill_slab=False)`` BEFORE starting
        the zygote, ``views.slab.fill_free_stack()`` while it starts (before any allocation);
        ``locks.unlink_names()`` once the zygote has attached. Under the fork start method it
        also attaches the zygote's views before the fork (the zygote inherits them).
    zygote / workers: ``attach(segment, layout, locks)`` (checks magic, version and sizes).

Segment:

    # offset                     size                  region
    #   0                          256                 global header (below)
    #   SLOTS = 4096               n_slots * slot_bytes  slot k at SLOTS + k * slot_bytes
    #   slab_offset  (page-aligned)  Slab.region_bytes  payload blocks + free stack
    #   ftab_offset  (page-aligned)  FunctionTable...   pickled functions
    # Regions start on page boundaries so each one's untouched pages stay unallocated (the memfd
    # is sparse: 32768 blocks of 1 KiB cost 32 MiB of address space, not of memory).

Global header (int64 words):

    # offset size field            writer              meaning
    #   0     8   magic            creator, const      LAYOUT_MAGIC
    #   8     8   version          creator, const      LAYOUT_VERSION; bumped on any change
    #  16     8   total_bytes      creator, const      real segment size (a mapping rounds up)
    #  24     8   n_slots          creator, const
    #  32     8   deque_capacity   creator, const
    #  40     8   inbox_capacity   creator, const
    #  48     8   block_count      creator, const
    #  56     8   block_bytes      creator, const
    #  64     8   ftab_data_bytes  creator, const
    #  72     8   ftab_max_fids    creator, const
    #  80     8   done_capacity    creator, const
    #  88    40   (spare)
    # 128     8   sleepers         global-lock holder  workers that announced sleep
    # 136     8   holder_pid       global-lock holder  pid holding the global lock, 0 = none
    # 144     8   live_children    global-lock holder  child tasks pushed and not yet finished
    # 152    40   (spare)
    # 192     8   run_state        coordinator         engine-defined pool state, read by workers
    # 200     8   injected_total   coordinator         handles injected (statistics)
    # 208     8   collector        coordinator process a user thread collects done rings itself
    #                                                  (help_wait): idle workers skip the poke
    # 216     8   lazy_sweep       coordinator thread  the loop sweeps done rings rarely: a
    #                                                  result pushed into an empty done ring
    #                                                  is poked before the worker's next task
    # 224    32   counter1..4      engine-defined      reserved for engine counters
"""

from __future__ import annotations

import os
from collections.abc import Callable

from mpsched._constants import Constants
from mpsched._errors import InternalError
from mpsched._function_table import FTAB_DATA_BYTES, FTAB_MAX_FIDS, FunctionTable
from mpsched._payloads import BLOCK_BYTES, Slab
from mpsched._shm import AnonSegment, GuardedLock, SemLockHandle, create_lock
from mpsched._shm_deque import SlotQueues
from mpsched._slot_region import slot_bytes

# typing.TYPE_CHECKING without importing typing at run time (why: mpsched/__init__.py).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Final

__all__ = (
    "LAYOUT_VERSION",
    "GlobalField",
    "GlobalHeader",
    "SegmentLayout",
    "SegmentLocks",
    "SegmentViews",
    "attach",
    "create_locks",
)

LAYOUT_MAGIC = 0x6D70_7363_6864_6731  # "mpschdg1"
# Bump whenever any layout table in _layout, _slot_region, _slab_region or _function_table changes.
LAYOUT_VERSION = 4
HEADER_BYTES = 256
PAGE = 4096  # bytes; region alignment (see "Regions start on page boundaries")


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


class GlobalField(Constants):
    """Word index of each global header field (see the table)."""

    MAGIC: Final = 0
    VERSION: Final = 1
    TOTAL_BYTES: Final = 2
    N_SLOTS: Final = 3
    DEQUE_CAPACITY: Final = 4
    INBOX_CAPACITY: Final = 5
    BLOCK_COUNT: Final = 6
    BLOCK_BYTES: Final = 7
    FTAB_DATA_BYTES: Final = 8
    FTAB_MAX_FIDS: Final = 9
    DONE_CAPACITY: Final = 10
    SLEEPERS: Final = 16
    HOLDER_PID: Final = 17
    LIVE_CHILDREN: Final = 18
    RUN_STATE: Final = 24
    INJECTED_TOTAL: Final = 25
    COLLECTOR: Final = 26
    LAZY_SWEEP: Final = 27


_SLEEPERS = GlobalField.SLEEPERS  # module globals: cheaper than a class attribute
_HOLDER_PID = GlobalField.HOLDER_PID
_LIVE_CHILDREN = GlobalField.LIVE_CHILDREN
_COLLECTOR = GlobalField.COLLECTOR
_LAZY_SWEEP = GlobalField.LAZY_SWEEP


# The records below are plain classes, not dataclasses: the zygote imports this module, and
# dataclasses (with inspect, ast and dis) would add ~10 ms to the start-up of every pool.


class SegmentLayout:
    """Sizes of a pool's shared structures and the offsets they imply (all in bytes)."""

    __slots__ = _LAYOUT_FIELDS = (
        "n_slots",
        "deque_capacity",
        "inbox_capacity",
        "done_capacity",
        "block_count",
        "block_bytes",
        "ftab_data_bytes",
        "ftab_max_fids",
    )

    def __init__(
        self,
        n_slots: int,
        deque_capacity: int = 1024,  # children per worker before push() fails and runs inline
        inbox_capacity: int = 256,  # coordinator hand-outs queued per worker
        done_capacity: int = 1024,  # finished top-level tasks per worker; >= the tasks in flight
        block_count: int = 32768,  # payload blocks: 32 MiB virtual at 1 KiB, sparse
        block_bytes: int = BLOCK_BYTES,
        ftab_data_bytes: int = FTAB_DATA_BYTES,
        ftab_max_fids: int = FTAB_MAX_FIDS,
    ) -> None:
        if n_slots <= 0:
            raise ValueError(f"n_slots must be positive, got {n_slots}")
        self.n_slots = n_slots
        self.deque_capacity = deque_capacity
        self.inbox_capacity = inbox_capacity
        self.done_capacity = done_capacity
        self.block_count = block_count
        self.block_bytes = block_bytes
        self.ftab_data_bytes = ftab_data_bytes
        self.ftab_max_fids = ftab_max_fids

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._LAYOUT_FIELDS)
        return f"SegmentLayout({fields})"

    @property
    def slot_bytes(self) -> int:
        return slot_bytes(self.deque_capacity, self.inbox_capacity, self.done_capacity)

    @property
    def slots_offset(self) -> int:
        return PAGE

    def slot_offset(self, k: int) -> int:
        if not 0 <= k < self.n_slots:
            raise IndexError(f"slot {k} not in 0..{self.n_slots - 1}")
        return self.slots_offset + k * self.slot_bytes

    @property
    def slab_offset(self) -> int:
        return _round_up(self.slots_offset + self.n_slots * self.slot_bytes, PAGE)

    @property
    def slab_bytes(self) -> int:
        return Slab.region_bytes(self.block_count, self.block_bytes)

    @property
    def ftab_offset(self) -> int:
        return _round_up(self.slab_offset + self.slab_bytes, PAGE)

    @property
    def ftab_bytes(self) -> int:
        return FunctionTable.region_bytes(self.ftab_data_bytes, self.ftab_max_fids)

    @property
    def total_bytes(self) -> int:
        return _round_up(self.ftab_offset + self.ftab_bytes, PAGE)

    def header_words(self) -> dict[int, int]:
        """The constant header words this layout implies."""
        return {
            GlobalField.MAGIC: LAYOUT_MAGIC,
            GlobalField.VERSION: LAYOUT_VERSION,
            GlobalField.TOTAL_BYTES: self.total_bytes,
            GlobalField.N_SLOTS: self.n_slots,
            GlobalField.DEQUE_CAPACITY: self.deque_capacity,
            GlobalField.INBOX_CAPACITY: self.inbox_capacity,
            GlobalField.BLOCK_COUNT: self.block_count,
            GlobalField.BLOCK_BYTES: self.block_bytes,
            GlobalField.FTAB_DATA_BYTES: self.ftab_data_bytes,
            GlobalField.FTAB_MAX_FIDS: self.ftab_max_fids,
            GlobalField.DONE_CAPACITY: self.done_capacity,
        }


class SegmentLocks:
    """Every lock a pool's segment needs; each guards one thing only (gh-125451).

    Lock order: a slot lock may be taken while holding nothing; the slab lock and the global
    lock are leaves (never held while taking another lock). Only ``steal`` holds two slots'
    words at once, and it takes just the victim's lock (its own words need none).
    """

    __slots__ = ("global_", "slab", "slots")

    def __init__(
        self,
        slots: tuple[SemLockHandle, ...],  # one per worker slot: that slot's deque + inbox
        slab: SemLockHandle,  # the slab's free stack
        global_: SemLockHandle,  # the global header's counters (sleepers, live_children)
    ) -> None:
        self.slots = slots
        self.slab = slab
        self.global_ = global_

    def __repr__(self) -> str:
        return f"SegmentLocks(slots={self.slots!r}, slab={self.slab!r}, global_={self.global_!r})"

    def all(self) -> tuple[SemLockHandle, ...]:
        return (*self.slots, self.slab, self.global_)

    def guarded(self, on_stall: Callable[[str, int, Any, float], None]) -> SegmentLocks:
        """The same locks with bounded blocking waits (``GuardedLock``), for the coordinator's
        process; ``on_stall(kind, index, lock, waited)`` names the lock: ("slot", k),
        ("slab", 0) or ("global", 0)."""

        def guard(lock: SemLockHandle, kind: str, index: int) -> Any:
            return GuardedLock(lock, lambda g, waited: on_stall(kind, index, g, waited))

        return SegmentLocks(
            slots=tuple(guard(lock, "slot", k) for k, lock in enumerate(self.slots)),
            slab=guard(self.slab, "slab", 0),
            global_=guard(self.global_, "global", 0),
        )

    def unlink_names(self) -> None:
        """Coordinator, once the zygote has opened them: remove every name (idempotent)."""
        for lock in self.all():
            lock.unlink()


def create_locks(n_slots: int) -> SegmentLocks:
    """Coordinator only: create the named locks of a pool (unlink them after start-up). If one
    cannot be made (no room in /dev/shm, no fd left), those made already are unlinked: their
    names stayed in /dev/shm until a later pool's sweep, after this process ended."""
    made: list[SemLockHandle] = []
    try:
        made.extend(create_lock() for _ in range(n_slots + 2))  # keeps those made before a raise
    except BaseException as exc:
        for lock in made:
            lock.unlink()
        if isinstance(exc, OSError) and exc.errno is not None:
            # The bare ENOMEM of Pool(100000) (a mapping per lock: vm.max_map_count) named
            # neither the locks nor the worker count (API hunt). OSError's own constructor
            # picks the subclass of the errno (a subclass's own may take other arguments).
            strerror = exc.strerror or os.strerror(exc.errno)
            filename = () if exc.filename is None else (exc.filename,)
            raise OSError(
                exc.errno,
                f"{strerror}: made {len(made)} of the pool's {n_slots + 2} locks (one per "
                f"worker, each a semaphore and a memory mapping)",
                *filename,
            ) from exc
        raise
    return SegmentLocks(slots=tuple(made[:n_slots]), slab=made[n_slots], global_=made[n_slots + 1])


_pid = os.getpid()


def _refresh_pid() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_refresh_pid)


class GlobalHeader:
    """The global header words (see the table for each word's writer)."""

    def __init__(self, buf: memoryview, lock: SemLockHandle) -> None:
        region = buf[:HEADER_BYTES]
        self._w = region.cast("q")
        region.release()
        self._acquire = lock.acquire
        self._release = lock.release

    def get(self, field: int) -> int:
        """A header word (racy for the variable ones: hint only)."""
        return self._w[field]

    def set(self, field: int, value: int) -> None:
        """Set a word that has a single writer (run_state, injected_total, counters)."""
        if field < GlobalField.RUN_STATE:
            name = GlobalField.name(field)
            raise InternalError(f"{name} is constant or lock-guarded; use add_*()")
        self._w[field] = value

    def add_sleepers(self, delta: int) -> int:
        """Add ``delta`` to ``sleepers`` under the global lock; return the new value."""
        return self._add(_SLEEPERS, delta)

    def sleepers(self) -> int:
        """Hint only: racy, clamped at 0."""
        n = self._w[_SLEEPERS]
        return n if n > 0 else 0  # not max(): a builtin call costs ~100 ns here

    def collector(self) -> bool:
        """Whether a user thread collects done rings itself (``help_wait``). Hint only."""
        return self._w[_COLLECTOR] != 0

    def set_collector(self, on: bool) -> None:
        """Coordinator's process only (its single writer)."""
        self._w[_COLLECTOR] = 1 if on else 0

    def lazy_sweep(self) -> bool:
        """Whether the loop sweeps the done rings rarely (``Coordinator.pace_sweep``): a worker
        then pokes each result that it pushed into an empty done ring, before its next task.
        Read after the push's lock round, so that the coordinator's locked recheck or this
        read sees the other."""
        return self._w[_LAZY_SWEEP] != 0

    def set_lazy_sweep(self, on: bool) -> None:
        """Coordinator thread only (its single writer)."""
        self._w[_LAZY_SWEEP] = 1 if on else 0

    def add_live_children(self, delta: int) -> int:
        """Add ``delta`` to ``live_children`` under the global lock; return the new value."""
        return self._add(_LIVE_CHILDREN, delta)

    def live_children(self) -> int:
        """Hint only: racy, clamped at 0."""
        n = self._w[_LIVE_CHILDREN]
        return n if n > 0 else 0

    def holder_pid(self) -> int:
        """Pid recorded as holding the global lock, 0 if none. Hint only: racy."""
        return self._w[_HOLDER_PID]

    def break_dead_holder(self, dead_pid: int) -> bool:
        """The single breaker (coordinator) only: release the global lock if ``dead_pid`` died
        holding it; each counter is consistent by its one-store commit."""
        w = self._w
        if dead_pid <= 0 or w[_HOLDER_PID] != dead_pid:
            return False
        w[_HOLDER_PID] = 0
        self._release()
        return True

    def _add(self, field: int, delta: int) -> int:
        w = self._w
        self._acquire()
        try:
            w[_HOLDER_PID] = _pid
            value = w[field] + delta
            w[field] = value  # commit
        finally:
            w[_HOLDER_PID] = 0
            self._release()
        return value

    def release(self) -> None:
        self._w.release()


class SegmentViews:
    """Every view object over one pool segment, for the process that attached."""

    __slots__ = ("functions", "header", "slab", "slots")

    def __init__(
        self,
        header: GlobalHeader,
        slots: tuple[SlotQueues, ...],
        slab: Slab,
        functions: FunctionTable,
    ) -> None:
        self.header = header
        self.slots = slots
        self.slab = slab
        self.functions = functions

    def release(self) -> None:
        """Release all views (``AnonSegment.close`` does this for tracked ones)."""
        for slot in self.slots:
            slot.release()
        self.slab.release()
        self.functions.release()
        self.header.release()


def attach(
    segment: AnonSegment,
    layout: SegmentLayout,
    locks: SegmentLocks,
    *,
    init: bool = False,
    fill_slab: bool = True,
    debug: bool = False,
) -> SegmentViews:
    """Build every view over ``segment``; each is registered with ``segment.track``.

    Args:
        init: format every region and the header (the coordinator, once, before any child
            attaches); otherwise check the header against ``layout``.
        fill_slab: with ``init``, False leaves the slab's free stack empty, to be filled by
            ``views.slab.fill_free_stack()`` before the first allocation (attaching checks
            only the slab's header).
        debug: pass ``debug=True`` to every ``SlotQueues`` (owner-pid checks).

    Raises:
        InternalError: the segment is too small or its header does not match ``layout``.
    """
    if segment.size < layout.total_bytes:
        raise InternalError(f"segment of {segment.size} B < layout's {layout.total_bytes} B")
    if len(locks.slots) != layout.n_slots:
        raise InternalError(f"{len(locks.slots)} slot locks for {layout.n_slots} slots")
    buf = segment.buf
    header = GlobalHeader(buf, locks.global_)
    segment.track(header)
    expected = layout.header_words()
    if init:
        for field, value in expected.items():
            header._w[field] = value
    else:
        found = {field: header.get(field) for field in expected}
        if found != expected:
            raise InternalError(f"segment header {found} does not match layout {expected}")
    slots = []
    for k, lock in enumerate(locks.slots):
        at = layout.slot_offset(k)
        sq = SlotQueues(
            buf[at : at + layout.slot_bytes],
            lock,
            layout.deque_capacity,
            layout.inbox_capacity,
            done_capacity=layout.done_capacity,
            init=init,
            debug=debug,
        )
        segment.track(sq)
        slots.append(sq)
    at = layout.slab_offset
    slab = Slab(
        buf[at : at + layout.slab_bytes],
        locks.slab,
        layout.block_count,
        layout.block_bytes,
        init=init,
        fill=fill_slab,
    )
    segment.track(slab)
    at = layout.ftab_offset
    functions = FunctionTable(
        buf[at : at + layout.ftab_bytes], layout.ftab_data_bytes, layout.ftab_max_fids, init=init
    )
    segment.track(functions)
    return SegmentViews(header, tuple(slots), slab, functions)
