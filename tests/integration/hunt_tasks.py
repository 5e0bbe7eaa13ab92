"""Task functions for tests/integration/test_hunt_engine.py; module-level so workers import them."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import mpsched

from .tasks import gate, ident, read_log, record  # noqa: F401  (re-exported for the tests)


def record_ident(path: str, x: int) -> int:
    """Record ``x`` in the log at ``path`` (a side effect that shows each run), return it."""
    return record(path, x)


def fail_at(x: int, bad: int) -> int:
    if x == bad:
        raise ValueError(f"bad item {x}")
    return x


def started_gate_record(started: str, gate_path: str, path: str, x: int) -> int:
    """Announce (FIFO ``started``), wait at ``gate_path``, then record ``x``."""
    with open(started, "wb") as fifo:
        fifo.write(b"s")
    gate(gate_path)
    return record(path, x)


def parent_raises_after_children(path: str, n: int) -> None:
    for k in range(n):
        mpsched.submit(record, path, k)
    raise ValueError("parent failed")


def child_boom(message: str) -> None:
    raise KeyError(message)


def parent_catches_child_error() -> str:
    child = mpsched.submit(child_boom, "from child")
    try:
        child.result()
    except KeyError as exc:
        return f"caught {exc.args[0]}"
    return "not raised"


def chain(depth: int) -> int:
    """A chain of nested tasks ``depth`` deep, each joining its only child."""
    if depth == 0:
        return 0
    return mpsched.submit(chain, depth - 1).result() + 1


def cancel_own_child(gate_path: str) -> tuple[bool, bool]:
    """Spawn a child, cancel it before anything could claim it (we hold... nothing: a peer may
    steal it), return (cancel() returned, child.cancelled())."""
    child = mpsched.submit(ident, 1)
    ok = child.cancel()
    return ok, child.cancelled()


def exit_now(code: int) -> None:
    os._exit(code)


def huge_result(n: int) -> bytes:
    return b"y" * n


def kill_self_with_children(path: str, n: int) -> int:
    """Push ``n`` children into this worker's deque, then SIGKILL this worker: the children
    sit in the dead worker's deque."""
    for k in range(n):
        mpsched.submit(record, path, k)
    os.kill(os.getpid(), signal.SIGKILL)
    return -1  # pragma: no cover


def join_children_then_die(started: str, gate_path: str, path: str, n: int) -> int:
    futures = [mpsched.submit(record, path, k) for k in range(n)]
    with open(started, "wb") as fifo:
        fifo.write(str(os.getpid()).encode())
    gate(gate_path)
    return sum(f.result() for f in futures)


def unpicklable_result() -> Any:
    return lambda: None


def generator_result() -> Any:
    return (x for x in range(3))


def version() -> str:
    return sys.version
