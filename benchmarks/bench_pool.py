"""mpsched.Pool against the process pools it must beat: the project's main benchmark job.

Usage, from the repository root::

    PYTHONPATH=. python benchmarks/bench_pool.py            # everything, default sizes (~7 min)
    PYTHONPATH=. python benchmarks/bench_pool.py --quick    # smoke run (~1 min)
    PYTHONPATH=. python benchmarks/bench_pool.py --only throughput,latency --repeats 7 \\
        --json /tmp/bench.json

Workloads (the shapes of the issue's targets; details in ``benchmarks/README.md``):
throughput, latency, imbalanced, forkjoin, startup, and recycle, payloads100k and payloads1m
(no issue target; shown beside them). Each runs mpsched and its peers interleaved per repeat
(``_common.run_interleaved``), prints a table of medians and paired ratios, and the run ends with
a PASS/FAIL/SKIP line per project target. Until ``mpsched.Pool`` exists, its rows say "mpsched:
not available" and its targets SKIP. A wrong result from any pool raises ``BenchmarkError`` and
the run exits non-zero; a missed target does not.

Every pool is created and shut down by the harness, once per measurement: warm (warmed with
untimed no-op tasks, then timed) for every workload except start-up, which measures a fresh pool
in a fresh interpreter. The Dask fork-join peer also runs in a fresh interpreter, so that its
threads and event loop never share a process with the pools that ``fork``.
"""

from __future__ import annotations

import compileall
import functools
import importlib.util
import multiprocessing
import multiprocessing.pool
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks import _common as common
from benchmarks import _workloads as wl
from benchmarks._common import WORKERS, Impl, Measurement, Series, TargetResult, Workload

# Start methods of the peers: whichever is best for them on each kind of workload.
DISPATCH_START_METHOD = "fork"  # throughput, latency: 3.11's Linux default; fastest dispatch
COMPUTE_START_METHOD = "forkserver"  # imbalanced, forkjoin: mpsched's default, and here PPE
# workers forked from this (large) benchmark process ran the summing loop ~9% slower than
# forkserver's (3.97 s vs 3.64 s median makespan, 4 interleaved quiet repeats).
REFERENCE_START_METHOD = "fork"  # the static reference: fastest variant measured here
MIN_REPEATS = 3  # fewer repeats give no meaningful median

PARETO_ALPHA = 1.2  # tail index of the imbalanced task sizes
PARETO_CAP_RATIO = 40.0  # largest task at most this many times the smallest
PARETO_SEED = 20_240_601  # fixed: every run and every pool gets the same batch
FORKJOIN_LEAF_S = 0.001  # s; target duration of one fork-join leaf
DASK_MAX_REPEATS = 3  # Dask nested fork-join: 5-6 s per sample at default size (1,023 tasks)
PROBE_MODULE = "benchmarks.bench_pool"  # what a fresh-interpreter probe imports (not __main__)
PROBE_TIMEOUT_S = 900  # s; a fresh-interpreter probe (start-up or Dask) taking longer is a hang

# Targets (2 workers), as fixed for the project.
SUBMIT_VS_PPE_MIN = 8.0  # mpsched submit throughput / ProcessPoolExecutor.submit throughput
SUBMIT_VS_APPLY_ASYNC_MIN = 2.0  # ... / multiprocessing.Pool.apply_async throughput
MAP_VS_BEST_CHUNKED_MIN = 1.0  # mpsched map default chunking / best chunked peer map
LATENCY_VS_PPE_MAX = 0.25  # mpsched round trip / ProcessPoolExecutor round trip
IMBALANCED_VS_REFERENCE_MAX = 1.05  # mpsched makespan / balanced static split makespan
FORKJOIN_VS_FLAT_MAX = 1.10  # mpsched nested makespan / flat ProcessPoolExecutor makespan
DASK_VS_FORKJOIN_MIN = 3.0  # Dask nested makespan / mpsched nested makespan
STARTUP_VS_PPE_MAX = 1.0  # mpsched start-up / ProcessPoolExecutor start-up, same start method

NEEDS_POOL = ("Pool",)
NEEDS_NESTED = ("Pool", "submit")

# Row names that the targets refer to.
MPSCHED_SUBMIT = "mpsched Pool.submit"
MPSCHED_MAP = "mpsched Pool.map (default chunking)"
PPE_SUBMIT = "ProcessPoolExecutor.submit"
PPE_MAP_1 = "ProcessPoolExecutor.map chunksize=1"
PPE_MAP_256 = "ProcessPoolExecutor.map chunksize=256"
MP_APPLY_ASYNC = "multiprocessing.Pool.apply_async"
MP_IMAP_256 = "multiprocessing.Pool.imap chunksize=256"
MP_MAP_DEFAULT = "multiprocessing.Pool.map (default chunksize)"
LOKY_SUBMIT = "loky submit"
LATENCY_MPSCHED = "mpsched submit().result()"
LATENCY_PPE = "ProcessPoolExecutor submit().result()"
STATIC_REFERENCE = "reference: 2 plain processes, balanced static split"
FJ_FLAT = "reference: ProcessPoolExecutor, leaves submitted flat"
FJ_MPSCHED = "mpsched nested (mpsched.submit + join)"
FJ_DASK = "Dask distributed nested (secede/rejoin)"
FJ_SERIAL = "serial recursion, main process"
PAYLOAD_MPSCHED = "mpsched Pool.submit"
PAYLOAD_PPE = "ProcessPoolExecutor.submit"
PAYLOAD_LOKY = "loky submit"
PAYLOAD_KEYS = ("payloads100k", "payloads1m")  # the workloads of Sizes.payloads, in order
# Start-up cases: (start method, second pool). A second pool of the same interpreter finds the
# forkserver running (a pipeline that makes a pool per stage); under fork nothing carries over.
# Every start method (the "with the same start method"; spawn added after an audit).
STARTUP_CASES = (("forkserver", False), ("fork", False), ("spawn", False), ("forkserver", True))
# recycle: mpsched's default; ProcessPoolExecutor refuses max_tasks_per_child under fork.
RECYCLE_START_METHOD = "forkserver"
RECYCLE_MPSCHED = "mpsched Pool (max_tasks_per_worker=1)"
RECYCLE_PPE = "ProcessPoolExecutor (max_tasks_per_child=1)"

# Distributions whose versions go into the machine info of --json.
JSON_DISTS = ("psutil", "loky", "distributed", "cloudpickle")


def startup_case(method: str, second: bool) -> str:
    """One start-up case, as rows and targets name it (``second``: the interpreter's second
    pool)."""
    return f"{method}, second pool" if second else method


def startup_name(impl: str, method: str, second: bool = False) -> str:
    """Row name of one start-up case."""
    pool = "mpsched Pool" if impl == "mpsched" else "ProcessPoolExecutor"
    return f"{pool} ({startup_case(method, second)})"


@dataclass(frozen=True)
class Sizes:
    """Everything ``--quick`` shrinks."""

    repeats: int
    # Start-up samples are cheap (a fresh interpreter, ~0.1-0.3 s each) and spread most: single
    # paired ratios of the same code ranged 0.6-1.8. At least this many steady their median.
    startup_repeats: int
    throughput_tasks: int
    warmup_tasks: int  # untimed no-op tasks on every warm pool before its timed part
    latency_round_trips: int
    imbalanced_tasks: int
    imbalanced_serial_s: float  # s; serial work of the whole batch, by the calibration
    forkjoin_serial_s: float  # s; serial work of the fork-join range, by the calibration
    # payloads: (tasks, bytes of each one's argument and then of its result) per workload:
    # past a slab chain (~60 KiB; they go through the coordinator's stash) and well past it.
    payloads: tuple[tuple[int, int], ...]
    recycle_tasks: int  # tasks after the first in ``recycle``, each in a new worker
    idle_max_wait_s: float  # s; one idle gate gives up (and marks the repeat) after this
    idle_budget_s: float  # s; all gates of the run together wait at most this (then 1 window)
    watchdog_s: int  # s; the whole run is killed (stacks dumped) after this


DEFAULT = Sizes(
    5,
    15,
    20_000,
    200,
    2_000,
    400,
    8.0,
    0.8,
    ((2_000, 100 << 10), (300, 1 << 20)),
    8,
    10.0,
    60.0,
    1800,
)
QUICK = Sizes(
    3, 3, 2_000, 50, 200, 40, 1.0, 0.2, ((200, 100 << 10), (30, 1 << 20)), 2, 2.0, 10.0, 600
)


# --------------------------------------------------------------------------- pools


def ppe(method: str = DISPATCH_START_METHOD) -> ProcessPoolExecutor:
    """A stdlib ``ProcessPoolExecutor`` with ``WORKERS`` workers."""
    return ProcessPoolExecutor(max_workers=WORKERS, mp_context=multiprocessing.get_context(method))


@contextmanager
def mp_pool(method: str = DISPATCH_START_METHOD) -> Iterator[multiprocessing.pool.Pool]:
    """A ``multiprocessing.Pool`` that is closed and joined (its own ``__exit__`` terminates)."""
    pool = multiprocessing.get_context(method).Pool(WORKERS)
    try:
        yield pool
    except BaseException:
        pool.terminate()
        raise
    else:
        pool.close()
    finally:
        pool.join()


@contextmanager
def loky_executor() -> Iterator[Any]:
    """loky's reusable executor, shut down afterwards (the next call makes a fresh one)."""
    import loky

    executor = loky.get_reusable_executor(max_workers=WORKERS)
    try:
        yield executor
    finally:
        executor.shutdown(wait=True)


def mpsched_pool(start_method: str | None = None) -> Any:
    """An ``mpsched.Pool``; ``None`` is its default start method (forkserver on Linux)."""
    import mpsched

    return mpsched.Pool(workers=WORKERS, start_method=start_method)


PoolFactory = Callable[[], AbstractContextManager[Any]]
compute_ppe: PoolFactory = functools.partial(ppe, COMPUTE_START_METHOD)
compute_mp_pool: PoolFactory = functools.partial(mp_pool, COMPUTE_START_METHOD)
Driver = Callable[[Any, Callable[[int], int], Sequence[int]], list[int]]


def submit_each(pool: Any, fn: Callable[[int], int], items: Sequence[int]) -> list[int]:
    """One ``submit`` per item, each with its future; then every result in order."""
    futures = [pool.submit(fn, x) for x in items]
    return [f.result() for f in futures]


def apply_async_each(
    pool: multiprocessing.pool.Pool, fn: Callable[[int], int], items: Sequence[int]
) -> list[int]:
    """``multiprocessing.Pool.apply_async`` per item; then every result in order."""
    handles = [pool.apply_async(fn, (x,)) for x in items]
    return [h.get() for h in handles]


def map_with(chunksize: int | None) -> Driver:
    """``pool.map(fn, items)``, with ``chunksize`` unless None (the pool's own default)."""

    def driver(pool: Any, fn: Callable[[int], int], items: Sequence[int]) -> list[int]:
        if chunksize is None:
            return list(pool.map(fn, items))
        return list(pool.map(fn, items, chunksize=chunksize))

    return driver


def imap_with(chunksize: int) -> Driver:
    """``multiprocessing.Pool.imap(fn, items, chunksize)``, consumed in order."""

    def driver(pool: Any, fn: Callable[[int], int], items: Sequence[int]) -> list[int]:
        return list(pool.imap(fn, items, chunksize))

    return driver


def warm_pool_run(
    make_pool: PoolFactory,
    driver: Driver,
    fn: Callable[[int], int],
    items: Sequence[int],
    expected: list[int],
    warmup: int,
    label: str,
) -> Measurement:
    """Create a pool, warm it with ``warmup`` no-ops, time ``driver`` over ``items``, check."""
    with make_pool() as pool:
        common.verify(driver(pool, wl.noop, range(warmup)) == list(range(warmup)), label)
        with common.CpuAudit() as audit:
            t0 = time.perf_counter()
            results = driver(pool, fn, items)
            seconds = time.perf_counter() - t0
    common.verify(results == expected, f"{label}: results of {len(items)} tasks")
    return Measurement(seconds, audit.result)


# --------------------------------------------------------------------------- run context


@dataclass
class Run(common.GatedRun):
    """Settings of this run and the loop calibration, measured once on first use."""

    sizes: Sizes
    verbose: bool
    ns_per_iteration_cache: float | None = None
    gates_waited_s: float = 0.0

    def interleave(
        self, key: str, impls: Sequence[Impl], repeats: int | None = None
    ) -> tuple[dict[str, Series], list[common.GateResult]]:
        """``common.run_interleaved`` with this run's settings (``repeats``: the run's)."""
        return common.run_interleaved(
            key, impls, repeats or self.sizes.repeats, self.gate, self.log, self.verbose
        )


# --------------------------------------------------------------------------- workloads


def bench_throughput(run: Run) -> Workload:
    """20,000 no-op tasks, one future each (or one map), warm pool, first submit to last result."""
    n, warmup = run.sizes.throughput_tasks, run.sizes.warmup_tasks
    items = list(range(n))

    def case(name: str, make_pool: PoolFactory, driver: Driver, **kw: Any) -> Impl:
        def measure() -> Measurement:
            return warm_pool_run(make_pool, driver, wl.noop, items, items, warmup, name)

        return Impl(name, measure, **kw)

    impls = [
        case(MPSCHED_SUBMIT, mpsched_pool, submit_each, needs=NEEDS_POOL),
        case(MPSCHED_MAP, mpsched_pool, map_with(None), needs=NEEDS_POOL),
        case(PPE_SUBMIT, ppe, submit_each, baseline=MPSCHED_SUBMIT),
        case(PPE_MAP_1, ppe, map_with(1), baseline=MPSCHED_MAP),
        case(PPE_MAP_256, ppe, map_with(256), baseline=MPSCHED_MAP),
        case(MP_APPLY_ASYNC, mp_pool, apply_async_each, baseline=MPSCHED_SUBMIT),
        case(MP_IMAP_256, mp_pool, imap_with(256), baseline=MPSCHED_MAP),
        # Its default chunks (n / (4 * workers) items: 8 here) are a chunked map too, and in
        # an audit's quick runs the fastest of them (found in review).
        case(MP_MAP_DEFAULT, mp_pool, map_with(None), baseline=MPSCHED_MAP),
        case(LOKY_SUBMIT, loky_executor, submit_each, baseline=MPSCHED_SUBMIT),
    ]
    series, gates = run.interleave("throughput", impls)
    title = (
        f"{n:,} no-op tasks, warm pool, first submit to last result; "
        f"PPE and mp.Pool use {DISPATCH_START_METHOD}"
    )
    return Workload("throughput", title, "ms", series, gates, {"tasks": n, "warmup_tasks": warmup})


def latency_run(make_pool: PoolFactory, round_trips: int, warmup: int, label: str) -> Measurement:
    """Median (and p90) of ``round_trips`` sequential ``submit(noop, i).result()`` calls."""
    times = [0] * round_trips
    results = [0] * round_trips
    with make_pool() as pool:
        submit_each(pool, wl.noop, range(warmup))
        with common.CpuAudit() as audit:
            for i in range(round_trips):
                t0 = time.perf_counter_ns()
                results[i] = pool.submit(wl.noop, i).result()
                times[i] = time.perf_counter_ns() - t0
    common.verify(results == list(range(round_trips)), f"{label}: round-trip results")
    p90 = statistics.quantiles(times, n=10)[-1]
    return Measurement(statistics.median(times) / 1e9, audit.result, {"p90_s": p90 / 1e9})


def bench_latency(run: Run) -> Workload:
    """Round trip of one tiny task, repeated; mpsched against ProcessPoolExecutor."""
    n, warmup = run.sizes.latency_round_trips, run.sizes.warmup_tasks

    def case(name: str, make_pool: PoolFactory, **kw: Any) -> Impl:
        return Impl(name, lambda: latency_run(make_pool, n, warmup, name), **kw)

    impls = [
        case(LATENCY_MPSCHED, mpsched_pool, needs=NEEDS_POOL),
        case(LATENCY_PPE, ppe, baseline=LATENCY_MPSCHED),
    ]
    series, gates = run.interleave("latency", impls)
    title = (
        f"round trip of one no-op task, median of {n:,} per repeat; "
        f"PPE uses {DISPATCH_START_METHOD}"
    )
    return Workload("latency", title, "us", series, gates, {"round_trips": n})


def static_reference(parts: list[list[int]], expected_total: int) -> Measurement:
    """The physical limit: one plain process per share of a balanced split, no pool at all."""
    ctx = multiprocessing.get_context(REFERENCE_START_METHOD)
    pipes = [ctx.Pipe(duplex=False) for _ in parts]
    procs = [
        ctx.Process(target=wl.run_static_batch, args=(part, send))
        for part, (_, send) in zip(parts, pipes, strict=True)
    ]
    try:
        with common.CpuAudit() as audit:
            t0 = time.perf_counter()
            for proc in procs:
                proc.start()
            for _, send in pipes:
                send.close()  # so that a dead child shows up as EOFError, not a hang
            results = [recv.recv() for recv, _ in pipes]
            seconds = time.perf_counter() - t0
            for proc in procs:
                proc.join()
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    total = sum(sum(r) for r in results)
    common.verify(total == expected_total, f"{STATIC_REFERENCE}: total {total}")
    return Measurement(seconds, audit.result)


def bench_imbalanced(run: Run) -> Workload:
    """400 CPU-bound tasks of Pareto sizes, submitted one by one in generated order."""
    ns = run.ns_per_iteration()
    total_iterations = round(run.sizes.imbalanced_serial_s * 1e9 / ns)
    sizes = wl.pareto_sizes(run.sizes.imbalanced_tasks, PARETO_ALPHA, PARETO_CAP_RATIO, PARETO_SEED)
    counts = wl.scale_to_iterations(sizes, total_iterations)
    expected = [wl.expected_sum(0, c) for c in counts]
    parts = wl.lpt_partition(counts, WORKERS)
    warmup = run.sizes.warmup_tasks

    def case(name: str, make_pool: PoolFactory, driver: Driver, **kw: Any) -> Impl:
        def measure() -> Measurement:
            return warm_pool_run(make_pool, driver, wl.spin, counts, expected, warmup, name)

        return Impl(name, measure, **kw)

    impls = [
        Impl(STATIC_REFERENCE, lambda: static_reference(parts, sum(expected))),
        case(MPSCHED_SUBMIT, mpsched_pool, submit_each, needs=NEEDS_POOL),
        case(PPE_SUBMIT, compute_ppe, submit_each, baseline=MPSCHED_SUBMIT),
        case(MP_APPLY_ASYNC, compute_mp_pool, apply_async_each, baseline=MPSCHED_SUBMIT),
        case(MP_MAP_DEFAULT, compute_mp_pool, map_with(None), baseline=MPSCHED_SUBMIT),
        case(LOKY_SUBMIT, loky_executor, submit_each, baseline=MPSCHED_SUBMIT),
    ]
    series, gates = run.interleave("imbalanced", impls)
    loads = [sum(p) for p in parts]
    shape = {
        "tasks": len(counts),
        "ns_per_iteration": ns,
        "total_iterations": sum(counts),
        "serial_estimate_s": sum(counts) * ns / 1e9,
        "task_ms_min": min(counts) * ns / 1e6,
        "task_ms_max": max(counts) * ns / 1e6,
        "static_split_imbalance": max(loads) / min(loads) - 1,
    }
    title = (
        f"{len(counts)} CPU-bound tasks, Pareto({PARETO_ALPHA}) sizes capped at "
        f"{PARETO_CAP_RATIO:g}x min, ~{shape['serial_estimate_s']:.1f} s serial; "
        f"PPE and mp.Pool use {COMPUTE_START_METHOD}, the reference {REFERENCE_START_METHOD}"
    )
    return Workload("imbalanced", title, "s", series, gates, shape, reference=STATIC_REFERENCE)


def flat_ppe_run(leaves: list[tuple[int, int]], expected: int, warmup: int) -> Measurement:
    """The fork-join reference: the leaves, split by hand, submitted flat to a warm PPE."""
    with compute_ppe() as pool:
        submit_each(pool, wl.noop, range(warmup))
        with common.CpuAudit() as audit:
            t0 = time.perf_counter()
            futures = [pool.submit(wl.sum_range, lo, hi) for lo, hi in leaves]
            total = sum(f.result() for f in futures)
            seconds = time.perf_counter() - t0
    common.verify(total == expected, f"{FJ_FLAT}: total {total}")
    return Measurement(seconds, audit.result)


def mpsched_nested_run(shape: wl.ForkJoinShape, warmup: int) -> Measurement:
    """mpsched's nested fork-join on a warm pool (warmed by no-ops and a small nested run)."""
    small = shape.leaf * 4
    with mpsched_pool() as pool:
        submit_each(pool, wl.noop, range(warmup))
        warm = pool.submit(wl.fork_join_mpsched, 0, small, shape.leaf).result()
        common.verify(warm == wl.expected_sum(0, small), f"{FJ_MPSCHED}: warm-up total")
        with common.CpuAudit() as audit:
            t0 = time.perf_counter()
            total = pool.submit(wl.fork_join_mpsched, 0, shape.n, shape.leaf).result()
            seconds = time.perf_counter() - t0
    common.verify(total == shape.expected, f"{FJ_MPSCHED}: total {total}")
    return Measurement(seconds, audit.result)


def serial_run(shape: wl.ForkJoinShape) -> Measurement:
    """The same recursion in the main process, for scale."""
    with common.CpuAudit() as audit:
        t0 = time.perf_counter()
        total = wl.fork_join_serial(0, shape.n, shape.leaf)
        seconds = time.perf_counter() - t0
    common.verify(total == shape.expected, f"{FJ_SERIAL}: total {total}")
    return Measurement(seconds, audit.result)


def dask_fork_join_probe(n: int, leaf: int) -> dict[str, Any]:
    """In a fresh interpreter: Dask's nested fork-join on a warm 2-process LocalCluster."""
    import logging

    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=WORKERS,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            silence_logs=logging.ERROR,
        ) as cluster,
        Client(cluster) as client,
    ):
        client.submit(wl.fork_join_dask, 0, leaf * 4, leaf, pure=False).result()  # warm-up
        with common.CpuAudit() as audit:
            t0 = time.perf_counter()
            total = client.submit(wl.fork_join_dask, 0, n, leaf, pure=False).result()
            seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "cpu": asdict(audit.result) if audit.result else None,
        "result": total,
    }


def dask_nested_run(shape: wl.ForkJoinShape) -> Measurement:
    """Run ``dask_fork_join_probe`` in a fresh interpreter and check its total."""
    out = common.run_probe(
        f"{PROBE_MODULE}:dask_fork_join_probe", {"n": shape.n, "leaf": shape.leaf}, PROBE_TIMEOUT_S
    )
    common.verify(out["result"] == shape.expected, f"{FJ_DASK}: total {out['result']}")
    return Measurement(out["seconds"], common.CpuUse(**out["cpu"]) if out["cpu"] else None)


def bench_forkjoin(run: Run) -> Workload:
    """Recursive range sum with ~1 ms leaves: nested mpsched vs flat PPE vs nested Dask."""
    ns = run.ns_per_iteration()
    shape = wl.fork_join_shape(ns, run.sizes.forkjoin_serial_s, FORKJOIN_LEAF_S)
    leaves = wl.split_leaves(0, shape.n, shape.leaf)
    warmup = run.sizes.warmup_tasks
    impls = [
        Impl(FJ_FLAT, lambda: flat_ppe_run(leaves, shape.expected, warmup)),
        Impl(FJ_MPSCHED, lambda: mpsched_nested_run(shape, warmup), needs=NEEDS_NESTED),
        Impl(
            FJ_DASK,
            lambda: dask_nested_run(shape),
            baseline=FJ_MPSCHED,
            max_repeats=DASK_MAX_REPEATS,
        ),
        Impl(FJ_SERIAL, lambda: serial_run(shape), baseline=FJ_MPSCHED),
    ]
    series, gates = run.interleave("forkjoin", impls)
    leaf_ms = shape.leaf * ns / 1e6
    info = {
        "n": shape.n,
        "leaf_iterations": shape.leaf,
        "leaves": len(leaves),
        "leaf_ms_estimate": leaf_ms,
        "serial_estimate_s": shape.n * ns / 1e9,
    }
    title = (
        f"recursive sum, {len(leaves):,} leaves of ~{leaf_ms:.2f} ms, "
        f"~{info['serial_estimate_s']:.2f} s serial; PPE uses {COMPUTE_START_METHOD}"
    )
    return Workload("forkjoin", title, "s", series, gates, info, reference=FJ_FLAT)


def startup_probe(impl: str, start_method: str, second: bool = False) -> dict[str, Any]:
    """In a fresh interpreter: pool creation to first result, then shutdown, in seconds; with
    ``second``, of the second pool, once a first one (untimed) ran a task and shut down."""
    make: Callable[[str], AbstractContextManager[Any]] = mpsched_pool if impl == "mpsched" else ppe
    if impl == "mpsched":
        # Import mpsched.Pool before the clock starts, as ProcessPoolExecutor is imported.
        common.mpsched_status("Pool")
    if second:
        with make(start_method) as pool:
            common.verify(pool.submit(wl.noop, 1).result() == 1, "startup: first pool")
    t0 = time.perf_counter()
    with make(start_method) as pool:
        result = pool.submit(wl.noop, 1).result()
        t1 = time.perf_counter()
    t2 = time.perf_counter()
    return {"seconds": t1 - t0, "shutdown_s": t2 - t1, "result": result}


def startup_run(impl: str, method: str, second: bool) -> Measurement:
    """Run ``startup_probe`` in a fresh interpreter and check its result."""
    out = common.run_probe(
        f"{PROBE_MODULE}:startup_probe",
        {"impl": impl, "start_method": method, "second": second},
        PROBE_TIMEOUT_S,
    )
    name = startup_name(impl, method, second)
    common.verify(out["result"] == 1, f"{name}: result {out['result']}")
    return Measurement(out["seconds"], None, {"shutdown_s": out["shutdown_s"]})


def bench_startup(run: Run) -> Workload:
    """Fresh pool in a fresh interpreter: creation to first result, per start method."""
    impls: list[Impl] = []
    for method, second in STARTUP_CASES:
        mine = startup_name("mpsched", method, second)
        impls += [
            Impl(mine, lambda m=method, s=second: startup_run("mpsched", m, s), needs=NEEDS_POOL),
            Impl(
                startup_name("ppe", method, second),
                lambda m=method, s=second: startup_run("ppe", m, s),
                baseline=mine,
            ),
        ]
    sizes = run.sizes
    series, gates = run.interleave("startup", impls, max(sizes.repeats, sizes.startup_repeats))
    return Workload(
        "startup",
        "pool creation to first result, fresh interpreter per sample (second pool: after one)",
        "ms",
        series,
        gates,
        {"cases": [startup_name("mpsched", m, s) for m, s in STARTUP_CASES]},
    )


def recycle_probe(impl: str, tasks: int) -> dict[str, Any]:
    """In a fresh interpreter: a pool whose workers each run one task, of a module with a heavy
    import (``_heavy_tasks``); creation to the first result, and to the last of ``tasks`` more,
    each submitted once the one before it returned (so each waits for a new worker), in s."""
    from benchmarks import _heavy_tasks as heavy  # here, not at the top: see its docstring

    make: Callable[[], AbstractContextManager[Any]]
    if impl == "mpsched":
        import mpsched

        common.mpsched_status("Pool")  # imported before the clock, as ProcessPoolExecutor is
        make = functools.partial(
            mpsched.Pool, WORKERS, start_method=RECYCLE_START_METHOD, max_tasks_per_worker=1
        )
    else:
        context = multiprocessing.get_context(RECYCLE_START_METHOD)
        make = functools.partial(
            ProcessPoolExecutor, WORKERS, mp_context=context, max_tasks_per_child=1
        )
    t0 = time.perf_counter()
    with make() as pool:
        results = [pool.submit(heavy.ident, 0).result()]
        t1 = time.perf_counter()
        results += [pool.submit(heavy.ident, i).result() for i in range(1, tasks + 1)]
        t2 = time.perf_counter()
    return {"seconds": t2 - t0, "first_s": t1 - t0, "results": results}


def recycle_run(impl: str, tasks: int) -> Measurement:
    """Run ``recycle_probe`` in a fresh interpreter and check its results."""
    out = common.run_probe(
        f"{PROBE_MODULE}:recycle_probe", {"impl": impl, "tasks": tasks}, PROBE_TIMEOUT_S
    )
    common.verify(out["results"] == list(range(tasks + 1)), f"recycle {impl}: {out['results']}")
    return Measurement(out["seconds"], None, {"first_s": out["first_s"]})


def bench_recycle(run: Run) -> Workload:
    """No issue target: workers that each run one task (``max_tasks_per_worker=1``, as a
    pipeline that contains a leaky library sets), of a module with a heavy import. mpsched's
    zygote imports the first task's module and every worker it forks inherits it; each of
    ProcessPoolExecutor's new workers imports it again. A fresh interpreter per sample."""
    n = run.sizes.recycle_tasks
    impls = [
        Impl(RECYCLE_MPSCHED, lambda: recycle_run("mpsched", n), needs=NEEDS_POOL),
        Impl(RECYCLE_PPE, lambda: recycle_run("ppe", n), baseline=RECYCLE_MPSCHED),
    ]
    series, gates = run.interleave("recycle", impls)
    title = (
        f"pool creation to the last of 1 + {n} tasks submitted one after another, each worker "
        f"running one, of a module that imports distributed; {RECYCLE_START_METHOD}, fresh "
        f"interpreter per sample; no issue target"
    )
    return Workload("recycle", title, "s", series, gates, {"tasks": n + 1})


def bench_payloads(run: Run, which: int) -> Workload:
    """Big arguments, then big results: ``sizes.payloads[which]`` (tasks, bytes), each task
    submitted one by one; no issue target (a data pipeline's arrays), shown against PPE and
    loky. mpsched's go through the coordinator's stash (past a slab chain's ~60 KiB)."""
    (n, size), warmup = run.sizes.payloads[which], run.sizes.warmup_tasks
    key = PAYLOAD_KEYS[which]
    datas = [i.to_bytes(4, "little") * (size // 4) for i in range(n)]  # one object each

    def arguments(pool: Any) -> list[int]:
        futures = [pool.submit(wl.size_of, data) for data in datas]
        return [f.result() for f in futures]

    def results(pool: Any) -> list[int]:
        futures = [pool.submit(wl.zeros, size) for _ in range(n)]
        return [len(f.result()) for f in futures]

    def case(name: str, make_pool: PoolFactory, **kw: Any) -> Impl:
        def measure() -> Measurement:
            with make_pool() as pool:
                common.verify(
                    submit_each(pool, wl.noop, range(warmup)) == list(range(warmup)), name
                )
                with common.CpuAudit() as audit:
                    t0 = time.perf_counter()
                    got = arguments(pool) + results(pool)
                    seconds = time.perf_counter() - t0
            common.verify(got == [len(datas[0])] * n + [size] * n, f"{name}: payload sizes")
            return Measurement(seconds, audit.result)

        return Impl(name, measure, **kw)

    impls = [
        case(PAYLOAD_MPSCHED, mpsched_pool, needs=NEEDS_POOL),
        case(PAYLOAD_PPE, ppe, baseline=PAYLOAD_MPSCHED),
        case(PAYLOAD_LOKY, loky_executor, baseline=PAYLOAD_MPSCHED),
    ]
    series, gates = run.interleave(key, impls)
    title = (
        f"{n:,} tasks with a {size >> 10:,} KiB argument, then {n:,} with a {size >> 10:,} KiB "
        f"result, submitted one by one, warm pool; no issue target; PPE uses "
        f"{DISPATCH_START_METHOD}"
    )
    return Workload(key, title, "s", series, gates, {"tasks": n, "bytes": size})


BENCHES: dict[str, Callable[[Run], Workload]] = {
    "throughput": bench_throughput,
    "latency": bench_latency,
    "imbalanced": bench_imbalanced,
    "forkjoin": bench_forkjoin,
    "startup": bench_startup,
    "recycle": bench_recycle,
    PAYLOAD_KEYS[0]: functools.partial(bench_payloads, which=0),
    PAYLOAD_KEYS[1]: functools.partial(bench_payloads, which=1),
}


# --------------------------------------------------------------------------- report


def extra_columns(w: Workload) -> list[common.ExtraColumn]:
    """Workload-specific columns of the table."""
    if w.key == "throughput":
        n = w.shape["tasks"]

        def rate(s: Series) -> str:
            median = s.median()
            return f"{n / median:,.0f}" if median else "-"

        def per_task(s: Series) -> str:
            median = s.median()
            return f"{median / n * 1e6:.2f}" if median else "-"

        return [("tasks/s", rate), ("us/task", per_task)]
    if w.key == "latency":
        return [("p90", lambda s: common.fmt_time(s.extra_median("p90_s"), "us"))]
    if w.key == "imbalanced":
        ref = w[STATIC_REFERENCE]
        return [("efficiency", lambda s: _fmt_plain(common.paired_ratio([ref], s)))]
    if w.key == "startup":
        return [("shutdown", lambda s: common.fmt_time(s.extra_median("shutdown_s"), "ms"))]
    if w.key == "recycle":
        return [("first result", lambda s: common.fmt_time(s.extra_median("first_s"), "ms"))]
    return []


def _fmt_plain(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def render_workload(w: Workload) -> str:
    """Title, table and idle-gate line of one workload."""
    repeats = max((len(s.samples) for s in w.series.values()), default=0)
    head = f"== {w.key}: {w.title} ({WORKERS} workers; median of {repeats} repeats) =="
    return "\n".join(
        [head, common.render_table(w, extra_columns(w)), common.describe_gates(w.gates), ""]
    )


def _ratio(w: Workload, numerators: Sequence[str], denominator: str) -> float | None:
    return common.paired_ratio([w[n] for n in numerators], w[denominator])


def _why(w: Workload, *names: str) -> str:
    """Why a target could not be checked (the first unavailable row)."""
    for name in names:
        if w[name].unavailable is not None:
            return f"mpsched: not available ({w[name].unavailable})"
    return "no paired samples"


def evaluate_targets(ws: Mapping[str, Workload]) -> list[TargetResult]:
    """Check each project target that the selected workloads can answer."""
    check = common.check_target
    out: list[TargetResult] = []
    if (w := ws.get("throughput")) is not None:
        why = _why(w, MPSCHED_SUBMIT, MPSCHED_MAP)
        out += [
            check(
                "throughput: mpsched submit vs ProcessPoolExecutor.submit (x faster)",
                _ratio(w, [PPE_SUBMIT], MPSCHED_SUBMIT),
                ">=",
                SUBMIT_VS_PPE_MIN,
                why,
            ),
            check(
                "throughput: mpsched submit vs multiprocessing.Pool.apply_async (x faster)",
                _ratio(w, [MP_APPLY_ASYNC], MPSCHED_SUBMIT),
                ">=",
                SUBMIT_VS_APPLY_ASYNC_MIN,
                why,
            ),
            check(
                "throughput: mpsched map vs best chunked peer map (x faster)",
                _ratio(w, [PPE_MAP_256, MP_IMAP_256, MP_MAP_DEFAULT], MPSCHED_MAP),
                ">=",
                MAP_VS_BEST_CHUNKED_MIN,
                why,
            ),
        ]
    if (w := ws.get("latency")) is not None:
        out.append(
            check(
                "latency: mpsched / ProcessPoolExecutor median round trip",
                _ratio(w, [LATENCY_MPSCHED], LATENCY_PPE),
                "<=",
                LATENCY_VS_PPE_MAX,
                _why(w, LATENCY_MPSCHED),
            )
        )
    if (w := ws.get("imbalanced")) is not None:
        why = _why(w, MPSCHED_SUBMIT)
        peers = [n for n, s in w.series.items() if s.impl.baseline == MPSCHED_SUBMIT]
        closest = min(
            ((_ratio(w, [p], MPSCHED_SUBMIT), p) for p in peers),
            key=lambda rp: rp[0] if rp[0] is not None else float("inf"),
        )
        out += [
            check(
                "imbalanced: mpsched makespan / balanced static reference",
                _ratio(w, [MPSCHED_SUBMIT], STATIC_REFERENCE),
                "<=",
                IMBALANCED_VS_REFERENCE_MAX,
                why,
            ),
            check(
                f"imbalanced: closest peer makespan / mpsched ({closest[1]})",
                closest[0],
                ">",
                1.0,
                why,
            ),
        ]
    if (w := ws.get("forkjoin")) is not None:
        why = _why(w, FJ_MPSCHED)
        out += [
            check(
                "forkjoin: mpsched nested / flat ProcessPoolExecutor makespan",
                _ratio(w, [FJ_MPSCHED], FJ_FLAT),
                "<=",
                FORKJOIN_VS_FLAT_MAX,
                why,
            ),
            check(
                "forkjoin: Dask nested / mpsched nested makespan",
                _ratio(w, [FJ_DASK], FJ_MPSCHED),
                ">=",
                DASK_VS_FORKJOIN_MIN,
                why,
            ),
        ]
    if (w := ws.get("startup")) is not None:
        for method, second in STARTUP_CASES:
            mine = startup_name("mpsched", method, second)
            out.append(
                check(
                    f"startup: mpsched / ProcessPoolExecutor ({startup_case(method, second)})",
                    _ratio(w, [mine], startup_name("ppe", method, second)),
                    "<=",
                    STARTUP_VS_PPE_MAX,
                    _why(w, mine),
                )
            )
    return out


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    """Run the selected workloads, print tables and targets; 0 unless a result was wrong."""
    args = common.parse_workload_args(__doc__, list(BENCHES), MIN_REPEATS, argv)
    sizes = common.start_workload_run(args, QUICK, DEFAULT)
    # Users import mpsched from compiled bytecode, as the peers import the precompiled stdlib;
    # where PYTHONDONTWRITEBYTECODE is set, every fresh interpreter (start-up probes, the
    # forkserver's zygote) would otherwise recompile mpsched and pay ~0.1 s the peers do not.
    spec = importlib.util.find_spec("mpsched")
    for where in (spec.submodule_search_locations or []) if spec is not None else []:
        compileall.compile_dir(where, quiet=1)
    run = Run(sizes, args.verbose)
    started = time.perf_counter()
    status = common.mpsched_status(*NEEDS_NESTED)
    print(f"mpsched: {'available' if status is None else f'not available ({status})'}")
    print(
        "impl/mpsched = median over repeats of (impl time / mpsched time, same repeat): "
        "> 1 means mpsched is faster.\n"
    )
    workloads: dict[str, Workload] = {}
    for key in args.only:
        workloads[key] = BENCHES[key](run)
        print(render_workload(workloads[key]), flush=True)
    targets = evaluate_targets(workloads)
    return common.finish_workload_run(
        args, sizes, status, run, workloads, targets, started, JSON_DISTS
    )


if __name__ == "__main__":
    sys.exit(main())
