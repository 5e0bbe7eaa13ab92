"""Nameless shared memory, nameless locks and wake fds: the OS resources under the pool.

What this module owns:
    * ``AnonSegment``: one memfd-backed mapping that holds every shared structure of a pool
      (deques, inboxes, payload slab, function table; the offsets belong to ``_layout``).
      It has no name, so nothing can be left in /dev/shm, whatever kills the processes.
    * ``SemLockHandle``: a POSIX semaphore (``_multiprocessing.SemLock``) used as a lock or as a
      counting semaphore. Its name exists only during start-up: the coordinator creates it, the
      zygote opens it by name, the coordinator unlinks the name, and the zygote's ``os.fork()``
      children inherit the open semaphore (as fork-context Locks do).
    * ``SharedFd`` and ``create_eventfd``: wake fds passed to a spawn/forkserver child.
    * ``wait_readable``: a wait for one fd of any number (``select()`` refuses the fds of a
      process with more than ``SELECT_FD_LIMIT`` open).
    * ``sweep_stale_names``: removes semaphore names left by a creator that died inside the
      start-up window.
    * ``death_signal_setter``: ``prctl(PR_SET_PDEATHSIG)`` for the zygote's workers.
    * ``become_forked_child``: the part of ``multiprocessing``'s child bootstrap that a zygote
      started by a bare ``os.fork()`` (fork start method) keeps.
    * ``preload_in_forkserver``: has ``multiprocessing``'s forkserver import the zygote's
      modules once, as it starts, instead of every pool's zygote importing them.
    This is the ONLY module that touches private CPython API (``_multiprocessing``; ``_ctypes``
    for that one ``prctl`` call, see ``death_signal_setter``; ``multiprocessing.process`` and
    ``multiprocessing.util`` internals in ``become_forked_child``, ``process._children`` in
    ``disown_inherited_process``, the forkserver's preload list in ``preload_in_forkserver``):
    ``SemLock(kind, value, maxvalue, name, unlink)``, ``SemLock._rebuild(handle, kind, maxvalue,
    name)`` and ``sem_unlink(name)``, as in 3.11's Modules/_multiprocessing/semaphore.c (the same
    calls ``multiprocessing.synchronize`` makes). If they change, only this file changes.

Who calls what, from which process:
    * coordinator (a thread in the user's process): ``AnonSegment.create``, ``create_lock``,
      ``create_semaphore``, ``create_eventfd``; passes them to the zygote as ``Process`` args
      (pickled under spawn/forkserver, inherited under fork); after the zygote acknowledges,
      ``SemLockHandle.unlink()``. Also ``sweep_stale_names()`` once before creating anything.
    * zygote (single-threaded child): unpickles (``open_lock`` by name, ``AnonSegment`` by fd),
      then ``os.fork()``s the workers, which inherit everything as is.
    * workers: use ``.buf`` views and ``lock.acquire`` / ``lock.release`` bound methods.

Invariants:
    * Exactly one process (the coordinator) creates and unlinks each semaphore name, and
      closes the segment it created; children close only their own mapping and fd.
    * Pickling an ``AnonSegment`` or ``SharedFd`` is legal only while a child is being spawned
      (``multiprocessing.context.assert_spawning``, as for SemLock): outside spawning,
      ``reduction.DupFd`` would silently start the resource-sharer thread in this process.
    * ``AnonSegment.close()`` releases every tracked view first, in reverse order of
      registration, then unmaps; an untracked view still alive makes it raise ``BufferError``.

Not handled here: payloads larger than the segment (see ``_payloads``), macOS (no memfd).

Layout: this module imposes none on the segment; ``_layout.GlobalHeader`` writes magic, version
and the real size into the first words, because ``.size`` is only what was asked for.

    # offset size  field    writer       meaning
    #   0    size  (bytes)  see _layout  zero-filled at creation (memfd), sparse: untouched
    #                                    pages use no memory
"""

from __future__ import annotations

import _multiprocessing  # type: ignore[import-not-found]  # private C module, no stubs
import math
import mmap
import os
import re
import select
import sys
import weakref
from collections.abc import Callable
from multiprocessing import context, reduction

from mpsched._errors import PACKAGE_DIR, InternalError
from mpsched._stdio import above_stdio, fill_stdio

# typing.TYPE_CHECKING without importing typing at run time (why: mpsched/__init__.py).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Literal, Protocol, TextIO

__all__ = (
    "SEM_PREFIX",
    "AnonSegment",
    "SemLockHandle",
    "SharedFd",
    "become_forked_child",
    "create_eventfd",
    "create_lock",
    "create_semaphore",
    "death_signal_setter",
    "disown_inherited_process",
    "open_lock",
    "sweep_stale_names",
    "unlink_lock_name",
)

# Every semaphore name is "/<SEM_PREFIX>-<creator pid>-<random>"; the pid lets
# sweep_stale_names() decide whether the creator is still alive.
SEM_PREFIX = "mpsched"
SHM_DIR = "/dev/shm"  # where glibc puts named semaphores, as "sem.<name without slash>"
# Compiled on first use (re caches it), not at import: only the coordinator sweeps.
_SEM_FILE_PATTERN = r"^sem\." + SEM_PREFIX + r"-(\d+)-[0-9a-f]+$"

# _multiprocessing.SemLock kinds (Modules/_multiprocessing/semaphore.c: enum {RECURSIVE_MUTEX,
# SEMAPHORE}). We never use RECURSIVE_MUTEX: its release() from another process raises, and the
# crash breaker must release a dead holder's lock from the coordinator.
_SEMAPHORE_KIND = 1
SEM_VALUE_MAX: int = _multiprocessing.SemLock.SEM_VALUE_MAX  # 2**31 - 1 on Linux
_NAME_ATTEMPTS = 100  # FileExistsError retries; 32 random bits make one collision already rare
_NAME_RANDOM_BYTES = 4

# How many registrations between prunings of dead weakrefs in AnonSegment._tracked; views are
# long-lived (one set per process), so this only bounds growth in tests that rebuild views.
_PRUNE_EVERY = 64


if TYPE_CHECKING:  # structural types, for annotations only

    class Releasable(Protocol):
        """Anything with ``release()``: a memoryview, or an object owning views of the segment."""

        def release(self) -> None: ...


def _dup_for_child(obj: object, fd: int) -> Any:
    # Refuse the resource_sharer path of reduction.DupFd: it starts a listener thread in the
    # calling (user's) process and would let an fd travel long after start-up.
    context.assert_spawning(obj)
    return reduction.DupFd(fd)


def _own_received_fd(dupfd: Any) -> int:
    # Above 2: under forkserver the server numbers what it receives, and a program that
    # closed its stdout made that number free there (see _stdio). Then the closed ones get
    # /dev/null, before this process makes an fd: the mapping's own duplicate of the memfd,
    # made as the segment is unpickled, had taken the number 1.
    fd = above_stdio(dupfd.detach())
    fill_stdio(inheritable=True)
    # spawn passes fds through pass_fds and forkserver through SCM_RIGHTS; both arrive
    # inheritable, so a later exec() in this process would leak them. os.fork() still
    # inherits CLOEXEC fds, which is how the zygote's workers get them.
    os.set_inheritable(fd, False)
    return fd


class AnonSegment:
    """A memfd-backed shared mapping with no name anywhere in the filesystem.

    Create with ``AnonSegment.create(size)`` in the coordinator. A spawn/forkserver child gets
    it by pickling (fd passed by ``DupFd``); a fork child inherits it as is.

    Attributes:
        buf: a writable memoryview of the whole mapping (released by ``close()``).
        size: the size asked for, in bytes (exact on Linux).
        fd: the memfd; CLOEXEC, but inherited by ``os.fork()``.
    """

    buf: memoryview
    size: int
    fd: int

    def __init__(self, fd: int, size: int) -> None:
        """Map ``size`` bytes of an open memfd; takes ownership of ``fd``.

        Should only be used by ``create``, the unpickler and unit tests.
        """
        if size <= 0:
            raise ValueError(f"AnonSegment size must be positive, got {size}")
        actual = os.fstat(fd).st_size
        if actual < size:
            raise InternalError(f"memfd {fd} holds {actual} bytes, expected at least {size}")
        self.fd = fd
        self.size = size
        self._mmap: mmap.mmap | None = mmap.mmap(fd, size)
        self.buf = memoryview(self._mmap)
        self._tracked: list[weakref.ref[Releasable]] = []
        self._closed = False

    @classmethod
    def create(cls, size: int, *, label: str = SEM_PREFIX) -> AnonSegment:
        """Create a zero-filled, sparse segment of ``size`` bytes.

        Args:
            size: bytes; pages are allocated only when first touched.
            label: shown as ``/memfd:<label> (deleted)`` in /proc/<pid>/maps, for leak checks.
        """
        fd = os.memfd_create(label, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            return cls(fd, size)
        except BaseException:
            os.close(fd)
            raise

    @property
    def closed(self) -> bool:
        return self._closed

    def view(self, offset: int, nbytes: int, fmt: Literal["B", "q"] = "B") -> memoryview:
        """Return a tracked view of ``[offset, offset + nbytes)``, cast to ``fmt``.

        ``close()`` releases it; the caller may release it earlier.
        """
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"view [{offset}, {offset + nbytes}) outside segment of {self.size}")
        part = self.buf[offset : offset + nbytes]
        if fmt != "B":
            cast = part.cast(fmt)
            part.release()
            part = cast
        self.track(part)
        return part

    def track(self, obj: Releasable) -> None:
        """Register an object that holds views of ``buf``; ``close()`` calls its ``release()``.

        Objects are held weakly, so registering does not keep them alive; they must support
        weak references (memoryviews and ordinary classes do).
        """
        if self._closed:
            raise ValueError("AnonSegment is closed")
        self._tracked.append(weakref.ref(obj))
        if len(self._tracked) % _PRUNE_EVERY == 0:
            self._tracked = [r for r in self._tracked if r() is not None]

    def close(self) -> None:
        """Release tracked views (newest first), unmap, close the fd. Idempotent.

        Raises:
            BufferError: an untracked view of ``buf`` is still alive. The fd is closed anyway
                and the mapping goes away when that last view is released.
        """
        if self._closed:
            return
        self._closed = True
        try:
            for ref in reversed(self._tracked):
                obj = ref()
                if obj is not None:
                    obj.release()
            self._tracked.clear()
            self.buf.release()
            mm, self._mmap = self._mmap, None
            if mm is not None:
                mm.close()
        except BufferError as exc:
            raise BufferError(
                "AnonSegment.close(): a view of the segment is still alive and was not "
                "registered with track()/view(); release it before close(), or track it"
            ) from exc
        finally:
            os.close(self.fd)  # the mapping, if still exported, goes with its last view

    def __enter__(self) -> AnonSegment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[Callable[..., AnonSegment], tuple[Any, int]]:
        return (_rebuild_segment, (_dup_for_child(self, self.fd), self.size))

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"fd={self.fd}"
        return f"<AnonSegment size={self.size} {state}>"


def _rebuild_segment(dupfd: Any, size: int) -> AnonSegment:
    fd = _own_received_fd(dupfd)
    try:
        return AnonSegment(fd, size)
    except BaseException:
        os.close(fd)
        raise


class SemLockHandle:
    """A POSIX semaphore shared between processes; a lock when ``maxvalue == 1``.

    ``acquire`` and ``release`` are the bound C methods of ``_multiprocessing.SemLock`` (about
    33 ns a pair; ``with lock:`` costs 5x that). ``acquire(block=True, timeout=None) -> bool``.
    A lock held by a dead process may be released by any other process (kind SEMAPHORE).

    Pickled by name, so it can reach a spawn/forkserver child only while the name exists;
    under fork (``os.fork`` or the fork start method) it is inherited as is.
    """

    __slots__ = ("__weakref__", "_sem", "_unlinked", "acquire", "maxvalue", "name", "release")

    acquire: Callable[..., bool]
    release: Callable[[], None]

    def __init__(self, sem: Any, name: str, maxvalue: int) -> None:
        """Should only be used by ``create_lock``, ``create_semaphore`` and ``open_lock``."""
        self._sem = sem
        self.name = name
        self.maxvalue = maxvalue
        self.acquire = sem.acquire
        self.release = sem.release
        self._unlinked = False

    def unlink(self) -> bool:
        """Remove the name (the coordinator, once the zygote has opened it). Idempotent.

        Returns:
            True if this call removed the name, False if it was already gone.
        """
        self._unlinked = True
        return unlink_lock_name(self.name)

    def value(self) -> int:
        """The semaphore's current value (hint only: stale as soon as it is read)."""
        v: int = self._sem._get_value()
        return v

    def __reduce__(self) -> tuple[Callable[..., SemLockHandle], tuple[str, int]]:
        if self._unlinked:
            raise InternalError(
                f"semaphore {self.name!r} was unlinked; it reaches new processes only through "
                "os.fork() now (start the zygote before unlinking)"
            )
        return (open_lock, (self.name, self.maxvalue))

    def __repr__(self) -> str:
        return f"<SemLockHandle {self.name!r} maxvalue={self.maxvalue}>"


STALL_CHECK_INTERVAL = 0.1  # s; a guarded lock that does not come free is checked this often


class GuardedLock:
    """A lock whose blocking waits are bounded: every ``STALL_CHECK_INTERVAL`` that the lock
    stays taken, ``on_stall()`` runs (the coordinator checks whether the recorded holder died,
    and repairs the lock if so), then the wait goes on. Used in the coordinator's process only:
    there a wait behind a dead worker would stop the very thread that must detect its death.
    Non-blocking and timed acquires go straight through."""

    __slots__ = ("_acquire", "on_stall", "release")

    def __init__(self, lock: SemLockHandle, on_stall: Callable[[Any, float], None]) -> None:
        self._acquire = lock.acquire
        self.release = lock.release
        self.on_stall = on_stall  # on_stall(this lock, seconds waited so far)

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        if not block or timeout is not None:
            return self._acquire(block, timeout)
        acquire = self._acquire
        waited = 0.0
        while not acquire(True, STALL_CHECK_INTERVAL):
            waited += STALL_CHECK_INTERVAL
            self.on_stall(self, waited)
        return True


def release_if_orphaned(lock: Any, holder_pid: Callable[[], int], wait: float) -> bool:
    """Coordinator, after a worker died: if ``lock`` stays taken for ``wait`` seconds with no
    holder recorded, release it and return True.

    Every critical section records its holder's pid as its first store after the acquire, so a
    lock held with no pid recorded for that long was taken by a process that died before that
    store: it changed nothing yet, and releasing it is safe. (A live process preempted for
    ``wait`` seconds in that one-store window would be the exception; ``wait`` is chosen far
    above any scheduling delay.)"""
    if lock.acquire(True, wait):
        lock.release()
        return False
    if holder_pid() != 0:
        return False
    lock.release()
    return True


def _new_name() -> str:
    # os.urandom, not secrets: importing secrets loads OpenSSL (hmac, hashlib), a few ms that
    # the zygote would pay at start-up for a module only the coordinator uses.
    return f"/{SEM_PREFIX}-{os.getpid()}-{os.urandom(_NAME_RANDOM_BYTES).hex()}"


def create_semaphore(value: int = 0, maxvalue: int = SEM_VALUE_MAX) -> SemLockHandle:
    """Create a named counting semaphore (coordinator only); unlink it after start-up.

    Args:
        value: initial value.
        maxvalue: ``release()`` past it raises ValueError (checked, not atomically).
    """
    for _ in range(_NAME_ATTEMPTS):
        name = _new_name()
        try:
            sem = _multiprocessing.SemLock(_SEMAPHORE_KIND, value, maxvalue, name, False)
        except FileExistsError:
            continue
        return SemLockHandle(sem, name, maxvalue)
    raise FileExistsError(f"no free semaphore name with prefix {SEM_PREFIX!r}")


def create_lock() -> SemLockHandle:
    """Create a named binary semaphore, value 1 (coordinator only); unlink it after start-up."""
    return create_semaphore(1, 1)


def open_lock(name: str, maxvalue: int = 1) -> SemLockHandle:
    """Open an existing semaphore by name (in the zygote, or the unpickler).

    Raises:
        FileNotFoundError: the name was already unlinked (or never existed).
    """
    # _rebuild(handle, kind, maxvalue, name): on POSIX the handle is ignored when a name is
    # given, and sem_open(name, 0) opens the existing semaphore.
    sem = _multiprocessing.SemLock._rebuild(0, _SEMAPHORE_KIND, maxvalue, name)
    return SemLockHandle(sem, name, maxvalue)


def unlink_lock_name(name: str) -> bool:
    """Remove a semaphore name; open handles stay valid. False if the name was already gone."""
    try:
        _multiprocessing.sem_unlink(name)
    except FileNotFoundError:
        return False
    return True


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def sweep_stale_names(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink ``sem.mpsched-<pid>-*`` whose creator pid is dead; return the names removed.

    Debris comes only from a coordinator killed between ``create_lock`` and ``unlink``.
    A live pid (even a reused one) keeps its names: a leak is better than breaking a pool.
    """
    removed: list[str] = []
    try:
        entries = os.listdir(shm_dir)
    except FileNotFoundError:
        return removed
    for entry in entries:
        match = re.match(_SEM_FILE_PATTERN, entry)
        if match is None or _pid_alive(int(match.group(1))):
            continue
        name = "/" + entry[len("sem.") :]
        if unlink_lock_name(name):
            removed.append(name)
    return removed


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def death_signal_setter() -> Callable[[int], None]:
    """For the zygote: a function that asks the kernel to send ``sig`` to the calling process
    when its parent dies (``prctl(PR_SET_PDEATHSIG, sig)``). Look it up once; call it in each
    child right after fork.

    Through ``_ctypes``, the C core of ``ctypes`` (``dlopen``, ``dlsym``, ``call_function``,
    which ``ctypes`` itself is built on): importing ``ctypes`` costs the zygote 2-4 ms on the
    path of every pool's start-up, ``_ctypes`` ~0.5 ms. Integer arguments pass as C ints, as
    through ``ctypes.CDLL``; errno is not captured (the call fails only for a bad signal).
    """
    import _ctypes

    # dlopen(NULL): the program's global symbols, as ctypes.CDLL(None); the stub wants a path.
    prctl = _ctypes.dlsym(_ctypes.dlopen(None), "prctl")  # type: ignore[arg-type]
    call = _ctypes.call_function

    def set_death_signal(sig: int) -> None:
        if call(prctl, (PR_SET_PDEATHSIG, sig, 0, 0, 0)) != 0:
            raise OSError(f"prctl(PR_SET_PDEATHSIG, {sig}) failed")

    return set_death_signal


def become_forked_child(name: str, parent_pid: int, stdin: TextIO | None) -> None:
    """In the child of a bare ``os.fork()`` (the zygote under the fork start method), before
    anything else: what ``multiprocessing``'s own child bootstrap (3.11
    ``BaseProcess._bootstrap``) does that the zygote's workers, and the user's tasks there, may
    rely on, at a fraction of its cost (see ``_zygote.ForkedZygote``):

    * stdin reads ``/dev/null``, never the parent's input (``util._close_stdin``): ``/dev/null``
      is ``dup2``-ed onto fd 0 and ``sys.stdin`` becomes ``stdin``, a reader of fd 0 that the
      parent made before the fork (None: leave ``sys.stdin``, as when the parent has none).
      Made here, the reader would cost ~0.3 ms of copy-on-write faults, in the parent ~20 us;
    * ``multiprocessing.current_process()`` is a child process named ``name``, daemonic (as a
      ``Process(daemon=True)``: a task cannot start processes that would outlive its worker),
      with no children of its own; ``parent_process()`` is the pool's process;
    * the after-fork hooks registered with ``multiprocessing.util.register_after_fork`` run
      (they reset inherited ``multiprocessing`` objects, e.g. a ``Queue``'s feeder thread
      state), and the parent's exit finalizers are dropped.
    """
    import itertools
    import threading
    from multiprocessing import process, util

    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    if stdin is not None:
        sys.stdin = stdin
    context._force_start_method("fork")
    parent = process.current_process()
    child = process.BaseProcess(name=name, daemon=True)
    child._parent_pid = parent_pid  # type: ignore[attr-defined]  # made here, not in the parent
    process._current_process = child  # type: ignore[attr-defined]
    # The parent's sentinel: a pidfd, readable once the parent exits (its Process.sentinel).
    process._parent_process = process._ParentProcess(  # type: ignore[attr-defined]
        parent.name, parent_pid, os.pidfd_open(parent_pid)
    )
    process._children = set()  # type: ignore[attr-defined]
    process._process_counter = itertools.count(1)  # type: ignore[attr-defined]
    threading.main_thread()._set_native_id()  # type: ignore[attr-defined]
    util._finalizer_registry.clear()  # type: ignore[attr-defined]
    util._run_after_forkers()  # type: ignore[attr-defined]


def disown_inherited_process(proc: object) -> None:
    """In a child of a user's ``os.fork()``: ``proc``, a ``multiprocessing.Process`` started
    by the parent (a pool's zygote), is not this process's child. Drop it from
    ``multiprocessing``'s record of children, whose exit hook (3.11 ``util._exit_function``)
    would otherwise SIGTERM it at this process's exit, as a daemonic child (the parent's pool
    then breaks), and fail to join it ("can only join a child process")."""
    from multiprocessing import process

    process._children.discard(proc)  # type: ignore[attr-defined]


def preload_in_forkserver(module: str) -> bool:
    """Before the forkserver start method's first ``Process.start()`` in this process: add
    ``module`` (a module of this package) to the forkserver's preload list, so that the server
    imports it once as it starts and every zygote forked from it has it. Returns whether it did.

    Why: a zygote forked from a running forkserver imported ``mpsched._zygote`` itself, ~4 ms
    of the ~22 ms to a second pool's first result, where ProcessPoolExecutor's worker imports
    ``concurrent.futures.process`` (~2 ms). Preloaded, the import is paid once, in the server's
    own start-up, which the first pool waits for either way.

    Done only while the server has not started (its list is read at its start; the user's
    entries, ``'__main__'`` by default, are kept), and only if the server would import this
    copy of the package: it is a ``python -c`` started in the current directory, whose
    ``sys.path`` is this process's but for the first entry (the current directory, unless
    isolated), and it does not apply the ``sys_path`` it is given (3.10-3.13). A package found
    elsewhere first (a path added at run time, another copy installed) would be a different
    version in every zygote; then nothing is preloaded and each zygote imports the package
    from this process's ``sys.path``, as before. The server ignores a preload that fails to
    import.
    """
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    preload = getattr(server, "_preload_modules", None)
    if (
        server is None
        or getattr(server, "_forkserver_pid", None) is not None
        or not isinstance(preload, list)
        or module in preload
        or not _fresh_interpreter_finds_this_package()
    ):
        return False
    server.set_forkserver_preload([*preload, module])
    return True


def _fresh_interpreter_finds_this_package() -> bool:
    """Whether a ``python -c`` started here, with this process's flags and environment, would
    import this copy of the package (see ``preload_in_forkserver``)."""
    from importlib.machinery import PathFinder

    safe_path = sys.flags.isolated or getattr(sys.flags, "safe_path", False)  # 3.11+: -P
    try:
        search = list(sys.path) if safe_path else [os.getcwd(), *sys.path[1:]]
        spec = PathFinder.find_spec(__name__.partition(".")[0], search)
    except (ImportError, OSError, ValueError):  # an unreadable or odd sys.path entry
        return False
    if spec is None or spec.origin is None:
        return False
    return os.path.realpath(os.path.dirname(spec.origin)) == os.path.realpath(PACKAGE_DIR)


# FD_SETSIZE: ``select.select`` raises ValueError for an fd from this number on, which a pool
# created by a program with many files or sockets open gets (found in review: the pool broke
# at its first timed task, and its end raised in the coordinator thread).
SELECT_FD_LIMIT = 1024


def wait_readable(fd: int, timeout: float | None) -> bool:
    """Wait until ``fd`` is readable or ``timeout`` seconds passed (None: no limit); True if
    readable. ``poll()``, not ``select()``: any fd number (the timeout is rounded up to ms)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(None if timeout is None else math.ceil(timeout * 1000)))


def create_eventfd() -> int:
    """A non-blocking, CLOEXEC eventfd, counter 0: the wake fd of one worker."""
    return os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)


class SharedFd:
    """An fd that can be passed to a spawn/forkserver child in ``Process`` args (by ``DupFd``).

    Under fork the object and its fd are simply inherited. The receiving process owns its copy
    and closes it with ``close()``.
    """

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def close(self) -> None:
        """Close the fd. Idempotent."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __reduce__(self) -> tuple[Callable[..., SharedFd], tuple[Any]]:
        return (_rebuild_fd, (_dup_for_child(self, self.fd),))

    def __repr__(self) -> str:
        return f"<SharedFd {self.fd}>"


def _rebuild_fd(dupfd: Any) -> SharedFd:
    return SharedFd(_own_received_fd(dupfd))
