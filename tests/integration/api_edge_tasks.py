"""Task functions of test_api_edges.py; module-level so workers can import them."""

from __future__ import annotations

from typing import Any

import mpsched

from . import tasks


def context_fields() -> tuple[Any, int, bool]:
    """The running task's id, version and cancel flag, as ``current_task()`` reports them."""
    ctx = mpsched.current_task()
    return ctx.task_id, ctx.version, ctx.cancel_requested


def contexts_of_parent_and_child() -> tuple[tuple[Any, int, bool], tuple[Any, int, bool]]:
    """This task's context fields and those its child sees."""
    return context_fields(), mpsched.submit(context_fields).result()


def contexts_of_children(n: int) -> list[tuple[Any, int, bool]]:
    """The context fields ``n`` children see (all spawned before any is waited for: past the
    deque's capacity they run inline), then this task's own."""
    futures = [mpsched.submit(context_fields) for _ in range(n)]
    return [f.result() for f in futures] + [context_fields()]


def task_id_is_nan() -> bool:
    """Whether this run's id is a NaN (its copy in the worker is another NaN object)."""
    task_id = mpsched.current_task().task_id
    return isinstance(task_id, float) and task_id != task_id


def child_result_with_no_time_left() -> tuple[bool, int]:
    """Whether a child's ``result(timeout=0)`` raised ``concurrent.futures.TimeoutError`` (not
    done yet: the join checks its deadline before it helps), then the child's value."""
    from concurrent.futures import TimeoutError as FuturesTimeoutError

    future = mpsched.submit(abs, -7)
    try:
        future.result(timeout=0)
        timed_out = False
    except FuturesTimeoutError:
        timed_out = True
    return timed_out, future.result()


def join_a_stolen_child(started: str, gate: str, log: str, timeout: float) -> Any:
    """Spawn a child and wait until it runs (a peer stole it: this worker, blocked here, cannot
    run it), append ``j`` to ``log``, then join it with ``timeout``: with nothing else to run,
    the join sleeps until the test opens the child's gate."""
    child = mpsched.submit(tasks.started_then_gated, started, gate, 7)
    tasks.wait_started(started)
    with open(log, "ab") as out:
        out.write(b"j")
    return child.result(timeout=timeout)


def child_results_with_timeouts(timeouts: list[Any]) -> list[Any]:
    """A child's ``result(timeout=t)`` for each of ``timeouts``: its value, or the name of the
    error raised in the task."""
    out: list[Any] = []
    for timeout in timeouts:
        future = mpsched.submit(abs, -3)
        try:
            out.append(future.result(timeout=timeout))
        except Exception as exc:
            out.append(type(exc).__name__)
        future.result()  # joined in any case: its block is freed
    return out
