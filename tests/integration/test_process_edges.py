"""How the pool behaves inside the user's process and the processes its tasks make: a task
that forks a process outliving it (a bare ``os.fork()``, as daemons and some libraries do), and
a Ctrl-C that ends a program whose pool is in no ``with`` block (a script in ``tmp_path``, as in
``test_exit_paths``)."""

from __future__ import annotations

import contextlib
import gc
import os
import pathlib
import resource
import signal
import subprocess
import sys
import time

import psutil
import pytest

from mpsched import Pool, WorkerCrashedError, _lifecycle
from mpsched._shm import SELECT_FD_LIMIT
from tests import closed_stdio

from . import proc_tasks, tasks
from .conditions import wait_until
from .test_exit_paths import ROOT, _run_and_interrupt

TIMEOUT = 20.0  # s; bound of every wait that must succeed
SOON = 5.0  # s; what the pool may take to notice a death or end, far below the helper's life


def _release(fifo: str, helper: int | None) -> None:
    """Let the helper go (it waits on the FIFO) and wait until it has exited: after its
    worker died it is no child of ours, so the leak check would not see it."""
    with contextlib.suppress(OSError):
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.write(fd, b"x")
        os.close(fd)
    if helper is not None:
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(helper).wait(TIMEOUT)


@pytest.mark.timeout(60)
def test_a_worker_death_is_seen_while_a_process_its_task_forked_lives(
    tmp_path: pathlib.Path,
) -> None:
    """The coordinator learns of a worker's death by EOF on the worker's socket. A process
    forked by a task inherited the worker's end of it, so a worker that died after such a task
    was noticed only once that process exited (never, for a daemon): the dead worker's task
    did not fail, its slot was not replaced and the shutdown waited the drain's timeout. The
    forked process is no worker either: ``mpsched.submit`` refuses to run there."""
    release, report = str(tmp_path / "release"), tmp_path / "report"
    os.mkfifo(release)
    helper = None
    pool = Pool(1)
    try:
        helper = pool.submit(proc_tasks.fork_helper, release, str(report)).result(TIMEOUT)
        with pytest.raises(WorkerCrashedError, match=r"exit code 3\b"):
            pool.submit(proc_tasks.exit_worker, 3).result(SOON)
        assert pool.submit(tasks.ident, 7).result(SOON) == 7  # the replacement runs it
        assert psutil.pid_exists(helper), "the helper should still be alive here"
        wait_until(lambda: report.exists() and report.read_text() != "", "the helper reported")
        assert report.read_text() == "submit refused"
        started = time.monotonic()
        pool.shutdown()
        assert time.monotonic() - started < SOON, "the shutdown waited for the helper"
    finally:
        _release(release, helper)
        pool.shutdown()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("nested", [False, True], ids=["task", "child task"])
@pytest.mark.parametrize(("how", "code"), [("exit", 3), ("return", 0), ("raise", 1)])
def test_a_process_forked_by_a_task_ends_when_it_leaves_the_task(
    how: str, code: int, nested: bool
) -> None:
    """A process forked by a task that leaves the task's code (``sys.exit()``, the usual end
    of a fork's child; a return; an exception) came back into the worker's: it reported the
    task in the worker's place (its SystemExit or value became the task's outcome), then ran
    the worker's loop beside it, and the worker's own report broke the pool (InternalError
    "not the innermost running task"). Now it ends there, as a program ends at its top level."""
    with Pool(1) as pool:
        assert pool.submit(proc_tasks.fork_child_leaves, how, nested).result(TIMEOUT) == (
            "task",
            code,
        )
        assert [pool.submit(tasks.ident, i).result(TIMEOUT) for i in range(20)] == list(range(20))
        assert pool.statistics().crashes == 0


@pytest.mark.timeout(60)
def test_a_process_forked_by_an_initializer_ends_when_it_leaves_it() -> None:
    """The same for the initializer: its forked child went on as a second worker of the
    slot, and the initializer waited for it for ever."""
    with Pool(1, initializer=proc_tasks.fork_in_initializer) as pool:
        assert pool.submit(proc_tasks.initializer_fork).result(TIMEOUT) == 0
        assert [pool.submit(tasks.ident, i).result(TIMEOUT) for i in range(20)] == list(range(20))


# Ctrl-C while the main thread waits on a result, in a program that never put the pool in a
# ``with`` block (or shut it down): the KeyboardInterrupt ends the program.
CTRL_C_OUTSIDE_WITH = """
if __name__ == "__main__":
    pool = mpsched.Pool(2, start_method=sys.argv[1])
    futures = [pool.submit(spin, 60.0) for _ in range(2)]
    when_main_in("result")
    futures[0].result()
"""


@pytest.mark.timeout(60)
def test_ctrl_c_that_ends_the_program_outside_a_with_block_stops_running_tasks(
    tmp_path: pathlib.Path,
) -> None:
    """The interpreter's exit (the atexit hook) shut the pool down with ``wait=True``: after a
    Ctrl-C had ended the program, with its traceback printed, the exit still waited for the
    60 s tasks. Ctrl-C means "stop now" (design.md, "Ctrl-C"), in a ``with`` block or not."""
    code, _, err = _run_and_interrupt(tmp_path, CTRL_C_OUTSIDE_WITH, "forkserver")
    assert code != 0
    assert err.count("Traceback (most recent call last)") == 1, err
    assert err.rstrip().endswith("KeyboardInterrupt"), err


class _FinalizedOnce:
    """Garbage in a reference cycle whose finalizer logs the pid of the process that ran it."""

    def __init__(self, log: str) -> None:
        self.log = log
        self.me = self

    def __del__(self) -> None:
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()}\n")


@pytest.mark.timeout(60)
def test_a_fork_pools_processes_never_finalize_garbage_of_the_pools_process(
    tmp_path: pathlib.Path,
) -> None:
    """Under fork the zygote is a copy of the user's process, and the workers copies of it: a
    garbage cycle not yet collected there was collected again in each of them, and its
    finalizer ran once per process (a file removed, a message sent, a line logged, twice).
    The zygote freezes what it inherited (``gc.freeze``): only the user's process finalizes."""
    log = str(tmp_path / "finalized")
    gc.disable()  # the cycle must still be there when the zygote is forked
    try:
        _FinalizedOnce(log)
        with Pool(2, start_method="fork") as pool:
            for _ in range(20):
                pool.submit(tasks.collect_garbage).result(timeout=TIMEOUT)
    finally:
        gc.enable()
    assert not os.path.exists(log)
    gc.collect()
    with open(log) as f:
        assert f.read().split() == [str(os.getpid())]


@pytest.mark.timeout(60)
def test_a_collection_in_a_fork_pools_worker_copies_none_of_the_inherited_heap() -> None:
    """A full collection writes to the header of every object it walks: in a worker forked
    with the user's heap (300,000 lists here, ~40 MiB), it made a private copy of every page
    that held one (measured before: +127 MiB in each worker for 10^6 lists). Frozen by the
    zygote, they are not walked."""
    heap = [[i, str(i)] for i in range(300_000)]
    with Pool(1, start_method="fork") as pool:
        growth = pool.submit(tasks.private_growth_of_a_collection).result(timeout=TIMEOUT)
    assert len(heap) == 300_000  # alive throughout
    assert growth < 4 * 2**20


# A program that ignores SIGCHLD (a daemon's way to have no zombies) has the kernel reap its
# children itself, and a fork or forkserver zygote inherits the setting (the forkserver through
# exec): a worker's death made the zygote's waitpid fail (ECHILD), and the pool broke. A server
# whose SIGCHLD handler reaps every child (``waitpid(-1)``) did the same to a fork zygote, which
# inherited the handler. Under spawn the zygote is the program's own child: when the kernel
# reaped it, the pool's end raised in its thread (closing a "running" Process) and left an fd.
SIGCHLD_PROGRAM = """
import os, signal, sys
import mpsched

def die():
    os.kill(os.getpid(), signal.SIGKILL)

def reap(signum, frame):
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass

def sigchld_handler():
    handler = signal.getsignal(signal.SIGCHLD)
    if handler == signal.SIG_IGN:
        return "ignored"
    return "default" if handler == signal.SIG_DFL else handler.__name__

def a_crash_in_a_pool():
    with mpsched.Pool(2, start_method=sys.argv[1]) as pool:
        try:
            pool.submit(die).result(timeout=20)
        except mpsched.WorkerCrashedError:
            print("crash reported", flush=True)
        print("after:", pool.submit(abs, -5).result(timeout=20), flush=True)
        print("workers:", pool.submit(sigchld_handler).result(timeout=20), flush=True)
    return len(os.listdir("/proc/self/fd"))

if __name__ == "__main__":
    signal.signal(signal.SIGCHLD, signal.SIG_IGN if sys.argv[2] == "ignored" else reap)
    first = a_crash_in_a_pool()  # multiprocessing's own helpers (a forkserver) stay open
    print("fds left by a second pool:", a_crash_in_a_pool() - first, flush=True)
"""


def _run_program(
    tmp_path: pathlib.Path, text: str, *args: str, timeout: float
) -> subprocess.CompletedProcess[str]:
    """Run the program ``text`` with ``args`` to its end, in a session of its own (a signal to
    its process group must not reach pytest)."""
    script = tmp_path / "prog.py"
    script.write_text(text)
    return subprocess.run(
        [sys.executable, str(script), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        start_new_session=True,
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
@pytest.mark.parametrize("sigchld", ["ignored", "reap"])
def test_a_program_that_ignores_or_reaps_sigchld_keeps_its_pool_through_a_worker_crash(
    tmp_path: pathlib.Path, start_method: str, sigchld: str
) -> None:
    result = _run_program(tmp_path, SIGCHLD_PROGRAM, start_method, sigchld, timeout=50)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert "crash reported" in result.stdout, result.stdout
    assert "after: 5" in result.stdout, result.stdout
    # The workers keep the program's setting (the zygote alone takes the default back); a
    # Python handler travels only by fork (exec resets it: forkserver, spawn).
    kept = sigchld if sigchld == "ignored" or start_method == "fork" else "default"
    assert f"workers: {kept}" in result.stdout, result.stdout
    assert "fds left by a second pool: 0" in result.stdout, result.stdout


# A SIGCHLD handler that the first task's module sets as it is imported: under forkserver and spawn
# the zygote imports that module at the first task (START) and takes the default action back for
# itself (its reaping needs it), so it must hand the module's handler on to the workers, which
# have the module from their fork and never import it again. Under fork each worker imports it
# itself. A mutation hunt found the hand-on unpinned (the workers had the default action).
SIGCHLD_MODULE = """
import signal

def noted(signum, frame):
    pass

signal.signal(signal.SIGCHLD, noted)

def sigchld_handler():
    handler = signal.getsignal(signal.SIGCHLD)
    return getattr(handler, "__name__", str(handler))
"""

SIGCHLD_AT_IMPORT_PROGRAM = """
import os, sys
import mpsched

if __name__ == "__main__":
    with mpsched.Pool(1, start_method=sys.argv[1]) as pool:
        import sets_sigchld  # after Pool(), as the first task's module: the zygote imports it
        print("workers:", pool.submit(sets_sigchld.sigchld_handler).result(timeout=20), flush=True)
        try:
            pool.submit(os._exit, 3).result(timeout=20)
        except mpsched.WorkerCrashedError:
            print("crash reported", flush=True)
        print("replacement:", pool.submit(sets_sigchld.sigchld_handler).result(timeout=20))
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_a_sigchld_handler_set_by_the_first_tasks_module_reaches_every_worker(
    tmp_path: pathlib.Path, start_method: str
) -> None:
    """The handler that the first task's module set at its import is the workers' (the first
    and a replacement), as if each had imported the module itself."""
    (tmp_path / "sets_sigchld.py").write_text(SIGCHLD_MODULE)
    result = _run_program(tmp_path, SIGCHLD_AT_IMPORT_PROGRAM, start_method, timeout=50)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "workers: noted",
        "crash reported",
        "replacement: noted",
    ], result.stderr


# A worker that cannot start for now: the pool's process out of fds as work wakes a dormant
# worker, or the zygote's fork failing with EAGAIN (a process limit: RLIMIT_NPROC, which does
# not bind root, or a container's pids.max; here a stand-in for os.fork in the zygote, a copy
# of this process under fork). The pool broke for good at the first such failure, even while
# a worker ran (found in review); now it warns, runs the work on the workers it has, and asks
# again later; with no worker at all it breaks after SPAWN_GIVE_UP, saying why.
SPAWN_FAILURE_PROGRAM = """
import errno
import os
import resource
import signal
import sys
import time
import mpsched
import mpsched._coordinator

def nap(x):
    time.sleep(0.02)
    return x

def running(pool):
    return sum(1 for w in pool.statistics().per_worker if w.pid)

def busy(pool, n):
    return sorted(f.result(timeout=20) for f in [pool.submit(nap, i) for i in range(n)])

mode, flag = sys.argv[1], sys.argv[2]
real_fork, me = os.fork, os.getpid()

def fork():
    if os.getpid() != me and os.path.exists(flag):  # in the zygote, while the flag is there
        raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
    return real_fork()

os.fork = fork

if __name__ == "__main__":
    if mode == "give-up":
        mpsched._coordinator.SPAWN_GIVE_UP = 1.0
        open(flag, "w").close()
        pool = mpsched.Pool(1, start_method="fork")
        try:
            pool.submit(nap, 1).result(timeout=20)
        except mpsched.BrokenPoolError as exc:
            print("broken:", exc)
        pool.shutdown()
        sys.exit()
    if mode == "stranded":
        # Failures for longer than the give-up while a worker ran, then that worker dies:
        # the clock starts then (it counted from the first failure: the pool broke at once).
        mpsched._coordinator.SPAWN_GIVE_UP = 1.0
        with mpsched.Pool(2, start_method="fork") as pool:
            busy(pool, 1)
            open(flag, "w").close()
            started = time.monotonic()
            while time.monotonic() - started < 1.5:
                busy(pool, 4)  # the dormant worker is wanted, and cannot start
            os.kill(next(w.pid for w in pool.statistics().per_worker if w.pid), 9)
            coordinator = pool._coordinator
            while coordinator.stranded_since is None and coordinator.broken is None:
                time.sleep(0.01)  # until its replacement failed too
            os.unlink(flag)
            print(busy(pool, 2))
        sys.exit()
    with mpsched.Pool(2, start_method="fork") as pool:
        print(busy(pool, 1), running(pool))  # the other worker is dormant
        held = []
        if mode == "fds":
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))
            try:
                while True:
                    held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                pass
        else:
            open(flag, "w").close()
        print(busy(pool, 40) == list(range(40)), running(pool))
        for fd in held:
            os.close(fd)
        if os.path.exists(flag):
            os.unlink(flag)
        while running(pool) < 2:
            busy(pool, 40)
        print(busy(pool, 4), running(pool))
"""


def _run_spawn_failure_program(
    tmp_path: pathlib.Path, mode: str
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "prog.py"
    script.write_text(SPAWN_FAILURE_PROGRAM)
    return subprocess.run(
        [sys.executable, str(script), mode, str(tmp_path / "flag")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=50,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["fds", "fork"])
def test_a_worker_that_cannot_start_for_now_is_asked_for_again(
    tmp_path: pathlib.Path, mode: str
) -> None:
    result = _run_spawn_failure_program(tmp_path, mode)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[0] 1", "True 1", "[0, 1, 2, 3] 2"], result.stderr
    assert "a worker of the pool could not start" in result.stderr, result.stderr


@pytest.mark.timeout(60)
def test_a_pool_whose_last_worker_dies_while_spawns_fail_waits_for_a_replacement(
    tmp_path: pathlib.Path,
) -> None:
    result = _run_spawn_failure_program(tmp_path, "stranded")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[0, 1]"], result.stdout + result.stderr


@pytest.mark.timeout(60)
def test_a_pool_none_of_whose_workers_can_start_breaks_saying_why(tmp_path: pathlib.Path) -> None:
    result = _run_spawn_failure_program(tmp_path, "give-up")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("broken: no worker could start for 1 s: [Errno 11]"), (
        result.stdout + result.stderr
    )


# A program run with stdin, stdout and stderr closed (``>&-``, a daemon): the pool's memfd,
# eventfds and sockets took those numbers, which a child reads as its standard streams. Under
# spawn the zygote's Python wrapped the memfd as sys.stdout, so a task's print wrote over the
# segment's header; under fork a C library's write to fd 1 did the same: the pool hung at
# shutdown or broke (found by a hunt). Its report goes to a file (argv[2]).
CLOSED_STDIO_PROGRAM = """
import ctypes, multiprocessing.forkserver, sys
import mpsched
from tests.closed_stdio import reporter, where

def write_all(n):
    print("x" * n)  # sys.stdout is None where fd 1 was closed as Python started
    libc = ctypes.CDLL(None)
    for fd in (1, 2):  # as a C extension's printf would
        libc.write(fd, b"y" * n, n)
    return [where(fd) for fd in (0, 1, 2)]

if __name__ == "__main__":
    report = reporter(sys.argv[1])
    if sys.argv[2] == "forkserver":  # a server started with them closed numbers our fds there
        multiprocessing.forkserver.ensure_running()  # (its pipe to us may take one)
    report("mine", [where(fd) for fd in (1, 2)])
    with mpsched.Pool(2, start_method=sys.argv[2]) as pool:
        report("task", pool.submit(write_all, 5000).result(timeout=20))
        report("mine", [where(fd) for fd in (1, 2)])
        report("map", sum(pool.map(abs, range(-100, 0), timeout=20)))
        report("task", pool.submit(write_all, 300).result(timeout=20))
    report("mine", [where(fd) for fd in (1, 2)])
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_a_program_with_its_standard_streams_closed_gives_its_workers_none_of_the_pools_fds(
    tmp_path: pathlib.Path, start_method: str
) -> None:
    returncode, lines = closed_stdio.run(tmp_path, CLOSED_STDIO_PROGRAM, start_method, timeout=50)
    assert returncode == 0, lines
    for name, value in lines:
        if name == "task":  # fd 0 may be multiprocessing's own pipe, but none of the pool's
            assert not any(kind in value[0] for kind in ("memfd", "socket", "eventfd")), lines
    mine = lines[0][1]  # the program's own 1 and 2 stay as it left them
    assert mine == ["closed", "closed"] or start_method == "forkserver", lines
    assert [(name, value[1:] if name == "task" else value) for name, value in lines] == [
        ("mine", mine),
        ("task", ["/dev/null", "/dev/null"]),
        ("mine", mine),
        ("map", 5050),
        ("task", ["/dev/null", "/dev/null"]),
        ("mine", mine),
    ], lines


@pytest.mark.timeout(90)
@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_a_pool_in_a_process_with_over_1024_fds_open_works_and_ends(start_method: str) -> None:
    """``select()`` refuses an fd from FD_SETSIZE (1024) on, and a program with many files or
    sockets open gives its pool such fds: the pool broke at a timed task due within the loop's
    fine wait ("filedescriptor out of range in select()"), and its end raised in the
    coordinator thread (the wait for the release; under fork, the zygote's join)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 2 * SELECT_FD_LIMIT
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.skip(f"the hard limit of open files ({hard}) is below {wanted}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    fds: list[int] = []
    try:
        while not fds or fds[-1] < SELECT_FD_LIMIT:  # every lower number taken: the pool's fds
            fds.append(os.open(os.devnull, os.O_RDONLY))  # come above
        with Pool(1, start_method=start_method) as pool:
            assert pool.submit(abs, -1).result(timeout=30) == 1
            now = time.monotonic()
            futures = [pool.schedule(k, now + k / 200, 0, abs, -k) for k in range(1, 9)]
            assert [f.result(timeout=30) for f in futures] == list(range(1, 9))
    finally:
        for fd in fds:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.timeout(120)
def test_a_spawn_pools_end_does_not_wait_for_a_process_its_task_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under spawn the zygote is multiprocessing's child, whose timed join watches a pipe that
    the zygote's descendants inherit: a process that a task left running (``cmd &``) kept it
    open, and the pool's end waited the whole ``ZYGOTE_JOIN_TIMEOUT`` (lengthened here) for a
    zygote that had exited. The join watches the zygote's pid."""
    monkeypatch.setattr(_lifecycle, "ZYGOTE_JOIN_TIMEOUT", 60.0)
    pool = Pool(1, start_method="spawn")
    left = pool.submit(proc_tasks.leave_a_process, proc_tasks.HELPER_MAX_S).result(timeout=30)
    try:
        began = time.monotonic()
        pool.shutdown(wait=True)
        assert time.monotonic() - began < 30.0  # a few ms; 60 s before
    finally:
        pool.shutdown(wait=False)
        with contextlib.suppress(ProcessLookupError):
            os.kill(left, signal.SIGKILL)


# A program that set SIGPIPE's default action back (command-line tools do, for ``| head``):
# a write of the pool's to the socket of a child that just died killed it, silently (-13).
SIGPIPE_DEFAULT = """
import os, signal, sys
import mpsched
from mpsched import _protocol, _worker

def fetch_then_die(self, key):  # the worker dies (the OOM killer, say) as its arguments come
    self.conn.send_bytes(_protocol.encode(_protocol.Tag.FETCH, key))
    os.kill(os.getpid(), signal.SIGKILL)

def size(data):
    return len(data)

if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    if sys.argv[1] == "payload":  # the coordinator thread answers FETCH to a dead worker
        _worker.Worker.fetch = fetch_then_die  # (fork: the workers have it)
        with mpsched.Pool(1, start_method="fork") as pool:
            assert pool.submit(abs, -1).result() == 1
            try:
                pool.submit(size, b"z" * (8 << 20)).result(timeout=60)
            except mpsched.WorkerCrashedError:
                print("crashed", flush=True)
    else:  # a user's thread sends START to a dead zygote (forkserver: at the first submit)
        pool = mpsched.Pool(1, start_method="forkserver")
        zygote = pool._resources.zygote
        os.kill(zygote.pid, signal.SIGKILL)
        zygote.join()
        try:
            pool.submit(abs, -1).result(timeout=60)
        except mpsched.BrokenPoolError:
            print("broken", flush=True)
        pool.shutdown()
    print("end", flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("case", "said"), [("payload", "crashed"), ("start", "broken")])
def test_a_program_with_sigpipes_default_action_survives_a_dead_child(
    tmp_path: pathlib.Path, case: str, said: str
) -> None:
    result = _run_program(tmp_path, SIGPIPE_DEFAULT, case, timeout=100)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert result.stdout.split() == [said, "end"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["result", "done"])
def test_a_child_future_in_a_process_forked_by_its_task_refuses(how: str) -> None:
    """The fork's child shares the worker's deque, run stack and slab: its join popped a child
    off the worker's deque and ran it there (then the task's completion broke the pool), and
    its ``done()`` freed a child's block (then the task's join waited for ever)."""
    with Pool(1) as pool:
        assert pool.submit(proc_tasks.fork_then_touch_a_child_future, how).result(30) == (3, 42, 2)
        assert pool.submit(pow, 2, 5).result(30) == 32


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["wait", "as_completed"])
def test_a_child_future_given_to_concurrent_futures_says_why_it_cannot_be(how: str) -> None:
    """They failed with "'ChildFuture' object has no attribute '_condition'"."""
    with Pool(1) as pool:
        message = pool.submit(proc_tasks.wait_on_a_child_future, how).result(30)
    assert "join it with result()" in message


@pytest.mark.timeout(60)
def test_a_done_callback_runs_with_sigpipe_unblocked() -> None:
    """SIGPIPE blocked for the coordinator thread's life went to the callbacks' thread it
    starts, and through exec to what callbacks ran (``yes | head`` ended with an error)."""
    masks: list[set[int]] = []
    with Pool(1) as pool:
        future = pool.submit(tasks.ident, 1)
        future.add_done_callback(
            lambda _: masks.append(signal.pthread_sigmask(signal.SIG_BLOCK, []))
        )
        assert future.result(30) == 1
    assert len(masks) == 1
    assert signal.SIGPIPE not in masks[0]
