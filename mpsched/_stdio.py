"""Keeps the pool's file descriptors off the numbers 0, 1 and 2 (stdin, stdout, stderr).

A program may run with those closed (``python app.py >&-``, a daemon). The kernel then gives
the lowest free number to the next fd made, and a pool's memfd, eventfd or socket took one of
them, which a child process reads as its standard stream by convention: under spawn the
zygote's Python wrapped the segment's memfd as ``sys.stdout``, so a task's ``print`` wrote
over the segment's header, and under fork a C extension's ``printf`` or faulthandler's dump
did the same through the inherited number; the pool hung at shutdown or broke (found by a
hunt). ProcessPoolExecutor's workers do not carry its pipes on those numbers.

- The pool's process: ``stdio_held()`` puts /dev/null on the closed ones while ``Pool()``
  makes its fds (the zygote, forked or started then, gets none of them there), and closes those
  stand-ins after: the program's own descriptors stay as it left them. A worker's socket, which
  the coordinator thread receives later, goes above 2 by ``above_stdio``.
- The zygote (``zygote_main``), whose table every worker inherits by fork: ``above_stdio``
  moves an fd that it received on one of those numbers (under forkserver the server numbers
  them, and its own 0-2 may be closed: it started with the program's), then ``fill_stdio``
  puts /dev/null on every closed one for good, before it makes any fd of its own. A worker
  writing to its fd 1 then writes to /dev/null, as a closed stdout meant, or, under spawn,
  fails with EBADF: multiprocessing's child takes the lowest free number for a duplicate of
  its parent sentinel (a pipe's read end) before any code of ours runs.

Known gap: a thread of the program that puts a file of its own on one of those numbers while
a ``Pool()`` holds it for /dev/null loses that file as the pool closes its stand-in.
"""

from __future__ import annotations

import _thread
import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator

_STDIO = (0, 1, 2)
# Guards _held and _holders: pools may start in several threads. (_thread: the zygote, which
# imports this module, does not load threading.)
_lock = _thread.allocate_lock()
_held: list[int] = []  # the stand-ins that the first of the starting pools opened
_holders = 0  # how many Pool() calls are in stdio_held() now


def _is_closed(fd: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_GETFD)
    except OSError as exc:
        return exc.errno == errno.EBADF
    return False


def fill_stdio(*, inheritable: bool) -> list[int]:
    """Open /dev/null on each of 0, 1 and 2 that is closed; return those numbers. (Opened in
    increasing order, each lands on its number: the open takes the lowest one free.)"""
    filled = []
    for fd in _STDIO:
        if _is_closed(fd):
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:  # another thread took the number meanwhile: leave it theirs
                os.close(null)
                continue
            os.set_inheritable(fd, inheritable)
            filled.append(fd)
    return filled


@contextlib.contextmanager
def stdio_held() -> Iterator[None]:
    """The pool's process, around ``Pool()``'s making of fds: none of them lands on 0, 1 or 2.
    Three ``fcntl`` calls when all three are open (the common case)."""
    global _holders
    with _lock:
        if _holders == 0:
            # Not inheritable: a subprocess that another thread starts meanwhile gets the
            # program's closed numbers, as it would without the pool.
            _held[:] = fill_stdio(inheritable=False)
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0:
                for fd in _held:
                    with contextlib.suppress(OSError):
                        os.close(fd)
                _held.clear()


def dup_above_stdio(fd: int) -> int:
    """A CLOEXEC duplicate of ``fd`` on a number above 2."""
    dup: int = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    return dup


def above_stdio(fd: int) -> int:
    """``fd`` if above 2; else ``dup_above_stdio(fd)``, and ``fd`` is closed (also when that
    fails: EMFILE)."""
    if fd > 2:
        return fd
    try:
        return dup_above_stdio(fd)
    finally:
        os.close(fd)
