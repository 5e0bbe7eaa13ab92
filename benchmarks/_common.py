"""Harness shared by the pool benchmarks: noise gating, interleaved repeats, tables, targets.

Why it looks like this: the machine is a shared 2-vCPU VM whose wall times can be off by 2x
while other jobs run (docs/design.md, "Known gaps"). So:

- every workload runs mpsched and its peers in one run, **interleaved per repeat** (the order
  rotates from one repeat to the next), and reports medians and **paired ratios** (the median
  over repeats of ``impl time / mpsched time`` measured in the same repeat);
- before each repeat, ``wait_for_idle`` waits (bounded) until ``psutil.cpu_percent`` over a short
  window says the machine is idle; if it never is, the repeat runs anyway and is marked;
- around each timed window, ``CpuAudit`` estimates the CPU that *other* processes used (system
  busy CPU, steal included, minus the CPU of this process tree). A sample is **noisy** when its
  repeat's gate failed or other processes used more than ``FOREIGN_MAX_CORES`` on average
  (plus ``AUDIT_SLACK_CPU_S`` for the 10 ms resolution of the counters, which makes the audit
  blind in windows of a few ms: there only the gate speaks). Noisy samples are kept and counted
  in every table (column ``noisy``), never silently dropped.

Not handled: CPU frequency scaling and cache effects of the previous measurement; the rotation
of the order spreads them over the implementations instead.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import psutil

REPO_ROOT = Path(__file__).resolve().parent.parent

WORKERS = 2  # worker processes in every pool: one per vCPU of the target machine

IDLE_WINDOW_S = 0.5  # s; one psutil.cpu_percent window of the idle gate
IDLE_BUSY_MAX_PCT = 10.0  # % of all CPUs; above this the machine is not idle (0.2 of 2 cores)
FOREIGN_MAX_CORES = 0.15  # cores; others' mean CPU during a sample above this marks it noisy
AUDIT_SLACK_CPU_S = 0.04  # CPU s; counters tick every 10 ms per CPU and process: 4 ticks of slack

PROBE_MARK = "MPSCHED-BENCH-PROBE "  # prefix of the one stdout line a probe subprocess returns
PROBE_CODE = (
    "import importlib, json, sys\n"
    "module, _, name = sys.argv[1].partition(':')\n"
    "result = getattr(importlib.import_module(module), name)(**json.loads(sys.argv[2]))\n"
    f"print({PROBE_MARK!r} + json.dumps(result), flush=True)\n"
)
PROBE_GRACE_S = 3.0  # s; a probe's helpers (forkserver, trackers) get this long to exit
PROBE_POLL_S = 0.02  # s; poll period while waiting for them
PROBE_KILL_WAIT_S = 5.0  # s; how long killed processes get to disappear


class BenchmarkError(RuntimeError):
    """A benchmark produced a wrong result or could not run: the whole run must fail."""


def verify(ok: bool, what: str) -> None:
    """Fail loudly (not with ``assert``, which ``-O`` strips) when a result is wrong."""
    if not ok:
        raise BenchmarkError(f"wrong result: {what}")


# --------------------------------------------------------------------------- mpsched probe


def mpsched_status(*attributes: str) -> str | None:
    """Return None if ``mpsched`` has every named attribute, else why it is not available.

    Only ``ImportError`` and ``AttributeError`` count as "not available yet"; any other error
    while importing mpsched is a bug and propagates.
    """
    try:
        import mpsched  # optional until mpsched.Pool is written
    except (ImportError, AttributeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    missing = [name for name in attributes if not hasattr(mpsched, name)]
    if missing:
        return "AttributeError: no " + ", ".join(f"mpsched.{name}" for name in missing)
    return None


# --------------------------------------------------------------------------- noise


@dataclass(frozen=True)
class GateResult:
    """Outcome of the idle gate before one repeat."""

    busy_pct: float  # % of all CPUs busy in the last window
    waited_s: float  # s spent waiting
    quiet: bool  # busy_pct <= IDLE_BUSY_MAX_PCT


def wait_for_idle(max_wait_s: float) -> GateResult:
    """Wait until the machine is idle over one ``IDLE_WINDOW_S`` window, at most ``max_wait_s``."""
    start = time.monotonic()
    while True:
        busy = psutil.cpu_percent(interval=IDLE_WINDOW_S)
        waited = time.monotonic() - start
        if busy <= IDLE_BUSY_MAX_PCT or waited >= max_wait_s:
            return GateResult(busy_pct=busy, waited_s=waited, quiet=busy <= IDLE_BUSY_MAX_PCT)


class GatedRun:
    """Base of a benchmark's run context: its progress log, its idle gates within one waiting
    budget for the whole run, and the summing loop's calibration (measured once, after a gate).

    Subclasses (dataclasses) provide ``sizes`` (with ``idle_max_wait_s`` and ``idle_budget_s``),
    ``gates_waited_s`` and ``ns_per_iteration_cache``.
    """

    sizes: Any
    gates_waited_s: float
    ns_per_iteration_cache: float | None

    def log(self, message: str) -> None:
        """Progress goes to stderr; the tables go to stdout."""
        print(message, file=sys.stderr, flush=True)

    def gate(self) -> GateResult:
        """Wait for an idle machine, within what is left of the run's waiting budget.

        On a machine that stays busy, the gates would otherwise add minutes; once the budget is
        spent each gate samples one window, and the repeat is still marked when it is noisy.
        """
        left = max(0.0, self.sizes.idle_budget_s - self.gates_waited_s)
        result = wait_for_idle(min(self.sizes.idle_max_wait_s, left))
        self.gates_waited_s += result.waited_s
        return result

    def ns_per_iteration(self) -> float:
        """The summing loop's speed in this process (once per run, on an idle machine)."""
        if self.ns_per_iteration_cache is None:
            from benchmarks._workloads import calibrate_ns_per_iteration

            gate = self.gate()
            self.ns_per_iteration_cache = calibrate_ns_per_iteration()
            self.log(
                f"calibration: {self.ns_per_iteration_cache:.2f} ns per loop iteration"
                f"{'' if gate.quiet else ' (NOISY machine: sizes may be off)'}"
            )
        return self.ns_per_iteration_cache


def _system_busy_cpu_s() -> float:
    """CPU seconds the whole machine was busy since boot, steal (another VM) included."""
    t = psutil.cpu_times()
    # guest time is already part of user time on Linux.
    return t.user + t.nice + t.system + t.irq + t.softirq + t.steal


def _tree_cpu_s() -> dict[tuple[int, float], float]:
    """CPU seconds of this process and every live descendant, keyed by (pid, create time)."""
    me = psutil.Process()
    out: dict[tuple[int, float], float] = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            with proc.oneshot():
                t = proc.cpu_times()
                out[(proc.pid, proc.create_time())] = t.user + t.system
        except psutil.Error:  # exited between listing and reading: its CPU is lost
            continue
    return out


def _reaped_children_cpu_s() -> float:
    """CPU seconds of the descendants this process has already waited for."""
    t = os.times()
    return t.children_user + t.children_system


@dataclass(frozen=True)
class CpuUse:
    """What ``CpuAudit`` saw during one timed window."""

    wall_s: float
    foreign_cpu_s: float  # CPU s used outside this process tree (steal included), >= 0

    @property
    def foreign_cores(self) -> float:
        """Mean number of cores that other processes kept busy."""
        return self.foreign_cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def noisy(self) -> bool:
        """True when others used more than ``FOREIGN_MAX_CORES``, beyond the counters' slack."""
        return self.foreign_cpu_s > FOREIGN_MAX_CORES * self.wall_s + AUDIT_SLACK_CPU_S


class CpuAudit:
    """Context manager: how much CPU did processes outside this tree use during the block?

    After the block, ``result`` holds the answer. A descendant that exits inside the window
    without being reaped by us loses its CPU, which inflates the estimate: it errs towards
    "noisy".
    """

    def __init__(self) -> None:
        self.result: CpuUse | None = None

    def __enter__(self) -> CpuAudit:
        self._tree0 = _tree_cpu_s()
        self._reaped0 = _reaped_children_cpu_s()
        self._busy0 = _system_busy_cpu_s()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._t0
        busy = _system_busy_cpu_s() - self._busy0
        tree1 = _tree_cpu_s()
        own = sum(cpu - self._tree0.get(key, 0.0) for key, cpu in tree1.items())
        own += _reaped_children_cpu_s() - self._reaped0
        self.result = CpuUse(wall_s=wall, foreign_cpu_s=max(0.0, busy - own))


# --------------------------------------------------------------------------- samples, series


@dataclass(frozen=True)
class Measurement:
    """What one implementation returns for one repeat."""

    seconds: float  # the figure of merit: a wall time, or a per-repeat statistic (median latency)
    cpu: CpuUse | None = None  # from CpuAudit around the timed window; None = not audited
    extra: Mapping[str, float] = field(default_factory=dict)  # secondary figures, e.g. p90


@dataclass(frozen=True)
class Sample:
    """One measurement placed in its repeat."""

    repeat: int
    seconds: float
    cpu: CpuUse | None
    gate_quiet: bool
    extra: Mapping[str, float]

    @property
    def noisy(self) -> bool:
        """True when the machine was busy before or (by the audit) during this sample."""
        return not self.gate_quiet or (self.cpu is not None and self.cpu.noisy)


@dataclass(frozen=True)
class Impl:
    """One row of a workload: an implementation and how to measure it once."""

    name: str
    run: Callable[[], Measurement]
    needs: tuple[str, ...] = ()  # mpsched attributes it needs; empty = a peer (always runs)
    baseline: str | None = None  # name of the mpsched row its "vs mpsched" ratio refers to
    max_repeats: int | None = None  # cap for very slow peers; None = every repeat


@dataclass
class Series:
    """All samples of one implementation in one workload."""

    impl: Impl
    unavailable: str | None = None  # why it did not run (mpsched missing), or None
    samples: list[Sample] = field(default_factory=list)

    @property
    def name(self) -> str:
        """The row name."""
        return self.impl.name

    def by_repeat(self) -> dict[int, float]:
        """Seconds per repeat index."""
        return {s.repeat: s.seconds for s in self.samples}

    def median(self) -> float | None:
        """Median seconds, or None without samples."""
        return statistics.median(s.seconds for s in self.samples) if self.samples else None

    def extra_median(self, key: str) -> float | None:
        """Median of one secondary figure."""
        values = [s.extra[key] for s in self.samples if key in s.extra]
        return statistics.median(values) if values else None

    def to_json(self) -> dict[str, Any]:
        """Raw numbers for ``--json``."""
        return {
            "unavailable": self.unavailable,
            "median_s": self.median(),
            "samples": [asdict(s) | {"noisy": s.noisy} for s in self.samples],
        }


def paired_ratio(numerators: Sequence[Series], denominator: Series) -> float | None:
    """Median over repeats of ``min(numerators) / denominator`` taken in the same repeat.

    With one numerator this is the paired ratio of two rows; with several it compares the best
    of them in each repeat (e.g. the best chunked peer map). None when no repeat has both.
    """
    den = denominator.by_repeat()
    nums = [s.by_repeat() for s in numerators]
    ratios = [
        min(num[r] for num in nums) / den[r]
        for r in sorted(den)
        if den[r] > 0 and all(r in num for num in nums)
    ]
    return statistics.median(ratios) if ratios else None


@dataclass
class Workload:
    """The outcome of one workload: its rows, gates and shape."""

    key: str
    title: str
    unit: Literal["s", "ms", "us"]
    series: dict[str, Series]
    gates: list[GateResult]
    shape: Mapping[str, Any] = field(default_factory=dict)
    reference: str | None = None  # name of the reference row (physical limit), if any

    def __getitem__(self, name: str) -> Series:
        return self.series[name]

    def to_json(self) -> dict[str, Any]:
        """Raw numbers for ``--json``."""
        return {
            "title": self.title,
            "shape": dict(self.shape),
            "gates": [asdict(g) for g in self.gates],
            "series": {name: s.to_json() for name, s in self.series.items()},
        }


def run_interleaved(
    key: str,
    impls: Sequence[Impl],
    repeats: int,
    gate: Callable[[], GateResult],
    log: Callable[[str], None],
    verbose: bool = False,
) -> tuple[dict[str, Series], list[GateResult]]:
    """Run every available implementation once per repeat, rotating the order each repeat.

    ``gate`` runs before each repeat (normally ``wait_for_idle``). ``log`` gets one line per
    repeat and, if ``verbose``, one per sample.
    """
    series = {impl.name: Series(impl, unavailable=mpsched_status(*impl.needs)) for impl in impls}
    runnable = [s for s in series.values() if s.unavailable is None]
    gates: list[GateResult] = []
    for repeat in range(repeats):
        opened = gate()
        gates.append(opened)
        state = "idle" if opened.quiet else "NOISY"
        log(
            f"[{key}] repeat {repeat + 1}/{repeats}: {state}, {opened.busy_pct:.1f}% busy "
            f"(waited {opened.waited_s:.1f} s)"
        )
        shift = repeat % len(runnable) if runnable else 0
        for s in runnable[shift:] + runnable[:shift]:
            cap = s.impl.max_repeats
            if cap is not None and repeat >= cap:
                continue
            m = s.impl.run()
            sample = Sample(repeat, m.seconds, m.cpu, opened.quiet, dict(m.extra))
            s.samples.append(sample)
            if verbose:
                others = "" if m.cpu is None else f", others {m.cpu.foreign_cores:.2f} cores"
                log(f"    {s.name}: {m.seconds:.6g} s{others}{' NOISY' if sample.noisy else ''}")
    return series, gates


# --------------------------------------------------------------------------- formatting

UNIT_SCALE = {"s": 1.0, "ms": 1e3, "us": 1e6}


def fmt_time(seconds: float | None, unit: str) -> str:
    """Format seconds in ``unit`` with 3 significant figures or so."""
    if seconds is None:
        return "-"
    value = seconds * UNIT_SCALE[unit]
    digits = 3 if value < 1 else 2 if value < 10 else 1 if value < 100 else 0
    return f"{value:,.{digits}f} {unit}"


def fmt_ratio(ratio: float | None) -> str:
    """Format a time ratio as ``x1.23``."""
    return "-" if ratio is None else f"x{ratio:.2f}" if ratio < 100 else f"x{ratio:.0f}"


ExtraColumn = tuple[str, Callable[[Series], str]]


def render_table(workload: Workload, extra_columns: Sequence[ExtraColumn] = ()) -> str:
    """Plain-text table: impl | median | min-max | extras | vs mpsched | [vs reference] | noisy."""
    unit = workload.unit
    headers = ["impl", "median", "min-max", *(h for h, _ in extra_columns), "impl/mpsched"]
    reference = workload.series.get(workload.reference) if workload.reference else None
    if reference is not None:
        headers.append("impl/reference")
    headers.append("noisy")
    rows: list[list[str]] = []
    for s in workload.series.values():
        if s.unavailable is not None:
            rows.append([s.name, f"mpsched: not available ({s.unavailable})"])
            continue
        values = [x.seconds for x in s.samples]
        base = workload.series.get(s.impl.baseline) if s.impl.baseline else None
        vs_mpsched = "base" if s.impl.needs else "-"
        if base is not None:
            vs_mpsched = fmt_ratio(paired_ratio([s], base)) if base.samples else "-"
        row = [
            s.name,
            fmt_time(s.median(), unit),
            f"{fmt_time(min(values), unit)} - {fmt_time(max(values), unit)}" if values else "-",
            *(fn(s) for _, fn in extra_columns),
            vs_mpsched,
        ]
        if reference is not None:
            row.append(fmt_ratio(paired_ratio([s], reference)) if reference.samples else "-")
        row.append(f"{sum(x.noisy for x in s.samples)}/{len(s.samples)}")
        rows.append(row)
    return _layout(headers, rows)


def _layout(headers: list[str], rows: list[list[str]]) -> str:
    """Align columns; a short row (an unavailable impl) spans the remaining columns."""
    full = [r for r in rows if len(r) == len(headers)]
    widths = [max(len(r[i]) for r in [headers, *full]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        if len(cells) < len(headers):
            return " | ".join([cells[0].ljust(widths[0]), *cells[1:]])
        out = [cells[0].ljust(widths[0])]
        out += [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return " | ".join(out)

    rule = "-+-".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def describe_gates(gates: Sequence[GateResult]) -> str:
    """One line: how many repeats started on an idle machine."""
    quiet = sum(g.quiet for g in gates)
    worst = max((g.busy_pct for g in gates), default=0.0)
    note = "" if quiet == len(gates) else "  <- results of the noisy repeats are less reliable"
    return (
        f"idle gate: {quiet}/{len(gates)} repeats started idle (worst {worst:.1f}% busy; "
        f"noisy = gate failed or others > {FOREIGN_MAX_CORES} cores during the sample){note}"
    )


# --------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class TargetResult:
    """One checked target."""

    name: str
    status: Literal["PASS", "FAIL", "SKIP"]
    figure: str


def check_target(
    name: str, value: float | None, op: Literal["<=", ">=", ">"], limit: float, why_none: str
) -> TargetResult:
    """Compare ``value`` with ``limit``; SKIP (with ``why_none``) when there is no value."""
    if value is None:
        return TargetResult(name, "SKIP", why_none)
    ok = {"<=": value <= limit, ">=": value >= limit, ">": value > limit}[op]
    return TargetResult(name, "PASS" if ok else "FAIL", f"{value:.4g} (need {op} {limit:g})")


def render_targets(results: Iterable[TargetResult]) -> str:
    """The closing "targets" section."""
    rows = list(results)
    width = max((len(r.name) for r in rows), default=0)
    return "\n".join(f"{r.status:4}  {r.name.ljust(width)}  {r.figure}" for r in rows)


# --------------------------------------------------------------------------- processes


def run_probe(target: str, kwargs: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
    """Run ``module:function(**kwargs)`` in a fresh interpreter and return its JSON result.

    The probe gets its own session (process group), so whatever it starts (a forkserver, a Dask
    cluster) is killed with it on timeout. Helpers that outlive it by design (a forkserver, a
    resource tracker: they exit when they see their parent's pipe close) get
    ``PROBE_GRACE_S``; whatever is still running then is killed and reported.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        [sys.executable, "-c", PROBE_CODE, target, json.dumps(dict(kwargs))],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except BaseException:
        _kill_group(proc.pid, grace_s=0.0)
        proc.communicate()
        raise
    left = _kill_group(proc.pid, grace_s=PROBE_GRACE_S)
    if left:
        print(f"warning: probe {target} left {left} behind; killed them", file=sys.stderr)
    lines = [ln for ln in out.splitlines() if ln.startswith(PROBE_MARK)]
    if proc.returncode != 0 or not lines:
        raise BenchmarkError(f"probe {target} failed (exit {proc.returncode}):\n{err[-4000:]}")
    result: dict[str, Any] = json.loads(lines[-1][len(PROBE_MARK) :])
    return result


def _group_members(pgid: int) -> list[psutil.Process]:
    """Live (not zombie) processes of the process group ``pgid``."""
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc)
        except (psutil.Error, ProcessLookupError):
            continue
    return members


def _kill_group(pgid: int, grace_s: float) -> list[str]:
    """Give the group ``pgid`` (one we created) ``grace_s`` to exit, then SIGKILL the rest.

    Returns a description of the processes that had to be killed.
    """
    deadline = time.monotonic() + grace_s
    while (members := _group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(PROBE_POLL_S)
    killed = []
    for proc in members:
        try:
            killed.append(f"{proc.pid} {' '.join(proc.cmdline())[:80]}")
            proc.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(members, timeout=PROBE_KILL_WAIT_S)
    return killed


def kill_descendants() -> list[int]:
    """SIGKILL every live descendant of this process; return their pids."""
    victims = psutil.Process().children(recursive=True)
    for proc in victims:
        try:
            proc.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(victims, timeout=PROBE_KILL_WAIT_S)
    return [p.pid for p in victims]


def arm_watchdog(seconds: int) -> None:
    """After ``seconds``, dump every thread's stack, kill our descendants and exit with 3.

    Uses SIGALRM (no helper thread, so it does not make ``fork`` less safe). Pending alarms are
    not inherited by forked workers. ``seconds == 0`` disarms.
    """

    def on_alarm(signum: int, frame: types.FrameType | None) -> None:
        print(f"\nwatchdog: the benchmark ran longer than {seconds} s; stacks:", file=sys.stderr)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        kill_descendants()
        os._exit(3)

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)


def dump_json(path: Path, payload: Mapping[str, Any]) -> None:
    """Write the raw numbers."""
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")


def machine_info(dists: Sequence[str]) -> dict[str, Any]:
    """What the numbers were measured on: Python, platform, CPUs, the versions of ``dists``."""
    import importlib.metadata as md
    import multiprocessing
    import platform

    versions: dict[str, str | None] = {}
    for dist in dists:
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": multiprocessing.cpu_count(),
        "versions": versions,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def parse_workload_args(
    doc: str | None, workloads: Sequence[str], min_repeats: int, argv: Sequence[str] | None
) -> Any:
    """The command line shared by the workload benchmarks: ``--quick``, ``--repeats N``,
    ``--only a,b`` (checked against ``workloads``; all by default), ``--json PATH``, ``-v``."""
    import argparse

    p = argparse.ArgumentParser(description=doc.split("\n\n")[0] if doc else None)
    p.add_argument("--quick", action="store_true", help="small sizes, 3 repeats (smoke run)")
    p.add_argument("--repeats", type=int, help=f"repeats per workload (>= {min_repeats})")
    p.add_argument("--only", help="comma-separated workloads: " + ",".join(workloads))
    p.add_argument("--json", type=Path, metavar="PATH", help="dump the raw numbers here")
    p.add_argument("-v", "--verbose", action="store_true", help="log every sample to stderr")
    args = p.parse_args(argv)
    if args.repeats is not None and args.repeats < min_repeats:
        p.error(f"--repeats must be >= {min_repeats}")
    args.only = [k.strip() for k in args.only.split(",")] if args.only else list(workloads)
    unknown = sorted(set(args.only) - set(workloads))
    if unknown:
        p.error(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(workloads)}")
    return args


def start_workload_run(args: Any, quick: Any, default: Any) -> Any:
    """The sizes of a workload benchmark's run (``quick`` with ``--quick``, ``--repeats``
    applied; dataclasses with ``repeats`` and ``watchdog_s``), with its watchdog armed."""
    sizes = quick if args.quick else default
    if args.repeats is not None:
        sizes = replace(sizes, repeats=args.repeats)
    arm_watchdog(sizes.watchdog_s)
    return sizes


def finish_workload_run(
    args: Any,
    sizes: Any,
    status: str | None,
    run: GatedRun,
    workloads: Mapping[str, Workload],
    targets: Sequence[TargetResult],
    started: float,
    dists: Sequence[str],
) -> int:
    """The end of a workload benchmark (``parse_workload_args``): print the targets and the
    total time, dump the raw numbers if ``--json`` asked, disarm the watchdog. Returns 0."""
    elapsed = time.perf_counter() - started
    print("== targets ==")
    print(render_targets(targets))
    print(f"\ntotal time: {elapsed:.0f} s ({'quick' if args.quick else 'default'} sizes)")
    if args.json is not None:
        dump_json(
            args.json,
            {
                "machine": machine_info(dists),
                "sizes": asdict(sizes),
                "mpsched": status or "available",
                "ns_per_iteration": run.ns_per_iteration_cache,
                "workloads": {k: w.to_json() for k, w in workloads.items()},
                "targets": [asdict(t) for t in targets],
                "total_s": elapsed,
            },
        )
    arm_watchdog(0)
    return 0
