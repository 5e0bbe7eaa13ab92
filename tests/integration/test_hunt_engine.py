"""Edge cases of Pool.map, nested tasks and crashes (bug hunt of the engine)."""

from __future__ import annotations

import functools
import os

import pytest

from mpsched import Pool

from . import hunt_tasks as ht
from . import tasks


@pytest.fixture
def gates(tmp_path: object) -> tuple[str, str, str]:
    """A FIFO the blocker announces itself on, the FIFO gate it waits at, and a log file."""
    started = os.path.join(str(tmp_path), "started")
    gate = os.path.join(str(tmp_path), "gate")
    log = os.path.join(str(tmp_path), "log")
    os.mkfifo(started)
    os.mkfifo(gate)
    open(log, "wb").close()
    return started, gate, log


# ---------------------------------------------------------------- map
@pytest.mark.timeout(60)
def test_map_timeout_cancels_the_chunk_it_timed_out_on(gates: tuple[str, str, str]) -> None:
    """A map whose result times out must cancel every chunk not yet claimed, including the
    one it was waiting for (the stdlib fixed the same leak in gh-95166)."""
    started, gate, log = gates
    with Pool(1) as pool:
        blocker = pool.submit(tasks.started_then_gated, started, gate, "blocker")
        tasks.wait_started(started)  # the only worker is busy: every chunk stays queued
        results = pool.map(
            functools.partial(ht.record_ident, log), [1, 2, 3], chunksize=1, timeout=0.05
        )
        with pytest.raises(TimeoutError):
            next(results)
        tasks.open_gate(gate)
        assert blocker.result(timeout=20) == "blocker"
    assert tasks.read_log(log) == []  # no chunk of the abandoned map ran


def _force_down(pool: Pool) -> None:
    """End a pool that may be stuck: shutdown without waiting, then kill its zygote (its
    workers die with it) if the drain does not end."""
    pool.shutdown(wait=False, cancel_futures=True)
    if not pool.await_termination(10):
        pool._zygote.kill()
        assert pool.await_termination(20)


# ---------------------------------------------------------------- nested tasks
@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [1, 2])
def test_a_chain_of_nested_joins_deeper_than_the_run_stack_finishes(workers: int) -> None:
    """Each task joins its only child; join-helping runs the child inside the parent, so the
    run stack grows by one per level. Deeper than MAX_NESTING (64), the worker stops helping
    and sleeps, while the child it waits for sits in its own deque."""
    pool = Pool(workers)
    try:
        assert pool.submit(ht.chain, 200).result(timeout=20) == 200
    finally:
        _force_down(pool)
