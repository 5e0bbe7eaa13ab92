"""Tasks for test_process_edges.py: tasks that fork a process which outlives them, or whose
forked process ends by coming back out of the task's code."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

import mpsched

HELPER_MAX_S = 60.0  # s; a helper exits by then in any case


def fork_helper(release: str, report: str) -> int:
    """Fork a helper that lives on after this task, until the test opens the FIFO ``release``
    (as a task that starts a background process with a bare ``os.fork()``). The helper writes
    into the file ``report`` what ``mpsched.submit`` did there. Returns the helper's pid."""
    gate = os.open(release, os.O_RDONLY | os.O_NONBLOCK)  # open before the test writes to it
    pid = os.fork()
    if pid == 0:
        try:
            try:
                mpsched.submit(abs, -1)
                outcome = "submit worked"
            except RuntimeError:
                outcome = "submit refused"
            with open(report, "w") as f:
                f.write(outcome)
            select.select([gate], [], [], HELPER_MAX_S)
        finally:
            os._exit(0)
    os.close(gate)
    return pid


def exit_worker(code: int) -> None:
    os._exit(code)


CHILD_EXIT_WAIT_S = 10.0  # s; a forked child that ends at once has by then, on a loaded host
# The forked child was still running after CHILD_EXIT_WAIT_S: it went on as a worker.
CHILD_HUNG = "hung"
_initializer_fork: int | str | None = None  # what fork_in_initializer's child ended with


def _wait_child(pid: int) -> int | str:
    """The exit code of child ``pid``, or CHILD_HUNG (then killed) if it is still running
    after CHILD_EXIT_WAIT_S."""
    pidfd = os.pidfd_open(pid)
    try:
        if not select.select([pidfd], [], [], CHILD_EXIT_WAIT_S)[0]:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return CHILD_HUNG
    finally:
        os.close(pidfd)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _fork_and_leave(how: str) -> int | str | None:
    """Fork; the child leaves the caller's code as ``how`` says (``exit``: ``sys.exit(3)``,
    ``return``, ``raise``: a ValueError), back into whatever called it. Returns, in the parent,
    the child's exit code (or CHILD_HUNG); in the child, None (``return``)."""
    pid = os.fork()
    if pid == 0:
        if how == "exit":
            sys.exit(3)
        if how == "raise":
            raise ValueError("raised in the forked child")
        return None
    return _wait_child(pid)


def fork_child_leaves(how: str, nested: bool = False) -> tuple[str, int | str | None]:
    """A task (``nested``: a child task, joined) whose forked child comes back out of it."""
    if nested:
        return mpsched.submit(fork_child_leaves, how).result()  # type: ignore[no-any-return]
    code = _fork_and_leave(how)
    return ("forked child", code) if code is None else ("task", code)


def fork_in_initializer() -> None:
    """An initializer whose forked child returns from it."""
    global _initializer_fork
    code = _fork_and_leave("return")
    if code is not None:
        _initializer_fork = code


def initializer_fork() -> int | str | None:
    return _initializer_fork


def leave_a_process(seconds: float) -> int:
    """Start a process that outlives the task and inherits the worker's fds (as a shell's
    ``cmd &`` does); return its pid."""
    return subprocess.Popen(["sleep", str(seconds)], close_fds=False).pid


def _double(x: int) -> int:
    return 2 * x


def fork_then_touch_a_child_future(how: str) -> tuple[int, int, int]:
    """Spawn two children, fork, and in the fork's child call ``how`` (``result`` on a child
    still queued, ``done`` on one that ran and is not collected) on one; that process's exit
    code is 3 if the call raised RuntimeError, 4 if it returned. Then join both here."""
    first = mpsched.submit(_double, 1)
    second = mpsched.submit(_double, 21)
    if how == "done":
        first.result()  # the join runs second (the deque's back) first: done, not collected
    pid = os.fork()
    if pid == 0:
        code = 4
        try:
            second.result() if how == "result" else second.done()
        except RuntimeError:
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), second.result(), first.result()


def wait_on_a_child_future(how: str) -> str:
    """Hand a child's future to ``concurrent.futures`` (``how``: wait, as_completed); the
    TypeError's message, after the child is joined."""
    import concurrent.futures

    child = mpsched.submit(_double, 1)
    try:
        if how == "wait":
            concurrent.futures.wait([child])  # type: ignore[list-item]
        else:
            list(concurrent.futures.as_completed([child]))  # type: ignore[list-item]
    except TypeError as exc:
        assert child.result() == 2
        return str(exc)
    return "no error"
