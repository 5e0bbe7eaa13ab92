"""The pool's first task under forkserver and spawn: the zygote waits for it to fork the
workers, and imports its function's module first, so that every worker inherits the module
(docs/design.md, "Start-up to the first result")."""

from __future__ import annotations

import importlib
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from mpsched import BrokenPoolError, Pool, _coordinator
from mpsched._protocol import Tag

from . import preload_refused, preload_tasks, tasks
from .conditions import CONDITION_TIMEOUT, start_every_worker, wait_until

DEFERRING = ["forkserver", "spawn"]


def _workers_up(pool: Pool) -> bool:
    return all(w.pid != 0 for w in pool.statistics().per_worker)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", DEFERRING)
def test_every_worker_inherits_the_first_tasks_module_from_the_zygote(start_method: str) -> None:
    with Pool(2, start_method=start_method) as pool:
        zygote = pool._zygote.pid
        # Nothing forked before the first task: the zygote waits for START.
        assert psutil.Process(zygote).children() == []
        seen = [pool.submit(preload_tasks.where_imported).result(timeout=20) for _ in range(50)]
        start_every_worker(pool)  # one task at a time needs one worker
        seen += pool.map(preload_tasks.where_imported, range(200), chunksize=1)
    assert {imported_in for imported_in, _ in seen} == {zygote}
    assert zygote not in {pid for _, pid in seen}


@pytest.mark.timeout(60)
def test_first_submissions_from_many_threads_at_once_start_the_workers_once() -> None:
    """First submissions racing from many threads: each task runs once, in a worker that
    inherited the module of the one whose START went first (the zygote imports only that)."""
    n = 8
    barrier = threading.Barrier(n)
    seen: list[tuple[int, int]] = []

    def first_call(pool: Pool) -> None:
        barrier.wait()
        seen.append(pool.submit(preload_tasks.where_imported).result(timeout=20))

    for _ in range(3):
        seen.clear()
        with Pool(2, start_method="forkserver") as pool:
            threads = [threading.Thread(target=first_call, args=(pool,)) for _ in range(n)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            zygote = pool._zygote.pid
        assert len(seen) == n
        assert {imported_in for imported_in, _ in seen} == {zygote}
        assert sorted(pool._coordinator.final_stats) == [0, 1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("first", ["schedule", "map"])
def test_a_schedule_or_a_map_as_the_first_call_starts_the_workers_too(first: str) -> None:
    with Pool(2, start_method="forkserver") as pool:
        zygote = pool._zygote.pid
        if first == "schedule":
            seen = [pool.schedule("t", 0.0, 0, preload_tasks.where_imported).result(timeout=20)]
        else:
            seen = list(pool.map(preload_tasks.where_imported, range(4)))
    assert {imported_in for imported_in, _ in seen} == {zygote}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["forkserver", "fork"])
def test_workers_start_with_the_pool_under_fork_the_first_or_with_an_initializer_all(
    start_method: str,
) -> None:
    """Under fork the zygote has the modules of the pool's process; with an initializer, a
    module imported before it ran could see another environment: neither waits, and with an
    initializer each worker imports the task's module itself. Under fork the first worker
    starts, the other one stays dormant (no work for it); with an initializer both start."""
    initializer = None if start_method == "fork" else tasks.remember
    with Pool(2, start_method=start_method, initializer=initializer, initargs=(1,)) as pool:
        wait_until(lambda: pool.statistics().per_worker[0].pid != 0, "a worker is up, no task")
        if initializer:
            wait_until(lambda: _workers_up(pool), "the workers are up, with no task")
        else:
            assert pool._coordinator.dormant == [1]
            assert pool.statistics().per_worker[1].pid == 0
        imported_in, pid = pool.submit(preload_tasks.where_imported).result(timeout=20)
        zygote = pool._zygote.pid
    assert imported_in != zygote
    assert imported_in == (pid if initializer else preload_tasks.IMPORTED_IN)


@pytest.mark.timeout(60)
def test_a_first_tasks_module_that_fails_to_import_in_the_zygote_fails_only_its_tasks() -> None:
    with Pool(2, start_method="forkserver") as pool:
        failed = pool.submit(preload_refused.one)
        with pytest.raises(ImportError, match="not in a pool's process"):
            failed.result(timeout=CONDITION_TIMEOUT)  # the worker's own import, as without
        assert pool.submit(tasks.add, 2, 3).result(timeout=CONDITION_TIMEOUT) == 5
    assert sorted(pool._coordinator.final_stats) == [0, 1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", DEFERRING)
def test_a_pool_shut_down_before_any_task_drains_its_workers(start_method: str) -> None:
    with Pool(2, start_method=start_method) as pool:
        pass
    assert sorted(pool._coordinator.final_stats) == [0, 1]


@pytest.mark.timeout(60)
def test_a_signal_handler_that_submits_inside_the_first_submissions_start_does_not_hang(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A SIGUSR1 raised while the first submission holds the zygote's send lock (as it encodes
    START): the handler's own first submission takes that lock again in the same thread. With
    a plain lock it waited for ever; it sends its START, and the zygote ignores the second."""
    real_encode = _coordinator.encode
    raised: list[bool] = []

    def encode(tag: int, *fields: Any) -> bytes:
        if tag == Tag.START and not raised:
            raised.append(True)
            signal.raise_signal(signal.SIGUSR1)  # the handler runs before this returns
        return real_encode(tag, *fields)

    from_handler: list[Any] = []
    with Pool(2, start_method="forkserver") as pool:
        previous = signal.signal(
            signal.SIGUSR1, lambda *_: from_handler.append(pool.submit(tasks.add, 1, 2))
        )
        monkeypatch.setattr(_coordinator, "encode", encode)
        try:
            first = pool.submit(preload_tasks.where_imported)
        finally:
            signal.signal(signal.SIGUSR1, previous)
        assert raised
        assert len(from_handler) == 1
        assert from_handler[0].result(timeout=CONDITION_TIMEOUT) == 3
        # The handler's START went first, with its own task's module: the zygote imported
        # that one, and ignored the second START (with preload_tasks) that came after it.
        imported_in, pid = first.result(timeout=CONDITION_TIMEOUT)
        assert imported_in == pid != pool._zygote.pid
    assert sorted(pool._coordinator.final_stats) == [0, 1]


CHILD_ONLY_IMPORT = """
import multiprocessing, os
if multiprocessing.parent_process() is not None:  # in a child process only, as for a C
    os._exit(70)                                  # extension that is not fork-safe

def double(x):
    return 2 * x
"""


@pytest.mark.timeout(60)
def test_a_first_tasks_module_whose_import_exits_in_the_zygote_breaks_the_pool_naming_it(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The zygote imports the first task's module before it forks a worker: an import that
    exits (or crashes) there broke the pool blaming the main module's import (found in
    review). The error now names the module."""
    name = "child_only_import"
    (tmp_path / f"{name}.py").write_text(CHILD_ONLY_IMPORT)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(name)  # fine in this process
    try:
        with Pool(2, start_method="forkserver") as pool:
            # At the call too: the submit sends START before its own task goes in, and the
            # zygote may die and the pool break in between (a fresh-clone CI run).
            with pytest.raises(BrokenPoolError, match=f"first task's module.*'{name}'"):
                pool.submit(module.double, 1).result(timeout=CONDITION_TIMEOUT)
            with pytest.raises(BrokenPoolError):  # (at the call or on its future)
                pool.submit(len, [1, 2]).result(timeout=CONDITION_TIMEOUT)
    finally:
        sys.modules.pop(name, None)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_a_first_task_due_later_has_its_module_imported_by_no_one_before_it_is_due(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, start_method: str
) -> None:
    """The zygote imported the module of the pool's first submission whatever its due time: a
    task due in an hour held up every task due before it for its import, and an import that
    exits in a child broke the pool for them (a hunt). A task due later leaves the zygote's
    import out; its workers import its module when it comes."""
    name = "child_only_import_later"
    (tmp_path / f"{name}.py").write_text(CHILD_ONLY_IMPORT)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(name)  # fine in this process
    try:
        with Pool(2, start_method=start_method) as pool:
            hourly = pool.schedule("hourly", time.monotonic() + 3600, 0, module.double, 1)
            assert pool.submit(len, [1, 2]).result(timeout=CONDITION_TIMEOUT) == 2
            assert pool.cancel("hourly")
            assert hourly.cancelled()
    finally:
        sys.modules.pop(name, None)
