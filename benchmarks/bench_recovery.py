"""Recovery from a worker's SIGKILL: how long until the pool runs work again.

Usage, from the repository root::

    PYTHONPATH=. python -m benchmarks.bench_recovery               # 7 repeats (~1 min)
    PYTHONPATH=. python -m benchmarks.bench_recovery --repeats 9 --json /tmp/recovery.json -v

One sample, per implementation: a pool with ONE worker (so the task after the crash must run in
the replacement) runs a task that writes its worker's pid into a FIFO and then blocks on another
FIFO that nobody opens. The benchmark reads the pid, takes ``t0 = time.monotonic()`` and
SIGKILLs the worker, then submits a probe, the builtin ``time.monotonic`` itself (no import in
the new worker: only the recovery is timed), which returns the time it started at. Figures, from
``t0`` (``CLOCK_MONOTONIC`` is one clock for every process on Linux):

* ``recovery`` = probe start - t0: death noticed, a replacement started, the probe claimed;
* ``crash reported`` = when the killed task's future failed (its done-callback ran).

mpsched keeps its pool: the crashed future fails with ``WorkerCrashedError`` and the pool forks a
replacement from its zygote. ``ProcessPoolExecutor`` breaks: the future fails with
``BrokenProcessPool``, the executor is unusable, and the caller must create a NEW one; its
``recovery`` includes that (time until ``BrokenProcessPool`` is raised, then a new executor
runs the probe). loky's ``get_reusable_executor`` is the same, except that the next call to
``get_reusable_executor`` makes the new executor itself (its workers start through loky's own
fork+exec start method).

Rows run interleaved per repeat (``_common.run_interleaved``) with the idle gate and CPU audit;
targets: mpsched median recovery < 300 ms with ``fork`` and < 1 s with ``forkserver``. A wrong
outcome (the task does not fail, or fails with another error; the probe does not run in a new
process) raises ``BenchmarkError``; a missed target prints FAIL.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import _common as common
from benchmarks import _recovery_tasks as rt
from benchmarks._common import Impl, Measurement, TargetResult, Workload

START_METHODS = ("fork", "forkserver")
MIN_REPEATS = 5  # medians of at least 5 samples
DEFAULT_REPEATS = 7
TASK_TIMEOUT_S = 60.0  # s; a future that does not end within this is a hang: the run fails
IDLE_MAX_WAIT_S = 5.0  # s; one idle gate gives up (and marks the repeat noisy) after this
IDLE_BUDGET_S = 30.0  # s; all gates of the run together wait at most this
WATCHDOG_S = 900  # s; the whole run is killed (stacks dumped) after this

# Targets, as fixed for the project's crash-safety issue.
RECOVERY_MAX_S = {"fork": 0.3, "forkserver": 1.0}  # s; mpsched median recovery, per start method

NEEDS_POOL = ("Pool", "WorkerCrashedError")
LOKY = "loky get_reusable_executor"


def mpsched_name(method: str) -> str:
    return f"mpsched Pool ({method})"


def ppe_name(method: str) -> str:
    return f"ProcessPoolExecutor ({method})"


# --------------------------------------------------------------------------- one sample


@dataclass
class Victim:
    """The FIFOs of one sample's blocking task and the time its future failed."""

    started: str
    gate: str
    failed_at: float | None = None

    @classmethod
    def make(cls, where: str) -> Victim:
        started, gate = os.path.join(where, "started"), os.path.join(where, "gate")
        os.mkfifo(started)
        os.mkfifo(gate)
        return cls(started, gate)

    def watch(self, future: Future[Any]) -> None:
        """Record when ``future`` ends (its done-callback runs in the pool's own thread)."""

        def done(_: Future[Any]) -> None:
            self.failed_at = time.monotonic()

        future.add_done_callback(done)

    def read_pid(self) -> int:
        """Block until the task wrote its worker's pid."""
        with open(self.started, "rb") as fifo:
            return int(fifo.read())


def measure(
    submit_victim: Callable[[Victim], Future[Any]],
    after_kill: Callable[[Future[Any]], float],
    label: str,
) -> Measurement:
    """One sample: start the blocking task, kill its worker at t0, let ``after_kill`` get the
    probe's start time (it also checks the victim's error), return the figures from t0."""
    with tempfile.TemporaryDirectory(prefix="mpsched-recovery-") as where:
        victim = Victim.make(where)
        future = submit_victim(victim)
        victim.watch(future)
        pid = victim.read_pid()
        with common.CpuAudit() as audit:
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            probe_started = after_kill(future)
    common.verify(victim.failed_at is not None, f"{label}: the killed task's future never ended")
    assert victim.failed_at is not None
    common.verify(probe_started > t0, f"{label}: the probe started before the kill")
    return Measurement(
        probe_started - t0, audit.result, {"crash_reported_s": victim.failed_at - t0}
    )


def mpsched_sample(method: str) -> Measurement:
    """mpsched: the same pool goes on; the probe runs in the replacement worker."""
    import mpsched

    label = mpsched_name(method)
    with mpsched.Pool(workers=1, start_method=method) as pool:
        first = pool.submit(os.getpid).result(TASK_TIMEOUT_S)

        def after_kill(future: Future[Any]) -> float:
            probe = pool.submit(time.monotonic)
            started: float = probe.result(TASK_TIMEOUT_S)
            error = future.exception(TASK_TIMEOUT_S)
            common.verify(
                isinstance(error, mpsched.WorkerCrashedError),
                f"{label}: the killed task failed with {error!r}",
            )
            return started

        sample = measure(
            lambda v: pool.submit(rt.report_pid_then_block, v.started, v.gate), after_kill, label
        )
        replacement = pool.submit(os.getpid).result(TASK_TIMEOUT_S)
        common.verify(replacement != first, f"{label}: no new worker after the kill")
    return sample


def ppe_sample(method: str) -> Measurement:
    """ProcessPoolExecutor: the executor breaks; a new one runs the probe."""
    label = ppe_name(method)
    context = multiprocessing.get_context(method)
    broken = ProcessPoolExecutor(max_workers=1, mp_context=context)
    fresh: ProcessPoolExecutor | None = None
    try:
        broken.submit(os.getpid).result(TASK_TIMEOUT_S)  # the worker exists before the sample

        def after_kill(future: Future[Any]) -> float:
            nonlocal fresh
            error = future.exception(TASK_TIMEOUT_S)
            common.verify(
                isinstance(error, BrokenProcessPool), f"{label}: the killed task: {error!r}"
            )
            fresh = ProcessPoolExecutor(max_workers=1, mp_context=context)
            started: float = fresh.submit(time.monotonic).result(TASK_TIMEOUT_S)
            return started

        sample = measure(
            lambda v: broken.submit(rt.report_pid_then_block, v.started, v.gate), after_kill, label
        )
    finally:
        broken.shutdown(wait=True)
        if fresh is not None:
            fresh.shutdown(wait=True)
    return sample


def loky_sample() -> Measurement:
    """loky: the reusable executor breaks; the next ``get_reusable_executor`` makes a new one."""
    import loky
    from loky.process_executor import TerminatedWorkerError

    executor = loky.get_reusable_executor(max_workers=1)
    try:
        executor.submit(os.getpid).result(TASK_TIMEOUT_S)

        def after_kill(future: Future[Any]) -> float:
            nonlocal executor
            error = future.exception(TASK_TIMEOUT_S)
            common.verify(
                isinstance(error, TerminatedWorkerError), f"{LOKY}: the killed task: {error!r}"
            )
            executor = loky.get_reusable_executor(max_workers=1)
            started: float = executor.submit(time.monotonic).result(TASK_TIMEOUT_S)
            return started

        return measure(
            lambda v: executor.submit(rt.report_pid_then_block, v.started, v.gate),
            after_kill,
            LOKY,
        )
    finally:
        executor.shutdown(wait=True)


# --------------------------------------------------------------------------- the run


def impls() -> list[Impl]:
    out = [Impl(mpsched_name(m), lambda m=m: mpsched_sample(m), NEEDS_POOL) for m in START_METHODS]
    out += [
        Impl(ppe_name(m), lambda m=m: ppe_sample(m), baseline=mpsched_name(m))
        for m in START_METHODS
    ]
    if importlib_available("loky"):
        out.append(Impl(LOKY, loky_sample, baseline=mpsched_name("forkserver")))
    return out


def importlib_available(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


class Gate:
    """The idle gate, within a waiting budget for the whole run (as in bench_pool)."""

    def __init__(self) -> None:
        self.waited_s = 0.0

    def __call__(self) -> common.GateResult:
        left = max(0.0, IDLE_BUDGET_S - self.waited_s)
        result = common.wait_for_idle(min(IDLE_MAX_WAIT_S, left))
        self.waited_s += result.waited_s
        return result


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def crash_reported(series: common.Series) -> str:
    return common.fmt_time(series.extra_median("crash_reported_s"), "ms")


def evaluate_targets(workload: Workload) -> list[TargetResult]:
    out = []
    for method in START_METHODS:
        series = workload[mpsched_name(method)]
        why = (
            f"mpsched: not available ({series.unavailable})"
            if series.unavailable is not None
            else "no samples"
        )
        out.append(
            common.check_target(
                f"recovery: mpsched median with {method} (s)",
                series.median(),
                "<=",
                RECOVERY_MAX_S[method],
                why,
            )
        )
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument(
        "--repeats", type=int, default=DEFAULT_REPEATS, help=f"samples per row (>= {MIN_REPEATS})"
    )
    p.add_argument("--json", type=Path, metavar="PATH", help="dump the raw numbers here")
    p.add_argument("-v", "--verbose", action="store_true", help="log every sample to stderr")
    args = p.parse_args(argv)
    if args.repeats < MIN_REPEATS:
        p.error(f"--repeats must be >= {MIN_REPEATS}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Measure every row, print the table and the targets; 0 unless an outcome was wrong."""
    args = parse_args(argv)
    common.arm_watchdog(WATCHDOG_S)
    started = time.perf_counter()
    status = common.mpsched_status(*NEEDS_POOL)
    print(f"mpsched: {'available' if status is None else f'not available ({status})'}")
    print(
        "recovery = SIGKILL of the only worker -> start of the next task (in a new worker); "
        "impl/mpsched > 1 means mpsched recovers faster.\n"
    )
    series, gates = common.run_interleaved(
        "recovery", impls(), args.repeats, Gate(), log, args.verbose
    )
    title = "SIGKILL of the only worker to the next task's start, 1 worker"
    workload = Workload("recovery", title, "ms", series, gates, {"workers": 1})
    print(f"== recovery: {title} (median of {args.repeats} repeats) ==")
    print(common.render_table(workload, [("crash reported", crash_reported)]))
    print(common.describe_gates(gates))
    print()
    targets = evaluate_targets(workload)
    print("== targets ==")
    print(common.render_targets(targets))
    elapsed = time.perf_counter() - started
    print(f"\ntotal time: {elapsed:.0f} s")
    if args.json is not None:
        common.dump_json(
            args.json,
            {
                "machine": common.machine_info(("psutil", "loky")),
                "repeats": args.repeats,
                "mpsched": status or "available",
                "workloads": {"recovery": workload.to_json()},
                "targets": [
                    {"name": t.name, "status": t.status, "figure": t.figure} for t in targets
                ],
                "medians_s": {name: s.median() for name, s in series.items()},
                "crash_reported_medians_s": {
                    name: s.extra_median("crash_reported_s") for name, s in series.items()
                },
                "total_s": elapsed,
            },
        )
    common.arm_watchdog(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
