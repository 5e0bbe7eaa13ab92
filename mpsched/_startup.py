"""Pool start-up: size the shared memory, start the zygote and the coordinator thread.

Owns the segment's sizes (the ``DISPATCH_WINDOW`` default and the per-worker constants below),
the order of the start-up, and its undoing when it fails. Called from: ``Pool.__init__`` (the
user thread creating the pool), once its arguments are checked: ``start`` fills the Pool's
aliases of what its ``_lifecycle.PoolResources`` holds, and, on any failure (a BaseException
too), ``abort_start`` ends the waiting coordinator thread and releases what exists, so nothing
leaks and the Pool is never registered.

Start-up, in order (the reasons are in docs/design.md, section 2):
  1. sweep semaphore names left by a process that died inside the start-up window;
  2. create the memfd segment (no name), the locks (named for now), one wake eventfd per slot,
     and format the segment but for the slab's free stack;
  3. start the zygote through the start method (under fork: a bare fork, see ForkedZygote;
     under forkserver, a pool that starts the server has it preload the zygote's modules,
     ``_shm.preload_in_forkserver``; its config carries at most ``WAKE_FDS_IN_CONFIG`` wake
     fds, the others follow on its socket, ``_zygote.send_wake_fds``); it opens the locks and
     maps the segment; meanwhile
     build the coordinator, mark the initial workers as starting (the others dormant), fill
     the free stack and start the coordinator thread (it waits);
  4. on READY, unlink every lock name (from here on nothing of the pool has a name), let the
     coordinator thread go and return: the workers are not waited for;
  5. the zygote forks the initial workers (listed in its config: no SPAWN message each; the
     first one only, unless there is an initializer); the coordinator thread registers each as
     its SPAWNED comes, and SPAWNs the dormant ones as work waits for them
     (``Coordinator.wake_dormant``). A task submitted before may wait in a starting worker's
     inbox. Under forkserver and spawn, with no initializer, the zygote forks the first one
     only once the pool's first submission sends START (``Pool._release_workers``) with the
     module of its function, which the zygote imports first, so that the workers inherit it
     (``ZygoteConfig.await_start``).

Ctrl-C: SIGINT is held (noted, not raised) from step 1 to the end, but for the wait for
READY in step 4 (``_HeldInterrupt``): there every resource is in ``PoolResources``, which
``abort_start`` undoes; a Ctrl-C held elsewhere is raised at the wait, or, after READY, once
the pool is whole and registered (the caller never gets it: it ends as a dropped pool does).

Invariants: once ``start`` returned or raised, nothing of the pool has a name (the locks'
names are unlinked in its ``finally``); a pool is in ``_lifecycle.live_pools``, and its
resources are watched for its drop, only once it started.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import signal
import threading
from collections.abc import Iterator
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from mpsched._coordinator import Coordinator
from mpsched._errors import PoolClosedError
from mpsched._function_cache import FunctionCache
from mpsched._layout import SegmentLayout, SegmentLocks, attach, create_locks
from mpsched._lifecycle import (
    EXIT_BEGAN_MESSAGE,
    PoolResources,
    coordinator_fds,
    exit_began,
    forget_a_foreign_forkserver,
    inherited_by_a_fork,
    live_pools,
    run_coordinator,
    zygote_exit_code,
)
from mpsched._shm import (
    AnonSegment,
    SharedFd,
    create_eventfd,
    preload_in_forkserver,
    sweep_stale_names,
)
from mpsched._stdio import stdio_held
from mpsched._wakeup import Wakeup
from mpsched._zygote import (
    ZYGOTE_NAME,
    ForkedZygote,
    ZygoteConfig,
    send_wake_fds,
    zygote_main,
)

if TYPE_CHECKING:
    from mpsched._pool import Pool

DISPATCH_WINDOW = 128  # tasks per worker inbox; larger = fewer wake-ups, longer cancel window
DISPATCH_WINDOW_MAX = 4096  # the inbox ring is sized for the window
INFLIGHT_PER_WORKER = 4 * DISPATCH_WINDOW  # dispatched-unfinished tasks, per worker
BLOCKS_PER_WORKER = 2048  # slab blocks per worker: in-flight tasks plus their children
DEQUE_CAPACITY = 1024  # children queued per worker before they run inline
# Wake eventfds pickled with the zygote's config (forkserver, spawn); a pool with more workers
# sends it the others after its start (_zygote.send_wake_fds). Under forkserver every fd of the
# config goes to multiprocessing's server in one SCM_RIGHTS message (at most 249 fds of ours:
# SCM_MAX_FD, 253, less its 4): this leaves room for the segment, the control socket and fds in
# the initializer's arguments (a Queue's pipe), and Pool() on up to 128 CPUs sends no more.
WAKE_FDS_IN_CONFIG = 128
STARTUP_TIMEOUT = 60.0  # seconds for the zygote to come up (spawn imports the main module)
_MAX_SEGMENT_BYTES = 1 << 63  # off_t: ftruncate's limit


def start(pool: Pool) -> None:
    """``Pool.__init__``, once the arguments are checked: start the pool (see above); on
    failure, undo what was made and raise. A Ctrl-C is held while anything is made (see
    ``_HeldInterrupt``) and goes through only during the wait for READY."""
    if exit_began():
        raise PoolClosedError(EXIT_BEGAN_MESSAGE)
    held = _HeldInterrupt()
    held.hold()
    try:
        with stdio_held():  # none of the pool's fds on 0, 1 or 2: see _stdio
            _start(pool, held)
    finally:
        held.release()  # a Ctrl-C held since the wait for READY is raised here: the pool is whole


def _start(pool: Pool, held: _HeldInterrupt) -> None:
    sweep_stale_names()
    n = pool._workers
    layout = SegmentLayout(
        n_slots=n,
        deque_capacity=DEQUE_CAPACITY,
        inbox_capacity=_pow2(pool._window),
        done_capacity=_pow2(max(INFLIGHT_PER_WORKER, 4 * pool._window) * n),
        block_count=BLOCKS_PER_WORKER * n,
    )
    if layout.total_bytes >= _MAX_SEGMENT_BYTES:  # else an OverflowError deep in ftruncate
        raise ValueError(
            f"workers={n} is too many: the pool's shared memory would take "
            f"{layout.total_bytes:.3e} bytes"
        )
    segment = AnonSegment.create(layout.total_bytes)
    try:
        pool._wakeup = Wakeup()
    except BaseException:  # EMFILE: the segment's fd went with it
        segment.close()
        raise
    res = pool._resources = PoolResources(segment, pool._wakeup)
    try:
        locks = create_locks(n)
    except BaseException:
        res.teardown()
        raise
    try:
        for _ in range(n):  # one by one into the list that teardown closes: EMFILE midway
            res.wake_fds.append(SharedFd(create_eventfd()))  # leaked those made before
        # The stall callback is the resources' (not a method of the Pool: the locks are
        # the coordinator's, and nothing it reaches may keep the Pool alive).
        guarded = locks.guarded(res.on_lock_stall)
        # Format the segment, which the zygote checks when it attaches; the bulk of it,
        # the slab's free stack, is filled below while the zygote starts up.
        pool._views = attach(segment, layout, guarded, init=True, fill_slab=False)
        # Not under fork (the zygote has the modules of the pool's process) nor with an
        # initializer (a module imported before it ran could see another environment).
        pool._workers_deferred = await_start = (
            pool._start_method != "fork" and not pool._worker_options.initializer
        )
        # The first worker only; the others as work waits for them (wake_dormant). With an
        # initializer all of them, as before (docs/design.md, "Dormant workers").
        initial = list(range(n)) if pool._worker_options.initializer else [0]
        zygote_conn = _start_zygote(pool, layout, locks, await_start, initial)
        # While the zygote starts up: build the coordinator, mark the initial workers as
        # starting (the zygote forks them after READY, or after START), fill the free stack
        # (no block is allocated before Pool() returns) and start the coordinator thread (it
        # waits for go). None of it is then on the path to the first result.
        pool._functions = res.functions = FunctionCache(pool._views.functions.add)
        pool._coordinator = res.coordinator = Coordinator(
            pool._views,
            res.wake_fds,
            zygote_conn,
            pool._wakeup.fileno(),
            pool._wakeup.wakeup,
            pool._wakeup.clear,
            n,
            pool._window,
            max(INFLIGHT_PER_WORKER, 4 * pool._window) * n,
            locks=guarded,
            aging=pool._aging,
            timed_after_shutdown=pool._timed_after_shutdown,
            recurring_after_shutdown=pool._recurring_after_shutdown,
            wakeup_nowait=pool._wakeup.wakeup_nowait,
            has_initializer=bool(pool._worker_options.initializer),
            workers_await_start=await_start,
            zygote_status=functools.partial(zygote_exit_code, res.zygote),
        )
        pool._coordinator.mark_starting(initial)
        pool._views.slab.fill_free_stack()
        pool._thread = res.thread = threading.Thread(
            target=run_coordinator, args=(res,), name="mpsched-coordinator", daemon=True
        )
        pool._thread.start()
        # READY: the zygote opened the locks, so their names can go. The workers are not
        # waited for: a first task waits in a starting worker's inbox (see dispatch_one).
        # A Ctrl-C goes through during the wait (long under spawn: the zygote imports the main
        # module), everything made being in ``res`` by now; one held so far is raised here.
        held.release()
        try:
            pool._functions.note_worker_main(pool._coordinator.wait_ready(STARTUP_TIMEOUT))
        finally:
            held.hold()
    except BaseException:
        held.hold()  # a Ctrl-C that came through the wait: a second one waits for the undoing
        abort_start(res)
        raise
    finally:
        locks.unlink_names()  # from here on, nothing of the pool has a name
    pool._coordinator.go.set()
    pool._coordinator_pid = os.getpid()
    pool._started = True
    live_pools.add(pool)
    res.watch(pool)


def abort_start(res: PoolResources) -> None:
    """Start-up failed: end the waiting coordinator thread, then undo the rest."""
    if res.coordinator is not None:
        res.coordinator.start_aborted = True
        res.coordinator.go.set()
    if res.thread is not None and res.thread.ident is not None:
        res.thread.join()
    res.teardown()


class _HeldInterrupt:
    """Holds a Ctrl-C (SIGINT) during the start-up, then raises it where nothing is half made.

    A KeyboardInterrupt lands after any C call of the main thread: between a call that made
    an fd, a semaphore name or a process and the store that records it (``os.memfd_create``,
    ``os.pipe2``, a ``SemLock``, ``os.fork``), so that no handler could undo it, or inside the
    ``finally`` that unlinks the names, or after the start-up and before the pool was
    registered; each left fds, names in /dev/shm, or the whole pool (zygote, workers, the
    waiting thread) behind. While held, SIGINT's Python handler only notes the signal;
    ``release`` puts the previous handler back and calls it with a noted signal (the default
    one raises KeyboardInterrupt there). Python runs signal handlers in the main thread only,
    so elsewhere (and for a handler that is not a Python callable: ignored, or the default
    action) there is nothing to hold. Costs two ``signal.signal`` calls (a few us) a hold.
    """

    __slots__ = ("pending", "previous")

    def __init__(self) -> None:
        self.previous: Any = None  # the handler to put back; None while not held
        self.pending: tuple[int, Any] | None = None  # (signum, frame) of a noted SIGINT

    def hold(self) -> None:
        if self.previous is not None or threading.current_thread() is not threading.main_thread():
            return
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler):
            try:
                signal.signal(signal.SIGINT, self._note)
            except ValueError:  # a subinterpreter's main thread: no signal lands there either
                return
            self.previous = handler

    def release(self) -> None:
        """Put the previous handler back; call it with a SIGINT noted meanwhile (may raise)."""
        handler, self.previous = self.previous, None
        if handler is None:
            return
        signal.signal(signal.SIGINT, handler)
        pending, self.pending = self.pending, None
        if pending is not None:
            handler(*pending)

    def _note(self, signum: int, frame: Any) -> None:
        # Not the frame (None is a handler's documented "no frame"): it kept the views made in
        # it alive, and the undoing's unmapping of the segment raised BufferError instead.
        self.pending = (signum, None)


def _start_zygote(
    pool: Pool, layout: SegmentLayout, locks: SegmentLocks, await_start: bool, initial: list[int]
) -> Connection:
    ctx: Any = multiprocessing.get_context(pool._start_method)
    parent_conn: Connection
    parent_conn, child_conn = ctx.Pipe(duplex=True)
    res = pool._resources
    res.zygote_conn = parent_conn
    coordinator_fds.add(parent_conn.fileno())
    fork = pool._start_method == "fork"
    # Under fork the zygote inherits them all; else the config carries the first ones.
    late_wake_fds = [] if fork else res.wake_fds[WAKE_FDS_IN_CONFIG:]
    cfg = ZygoteConfig(
        conn=child_conn,
        segment=res.segment,
        layout=layout,
        locks=locks,
        wake_fds=res.wake_fds if fork else res.wake_fds[:WAKE_FDS_IN_CONFIG],
        worker_options=pool._worker_options,
        close_fds=sorted(coordinator_fds) if fork else [],
        initial_slots=initial,
        await_start=await_start,
        # Under fork the zygote inherits the workers' views: attaching here costs ~0.1 ms,
        # in the zygote (copy-on-write faults after the fork) ~0.7 ms on the start-up path.
        views=attach(res.segment, layout, locks) if fork else None,
        inherited=inherited_by_a_fork() if fork else (),
    )
    try:
        if fork:  # a bare fork, lighter than a Process (see ForkedZygote)
            with _sigint_blocked():
                res.zygote = ForkedZygote(cfg)
        else:
            forkserver = pool._start_method == "forkserver"
            if forkserver:
                forget_a_foreign_forkserver()
                preload_in_forkserver(zygote_main.__module__)
            res.zygote = ctx.Process(target=zygote_main, args=(cfg,), name=ZYGOTE_NAME, daemon=True)
            if forkserver:  # not blocked: the server would keep SIGINT blocked, and so would
                res.zygote.start()  # every process it forks, the user's own included
            else:
                resource_tracker.ensure_running()  # first: its start unblocks SIGINT as it ends
                with _sigint_blocked():
                    res.zygote.start()
    finally:
        child_conn.close()
    if late_wake_fds:
        # Before the coordinator thread exists: nothing else is sent on the socket first.
        # EPIPE: the zygote died already; wait_ready reports it (BrokenPoolError).
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            send_wake_fds(parent_conn, late_wake_fds)
    return parent_conn


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """SIGINT blocked in this thread while the zygote is made: the zygote inherits the mask
    (through exec under spawn) and unblocks it once it ignores SIGINT (``zygote_main``).
    Before, a Ctrl-C in the terminal during its start (its interpreter's, ~50-100 ms under
    spawn) raised KeyboardInterrupt in its default handler: a second traceback, or "Fatal
    Python error: init_import_site", beside the caller's (leak hunt). A SIGINT that comes
    meanwhile stays pending for the pool's process, to its held handler, not lost. Under
    forkserver the server forks the zygote with its own mask and handlers."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
