"""Task bodies for the timed-task tests (module level: workers import them by reference)."""

from __future__ import annotations

import os
import time
from typing import Any

import mpsched

from .tasks import gate, spin


def stamp(tag: Any) -> tuple[Any, float]:
    """Return ``tag`` and the monotonic time this run started (shared by all processes)."""
    return tag, time.monotonic()


def log(path: str, tag: Any) -> float:
    """Append ``repr(tag)`` and the start time to the log at ``path`` (one O_APPEND write);
    returns the start."""
    start = time.monotonic()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{tag!r}\t{start!r}\n".encode())
    finally:
        os.close(fd)
    return start


def _lines(path: str) -> list[str]:
    try:
        with open(path) as f:
            # A line without its newline is being written (a read races the writer's one
            # write: seen as a tab-less fragment in test_timed_races), or its writer was killed
            # in mid-write: not a record yet, or never.
            return [line[:-1] for line in f if line.endswith("\n") and line.strip()]
    except FileNotFoundError:
        return []


def _read(path: str) -> list[tuple[Any, float]]:
    import ast

    records = []
    for line in _lines(path):
        fields = line.split("\t")
        if len(fields) != 2:  # say what it holds: only a poll (count_records) may see this
            raise AssertionError(f"a malformed line in the run log {path}: {line!r}")
        records.append((ast.literal_eval(fields[0]), float(fields[1])))
    return records


def count_records(path: str) -> int:
    """The complete records in the log at ``path``, for a test that polls it while workers
    write to it and get killed: a line that is not a record (yet) is not counted. (Twice in
    test_timed_races, such a poll read a line with its newline and no tab, never reproduced
    since; the test's final, strict read (``read_tags``) names any such line.)"""
    return sum(line.count("\t") == 1 for line in _lines(path))


def read_tags(path: str) -> list[Any]:
    return [tag for tag, _ in _read(path)]


def read_starts(path: str) -> list[float]:
    return [start for _, start in _read(path)]


def announce(started: str) -> None:
    with open(started, "wb") as fifo:
        fifo.write(b"s")


def wait_for_cancel(started: str, then_return: bool, timed: bool = False) -> str:
    """Signal that the task runs, poll the cancel flag, then acknowledge or ignore it.

    The flag must be clear at the start, unless the task runs under a timeout (``timed``):
    that timeout's cancel may come before a stalled worker gets here. Announced first either
    way, so that the test waiting for it never hangs."""
    ctx = mpsched.current_task()
    flagged_at_start = ctx.cancel_requested
    announce(started)
    assert timed or not flagged_at_start
    while not ctx.cancel_requested:
        pass
    if then_return:
        return "finished anyway"
    ctx.raise_if_cancelled()
    return "unreachable"


def context_fields() -> tuple[Any, int, int, bool]:
    ctx = mpsched.current_task()
    return ctx.task_id, ctx.version, ctx.worker_id, ctx.cancel_requested


def announce_then_gate(started: str, path: str) -> int:
    announce(started)
    gate(path)
    return os.getpid()


def spin_then_log(path: str, tag: Any, seconds: float) -> float:
    spin(seconds)
    return log(path, tag)


def recurring_run(path: str, long_first: float, last: int) -> float:
    """A recurring task: logs (version, start); the first run is long, run ``last`` fails (so
    the recurrence ends with that error and the test has its end without a sleep)."""
    ctx = mpsched.current_task()
    start = log(path, (ctx.version, time.monotonic()))
    if ctx.version == 1:
        spin(long_first)
    if ctx.version >= last:
        raise LookupError(f"run {ctx.version} ends the recurrence")
    return start


def log_version(path: str) -> float:
    """Log the running version of the recurring task (``log``); returns its start."""
    return log(path, mpsched.current_task().version)


def logged_span(path: str, seconds: float) -> int:
    """Log ``("start", id, version)``, busy-wait ``seconds``, log ``("end", id, version)`` (two
    O_APPEND writes, so two versions of one id that overlap would interleave in the log);
    returns the version."""
    ctx = mpsched.current_task()
    log(path, ("start", ctx.task_id, ctx.version))
    spin(seconds)
    log(path, ("end", ctx.task_id, ctx.version))
    return ctx.version


def log_pid_then_gate(path: str, tag: Any, gate_path: str) -> int:
    """Log ``(tag, pid)`` (so the test knows which worker to kill, and how many times this
    ran), then wait at the gate; returns the pid."""
    log(path, (tag, os.getpid()))
    gate(gate_path)
    return os.getpid()


def log_pid_until_asked_then_gate(path: str, gate_path: str) -> int:
    """Log ``("run", pid)``, poll the cancel flag, log ``("asked", pid)`` once it is set (and
    ignore it), then wait at the gate; returns the pid."""
    ctx = mpsched.current_task()
    log(path, ("run", os.getpid()))
    while not ctx.cancel_requested:
        pass
    log(path, ("asked", os.getpid()))
    gate(gate_path)
    return os.getpid()


def spin_checking_cancel(seconds: float, acknowledge: bool) -> str:
    """Busy-wait up to ``seconds``; if a cancel is asked for meanwhile, acknowledge it (raise
    TaskCancelled) or return at once."""
    ctx = mpsched.current_task()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        if ctx.cancel_requested:
            if acknowledge:
                ctx.raise_if_cancelled()
            return "asked"
    return "done"


def gated_failing_initializer(gate_path: str) -> None:
    """A pool initializer that fails once the test opens the gate (so that the test decides
    what was scheduled before the pool broke)."""
    gate(gate_path)
    raise OSError("the initializer failed")


def span_or_raise(path: str, seconds: float, fail_one_in: int) -> int:
    """Log ``("start", id, version, pid)``, busy-wait ``seconds``, log ``("end", id, version,
    pid)``; then raise (ending its recurrence) on versions divisible by ``fail_one_in`` (0:
    never). The pid tells a run killed on purpose (its worker is gone) from one that overlaps."""
    ctx = mpsched.current_task()
    log(path, ("start", ctx.task_id, ctx.version, os.getpid()))
    spin(seconds)
    log(path, ("end", ctx.task_id, ctx.version, os.getpid()))
    if fail_one_in and ctx.version % fail_one_in == 0:
        raise LookupError(f"run {ctx.version} fails")
    return ctx.version


def exit_when_asked(started: str) -> None:
    """Announce, poll the cancel flag, and end the worker process (os._exit) once it is set:
    a worker that dies on its own just as the pool kills it."""
    ctx = mpsched.current_task()
    announce(started)
    while not ctx.cancel_requested:
        pass
    os._exit(3)


def gate_replacements(marker: str, gate_path: str) -> None:
    """A pool initializer: a worker started once ``marker`` exists (the test creates it before
    it kills the first worker) waits at the gate before it takes a task, so that what is
    dispatched to the replacement stays unclaimed in its inbox until the test opens it."""
    if os.path.exists(marker):
        gate(gate_path)


def gated_cancel_flag(gate_path: str) -> bool:
    """Wait at the gate, then return whether this task was asked to cancel."""
    gate(gate_path)
    return mpsched.current_task().cancel_requested


# Contexts kept past their runs, with their runs' blocks, in the worker process
# (test_a_context_kept_past_its_run_keeps_its_runs_flag).
_KEPT: list[tuple[mpsched.TaskContext, int]] = []


def keep_context(started: str, wait: bool) -> None:
    """Keep this run's context past the run; with ``wait``, announce, wait for a cancel
    request and acknowledge it (the future ends cancelled)."""
    ctx = mpsched.current_task()
    _KEPT.append((ctx, int(ctx._entry[0])))
    if wait:
        announce(started)
        while not ctx.cancel_requested:
            pass
        ctx.raise_if_cancelled()


def kept_flag(started: str | None) -> tuple[bool, bool, bool]:
    """Whether this run has the last kept context's block, and that context's flag; with
    ``started``, announce first and wait for this run's own cancel request (then return rather
    than acknowledge it). The third field is this run's own flag."""
    ctx = mpsched.current_task()
    if started is not None:
        announce(started)
        while not ctx.cancel_requested:
            pass
    kept, block = _KEPT[-1]
    return int(ctx._entry[0]) == block, kept.cancel_requested, ctx.cancel_requested


def die_first_then_spin(marker: str, first: float, retry: float) -> str:
    """The first run (no file ``marker`` yet) makes ``marker``, busy-waits ``first`` seconds
    and kills its worker (``os._exit``); a retry busy-waits ``retry`` seconds and returns."""
    if not os.path.exists(marker):
        open(marker, "w").close()
        spin(first)
        os._exit(3)
    spin(retry)
    return "retried"


def gate_the_first_run_then_log(path: str, started: str, gate_path: str) -> float:
    """A recurring task: run 1 announces itself on ``started`` and waits at the gate; every
    run then logs its version (``log_version``)."""
    if mpsched.current_task().version == 1:
        announce(started)
        gate(gate_path)
    return log_version(path)
