"""Tasks of the resource-exhaustion tests (``test_exhaustion.py``): importable, so that they
are tabled by reference like a user's module functions."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import mpsched


def ident(x: Any) -> Any:
    return x


def blob(n: int, fill: int = 7) -> bytes:
    return bytes([fill]) * n


def size_of(data: bytes) -> int:
    return len(data)


def kwargs_sizes(**kwargs: bytes) -> dict[str, int]:
    return {k: len(v) for k, v in kwargs.items()}


def spawn_then_join(n: int, arg_bytes: int) -> int:
    """Spawn ``n`` children (each with ``arg_bytes`` of arguments) without joining any, then
    join them all: more children than a deque holds, and (with big arguments) than the slab."""
    pad = b"c" * arg_bytes
    children = [mpsched.submit(child_value, i, pad) for i in range(n)]
    return sum(f.result() for f in children)


def child_value(i: int, pad: bytes) -> int:
    return i + len(pad)


def _numbered(i: int) -> Callable[[int], int]:
    def fn(x: int) -> int:
        return x + i

    # A module-level name and qualname: pickled by reference, so each one takes a function id.
    fn.__name__ = fn.__qualname__ = f"numbered_{i}"
    fn.__module__ = __name__
    return fn


NUMBERED = 4096 + 200  # more distinct module functions than a pool's table holds (FTAB_MAX_FIDS)
for _i in range(NUMBERED):
    globals()[f"numbered_{_i}"] = _numbered(_i)
del _i


def numbered(i: int) -> Callable[[int], int]:
    fn: Callable[[int], int] = globals()[f"numbered_{i}"]
    return fn


class Captured:
    """An object a closure captures (weakly referenceable: a test checks it is freed)."""

    def __init__(self, n: int) -> None:
        self.data = bytes(n)


def closure_over(obj: Captured) -> Callable[[], int]:
    """A closure (pickled inline, with its captured ``obj``, by cloudpickle)."""
    return lambda: len(obj.data)


def count(path: str) -> int:
    """Append one byte to ``path`` (O_APPEND: atomic across processes); the runs so far."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, b".")
    finally:
        os.close(fd)
    return 0


def nest(depth: int) -> int:
    """A chain of ``depth`` children, each joined by its parent (join-helping nests runs)."""
    if depth == 0:
        return 0
    return mpsched.submit(nest, depth - 1).result() + 1


def uids_past_the_counter_limit(start: int) -> list[bool]:
    """In a worker: whether each uid (children, stash keys) still names this worker's pid when
    its counter starts at ``start`` (2**31 is reached after ~2 billion spawns in one worker's
    life)."""
    from mpsched import _children

    worker = _children._current
    assert worker is not None
    worker.stash_counter = start
    return [worker.next_uid() >> 31 == worker.pid for _ in range(4)]


def spawn_past_the_counter_limit() -> int:
    """Children spawned and joined around the counter's wrap."""
    from mpsched import _children

    worker = _children._current
    assert worker is not None
    worker.stash_counter = 2**31 - 3
    return sum(mpsched.submit(ident, i).result() for i in range(6))
