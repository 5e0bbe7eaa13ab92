"""How a program that uses a pool ends: Ctrl-C at each place the main thread can block (the
``with`` block's exit, ``shutdown(wait=True)``, ``Pool()`` itself), SIGTERM and a dropped pool
at interpreter exit. Each runs in a fresh interpreter (a script in ``tmp_path``, like a user's
program), and the test checks the aftermath: the exit comes in time, every process the script
started is gone, nothing of it is left in /dev/shm, and stderr holds only what the user's own
code raised."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from mpsched import BrokenPoolError, Pool
from mpsched._coordinator import Coordinator

from . import tasks
from .conditions import still_running

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXIT_DEADLINE = 20.0  # s from the signal to the script's exit (the tasks spin for 60 s)
GONE_DEADLINE = 5.0  # s from the script's exit until every process it started is gone

# The script's helpers: a task that spins, and ``when_main_in(name)``, which prints "ready"
# once the main thread's stack holds a frame of the function ``name`` (polled with a deadline:
# the test then knows where the main thread blocks when it sends the signal).
PRELUDE = """
import json, sys, threading, time
import mpsched

def spin(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    return seconds

def when_main_in(name):
    main = threading.main_thread().ident
    def watch():
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            frame = sys._current_frames().get(main)
            while frame is not None:
                if frame.f_code.co_name == name:
                    print("ready", flush=True)
                    return
                frame = frame.f_back
            time.sleep(0.001)
    threading.Thread(target=watch, daemon=True).start()
"""

# Ctrl-C while leaving a ``with`` block normally: __exit__ waits for two 60 s tasks.
WITH_EXIT = """
if __name__ == "__main__":
    with mpsched.Pool(2, start_method=sys.argv[1]) as pool:
        futures = [pool.submit(spin, 60.0) for _ in range(2)]
        when_main_in("await_termination")
"""

# Ctrl-C while an explicit shutdown(wait=True) waits for two 60 s tasks.
SHUTDOWN_WAIT = """
if __name__ == "__main__":
    pool = mpsched.Pool(2, start_method=sys.argv[1])
    futures = [pool.submit(spin, 60.0) for _ in range(2)]
    when_main_in("await_termination")
    pool.shutdown(wait=True)
"""


def _run(
    tmp_path: pathlib.Path, body: str, start_method: str, timeout: float, prelude: str = PRELUDE
) -> subprocess.CompletedProcess[str]:
    """Run ``prelude`` + ``body`` to its end (bounded by ``timeout`` seconds)."""
    script = tmp_path / "prog.py"
    script.write_text(prelude + body)
    return subprocess.run(
        [sys.executable, str(script), start_method],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        start_new_session=True,  # a signal to its process group (pid 0) must not reach pytest
    )


def _run_and_interrupt(
    tmp_path: pathlib.Path, body: str, start_method: str, sig: int = signal.SIGINT
) -> tuple[int, str, str]:
    """Run PRELUDE + ``body``; once it prints "ready", send ``sig``. Returns (returncode,
    stdout, stderr) after checking that the exit came within EXIT_DEADLINE and that every
    process the script started is gone within GONE_DEADLINE."""
    script = tmp_path / "prog.py"
    script.write_text(PRELUDE + body)
    proc = subprocess.Popen(
        [sys.executable, str(script), start_method],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    descendants: list[psutil.Process] = []
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "ready", line + (proc.stderr.read() if proc.stderr else "")
        descendants = psutil.Process(proc.pid).children(recursive=True)
        if sig:  # 0: the script interrupts itself
            os.kill(proc.pid, sig)
        try:
            out, err = proc.communicate(timeout=EXIT_DEADLINE)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the script did not exit within {EXIT_DEADLINE} s of the signal")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        alive = still_running(descendants, GONE_DEADLINE)
        for leftover in alive:
            leftover.kill()
    assert not alive, f"processes of the script still alive after its exit: {alive}"
    left = [n for n in os.listdir("/dev/shm") if f"mpsched-{proc.pid}-" in n]
    assert not left, f"left in /dev/shm: {left}"
    return proc.returncode, out, err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
@pytest.mark.parametrize("body", [WITH_EXIT, SHUTDOWN_WAIT], ids=["with-exit", "shutdown"])
def test_ctrl_c_while_waiting_for_the_shutdown_stops_running_tasks(
    tmp_path: pathlib.Path, body: str, start_method: str
) -> None:
    """Ctrl-C means "stop now" (design.md, "Ctrl-C"): also when it comes while the pool already
    waits for its running tasks, in ``__exit__`` or in ``shutdown(wait=True)``. The interpreter's
    exit must not then wait (in the atexit hook) for the 60 s tasks."""
    code, _, err = _run_and_interrupt(tmp_path, body, start_method)
    assert code != 0
    assert err.count("Traceback (most recent call last)") == 1, err
    assert err.rstrip().endswith("KeyboardInterrupt"), err


# Ctrl-C at interpreter exit while it waits for a dropped pool (``join_dropped``): the pool was
# never shut down and its two 60 s tasks still run when the script's main code ends.
DROPPED_EXIT = """
if __name__ == "__main__":
    pool = mpsched.Pool(2, start_method=sys.argv[1])
    futures = [pool.submit(spin, 60.0) for _ in range(2)]
    del pool, futures
    when_main_in("join_dropped")
"""


@pytest.mark.timeout(60)
def test_ctrl_c_while_the_exit_waits_for_a_dropped_pool_stops_its_tasks(
    tmp_path: pathlib.Path,
) -> None:
    """As for a pool still referenced: Ctrl-C while the interpreter's exit waits for a dropped
    pool's running tasks ends the program now, with one report and nothing left behind. (Who
    stops the tasks is not observable from outside: ``join_dropped`` stops the pool, and the
    zygote would kill the workers anyway once the exiting process closes its socket.)"""
    _, _, err = _run_and_interrupt(tmp_path, DROPPED_EXIT, "forkserver")
    # The interpreter reports an exception in an atexit hook and goes on with its exit.
    assert err.startswith("Exception ignored in atexit callback"), err
    assert err.count("Traceback (most recent call last)") == 1, err
    assert err.rstrip().endswith("KeyboardInterrupt:"), err


# Ctrl-C inside Pool(), before the zygote's READY. Under spawn the zygote imports the main
# module as __mp_main__ before it reads its config: there it sends the SIGINT to the script,
# then waits until the script has closed its end of the control socket (its Pool() gave up)
# and only then goes on to send READY.
CTOR = """
import os, select, signal

def _wait_for_hang_up():
    sockets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                sockets.append(int(fd))
        except OSError:  # the fd of the listing itself
            pass
    poller = select.poll()
    for fd in sockets:
        poller.register(fd, select.POLLIN | select.POLLHUP)
    poller.poll(30_000)

if __name__ == "__mp_main__":  # the zygote, importing the main module
    os.kill(os.getppid(), signal.SIGINT)
    _wait_for_hang_up()

if __name__ == "__main__":
    print("ready", flush=True)
    try:
        mpsched.Pool(2, start_method=sys.argv[1])
    except KeyboardInterrupt:
        print("interrupted", flush=True)
"""


@pytest.mark.timeout(60)
def test_ctrl_c_in_pool_creation_leaves_nothing_and_prints_nothing(
    tmp_path: pathlib.Path,
) -> None:
    """The zygote finds its coordinator gone when it reports READY: it must exit quietly (no
    BrokenPipeError traceback on the user's terminal), like after READY (``_coordinator_gone``)."""
    code, out, err = _run_and_interrupt(tmp_path, CTOR, "spawn", sig=0)
    assert code == 0, err
    assert "interrupted" in out
    assert err == ""


@pytest.mark.timeout(60)
def test_an_interrupted_exit_kills_a_task_on_a_worker_not_registered_yet(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker runs tasks before the coordinator thread has read its SPAWNED (design.md:
    "No worker is waited for"). A kill request (Ctrl-C leaving a ``with`` block, i.e.
    ``abort_running``; or ``cancel(force=True)``) for a task running there must not be dropped
    because the worker's pid is not known yet: it must wait for the registration. Here the
    coordinator thread is kept from reading the zygote's messages until the request was seen."""
    gate = threading.Event()
    applied = threading.Event()
    read_zygote_message = Coordinator.on_zygote_message
    apply_requests = Coordinator.apply_requests

    def gated(self: Coordinator, block: bool) -> None:
        if gate.is_set():
            read_zygote_message(self, block)

    def noted(self: Coordinator) -> None:
        apply_requests(self)
        applied.set()

    monkeypatch.setattr(Coordinator, "on_zygote_message", gated)
    monkeypatch.setattr(Coordinator, "apply_requests", noted)
    pool = Pool(1, start_method="fork")
    try:
        future = pool.submit(tasks.spin, 30.0)
        deadline = time.monotonic() + 20.0
        while pool._views.slots[0].run_depth() < 1:  # the unregistered worker runs it
            assert time.monotonic() < deadline, "the worker did not start the task"
            time.sleep(0.001)
        assert pool._coordinator.workers == [None]
        # What __exit__ does on a KeyboardInterrupt.
        pool.shutdown(wait=False, cancel_futures=True)
        pool._coordinator.abort_running()
        assert applied.wait(20.0), "the coordinator thread did not take the kill request"
        gate.set()
        assert pool.await_termination(timeout=10.0), "the running task was not killed"
        assert future.cancelled()
    finally:
        gate.set()
        if not pool.await_termination(timeout=0):  # failed: do not wait for the 30 s task
            os.kill(pool._zygote.pid, signal.SIGKILL)
        pool.shutdown(wait=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_a_pool_that_breaks_ends_a_worker_it_had_not_registered_yet(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path, start_method: str
) -> None:
    """A worker runs tasks before the coordinator thread has read its SPAWNED, which carries
    the coordinator's end of the worker's socket. The pool breaking then (its initializer
    failing in a registered peer; here an error injected into the loop) closed the sockets
    of the registered workers only: this one's stayed open in the zygote's unread message, so
    it never saw an EOF and lived on, idle once its task ended, until the pool's shutdown.
    Now the break shuts the zygote's control socket, and the zygote kills every worker."""
    started, gate = str(tmp_path / "started"), str(tmp_path / "gate")
    os.mkfifo(started)
    os.mkfifo(gate)
    breaking = threading.Event()

    def unread(self: Coordinator, block: bool) -> None:  # reads nothing, until it raises
        if breaking.is_set():
            raise RuntimeError("an injected internal error")

    monkeypatch.setattr(Coordinator, "on_zygote_message", unread)
    pool = Pool(1, start_method=start_method)
    try:
        future = pool.submit(tasks.report_pid_then_gate, started, gate)
        worker = psutil.Process(tasks.read_pid(started))  # it runs the task, unregistered
        assert pool._coordinator.workers == [None]
        breaking.set()
        pool._wakeup.wakeup()  # the zygote's unread SPAWNED wakes the loop anyway
        with pytest.raises(BrokenPoolError, match="injected"):
            future.result(timeout=20)
        worker.wait(20)  # killed at its gate, which nobody opens
    finally:
        if not breaking.is_set():
            tasks.open_gate(gate)
        pool.shutdown(wait=True)


# os.fork() by user code while a pool is alive: the child inherits the Pool object but not its
# coordinator thread. The child tries the pool, then ends normally (its atexit hooks run).
USER_FORK = """
import os

if __name__ == "__main__":
    pool = mpsched.Pool(2, start_method=sys.argv[1])
    assert pool.submit(abs, -3).result(timeout=20) == 3
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        try:
            pool.submit(abs, -4)
            outcome = "submit worked"
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        os.write(write_end, outcome.encode())
        os.close(write_end)
        sys.exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        print("child:", pipe.read(), flush=True)
    deadline = time.monotonic() + 10.0
    while not os.waitpid(pid, os.WNOHANG)[0]:
        if time.monotonic() > deadline:
            print("child hung at exit", flush=True)
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            break
        time.sleep(0.01)
    else:
        print("child exited", flush=True)
    print("parent:", pool.submit(abs, -5).result(timeout=20), flush=True)
    pool.shutdown()
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_a_user_fork_child_neither_uses_nor_waits_for_the_parents_pool(
    tmp_path: pathlib.Path, start_method: str
) -> None:
    """The pool belongs to the process that created it. In a child of ``os.fork()`` it must
    refuse work with a clear error (a submit there went to the parent's workers through the
    shared memory, behind the parent's coordinator's back), and the child's exit must not wait
    for a drain that no thread of the child will ever run (the atexit hook hung)."""
    result = _run(tmp_path, USER_FORK, start_method, timeout=50)
    assert result.returncode == 0, result.stderr
    assert "child: PoolClosedError" in result.stdout, result.stdout
    assert "os.fork()" in result.stdout, result.stdout  # the error says why
    assert "child exited" in result.stdout, result.stdout
    assert "parent: 5" in result.stdout, result.stdout
    # Python 3.12+ warns, rightly, of the program's own fork of a process with threads (the
    # pool's coordinator thread); nothing else may be printed.
    warning = re.compile(r".*DeprecationWarning: This process .* is multi-threaded.*\n.*\n")
    assert warning.sub("", result.stderr) == ""


# Task functions defined in the main module (spawn and forkserver import it again, as
# __mp_main__), and a pool that is never shut down: the interpreter's exit (the atexit hook)
# must still run what was submitted and end every process, quietly.
MAIN_MODULE_TASKS = """
import os
import psutil

def square(x):
    return x * x

def record(path, x):
    time.sleep(0.05)  # still running when the script ends
    with open(path, "a") as f:
        f.write(f"{x}\\n")

class AddOne:
    def __call__(self, x):
        return x + 1

if __name__ == "__main__":
    pool = mpsched.Pool(2, start_method=sys.argv[1])
    print(pool.submit(square, 3).result(timeout=20), list(pool.map(square, range(4))))
    print(pool.submit(AddOne(), 1).result(timeout=20), pool.submit(lambda: 7).result(timeout=20))
    for x in range(4):
        pool.submit(record, "done.txt", x)
    children = psutil.Process().children(recursive=True)
    print("pids", *[f"{p.pid}@{p.create_time()}" for p in children], flush=True)
    del pool  # dropped, never shut down
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_main_module_tasks_and_a_pool_never_shut_down(
    tmp_path: pathlib.Path, start_method: str
) -> None:
    result = _run(tmp_path, MAIN_MODULE_TASKS, start_method, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    assert lines[:2] == ["9 [0, 1, 4, 9]", "2 7"], result.stdout
    assert sorted((tmp_path / "done.txt").read_text().split()) == ["0", "1", "2", "3"]
    started = [p.split("@") for p in lines[2].split()[1:]]
    assert started
    procs = []
    for pid, create_time in started:
        try:
            proc = psutil.Process(int(pid))
        except psutil.NoSuchProcess:
            continue
        if proc.create_time() == float(create_time):  # not a new process with a reused pid
            procs.append(proc)
    alive = still_running(procs, GONE_DEADLINE)
    for leftover in alive:
        leftover.kill()
    assert not alive, f"processes of the script still alive after its exit: {alive}"


# A pool shut down without waiting, then dropped ("finish in the background"): its drop was
# not delivered (its release was already asked for), so the exit hook, which waited only for
# the pools it found dropped, left it to multiprocessing's hook, which terminated the zygote
# (forkserver, spawn; under fork the exit closed its socket), and its tasks died unfinished
# (0 of 4, found in review). ProcessPoolExecutor's exit waits for them.
SHUT_DOWN_THEN_DROPPED = """
def record(path, x):
    time.sleep(0.2)  # still running when the script ends
    with open(path, "a") as f:
        f.write(f"{x}\\n")

def finish_in_the_background():
    pool = mpsched.Pool(2, start_method=sys.argv[1])
    for x in range(4):
        pool.submit(record, "done.txt", x)
    pool.shutdown(wait=False)

if __name__ == "__main__":
    finish_in_the_background()
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_the_exit_waits_for_a_pool_shut_down_without_waiting_then_dropped(
    tmp_path: pathlib.Path, start_method: str
) -> None:
    result = _run(tmp_path, SHUT_DOWN_THEN_DROPPED, start_method, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    done = tmp_path / "done.txt"
    assert done.exists(), "no task ended"
    assert sorted(done.read_text().split()) == ["0", "1", "2", "3"]


# Pools at the interpreter's exit, in atexit handlers (which run last registered first). The
# exit hook of mpsched was registered when ``Pool`` was first imported, not with the package:
# a handler registered after ``import mpsched`` but before the first ``Pool()`` found the pools
# shut down, and a pool first made in a handler was cut off with its task (the hook,
# registered during the exit, never ran). One registered before ``import mpsched`` runs after
# the hook: a pool made there is refused. (Python 3.12.0-3.12.2 themselves refuse a fork or a
# new thread in an atexit handler, gh-104690: no pool can start there; 3.12.3 and 3.13 allow
# them again, gh-113964.)
ATEXIT_HANDLERS = """
import atexit, sys, time

def too_late():
    try:
        mpsched.Pool(1)
        print("too late: started", flush=True)
    except mpsched.PoolClosedError as exc:
        print("too late:", "import mpsched before" in str(exc), flush=True)

atexit.register(too_late)
import mpsched

def record(path):
    time.sleep(0.05)  # still running when the handler returns
    with open(path, "w") as f:
        f.write("ran")

def drops_a_pool():
    try:
        mpsched.Pool(1, start_method=sys.argv[1]).submit(record, "done.txt")
    except RuntimeError as exc:  # Python 3.12.0-3.12.2: no fork and no new thread then
        print("drops:", str(exc).startswith("can't "), flush=True)

def uses_the_pool():
    print("uses:", POOL.submit(pow, 2, 10).result(timeout=20), flush=True)

if __name__ == "__main__":
    atexit.register(drops_a_pool)
    atexit.register(uses_the_pool)
    POOL = mpsched.Pool(2, start_method=sys.argv[1])
"""


def _threads_start_in_atexit_handlers() -> bool:
    """Whether this interpreter starts a thread in an atexit handler (not 3.12.0-3.12.2): asked
    of it, not read from its version number."""
    probe = (
        "import atexit, threading\natexit.register(lambda: threading.Thread(target=int).start())"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=30
    )
    return "can't create new thread" not in result.stderr


@pytest.mark.timeout(90)
@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_pools_in_atexit_handlers_run_their_tasks_or_are_refused_clearly(
    tmp_path: pathlib.Path, start_method: str
) -> None:
    result = _run(tmp_path, ATEXIT_HANDLERS, start_method, timeout=60, prelude="")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    if not _threads_start_in_atexit_handlers():  # the interpreter refuses: the error is Python's
        assert result.stdout.splitlines() == ["uses: 1024", "drops: True", "too late: True"]
        assert not (tmp_path / "done.txt").exists()
    else:
        assert result.stdout.splitlines() == ["uses: 1024", "too late: True"], result.stdout
        assert (tmp_path / "done.txt").read_text() == "ran"


# The process's first pool made in an atexit handler: ``mpsched.Pool`` is imported there, after
# the interpreter's threading exit hooks ran, and ``concurrent.futures.process`` refused to
# register its own (RuntimeError: "can't register atexit after shutdown"; leak hunt). That
# hook runs at once then: dropped, a ProcessPoolExecutor of a later handler (never shut down)
# started workers that nothing stopped, and the exit hung (diff review); the stdlib refuses.
FIRST_POOL_AT_EXIT = """
import atexit, sys
import mpsched

def first_pool():
    try:
        with mpsched.Pool(2, start_method=sys.argv[1]) as pool:
            print("first:", pool.submit(pow, 2, 10).result(timeout=20), flush=True)
    except RuntimeError as exc:  # Python 3.12.0-3.12.2: no fork and no new thread then
        print("refused:", exc, flush=True)

def executor_after_it():
    from concurrent.futures import ProcessPoolExecutor
    try:
        ProcessPoolExecutor(1).submit(pow, 3, 3)
    except RuntimeError as exc:
        print("executor:", exc, flush=True)

if __name__ == "__main__":
    atexit.register(executor_after_it)
    atexit.register(first_pool)  # runs first
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_the_first_pool_made_in_an_atexit_handler_runs_its_task(
    tmp_path: pathlib.Path, start_method: str
) -> None:
    result = _run(tmp_path, FIRST_POOL_AT_EXIT, start_method, timeout=60, prelude="")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    if _threads_start_in_atexit_handlers():
        assert result.stdout.splitlines() == [
            "first: 1024",
            "executor: cannot schedule new futures after interpreter shutdown",
        ], result.stdout
    else:  # the interpreter refuses: the error is Python's, about the thread or the fork
        assert "register atexit" not in result.stdout, result.stdout


# A SIGINT (a Ctrl-C in the terminal reaches the whole process group) while the zygote starts,
# before ``zygote_main`` ignores it: the zygote's interpreter raised KeyboardInterrupt in its
# default handler, printed a traceback beside the caller's (under spawn, at times "Fatal Python
# error: init_import_site") and died, and the pool broke (leak hunt). Sent by the zygote to
# itself, so that it lands there: under spawn as it imports the main module (as
# ``__mp_main__``); under fork right after the fork, of a pool made in a thread (the main
# thread's start-up holds a Ctrl-C, and a fork keeps that handler).
SIGINT_AS_THE_ZYGOTE_STARTS = """
import os, signal, sys, threading
import mpsched

MAIN = int(os.environ.setdefault("MPSCHED_TEST_MAIN_PID", str(os.getpid())))

def interrupt_the_zygote():
    if os.getppid() == MAIN:  # the zygote, not a worker (the zygote's child)
        os.kill(os.getpid(), signal.SIGINT)

if __name__ == "__mp_main__":
    interrupt_the_zygote()

def run():
    with mpsched.Pool(1, start_method=sys.argv[1]) as pool:
        print(pool.submit(abs, -3).result(timeout=20), flush=True)

if __name__ == "__main__":
    if sys.argv[1] == "fork":
        os.register_at_fork(after_in_child=interrupt_the_zygote)
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
    else:
        run()
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_sigint_as_the_zygote_starts_is_ignored_there(
    tmp_path: pathlib.Path, start_method: str
) -> None:
    result = _run(tmp_path, SIGINT_AS_THE_ZYGOTE_STARTS, start_method, timeout=60, prelude="")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "3\n", result.stdout
    assert result.stderr == ""


# The zygote killed in a program that ignores SIGCHLD (the kernel reaps it: its status is gone):
# the pool's error named "exit code 255", mpsched's mark of a lost status, as the zygote's exit
# code (diff review).
ZYGOTE_KILLED_UNREAPED = """
import signal, sys
import mpsched

if __name__ == "__main__":
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    pool = mpsched.Pool(1, start_method=sys.argv[1])
    print(pool.submit(abs, -1).result(timeout=20), flush=True)
    pool._zygote.kill()
    try:
        for _ in range(10_000):  # until the pool knows (each a round trip while it lives)
            pool.submit(abs, -1).result(timeout=20)
    except mpsched.BrokenPoolError as exc:
        print(exc, flush=True)
    pool.shutdown()
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_zygote_whose_status_is_lost_dies_of_an_unknown_exit(
    tmp_path: pathlib.Path, start_method: str
) -> None:
    result = _run(tmp_path, ZYGOTE_KILLED_UNREAPED, start_method, timeout=60, prelude="")
    assert result.returncode == 0, result.stderr
    first, message = result.stdout.splitlines()
    assert first == "1"
    assert "the pool's zygote process died (unknown exit" in message, message  # (or at submit)


# A task that closes every fd of its worker (a daemonizing library's ``os.closerange``), its
# socket to the coordinator with them: the worker's next poke failed with EBADF in a frame of
# multiprocessing's, and the message blamed a signal handler or a finalizer (leak hunt).
CLOSE_EVERY_FD = """
import os

def close_every_fd():
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    return "closed"

if __name__ == "__main__":
    with mpsched.Pool(1, start_method=sys.argv[1]) as pool:
        print(pool.submit(close_every_fd).result(timeout=20), flush=True)
        deadline = time.monotonic() + 20.0
        while pool.statistics().crashes == 0 and time.monotonic() < deadline:
            time.sleep(0.001)  # polled: the worker exits at its next poke
        print(pool.submit(abs, -7).result(timeout=20), pool.statistics().crashes, flush=True)
"""


@pytest.mark.timeout(90)
def test_a_task_that_closes_every_fd_costs_its_worker_and_the_message_says_so(
    tmp_path: pathlib.Path,
) -> None:
    result = _run(tmp_path, CLOSE_EVERY_FD, "forkserver", timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["closed", "7 1"], result.stdout
    assert "a file descriptor of the worker was closed (a task's os.close" in result.stderr
    assert "signal handler" not in result.stderr, result.stderr


# Tasks that take their worker's stdout and stderr away: the workers' exits (retired after a
# task, then at shutdown) flush them.
STREAMS_TAKEN = """
class Refusing:
    def write(self, text):
        return len(text)

    def flush(self):
        raise RuntimeError("flush refused")

def take_streams(which):
    if which == "none":
        sys.stdout = sys.stderr = None
    elif which == "refusing":
        sys.stdout = Refusing()
    else:
        sys.stdout.close()
    return which

if __name__ == "__main__":
    with mpsched.Pool(2, start_method=sys.argv[1], max_tasks_per_worker=1) as pool:
        kinds = ["none", "closed", "refusing"] * 2
        print(sorted(pool.map(take_streams, kinds, chunksize=1)))
        print(pool.statistics().crashes, flush=True)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_a_task_that_takes_its_workers_streams_away_leaves_a_clean_exit(
    tmp_path: pathlib.Path, start_method: str
) -> None:
    """The worker's exit printed a traceback that blamed the zygote's code (``flush`` of a
    ``None`` stdout) and exited with code 1; a ``flush`` that raised took the worker on into
    the zygote's code and multiprocessing's (three tracebacks)."""
    result = _run(tmp_path, STREAMS_TAKEN, start_method, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    kinds = ["closed", "closed", "none", "none", "refusing", "refusing"]
    assert result.stdout.splitlines() == [str(kinds), "0"]


# Tasks that leave os._exit replaced (a mock.patch never stopped), in workers that then retire
# (max_tasks_per_worker) or drain.
EXIT_REPLACED = """
import os

def replace_exit(how):
    if how == "returns":
        os._exit = lambda code: None
    else:
        def refuse(code):
            raise RuntimeError("no exit")
        os._exit = refuse
    return how

if __name__ == "__main__":
    with mpsched.Pool(1, start_method=sys.argv[1], max_tasks_per_worker=1) as pool:
        print([pool.submit(replace_exit, how).result(timeout=20) for how in ("returns", "raises")])
        print(pool.submit(abs, -1).result(timeout=20), pool.statistics().crashes)
    for how in ("returns", "raises"):
        with mpsched.Pool(1, start_method=sys.argv[1]) as pool:
            print(pool.submit(replace_exit, how).result(timeout=20))
    print("after", flush=True)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_a_task_that_replaces_os_exit_leaves_its_worker_to_end(
    tmp_path: pathlib.Path, start_method: str
) -> None:
    """The worker's end looked ``os._exit`` up when it ended: a replacement that returned led
    the worker on into the zygote's code, which SIGKILLed pid 0, the pool's whole process group
    (the program ended killed); one that raised, under fork, ran the user's program on in the
    worker (its ``finally`` blocks and exit handlers)."""
    result = _run(tmp_path, EXIT_REPLACED, start_method, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout.splitlines() == [
        "['returns', 'raises']",
        "1 0",
        "returns",
        "raises",
        "after",
    ]


# A user's fork child that outlives its parent; the parent is then SIGKILLed.
USER_FORK_OUTLIVES = """
import json, os, signal
from tests.integration.conditions import start_every_worker

if __name__ == "__main__":
    pool = mpsched.Pool(2, start_method=sys.argv[1])
    assert pool.submit(abs, -3).result(timeout=20) == 3
    start_every_worker(pool)
    ours = [w.pid for w in pool.statistics().per_worker] + [pool._zygote.pid]
    child = os.fork()
    if child == 0:
        signal.pause()  # until the test kills it
        os._exit(0)
    print(json.dumps({"pool": ours, "child": child}), flush=True)
    signal.pause()
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_a_user_fork_child_does_not_keep_the_pool_alive_after_its_parent_died(
    tmp_path: pathlib.Path, start_method: str
) -> None:
    """The zygote learns of its coordinator's death by EOF on the control socket; a copy of
    the coordinator's end inherited by a user's fork child kept it open, so the workers and
    the zygote outlived a SIGKILLed coordinator for as long as that child lived."""
    script = tmp_path / "prog.py"
    script.write_text(PRELUDE + USER_FORK_OUTLIVES)
    proc = subprocess.Popen(
        [sys.executable, str(script), start_method],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    pool_procs: list[psutil.Process] = []
    child: psutil.Process | None = None
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
        child = psutil.Process(info["child"])
        pool_procs = [psutil.Process(pid) for pid in info["pool"]]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        alive = still_running(pool_procs, GONE_DEADLINE)
        assert child.is_running(), "the fork child should still be alive here"
        assert not alive, f"the pool outlived its SIGKILLed coordinator: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        for leftover in [*pool_procs, *([child] if child is not None else [])]:
            with contextlib.suppress(psutil.NoSuchProcess):
                leftover.kill()
