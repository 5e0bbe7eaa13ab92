"""Pool.map: reading the input in chunks, sizing them, and yielding the results in input order.

Owns a map's state (``MapRun``: its input, chunks in flight and sizing), its iterator
(``ordered_results``), the default chunk sizing (``_next_chunksize``, ``_max_chunk`` from the
arguments' bytes, ``_bytes_cap`` from the results', ``_stop_bytes`` for a chunk's own stop, the
``MAP_*`` constants), the unpickling of the chunks' results (``_load``: ``run_chunk`` returns
them pickled, so that their size is known) and the failed future that takes the place of an
error met ahead of the results (``_failed``). The chunks are ordinary top-level tasks
(``_chunks.run_chunk``), sent through ``Pool.submit``; nothing here touches the coordinator but
``cancel_later``. The reasons and measurements are in docs/design.md, "Pool.map".

Called from: ``Pool.map`` (a user thread), which checks the arguments and the pool, then makes
a ``MapRun`` (``items`` are argument tuples if ``star``) and ``start``s it: it sends the first
window at once and returns its iterator. The iterator runs in whichever thread iterates it; its
cleanup (``close()``) may run in any thread, inside the garbage collector, so it takes no lock
there. ``Pool.shutdown`` (any thread) calls
``MapRun.send_rest`` for every live map. ``MapRun.lock`` orders the reads of
the input, the sends and the changes of ``in_flight`` between those threads.

A range input (the type ``range`` itself, of a map over one iterable) is read as sub-ranges
(``_read``: a slice, O(1)), and its chunks go as ranges, also the rests that chunks leave
(slices again): the caller builds no int object per item and pickles ~40 bytes a chunk, not
~3-5 an item, and the worker unpickles no list. A map of 20,000 no-ops over ``range(20000)``
took ~25% less time so (docs/design.md, "Pool.map"). A range's items cannot fail to pickle, and
reading one has no side effect, so it needs none of the rules below for errors in the input.

Invariants: ``in_flight`` holds the chunks sent and not yet yielded, in input order (the rest of
a chunk that stopped at its budget goes in right behind it, once: ``settle``, by the iterator,
by ``send_rest`` or by an eager run's ``fill``); new input is read only while fewer than
``MAP_PREFETCH_PER_WORKER`` chunks per worker are in flight (one a worker before a result was
measured), or by ``send_rest``, or, for an ``eager`` run (inputs that are all built-in
containers, ``SHARED_INPUTS``, with a finite deadline, until then; or dropped unread, to the
end), while fewer than that many are unfinished (by its chunks' done-callbacks,
``_chunk_done``, in whichever thread settles them); once its iterator is gone unread, what
ended leaves ``in_flight``; every chunk still in flight
when the iterator ends is cancelled: at once when it ends by its own error, timeout or Ctrl-C,
by the coordinator thread (``cancel_later``) when it is closed. An error met ahead of the
results (the input's, a chunk's submit) is raised only after every earlier result was yielded,
and nothing after it is sent.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import itertools
import math
import pickle
import sys
import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterator
from queue import Empty, SimpleQueue
from typing import TYPE_CHECKING, Any

from mpsched._chunks import run_chunk
from mpsched._errors import POOL_CLOSED_MESSAGE, PoolClosedError, timeout_error
from mpsched._future import CallbackRunner, Future
from mpsched._protocol import PICKLE_PROTOCOL, load_exception, unpickling_failed
from mpsched._serialize import TaskPicklingError, dumps, first_unpicklable

if TYPE_CHECKING:
    from typing import TypeAlias

    from mpsched._pool import Pool

    # A chunk's items: a list, or a sub-range of a range input (module docstring).
    Chunk: TypeAlias = "list[Any] | range"

# Inputs whose iteration no thread owns (these types exactly): a map of such inputs only may
# read them in the thread that settles a chunk (``MapRun.eager``). A generator, a cursor, or any
# class of the user's, with a length or not (a subclass of list too), may be bound to its thread
# (a sqlite3 cursor raises ProgrammingError in another): read by the map's reader only.
SHARED_INPUTS = (list, tuple, range, str, bytes, dict, set, frozenset)

# The default chunking (docs/design.md, "Pool.map").
MAP_TARGET_CHUNK_SECONDS = 0.002  # map: aim for chunks of about this much work
# Items per chunk, at most. A chunk costs ~0.3 ms of hand-offs (inject, wake, poke, collect)
# whatever its size: 20,000 no-ops took 7.3 ms at 4096 and 9.0 ms at 1024 (medians of 9).
MAP_MAX_CHUNK = 4096
# Pickled bytes per chunk, about: of its arguments from the first chunk on, of its results too
# once some came back (the first window can only be sized from the arguments). 20,000 strings
# of 1 KB: 64 ms in 512 KiB chunks, 71 ms in 1 MiB, 128 ms in 4 MiB (the stash through the
# coordinator's socket) and 134 ms in 128 KiB (hand-offs); medians of 5, interleaved.
MAP_CHUNK_BYTES = 512 * 1024
# A default chunk stops once its pickled results hold this much (``run_chunk``, as at its time
# budget): twice the sizing target, so that a chunk sized by its results' mean does not stop early.
MAP_CHUNK_STOP_BYTES = 2 * MAP_CHUNK_BYTES
# The TimeoutError of a map's iterator (a chunk's own wait names that wait's remaining time).
MAP_TIMED_OUT = (
    "a result of the map was not ready within its timeout, counted from the map() call; the "
    "map ends here, and its chunks that no worker has started are cancelled"
)
MAP_SAMPLE_ITEMS = 8  # items of the first chunk pickled to estimate bytes per item
# Pickled bytes per result, on average over a chunk, from which its results are let go of one
# by one as they are yielded (``_handed_out``); smaller ones are freed with their chunk.
MAP_RELEASE_BYTES = 256
MAP_PREFETCH_PER_WORKER = 4  # chunks in flight per worker (bounded read-ahead of lazy input)
MAP_GROWTH = 64  # chunks grow at most this much per measured chunk
MAP_FIRST_CHUNK = 64  # items per chunk before any chunk was measured (bounded by the budget)
# A default-sized chunk stops after about this much work (s) and map sends the rest of its
# items again: a first guess or a mis-measured chunk of slow items costs at most this much
# imbalance. 5x the target, so that a chunk sized by the target does not stop early.
MAP_CHUNK_BUDGET = 0.01
# ``fn`` travels pickled in every chunk (see ``MapRun.fn``): one that pickles to at least
# MAP_BIG_FN_BYTES (a partial over a big table, a bound method of a big object) makes the
# chunks long enough that it costs at most 1/MAP_FN_SHARE of their time, taken as
# MAP_FN_SECONDS_PER_BYTE a byte (pickled, sent, unpickled: ~48 ms for 10 MB measured here).
# Sized by the items alone, 5,000 items of 0.1 ms with a 10 MB partial took 23.5 s, where
# multiprocessing.Pool.map (which sends fn with each of its few chunks) took 0.49 s.
MAP_BIG_FN_BYTES = 64 * 1024
MAP_FN_SECONDS_PER_BYTE = 5e-9
MAP_FN_SHARE = 10


class MapRun:
    """One ``Pool.map``'s input, its chunks in flight and its sizing state: the iterator
    (``ordered_results``) reads from it in whichever thread iterates, ``fill`` sends ahead at
    the call and as results are consumed, and ``Pool.shutdown`` may send the rest
    (``send_rest``) from its own thread. ``lock`` orders the input's reads, the sends and
    ``in_flight``'s changes among those; the iterator's cleanup on ``close()`` takes no lock
    (see there)."""

    __slots__ = (
        "__weakref__",
        "budget",
        "cap",
        "chunksize",
        "closed",
        "deadline",
        "eager",
        "ended",
        "exhausted",
        "final",
        "fn",
        "in_flight",
        "items",
        "limit",
        "lock",
        "out_per_item",
        "per_item",
        "pool",
        "read",
        "reader",
        "sending",
        "shared",
        "size",
        "sized",
        "star",
        "stoppable",
        "target",
        "unfinished",
        "window",
    )

    def __init__(
        self,
        pool: Pool,
        fn: Callable[..., Any],
        items: Iterator[Any] | range,
        star: bool,
        chunksize: int | None,
        deadline: float | None,
        sized: bool,
        shared: bool,
    ) -> None:
        # Weak: the pool holds its unread maps (Pool._unread_maps), and a cycle would keep a
        # dropped pool alive until a garbage collection. The iterator holds the pool (as a
        # reference to the pool keeps it alive: it sends more as it is read).
        self.pool = weakref.ref(pool)
        # fn travels in each chunk's arguments, not through the function table: a __main__
        # function needs its copy by value there too (see _serialize.portable), the one the
        # pool's function cache keeps current (by value only once a global it read was rebound).
        self.fn = pool._functions.portable(fn)
        # Seconds of work a default chunk aims at, and after which it stops (see above).
        self.target, self.budget = MAP_TARGET_CHUNK_SECONDS, MAP_CHUNK_BUDGET
        if chunksize is None:
            try:
                fn_bytes = len(dumps(self.fn))  # once, at the call (a plain function: ~2 us)
            except Exception:  # reported where its first chunk is sent (``_send``)
                fn_bytes = 0
            if fn_bytes >= MAP_BIG_FN_BYTES:
                self.target = max(self.target, MAP_FN_SHARE * MAP_FN_SECONDS_PER_BYTE * fn_bytes)
                self.budget = self.target * (MAP_CHUNK_BUDGET / MAP_TARGET_CHUNK_SECONDS)
        self.items = items
        self.sized = sized  # an input with a length: finite, so shutdown sends all of it
        self.star = star
        self.chunksize = chunksize
        self.deadline = deadline
        # Inputs that any thread may read (``SHARED_INPUTS``): with a finite deadline, the
        # chunks go as workers finish them, not as the results are read (see ``_chunk_done``),
        # until then; once its iterator is gone unread, until the input's end (``reader_gone``).
        self.shared = shared
        self.eager = shared and deadline is not None and deadline < math.inf
        # The iterator (``start``), to know whether it can still be read: dropped or closed
        # unread, nobody takes the results (see ``fill``); ``read``: its first ``next()`` came.
        self.reader: weakref.ref[Generator[Any, None, None]] | None = None
        self.read = False
        self.unfinished = 0  # chunks sent and not done (kept only if eager)
        self.ended: list[Future[Any]] = []  # eager: chunks that ended, their rest not yet settled
        self.sending = False  # the lock's holder is sending (see ``_chunk_done``)
        # In input order: each chunk's future and its items (a chunk that stopped at its budget
        # leaves the rest of its items to go again, before every later chunk's results).
        self.in_flight: collections.deque[tuple[Future[Any], Chunk]] = collections.deque()
        # islice takes at most sys.maxsize: a bigger chunksize means the same (one chunk).
        self.size = min(chunksize, sys.maxsize) if chunksize else MAP_FIRST_CHUNK
        self.per_item: float | None = None
        self.cap = 0  # largest default chunk, from the first chunk's bytes per item; 0: not yet
        # pickled result bytes per item (a running mean); None: none came yet
        self.out_per_item: float | None = None
        self.limit = MAP_PREFETCH_PER_WORKER * pool._workers
        # Until a result came back, a default chunk's results have no known size: one chunk
        # per worker (a full window of 64-item chunks of 1 MB results was 512 MB on the way
        # back).
        self.window = pool._workers if chunksize is None else self.limit
        self.exhausted = False
        self.final = False  # sent from send_rest on: chunks run to their end (no stop)
        self.closed = False  # the iterator ended (closed, or by an error): nothing more is sent
        # The futures in flight of chunks that may stop part-way (by budget or bytes) whose
        # rest was not settled yet (``settle``): the iterator's, or ``Pool.shutdown``'s.
        self.stoppable: set[Future[Any]] = set()
        self.lock = threading.RLock()

    def start(self) -> Generator[Any, None, None]:
        """``Pool.map``'s iterator, after its checks: the items in chunks, their results in
        input order, until ``deadline`` (``time.monotonic()``; None: no limit). The first
        window of chunks is sent here, at the call, as ``ProcessPoolExecutor.map`` sends its
        tasks: a map nobody iterated yet ran nothing, and its timeout, counted from the call,
        ran out before its work began."""
        pool = self.pool()
        assert pool is not None  # the caller's
        results = ordered_results(self, pool)
        if self.shared:  # dropped unread, it is taken up again (``reader_gone``)
            runner = pool._coordinator.callbacks
            if runner.thread is None:  # started here, so that the drop finds it (``_dropped``)
                runner.start()
            gone = functools.partial(_dropped, pool._dropped_maps, runner, weakref.ref(self))
            self.reader = weakref.ref(results, gone)
        self.fill()
        return results

    def reader_gone(self) -> None:
        """The iterator was dropped (``let_dropped_maps_go``, in the pool's callback thread or
        in a later ``Pool.map``): unless it had been read (closed then) or the shutdown sent
        the rest, the map runs on to its end, its results dropped as they come (``fill``)."""
        with self.lock:
            if self.closed or self.final or self.read:
                return
            if not self.eager:  # the chunks in flight were sent without a done-callback:
                self.eager = True  # each gets one now (one that ended is called back at once)
                self.sending = True  # (so that those calls only queue it in ``ended``)
                try:
                    for future, _ in list(self.in_flight):
                        self._call_back_at_end(future)
                finally:
                    self.sending = False
            self.fill()

    def fill(self) -> None:
        """Send chunks while fewer than the window are in flight (the bounded read-ahead), or,
        if ``eager``, fewer than the window are unfinished (until the deadline, if any). Once
        the iterator was dropped or closed unread, drop what ended (``_forget_ended``)."""
        with self.lock:
            self.sending = True
            try:
                while True:
                    while self.ended:  # (each is in ``in_flight`` by now: it is no send's)
                        self.settle(self.ended.pop())
                    gone = self._unread_and_gone()
                    if gone:  # before the window's test: what ended frees its place
                        self._forget_ended()
                    if self.exhausted or not (
                        len(self.in_flight) < self.window
                        or (
                            self.eager
                            and self.unfinished < self.window
                            # Gone unread, it runs to its end, its deadline passed or not
                            # (before, that one stopped, and was let go only at shutdown).
                            and (gone or self.deadline is None or time.monotonic() < self.deadline)
                        )
                    ):
                        break
                    self._send_next()
            finally:
                self.sending = False

    def _unread_and_gone(self) -> bool:
        """Under ``lock``: the iterator was dropped, or closed (a generator closed has no
        frame), before its first ``next()``."""
        if self.read or self.reader is None:
            return False
        reader = self.reader()
        return reader is None or getattr(reader, "gi_frame", None) is None

    def _forget_ended(self) -> None:
        """Under ``lock``, for a map whose iterator was dropped (or closed) before its first
        ``next()`` (a ``pool.map(f, items)`` called for its side effects, as with
        ``ProcessPoolExecutor.map``): nobody will read its results, so the chunks that ended
        (and were settled: their rests went) leave ``in_flight``, and once the input is
        exhausted and nothing is in flight the pool lets the run go (``Pool._unread_maps``).
        Before, such a map ran its first window at the call and the rest only at the pool's
        shutdown, and each one held its input and results until then (found by a soak
        review: 5,000 of them grew the pool's process by 150 MB)."""
        in_flight = self.in_flight
        kept: list[tuple[Future[Any], Chunk]] = []
        rests: list[Chunk] = []
        for future, items in in_flight:
            if not future.done() or future in self.stoppable:
                kept.append((future, items))
            elif not future.cancelled() and future.exception() is None:
                # A chunk ends at an item that raised (a read map raises there): nobody reads
                # this one, so the items after it go on, as ProcessPoolExecutor.map's would
                # (they never ran: some dozens, as the chunking went, and nothing said so).
                # A chunk's task that failed ran no item to its end, or died with its worker
                # (its items may have run): nothing of it goes again.
                _, _, error, done = future.result()
                if error is not None and done < len(items):
                    rests.append(items[done:])
        if len(kept) < len(in_flight):
            in_flight.clear()
            in_flight.extend(kept)
            for rest in rests:
                self._send_at(len(in_flight), rest)
        if self.exhausted and not in_flight:
            pool = self.pool()
            if pool is not None:
                pool._unread_maps.discard(self)  # (one C call: no lock needed to drop it)

    def _chunk_done(self, future: Future[Any]) -> None:
        """An ``eager`` run's chunk ended (a done-callback: in the pool's callback thread, or
        in the thread that collected it). Its rest goes at once and more chunks go, so that a
        reader who pauses between results does not stop the work: with a timeout counted
        from the call, as ``ProcessPoolExecutor.map``'s, which submits the whole input at the
        call, the results still to be read came late and timed out while the workers idled;
        and a map dropped unread runs on (``reader_gone``). Built-in containers are read here
        too (as ``send_rest`` reads an input with a length from the shutdown's thread); any
        other input (an iterator, a class of the user's) is read only by the reader (it may be
        bound to its thread): such a run is never eager."""
        with self.lock:
            self.unfinished -= 1
            # ``send_rest`` settles what it sent before; a run that is not eager is settled and
            # sent on by its reader (``take_first``, ``fill``).
            if self.closed or self.final or not self.eager:
                return
            if (
                self.chunksize is None
                and self._unread_and_gone()  # else the reader measures it, once
                and not future.cancelled()
                and future.exception() is None
            ):
                # Sized here too: a map nobody reads (yet) went on in chunks of 64 items, one
                # per worker, 20-40 times slower than one read at once (found in review).
                pickled, seconds, error, done = future.result()
                if error is None and done:
                    self.measured(seconds, sum(map(len, pickled)), done)
            self.ended.append(future)
            # Called back at once by a send of this thread's (the chunk ended first), it is
            # not in ``in_flight`` yet, and settling it would lose its rest: the next ``fill``
            # settles it (the reader's, or this one's after the send).
            if not self.sending:
                self.fill()

    def send_rest(self, wait_chunks: bool = True, wait: bool = True) -> bool:
        """``Pool.shutdown``, before it closes the pool: for a map whose input has a length,
        send the rest of its input, so that its results all come, also once the pool ended
        (as ``ProcessPoolExecutor.map``, which sends it all at the call); for any map, let
        what was sent run to its end. What is sent from here on runs to its end (no budget,
        no bytes' stop), and so does a chunk in flight that may stop but no worker claimed
        yet: withdrawn, it goes again whole (``_send_whole``). What a claimed one leaves is
        sent again here, once it returned (the iterator, which does that otherwise, may be
        read only once the pool ended: the rest was lost, and reading it raised
        PoolClosedError). So this waits for the claimed chunks that may stop (at most about
        ``MAP_CHUNK_BUDGET`` of work each, past the item that runs at the budget; their sizes
        bound their results' bytes); a wait for the unclaimed ones was a wait for all the work
        queued ahead of them, in ``shutdown(wait=False)`` too, and for ever if that work
        waited for the caller. Not with ``wait_chunks`` False (the coordinator's thread, which
        must collect them, and may hold the locks that a withdrawal takes). With ``wait``
        False (``shutdown(wait=False)``), the wait is left to ``settle_rests``, in a thread of
        its own; returns whether claimed chunks are left to it."""
        with self.lock:
            self.final = True
            while self.sized and not self.exhausted and not self.closed:
                self._send_next()
            if wait_chunks and not self.closed:
                for future in list(self.stoppable):
                    if future.cancel():  # no worker claimed it: it never runs
                        self._send_whole(future)
            left = wait_chunks and not self.closed and bool(self.stoppable)
        if left and wait:
            self.settle_rests()
        return left and not wait

    def settle_rests(self) -> None:
        """``send_rest``'s wait: for each claimed chunk that may stop, once it returned, send
        what it left, right behind it (``settle``)."""
        while True:
            with self.lock:
                if self.closed or not self.stoppable:
                    return
                future = next(iter(self.stoppable))
            future.wait_done()
            self.settle(future)

    def settle(self, future: Future[Any]) -> None:
        """Under ``lock``: the chunk of ``future`` (done, at the front of ``in_flight`` or, from
        ``send_rest``, anywhere in it) sends again what it left at its budget, right behind
        itself, once; a no-op for a chunk that cannot stop, or was settled or taken already."""
        with self.lock:
            if future not in self.stoppable:  # (a chunksize map's chunks: no search)
                return
            index = self._unlist(future)
            in_flight = self.in_flight
            if index is None or future.cancelled() or future.exception() is not None:
                return  # (not in flight: dropped when the iterator was closed)
            _, _, error, done = future.result()
            try:
                chunk = in_flight[index][1]
                if error is not None or done >= len(chunk):
                    return
                in_flight[index] = (future, chunk[:done])
            except IndexError:  # cleared meanwhile: see _unlist
                return
            self._send_at(index + 1, chunk[done:])

    def _send_whole(self, future: Future[Any]) -> None:
        """Under ``lock``, from ``send_rest``: ``future``'s chunk (withdrawn before any worker
        claimed it) goes again in its place, to its end. The iterator, if it waits for it,
        finds its place taken (see ``ordered_results``)."""
        index = self._unlist(future)
        if index is None:
            return
        try:
            chunk = self.in_flight[index][1]
            del self.in_flight[index]
        except IndexError:  # cleared meanwhile: see _unlist
            return
        self._send_at(index, chunk)

    def _unlist(self, future: Future[Any]) -> int | None:
        """Under ``lock``: ``future``'s chunk is settled from now on (out of ``stoppable``);
        its index in ``in_flight``, or None if it left (its iterator was closed).

        The iterator's close clears ``in_flight`` without the lock, from any thread, at any
        point (``ordered_results``: it may run inside the garbage collector), so this scans a
        copy (``list()``, one C call), and the callers find the index gone (IndexError) if it
        came in between; scanning the deque itself, a shutdown raised "deque mutated during
        iteration" and left the pool open (found by a review, with a delay injected)."""
        self.stoppable.discard(future)
        entries = list(self.in_flight)
        return next((i for i, (f, _) in enumerate(entries) if f is future), None)

    def _send_at(self, index: int, items: Chunk) -> None:
        """Under ``lock``: send ``items`` again, in chunks of ``size``, at ``index`` of
        ``in_flight``."""
        size = self.size
        entries = []
        sending, self.sending = self.sending, True
        try:
            for start in range(0, len(items), size):
                entries += self._send(items[start : start + size])[0]
        finally:
            self.sending = sending
        for offset, entry in enumerate(entries):
            self.in_flight.insert(index + offset, entry)
        if self.closed:
            # The iterator was closed while these went (its close cancels what it finds in
            # ``in_flight``, then clears it, without the lock): they would run unread.
            for future, _ in entries:
                future.cancel()

    def _send_next(self) -> None:
        """Read the next chunk of the input and send it (under ``lock``); ``exhausted`` once
        the input ended, failed or a chunk could not be sent (nothing after it is sent).

        The first default chunks, before anything was measured, go as a window: the first
        ``MAP_SAMPLE_ITEMS`` items give the bytes per item (``cap``: the bytes bound every
        chunk from the first on; read 64 to a chunk, 1 MB items made 512 MB in flight before
        the first result), then a window of chunks of ``size`` items is read at once, and an
        input that ends within it is split evenly over the window (a chunk a worker): sent in
        chunks from the front, a short map of slow items ran on one worker while the others
        idled (2 items of 0.5 s took 1 s on 2 workers, where ProcessPoolExecutor.map takes
        0.5 s). Once the pool is closed, nothing is read: read and then refused, a window of
        the caller's items (4,096) was gone from its iterator."""
        if self._refused():  # read nothing that cannot go: the caller's input
            return
        chunk: Chunk = []
        error: Exception | None = None
        parts = 1
        try:
            if not self.cap and self.chunksize is None:
                parts = self.window
                chunk = self._read(chunk, MAP_SAMPLE_ITEMS)
                if chunk:
                    self.cap = _max_chunk(chunk)
                    self.size = min(self.size, self.cap)
            wanted = parts * self.size
            chunk = self._read(chunk, max(0, wanted - len(chunk)))
        except Exception as exc:  # keeps what came before the input's error
            error = exc
            wanted = parts * self.size
        if not self.sized and self._refused():  # closed while it was read (see _read)
            return
        per = max(1, -(-len(chunk) // parts))  # ``size``, unless the input ended sooner
        for start in range(0, len(chunk), per):
            entries, sent = self._send(chunk[start : start + per])
            self.in_flight.extend(entries)
            if not sent:  # failed to go: nothing after it is sent
                self.exhausted = True
                return
        if error is not None:
            self.in_flight.append((_failed(error), []))
        self.exhausted = error is not None or len(chunk) < wanted

    def _refused(self) -> bool:
        """Under ``lock``: whether the pool is closed (or gone); then the map ends there, with
        PoolClosedError in place of its next chunk."""
        pool = self.pool()
        if pool is not None and not pool._closed:
            return False
        closed = PoolClosedError(POOL_CLOSED_MESSAGE if pool is None else pool._closed_message)
        self.in_flight.append((_failed(closed), []))
        self.exhausted = True
        return True

    def _read(self, chunk: Chunk, n: int) -> Chunk:
        """Under ``lock``: ``chunk`` and up to ``n`` more items of the input (those read before
        an error are added to ``chunk`` too). A ``range`` is read as a sub-range, which
        follows ``chunk``, read from it before (module docstring, "A range input").
        An input without a length is read by its iterator's thread only
        (``fill``, from ``start`` or the iterator), with ``lock`` released meanwhile: it may
        wait as long as it likes (a queue, a socket), and ``Pool.shutdown`` takes ``lock``
        (``send_rest``). It waited for it: a shutdown, ``wait=False`` too, in a signal handler
        or at the interpreter's exit, hung until the stream gave its next item (found by two
        reviews)."""
        items = self.items
        if type(items) is range:
            piece, self.items = items[:n], items[n:]
            return range(chunk.start, piece.stop, piece.step) if type(chunk) is range else piece
        assert type(chunk) is list
        if self.sized:
            chunk.extend(itertools.islice(items, n))
            return chunk
        lock = self.lock
        try:
            lock.release()  # held once: fill took it, in the iterator's thread
            chunk.extend(itertools.islice(items, n))
        finally:
            _hold_again(lock)
        return chunk

    def _send(self, piece: Chunk) -> tuple[list[tuple[Future[Any], Chunk]], bool]:
        """``in_flight``'s entries for ``piece``, and whether all of it went. An error met
        ahead of the results (the input's, a submit's: an item that does not pickle, the pool
        shut down) takes the place of its items: the results before it come first, as with
        the builtin map. An item that does not pickle fails alone: the items before it go as
        a chunk of their own (ProcessPoolExecutor.map drops them with the chunk), and the
        error names it (or fn, if fn is what does not pickle)."""
        fn = self.fn
        try:
            if self.chunksize or self.final:  # no budget either
                budget = max_bytes = math.inf
            else:
                budget, max_bytes = self.budget, _stop_bytes(len(piece), self.out_per_item)
            pool = self.pool()
            if pool is None:  # unreachable while the iterator or a shutdown holds the pool
                raise PoolClosedError(POOL_CLOSED_MESSAGE)
            # Once final, a shutdown sends it: past the pool's closing (``Pool._submit``'s
            # ``rest``), which refuses the user's work from the shutdown's start on.
            future = pool._submit(  # (direct: see Coordinator.submit)
                None, run_chunk, (fn, piece, self.star, budget, max_bytes), {}, self.final, True
            )
            if budget != math.inf or max_bytes != math.inf:
                self.stoppable.add(future)
            if self.eager:
                self._call_back_at_end(future)
            return [(future, piece)], True
        except Exception as exc:  # a BaseException (Ctrl-C) goes on at once
            found = first_unpicklable([fn, *piece]) if isinstance(exc, TaskPicklingError) else None
            if found is None:  # items that pickle alone but not together: the chunk's error
                return [(_failed(exc), piece)], False
            index, error = found
            before = self._send(piece[: index - 1])[0] if index > 1 else []
            return [*before, (_failed(error), [])], False

    def _call_back_at_end(self, future: Future[Any]) -> None:
        """Under ``lock``, for an eager run: count ``future``'s chunk unfinished until its
        done-callback (``_chunk_done``) comes."""
        self.unfinished += 1
        future.add_done_callback(functools.partial(_chunk_done, weakref.ref(self)))

    def measured(self, seconds: float, nbytes: int, done: int) -> None:
        """A default chunk's results came (``done`` items in ``seconds``, ``nbytes`` pickled):
        size the next chunks from them."""
        with self.lock:
            sample = seconds / done
            per_item = self.per_item
            per_item = sample if per_item is None else 0.5 * per_item + 0.5 * sample
            self.per_item = per_item
            # Results bound the chunks too: small inputs with big results (1 MB each) made
            # chunks of thousands of items, each returning one huge list.
            sample = nbytes / done
            out = self.out_per_item
            self.out_per_item = out = sample if out is None else 0.5 * out + 0.5 * sample
            self.window = self.limit
            self.size = _next_chunksize(per_item, done, _bytes_cap(self.cap, out), self.target)

    def first_in_flight(self) -> Future[Any] | None:
        with self.lock:
            return self.in_flight[0][0] if self.in_flight else None

    def take_first(self, future: Future[Any]) -> None:
        """The iterator is done with ``future``'s chunk (the first in flight): what it left at
        its budget goes again, ahead of every later chunk (``settle``), and it leaves
        ``in_flight``."""
        with self.lock:  # (reentrant: settle takes it too)
            self.settle(future)
            assert self.in_flight[0][0] is future, "map order lost"
            self.in_flight.popleft()


def ordered_results(run: MapRun, pool: Pool) -> Generator[Any, None, None]:
    """The results of ``run``'s chunks in input order, sending more as they are consumed."""
    in_flight = run.in_flight
    deadline = run.deadline
    run.read = True  # read from now on: dropped, it is abandoned (see Pool.map)
    if run in pool._unread_maps:
        with pool._maps_lock:
            pool._unread_maps.discard(run)
    try:
        while True:
            run.fill()
            future = run.first_in_flight()
            if future is None:
                return
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            # Still in in_flight while it is waited for (the finally below cancels it on a
            # timeout or a Ctrl-C: an abandoned map must not run it, the stdlib's gh-95166),
            # and for ``send_rest``, which may settle what it leaves at its budget first.
            try:
                pickled, seconds, error, done = future.result(remaining)
            except concurrent.futures.CancelledError:
                if run.first_in_flight() is future:
                    raise
                continue  # withdrawn by send_rest, and sent again in its place: wait for that
            except concurrent.futures.TimeoutError:
                if future.done():  # the input's own error, in its place (diff review)
                    raise
                raise timeout_error(MAP_TIMED_OUT) from None
            nbytes = sum(map(len, pickled))
            if run.chunksize is None and error is None:  # before its rest goes, sized so
                run.measured(seconds, nbytes, done)
            run.take_first(future)
            del future  # holds the pickled results: not again alongside the results
            results = _load(pickled)
            del pickled
            if error is not None:  # an item raised after these: they come first (_chunks)
                yield from _handed_out(results, nbytes)
                raise load_exception(error)
            yield from _handed_out(results, nbytes)
    except GeneratorExit:
        # close(): by the caller, or by the garbage collector finalizing the generator,
        # which may run inside any allocation, also while this thread holds a lock that
        # future.cancel() takes (Coordinator.lock, the futures' module lock, a slot lock, the
        # run's own lock): cancelling here would wait for this thread forever. The
        # coordinator thread cancels them instead, on its next pass (docs/design.md,
        # Pool.map). ``list()`` copies the deque in one C call, without a lock.
        run.closed = True
        pool._coordinator.cancel_later([future for future, _ in list(in_flight)])
        in_flight.clear()
        raise
    finally:
        # The map's own error, timeout or Ctrl-C, raised in this frame (every lock taken
        # below it was released on the way out): cancel at once. Ended, the map sends nothing
        # more, also from ``Pool.shutdown``: the exception's traceback keeps this frame, and
        # with it the run, among the pool's maps (the rest of a map that had raised ran at
        # the shutdown).
        run.closed = True
        for future, _ in list(in_flight):
            future.cancel()


def no_results() -> Generator[Any, None, None]:
    """``Pool.map`` of no iterable: no result (a generator, as every map's iterator, so that
    it has ``close()`` too)."""
    yield from ()


def _dropped(
    dropped: SimpleQueue[weakref.ref[MapRun]],
    runner: CallbackRunner,
    run: weakref.ref[MapRun],
    _: weakref.ref[Generator[Any, None, None]],
) -> None:
    """The callback of ``MapRun.reader``: the map's iterator is gone. It may run in the
    garbage collector, inside any call of any thread, where a lock may be held that a send
    takes: so it only queues the run, and has the pool's callback thread take it up
    (``let_dropped_maps_go``; neither ``put`` takes a lock). If that thread has ended, the
    pool's next ``map()`` does, or its shutdown sends the rest."""
    dropped.put(run)
    runner.poke(functools.partial(let_dropped_maps_go, dropped))


def let_dropped_maps_go(dropped: SimpleQueue[weakref.ref[MapRun]]) -> None:
    """The pool's callback thread (poked by ``_dropped``) or ``Pool.map``: each map whose
    iterator was dropped unread runs on to its end and is let go (``MapRun.reader_gone``)."""
    while True:
        try:  # (no empty() first: another thread may take the last one between)
            ref = dropped.get_nowait()
        except Empty:
            return
        run = ref()
        if run is not None:
            run.reader_gone()


def _chunk_done(ref: weakref.ref[MapRun], future: Future[Any]) -> None:
    """A chunk's done-callback: it refers to its run weakly (the run's futures are in its
    ``in_flight``: a cycle would keep a run, and the results it holds, until a collection)."""
    run = ref()
    if run is not None:
        run._chunk_done(future)


def _handed_out(results: list[Any], nbytes: int) -> Iterator[Any]:
    """``results`` (``nbytes`` pickled) in order. Big ones are let go of one by one as they are
    yielded, so that a result the caller dropped is freed (as the stdlib's map does since
    bpo-14406: a chunk's list kept its results, and their memory, until its last was yielded);
    small ones go with their chunk (at most ~``MAP_CHUNK_BYTES`` of them pickled), as letting
    go costs ~30 ns a result, ~10% of a map of no-ops."""
    if nbytes < MAP_RELEASE_BYTES * len(results):
        return iter(results)
    results.reverse()
    return itertools.starmap(results.pop, itertools.repeat((), len(results)))


def _next_chunksize(per_item: float, measured: int, cap: int, seconds: float) -> int:
    """Items in the next default chunk, of about ``seconds`` of work, from the mean ``per_item``
    seconds and the items of the last measured chunk; at most ``cap`` (``_max_chunk``)."""
    target = int(seconds / per_item) if per_item > 0 else cap
    # Bounded growth, so one mis-measured fast chunk cannot make a huge slow one; 64x reaches
    # the largest chunk from the first one in one result, so a map of tiny tasks ramps up fast.
    return max(1, min(target, MAP_GROWTH * measured, cap))


def _bytes_cap(cap: int, out_per_item: float) -> int:
    """``cap`` (items), lowered so that a chunk's pickled results hold about
    ``MAP_CHUNK_BYTES`` at ``out_per_item`` bytes each (one item at least)."""
    return max(1, min(cap, int(MAP_CHUNK_BYTES / max(1.0, out_per_item))))


def _stop_bytes(items: int, out_per_item: float | None) -> float:
    """``max_bytes`` of a default chunk of ``items`` (``run_chunk``): ``MAP_CHUNK_STOP_BYTES``
    while the results' size is unknown or their bytes can matter, else no limit (a chunk of
    small results then pickles them once, not once per run)."""
    if out_per_item is None or items * out_per_item * 8 >= MAP_CHUNK_BYTES:
        return MAP_CHUNK_STOP_BYTES
    return math.inf


def _load(pieces: list[bytes]) -> list[Any]:
    """A chunk's results from their pickled pieces (``run_chunk``), in the caller's thread.
    An error (SystemExit included) fails as any task's result that does not unpickle does, with
    a TaskOutcomeError; a KeyboardInterrupt goes on: here it may be the caller's Ctrl-C."""
    try:  # user code runs here (__setstate__, __reduce__)
        if len(pieces) == 1:
            results: list[Any] = pickle.loads(pieces[0])
        else:
            results = [result for piece in pieces for result in pickle.loads(piece)]
    except (Exception, SystemExit) as exc:
        raise unpickling_failed(exc) from exc
    return results


def _hold_again(lock: Any) -> None:
    """Hold ``lock`` again, an RLock this thread held once and released (``MapRun._read``),
    whatever comes meanwhile: a Ctrl-C's KeyboardInterrupt, raised in ``acquire()`` without
    the lock, or just after it, is raised once the lock is held. (Raised from the plain
    ``acquire()``, the caller's ``with`` then failed to release a lock it did not hold: a
    RuntimeError in its place, and the ``with`` block of the pool waited for its tasks, as for
    any error, instead of stopping them. Found by a review, with a delay injected.)"""
    pending: BaseException | None = None
    while True:
        try:
            if not lock._is_owned():  # (RLock's, as threading.Condition asks it)
                lock.acquire()
            break
        except BaseException as exc:
            pending = exc
    if pending is not None:
        raise pending


def _failed(error: Exception) -> Future[Any]:
    """A future that failed with ``error``: an error in ``Pool.map``'s input order."""
    future: Future[Any] = Future()
    future.set_exception(error)
    return future


def _max_chunk(chunk: Chunk) -> int:
    """The largest default chunk for items like the first few of ``chunk``: at most
    ``MAP_MAX_CHUNK`` items and about ``MAP_CHUNK_BYTES`` pickled (a range's chunk pickles to
    a few dozen bytes, whatever its length)."""
    if type(chunk) is range:
        return MAP_MAX_CHUNK
    sample = chunk[:MAP_SAMPLE_ITEMS]
    try:
        nbytes = len(pickle.dumps(sample, PICKLE_PROTOCOL))
    except Exception:  # submit says why, with cloudpickle's help; size by count meanwhile
        return MAP_MAX_CHUNK
    return max(1, min(MAP_MAX_CHUNK, MAP_CHUNK_BYTES * len(sample) // max(1, nbytes)))
