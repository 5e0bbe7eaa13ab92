"""Task functions of the chaos test; module-level and light, so that each replacement worker
imports them quickly (the test module itself would pull pytest into every new worker)."""

from __future__ import annotations

import os
import struct
import time

import mpsched

RECORD = struct.Struct("qq")  # (task id, pid of the worker that ran it): one O_APPEND write

_log_fds: dict[str, int] = {}


def record(path: str, task_id: int) -> None:
    """Append ``(task_id, pid)`` to the log at ``path`` in one ``write`` (atomic with O_APPEND:
    records never interleave, so the log shows how many times, and where, each task ran)."""
    fd = _log_fds.get(path)
    if fd is None:
        fd = _log_fds[path] = os.open(path, os.O_WRONLY | os.O_APPEND)
    os.write(fd, RECORD.pack(task_id, os.getpid()))


def read_log(path: str) -> list[tuple[int, int]]:
    with open(path, "rb") as f:
        data = f.read()
    assert len(data) % RECORD.size == 0, "a torn record: O_APPEND writes must not interleave"
    return list(RECORD.iter_unpack(data))


def child_id(task_id: int, k: int) -> int:
    """The (negative) id of child ``k`` of task ``task_id``."""
    return -(task_id * 100 + k) - 1


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def leaf(path: str, task_id: int, seconds: float) -> int:
    """Work for ``seconds``, then record ``task_id``; returns it."""
    busy(seconds)
    record(path, task_id)
    return task_id


def parent(path: str, task_id: int, children: int, seconds: float) -> int:
    """Spawn ``children`` leaves with ``mpsched.submit``, work and record like a leaf, then join
    them (join-helping); returns ``task_id`` once every child's result checked out."""
    futures = [mpsched.submit(leaf, path, child_id(task_id, k), seconds) for k in range(children)]
    leaf(path, task_id, seconds)
    got = [f.result() for f in futures]
    if got != [child_id(task_id, k) for k in range(children)]:
        raise AssertionError(f"task {task_id}: wrong child results {got}")
    return task_id
