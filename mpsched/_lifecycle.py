"""What a started pool owns apart from the ``Pool`` object, and who releases it, exactly once;
what becomes of every pool when the process forks or exits.

A ``Pool`` that its user drops (no ``shutdown``, no ``with``) ends like ``shutdown(wait=False)``,
as ``concurrent.futures.ProcessPoolExecutor`` does (its manager thread holds only a weakref to
the executor). So nothing the coordinator thread reaches references the ``Pool``: the thread
runs ``run_coordinator(resources)``, and ``PoolResources`` holds the processes, fds and memory,
never the Pool. The Pool holds its ``PoolResources``; a weakref to the Pool, with a callback,
tells them of the drop (``watch``).

Who releases (``PoolResources.teardown``; a second call is a no-op):
  - the coordinator thread, at its end, once release was asked: by ``Pool.await_termination``
    (``shutdown(wait=True)``, the atexit hook) through ``request_release``, or by the drop.
    After its loop ended, the thread waits on the wakeup pipe for that request, because the
    Pool's ``statistics()`` may read the shared memory until the Pool releases it;
  - ``_startup.abort_start``, after a failed start-up (the loop never ran).

The drop callback (``_on_pool_dropped``) runs wherever the garbage collector runs: in any
thread, possibly inside a critical section of that same thread (the coordinator's lock, the
wakeup's lock), as the map finalizer of tests/integration/test_engine_edges.py showed. So it
takes no lock and waits for nothing: it sets flags and writes a byte to the wakeup pipe
(``Wakeup.wakeup_nowait``); the coordinator loop then begins the shutdown itself
(``ask_shutdown``). A ``shutdown`` that a signal handler or a finalizer calls inside a call of
the pool's in the same thread does the same (``interrupted_pool_call``).

Registries: ``_unreleased``, every started pool's resources until they are released, and
``live_pools``, the started ``Pool`` objects not yet released (weak references). The
process-wide hooks at the end of this module use them, and run in the thread that forks or
exits:
  - after ``os.fork()``, in the child (``_disown_pools_in_forked_child``): the pools stay the
    parent's; their copies here refuse work, and the child lets go of its copies of their
    sockets and processes (``disown_all``);
  - at the interpreter's exit (``shutdown_all_pools``, atexit): shut down every pool still
    referenced, then wait for those that were dropped (``join_dropped``); after a Ctrl-C that
    ended the program, stop them now (``_exiting_on_ctrl_c``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import sys
import threading
import types
import weakref
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from mpsched._clock import join_interruptibly
from mpsched._coordinator import Coordinator
from mpsched._errors import PACKAGE_DIR
from mpsched._function_cache import FunctionCache
from mpsched._future import call_logged
from mpsched._shm import AnonSegment, SharedFd, disown_inherited_process, wait_readable
from mpsched._wakeup import Wakeup
from mpsched._zygote import EXIT_STATUS_LOST, ForkedZygote

if TYPE_CHECKING:
    from mpsched._pool import Pool

ZYGOTE_JOIN_TIMEOUT = 5.0  # seconds the zygote gets to exit after EOF before it is killed

# Resources of started pools not yet released. Written by: PoolResources.watch (the pool's
# thread), teardown (the coordinator thread), disown_all (a fork child).
_unreleased: set[PoolResources] = set()
# Fork start method: the control ends of live pools, which a new zygote must not keep open (the
# zygote of a pool learns of its coordinator's death by EOF there). Kept exact: numbers are
# removed when closed, so a reused number is never closed by mistake.
coordinator_fds: set[int] = set()
# Pools started and not released. Weak: a dropped pool is collected, and then ends by itself
# (docs/design.md, "Lifecycle"); its resources stay in _unreleased until released. Written by:
# _startup.start and Pool._release (user threads), the after-fork hook (a fork child). Read by:
# the atexit hook.
live_pools: weakref.WeakSet[Pool] = weakref.WeakSet()
# Set as the exit hook begins. A pool started after it (in an atexit handler that runs after
# it: one registered before ``import mpsched``) would be cut off with its work at the
# interpreter's finalization (its coordinator is a daemon thread), so it is refused, as
# ProcessPoolExecutor refuses work then. Read by: _startup.start.
_exit_began = False
EXIT_BEGAN_MESSAGE = (
    "cannot start a Pool: the interpreter's exit has shut mpsched's pools down (its atexit "
    "hook ran, before this atexit handler: import mpsched before registering it)"
)


# The frames that call a done-callback, never with a lock of the pool's held (docs/design.md,
# "Where done-callbacks run"): interrupted_pool_call stops at them.
_CALLBACK_CALLERS = frozenset(
    (
        concurrent.futures.Future._invoke_callbacks.__code__,  # type: ignore[attr-defined]
        concurrent.futures.Future.add_done_callback.__code__,
        call_logged.__code__,  # the callback thread's
    )
)


def interrupted_pool_call(
    frame: types.FrameType | None, ordinary: frozenset[types.CodeType] = frozenset()
) -> bool:
    """Whether ``frame``, the caller of a public call of the pool, is user code that a call
    of the pool's in the same thread called back, other than a done-callback: a signal
    handler that interrupted that call (Python runs handlers between two bytecodes of the
    main thread, wherever it is), or a finalizer or weakref callback that the garbage
    collector ran there. That call may hold any of the pool's locks (none is reentrant: the
    state each guards may be half-changed), so the callback must not wait for one.

    Called by ``Pool.shutdown`` only (a walk up the stack: ~0.25 us a frame); the pool's
    own calls of it (a ``with`` block's exit, the exit hook) are not callbacks, nor is a
    subclass's ``shutdown`` that they call: the walk stops at the frames of ``ordinary``
    (before, such an override, calling ``super().shutdown()``, was taken for a callback, and
    the end of a ``with`` block did not wait; found by a review)."""
    if frame is None or frame.f_code.co_filename.startswith(PACKAGE_DIR):
        return False
    frame = frame.f_back
    while frame is not None:
        code = frame.f_code
        if code in _CALLBACK_CALLERS or code in ordinary:
            return False
        if code.co_filename.startswith(PACKAGE_DIR):
            return True
        frame = frame.f_back
    return False


class PoolResources:
    """The processes, fds and shared memory of one pool; never a reference to the ``Pool``.

    Fields are filled by ``_startup.start`` as it creates them (a failed start-up releases what
    exists). Flags below are plain attributes written without a lock: each is set once, never
    cleared, and read after the wakeup byte that follows its write.
    """

    def __init__(self, segment: AnonSegment, wakeup: Wakeup) -> None:
        self.segment = segment
        self.wakeup = wakeup
        self.wake_fds: list[SharedFd] = []
        self.zygote: Any = None  # a multiprocessing Process, or a ForkedZygote
        self.zygote_conn: Connection | None = None
        self.functions: FunctionCache | None = None
        self.coordinator: Coordinator | None = None
        self.thread: threading.Thread | None = None
        # Set by request_release or the drop callback. Read by: the coordinator thread.
        self.release_requested = False
        self.dropped = False  # the Pool was collected. Written by: the drop callback only.
        self.disowned = False  # a fork child's copy: none of it belongs to this process
        self._pool_ref: weakref.ref[Any] | None = None
        self._teardown_lock = threading.Lock()
        self._released = False  # under _teardown_lock
        # The shared memory is gone (set under memory_lock before it is unmapped): a user
        # thread reads it only under that lock and while this is False (Pool.statistics).
        # Reentrant: a signal handler that interrupted a statistics() may call it again.
        self.memory_lock = threading.RLock()
        self.memory_released = False

    def watch(self, pool: object) -> None:
        """The pool started: be told when it is collected; count as unreleased."""
        self._pool_ref = weakref.ref(pool, self._on_pool_dropped)
        _unreleased.add(self)

    def _on_pool_dropped(self, _: weakref.ref[Any]) -> None:
        # The garbage collector's callback: no lock, no wait (see the module docstring).
        coordinator = self.coordinator
        if self.disowned or self.release_requested or coordinator is None:
            return  # a fork child's copy, or released (or being released) by the Pool
        self._deliver_drop(coordinator)

    def _deliver_drop(self, coordinator: Any) -> None:
        self.dropped = True
        self.ask_shutdown(coordinator, cancel_futures=False)

    def ask_shutdown(self, coordinator: Any, cancel_futures: bool) -> None:
        """Any thread, inside any critical section of its own: no lock, no wait (see the
        module docstring). The loop begins a ``shutdown(wait=False, cancel_futures=...)``,
        and the thread tears down once the drain ended."""
        if cancel_futures:
            coordinator.cancel_asked = True  # before shutdown_asked: the loop reads it after
        coordinator.shutdown_asked = True
        self.release_requested = True
        self.wakeup.wakeup_nowait()

    def deliver_lost_drop(self) -> None:
        """Interpreter exit (``join_dropped``): the Pool is gone but its drop was not (fully)
        delivered. The interpreter ignores an exception raised in a weakref callback, so a
        Ctrl-C's KeyboardInterrupt landing in ``_on_pool_dropped`` left the pool running with
        nobody to shut it down, its work then cut off at the exit (or, cut short after
        ``dropped``, the exit waited for ever for a loop never told). Each step again: they
        are idempotent."""
        ref = self._pool_ref
        coordinator = self.coordinator
        if ref is None or ref() is not None or coordinator is None or self.disowned:
            return
        if self.dropped or not self.release_requested:  # else released by the Pool itself
            self._deliver_drop(coordinator)

    def on_lock_stall(self, kind: str, index: int, lock: Any, waited: float) -> None:
        """The guarded locks' stall callback (made before the coordinator exists)."""
        if self.coordinator is not None:
            self.coordinator.on_lock_stall(kind, index, lock, waited)

    def request_release(self) -> None:
        """Any thread but the coordinator's: let the coordinator thread tear down and end once
        its loop ended (``Pool._release`` joins it next; ``shutdown(wait=False)`` does not)."""
        self.release_requested = True
        self.wakeup.wakeup()

    def wait_release_requested(self) -> None:
        """Coordinator thread, after its loop: until ``request_release`` or the drop. The
        flag is written before the wakeup byte, which stays readable until ``clear``, so a
        request between the check and the wait is not lost."""
        fd = self.wakeup.fileno()
        while not self.release_requested:
            wait_readable(fd, None)
            self.wakeup.clear()

    def teardown(self) -> None:
        """Undo what start-up made: processes, fds and memory, so nothing leaks. Once."""
        with self._teardown_lock:
            if self._released:
                return
            self._released = True
        _unreleased.discard(self)
        if self.functions is not None:
            self.functions.close()
        coordinator = self.coordinator
        if coordinator is not None:
            for worker in coordinator.workers:
                if worker is not None:
                    coordinator.forget_worker(worker)
            coordinator.close()
        if self.zygote_conn is not None:
            coordinator_fds.discard(self.zygote_conn.fileno())
            self.zygote_conn.close()  # EOF: the zygote kills its workers and exits
        if self.zygote is not None and self.zygote.pid is not None:
            _join_zygote(self.zygote)
            _close_process(self.zygote)
        self.wakeup.close()
        for fd in self.wake_fds:
            fd.close()
        with self.memory_lock:  # no statistics() is reading it
            self.memory_released = True
        self.segment.close()

    def disown(self) -> None:
        """In the child of ``os.fork()``: let go of the copies of the parent's sockets and
        processes (see ``_disown_pools_in_forked_child``); release nothing else."""
        self.disowned = True
        if self.coordinator is not None:
            self.coordinator.disowned = True  # its futures' copies leave the parent's memory be
        if self.zygote is not None and not isinstance(self.zygote, ForkedZygote):
            disown_inherited_process(self.zygote)  # a Process of the parent's
        if self.zygote_conn is not None:
            # /dev/null takes the number, rather than close(): under the fork start method
            # this child may be a new zygote, which closes the numbers of its config's
            # close_fds (listed before the fork), and a freed number may be reused by then.
            fd = self.zygote_conn.fileno()
            coordinator_fds.discard(fd)
            null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            os.dup2(null, fd, inheritable=False)
            os.close(null)
        if self.coordinator is not None:
            for worker in self.coordinator.workers:
                if worker is not None:
                    with contextlib.suppress(OSError):
                        worker.conn.close()


def _join_zygote(zygote: Any) -> None:
    """Wait for the zygote's exit, killing it after ``ZYGOTE_JOIN_TIMEOUT``."""
    _join_if_exited(zygote, ZYGOTE_JOIN_TIMEOUT)
    if zygote.is_alive():
        zygote.kill()
        zygote.join()


def _join_if_exited(zygote: Any, timeout: float) -> None:
    """Join the zygote if it exits within ``timeout`` seconds. Its exit is watched through a
    pidfd: multiprocessing's timed join (under spawn) watches a pipe whose write end the
    zygote's descendants inherit, so a process that a task left running (``os.system("cmd
    &")``) made every pool's end wait the whole timeout (found in review)."""
    if isinstance(zygote, ForkedZygote):  # watched through its own pidfd
        zygote.join(timeout)
        return
    try:
        pidfd = os.pidfd_open(zygote.pid)
    except OSError:  # reaped already (where SIGCHLD is ignored, or by another thread), no fd
        zygote.join(timeout)
        return
    try:
        exited = wait_readable(pidfd, timeout)
    finally:
        os.close(pidfd)
    if exited:
        zygote.join()


def zygote_exit_code(zygote: Any, timeout: float) -> int | None:
    """The zygote's exit code once it exited within ``timeout`` seconds; None if it runs on,
    or its status is unknown: 255 (``EXIT_STATUS_LOST``) too, ForkedZygote's mark of a status
    the kernel dropped (SIGCHLD ignored), and multiprocessing's when another thread
    (``active_children()``) read the forkserver's report first: it was named as the exit code
    (diff review)."""
    _join_if_exited(zygote, timeout)
    code: int | None = zygote.exitcode
    return None if code == EXIT_STATUS_LOST else code


def _close_process(zygote: Any) -> None:
    """``close()`` the zygote, joined: under spawn it is the pool's child, and where the pool's
    process ignores SIGCHLD the kernel reaped it, so multiprocessing's waitpid finds no child
    and takes it for running: ``close()`` raised ValueError, and the pool's end left its
    sentinel's fd open and a traceback in the coordinator thread. Joined, it is gone (its
    sentinel said so): its exit status, which the kernel dropped, is marked lost."""
    try:
        zygote.close()
    except ValueError:
        zygote._popen.returncode = EXIT_STATUS_LOST
        zygote.close()


def run_coordinator(resources: PoolResources) -> None:
    """The coordinator thread's main: the loop, then (once release is asked) the teardown."""
    coordinator = resources.coordinator
    assert coordinator is not None
    try:
        try:
            coordinator.run()
        finally:
            if not coordinator.start_aborted:  # else _startup.abort_start tears down
                # The last look at the slots' counters: the loop has ended, so they are final
                # (statistics() reads them from here on). A worker that died in the drain sent
                # no DRAINED (and one recycled or crashed before counted in its slot, which
                # its successor goes on from): its slot kept what it ran.
                final = coordinator.final_stats
                for k, slot in enumerate(coordinator.slots):
                    final[k] = slot.counters()
                resources.wait_release_requested()
                resources.teardown()
    finally:
        # A thread started after this one ended may get its ident (the OS reuses them): taken
        # for this thread, its shutdown(wait=True) waited for nothing (no wait from the
        # coordinator thread, which would wait for its own end) and returned with the
        # done-callbacks still running.
        coordinator.thread_id = 0


def inherited_by_a_fork() -> list[AnonSegment | SharedFd]:
    """Fork start method, before a pool's zygote forks: what of the other started pools the
    zygote closes (``ZygoteConfig.inherited``): their segments and wake eventfds, which close
    with no lock (a lock a thread of the parent held at the fork stays held in the child)."""
    inherited: list[AnonSegment | SharedFd] = []
    for resources in list(_unreleased):
        inherited.append(resources.segment)
        inherited += resources.wake_fds
    return inherited


def exit_began() -> bool:
    return _exit_began


def disown_all() -> None:
    """In the child of ``os.fork()``: every pool's resources are the parent's."""
    for resources in list(_unreleased):
        resources.disown()
    _unreleased.clear()


def join_dropped(stop: bool = False) -> None:
    """Interpreter exit, once the pools still referenced were shut down: wait for the pools
    that were dropped while their work went on (their coordinator threads tear them down),
    as for the pools still referenced; so too for one shut down without waiting and then
    dropped, whose drop was not delivered (its release was asked for already): skipped, its
    work was cut off by multiprocessing's exit hook (the zygote terminated). Ctrl-C while
    waiting, or ``stop`` (the program ended on one), stops them now, as it stops a ``with``
    block's pool."""
    for resources in list(_unreleased):
        resources.deliver_lost_drop()
        thread = resources.thread
        coordinator = resources.coordinator
        if resources.disowned or thread is None or coordinator is None:
            continue
        if stop:
            coordinator.begin_shutdown(True)
            coordinator.abort_running()
        try:
            join_interruptibly(thread)
            coordinator.callbacks.join()  # closed at the loop's end: their last ones run
        except BaseException:
            coordinator.begin_shutdown(True)
            coordinator.abort_running()
            raise


FORKED_CHILD_MESSAGE = (
    "this pool belongs to the process that created it (pid {pid}); this process is a child of "
    "os.fork() and cannot use it: create a new Pool here"
)


def _disown_pools_in_forked_child() -> None:
    """``os.fork()`` (by user code, or a zygote under the fork start method): the child has
    copies of the pools' objects but not their coordinator threads, and shares their memory
    with the parent. The pools stay the parent's: here a submit would write into the parent's
    shared memory behind its coordinator's back (which then breaks on a block it never
    handed out), and a shutdown (the atexit hook at the child's exit) would wait forever for a
    coordinator thread that this process does not have. So the child's copies refuse work
    with a clear error and their shutdown does nothing (the parent's pool goes on). The
    child also closes its copies of the coordinator's sockets: the zygote learns of its
    coordinator's death by EOF on the control socket, which a copy here kept open, so the
    parent's workers outlived a SIGKILLed parent as long as this child lived."""
    for pool in list(live_pools):
        pool._closed_message = FORKED_CHILD_MESSAGE.format(pid=pool._coordinator_pid)
        pool._closed = True
        pool._started = False
    disown_all()  # every pool's, referenced or dropped: sockets, zygote processes
    live_pools.clear()
    _forget_the_parents_forkserver()


def _forget_the_parents_forkserver(close_alive: bool = True) -> None:
    """The parent's forkserver is not this process's child: ``multiprocessing`` asks
    ``waitpid`` whether it still runs, which raised ChildProcessError at the child's first
    forkserver ``Process`` (a new ``Pool()``, which the error of the parent's pool here tells
    the user to make; ProcessPoolExecutor fails the same way). Forgotten, as if none had
    started here: the child starts its own. Its copy of the server's alive fd is closed (it
    kept the parent's server alive as long as the child lived). Found by a review."""
    forkserver = sys.modules.get("multiprocessing.forkserver")
    server = getattr(forkserver, "_forkserver", None)
    if server is None or getattr(server, "_forkserver_pid", None) is None:
        return
    alive = server._forkserver_alive_fd
    server._forkserver_pid = server._forkserver_address = server._forkserver_alive_fd = None
    if alive is not None and close_alive:
        with contextlib.suppress(OSError):
            os.close(alive)


def forget_a_foreign_forkserver() -> None:
    """Before a forkserver ``Pool()`` starts its zygote: a server that is not this process's
    child is a parent's, inherited through an ``os.fork()`` that came before this module's
    at-fork hook existed (``import mpsched`` imports this module only with the first pool):
    forgotten, as that hook would have (``_forget_the_parents_forkserver``), but for the fd
    that kept the parent's server alive: by now its number may be another file of this
    program's (a review saw the program's ``/dev/null`` closed so). ``WNOWAIT``: the check reaps
    no child of ours. Found by a review."""
    forkserver = sys.modules.get("multiprocessing.forkserver")
    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if pid is None:
        return
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        _forget_the_parents_forkserver(close_alive=False)


os.register_at_fork(after_in_child=_disown_pools_in_forked_child)


def _exiting_on_ctrl_c() -> bool:
    """The interpreter exits because a KeyboardInterrupt reached the top of the main module:
    its report there set ``sys.last_value``. Not in an interactive session, where that is
    whatever failed last at the prompt."""
    return isinstance(getattr(sys, "last_value", None), KeyboardInterrupt) and not hasattr(
        sys, "ps1"
    )


def shutdown_all_pools() -> None:
    """Interpreter exit (the package's atexit hook, ``mpsched._at_exit``): finish and stop
    every pool the user did not shut down; after a Ctrl-C that ended the program, stop them
    now, as leaving a ``with`` block on it does (the interrupted wait was outside one: the
    exit waited for every running task)."""
    global _exit_began
    _exit_began = True
    stop = _exiting_on_ctrl_c()
    for pool in list(live_pools):
        with contextlib.suppress(Exception):
            if stop and pool._started:
                pool.shutdown(wait=False, cancel_futures=True)
                pool._coordinator.abort_running()
            pool.shutdown(wait=True)
    join_dropped(stop)
