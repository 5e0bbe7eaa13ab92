"""Where task bytes live: a slab of fixed-size blocks, allocated and read and written here.

What this module owns: ``Slab``, the class every process instantiates over the slab region of
the pool's segment (``_layout`` places it), and every per-task access to it: the allocator
(``alloc*`` / ``free*``), the chains, and the reads and writes of a block's header words and
bytes. A task handle in a deque or inbox (``_shm_deque``) is a block index here; the block holds
the task's pickled arguments, and later its result.

``_payloads`` is one leaf in four modules, whose parts ``Slab`` combines or that sit beside it:
``_slab_region`` (the region's and a block's layout, ``BlockField``, attaching, the hints),
``_slab_repair`` (the coordinator's repair after a lock holder died: ``break_dead_holder``)
and ``_function_table`` (the table of pickled functions). The layout constants and
``BlockField`` are importable from here too.

Who calls what, from which process:
    * ``Slab``: the coordinator allocates and frees blocks for top-level tasks and writes their
      arguments; a worker allocates blocks for the children its tasks spawn (``alloc``,
      ``write_child``), reads the arguments of a claimed task (``read`` / ``data_view``) and writes
      the result back into the same block (``write_result``); whoever consumes a result frees
      the block. ``alloc*`` / ``free*`` and the chain ops take the ONE allocator lock (passed
      in, used for nothing else); the block words and data are written without it (but for
      ``alloc``'s stamp and a chain's links), by the block's current holder, and
      published to other processes only through a locked ring (``_shm_deque``).

Invariants and ordering:
    * A block index is handed out by ``alloc`` to exactly one holder until ``free``; the slab
      itself cannot tell a double free (the engine must not do one; a free past N raises).
    * Visibility without fences: a block's bytes are written before its handle is pushed or
      injected under a slot lock, and read after the handle is claimed under that lock; the
      lock's acquire/release order the plain stores (also on ARM). The same chain makes a fid
      visible (``_function_table``).
      ``result_status`` is the commit point of a result against crashes, not a publication:
      whoever reads a result must have learnt of it through a lock or a syscall (pipe, eventfd)
      after the worker wrote it, never by polling the word.
    * A process that dies holding the allocator lock leaves the old or the new free_top (one
      final store); ``break_dead_holder`` (``_slab_repair``) releases the lock.
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

import os
from array import array
from collections.abc import Sequence

from mpsched._errors import InternalError
from mpsched._slab_region import (
    _FREE_TOP,
    _HOLDER_PID,
    _NBYTES,
    _NEXT_ARG,
    _NEXT_RESULT,
    _PARENT,
    _PENDING_TOP,
    _PENDING_VALUE,
    _PENDING_WORD,
    _RESULT_NBYTES,
    _RESULT_STATUS,
    _STATE,
    _UID,
    BLOCK_BYTES,
    BLOCK_HEADER_BYTES,
    BlockField,
)
from mpsched._slab_repair import SlabRepair

__all__ = (
    "BLOCK_BYTES",
    "BLOCK_HEADER_BYTES",
    "CHAIN_BYTES_MAX",
    "MAX_CHAIN_BLOCKS",
    "BlockField",
    "Slab",
)

# Blocks per chain (~60 KiB): beyond, bytes go through the coordinator's stash (raw frames on
# the sockets). A chain costs Python work per 960-byte block on both sides, a stash a kernel copy
# each way and, for arguments, a FETCH round trip. Measured (2 workers, fork, tasks submitted
# one by one, us a task, chain vs stash): results of 16 KiB 80 vs 56, 64 KiB 252 vs 148,
# 200 KiB 630 vs 262; arguments of 32 KiB 150 vs 178, 64 KiB 231 vs 226, 96 KiB 299 vs 248;
# round trips of one task, 16 KiB either way 135 vs 190-255, 200 KiB 1,230-1,260 vs 360-730;
# children (spawned and joined in a worker) level at 100 KiB, a 200 KiB result 611 vs 489.
# At 256 blocks (~240 KiB), every size from ~64 KiB up took the slower way.
MAX_CHAIN_BLOCKS = 64
# Bytes: the most a chain holds (61,440); longer bytes always go through the stash.
CHAIN_BYTES_MAX = MAX_CHAIN_BLOCKS * (BLOCK_BYTES - BLOCK_HEADER_BYTES)

_pid = os.getpid()  # for holder_pid without a syscall per operation


def _refresh_pid() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_refresh_pid)


class Slab(SlabRepair):
    """Fixed-size blocks in shared memory with a locked free stack."""

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
        """Return several blocks in one lock round, then clear the ``state`` and ``uid`` words
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
            self._stack[top : top + k] = values
            w[_FREE_TOP] = top + k  # commit
            for index in children:  # after the commit: see free_children
                base = self._blocks_word + index * self._block_words
                w[base + _STATE] = 0
                w[base + _UID] = 0
        finally:
            w[_HOLDER_PID] = 0
            self._release()

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
        under the allocator lock, right after the commit: a freer that dies before the commit
        leaves the block as it was, a child the crash recovery still finds, and one that dies
        after it leaves free blocks that ``break_dead_holder`` clears. (Cleared before the
        commit, a death in between left a block that named nobody, yet in no free stack:
        leaked, about once in 50 chaos runs of 20 kills on a loaded machine.)"""
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
