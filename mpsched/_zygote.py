"""The zygote: one clean, single-threaded process that forks the pool's workers.

Why it exists (FEASIBILITY.md, "Start methods"): the coordinator lives in the user's process,
which may have threads, and forking a threaded process can deadlock the child. The pool starts
the zygote once through the chosen start method (forkserver by default); the zygote opens the
named semaphores (after which the coordinator unlinks every name, so nothing named survives
start-up) and maps the memfd segment, then ``os.fork()``s each worker and each replacement.
Workers inherit the locks, the segment and the wake eventfds through that fork.

Called from: ``_pool`` starts ``zygote_main`` as the target of ``ctx.Process`` (forkserver,
spawn) or in a bare fork (``ForkedZygote``, fork start method). Runs in the zygote process only;
``_spawn`` runs the worker (``_worker.worker_main``) in the forked child.

Protocol with the coordinator (one duplex Connection; see ``_protocol``):
    coord  -> the other wake fds        first, only if the config carries fewer wake fds than
                                        the pool has slots (``send_wake_fds``): the rest, in
                                        SCM_RIGHTS messages of up to ``FDS_PER_MESSAGE``,
                                        sent by ``Pool()`` right after the zygote's start;
                                        received before anything else (``_receive_wake_fds``)
    zygote -> READY (its __main__ names) after attaching; then it forks the pool's initial
                                        workers (``ZygoteConfig.initial_slots``), answering
                                        SPAWNED for each as for a SPAWN; the other slots are
                                        dormant until the coordinator SPAWNs them
    coord  -> START(modules, state)     first, if ``ZygoteConfig.await_start``: the initial
                                        workers wait for it (the pool's first task); the
                                        zygote takes ``state`` (the pool's process's working
                                        directory, sys.path and environment) and imports
                                        ``modules`` before forking them
    coord  -> SPAWN(slot, dormant)      (a dormant slot's first worker, or a replacement)
                                        zygote forks, answers SPAWNED(slot, pid) and then
                                        sends the coordinator's end of the worker's socket
                                        pair as an fd (``send_fd``); ``dormant``: other
                                        slots are still dormant (see ``worker_main``)
    zygote -> SPAWN_FAILED(slot, error) instead of SPAWNED: the fork (or its socket pair, or
                                        its pidfd) failed for want of fds or processes; the
                                        coordinator tries again later
    zygote -> EXITED(slot, pid, code)   a worker exited (reaped here; its pidfd fired)
    coord  -> STOP                      spawn no more; exit once every worker has been reaped

Death: if the coordinator dies, or breaks the pool (it shuts the socket down), the control
Connection reaches EOF; the zygote SIGKILLs every worker, reaps them and exits. If the zygote
dies, each worker gets SIGKILL from the kernel (``PR_SET_PDEATHSIG``, set in the worker right
after fork; the zygote is single-threaded, so the "parent thread" it refers to is the zygote
itself). So a SIGKILL of the coordinator leaves no process behind, and the memfd and the
unlinked semaphores vanish with their last holder.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import select
import signal
import socket
import sys
from multiprocessing.connection import Connection

from mpsched._children import end_process
from mpsched._errors import ProtocolError
from mpsched._layout import SegmentLayout, SegmentLocks, SegmentViews, attach
from mpsched._protocol import Tag, decode, encode, recv_fds, send_fd, send_fds, socket_of
from mpsched._shm import (
    AnonSegment,
    SharedFd,
    become_forked_child,
    death_signal_setter,
    wait_readable,
)
from mpsched._stdio import dup_above_stdio, fill_stdio
from mpsched._worker import WorkerOptions, worker_main  # loaded once; every worker inherits it

# typing.TYPE_CHECKING without importing typing at run time (why: mpsched/__init__.py).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any, NoReturn

# Looked up at import: every worker calls it right after fork, on its start-up path, and under
# the fork start method the zygote inherits it from the pool's process (imported before).
_set_death_signal = death_signal_setter()
ZYGOTE_NAME = "mpsched-zygote"  # its multiprocessing.current_process().name, and its workers'
# The kernel's cap on the fds of one SCM_RIGHTS message is SCM_MAX_FD, 253: beyond it sendmsg
# fails with EINVAL. (Under forkserver multiprocessing sends every fd of a Process's pickled
# args, with 4 of its own, in one such message: why the config carries a bounded number of wake
# fds, and this module sends the others, see send_wake_fds.)
FDS_PER_MESSAGE = 250  # fds per SCM_RIGHTS message; below SCM_MAX_FD (253)
# ForkedZygote's exit code when the kernel reaped it (the pool's process ignores SIGCHLD) and
# its status is gone; as a negative code is a signal's, 255 (exit(-1)) stands for "unknown".
EXIT_STATUS_LOST = 255
# Seconds a worker's exit gives multiprocessing's exit finalizers (a Queue's thread writing
# what tasks put on it) and the flush of its streams before SIGALRM's default action ends it: a
# queue filled past its pipe's capacity, which nobody read, held each exit the retiring alarm's
# 10 s, every recycle and the shutdown (a diff review; ProcessPoolExecutor's waits for ever).
EXIT_FLUSH_TIMEOUT = 1.0


class ZygoteConfig:
    """Everything the zygote needs; pickled once when it is spawned (fds travel by DupFd).

    A plain class: a dataclass would make the zygote import dataclasses (and inspect, ast, dis),
    ~10 ms on the start-up path of every pool.
    """

    def __init__(
        self,
        *,
        conn: Connection,
        segment: AnonSegment,
        layout: SegmentLayout,
        locks: SegmentLocks,
        wake_fds: list[SharedFd],
        worker_options: WorkerOptions,
        close_fds: list[int],
        initial_slots: list[int],
        await_start: bool = False,
        views: SegmentViews | None = None,
        inherited: Sequence[AnonSegment | SharedFd] = (),
    ) -> None:
        self.conn = conn
        self.segment = segment
        self.layout = layout
        self.locks = locks
        # The first wake fds (by slot), or all of them; the zygote receives the others over
        # ``conn`` before it attaches (``send_wake_fds``), so it has one per slot before READY.
        self.wake_fds = wake_fds
        self.worker_options = worker_options
        self.close_fds = close_fds  # fork start method: coordinator-side fds inherited by accident
        self.initial_slots = initial_slots  # forked with no SPAWN each, after READY or START
        self.await_start = await_start  # fork them only once START came (see _await_start)
        # Fork start method: the workers' views, attached by the pool's process before the fork
        # (inherited, never pickled), so that the zygote's path to its first fork is shorter.
        self.views = views
        # Fork start method: the other live pools' segments and wake eventfds, which the fork
        # copied (never pickled). Closed first: a pool shut down meanwhile kept its memory
        # (~10 MiB) mapped in this pool's zygote and workers until this pool ended.
        self.inherited = inherited


def zygote_main(cfg: ZygoteConfig) -> None:
    """Target of the zygote's ``Process``. Never returns normally: exits with ``end_process``."""
    # What this process inherited (under fork: the user's whole heap) is never collected here
    # nor in the workers: a garbage cycle not yet collected in the user's process had its
    # finalizers run again in each (a file removed, a message sent, twice); and a collection
    # that walks inherited objects writes to their pages, which the fork shared.
    gc.freeze()
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the coordinator
        # Blocked since Pool() made us (fork, spawn: _startup._sigint_blocked), so that a
        # Ctrl-C during our start raised nothing; a pending one is dropped as it is ignored.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        # Reaping needs SIGCHLD's default action: ignored (a daemon's way to have no zombies,
        # inherited from the pool's process by fork, or through exec from a forkserver it
        # started), the kernel reaped the workers itself, and the zygote's waitpid failed
        # with ECHILD at the first worker's death: the pool broke. The workers get it back.
        workers_sigchld = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in cfg.close_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        for owned in cfg.inherited:  # each marks itself closed: no number is closed twice
            with contextlib.suppress(BufferError, OSError):  # a view left: the fd goes anyway
                owned.close()
        # Before this process makes or receives an fd, which every worker would inherit: none
        # on 0, 1 or 2 (see _stdio). The fds of the config are above 2 already (Pool() made
        # them so, and received ones are moved), but for the control socket under forkserver.
        if cfg.conn.fileno() <= 2:
            lifted = Connection(dup_above_stdio(cfg.conn.fileno()))
            cfg.conn.close()
            cfg.conn = lifted
        fill_stdio(inheritable=True)
        if not _receive_wake_fds(cfg):
            return  # EOF: Pool() gave up (a Ctrl-C in it) before sending them: exit quietly
        views = cfg.views if cfg.views is not None else attach(cfg.segment, cfg.layout, cfg.locks)
        _Zygote(cfg, views, workers_sigchld).serve()
    except BaseException:
        _print_exc()
        code = 1
    finally:
        try:
            _flush_std_streams()
        finally:
            end_process(code)


THREADED_ZYGOTE_WARNING = (
    "mpsched: the pool's zygote runs threads ({names}), started by an import (of the main "
    "module, which spawn and forkserver run again in it, or of the first task's module). The "
    "workers are forked from the zygote: a lock that such a thread holds at a fork stays held "
    "in that worker for ever, and a task that takes it hangs. Start such threads under "
    "`if __name__ == '__main__':`, or in each worker with the pool's initializer."
)


def _warn_if_threaded() -> None:
    """Before the first fork: say so if an import left this process with other threads (found
    in review: a main module that starts a thread holding a lock at times hung the workers of
    spawn and forkserver, where the stdlib's pools run the module afresh in each worker). Not
    an error: most such threads hold no lock that a task needs."""
    import threading

    me = threading.current_thread()
    others = [thread.name for thread in threading.enumerate() if thread is not me]
    if others:
        import warnings

        # Told, not raised: under ``-W error`` (which spawn passes on) it killed the zygote.
        with contextlib.suppress(Warning):
            warnings.warn(
                THREADED_ZYGOTE_WARNING.format(names=", ".join(others)), RuntimeWarning, 2
            )


def send_wake_fds(conn: Connection, wake_fds: Sequence[SharedFd]) -> None:
    """The pool's process, right after the zygote's start: send it the wake fds that its
    config does not carry, before any other message on ``conn``. No answer is awaited: the
    messages wait in the socket until the zygote reads them (``_receive_wake_fds``).

    Why: under forkserver ``multiprocessing`` passes every fd of a ``Process``'s pickled args
    to its server in one SCM_RIGHTS message, with 4 of its own: more than 251 failed with
    ValueError ("too many fds"), 250 and 251 with EINVAL (over SCM_MAX_FD), which also killed
    the server (an EOFError in it), so that the process's next forkserver pool failed too.
    """
    sock = socket_of(conn)
    try:
        for i in range(0, len(wake_fds), FDS_PER_MESSAGE):
            fds = [f.fd for f in wake_fds[i : i + FDS_PER_MESSAGE]]
            send_fds(sock, fds)
    finally:
        sock.detach()


def _receive_wake_fds(cfg: ZygoteConfig) -> bool:
    """Receive the wake fds that ``send_wake_fds`` sent, until there is one per slot (none to
    receive under fork, or when the config carried them all). Returns False at EOF (Pool()
    gave up before sending them all). Raises OSError(EMFILE) if this process had no fd free
    for them: the zygote dies before READY, so ``Pool()`` fails (BrokenPoolError)."""
    if len(cfg.wake_fds) >= cfg.layout.n_slots:
        return True
    sock = socket_of(cfg.conn)
    try:
        while len(cfg.wake_fds) < cfg.layout.n_slots:
            msg, fds, flags = recv_fds(sock, FDS_PER_MESSAGE)
            cfg.wake_fds += [SharedFd(fd) for fd in fds]
            if flags & socket.MSG_CTRUNC:  # the kernel dropped what it could not install
                raise OSError(
                    errno.EMFILE,
                    f"the pool's zygote had no file descriptor free for the workers' wake "
                    f"fds ({cfg.layout.n_slots} workers; the open-file limit, RLIMIT_NOFILE, "
                    "reached?)",
                )
            if not msg:
                return False
    finally:
        sock.detach()
    return True


def _take_state(state: tuple[str | None, list[str], dict[str, str]]) -> None:
    """The pool's process's working directory, ``sys.path`` and environment as START carried
    them (``_coordinator.process_state``), for every worker forked from here on. A directory
    that cannot be entered is left as it was, as multiprocessing does."""
    cwd, path, environ = state
    if cwd is not None:
        with contextlib.suppress(OSError):
            os.chdir(cwd)
    sys.path[:] = path
    for name in [name for name in os.environ if name not in environ]:
        del os.environ[name]
    for name, value in environ.items():
        if os.environ.get(name) != value:  # each set is a putenv(): only what changed
            os.environ[name] = value


class _Zygote:
    def __init__(self, cfg: ZygoteConfig, views: SegmentViews, workers_sigchld: Any) -> None:
        self.cfg = cfg
        # SIGCHLD's handler for the workers: the one this process inherited, or the one that
        # the first task's module set (see zygote_main and _await_start).
        self.workers_sigchld = workers_sigchld
        self.views = views
        self.conn = cfg.conn
        self.poller = select.poll()
        self.poller.register(self.conn.fileno(), select.POLLIN)
        self.children: dict[int, tuple[int, int]] = {}  # pidfd -> (slot, pid)
        self.stopping = False

    def serve(self) -> None:
        try:
            # With the names in its __main__, which its workers share (they fork from it):
            # the pool's process sends stand-ins only for objects of its own __main__ that are
            # not there (_function_cache).
            main = sys.modules.get("__main__")
            self.conn.send_bytes(encode(Tag.READY, tuple(getattr(main, "__dict__", ()))))
        except OSError:  # EPIPE: Pool() gave up before READY (a Ctrl-C in it): exit quietly,
            self._coordinator_gone()  # not with a traceback on the user's terminal
        if self.cfg.await_start:
            self._await_start()
        if not self.stopping:
            _warn_if_threaded()
            initial = self.cfg.initial_slots
            for slot in initial:  # the other slots wait for a SPAWN (dormant)
                self._spawn(slot, len(initial) < self.cfg.layout.n_slots)
        while not (self.stopping and not self.children):
            for fd, _ in self.poller.poll():
                if fd == self.conn.fileno():
                    self._on_command()
                else:
                    self._on_child_exit(fd)

    def _await_start(self) -> None:
        """Forkserver and spawn, with no initializer: before forking the initial workers, wait
        for START (the pool's first task, with the module of its function, imported here once
        so that every worker inherits it; or the drain of a pool that got none) or STOP (a pool
        that broke first: none is forked). Each worker, a child of this process, imported that
        module with ~3x the page faults of the same import here (docs/design.md, "The first
        task's module")."""
        try:
            tag, fields = decode(self.conn.recv_bytes())
        except (EOFError, OSError):
            self._coordinator_gone()
        if tag == Tag.STOP:
            self.stopping = True
            return
        if tag != Tag.START:
            raise ProtocolError(f"the zygote got {Tag.name(tag)} before START")
        _take_state(fields[1])  # before the imports: a path added since Pool() may hold them
        for name in fields[0]:
            if name not in sys.modules:
                # An import that fails here fails again in the worker that needs it, which
                # sends the error to the task's future, where its user sees it.
                with contextlib.suppress(BaseException):
                    __import__(name)
        handler = signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # a module may have set one
        if handler != signal.SIG_DFL:
            self.workers_sigchld = handler

    def _on_command(self) -> None:
        try:
            frame = self.conn.recv_bytes()
        except (EOFError, OSError):
            self._coordinator_gone()
        tag, fields = decode(frame)
        if tag == Tag.SPAWN:
            if not self.stopping:
                self._spawn(*fields)
        elif tag == Tag.STOP:
            self.stopping = True
        # else START again (a Ctrl-C in the pool's process right after it sent one): done

    def _spawn(self, slot: int, peers_dormant: bool) -> None:
        try:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError as exc:  # EMFILE, ENFILE: see _spawn_failed
            self._spawn_failed(slot, exc)
            return
        zygote_pid = os.getpid()
        gc.freeze()  # and what the zygote made since (a module it imported): see zygote_main
        try:
            pid = os.fork()
        except OSError as exc:  # EAGAIN (a process limit), ENOMEM
            ours.close()
            theirs.close()
            self._spawn_failed(slot, exc)
            return
        if pid == 0:  # the worker
            ours.close()
            self._become_worker(slot, theirs, zygote_pid, peers_dormant)
        theirs.close()
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as exc:  # EMFILE: a worker this process cannot watch is not kept
            os.kill(pid, signal.SIGKILL)  # not reaped yet: the pid is still that child's
            os.waitpid(pid, 0)
            ours.close()
            self._spawn_failed(slot, exc)
            return
        self.children[pidfd] = (slot, pid)
        self.poller.register(pidfd, select.POLLIN)
        try:
            self.conn.send_bytes(encode(Tag.SPAWNED, slot, pid))
            send_fd(self.conn, ours.fileno())
        except OSError:  # EPIPE: the coordinator closed its end (it is gone, or gave up)
            self._coordinator_gone()
        finally:
            ours.close()

    def _spawn_failed(self, slot: int, error: OSError) -> None:
        """A worker could not be forked for now (out of fds or processes: a limit the user's
        program reaches for a while): say so, and go on. The zygote died of it, and the pool
        broke for good, blaming its start-up, even while another worker ran (found in
        review); the coordinator now tries again later (``Coordinator.spawn_failed``)."""
        try:
            self.conn.send_bytes(encode(Tag.SPAWN_FAILED, slot, str(error)))
        except OSError:  # EPIPE: as in _spawn
            self._coordinator_gone()

    def _become_worker(
        self, slot: int, sock: socket.socket, zygote_pid: int, peers_dormant: bool
    ) -> None:
        code = 1
        try:
            _set_death_signal(signal.SIGKILL)  # SIGKILL us when the zygote dies
            if os.getppid() != zygote_pid:  # the zygote died between fork and prctl
                end_process(1)
            handler = self.workers_sigchld
            if handler == signal.SIG_IGN or callable(handler):  # None: not settable here
                signal.signal(signal.SIGCHLD, handler)
            for pidfd in self.children:
                os.close(pidfd)
            self.conn.close()
            code = worker_main(
                slot,
                self.views,
                self.cfg.wake_fds,
                Connection(sock.detach()),
                self.cfg.worker_options,
                peers_dormant,
            )
        except BaseException:
            _print_exc()
        finally:
            try:
                _run_exit_finalizers()
                _flush_std_streams()
            finally:  # whatever a task left in sys.stdout: never on in the zygote's code
                end_process(code)

    def _on_child_exit(self, pidfd: int) -> None:
        slot, pid = self.children.pop(pidfd)
        self.poller.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        with contextlib.suppress(OSError):
            self.conn.send_bytes(encode(Tag.EXITED, slot, pid, os.waitstatus_to_exitcode(status)))

    def _coordinator_gone(self) -> NoReturn:
        """EOF or EPIPE on the control socket: the coordinator is gone (or has given up on
        us): take every worker with us and exit."""
        self._kill_all()
        end_process(0)

    def _kill_all(self) -> None:
        for _, pid in self.children.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pidfd, (_, pid) in list(self.children.items()):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            os.close(pidfd)
        self.children.clear()


class ForkedZygote:
    """Fork start method: the zygote as a bare ``os.fork()`` of the pool's process.

    With ``multiprocessing.Process`` the zygote's code starts ~1.4 ms later (measured alone: in
    the parent pipes, a finalizer, bookkeeping; in the child its bootstrap, mostly a new
    ``sys.stdin``; ~0.4 ms of the pool's median start-up to first result, the rest overlaps
    the pool's own set-up), and the zygote needs only the part of that bootstrap that
    ``become_forked_child`` keeps. Has the members of ``Process`` that the pool (and its tests)
    use: ``pid``, ``join``, ``is_alive``, ``kill``, ``close``. The child is reaped through a
    pidfd. Under forkserver and spawn the zygote stays a ``Process``: there it is a new
    program, and multiprocessing's start-up is what brings it up.
    """

    def __init__(self, cfg: ZygoteConfig) -> None:
        _flush_std_streams()  # buffered output must not be written twice
        parent_pid = os.getpid()
        stdin = None
        if sys.stdin is not None:  # the child's sys.stdin: a reader of fd 0 (/dev/null there)
            with contextlib.suppress(OSError):
                stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
        pid = os.fork()
        if pid == 0:  # the zygote: never returns (as multiprocessing's Popen._launch, even a
            try:  # signal between the two calls must not run the pool's code on in this child)
                become_forked_child(ZYGOTE_NAME, parent_pid, stdin)
                zygote_main(cfg)  # exits with end_process
            except BaseException:
                _print_exc()
            finally:
                end_process(1)
        if stdin is not None:
            stdin.close()  # closefd=False: fd 0 stays open
        self.pid = pid
        self.exitcode: int | None = None
        try:
            self._pidfd = os.pidfd_open(pid)  # works until we reap it, even once it exited
        except BaseException:  # EMFILE: nobody would reap the child (a zombie per Pool())
            with contextlib.suppress(ProcessLookupError, ChildProcessError):  # see join
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            raise

    def join(self, timeout: float | None = None) -> None:
        if self.exitcode is not None:
            return
        if not wait_readable(self._pidfd, timeout):
            return
        try:
            _, status = os.waitpid(self.pid, 0)
        except ChildProcessError:  # this process ignores SIGCHLD: the kernel reaped it
            self.exitcode = EXIT_STATUS_LOST
        else:
            self.exitcode = os.waitstatus_to_exitcode(status)

    def is_alive(self) -> bool:
        self.join(0)
        return self.exitcode is None

    def kill(self) -> None:
        # Through the pidfd, which names this process only: reaped by the kernel (see join),
        # its pid may be another process's by now.
        if self.exitcode is None and self._pidfd >= 0:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    def close(self) -> None:
        if self.is_alive():
            raise ValueError("cannot close the zygote while it is still running")
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1


def _print_exc() -> None:
    import traceback  # only on this path: a few ms at every zygote's start-up otherwise

    with contextlib.suppress(Exception):  # sys.stderr may be None or closed (a task's doing)
        traceback.print_exc(file=sys.stderr)


def _run_exit_finalizers() -> None:
    """A worker's exit: multiprocessing's exit finalizers of this process, as a multiprocessing
    child runs them as it ends (each runs only in the process that made it). A ``Queue`` of the
    initializer's arguments writes what tasks put on it from a thread of its own, which
    ``os._exit`` killed: with ``max_tasks_per_worker`` a review saw 125 of 200 items arrive
    (ProcessPoolExecutor's workers deliver all). The queue's finalizer waits for that thread;
    if nothing reads the queue it waits ``EXIT_FLUSH_TIMEOUT`` (then SIGALRM ends the worker,
    after its DRAINED or RETIRING: no crash), where ProcessPoolExecutor's shutdown waits for
    ever."""
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.setitimer(signal.ITIMER_REAL, EXIT_FLUSH_TIMEOUT)  # for the flush after it too
    util = sys.modules.get("multiprocessing.util")
    if util is not None:
        with contextlib.suppress(Exception):
            util._run_finalizers()


def _flush_std_streams() -> None:
    """Flush stdout and stderr before ``os._exit`` or a fork. A task may have replaced or
    closed them (``sys.stdout = None``), or put there an object whose ``flush`` raises: that is
    no error of the worker's exit (it printed a traceback that blamed the zygote's code, and the
    worker exited with code 1)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
