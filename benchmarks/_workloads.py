"""Task bodies and workload shapes of the pool benchmarks.

Everything a worker process runs is a module-level function here, so that every pool pickles it
by reference (``benchmarks._workloads.spin``) instead of by value. The module imports only the
standard library at the top; ``mpsched`` and ``distributed`` are imported inside the functions
that need them, so the peer side runs while ``mpsched`` does not exist yet.

Shapes (those of the issue's targets):

- throughput / latency / start-up: ``noop(i) -> i``;
- imbalanced: ``spin(n)``, a pure-Python summing loop, with n drawn from a seeded
  Pareto(alpha=1.2) law (minimum 1, i.e. numpy's ``pareto(1.2) + 1``), capped at 40x the sample
  minimum and scaled to a chosen serial time;
- fork-join: a recursive sum over ``range(0, n)`` that halves the range until a leaf of
  ``leaf`` iterations; ``n = leaf * 2**depth`` so every split is exact.

Each task returns a value that the harness checks against a closed form (``expected_sum``).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

CALIBRATION_S = 0.2  # s; length of one timed calibration run of the summing loop
CALIBRATION_RUNS = 3  # best of this many runs (the least disturbed one)
CALIBRATION_PROBE_ITERATIONS = 200_000  # first, untimed-for-result run that sizes the timed ones


# --------------------------------------------------------------------------- task bodies


def noop(i: int) -> int:
    """Return ``i``: the smallest task that still proves the right task ran."""
    return i


def size_of(data: bytes) -> int:
    """The length of a big argument (``payloads``: the task's input is the work)."""
    return len(data)


def zeros(n: int) -> bytes:
    """``n`` zero bytes (``payloads``: a big result)."""
    return bytes(n)


def sum_range(lo: int, hi: int) -> int:
    """Sum ``range(lo, hi)`` with a pure-Python loop (the CPU-bound kernel of every workload)."""
    total = 0
    for i in range(lo, hi):
        total += i
    return total


def spin(n: int) -> int:
    """One imbalanced-batch task: ``sum_range(0, n)``; costs about ``n`` loop iterations."""
    return sum_range(0, n)


def expected_sum(lo: int, hi: int) -> int:
    """Closed form of ``sum_range(lo, hi)``, used to verify every result."""
    return (hi - lo) * (lo + hi - 1) // 2 if hi > lo else 0


def run_static_batch(counts: list[int], conn: Connection) -> None:
    """Target of one plain ``multiprocessing.Process`` of the imbalanced-batch reference.

    Runs ``spin`` over its whole share of the batch (no pool, no per-task messages) and sends
    the list of results back through ``conn``.
    """
    try:
        conn.send([spin(n) for n in counts])
    finally:
        conn.close()


# --------------------------------------------------------------------------- fork-join


def fork_join_serial(lo: int, hi: int, leaf: int) -> int:
    """Recursive sum of ``range(lo, hi)`` in the calling process (no pool)."""
    if hi - lo <= leaf:
        return sum_range(lo, hi)
    mid = (lo + hi) // 2
    return fork_join_serial(lo, mid, leaf) + fork_join_serial(mid, hi, leaf)


def fork_join_mpsched(lo: int, hi: int, leaf: int) -> int:
    """Nested fork-join on mpsched: submit the left half, compute the right half, join.

    Runs inside an mpsched worker. ``mpsched.submit`` pushes the child on this worker's own
    deque, where an idle peer can steal it; ``.result()`` runs other work while it waits.
    """
    import mpsched  # optional dependency; after the first call a dict lookup

    if hi - lo <= leaf:
        return sum_range(lo, hi)
    mid = (lo + hi) // 2
    left = mpsched.submit(fork_join_mpsched, lo, mid, leaf)
    right = fork_join_mpsched(mid, hi, leaf)
    return int(left.result()) + right


def fork_join_dask(lo: int, hi: int, leaf: int) -> int:
    """Nested fork-join on Dask distributed, in mpsched's shape: submit the left half, compute
    the right half, then wait for the left.

    The wait secedes the task from the worker's thread pool (``secede``/``rejoin``: what
    ``worker_client()`` does around its block, Dask's documented way to wait on tasks from
    tasks), so that the worker runs other tasks meanwhile. Submitting both halves, as this did
    before, gave Dask twice mpsched's tasks (~2,047 against ~1,023 submits).
    """
    if hi - lo <= leaf:
        return sum_range(lo, hi)
    from distributed import get_client, rejoin, secede  # optional dependency

    mid = (lo + hi) // 2
    left = get_client().submit(fork_join_dask, lo, mid, leaf, pure=False)
    right = fork_join_dask(mid, hi, leaf)
    secede()
    try:
        value = left.result()
    finally:
        rejoin()
    return int(value) + right


def split_leaves(lo: int, hi: int, leaf: int) -> list[tuple[int, int]]:
    """The leaves of the fork-join recursion, in order: the hand-split flat reference."""
    if hi - lo <= leaf:
        return [(lo, hi)]
    mid = (lo + hi) // 2
    return split_leaves(lo, mid, leaf) + split_leaves(mid, hi, leaf)


@dataclass(frozen=True)
class ForkJoinShape:
    """A fork-join range ``[0, n)`` that splits into ``2**depth`` leaves of ``leaf`` iterations."""

    n: int
    leaf: int
    depth: int

    @property
    def expected(self) -> int:
        """The correct total."""
        return expected_sum(0, self.n)


def fork_join_shape(ns_per_iteration: float, serial_s: float, leaf_s: float) -> ForkJoinShape:
    """Size the fork-join range: about ``serial_s`` in total, in leaves of about ``leaf_s``.

    The leaf count is the power of two nearest to ``serial_s / leaf_s`` (so that every split
    halves the range exactly), and the leaf size then follows from ``serial_s``.
    """
    depth = max(1, round(math.log2(serial_s / leaf_s)))
    leaf = max(1, round(serial_s / 2**depth * 1e9 / ns_per_iteration))
    return ForkJoinShape(n=leaf << depth, leaf=leaf, depth=depth)


# --------------------------------------------------------------------------- imbalanced batch


def pareto_sizes(count: int, alpha: float, cap_ratio: float, seed: int) -> list[float]:
    """Seeded relative task sizes: Pareto(alpha) with minimum 1, capped at ``cap_ratio`` x min.

    ``random.paretovariate`` has support [1, inf), the same law as numpy's ``pareto(alpha) + 1``.
    """
    rng = random.Random(seed)
    raw = [rng.paretovariate(alpha) for _ in range(count)]
    cap = cap_ratio * min(raw)
    return [min(x, cap) for x in raw]


def scale_to_iterations(sizes: list[float], total_iterations: int) -> list[int]:
    """Turn relative sizes into loop iteration counts summing to about ``total_iterations``."""
    scale = total_iterations / sum(sizes)
    return [max(1, round(s * scale)) for s in sizes]


def lpt_partition(counts: list[int], bins: int) -> list[list[int]]:
    """Greedy longest-processing-time partition of ``counts`` into ``bins`` near-equal shares."""
    loads = [0] * bins
    parts: list[list[int]] = [[] for _ in range(bins)]
    for n in sorted(counts, reverse=True):
        k = loads.index(min(loads))
        parts[k].append(n)
        loads[k] += n
    return parts


def calibrate_ns_per_iteration() -> float:
    """Measure the summing loop in this process: ns per iteration, best of a few short runs.

    Timed in this thread's CPU time, not wall time: on a busy machine the wall time counts
    the other processes' turns on the CPU, and the workloads sized from it shrank (a review
    measured 75-100 ns an iteration under load against 36-44 idle: the fork-join's serial
    work came out at half its stated size, which favoured the nested pools). Under three busy
    loops on the 2 CPUs the CPU time read 48 ns where the wall time read 97-150 (idle: 38)."""
    clock = time.thread_time
    t0 = clock()
    sum_range(0, CALIBRATION_PROBE_ITERATIONS)
    rough = max(clock() - t0, 1e-6) / CALIBRATION_PROBE_ITERATIONS
    iterations = max(CALIBRATION_PROBE_ITERATIONS, round(CALIBRATION_S / rough))
    best = math.inf
    for _ in range(CALIBRATION_RUNS):
        t0 = clock()
        sum_range(0, iterations)
        best = min(best, clock() - t0)
    return best / iterations * 1e9
