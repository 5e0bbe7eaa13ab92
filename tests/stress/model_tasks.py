"""Task bodies of the timed-API model test (``test_timed_model``); module-level and light, so
that workers import them by reference without pulling in pytest or hypothesis.

Side effects are records appended to a log with one ``O_APPEND`` write each, so that "ran once"
and "never ran" are read off the log rather than inferred from futures."""

from __future__ import annotations

import ast
import os
import time
from typing import Any

import mpsched

RELEASE_POLL = 0.0005  # s between two looks of a holder at its release file


def append(path: str, record: Any) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{record!r}\n".encode())
    finally:
        os.close(fd)


def hold(path: str, release: str) -> int:
    """Keep this worker busy until the file ``release`` exists: log ``("held", id, version)``
    first, so that the test knows the worker runs it (claimed), and nothing else can run on
    this worker meanwhile. A file rather than a FIFO gate: the test's clean-up can release a
    holder that never started without blocking. The cancel flag is ignored (a run asked to
    stop may still return: it then completes). Returns its version."""
    ctx = mpsched.current_task()
    append(path, ("held", ctx.task_id, ctx.version))
    wait_for(release)
    return ctx.version


def wait_for(path: str) -> None:
    """Return once the file ``path`` exists."""
    while not os.path.exists(path):
        time.sleep(RELEASE_POLL)


def record(path: str, tag: Any = None) -> tuple[Any, int]:
    """Log ``("ran", id, version, cancel_requested)``, with ``tag`` for the id of a task that
    has none (``submit``); returns ``(id, version)`` as logged."""
    ctx = mpsched.current_task()
    task_id = tag if ctx.task_id is None else ctx.task_id
    append(path, ("ran", task_id, ctx.version, ctx.cancel_requested))
    return task_id, ctx.version


def read_log(path: str) -> list[tuple[Any, ...]]:
    """The complete records of the log, in write order (a line without its newline is being
    written: not a record yet)."""
    try:
        with open(path) as f:
            return [ast.literal_eval(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []
