"""Where task bytes live: a slab of fixed-size blocks and an append-only function table.

What this module owns: the layout of two regions of the pool's segment (``_layout`` places
them) and every access to them. A task handle in a deque or inbox (``_shm_deque``) is a block
index here; the block holds the task's pickled arguments, and later its result.

Who calls what, from which process:
    * ``Slab``: the coordinator allocates and frees blocks for top-level tasks and writes their
      arguments; a worker allocates blocks for the children its tasks spawn (``alloc``,
      ``write_child``), reads the arguments of a claimed task (``read`` / ``data_view``) and writes
      the result back into the same block (``write_result``); whoever consumes a result frees
      the block. ``alloc*`` / ``free*`` and the chain ops take the ONE allocator lock (passed
      in, used for nothing else); the block words and data are written without it (but for
      ``alloc``'s stamp and a chain's links), by the block's current holder, and
      published to other processes only through a locked ring (``_shm_deque``).
    * ``FunctionTable``: the coordinator appends pickled functions (``add``, single writer,
      no lock); workers read them (``get``) and cache the loaded function by fid.

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
    #   48          8    pending_value allocator-lock holder that word's value (see "Chains")
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

Function table region (single writer: the coordinator):

    # offset      size     field      writer        meaning
    #    0          8      count      coordinator   fids in use; commit point of add()
    #    8          8      used       coordinator   bytes used in data
    #   16          8      magic      creator       FTAB_MAGIC
    #   24          8      max_fids   creator       F
    #   32          8      data_bytes creator       D
    #   40         24      (spare)
    #   64        16*F     index      coordinator   (offset, length) per fid, int64 pairs
    #  64+16F'      D      data       coordinator   pickled functions, back to back
    #                                               (F' = F rounded up to 4: 64-byte aligned)

Invariants and ordering:
    * A block index is handed out by ``alloc`` to exactly one holder until ``free``; the slab
      itself cannot tell a double free (the engine must not do one; a free past N raises).
    * Visibility without fences: a block's bytes are written before its handle is pushed or
      injected under a slot lock, and read after the handle is claimed under that lock; the
      lock's acquire/release order the plain stores (also on ARM). The same chain makes a fid
      visible: the coordinator adds the function before it injects a task using it.
      ``result_status`` is the commit point of a result against crashes, not a publication:
      whoever reads a result must have learnt of it through a lock or a syscall (pipe, eventfd)
      after the worker wrote it, never by polling the word.
    * A process that dies holding the allocator lock leaves the old or the new free_top (one
      final store); ``break_dead_holder`` releases the lock.
    * A free block's uid is 0: ``free_children`` clears a child's under the lock, before the
      commit, and other blocks never carry another (continuation blocks keep the uid they had
      free). ``alloc`` stamps a child's uid (and a zero state) under the lock before its
      commit, so a child's first block names its spawner at every instant it is taken, even
      before ``write``; the engine's crash recovery finds a dead worker's blocks by that name
      (a block handed over to be freed is renamed by the engine: ``uid`` then names its freer).
      A stamp without its commit (a death in between) is undone by ``break_dead_holder``.

Chains: bytes longer than one block's data area continue in further blocks, linked through
``next_arg`` (arguments) or ``next_result`` (results); the first block keeps the header and the
total length. Continuation blocks are taken by whoever writes the bytes and freed with the task
(``free_tasks``), or, for arguments, as soon as they are read (``release_args``); a chain is at
most ``MAX_CHAIN_BLOCKS`` long; beyond that, or when the slab is short of blocks,
``write``/``write_result`` return False and the engine routes the bytes elsewhere.
Continuation blocks carry no name of their own: they are found only through their first block,
so a chain is reachable from it at every instant it is taken, whatever the moment its writer
dies. ``_attach`` links the blocks among themselves (free blocks: nobody reads their links),
then, under the lock, records the op (``pending_*``: the first block's link word, the first
continuation block, the free_top after the commit), commits, stores the first block's link and
clears the record; ``_detach`` (``release_args``) likewise commits the free, then unlinks. A
holder that dies between the commit and the link store leaves the record, and
``break_dead_holder`` completes the store (the commit happened iff free_top reads the recorded
value: nobody else moves it while the dead holder's lock is held). The data is copied in after
the chain is linked, so the owner's crash recovery, which frees a task's block with its chains,
frees every block of it.

Not handled here: what ``state`` and ``result_status`` values mean.
"""

from __future__ import annotations

import enum
import os
from array import array
from collections.abc import Sequence

from mpsched._errors import InternalError

# typing.TYPE_CHECKING without importing typing at run time (why: mpsched/__init__.py).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Protocol

__all__ = (
    "BLOCK_BYTES",
    "BLOCK_HEADER_BYTES",
    "FTAB_DATA_BYTES",
    "FTAB_MAX_FIDS",
    "BlockField",
    "FunctionTable",
    "Slab",
)

BLOCK_BYTES = 1024  # per block: a pickled (fid, args) of a typical small task fits in 960 B
BLOCK_HEADER_BYTES = 64  # 8 int64 header words, one cache line
FTAB_DATA_BYTES = 4 * 1024 * 1024  # 4 MiB of pickled functions; sparse until written
FTAB_MAX_FIDS = 4096  # distinct functions per pool; index = 64 KiB
SLAB_MAGIC = 0x6D70_7363_6864_7331  # "mpschds1"
FTAB_MAGIC = 0x6D70_7363_6864_6631  # "mpschdf1"
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

# Function table header words.
_F_COUNT = 0
_F_USED = 1
_F_MAGIC = 2
_F_MAX_FIDS = 3
_F_DATA_BYTES = 4
_F_INDEX = 8  # word index of the (offset, length) pairs


class BlockField(enum.IntEnum):
    """Word index of each block header field (see the block layout table)."""

    STATE = 0
    UID = 1
    NBYTES = 2
    PARENT = 3
    RESULT_STATUS = 4
    RESULT_NBYTES = 5
    NEXT_ARG = 6
    NEXT_RESULT = 7


_HEADER_WORDS = BLOCK_HEADER_BYTES // 8
_UID = int(BlockField.UID)
_NBYTES = int(BlockField.NBYTES)
_PARENT = int(BlockField.PARENT)
_STATE = int(BlockField.STATE)
_RESULT_STATUS = int(BlockField.RESULT_STATUS)
_RESULT_NBYTES = int(BlockField.RESULT_NBYTES)
_NEXT_ARG = int(BlockField.NEXT_ARG)
_NEXT_RESULT = int(BlockField.NEXT_RESULT)
MAX_CHAIN_BLOCKS = 256  # blocks per chain (~240 KiB): beyond, bytes go through the coordinator

_pid = os.getpid()  # for holder_pid without a syscall per operation


def _refresh_pid() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_refresh_pid)


if TYPE_CHECKING:  # structural types, for annotations only

    class LockLike(Protocol):
        """A cross-process lock (``_shm.SemLockHandle``). Structurally the same protocol as
        ``_shm_deque.LockLike``: leaf modules do not import each other."""

        def acquire(self, block: bool = ..., timeout: float | None = ..., /) -> bool: ...

        def release(self) -> None: ...


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


class Slab:
    """Fixed-size blocks in shared memory with a locked free stack."""

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

    # ---- allocation (allocator lock) ----

    def alloc(self, uid: int = 0) -> int:
        """Take one free block. Its ``uid`` (0 for a top-level task; a child's names its
        spawner), a zero ``state`` and -1 in both chain links are stored under the lock, before
        the commit. From the commit on, a child's block names its spawner (whose crash
        recovery, ``orphan_children``, finds it by uid) even before ``write_child``: stamped
        after the commit, a spawner that died in between left the previous task's words, which
        name nobody, and the block leaked. A zero ``state`` says "not written yet" (a child's
        states are nonzero), and the links can be followed at every instant (to free the block
        with its chains). A death between the stamp and the commit leaves the stamped block
        free, on top of the free stack: ``break_dead_holder`` clears its uid.

        Returns:
            Its index, or -1 when every block is in use.
        """
        w = self._w
        self._acquire()
        try:
            w[_HOLDER_PID] = _pid
            top = w[_FREE_TOP] - 1
            if top < 0:
                return -1
            index = self._stack[top]
            base = self._blocks_word + index * self._block_words
            w[base + _STATE] = 0
            w[base + _UID] = uid
            w[base + _NEXT_ARG] = -1
            w[base + _NEXT_RESULT] = -1
            w[_FREE_TOP] = top  # commit
        finally:
            w[_HOLDER_PID] = 0
            self._release()
        return index

    def alloc_many(self, n: int) -> list[int]:
        """Take up to ``n`` free blocks in one lock round; fewer (maybe none) when short."""
        w = self._w
        self._acquire()
        try:
            w[_HOLDER_PID] = _pid
            top = w[_FREE_TOP]
            k = n if 0 <= n <= top else top if n > top else 0  # builtins min/max cost ~100 ns
            out = self._stack[top - k : top].tolist()
            w[_FREE_TOP] = top - k  # commit
        finally:
            w[_HOLDER_PID] = 0
            self._release()
        return out

    def free(self, index: int) -> None:
        """Return one block; its holder must not touch it afterwards."""
        w = self._w
        self._acquire()
        try:
            w[_HOLDER_PID] = _pid
            top = w[_FREE_TOP]
            if top >= self.capacity or not 0 <= index < self.capacity:
                raise InternalError(f"free({index}) with free_top={top}: double free or bad index")
            self._stack[top] = index
            w[_FREE_TOP] = top + 1  # commit
        finally:
            w[_HOLDER_PID] = 0
            self._release()

    def free_many(self, indices: Sequence[int], children: Sequence[int] = ()) -> None:
        """Return several blocks in one lock round; first clear the ``state`` and ``uid`` words
        of ``children`` (some of ``indices``: see ``free_children``)."""
        values = array("q", indices)
        k = len(values)
        if k and not (min(values) >= 0 and max(values) < self.capacity):
            raise InternalError(f"free_many: index out of range 0..{self.capacity - 1}")
        w = self._w
        self._acquire()
        try:
            w[_HOLDER_PID] = _pid
            top = w[_FREE_TOP]
            if top + k > self.capacity:
                raise InternalError(f"free_many of {k} with free_top={top}: double free")
            for index in children:
                base = self._blocks_word + index * self._block_words
                w[base + _STATE] = 0
                w[base + _UID] = 0
            self._stack[top : top + k] = values
            w[_FREE_TOP] = top + k  # commit
        finally:
            w[_HOLDER_PID] = 0
            self._release()

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

    def break_dead_holder(self, dead_pid: int) -> bool:
        """The single breaker (coordinator) only: release the allocator lock if ``dead_pid``
        died holding it; the free stack is consistent by the one-store commit."""
        w = self._w
        if dead_pid <= 0 or w[_HOLDER_PID] != dead_pid:
            return False
        # A free block's uid is 0 (a child's free clears it; other blocks carry 0), but for one
        # that ``alloc`` stamped and did not commit: it is on top of the free stack.
        # Cleared, so that no later block reads as a child of this pid (were it reused).
        top = w[_FREE_TOP]
        if 0 < top <= self.capacity:
            base = self._blocks_word + self._stack[top - 1] * self._block_words
            w[base + _UID] = 0
        # A chain op that committed and died before its link store: complete the store.
        if w[_PENDING_WORD] and w[_PENDING_TOP] == top:
            w[w[_PENDING_WORD]] = w[_PENDING_VALUE]
        w[_PENDING_WORD] = 0
        w[_HOLDER_PID] = 0
        self._release()
        return True

    # ---- block contents (no lock: the block's holder only) ----

    def get_word(self, index: int, field: int) -> int:
        """A header word of block ``index`` (``field`` is a ``BlockField``)."""
        return self._w[self._blocks_word + index * self._block_words + field]

    def set_word(self, index: int, field: int, value: int) -> None:
        """Set a header word of block ``index`` (``field`` is a ``BlockField``)."""
        self._w[self._blocks_word + index * self._block_words + field] = value

    def set_uid(self, index: int, value: int) -> None:
        """Set block ``index``'s uid word (a child's: whose crash recovery frees the block)."""
        self._w[self._blocks_word + index * self._block_words + _UID] = value

    def get_state(self, index: int) -> int:
        """Block ``index``'s state word (``_shm_deque.BlockStates``)."""
        return self._w[self._blocks_word + index * self._block_words]

    def set_state(self, index: int, value: int) -> None:
        """Set block ``index``'s state word (``_shm_deque.BlockStates``)."""
        self._w[self._blocks_word + index * self._block_words] = value

    def write(
        self, index: int, data: bytes, *, uid: int, parent: int = -1, state: int | None = None
    ) -> bool:
        """Write a task's argument bytes (chained if long) and header words; ``state`` (if
        given) is stored last.

        Returns:
            False if ``data`` needs more than ``MAX_CHAIN_BLOCKS`` blocks or the slab is short
            of blocks (nothing is written then).
        """
        w = self._w
        base = self._blocks_word + index * self._block_words
        w[base + _NEXT_RESULT] = -1  # first: even a refused write leaves no stale chain
        if not self._scatter(index, data, _NEXT_ARG):
            return False
        w[base + _UID] = uid
        w[base + _PARENT] = parent
        w[base + _RESULT_NBYTES] = 0
        w[base + _NBYTES] = len(data)
        if state is not None:
            w[base + _STATE] = state
        return True

    def write_child(self, index: int, data: bytes, parent: int, state: int) -> bool:
        """``write`` for a block from ``alloc`` (its uid and chain links are stored): a
        child's argument bytes, its parent's slot and, last, its ``state``.

        Returns:
            False, as ``write`` (nothing is written then).
        """
        if not self._scatter(index, data, _NEXT_ARG):
            return False
        w = self._w
        base = self._blocks_word + index * self._block_words
        w[base + _PARENT] = parent
        w[base + _RESULT_NBYTES] = 0
        w[base + _NBYTES] = len(data)
        w[base + _STATE] = state
        return True

    def read(self, index: int) -> bytes:
        """A copy of block ``index``'s argument bytes (gathered along its chain)."""
        n = self._w[self._blocks_word + index * self._block_words + _NBYTES]
        return self._gather(index, n, _NEXT_ARG)

    def release_args(self, index: int) -> None:
        """Free the argument chain's continuation blocks (the first block stays)."""
        rest = self._chain(index, _NEXT_ARG)
        if rest:
            self._detach(index, _NEXT_ARG, rest)

    def release_result_chain(self, index: int) -> None:
        """Free the result chain's continuation blocks (before the result is written again)."""
        rest = self._chain(index, _NEXT_RESULT)
        if rest:
            self._detach(index, _NEXT_RESULT, rest)

    def data_view(self, index: int, nbytes: int | None = None) -> memoryview:
        """A zero-copy view of block ``index``'s first data area (``nbytes`` defaults to the
        argument length, capped at the block). Drop or release it before the segment closes."""
        at = index * self.block_bytes + BLOCK_HEADER_BYTES
        if nbytes is None:
            nbytes = self._w[self._blocks_word + index * self._block_words + _NBYTES]
        return self._bytes[at : at + min(nbytes, self.data_capacity)]

    def write_result(self, index: int, status: int, data: bytes) -> bool:
        """Worker that ran the task: write the result (chained if long); ``status`` last.

        Returns:
            False if it does not fit in ``MAX_CHAIN_BLOCKS`` or blocks are short (nothing is
            written).
        """
        if not self._scatter(index, data, _NEXT_RESULT):
            return False
        base = self._blocks_word + index * self._block_words
        w = self._w
        w[base + _RESULT_NBYTES] = len(data)
        w[base + _RESULT_STATUS] = status
        return True

    def read_result(self, index: int) -> tuple[int, bytes]:
        """(result_status, a copy of the result bytes) of block ``index``."""
        base = self._blocks_word + index * self._block_words
        w = self._w
        return w[base + _RESULT_STATUS], self._gather(index, w[base + _RESULT_NBYTES], _NEXT_RESULT)

    def free_children(self, indices: Sequence[int]) -> None:
        """``free_tasks`` for child-task blocks, clearing their ``state`` and ``uid`` words: a
        free block, and one just allocated and not yet written, then never looks like a live
        child of anyone (the coordinator looks for a dead worker's children by uid). Cleared
        under the allocator lock, right before the commit: a freer that dies before the commit
        (waiting for the lock) leaves the block as it was, a child the crash recovery still
        finds (cleared first, such a block leaked: free of nothing, yet in no free stack)."""
        self.free_tasks(indices, True)

    def free_tasks(self, indices: Sequence[int], children: bool = False) -> None:
        """Free task blocks with both of their chains, in one lock round."""
        every = list(indices)
        for index in indices:
            every.extend(self._chain(index, _NEXT_ARG))
            every.extend(self._chain(index, _NEXT_RESULT))
        self.free_many(every, indices if children else ())

    # ---- chains ----

    def _chain(self, index: int, link: int) -> list[int]:
        """Continuation blocks of ``index`` along ``link`` (excluding ``index``)."""
        out: list[int] = []
        w = self._w
        first = self._blocks_word
        words = self._block_words
        nxt = w[first + index * words + link]
        while nxt >= 0 and len(out) < MAX_CHAIN_BLOCKS:
            out.append(nxt)
            nxt = w[first + nxt * words + link]
        return out

    def _scatter(self, index: int, data: bytes, link: int) -> bool:
        n = len(data)
        cap = self.data_capacity
        w = self._w
        first = self._blocks_word
        words = self._block_words
        at = index * self.block_bytes + BLOCK_HEADER_BYTES
        if n <= cap:  # the common case: one block
            self._bytes[at : at + n] = data
            w[first + index * words + link] = -1
            return True
        extra = -(-(n - cap) // cap)
        blocks = self._attach(index, link, extra) if extra < MAX_CHAIN_BLOCKS else []
        if not blocks:
            w[first + index * words + link] = -1  # a refused write leaves no chain to follow
            return False
        view = memoryview(data)
        self._bytes[at : at + cap] = view[:cap]
        pos = cap
        for block in blocks:
            at = block * self.block_bytes + BLOCK_HEADER_BYTES
            piece = view[pos : pos + cap]
            self._bytes[at : at + len(piece)] = piece
            pos += cap
        view.release()
        return True

    def _attach(self, index: int, link: int, n: int) -> list[int]:
        """Take ``n`` blocks and make them block ``index``'s chain along ``link`` (replacing
        what it held): linked among themselves first, then, in one lock round, taken and
        hung on ``index`` (see "Chains": a death in that round is completed by
        ``break_dead_holder``). All or nothing: [] when the slab is short of blocks."""
        w = self._w
        first = self._blocks_word
        words = self._block_words
        word = first + index * words + link
        self._acquire()
        try:
            w[_HOLDER_PID] = _pid
            top = w[_FREE_TOP]
            if n > top:
                return []
            blocks = self._stack[top - n : top].tolist()
            nxt = -1
            for block in reversed(blocks):  # free blocks until the commit: nobody reads them
                w[first + block * words + link] = nxt
                nxt = block
            w[_PENDING_TOP] = top - n
            w[_PENDING_VALUE] = nxt
            w[_PENDING_WORD] = word
            w[_FREE_TOP] = top - n  # commit
            w[word] = nxt
        finally:
            w[_PENDING_WORD] = 0  # (also after an exception: no stale record is ever left)
            w[_HOLDER_PID] = 0
            self._release()
        return blocks

    def _detach(self, index: int, link: int, rest: list[int]) -> None:
        """Free block ``index``'s chain ``rest`` along ``link`` and unlink it, in one lock
        round (see "Chains")."""
        values = array("q", rest)
        k = len(values)
        w = self._w
        word = self._blocks_word + index * self._block_words + link
        self._acquire()
        try:
            w[_HOLDER_PID] = _pid
            top = w[_FREE_TOP]
            if top + k > self.capacity:
                raise InternalError(f"free of a chain of {k} with free_top={top}: double free")
            self._stack[top : top + k] = values
            w[_PENDING_TOP] = top + k
            w[_PENDING_VALUE] = -1
            w[_PENDING_WORD] = word
            w[_FREE_TOP] = top + k  # commit
            w[word] = -1
        finally:
            w[_PENDING_WORD] = 0
            w[_HOLDER_PID] = 0
            self._release()

    def _gather(self, index: int, n: int, link: int) -> bytes:
        cap = self.data_capacity
        at = index * self.block_bytes + BLOCK_HEADER_BYTES
        if n <= cap:
            return self._bytes[at : at + n].tobytes()
        out = bytearray(self._bytes[at : at + cap])
        w = self._w
        first = self._blocks_word
        words = self._block_words
        nxt = w[first + index * words + link]
        while len(out) < n:
            at = nxt * self.block_bytes + BLOCK_HEADER_BYTES
            out += self._bytes[at : at + min(cap, n - len(out))]
            nxt = w[first + nxt * words + link]
        return bytes(out)

    def release(self) -> None:
        """Release this object's views of the segment (before ``AnonSegment.close``)."""
        self._stack.release()
        self._bytes.release()
        self._w.release()


class FunctionTable:
    """Append-only table of pickled functions; the coordinator writes, workers read."""

    @staticmethod
    def region_bytes(data_bytes: int = FTAB_DATA_BYTES, max_fids: int = FTAB_MAX_FIDS) -> int:
        """Size of the function table region in bytes (a multiple of 64)."""
        return _LINE + _round_up(16 * max_fids, _LINE) + _round_up(data_bytes, _LINE)

    def __init__(
        self,
        buf: memoryview,
        data_bytes: int = FTAB_DATA_BYTES,
        max_fids: int = FTAB_MAX_FIDS,
        *,
        init: bool = False,
    ) -> None:
        """Attach to (with ``init=True``: format) a function table region.

        Raises:
            InternalError: not ``init`` and the header does not match.
        """
        size = self.region_bytes(data_bytes, max_fids)
        if data_bytes <= 0 or max_fids <= 0 or buf.nbytes < size:
            raise ValueError(f"function table needs {size} bytes and positive sizes")
        region = buf[:size]
        self._w = region.cast("q")
        self._data = region[_LINE + _round_up(16 * max_fids, _LINE) :]
        region.release()
        self.max_fids = max_fids
        self.data_bytes = data_bytes
        w = self._w
        if init:
            w[_F_USED] = 0
            w[_F_MAX_FIDS] = max_fids
            w[_F_DATA_BYTES] = data_bytes
            w[_F_COUNT] = 0
            w[_F_MAGIC] = FTAB_MAGIC
        elif (w[_F_MAGIC], w[_F_MAX_FIDS], w[_F_DATA_BYTES]) != (FTAB_MAGIC, max_fids, data_bytes):
            raise InternalError("function table header mismatch: wrong offset or layout")

    def add(self, data: bytes) -> int:
        """Coordinator only (single writer): append pickled function bytes.

        Returns:
            The new fid, or -1 if the table (fids or bytes) is full.
        """
        w = self._w
        fid, used, n = w[_F_COUNT], w[_F_USED], len(data)
        if fid >= self.max_fids or used + n > self.data_bytes:
            return -1
        self._data[used : used + n] = data
        w[_F_INDEX + 2 * fid] = used
        w[_F_INDEX + 2 * fid + 1] = n
        w[_F_USED] = used + n
        w[_F_COUNT] = fid + 1  # commit
        return fid

    def get(self, fid: int) -> bytes:
        """Any process: the bytes of ``fid`` (copied; cache what you load from them).

        Raises:
            IndexError: ``fid`` was never added (or its add is not visible yet).
        """
        w = self._w
        if not 0 <= fid < w[_F_COUNT]:
            raise IndexError(f"fid {fid} not in function table of {w[_F_COUNT]}")
        at, n = w[_F_INDEX + 2 * fid], w[_F_INDEX + 2 * fid + 1]
        return self._data[at : at + n].tobytes()

    def __len__(self) -> int:
        return self._w[_F_COUNT]

    def release(self) -> None:
        """Release this object's views of the segment (before ``AnonSegment.close``)."""
        self._data.release()
        self._w.release()
