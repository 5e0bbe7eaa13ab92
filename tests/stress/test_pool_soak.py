"""Exactly-once under stealing: tens of thousands of tasks, nested ones included."""

from __future__ import annotations

import collections
import os

import pytest

from mpsched import Pool
from tests.integration import tasks

SCALE = float(os.environ.get("MPSCHED_STRESS_SCALE", "1"))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", [2, 3])
def test_every_task_runs_exactly_once_with_stealing(tmp_path: object, workers: int) -> None:
    path = os.path.join(str(tmp_path), "log")
    open(path, "wb").close()
    parents = int(10_000 * SCALE)
    children = 4
    with Pool(workers) as pool:
        nested = [
            pool.submit(tasks.record_with_children, path, i, children)
            for i in range(1, parents + 1)
        ]
        flat = [pool.submit(tasks.record, path, parents + i) for i in range(1, parents + 1)]
        for f in nested:
            f.result()
        for f in flat:
            f.result()
        stats = pool.statistics()
    counts = collections.Counter(tasks.read_log(path))
    expected = set(range(1, 2 * parents + 1))
    expected |= {-(i * 100 + k) - 1 for i in range(1, parents + 1) for k in range(children)}
    assert set(counts) == expected
    assert max(counts.values()) == 1, [k for k, v in counts.items() if v > 1][:10]
    assert len(counts) >= 50_000 * SCALE
    assert stats.steals > 0, "the workload must exercise stealing"
    assert sum(w.executed for w in stats.per_worker) >= 2 * parents
