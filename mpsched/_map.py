"""Pool.map: reading the input in chunks, sizing them, and yielding the results in input order.

Owns the map's iterator (``map_results``), the default chunk sizing (``_next_chunksize``,
``_max_chunk`` from the arguments' bytes, ``_bytes_cap`` from the results', ``_stop_bytes``
for a chunk's own stop, the ``MAP_*`` constants), the unpickling of the chunks' results
(``_load``: ``run_chunk`` returns them pickled, so that their size is known) and the failed
future that takes the place of an error met ahead of the results (``_failed``). The chunks are
ordinary top-level tasks (``_chunks.run_chunk``), sent through ``Pool.submit``; nothing here
touches the coordinator but ``cancel_later``. The reasons and measurements are in
docs/design.md, "Pool.map".

Called from: ``Pool.map`` (a user thread), which checks the arguments and the pool, then returns
``map_results``' generator. The generator runs in whichever thread iterates it; its cleanup
(``close()``) may run in any thread, inside the garbage collector, so it takes no lock there.

Invariants: ``in_flight`` holds the chunks sent and not yet yielded, in input order (the rest
of a chunk that stopped at its budget goes back to its front); new input is read only while
fewer than ``MAP_PREFETCH_PER_WORKER`` chunks per worker are in flight; every chunk still
in flight when the generator ends is cancelled: at once when it ends by its own error, timeout
or Ctrl-C, by the coordinator thread (``cancel_later``) when it is closed. An error met ahead
of the results (the input's, a chunk's submit) is raised only after every earlier result was
yielded, and nothing after it is read.
"""

from __future__ import annotations

import collections
import itertools
import math
import pickle
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from mpsched._chunks import run_chunk
from mpsched._future import Future
from mpsched._protocol import PICKLE_PROTOCOL, load_exception, unpickling_failed
from mpsched._serialize import TaskPicklingError, first_unpicklable

if TYPE_CHECKING:
    from mpsched._pool import Pool

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


def map_results(
    pool: Pool,
    fn: Callable[..., Any],
    items: Iterator[Any],
    star: bool,
    chunksize: int | None,
    deadline: float | None,
) -> Iterator[Any]:
    """``Pool.map``'s iterator, after its checks: ``items`` (argument tuples if ``star``) in
    chunks, their results in input order, until ``deadline`` (``time.monotonic()``; None: no
    limit)."""
    # In input order: each chunk's future and its items (a chunk that stopped at its budget
    # leaves the rest of its items to go again, before every later chunk's results).
    in_flight: collections.deque[tuple[Future, list[Any]]] = collections.deque()
    # islice takes at most sys.maxsize: a bigger chunksize means the same (one chunk).
    size = min(chunksize, sys.maxsize) if chunksize else MAP_FIRST_CHUNK
    budget = math.inf if chunksize else MAP_CHUNK_BUDGET
    per_item = None
    cap = 0  # largest default chunk, from the first chunk's bytes per item; 0: not yet
    out_per_item = None  # pickled result bytes per item (a running mean); None: none came yet
    limit = MAP_PREFETCH_PER_WORKER * pool._workers
    # Until a result came back, a default chunk's results have no known size: one chunk per
    # worker (a full window of 64-item chunks of 1 MB results was 512 MB on the way back).
    window = pool._workers if chunksize is None else limit
    exhausted = False
    # fn travels in each chunk's arguments, not through the function table: a __main__
    # function needs its copy by value there too (see _serialize.portable), the one the pool's
    # function cache keeps current (by value only once a global it read was rebound).
    fn = pool._functions.portable(fn)

    def send(piece: list[Any]) -> tuple[list[tuple[Future, list[Any]]], bool]:
        # ``in_flight``'s entries for ``piece``, and whether all of it went. An error met
        # ahead of the results (the input's, a submit's: an item that does not pickle, the
        # pool shut down) takes the place of its items: the results before it come first, as
        # with the builtin map. An item that does not pickle fails alone: the items before it
        # go as a chunk of their own (ProcessPoolExecutor.map drops them with the chunk), and
        # the error names it (or fn, if fn is what does not pickle).
        try:
            max_bytes = math.inf if chunksize else _stop_bytes(len(piece), out_per_item)
            return [(pool.submit(run_chunk, fn, piece, star, budget, max_bytes), piece)], True
        except Exception as exc:  # a BaseException (Ctrl-C) goes on at once
            found = first_unpicklable([fn, *piece]) if isinstance(exc, TaskPicklingError) else None
            if found is None:  # items that pickle alone but not together: the chunk's error
                return [(_failed(exc), piece)], False
            index, error = found
            before = send(piece[: index - 1])[0] if index > 1 else []
            return [*before, (_failed(error), [])], False

    try:
        while True:
            while not exhausted and len(in_flight) < window:
                chunk: list[Any] = []
                try:
                    if not cap and chunksize is None:
                        # The bytes per item bound every chunk from the first on: big
                        # items read 64 to a chunk made a read-ahead of 64 items per
                        # chunk in flight (512 MB of 1 MB items) before the first result.
                        chunk.extend(itertools.islice(items, MAP_SAMPLE_ITEMS))
                        if chunk:
                            cap = _max_chunk(chunk)
                            size = min(size, cap)
                    # keeps what came before an error of the input
                    chunk.extend(itertools.islice(items, max(0, size - len(chunk))))
                except Exception as exc:
                    if chunk:
                        in_flight.extend(send(chunk)[0])
                    in_flight.append((_failed(exc), []))
                    exhausted = True
                    break
                if not chunk:
                    exhausted = True
                    break
                entries, sent = send(chunk)
                in_flight.extend(entries)
                exhausted = not sent  # failed to go: nothing after it is read
            if not in_flight:
                return
            future, chunk = in_flight.popleft()
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                pickled, seconds, error = future.result(remaining)
            except BaseException:
                # Popped from in_flight, so the finally below does not see it: on a
                # timeout (or a Ctrl-C) its chunk may still be unclaimed, and an abandoned
                # map must not run it (the stdlib's gh-95166). A no-op if it failed.
                future.cancel()
                raise
            del future  # holds the pickled results: not again alongside the results
            nbytes = sum(map(len, pickled))
            results = _load(pickled)
            del pickled
            if error is not None:  # an item raised after these: they come first (_chunks)
                del chunk
                yield from _handed_out(results, nbytes)
                raise load_exception(error)
            if chunksize is None:
                sample = seconds / len(results)
                per_item = sample if per_item is None else 0.5 * per_item + 0.5 * sample
                # Results bound the chunks too: small inputs with big results (1 MB each)
                # made chunks of thousands of items, each returning one huge list.
                sample = nbytes / len(results)
                out_per_item = sample if out_per_item is None else 0.5 * out_per_item + 0.5 * sample
                window = limit
                size = _next_chunksize(per_item, len(results), _bytes_cap(cap, out_per_item))
            done = len(results)
            if done < len(chunk):  # stopped at its budget: the rest goes again, first
                rest = chunk[done:]
                pieces = [rest[i : i + size] for i in range(0, len(rest), size)]
                for piece in reversed(pieces):
                    in_flight.extendleft(reversed(send(piece)[0]))
            del chunk
            yield from _handed_out(results, nbytes)
    except GeneratorExit:
        # close(): by the caller, or by the garbage collector finalizing the generator,
        # which may run inside any allocation, also while this thread holds a lock that
        # future.cancel() takes (Coordinator.lock, the futures' module lock, a slot lock):
        # cancelling here would wait for this thread forever. The coordinator thread
        # cancels them instead, on its next pass (docs/design.md, Pool.map).
        pool._coordinator.cancel_later([future for future, _ in in_flight])
        in_flight.clear()
        raise
    finally:
        # The map's own error, timeout or Ctrl-C, raised in this frame (every lock taken
        # below it was released on the way out): cancel at once.
        for future, _ in in_flight:
            future.cancel()


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


def _next_chunksize(per_item: float, measured: int, cap: int) -> int:
    """Items in the next default chunk, from the mean ``per_item`` seconds and the items of the
    last measured chunk; at most ``cap`` (``_max_chunk``)."""
    target = int(MAP_TARGET_CHUNK_SECONDS / per_item) if per_item > 0 else cap
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
    a RuntimeError; a KeyboardInterrupt goes on: here it may be the caller's Ctrl-C."""
    try:  # user code runs here (__setstate__, __reduce__)
        if len(pieces) == 1:
            results: list[Any] = pickle.loads(pieces[0])
        else:
            results = [result for piece in pieces for result in pickle.loads(piece)]
    except (Exception, SystemExit) as exc:
        raise unpickling_failed(exc) from exc
    return results


def _failed(error: Exception) -> Future:
    """A future that failed with ``error``: an error in ``Pool.map``'s input order."""
    future = Future()
    future.set_exception(error)
    return future


def _max_chunk(chunk: list[Any]) -> int:
    """The largest default chunk for items like the first few of ``chunk``: at most
    ``MAP_MAX_CHUNK`` items and about ``MAP_CHUNK_BYTES`` pickled."""
    sample = chunk[:MAP_SAMPLE_ITEMS]
    try:
        nbytes = len(pickle.dumps(sample, PICKLE_PROTOCOL))
    except Exception:  # submit says why, with cloudpickle's help; size by count meanwhile
        return MAP_MAX_CHUNK
    return max(1, min(MAP_MAX_CHUNK, MAP_CHUNK_BYTES * len(sample) // max(1, nbytes)))
