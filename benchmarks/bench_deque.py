"""Costs of the shared-memory deque (mpsched._shm_deque), as a plain script.

    PYTHONPATH=. python benchmarks/bench_deque.py [--repeats 7] [--start-method forkserver]

Rows:
  push+pop pair              owner alone: push then pop, ns per pair
  push+pop(mark)+finish      the same, recording the claim in the run_stack (the worker's way)
  inject(1)+take_inbox       coordinator hands out one handle, owner takes it, ns per handle
  inject(64)+64 pop_or_take  batched hand-out (group64), ns per handle
  top-level task cycle       what each top-level task costs in queue operations: inject(64),
                             then per task pop_or_take(mark) + complete, then take_done(),
                             ns per task (no payload, no pickling)
  inject(64)+cancel+drain    coordinator cancels the last of 64 queued handles, then drains
                             (ns per round)
  steal, cross-process       a thief process empties a deque filled by the idle owner
  steal, empty (peek)        a thief looks at an empty victim (no lock taken)
  owner+thief throughput     owner process pushes 2 and pops 1 per step while a thief process
                             steals; total handles out per second (and the thief's share)

Each figure is the median over --repeats runs (min in brackets); single-process rows take the
best of many short batches inside a run, so that a preemption does not count. The machine's
busy share before each repeat is printed: figures measured on a busy machine are too high
(--wait-idle waits for a quiet moment first).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from mpsched._shm import AnonSegment, SemLockHandle, create_lock
from mpsched._shm_deque import SlotQueues, StealResult
from mpsched._slot_region import slot_bytes

DCAP = 1 << 16  # deque capacity: holds a whole steal batch
ICAP = 256
CCAP = 256  # done ring
BATCH = 2_000  # operations per timed batch in one process (short: a preemption spoils few)
BATCHES = 200  # best of this many batches
STEAL_HANDLES = 50_000
THROUGHPUT_STEPS = 100_000  # owner steps (push 2, pop 1) in the owner+thief row
IDLE_BUSY = 0.10  # share of all CPUs busy that still counts as idle for --wait-idle


def _cpu_busy(sample: float = 0.2) -> float:
    """Share of all CPUs busy during ``sample`` seconds (ours included)."""

    def read() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return sum(fields), fields[3] + fields[4]

    total0, idle0 = read()
    time.sleep(sample)  # a measurement window, not synchronisation
    total1, idle1 = read()
    return 1 - (idle1 - idle0) / max(total1 - total0, 1)


class Slots:
    """A segment with ``n`` slots, attachable in children."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.stride = slot_bytes(DCAP, ICAP, CCAP)
        self.seg = AnonSegment.create(n * self.stride + 64)
        self.locks: list[SemLockHandle] = [create_lock() for _ in range(n)]
        for k in range(n):
            self.attach(k, init=True)

    def attach(self, k: int, *, init: bool = False) -> SlotQueues:
        sq = SlotQueues(
            self.seg.buf[k * self.stride :],
            self.locks[k],
            DCAP,
            ICAP,
            done_capacity=CCAP,
            init=init,
        )
        self.seg.track(sq)
        return sq

    def flag(self) -> memoryview:
        """A bench-only word after the slots: "the owner is done"."""
        return self.seg.view(self.n * self.stride, 8, "q")

    def close(self) -> None:
        for lock in self.locks:
            lock.unlink()
        self.seg.close()


def _best_batch_ns(op: Callable[[int], None], per_batch: int) -> float:
    best = float("inf")
    for _ in range(BATCHES):
        t0 = time.perf_counter_ns()
        op(BATCH)
        best = min(best, (time.perf_counter_ns() - t0) / per_batch)
    return best


def single_process_rows() -> dict[str, float]:
    slots = Slots(1)
    sq = slots.attach(0)
    push, pop, finish = sq.push, sq.pop, sq.finish_running
    inject, take, pop_or_take = sq.inject, sq.take_inbox, sq.pop_or_take
    group = list(range(64))

    def loop(n: int) -> None:
        for _ in range(n):
            pass

    def push_pop(n: int) -> None:
        for i in range(n):
            push(i)
            pop()

    def push_pop_mark(n: int) -> None:
        for i in range(n):
            push(i)
            pop(True)
            finish()

    def inject_take(n: int) -> None:
        one = [7]
        for _ in range(n):
            inject(one)
            take()

    def inject_group(n: int) -> None:
        for _ in range(n // 64):
            inject(group)
            for _ in range(64):
                pop_or_take()

    def task_cycle(n: int) -> None:
        complete, take_done = sq.complete, sq.take_done
        for _ in range(n // 64):
            inject(group)
            for _ in range(64):
                complete(pop_or_take(True))
            take_done()

    def cancel(n: int) -> None:
        for _ in range(n // 64):
            inject(group)
            sq.cancel_injected(63)
            sq.drain()

    peek = slots.attach(0).steal

    def steal_empty(n: int) -> None:
        for _ in range(n):
            peek()

    rows = {
        "loop overhead": _best_batch_ns(loop, BATCH),
        "push+pop pair": _best_batch_ns(push_pop, BATCH),
        "push+pop(mark)+finish": _best_batch_ns(push_pop_mark, BATCH),
        "inject(1)+take_inbox": _best_batch_ns(inject_take, BATCH),
        "inject(64)+64 pop_or_take": _best_batch_ns(inject_group, BATCH // 64 * 64),
        "top-level task cycle": _best_batch_ns(task_cycle, BATCH // 64 * 64),
        "inject(64)+cancel+drain": _best_batch_ns(cancel, BATCH // 64),
        "steal, empty (peek)": _best_batch_ns(steal_empty, BATCH),
    }
    slots.close()
    return rows


def _thief(slots: Slots, until_empty: bool, conn: Connection) -> None:
    victim, mine, done = slots.attach(0), slots.attach(1), slots.flag()
    steal, finish = victim.steal, mine.finish_running
    conn.send("ready")
    conn.recv()
    got = retries = 0
    t0 = time.perf_counter_ns()
    while True:
        result, _ = steal(mine)
        if result == StealResult.SUCCESS:
            got += 1
            finish()
        elif result == StealResult.RETRY:
            retries += 1
        elif until_empty or done[0]:  # the owner sets it after its own last (empty) pop
            break
    conn.send((got, retries, time.perf_counter_ns() - t0))
    conn.close()


def _owner_steps(slots: Slots, conn: Connection) -> None:
    sq, done = slots.attach(0), slots.flag()
    push, pop, finish = sq.push, sq.pop, sq.finish_running
    conn.send("ready")
    conn.recv()
    popped = 0
    t0 = time.perf_counter_ns()
    for i in range(THROUGHPUT_STEPS):
        push(2 * i)
        push(2 * i + 1)
        if pop(True) >= 0:
            popped += 1
            finish()
    while pop(True) >= 0:
        popped += 1
        finish()
    elapsed = time.perf_counter_ns() - t0
    done[0] = 1
    conn.send((popped, elapsed))
    conn.close()


def _run(ctx: Any, jobs: list[tuple[Callable[..., None], tuple[Any, ...]]]) -> list[Any]:
    """Start every job, wait until all are ready, say go, return their answers."""
    started = []
    for target, args in jobs:
        parent_end, child_end = ctx.Pipe()
        proc = ctx.Process(target=target, args=(*args, child_end))
        proc.start()
        child_end.close()
        started.append((proc, parent_end))
    for _, conn in started:
        assert conn.recv() == "ready"
    for _, conn in started:
        conn.send("go")
    out = [conn.recv() for _, conn in started]
    for proc, conn in started:
        proc.join()
        assert proc.exitcode == 0
        proc.close()
        conn.close()
    return out


def cross_process_rows(ctx: Any) -> dict[str, float]:
    # steal cost: the owner filled the deque and stays idle while one thief empties it
    slots = Slots(2)
    owner = slots.attach(0)
    for h in range(STEAL_HANDLES):
        owner.push(h)
    [(got, _, elapsed)] = _run(ctx, [(_thief, (slots, True))])
    assert got == STEAL_HANDLES
    del owner
    slots.close()
    rows = {"steal, cross-process (ns)": elapsed / got}

    # throughput: the owner pushes 2 and pops 1 per step while the thief steals
    slots = Slots(2)
    (popped, owner_ns), (stolen, retries, thief_ns) = _run(
        ctx, [(_owner_steps, (slots,)), (_thief, (slots, False))]
    )
    slots.close()
    total = 2 * THROUGHPUT_STEPS
    assert popped + stolen == total, "a handle was lost or duplicated"
    rows["owner+thief, M handles/s"] = total / max(owner_ns, thief_ns) * 1e3
    rows["  thief share, %"] = 100 * stolen / total
    rows["  thief RETRY per steal"] = retries / max(stolen, 1)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--start-method", default="forkserver", choices=mp.get_all_start_methods())
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="S",
        help="before each repeat, wait up to S seconds for the machine to be idle (<10%% busy)",
    )
    args = parser.parse_args()
    ctx = mp.get_context(args.start_method)
    runs: dict[str, list[float]] = {}
    busy = []
    for _ in range(args.repeats):
        give_up = time.monotonic() + args.wait_idle
        while (load := _cpu_busy()) > IDLE_BUSY and time.monotonic() < give_up:
            pass
        busy.append(load)
        for name, value in (single_process_rows() | cross_process_rows(ctx)).items():
            runs.setdefault(name, []).append(value)
    print(
        f"bench_deque: {args.repeats} repeats, {args.start_method}, {os.cpu_count()} CPUs, "
        f"machine busy before each repeat: {', '.join(f'{b:.0%}' for b in busy)}"
    )
    print(f"{'row':34s} {'median':>10s} {'min':>10s}   (ns per op unless stated)")
    for name, values in runs.items():
        print(f"{name:34s} {statistics.median(values):10.1f} {min(values):10.1f}")


if __name__ == "__main__":
    main()
