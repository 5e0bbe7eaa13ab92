"""A child of the user's ``os.fork()`` holds copies of the parent's pool and futures, and shares
the pool's memory with the parent. Cancelling there (``Future.cancel``, ``Pool.cancel``) must
not reach the parent's queues: it tombstoned the parent's task in its inbox and freed its block,
so the parent's future never settled."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from mpsched import Pool, PoolClosedError

from . import tasks
from .conditions import Fifos, wait_until

CHILD_DEADLINE = 10.0  # seconds the fork child gets to report
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _in_fork_child(action: object) -> int:
    """Run ``action()`` in a child of os.fork(); its exit code: 3 if it returned True, 4 if
    False, 5 if it raised."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            code = 3 if action() else 4  # type: ignore[operator]
        except BaseException:
            code = 5
        os._exit(code)
    deadline = time.monotonic() + CHILD_DEADLINE
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the fork child hung")
        time.sleep(0.005)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["future", "by_id"])
def test_a_fork_childs_cancel_does_not_withdraw_the_parents_task(fifos: Fifos, how: str) -> None:
    with Pool(1) as pool:
        blocker = pool.submit(tasks.started_then_gated, fifos.started, fifos.gate, 0)
        tasks.wait_started(fifos.started)
        if how == "future":
            queued = pool.submit(tasks.ident, 5)
        else:
            queued = pool.schedule("queued", 0.0, 0, tasks.ident, 5)
        # In the busy worker's inbox (handed out, not claimed): the copy a child could cancel.
        wait_until(lambda: queued._slot >= 0, "the task is in the worker's inbox")
        if how == "future":
            code = _in_fork_child(queued.cancel)
        else:
            code = _in_fork_child(lambda: pool.cancel("queued"))
        assert code == 4  # not the child's to cancel: it cancelled nothing
        tasks.open_gate(fifos.gate)
        assert blocker.result(timeout=10) == 0
        assert queued.result(timeout=10) == 5  # the parent's task ran


def _refused(call: Callable[[], object]) -> Callable[[], bool]:
    def action() -> bool:
        try:
            call()
        except PoolClosedError:
            return True
        return False

    return action


@pytest.mark.timeout(60)
@pytest.mark.parametrize("call", ["state", "statistics"])
def test_a_fork_childs_look_at_the_pool_does_not_wait_for_a_lock_the_fork_copied(
    call: str,
) -> None:
    """The child's copy of the coordinator's lock is taken if a thread of the parent's held
    it at the fork (a thread scheduling in a loop): ``state()`` hung there (a review saw 14
    of 40 children hang). Here the parent holds it across the fork."""
    with Pool(1) as pool:
        pool.schedule(7, 0.0, 0, tasks.ident, 7).result()
        method = getattr(pool, call)
        lock = pool._coordinator.lock
        lock.acquire()
        try:
            code = _in_fork_child(_refused(lambda: method(7) if call == "state" else method()))
        finally:
            lock.release()
        assert code == 3


def _a_new_forkserver_pool_works() -> bool:
    with Pool(1, start_method="forkserver") as pool:
        return bool(pool.submit(tasks.ident, 4).result(30) == 4)


@pytest.mark.timeout(60)
def test_a_fork_child_of_a_forkserver_pools_process_makes_a_pool_of_its_own() -> None:
    """The parent's pool refuses in the child, saying to make a new pool there; under
    forkserver that failed with ChildProcessError: multiprocessing asked ``waitpid`` about the
    parent's forkserver, which is no child of this process."""
    with Pool(1, start_method="forkserver") as pool:
        assert pool.submit(tasks.ident, 3).result(30) == 3
        assert _in_fork_child(_a_new_forkserver_pool_works) == 3


FOREIGN_FORKSERVER = """
import multiprocessing, multiprocessing.forkserver, os, sys
import mpsched

if __name__ == "__main__":
    server_child = multiprocessing.get_context("forkserver").Process(target=len, args=((),))
    server_child.start()
    server_child.join()
    assert "mpsched._lifecycle" not in sys.modules  # so its at-fork hook is not registered
    pid = os.fork()
    if pid == 0:
        # The number of the fd that kept the parent's server alive, now a file of the child's
        # own (a child that closed what it inherited and opened its own files).
        alive = multiprocessing.forkserver._forkserver._forkserver_alive_fd
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, alive)
        with mpsched.Pool(1, start_method="forkserver") as pool:
            print(pool.submit(abs, -3).result(timeout=20), flush=True)
        print(os.readlink(f"/proc/self/fd/{alive}"), flush=True)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.timeout(60)
def test_a_fork_child_of_a_program_with_a_forkserver_but_no_pool_makes_one(
    tmp_path: pathlib.Path,
) -> None:
    """The same, when the parent ran multiprocessing's forkserver but made no pool before the
    fork, so mpsched's at-fork hook did not exist yet: ``Pool()`` itself sees that the server
    is no child of its process (found by a review). It leaves alone the fd that kept the
    parent's server alive, whose number here names a file of the child's own (it was closed)."""
    script = tmp_path / "program.py"
    script.write_text(FOREIGN_FORKSERVER)
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=CHILD_DEADLINE * 3,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert (proc.returncode, proc.stdout) == (0, f"3\n{os.devnull}\n"), proc.stderr
