"""The slab's region in shared memory: its layout, the block layout, attaching, and its hints.

What this module owns: the layout of the slab region (header, free stack, blocks) and of one
block (``BlockField`` names its header words), the word indices and constants every slab module
uses, and ``SlabRegion`` (``region_bytes``, format or attach, ``fill_free_stack``, the racy
hints ``free_count`` / ``free_indices`` / ``holder_pid``, ``release``). The region lives inside
the pool's ``AnonSegment``; ``_layout`` decides where. It is one leaf with ``_payloads`` (the
allocator and the block reads and writes: ``Slab``, the class to instantiate), ``_slab_repair``
(the coordinator's repair after a holder died) and ``_function_table``.

Who calls what, from which process: ``_layout`` sizes the region (``Slab.region_bytes``) and
the creator formats it (``init=True``, once, before any other process attaches); the
coordinator and every worker attach to it; the hints are read by the coordinator's crash
recovery (``free_indices``, and ``holder_pid`` on a lock stall; the lock's grace period in
``_shm.release_if_orphaned`` too) and by tests (``free_count``).

Slab region:

    # offset      size   field        writer                 meaning
    #    0          8    free_top     allocator-lock holder  entries used in free_stack; commit
    #                                                        point of alloc/free
    #    8          8    holder_pid   allocator-lock holder  pid holding the lock, 0 = none
    #   16          8    magic        creator, const         SLAB_MAGIC
    #   24          8    block_count  creator, const         N blocks
    #   32          8    block_bytes  creator, const         B bytes per block, multiple of 64
    #   40          8    pending_word allocator-lock holder  a chain op in progress (0 = none): the
    #                                                        link word it stores after its commit
    #   48          8    pending_value allocator-lock holder that word's value (``_payloads``:
    #                                                        "Chains")
    #   56          8    pending_top  allocator-lock holder  free_top once that op has committed
    #   64         8*N   free_stack   allocator-lock holder  free block indices; [0, free_top)
    #  64+8N'      N*B   blocks       see below              N' = N rounded up to 8 (64 B)
    # Invariant (under the lock): 0 <= free_top <= N; each index is in free_stack at most once.

Block (B bytes, header words are int64; ``BlockField`` names them):

    # offset size  field          writer                     meaning
    #   0     8    state          engine-defined             lifecycle word (values: the engine)
    #   8     8    uid            alloc, writer of     0: a top-level task; a child's: its
    #                              the task; a child's        spawner's pid << 31 | a counter,
    #                              freer (see below)          from its allocation until its free
    #  16     8    nbytes         writer of the task         length of the argument bytes
    #  24     8    parent         writer of the task         slot of the parent task, -1 = none
    #  32     8    result_status  worker that ran it         engine-defined; written after the
    #                                                        result bytes (their commit point)
    #  40     8    result_nbytes  worker that ran it         length of the result bytes
    #  48     8    next_arg       writer of the task         next block of the arguments, -1 = last
    #  56     8    next_result    worker that ran it         next block of the result, -1 = last
    #  64   B-64   data           task writer, then worker   arguments, later overwritten by the
    #                                                        result (args are dead by then)

Invariants: the header's constant words (magic, N, B) are written once by the creator, magic
last, and never change: an attach that reads others is at a wrong offset or layout. The hints
read free_top and holder_pid without the lock: exact only when no process allocates or frees.
"""

from __future__ import annotations

from array import array

from mpsched._constants import Constants
from mpsched._errors import InternalError

# typing.TYPE_CHECKING without importing typing at run time (why: mpsched/__init__.py).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Final, Protocol

__all__ = (
    "BLOCK_BYTES",
    "BLOCK_HEADER_BYTES",
    "SLAB_MAGIC",
    "BlockField",
    "SlabRegion",
)

BLOCK_BYTES = 1024  # per block: a pickled (fid, args) of a typical small task fits in 960 B
BLOCK_HEADER_BYTES = 64  # 8 int64 header words, one cache line
SLAB_MAGIC = 0x6D70_7363_6864_7331  # "mpschds1"
_LINE = 64  # bytes; alignment unit of regions

# Slab header words.
_FREE_TOP = 0
_HOLDER_PID = 1
_S_MAGIC = 2
_S_BLOCK_COUNT = 3
_S_BLOCK_BYTES = 4
_PENDING_WORD = 5
_PENDING_VALUE = 6
_PENDING_TOP = 7
_FREE_STACK = 8  # word index of free_stack


class BlockField(Constants):
    """Word index of each block header field (see the block layout table)."""

    STATE: Final = 0
    UID: Final = 1
    NBYTES: Final = 2
    PARENT: Final = 3
    RESULT_STATUS: Final = 4
    RESULT_NBYTES: Final = 5
    NEXT_ARG: Final = 6
    NEXT_RESULT: Final = 7


_UID = BlockField.UID
_NBYTES = BlockField.NBYTES
_PARENT = BlockField.PARENT
_STATE = BlockField.STATE
_RESULT_STATUS = BlockField.RESULT_STATUS
_RESULT_NBYTES = BlockField.RESULT_NBYTES
_NEXT_ARG = BlockField.NEXT_ARG
_NEXT_RESULT = BlockField.NEXT_RESULT


if TYPE_CHECKING:  # structural types, for annotations only

    class LockLike(Protocol):
        """A cross-process lock (``_shm.SemLockHandle``). Structurally the same protocol as
        ``_shm_deque.LockLike``: leaf modules do not import each other."""

        def acquire(self, block: bool = ..., timeout: float | None = ..., /) -> bool: ...

        def release(self) -> None: ...


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


class SlabRegion:
    """The slab region: the words, the views, the lock's bound methods; hints only.

    ``_payloads.Slab`` is the class to instantiate; this base holds what its parts share.
    """

    @staticmethod
    def region_bytes(block_count: int, block_bytes: int = BLOCK_BYTES) -> int:
        """Size of the slab region in bytes (a multiple of 64)."""
        return _LINE + _round_up(8 * block_count, _LINE) + block_count * block_bytes

    def __init__(
        self,
        buf: memoryview,
        lock: LockLike,
        block_count: int,
        block_bytes: int = BLOCK_BYTES,
        *,
        init: bool = False,
        fill: bool = True,
    ) -> None:
        """Attach to (with ``init=True``: format) a slab region.

        Args:
            buf: a byte view of the region, at least ``region_bytes(...)`` long.
            lock: the allocator lock, used for nothing else.
            block_count: N.
            block_bytes: B, a multiple of 64 larger than the 64-byte header.
            init: write the header and fill the free stack (the creator, once, before others
                attach).
            fill: with ``init``, False leaves the free stack empty (no block is free) for a
                later ``fill_free_stack``.

        Raises:
            InternalError: not ``init`` and the header does not match.
        """
        if block_count <= 0 or block_bytes <= BLOCK_HEADER_BYTES or block_bytes % _LINE:
            raise ValueError(f"bad slab geometry: {block_count} blocks of {block_bytes} B")
        size = self.region_bytes(block_count, block_bytes)
        if buf.nbytes < size:
            raise ValueError(f"slab region needs {size} bytes, got {buf.nbytes}")
        self.capacity = block_count
        self.block_bytes = block_bytes
        self.data_capacity = block_bytes - BLOCK_HEADER_BYTES
        region = buf[:size]
        self._w = region.cast("q")
        blocks_at = _LINE + _round_up(8 * block_count, _LINE)
        self._bytes = region[blocks_at:]  # block i at i * block_bytes
        region.release()
        self._stack = self._w[_FREE_STACK : _FREE_STACK + block_count]
        self._blocks_word = blocks_at // 8
        self._block_words = block_bytes // 8
        self._acquire = lock.acquire
        self._release = lock.release
        w = self._w
        if init:
            w[_S_BLOCK_COUNT] = block_count
            w[_S_BLOCK_BYTES] = block_bytes
            w[_HOLDER_PID] = 0
            w[_PENDING_WORD] = 0
            w[_FREE_TOP] = 0
            w[_S_MAGIC] = SLAB_MAGIC
            if fill:
                self.fill_free_stack()
        elif (w[_S_MAGIC], w[_S_BLOCK_COUNT], w[_S_BLOCK_BYTES]) != (
            SLAB_MAGIC,
            block_count,
            block_bytes,
        ):
            raise InternalError("slab header mismatch: wrong offset or layout")

    def fill_free_stack(self) -> None:
        """The creator, once, after ``init`` and before any allocation: every block is free.
        ~0.5 ms for 4096 blocks (a Python int per word, and the stack's first page faults)."""
        self._stack[:] = array("q", range(self.capacity - 1, -1, -1))  # alloc() yields 0 first
        self._w[_FREE_TOP] = self.capacity

    def free_count(self) -> int:
        """Free blocks. Hint only: racy."""
        return max(self._w[_FREE_TOP], 0)

    def free_indices(self) -> list[int]:
        """The free stack's content (racy; exact when no process allocates or frees)."""
        top = min(max(self._w[_FREE_TOP], 0), self.capacity)
        return self._stack[:top].tolist()

    def holder_pid(self) -> int:
        """Pid recorded as holding the allocator lock, 0 if none. Hint only: racy."""
        return self._w[_HOLDER_PID]

    def release(self) -> None:
        """Release this object's views of the segment (before ``AnonSegment.close``)."""
        self._stack.release()
        self._bytes.release()
        self._w.release()
