"""Ctrl-C (a real SIGINT, raised in the pool's process) at chosen steps of ``Pool()``: the
KeyboardInterrupt reaches the caller, and nothing of the pool is left: no process (the zygote
and the workers; under forkserver they are the forkserver's children, which the conftest's
check of this process's children skips), no fd, no semaphore name, no thread; and a new pool
works. Each step wraps a call of the start-up: the signal comes right after it returned, as a
Ctrl-C at the eval loop's check after that C call, before the caller stored what it made."""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil
import pytest

from mpsched import Pool, _layout, _lifecycle, _slab_region

from . import tasks
from .interrupts import sigint_after, sigint_before

NOTHING_LEFT_WITHIN = 8.0  # s for a pool the caller never got (dropped) to end by itself


# step -> (object, attribute, wrap): the call after (or before) which the SIGINT comes, and
# what the start-up left behind there before the fix.
STEPS: dict[str, tuple[Any, str, Callable[[Callable[..., Any]], Callable[..., Any]]]] = {
    "segment": (os, "memfd_create", sigint_after),  # the memfd, made before the try that undoes
    "wakeup": (os, "pipe2", sigint_after),  # the wake-up pipe, made before the PoolResources
    "lock": (_layout, "create_lock", sigint_after),  # semaphore names in /dev/shm
    "eventfd": (os, "eventfd", sigint_after),  # the eventfd, not yet in res.wake_fds
    # Inside the making of the views: the traceback kept views alive, and the undoing's
    # unmapping of the segment raised BufferError instead of the KeyboardInterrupt.
    "views": (_slab_region.SlabRegion, "__init__", sigint_after),
    "zygote": (os, "fork", sigint_after),  # fork: the zygote, not yet res.zygote (a zombie)
    # In the finally that unlinks the names, and before the pool was watched: the whole pool.
    "unlink": (_layout.SegmentLocks, "unlink_names", sigint_after),
    "watch": (_lifecycle.PoolResources, "watch", sigint_before),  # started, never watched
}


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def _names() -> set[str]:
    return {e for e in os.listdir("/dev/shm") if e.startswith(f"sem.mpsched-{os.getpid()}-")}


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("mpsched-")}


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("start_method", "step"),
    [
        (start_method, step)
        for start_method in ("fork", "forkserver")
        for step in STEPS
        # The bare fork of the zygote is the fork start method's.
        if step != "zygote" or start_method == "fork"
    ],
)
def test_a_ctrl_c_in_pool_creation_leaves_nothing_behind(
    step: str, start_method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: a Ctrl-C after a step that made an fd, a name or a process and before the store
    that recorded it (or in the ``finally`` that unlinks the names, or after the start-up,
    before the pool was watched for its drop) left it behind: fds, semaphore names in
    /dev/shm, a zombie zygote, or the whole pool (its thread waiting for ever, the zygote,
    the workers). Now SIGINT is held while the start-up makes anything."""
    with Pool(1, start_method=start_method) as warm:  # the forkserver runs, imports are done
        assert warm.submit(tasks.ident, 0).result(timeout=20) == 0
    before = (_descendants(), _fds(), _threads())
    target, name, wrap = STEPS[step]
    monkeypatch.setattr(target, name, wrap(getattr(target, name)))
    try:
        Pool(2, start_method=start_method)
    except KeyboardInterrupt:
        pass
    else:
        pytest.fail("the Ctrl-C did not reach the caller")
    finally:
        monkeypatch.undo()
    gc.collect()  # a pool made whole before the signal is the caller's to drop: it ends alone

    def left() -> list[str]:
        out = []
        if _descendants() - before[0]:
            out.append(f"processes {sorted(_descendants() - before[0])}")
        if (_fds() - before[1]) & _fds():
            out.append(f"fds {sorted(_fds() - before[1])}")
        if _names():
            out.append(f"names {sorted(_names())}")
        if _threads() - before[2]:
            out.append(f"threads {sorted(_threads() - before[2])}")
        return out

    deadline = time.monotonic() + NOTHING_LEFT_WITHIN
    while left() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not left(), f"a Ctrl-C at step {step!r} left {left()}"
    with Pool(1, start_method=start_method) as pool:
        assert pool.submit(tasks.ident, 1).result(timeout=20) == 1
