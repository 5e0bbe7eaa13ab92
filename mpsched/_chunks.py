"""The tasks that run one chunk of ``Pool.map`` in a worker.

Module-level so they pickle by reference (and enter the pool's function table once).

A map over one iterable sends its items as they are (a flat list), not as 1-tuples of
arguments: pickling 1,024 small ints as 1-tuples took 84 us to dump and 99 us to load here,
as a flat list 20 us and 36 us, and the tuples cost another ~60 us to build (``zip``) in the
caller. Several iterables need the tuples (``star=True``). A chunk of a range input is a
sub-range (``_map``, "A range input"): it is read as the list is.

A chunk may stop early, at its time budget: it runs its items in runs of 1, 1, 2, 4, ... (each
run as long as all before it), reads the clock after each run, and stops once ``budget``
seconds have passed. So a chunk of items of one cost holds at most about twice its budget of
work (or one item), whatever its length: ``Pool.map`` sends the items it did not run again.
Items that turn slower partway through a chunk are not bounded so: the run in progress (up to
half the chunk) goes on unchecked. (A clock read per item would bound them, at a cost paid on
every item of every map; not done.)

A chunk pickles its own results (``dumps_result``) and returns their bytes: ``map``
reads their size (``len``) to bound the results of later chunks, and unpickles them itself. The
worker's own pickling of that tuple copies the bytes once more; it needs no size field of the
pool's result path for every task. Given a finite ``max_bytes`` (map does, while its results'
size is unknown or large), a chunk pickles each run's results as the run ends and stops, as at
its budget, once they hold ``max_bytes``: it returns one piece per run, and a chunk of 64 small
arguments with 1 MB results no longer returns 64 MB. Otherwise it pickles them once, at the end
(one piece: each pickling costs ~1 us, and a chunk of 4,096 tiny results would run 13 of them).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from itertools import islice
from typing import Any

from mpsched._children import announce_result
from mpsched._errors import TaskCancelled
from mpsched._protocol import dump_exception
from mpsched._serialize import dumps_result, first_unpicklable


def run_chunk(
    fn: Callable[..., Any], items: list[Any] | range, star: bool, budget: float, max_bytes: float
) -> tuple[list[bytes], float, bytes | None, int]:
    """``[fn(x) for x in items]`` (``fn(*x)`` if ``star``), or a prefix of it if ``budget``
    seconds ran out or its pickled results reached ``max_bytes``, pickled (``dumps_result``)
    in pieces, each a list, to be concatenated in order; the seconds it took (map sizes chunks
    by it); None, or the pickled error (``dump_exception``) of the item that raised after
    the ones in the prefix; and how many items ran (with no error, how many results the
    pieces hold: ``Pool.shutdown`` sends the rest of a chunk that stopped again, without
    unpickling its results; with one, the item that raised too: a map dropped unread sends
    the items after it again, ``MapRun._forget_ended``).

    An item that raises ends the chunk: the results before it are returned with its error, so
    that ``map`` yields them before it raises, as the builtin ``map`` does (the task failing
    would drop them, and how many items precede the error in the same chunk depends on default
    chunking, i.e. on timing); the first item too, so that a chunk's task fails only when it
    ran no item to its end or its worker died (a map dropped unread sends the rest of a chunk
    again only on a returned error: ``MapRun._forget_ended``). A result that does not pickle
    is that item's error in the same way. The chunk's own cancel (``TaskCancelled``) ends it
    as a task's does."""
    try:
        return _run(fn, items, star, budget, max_bytes)
    finally:
        announce_result()  # map waits for the chunks in order: no batching of this result


def _run(
    fn: Callable[..., Any], items: list[Any] | range, star: bool, budget: float, max_bytes: float
) -> tuple[list[bytes], float, bytes | None, int]:
    start = time.perf_counter()
    it = iter(items)
    pieces: list[bytes] = []
    nbytes = 0  # in pieces
    in_pieces = 0  # items whose results are in pieces
    results: list[Any] = []  # the results not pickled yet
    by_run = max_bytes != math.inf
    done = 0  # items run
    error = None
    raised = 0  # 1 once an item raised: it ran, and has no result
    append = results.append
    while True:
        try:
            # Runs of 1, 1, 2, 4, ..., each call in this frame: through the builtin map (~10
            # ns an item faster), a StopIteration that fn raised ended the items there, as
            # their end would: no error, that item's result missing, the later ones moved up
            # a place (a run without a budget never ended).
            if star:
                for args in islice(it, done or 1):
                    append(fn(*args))
            else:
                for item in islice(it, done or 1):
                    append(fn(item))
        except BaseException as exc:  # user code: as the worker reports a task's error
            if isinstance(exc, TaskCancelled):  # the chunk's own cancel: it ends cancelled
                raise
            error = dump_exception(exc)
            raised = 1
        seconds = time.perf_counter() - start
        done = in_pieces + len(results) + raised
        if by_run and error is None:
            piece, unpicklable = _dump_results(results)
            pieces.append(piece)
            nbytes += len(piece)
            in_pieces, results = done, []
            append = results.append
            error = unpicklable or error
        if error is not None or done == len(items) or seconds >= budget or nbytes >= max_bytes:
            if results:
                piece, unpicklable = _dump_results(results)
                pieces.append(piece)
                error = unpicklable or error  # it came before the item that raised
            return pieces, seconds, error, done


def _dump_results(results: list[Any]) -> tuple[bytes, bytes | None]:
    """``dumps_result(results)`` and None; if a result does not pickle, the results before it
    pickled and that one's pickling error (``dump_exception``), for ``map`` to raise after
    yielding them, as for an item that raised. One ``dumps_result`` per result, on that path
    only."""
    try:
        return dumps_result(results), None
    except Exception as whole:
        error: Exception = whole
    found = first_unpicklable(results, dumps_result)
    if found is None:
        raise error  # each pickles alone, not together (state shared between them): as before
    index, exc = found
    return dumps_result(results[:index]), dump_exception(exc)
