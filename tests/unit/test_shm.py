"""Tests of mpsched._shm: nameless segments, locks that lose their names, wake fds.

Multi-process tests run under fork, forkserver and spawn; ordering comes from pipes only.
Helpers that run in children are module-level (picklable).
"""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import pathlib
import pickle
import sys
from multiprocessing import forkserver
from multiprocessing.connection import Connection
from typing import Any

import pytest

from mpsched import _layout
from mpsched._errors import PACKAGE_DIR, InternalError
from mpsched._shm import (
    SEM_PREFIX,
    AnonSegment,
    GuardedLock,
    SemLockHandle,
    SharedFd,
    create_eventfd,
    create_lock,
    create_semaphore,
    open_lock,
    preload_in_forkserver,
    release_if_orphaned,
    sweep_stale_names,
    unlink_lock_name,
)

PIPE_TIMEOUT = 30.0  # seconds a child may take to answer (spawn start-up is ~0.1 s)
GRANDCHILDREN = 2
INCREMENTS = 20_000  # per process; enough for unguarded += to lose updates on 2 cores


def _our_names() -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"sem.{SEM_PREFIX}-{os.getpid()}-")]


def _memfd_mappings() -> int:
    with open("/proc/self/maps") as maps:
        return sum(f"/memfd:{SEM_PREFIX}" in line for line in maps)


def _recv(conn: Connection) -> Any:
    assert conn.poll(PIPE_TIMEOUT), "child did not answer in time"
    return conn.recv()


# ---- AnonSegment ---------------------------------------------------------------------------


def test_segment_is_exact_sparse_and_zeroed() -> None:
    size = 64 * 1024 * 1024 + 100
    with AnonSegment.create(size) as seg:
        assert seg.size == size == len(seg.buf) == os.fstat(seg.fd).st_size
        assert not os.get_inheritable(seg.fd)
        assert _memfd_mappings() == 1
        # sparse: a 64 MiB segment that nobody touched holds no memory
        assert os.fstat(seg.fd).st_blocks == 0
        assert seg.buf[size - 1] == 0
        assert "/dev/shm" not in os.readlink(f"/proc/self/fd/{seg.fd}")


def test_close_releases_tracked_views_and_is_idempotent() -> None:
    seg = AnonSegment.create(4096)
    words = seg.view(64, 64, "q")
    raw = seg.view(0, 16)
    words[0] = 7
    fd = seg.fd
    seg.close()
    with pytest.raises(ValueError, match="released"):
        words[0]
    with pytest.raises(ValueError, match="released"):
        raw[0]
    with pytest.raises(OSError):  # noqa: PT011 - EBADF is the point
        os.fstat(fd)
    assert _memfd_mappings() == 0
    assert seg.closed
    seg.close()  # idempotent


class _ViewOwner:
    """Stands for SlotQueues/Slab: owns casts and releases them on request."""

    def __init__(self, seg: AnonSegment) -> None:
        part = seg.buf[128:256]
        self.words = part.cast("q")
        part.release()
        self.released = False
        seg.track(self)

    def release(self) -> None:
        self.words.release()
        self.released = True


def test_close_releases_registered_objects() -> None:
    seg = AnonSegment.create(4096)
    owner = _ViewOwner(seg)
    owner.words[3] = 9
    seg.close()
    assert owner.released
    assert _memfd_mappings() == 0


def test_close_with_untracked_view_raises_then_unmaps_when_it_goes() -> None:
    seg = AnonSegment.create(4096)
    stray = seg.buf[0:8].cast("q")
    with pytest.raises(BufferError, match="still alive"):
        seg.close()
    assert seg.closed
    assert _memfd_mappings() == 1  # kept alive by the stray view only
    stray.release()
    del stray
    assert _memfd_mappings() == 0


def test_view_bounds_are_checked() -> None:
    """A view past the end is refused; one that ends exactly at the end is not (a mutation hunt
    found that bound unpinned)."""
    with AnonSegment.create(4096) as seg:
        with pytest.raises(ValueError, match="outside"):
            seg.view(4000, 200)
        assert seg.view(4088, 8, "q").tolist() == [0]  # the last word


def test_a_memfd_shorter_than_the_segment_is_refused() -> None:
    """Mapping past a memfd's end would fault (SIGBUS) on the first touch: the constructor
    says so with an InternalError, the error of a broken pool's internals."""
    fd = os.memfd_create("short", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 100)
        with pytest.raises(InternalError, match="holds 100 bytes"):
            AnonSegment(fd, 4096)
    finally:
        os.close(fd)


def test_pickling_is_refused_outside_spawning() -> None:
    with AnonSegment.create(4096) as seg:
        with pytest.raises(RuntimeError, match="inheritance"):
            pickle.dumps(seg)
        shared = SharedFd(os.dup(seg.fd))
        with pytest.raises(RuntimeError, match="inheritance"):
            pickle.dumps(shared)
        shared.close()
        shared.close()  # idempotent


# ---- locks ---------------------------------------------------------------------------------


def test_lock_name_lifecycle() -> None:
    lock = create_lock()
    try:
        assert lock.name.startswith(f"/{SEM_PREFIX}-{os.getpid()}-")
        assert _our_names() == ["sem." + lock.name[1:]]
        twin = open_lock(lock.name)
        assert lock.acquire(False)
        assert not twin.acquire(False)  # the same semaphore
        lock.release()
        assert twin.acquire(False)
        twin.release()
        # pickling by name works while the name exists ...
        assert pickle.loads(pickle.dumps(lock)).name == lock.name
    finally:
        assert lock.unlink() is True
    assert lock.unlink() is False
    assert _our_names() == []
    assert lock.acquire(False)  # open handles outlive the name
    lock.release()
    with pytest.raises(InternalError, match="unlinked"):
        pickle.dumps(lock)  # ... and is refused once it is gone
    with pytest.raises(FileNotFoundError):
        open_lock(lock.name)
    assert unlink_lock_name(lock.name) is False


def _die_holding(lock: SemLockHandle) -> None:
    lock.acquire()
    os._exit(0)  # no release: what SIGKILL leaves behind


@pytest.mark.timeout(60)
class _PathError(OSError):
    """An OSError subclass whose constructor takes other arguments than OSError's."""

    def __init__(self, path: str) -> None:
        super().__init__(errno.ENOSPC, None, path)


@pytest.mark.parametrize(
    "error",
    [OSError(errno.ENOMEM, os.strerror(errno.ENOMEM)), _PathError("/dev/shm/sem.x")],
    ids=["enomem", "subclass-with-a-path"],
)
def test_a_pool_whose_locks_cannot_all_be_made_says_how_many_and_leaves_no_name(
    monkeypatch: pytest.MonkeyPatch, error: OSError
) -> None:
    """``Pool(100000)`` failed with a bare ``[Errno 12] Cannot allocate memory`` (each lock is
    a mapping: vm.max_map_count), naming neither the locks nor their count (API hunt). The
    errno and the path stay; an error whose class takes other arguments is no TypeError."""
    made = 0

    def fourth_fails() -> SemLockHandle:
        nonlocal made
        if made == 3:
            raise error
        made += 1
        return create_lock()

    monkeypatch.setattr(_layout, "create_lock", fourth_fails)
    with pytest.raises(OSError, match=r"made 3 of the pool's 5 locks \(one per worker") as info:
        _layout.create_locks(3)
    assert (info.value.errno, info.value.filename) == (error.errno, error.filename)
    assert info.value.strerror.startswith(os.strerror(error.errno))
    assert info.value.__cause__ is error
    assert _our_names() == []


def test_lock_of_a_dead_holder_can_be_released_by_another_process() -> None:
    # The crash breaker relies on this: kind SEMAPHORE (not RLock) may be released by anyone.
    lock = create_lock()
    lock.unlink()
    child = mp.get_context("fork").Process(target=_die_holding, args=(lock,))
    child.start()
    child.join(PIPE_TIMEOUT)
    child.close()
    assert not lock.acquire(True, 0.01)
    lock.release()
    assert lock.acquire(False)
    lock.release()
    with pytest.raises(ValueError, match="released too many times"):
        lock.release()


def test_a_lock_with_a_recorded_holder_is_not_orphaned() -> None:
    """``release_if_orphaned`` frees a lock held with no holder recorded only: a recorded pid
    is a holder inside its critical section (or one that ``break_dead_holder`` repairs), and
    releasing its lock under it would let another process into that section."""
    lock = create_lock()
    lock.unlink()
    assert not release_if_orphaned(lock, lambda: 0, 0.01)  # a free lock: nothing to do
    lock.acquire()
    assert not release_if_orphaned(lock, lambda: os.getpid(), 0.01)
    assert not lock.acquire(False)  # still held
    assert release_if_orphaned(lock, lambda: 0, 0.01)  # no holder recorded: orphaned
    assert lock.acquire(False)
    lock.release()


@pytest.mark.timeout(60)
def test_a_guarded_lock_honours_a_timeout() -> None:
    """A timed acquire of a ``GuardedLock`` gives up after its timeout, as the lock's own does,
    without stall checks: only an untimed wait is bounded by ``on_stall`` (a mutation hunt
    found the timed one unpinned; such a mutant waits forever)."""
    lock = create_lock()
    lock.unlink()
    lock.acquire()
    stalls: list[float] = []

    def on_stall(_lock: Any, waited: float) -> None:
        stalls.append(waited)
        raise AssertionError(f"a timed acquire still waiting after {waited:.1f} s")

    guarded = GuardedLock(lock, on_stall)
    assert not guarded.acquire(True, 0.3)
    assert not guarded.acquire(False)
    assert stalls == []
    lock.release()
    assert guarded.acquire(True, 0.3)
    guarded.release()


def test_counting_semaphore() -> None:
    sem = create_semaphore(0)
    sem.unlink()
    for _ in range(3):
        sem.release()
    assert sem.value() == 3
    assert [sem.acquire(False) for _ in range(4)] == [True, True, True, False]
    bounded = create_semaphore(1, 1)
    bounded.unlink()
    with pytest.raises(ValueError, match="released too many times"):
        bounded.release()


def _leave_a_name(conn: Connection) -> None:
    conn.send(create_lock().name)  # and never unlink it: the start-up window crash


@pytest.mark.timeout(60)
def test_sweep_removes_only_names_of_dead_creators() -> None:
    fork = mp.get_context("fork")
    parent_end, child_end = fork.Pipe()
    child = fork.Process(target=_leave_a_name, args=(child_end,))
    child.start()
    child_end.close()
    stale = _recv(parent_end)
    parent_end.close()
    child.join(PIPE_TIMEOUT)
    child.close()
    live = create_lock()
    try:
        assert os.path.exists("/dev/shm/sem." + stale[1:])
        assert stale in sweep_stale_names()
        assert not os.path.exists("/dev/shm/sem." + stale[1:])
        assert os.path.exists("/dev/shm/sem." + live.name[1:])  # our pid is alive
    finally:
        live.unlink()
    assert sweep_stale_names("/nonexistent") == []


def _count_under_lock(seg: AnonSegment, lock: SemLockHandle, n: int) -> None:
    words = seg.buf[:8].cast("q")
    acquire, release = lock.acquire, lock.release
    for _ in range(n):
        acquire()
        words[0] += 1
        release()
    words.release()


def _zygote(conn: Connection, seg: AnonSegment, lock: SemLockHandle) -> None:
    """Plays the zygote: opened the lock (by unpickling) and mapped the segment; waits until
    the parent unlinked the name, then forks workers that share both through inheritance."""
    conn.send("ready")
    assert conn.recv() == "go"
    pids = []
    for _ in range(GRANDCHILDREN):
        pid = os.fork()
        if pid == 0:  # worker: a plain os.fork() child
            code = 1
            try:
                _count_under_lock(seg, lock, INCREMENTS)
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    _count_under_lock(seg, lock, INCREMENTS)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    conn.send(codes)
    conn.close()
    seg.close()


@pytest.mark.timeout(60)
def test_lock_and_segment_reach_zygote_then_forked_workers(ctx: Any) -> None:
    seg = AnonSegment.create(4096)
    lock = create_lock()
    parent_end, child_end = ctx.Pipe()
    proc = ctx.Process(target=_zygote, args=(child_end, seg, lock))
    try:
        proc.start()
        child_end.close()
        assert _recv(parent_end) == "ready"
        lock.unlink()  # the zygote has it open: from now on nothing is named
        assert _our_names() == []
        parent_end.send("go")
        assert _recv(parent_end) == [0] * GRANDCHILDREN
        proc.join(PIPE_TIMEOUT)
        assert proc.exitcode == 0
        words = seg.buf[:8].cast("q")
        assert words[0] == INCREMENTS * (GRANDCHILDREN + 1)
        words.release()
    finally:
        parent_end.close()
        if proc.is_alive():
            proc.kill()
            proc.join()
        proc.close()
        lock.unlink()
        seg.close()
    assert _our_names() == []


# ---- wake fds ------------------------------------------------------------------------------


def _wake_from_child_and_grandchild(conn: Connection, efd: SharedFd) -> None:
    os.eventfd_write(efd.fd, 1)
    pid = os.fork()
    if pid == 0:  # the CLOEXEC eventfd is still inherited by os.fork()
        try:
            os.eventfd_write(efd.fd, 10)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    conn.send(os.get_inheritable(efd.fd))
    efd.close()
    conn.close()


@pytest.mark.timeout(60)
def test_eventfd_reaches_child_and_its_forks(ctx: Any) -> None:
    efd = SharedFd(create_eventfd())
    parent_end, child_end = ctx.Pipe()
    proc = ctx.Process(target=_wake_from_child_and_grandchild, args=(child_end, efd))
    try:
        proc.start()
        child_end.close()
        assert _recv(parent_end) is False  # received fds are made non-inheritable again
        proc.join(PIPE_TIMEOUT)
        assert proc.exitcode == 0
        assert os.eventfd_read(efd.fd) == 11
        with pytest.raises(BlockingIOError):  # EFD_NONBLOCK: an empty counter never blocks
            os.eventfd_read(efd.fd)
    finally:
        parent_end.close()
        proc.close()
        efd.close()


# ---- preload_in_forkserver -----------------------------------------------------------------
# A ForkServer that was never started stands in for multiprocessing's: the decision is made
# from its preload list and pid, and from where a fresh interpreter would find the package.

PACKAGE_PARENT = str(pathlib.Path(PACKAGE_DIR).parent)


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> forkserver.ForkServer:
    fresh = forkserver.ForkServer()
    monkeypatch.setattr(forkserver, "_forkserver", fresh)
    monkeypatch.chdir(tmp_path)  # nothing named mpsched here
    # sys.path[0] is the running script's directory, which a ``python -c`` does not search.
    monkeypatch.setattr(sys, "path", [str(tmp_path / "script-dir"), PACKAGE_PARENT])
    return fresh


def test_the_forkserver_preloads_the_zygote_keeping_the_users_modules(
    server: forkserver.ForkServer,
) -> None:
    server.set_forkserver_preload(["__main__", "json"])
    assert preload_in_forkserver("mpsched._zygote") is True
    assert server._preload_modules == ["__main__", "json", "mpsched._zygote"]
    assert preload_in_forkserver("mpsched._zygote") is False  # once
    assert server._preload_modules == ["__main__", "json", "mpsched._zygote"]


def test_a_running_forkserver_is_left_alone(server: forkserver.ForkServer) -> None:
    server._forkserver_pid = os.getpid()  # its list was read when it started
    assert preload_in_forkserver("mpsched._zygote") is False
    assert server._preload_modules == ["__main__"]


@pytest.mark.parametrize("where", ["cwd", "only-first-entry", "nowhere"])
def test_no_preload_where_a_fresh_interpreter_finds_another_copy_or_none(
    server: forkserver.ForkServer, tmp_path: pathlib.Path, where: str
) -> None:
    if where == "cwd":  # another mpsched in the current directory, which ``python -c`` tries first
        (tmp_path / "mpsched").mkdir()
        (tmp_path / "mpsched" / "__init__.py").write_text("")
    elif where == "only-first-entry":  # this copy only by the script's directory
        sys.path[:] = [PACKAGE_PARENT, str(tmp_path / "elsewhere")]
    else:
        sys.path[:] = [str(tmp_path / "script-dir")]
    assert preload_in_forkserver("mpsched._zygote") is False
    assert server._preload_modules == ["__main__"]
