"""Shared fixtures: leak checks after every test, and a deadlock guard.

After each test, the autouse ``no_leaks`` fixture checks that the test left no live child process,
no new ``/dev/shm`` entry, no thread of a pool's (coordinator, callbacks) still running and (for
tests that start processes) no new open file descriptor. A child still alive after a grace
period is killed (so CI never stalls) and the test fails.

Hangs: pytest-timeout (``timeout`` in pyproject.toml) dumps every thread's traceback and fails
the test; ``faulthandler_timeout`` dumps tracebacks earlier, and the teardown of ``no_leaks``
then kills whatever children remain.

Bytecode: the session compiles mpsched and the tests' task modules once, before the first test
(``_compile_once``). Without it, where ``PYTHONDONTWRITEBYTECODE`` is set and the checkout is
fresh (CI), every zygote and script the tests start compiled mpsched from source again (a fresh
clone's suite took 268 s so, 206 s with it).

Scripts that the tests kill on purpose (a SIGKILL of a pool's process, a Ctrl-C) cannot run
multiprocessing's exit hooks, which remove the temporary directory of its forkserver
(``pymp-*``): the scripts get a ``TMPDIR`` of the session's, removed when the session ends.
"""

from __future__ import annotations

import compileall
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import pathlib
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator

import psutil
import pytest

_SCRIPTS_TMPDIR = pytest.StashKey[str]()  # the TMPDIR of every process the tests start
CHILD_EXIT_GRACE = 5.0  # seconds a finished test's children get to exit before they are killed


def _shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:  # pragma: no cover - not Linux
        return set()


def _open_fds() -> set[int]:
    try:
        return {int(fd) for fd in os.listdir("/proc/self/fd")}
    except FileNotFoundError:  # pragma: no cover - not Linux
        return set()


def _pool_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("mpsched-")}


def _lingering(threads: set[threading.Thread]) -> list[str]:
    """The pool threads of ``threads`` still alive after ``CHILD_EXIT_GRACE`` seconds in all (a
    pool shut down without waiting ends its threads on its own, soon)."""
    deadline = time.monotonic() + CHILD_EXIT_GRACE
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return sorted(t.name for t in threads if t.is_alive())


def _reap(children: list[psutil.Process]) -> list[str]:
    """Wait for ``children`` to exit; kill those that do not. Returns their descriptions."""
    _, alive = psutil.wait_procs(children, timeout=CHILD_EXIT_GRACE)
    described = []
    for proc in alive:
        try:
            described.append(f"pid {proc.pid} {proc.cmdline()[:4]}")
            proc.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(alive, timeout=CHILD_EXIT_GRACE)
    return described


def _unreaped(before: set[int]) -> list[int]:
    """This process's new children that exited and were not reaped (the pool reaps its zygote
    in its teardown, which its threads' end follows): reaped here, their pids returned.
    ``_our_children`` skips them (a zombie has no command line), and an audit's mutant that
    left a pool's processes unreaped passed every test."""
    out = []
    for proc in psutil.Process().children():
        try:
            if proc.pid not in before and proc.status() == psutil.STATUS_ZOMBIE:
                out.append(proc.pid)
                os.waitpid(proc.pid, os.WNOHANG)
        except (psutil.NoSuchProcess, ChildProcessError):
            continue
    return out


def _our_children(before: set[int]) -> list[psutil.Process]:
    """Children of this process that the test started (multiprocessing's own helper processes,
    the forkserver and the resource tracker, live for the whole session and are not counted)."""
    out = []
    for proc in psutil.Process().children(recursive=True):
        if proc.pid in before:
            continue
        try:
            cmd = " ".join(proc.cmdline())
        except psutil.NoSuchProcess:
            continue
        if "forkserver" in cmd or "resource_tracker" in cmd:
            continue
        out.append(proc)
    return out


_os_kill = os.kill


def _kill_one_process(pid: int, sig: int) -> None:
    """``os.kill`` that refuses a pid of 0 or below, which signals a whole process group: a
    test that read a worker's pid as 0 (before the coordinator registered the worker) and sent
    it SIGSTOP stopped pytest itself, whose timeout then never fired, and CI hung."""
    if pid <= 0:
        raise ValueError(f"os.kill({pid}, {sig}) would signal a process group, not a process")
    _os_kill(pid, sig)


def _compile_once(config: pytest.Config) -> None:
    """Write the ``.pyc`` files of mpsched and of the tests' modules (the controller only, before
    its workers start): the import system reads them even where ``PYTHONDONTWRITEBYTECODE``
    keeps it from writing them, so no process of the suite compiles them again."""
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: its controller did it
        return
    root = pathlib.Path(__file__).resolve().parent.parent
    for folder in ("mpsched", "tests"):
        compileall.compile_dir(root / folder, quiet=1)


def pytest_configure(config: pytest.Config) -> None:
    """A suite started with SIGINT ignored (``cmd &`` in a shell without job control ignores it)
    would pass that on to every script it starts, whose Ctrl-C tests then see no
    KeyboardInterrupt: give the suite Python's own handler, which an exec resets to the
    default, so the scripts get theirs. And the scripts' TMPDIR (see the module doc). And
    ``os.kill`` signals one process only (``_kill_one_process``)."""
    _compile_once(config)
    os.kill = _kill_one_process
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # This process keeps its own temporary directory (read before TMPDIR changes, and cached
    # from then on): its forkserver's, which its exit removes, lives there.
    tempfile.gettempdir()
    scripts_tmpdir = tempfile.mkdtemp(prefix="mpsched-tests-")
    config.stash[_SCRIPTS_TMPDIR] = os.environ["TMPDIR"] = scripts_tmpdir


def pytest_unconfigure(config: pytest.Config) -> None:
    scripts_tmpdir = config.stash.get(_SCRIPTS_TMPDIR, None)
    if scripts_tmpdir is not None:
        shutil.rmtree(scripts_tmpdir, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _session_helpers() -> None:
    """Start multiprocessing's session-long helpers (the forkserver and the resource tracker)
    before the first test, so that their pipes are not counted as a test's leaked fds."""
    multiprocessing.forkserver.ensure_running()
    multiprocessing.resource_tracker.ensure_running()


START_METHODS = ("fork", "forkserver", "spawn")


@pytest.fixture(params=START_METHODS)
def ctx(request: pytest.FixtureRequest) -> multiprocessing.context.BaseContext:
    """A multiprocessing context, for tests that must hold under every start method."""
    return multiprocessing.get_context(request.param)


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    before_children = {p.pid for p in psutil.Process().children(recursive=True)}
    before_shm = _shm_entries()
    check_fds = request.node.get_closest_marker("no_fd_check") is None
    before_fds = _open_fds()
    before_threads = _pool_threads()
    yield
    leaked = _reap(_our_children(before_children))
    assert not leaked, f"test left live child processes (killed now): {leaked}"
    lingering = _lingering(_pool_threads() - before_threads)
    assert not lingering, f"test left pool threads running: {lingering}"
    zombies = _unreaped(before_children)
    assert not zombies, f"test left children that exited unreaped (reaped now): {zombies}"
    ours = (f"mpsched-{os.getpid()}-", f"sem.mpsched-{os.getpid()}-")  # other runs may share
    new_shm = {name for name in _shm_entries() - before_shm if name.startswith(ours)}
    assert not new_shm, f"test left shared-memory entries in /dev/shm: {sorted(new_shm)}"
    if check_fds:
        new_fds = _open_fds() - before_fds
        # An fd may be open briefly for listing; check what remains twice.
        new_fds &= _open_fds()
        assert not new_fds, f"test left open file descriptors: {_describe_fds(new_fds)}"


def _describe_fds(fds: set[int]) -> list[str]:
    out = []
    for fd in sorted(fds):
        try:
            out.append(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            out.append(str(fd))
    return out
