"""Pool.statistics: the snapshot's types (``PoolStatistics``, ``WorkerStatistics``) and its read.

Called from: ``Pool.statistics`` (any user thread). The shared memory is read under
``PoolResources.memory_lock`` and only while it is there (the
coordinator thread unmaps it under that lock once its loop ended after a shutdown). Nothing
here writes: the values are racy reads of counters that the workers and the coordinator write
(hints). While the pool runs, a slot's counters come from shared memory; once it ended, from
``Coordinator.final_stats`` (which the coordinator thread fills before the memory goes), and
queue depths and pids read 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpsched._pool import Pool

_NO_COUNTERS = {"executed": 0, "stolen": 0}


@dataclass(frozen=True)
class WorkerStatistics:
    """One worker slot's counters (``PoolStatistics.per_worker``).

    ``executed`` counts the tasks that ran to their end in this slot: top-level tasks (a
    ``map`` chunk is one) and children, wherever they were spawned (one its spawner ran inline
    too); a run its worker died in is not counted. ``stolen``: tasks it took from a peer's
    queues. Both add up over every worker that ran in the slot (a replacement after a crash or
    a recycling goes on counting). A run is counted just before its result is published, so a
    snapshot taken after a future is done counts its run (a worker that dies in between counts
    a run whose task then fails). ``pid`` is 0 while the slot's worker is starting (under
    forkserver and spawn without an initializer, until the pool's first task; the pool learns
    the pid from the zygote, which may tell it after the worker began its first task), while
    the slot is dormant (no worker forked yet: the pool has not had that many tasks at once,
    nor a child for a peer to steal; docs/design.md, "Dormant workers") and after the pool
    ended.
    ``inbox_depth`` counts the entries in its inbox: tasks handed to it and not claimed yet,
    and the entries a cancel left (tombstones) until the worker's claims reach them;
    ``deque_depth``, the children queued in its deque.
    """

    slot: int
    pid: int
    executed: int
    stolen: int
    inbox_depth: int
    deque_depth: int


@dataclass(frozen=True)
class PoolStatistics:
    """A snapshot of the pool's counters (racy reads of shared counters: hints).

    Attributes:
        workers: the pool's number of worker slots.
        submitted: the top-level tasks the pool took: each ``submit`` and ``schedule`` (a
            superseded or cancelled one too), each chunk of a ``map`` and each run of a
            recurring task.
        completed: the top-level runs a worker ended (returned or raised; a retried task
            once), so ``completed <= submitted``; children are in ``per_worker[k].executed``
            only.
        pending: tasks due and not yet handed to a worker.
        scheduled: versions waiting for their ``run_at`` (or behind a running version).
        steals: tasks taken from a peer's queues, the sum of ``per_worker[k].stolen``.
        crashes: workers that died other than by retiring, killed on purpose too (a forced
            cancel, a timeout's grace, an interrupted ``with`` block).
        respawns: replacements for those (none for a death once the drain's work is done).
        retried: runs queued again after their worker died (the ``retries`` option; a retry
            cancelled before it started counts too).
        recycled: workers retired after ``max_tasks_per_worker`` tasks (replaced unless the
            pool was draining with nothing left to run).
        misfires: recurring runs skipped by the misfire policy.
        skipped_runs: recurring due times dropped: by the overlap policy "skip" or
            "coalesce" (times that passed during a run), and after a run skipped as a
            misfire, whatever the overlap policy (the times that passed while that run
            waited: the next run is due at the grid time after now).
        per_worker: one ``WorkerStatistics`` per slot.
    """

    workers: int
    submitted: int
    completed: int
    pending: int
    scheduled: int
    steals: int
    crashes: int
    respawns: int
    retried: int
    recycled: int
    misfires: int
    skipped_runs: int
    per_worker: tuple[WorkerStatistics, ...]


def snapshot(pool: Pool) -> PoolStatistics:
    """``Pool.statistics``: the shared memory is read under ``PoolResources.memory_lock`` (a
    reentrant one), so it is not unmapped meanwhile. No other lock of the pool is taken: a
    signal handler (or a finalizer) that interrupted a call of the pool holding one, a submit
    holding ``Coordinator.lock``, waited for its own thread, and the whole pool with it (found
    by a hunt). ``pending`` is read without that lock: a hint, as the other counts."""
    coord = pool._coordinator
    resources = pool._resources
    pending = max(0, coord.ready.live())  # (two counts, which a compaction moves one by one)
    per_worker = []
    # The coordinator thread may unmap the memory once its loop ended (after a shutdown):
    # read it only while it is there, under the lock the unmapping takes.
    with resources.memory_lock:
        live = pool._started and not resources.memory_released
        for k, slot in enumerate(pool._views.slots):
            counters = coord.final_stats.get(k) or (slot.counters() if live else _NO_COUNTERS)
            worker = coord.workers[k]
            deque_, inbox = slot.depths() if live else (0, 0)
            per_worker.append(
                WorkerStatistics(
                    slot=k,
                    pid=worker.pid if worker is not None else 0,
                    executed=counters["executed"],
                    stolen=counters["stolen"],
                    inbox_depth=inbox,
                    deque_depth=deque_,
                )
            )
    return PoolStatistics(
        workers=pool._workers,
        submitted=coord.submitted,
        completed=coord.completed,
        pending=pending,
        scheduled=len(coord.timetable.heap),
        steals=sum(w.stolen for w in per_worker),
        crashes=coord.crashes,
        respawns=coord.respawns,
        retried=coord.retried,
        recycled=coord.recycled,
        misfires=coord.misfires,
        skipped_runs=coord.skipped_runs,
        per_worker=tuple(per_worker),
    )
