"""Model tests of nested tasks (fork-join with join-helping) and of ``Pool.map``, each against a
sequential reference run in the test process.

Trees: hypothesis draws trees of tasks (``nested_tasks.run_node``: depth up to 6, fan-out up
to 4, at most 60 nodes a tree); each node spawns its children with ``mpsched.submit``, joins
some of them in a drawn order (``result()``, ``result()`` with the error caught, or
``exception()``), never joins the others (a dropped ``ChildFuture``: the child still runs, its
outcome is discarded: ``ChildFuture``'s docstring), and may raise. One to three trees are
submitted at once to a pool of one worker (join-helping alone must finish them) or two. The
same code run sequentially (each child at its spawn) is the reference: every tree's result or
error must equal it, every node must run exactly once (never-joined subtrees too, possibly after
their tree's root returned), and the pool must be left quiet and consistent (no live child, no
queued task, ``executed`` counted once per node, a follow-up submit works).

Map: hypothesis draws one or two iterables of unequal lengths (0 to 3,000 items), positions
where the function raises, a ``chunksize`` (None or 1 to 500) and where the caller stops
reading (never, or after some results: ``close()`` or dropping the iterator). Results must come
in input order and equal the builtin ``map``'s, the first error must come at its position after
every result before it, the input must be read lazily (``Pool.map``'s docstring: "at most a few
chunks per worker ahead of the results", i.e. ``MAP_PREFETCH_PER_WORKER`` chunks per worker),
every item must run at most once (exactly once if it was yielded, or if the map ran to its
end), nothing that was not read from the input may run, and an abandoned map must leave the
pool quiet (its unclaimed chunks cancelled) and working.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mpsched import Pool, _map
from tests.integration.conditions import wait_until
from tests.stress import nested_tasks as nt

pytestmark = pytest.mark.slow

CONDITION_TIMEOUT = 10.0  # s a polled condition or a result may take before the test fails
# Each example runs real tasks on a shared pool: no per-example deadline; big examples are fine.
MODEL_SETTINGS = settings(
    deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
MAX_DEPTH = 6
MAX_FANOUT = 4
MAX_NODES = 60
MODES = ("result", "catch", "exception")
# None first: hypothesis shrinks towards it (a node that returns).
FAILS = (None, None, None, "ValueError", "KeyError", "TreeError")


def quiet(pool: Pool) -> bool:
    """Nothing queued, in flight or waiting to be cancelled, and no live child (read under the
    coordinator's lock, which every hand-over of a top-level task holds)."""
    coordinator = pool._coordinator
    with coordinator.lock:
        busy = coordinator.by_handle or coordinator.ready or coordinator.deferred_cancels
    if busy or pool._views.header.live_children():
        return False
    stats = pool.statistics()
    slab = pool._views.slab
    return (
        stats.pending == 0
        and all(w.inbox_depth == 0 and w.deque_depth == 0 for w in stats.per_worker)
        and slab.free_count() == slab.capacity  # no block left to a child or a chunk
    )


def executed(pool: Pool) -> int:
    return sum(w.executed for w in pool.statistics().per_worker)


def check_healthy(pool: Pool, executed_before: int, runs: int, cancels: bool) -> None:
    """The pool is quiet, counted ``runs`` more executions (plus the follow-up submit's) and
    still runs a task; without cancels, every submitted task completed."""
    wait_until(lambda: quiet(pool), "the pool is quiet")
    assert pool.submit(nt.echo, "after").result(CONDITION_TIMEOUT) == "after"
    wait_until(lambda: executed(pool) >= executed_before + runs + 1, "executed counts every run")
    assert executed(pool) == executed_before + runs + 1
    stats = pool.statistics()
    assert stats.pending == stats.scheduled == stats.crashes == 0
    if not cancels:  # a cancelled task is submitted, never completed
        assert stats.submitted == stats.completed


# ---------------------------------------------------------------- trees
@st.composite
def trees(draw: Any, prefix: str) -> nt.Node:
    count = 0

    def node(depth: int) -> nt.Node:
        nonlocal count
        node_id = f"{prefix}.{count}"
        count += 1
        children = []
        fanout = draw(st.integers(0, MAX_FANOUT)) if depth < MAX_DEPTH else 0
        for _ in range(fanout):
            if count >= MAX_NODES:
                break
            children.append(node(depth + 1))
        order = draw(st.permutations(range(len(children))))
        joined = draw(st.integers(0, len(children)))
        modes = draw(st.lists(st.sampled_from(MODES), min_size=joined, max_size=joined))
        joins = tuple(zip(order[:joined], modes, strict=True))
        return node_id, tuple(children), joins, draw(st.sampled_from(FAILS))

    return node(0)


def node_ids(node: nt.Node) -> list[str]:
    return [node[0], *(i for child in node[1] for i in node_ids(child))]


def outcome(fn: Any) -> tuple[Any, ...]:
    try:
        return ("value", fn())
    except Exception as exc:
        return ("error", nt.describe(exc))


def future_outcome(future: Any) -> tuple[Any, ...]:
    error = future.exception(CONDITION_TIMEOUT)
    return ("value", future.result(0)) if error is None else ("error", nt.describe(error))


def run_trees(pool: Pool, specs: list[nt.Node]) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="mpsched-nested-"))
    try:
        log, reference_log = str(tmp / "log"), str(tmp / "reference")
        before = executed(pool)
        futures = [pool.submit(nt.run_node, spec, log) for spec in specs]  # all at once
        expected = [outcome(functools.partial(nt.run_node, s, reference_log, True)) for s in specs]
        assert [future_outcome(f) for f in futures] == expected
        ids = [i for spec in specs for i in node_ids(spec)]
        assert Counter(nt.read_log(reference_log)) == Counter(ids)  # the reference's own check
        # Never-joined children may still run after their root returned.
        wait_until(lambda: len(nt.read_log(log)) >= len(ids), "every node ran")
        wait_until(lambda: quiet(pool), "the pool is quiet")
        assert Counter(nt.read_log(log)) == Counter(ids), "a node did not run exactly once"
        check_healthy(pool, before, len(ids), cancels=False)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@st.composite
def tree_lists(draw: Any) -> list[nt.Node]:
    n = draw(st.integers(1, 3))
    return [draw(trees(str(k))) for k in range(n)]


@pytest.mark.timeout(180)  # 76 s in one of ten loaded runs of the suite
def test_random_task_trees_match_a_sequential_run() -> None:
    with Pool(1) as pool1, Pool(2) as pool2:
        pools = {1: pool1, 2: pool2}

        @settings(MODEL_SETTINGS, max_examples=90)
        @given(workers=st.sampled_from([1, 2]), specs=tree_lists())
        def check(workers: int, specs: list[nt.Node]) -> None:
            run_trees(pools[workers], specs)

        check()


# ---------------------------------------------------------------- map
class Counted:
    """An iterable over ``range(n)`` that counts how many items were taken from it."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.taken = 0

    def __iter__(self) -> Iterator[int]:
        for x in range(self.n):
            self.taken += 1
            yield x


def run_map(
    pool: Pool,
    workers: int,
    lengths: list[int],
    bad: frozenset[int],
    chunksize: int | None,
    stop: int | None,
    close: bool,
) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="mpsched-map-"))
    try:
        log = str(tmp / "log")
        before = executed(pool)
        n = min(lengths)
        reference_fn = functools.partial(nt.map_item, None, bad)
        expected: list[Any] = []
        expected_error = None
        try:
            expected.extend(map(reference_fn, *(range(k) for k in lengths)))
        except Exception as exc:
            expected_error = nt.describe(exc)

        inputs = [Counted(k) for k in lengths]
        results = pool.map(functools.partial(nt.map_item, log, bad), *inputs, chunksize=chunksize)
        ahead = _map.MAP_PREFETCH_PER_WORKER * workers * (chunksize or _map.MAP_MAX_CHUNK)
        # zip takes one more item from the iterables before the one that ends first
        extra = 1 if len(lengths) > 1 else 0
        # The work starts at the call: the first window is read and sent (of default chunks,
        # one a worker while nothing was measured), and no more.
        if chunksize is None:
            first_window = workers * _map.MAP_FIRST_CHUNK
        else:
            first_window = _map.MAP_PREFETCH_PER_WORKER * workers * chunksize
        assert max(i.taken for i in inputs) <= first_window + extra, "read ahead at the call"
        got: list[Any] = []
        error = None
        while stop is None or len(got) < stop:
            try:
                got.append(next(results))
            except StopIteration:
                break
            except Exception as exc:
                error = nt.describe(exc)
                break
            taken = max(i.taken for i in inputs)
            assert taken <= len(got) + ahead + extra, (len(got), taken)
            if chunksize is None and len(got) == 1:  # nothing was measured yet: first chunks
                first = _map.MAP_PREFETCH_PER_WORKER * workers * _map.MAP_FIRST_CHUNK
                assert taken <= first + extra, taken
        assert got == expected[: len(got)]
        finished = stop is None or len(got) < stop
        if finished:
            assert got == expected
            assert error == expected_error
            if error is not None:
                with pytest.raises(StopIteration):
                    next(results)
        if close:
            results.close()
        del results  # dropped: the generator's finalizer abandons the map (if not closed)

        wait_until(lambda: quiet(pool), "the pool is quiet")
        ran = Counter(nt.read_log(log))
        taken = min(i.taken for i in inputs)
        assert all(count == 1 for count in ran.values()), "an item ran twice"
        assert set(ran) <= set(range(min(taken, n))), "an item that was not read ran"
        # Everything yielded ran, and so did the item that raised.
        assert set(range(len(got) + (error is not None))) <= set(ran)
        if finished and error is None:
            assert set(ran) == set(range(n))
        # How many chunks ran is up to the chunking (and, for an abandoned map, the race of
        # its cancel against the claims): what the quiet pool counts.
        check_healthy(pool, before, executed(pool) - before, cancels=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.timeout(120)
def test_map_matches_the_builtin_map() -> None:
    with Pool(1) as pool1, Pool(2) as pool2:
        pools = {1: pool1, 2: pool2}

        @settings(MODEL_SETTINGS, max_examples=300)
        @given(
            workers=st.sampled_from([1, 2]),
            lengths=st.lists(st.integers(0, 3000), min_size=1, max_size=2),
            bad=st.frozensets(st.integers(0, 3000), max_size=3),
            chunksize=st.none() | st.integers(1, 500),
            stop=st.none() | st.integers(0, 3000),
            close=st.booleans(),
        )
        def check(
            workers: int,
            lengths: list[int],
            bad: frozenset[int],
            chunksize: int | None,
            stop: int | None,
            close: bool,
        ) -> None:
            run_map(pools[workers], workers, lengths, bad, chunksize, stop, close)

        check()


# ---------------------------------------------------------------- regressions found by the model
@pytest.mark.timeout(60)
def test_a_child_dropped_by_a_parent_that_reraises_a_childs_error_frees_its_block() -> None:
    """Found by the model test (a slab block stayed taken after every tree had ended): a node
    joined a failing child with ``result()``, which re-raised it, and never joined a sibling.
    The raised exception was the object the child's future keeps (``_error``), so its
    traceback (the node's frame, holding every child future) and the future formed a
    reference cycle: the sibling's future was not dropped when the node ended but only at
    the worker's next cyclic garbage collection, and until then its finished block stayed
    taken (nothing else frees a child's block while its future lives).

    One worker, so that the sibling (pushed last, popped first by the join's help) is done
    before the root ends; nothing runs afterwards that could trigger a collection."""
    spec = (
        "root",
        (("fails", (), (), "ValueError"), ("dropped", (), (), None)),
        ((0, "result"),),
        None,
    )
    tmp = Path(tempfile.mkdtemp(prefix="mpsched-nested-"))
    pool = Pool(1)
    try:
        error = pool.submit(nt.run_node, spec, str(tmp / "log")).exception(CONDITION_TIMEOUT)
        assert error is not None
        assert nt.describe(error) == ("ValueError", ("fails",))
        slab = pool._views.slab
        wait_until(lambda: slab.free_count() == slab.capacity, "the dropped child's block is free")
        assert Counter(nt.read_log(str(tmp / "log"))) == Counter(["root", "fails", "dropped"])
    finally:
        pool.shutdown(cancel_futures=True)
        shutil.rmtree(tmp, ignore_errors=True)
