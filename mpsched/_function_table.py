"""The function table: an append-only table of pickled functions in shared memory.

What this module owns: the layout of the function table region (``_layout`` places it in the
pool's segment) and every access to it. A task's pickled ``(fid, args)`` (in a slab block,
``_payloads``) names its function by fid, an index here. Part of the ``_payloads`` leaf; it
shares the slab's alignment unit (``_slab_region``).

Who calls what, from which process: the coordinator appends pickled functions (``add``, single
writer, no lock); workers read them (``get``) and cache the loaded function by fid.

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

Invariants: a fid's index entry and bytes are written before ``count`` covers it (the commit
point), and never change afterwards. Visibility without fences: the coordinator adds the
function before it injects a task using it, under a slot lock whose acquire/release order the
plain stores (also on ARM); a worker reads the fid after claiming the task under that lock.
"""

from __future__ import annotations

from mpsched._errors import InternalError
from mpsched._slab_region import _LINE, _round_up

__all__ = (
    "FTAB_DATA_BYTES",
    "FTAB_MAX_FIDS",
    "FunctionTable",
)

FTAB_DATA_BYTES = 4 * 1024 * 1024  # 4 MiB of pickled functions; sparse until written
FTAB_MAX_FIDS = 4096  # distinct functions per pool; index = 64 KiB
FTAB_MAGIC = 0x6D70_7363_6864_6631  # "mpschdf1"

# Function table header words.
_F_COUNT = 0
_F_USED = 1
_F_MAGIC = 2
_F_MAX_FIDS = 3
_F_DATA_BYTES = 4
_F_INDEX = 8  # word index of the (offset, length) pairs


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
