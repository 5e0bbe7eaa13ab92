"""The worker process: find work, run it, report it, sleep without losing a wake-up, drain.

Runs in each worker process (forked by the zygote, ``_zygote``); ``worker_main`` is its entry.
Owns ``Worker``'s state (``Worker.__init__``) and its loop: find work, steal, run, load a
function, report, stash and fetch big payloads, idle and wake peers, read the coordinator's
messages; and the worker's start (``run_initializer``) and end. ``Worker`` is one object made of
two parts: the children's side (spawn, finish, collect, join) and the task-side API
(``mpsched.submit``, ``ChildFuture``, ``mpsched.current_task``) are in ``_children``, whose
``Children`` it extends; ``worker_main`` sets ``_children._current``.

find_work, in order (rayon's ``find_work``; "finish what we started before we take on something
new"): the own deque's back (LIFO: the children our tasks just spawned), then the own inbox's
front (FIFO: the coordinator's order), then a steal from the front of a peer's deque or inbox,
starting at a random peer and retrying only while some peer answered RETRY (crossbeam). A
join (``Children.join``) helps with children only (``find_child_work``): the own deque, then a
peer's deque, never an inbox's top-level task.

Claims are exactly-once by the rings (``_shm_deque``: removal under the slot lock is the claim),
and each claim is recorded in this worker's run stack in the same lock hold.

Task kinds, by the block's ``parent`` word:
  * top-level (parent -1, from the coordinator): after running, the result goes into the task's
    own block and the handle into this worker's done ring, popping the run stack in the same lock
    round (``SlotQueues.complete``): at every instant the handle is in exactly one of a ring, a
    run stack or a done ring, so a crash can lose nothing silently. The coordinator is poked
    (RESULTS) per batch, when idle, after a task that asked (``announce_result``: a map
    chunk) and, while the coordinator sweeps lazily, after a push into an empty done ring
    (before its next task starts); the coordinator's timer sweep covers the rest.
  * child (parent = the spawning worker's slot): the result goes into the child's block, whose
    ``state`` becomes DONE under the *parent's* slot lock; the parent's future reads it from
    there. A child that nobody waits for (its future was dropped) is ABANDONED, and whoever sees
    the second of DONE / ABANDONED frees the block.

Sleep protocol ("announce, recheck, then block"; the lost-wake-up argument is in design.md):
    1. sleepers += 1 (global lock);  2. announce_sleep() on the own slot (sets ``sleeping`` under
    the own lock if both own rings are empty);  3. recheck every peer with ``probe()`` (under each
    peer's lock) and, when joining, the awaited child's state (under the own lock);  4. block in
    ``poll`` on the own wake eventfd, the coordinator socket and the signal wakeup pipe.
    Wakers push first, then read ``sleepers`` and clear a sleeper's flag under its lock before
    writing its eventfd. A waker wakes one sleeper per publication, so a worker whose sleep
    ends passes the wake-up on to one more sleeper while more than one entry is queued in all.

Exceptions from user code are caught and reported as the task's error (including SystemExit and
KeyboardInterrupt raised by a task); exceptions from mpsched's own code end the worker with a
FATAL message and a non-zero exit code (rayon ``AbortIfPanic``).
"""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import pickle
import random
import select
import signal
import sys
import time
from _thread import get_ident
from collections.abc import Callable
from multiprocessing.connection import Connection

from mpsched import _children, _serialize
from mpsched._children import (
    _CANCEL_REQUESTED,
    _ERROR,
    _NBYTES,
    _OK,
    _RESULT_NBYTES,
    _RESULT_STATUS,
    _STATE,
    CHILD_DONE,
    ENDED,
    ENDED_CANCEL_REQUESTED,
    WAKE_FD_FAILED,
    Children,
    abandon_worker,
    end_forked_child,
    end_process,
    write_wake,
)
from mpsched._errors import PACKAGE_DIR, InternalError, TaskCancelled
from mpsched._layout import SegmentViews
from mpsched._payloads import BlockField
from mpsched._protocol import (
    MPSCHED_BUG_EXIT,
    USER_ERROR_EXIT,
    Buffer,
    ResultStatus,
    Tag,
    dump_exception,
    encode,
    frame_watch,
    recv_message,
    send_data,
)
from mpsched._serialize import INLINE, TaskPicklingError, decode_call, dumps_result
from mpsched._shm import SharedFd
from mpsched._shm_deque import StealResult

# typing.TYPE_CHECKING without importing typing at run time (why: mpsched/__init__.py).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from mpsched._initializer import InheritedInitializer

STEAL_RETRY_ROUNDS = 64  # full rounds over the peers while some answered RETRY, then sleep
# Before sleeping, watch the own queues this long (s): a caller that waits for each result
# before it submits the next task (a latency-bound loop) hands the next one over within tens of
# microseconds, and a sleeping worker costs it a cross-process wake-up (~35 us here) each time.
IDLE_SPIN = 200e-6
# The spin's bound in polls of the own queues, whatever the clock reads: a task may leave
# ``time.perf_counter`` frozen (what freezegun's ``freeze_time().start()`` does if never
# stopped), and the idle worker then spun on a full CPU for ever (found in review). A poll
# takes ~0.3 us here (~700 in a spin), so the spin ends by its time long before this count.
IDLE_SPIN_POLLS_MAX = 20_000
# A task closed (or replaced) an fd of the worker's signal wake-up pipe: as for its eventfds
# (WAKE_FD_FAILED), the worker is lost, not the pool (the EBADF in mpsched's frame read as a bug).
SIGNAL_FD_FAILED = "the signal wake-up pipe failed: a task closed or replaced one of its fds"
# The longest single sleep of a join with a timeout (ms): poll() takes a C int. A join that may
# wait longer wakes then and sleeps again (``Children.join`` rechecks its deadline).
SLEEP_MS_MAX = 2**31 - 1
# The longest single sleep of a join (ms): then it looks at its child again. The child's end
# wakes it at once (its DONE's wake-up); this bounds a wake-up that never came, as when a task
# in the peer that ran the child had put a file in place of this worker's eventfd there (a
# write that succeeds, into the file: the join slept for ever; found in review). One wake-up a
# second per long join costs nothing.
JOIN_SLEEP_MAX_MS = 1000
# Seconds a retiring worker's process gets to end once it sent RETIRING (flushing the streams
# a task may have replaced), as the drain gives a worker (``DRAIN_TIMEOUT``) before its kill.
RETIRED_EXIT_TIMEOUT = 10.0
_SUCCESS = StealResult.SUCCESS
_RETRY = StealResult.RETRY
_CANCELLED = ResultStatus.CANCELLED
_MISFIRED = ResultStatus.MISFIRED
_PARENT = BlockField.PARENT
_POKE = encode(Tag.RESULTS)
_WANT_PEERS = encode(Tag.WANT_PEERS)


class WorkerOptions:
    """Worker tunables, fixed per pool. A plain class, not a dataclass: the zygote imports this
    module, and dataclasses (with inspect, ast and dis) would add ~10 ms to every start-up."""

    __slots__ = ("initializer", "max_tasks", "result_batch")

    def __init__(
        self,
        *,
        result_batch: int = 32,
        max_tasks: int = 0,
        initializer: bytes | InheritedInitializer = b"",
    ) -> None:
        # Results: poke the coordinator after this many unannounced ones (and whenever idle);
        # the coordinator also sweeps done rings on a timer, which bounds any result's wait.
        self.result_batch = result_batch
        # Top-level tasks a worker runs before it retires and is replaced (0: no limit).
        self.max_tasks = max_tasks
        # The pool's initializer and its arguments, pickled (b"": none; or their arguments
        # as objects: ``_initializer``); run once per worker.
        self.initializer = initializer


class Worker(Children):
    """The state of one worker process. Methods run in that process's main thread only; the
    children's methods are in ``_children.Children``."""

    def __init__(
        self,
        slot: int,
        views: SegmentViews,
        wake_fds: list[SharedFd],
        conn: Connection,
        options: WorkerOptions,
        peers_dormant: bool = False,
    ) -> None:
        self.slot = slot
        self.thread = get_ident()  # the thread that runs the tasks: children are its alone
        self.views = views
        self.me = views.slots[slot]
        self.peers = [q for k, q in enumerate(views.slots) if k != slot]
        self.slots = views.slots
        self.slab = views.slab
        self.header = views.header
        self.wake_fds = [f.fd for f in wake_fds]
        self.my_wake_fd = self.wake_fds[slot]
        status = os.fstat(self.my_wake_fd)
        _children.eventfd_inode = (status.st_dev, status.st_ino)  # for write_wake's check
        self.conn = conn
        self.frame_waiting = frame_watch(conn)
        self.options = options
        # The other slots were not forked yet (the pool's first worker): its first child
        # asks for them (want_peers), or the child would wait for this worker's join.
        self.peers_dormant = peers_dormant
        self.fn_cache: dict[int, Callable[..., Any]] = {}
        self.fid_of: dict[Callable[..., Any], int] = {}  # reverse of fn_cache, for children
        self.abandoned: list[int] = []  # children whose futures were dropped (see __del__)
        # Children in blocks whose futures have neither settled nor been released as
        # abandoned: nonzero when the worker retires means futures outlived their task.
        self.unsettled = 0
        self.depth = 0  # tasks running in this process (join-helping nests them)
        # current_task()'s raw material, innermost last: [top-level handle or -1, meta] (see
        # TaskContext). The TaskContext object is built only when a task asks for it.
        self.contexts: list[list[Any]] = []
        self.unannounced = 0  # results in the done ring since the last poke
        # A result found the done ring empty while the loop sweeps lazily: poke before the
        # next task starts, or at idle (Coordinator.pace_sweep).
        self.poke_due = False
        self.announce = False  # the running task asked for a poke once it is done
        # What a task's signal handler raised in a join's sleep, left cleanly (see idle).
        self.interrupted_sleep: BaseException | None = None
        self.top_level_done = 0  # for max_tasks (children do not count)
        # Nothing ran since this worker's last idle wait (or its start): the next task it
        # claims starts at its first chance (the misfire check in ``run``).
        self.after_idle = True
        self.draining = False
        self.forked_child = False  # this is a process that a task forked (_forked_by_a_task)
        self.pid = os.getpid()
        # This worker's part of every uid and stash key it makes (next_uid), and the uid it
        # stamps on an ABANDONED child it takes over to free (finish_child).
        self.uid_base = self.pid << 31
        self.stash_counter = 0
        self.rng = random.Random(self.pid)
        self.poller = select.poll()
        self.poller.register(self.my_wake_fd, select.POLLIN)
        self.poller.register(conn.fileno(), select.POLLIN)
        # The wakeup fd of Python's signal handling: a signal that a task's handler waits for
        # may reach another thread, or come just before this thread blocks in poll (Python runs
        # handlers between bytecodes, after the C-level handler noted the signal); either way
        # poll slept on and the handler waited for the next wake-up. Its byte wakes the sleep.
        self.signal_fd, self.signal_write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.poller.register(self.signal_fd, select.POLLIN)
        self.watch_signals()

    # ------------------------------------------------------------------ main loop
    def main_loop(self) -> bool:
        """Run until drained (returns False) or retired by ``max_tasks`` (returns True)."""
        max_tasks = self.options.max_tasks
        while not self.draining:
            handle = self.find_work()
            if handle >= 0:
                if self.poke_due and not self.header.collector():
                    self.poke()
                self.run(handle)
                self.after_idle = False
                if self.abandoned:
                    self.release_abandoned()
                if max_tasks and self.top_level_done >= max_tasks:
                    return True
            else:
                self.idle(None)
                self.after_idle = True
        return False

    def find_work(self) -> int:
        handle = self.me.pop_or_take(True)
        return handle if handle >= 0 else self.steal(True)

    def find_child_work(self) -> int:
        """``find_work`` for a join: children only, from the own deque or a peer's, never a
        top-level task from an inbox (see ``Children.join``)."""
        handle = self.me.pop_or_take(True, False)
        return handle if handle >= 0 else self.steal(False)

    def steal(self, take_inbox: bool) -> int:
        peers = self.peers
        n = len(peers)
        if not n:
            return -1
        me = self.me
        for _ in range(STEAL_RETRY_ROUNDS):
            retry = False
            start = self.rng.randrange(n)
            for k in range(n):
                result, handle = peers[(start + k) % n].steal(me, take_inbox)
                if result is _SUCCESS:
                    return handle
                if result is _RETRY:
                    retry = True
            if not retry:
                return -1
        return -1

    # ------------------------------------------------------------------ running
    def run(self, handle: int, recorded: bool = True) -> None:
        """Run the claimed task ``handle`` (already on the run stack, unless not ``recorded``:
        an own child past the helping depth, see ``Children.join``) and report it."""
        slab = self.slab
        parent = slab.get_word(handle, _PARENT)
        nbytes = slab.get_word(handle, _NBYTES)
        data: Buffer
        if nbytes >= 0:
            data = slab.read(handle)
            slab.release_args(handle)
        else:
            data = self.fetch(-nbytes)
            # Fetched: a death from here on leaves no stashed arguments (the crash recovery
            # reads a negative count as bytes still stashed or on their way).
            slab.set_word(handle, _NBYTES, 0)
        self.depth += 1
        contexts = self.contexts
        entry: list[Any] = []
        try:
            fid, fn, args, kwargs, meta = decode_call(data)
            del data
            if meta and len(meta) > 2 and not self.after_idle and time.monotonic() > meta[2]:
                # A recurring run under the misfire policy "skip", claimed after its deadline
                # behind other work: dropped unstarted, as the coordinator drops one still in
                # its ready queue; the coordinator counts it and goes on. Claimed first thing
                # after an idle wait, it is no misfire: it started at this worker's first
                # chance, late only by the wake-up (as for the coordinator's: ``misfired``).
                status, out = _MISFIRED, b""
                self.top_level_done -= 1  # max_tasks counts the tasks that ran (added below)
                self.me.uncount_run()  # and so does executed (counted by complete, below)
            else:
                if fid != INLINE:
                    fn = self.load_function(fid)
                entry = [handle if parent < 0 else -1, meta]
                contexts.append(entry)
                value = fn(*args, **kwargs)
                if self.forked_child:
                    end_forked_child(None)
                del fn, args, kwargs
                status, out = _OK, dumps_result(value)
                del value
        except TaskCancelled as exc:
            if self.forked_child:
                end_forked_child(exc)
            # Cancelled only if asked to: a TaskCancelled raised unprompted is an error.
            requested = parent < 0 and slab.get_word(handle, _STATE) == _CANCEL_REQUESTED
            status, out = (_CANCELLED if requested else _ERROR), dump_exception(exc)
        except BaseException as exc:  # user code: any exception is the task's outcome
            if self.forked_child:
                end_forked_child(exc)
            status, out = _ERROR, dump_exception(exc)
        finally:
            self.depth -= 1
            if entry:
                contexts.pop()
                if parent < 0:  # before the result: its block is freed only after it
                    entry[0] = (
                        ENDED_CANCEL_REQUESTED
                        if len(entry) > 2 and slab.get_word(handle, _STATE) == _CANCEL_REQUESTED
                        else ENDED
                    )
        if not slab.write_result(handle, status, out):
            slab.set_word(handle, _RESULT_STATUS, status)
            self.stash(out, handle, _RESULT_NBYTES)
        del out
        if parent < 0:
            first = self.me.complete(handle)
            self.top_level_done += 1
            self.unannounced += 1
            # At once: a task that asked (announce_result), unless a user thread is
            # collecting the done rings itself (as in idle(): see Coordinator.help_wait).
            header = self.header
            if self.unannounced >= self.options.result_batch or (
                self.announce and not header.collector()
            ):
                self.poke()
            elif first and header.lazy_sweep():
                # The loop sweeps lazily: this result (and any pushed behind it, collected
                # with it) is announced before this worker starts another task, or at idle
                # (Coordinator.pace_sweep). Not here: the coordinator would hand out what
                # waits for this result (a recurrence's next run) before this worker looked
                # for work, and its claim of that, not after an idle wait, read as a misfire.
                self.poke_due = True
        else:
            self.finish_child(handle, parent, recorded)
        self.announce = False

    def load_function(self, fid: int) -> Callable[..., Any]:
        fn = self.fn_cache.get(fid)
        if fn is None:
            fn = pickle.loads(self.views.functions.get(fid))
            self.fn_cache[fid] = fn
            with contextlib.suppress(TypeError):  # unhashable: children pickle it inline
                self.fid_of[fn] = fid
        return fn

    def want_peers(self) -> None:
        self.peers_dormant = False
        with contextlib.suppress(OSError):  # the coordinator is gone: our EOF comes next
            self.conn.send_bytes(_WANT_PEERS)

    def poke(self) -> None:
        """Tell the coordinator that results wait in this worker's done ring."""
        self.poke_due = False
        if self.unannounced:
            self.unannounced = 0
            self.conn.send_bytes(_POKE)

    # ------------------------------------------------------------------ big payloads
    def stash(self, data: bytes, handle: int, field: int) -> int:
        """Hand bytes too big for a block to the coordinator; returns their key (> 0), stored
        (negated) in ``handle``'s word ``field`` before the STASH is sent: a worker that dies
        during or after the send leaves the key where the coordinator's recovery finds it (it
        drops the bytes; stored after the send, they leaked)."""
        key = self.next_uid()
        self.slab.set_word(handle, field, -key)
        send_data(self.conn, Tag.STASH, key, data)
        return key

    def fetch(self, key: int) -> Buffer:
        """Get stashed bytes from the coordinator (blocks until it answers)."""
        self.conn.send_bytes(encode(Tag.FETCH, key))
        while True:
            tag, fields = recv_message(self.conn)
            if tag == Tag.PAYLOAD and fields[0] == key:
                return fields[1]  # type: ignore[no-any-return]
            self.on_message(tag, fields)

    # ------------------------------------------------------------------ idle and wake-ups
    def idle(self, awaited: int | None, deadline: float | None = None, steal: bool = True) -> None:
        """Nothing to run: poke results, then announce, recheck and block until woken.

        ``awaited`` is the block of a child being joined (its DONE also ends the sleep).
        ``steal`` False: a join past the helping depth, which cannot take a peer's child, so
        the recheck does not look at the peers (their queued children ended each sleep at
        once: the worker spun until they were taken).
        """
        header = self.header
        if not header.collector():  # else a user thread is reading the done rings itself
            self.poke()
        me = self.me
        if awaited is None:
            end = time.perf_counter() + IDLE_SPIN
            polls = IDLE_SPIN_POLLS_MAX
            while me.is_empty():
                polls -= 1
                if not polls or time.perf_counter() > end:
                    break
            else:
                return  # work arrived: back to find_work
        joining = awaited is not None  # helps with children only: the inboxes are no work
        header.add_sleepers(1)
        try:
            if not me.announce_sleep(joining):
                return
            if (awaited is not None and me.block_state(self.slab, awaited) == CHILD_DONE) or (
                steal and any(peer.probe(joining) for peer in self.peers)
            ):
                if not me.clear_sleeping():
                    self.consume_wake()  # a waker got there first and wrote our eventfd
            else:
                timeout_ms = JOIN_SLEEP_MAX_MS if joining else -1
                if deadline is not None:
                    left_ms = (deadline - time.monotonic()) * 1e3
                    timeout_ms = max(0, int(min(left_ms, timeout_ms if joining else SLEEP_MS_MAX)))
                if not joining:  # between tasks: a task may have set a wakeup fd of its own
                    self.watch_signals()
                try:
                    events = self.poller.poll(timeout_ms)
                    # Woken by a signal's byte: its handler runs at this call (a Python frame's
                    # start), still inside the sleep's handling below.
                    self.drain_signal_fd(events)
                except BaseException as exc:
                    # A signal handler of the task's raised while this worker slept (its time
                    # limit's alarm, in a join, say): only the sleep was under way. Left cleanly,
                    # the exception may go on into the task (ChildFuture._wait).
                    if not me.clear_sleeping():
                        self.consume_wake()
                    self.interrupted_sleep = exc
                    raise
                for fd, _ in events:
                    if fd == self.my_wake_fd:
                        self.consume_wake()
                    elif fd != self.signal_fd:
                        self.read_messages()
                me.clear_sleeping()
        finally:
            header.add_sleepers(-1)
        # Pass the wake-up on: a waker wakes one sleeper for a batch (the coordinator's inject
        # into a sleeping inbox wakes only its owner), and this worker takes one task of it.
        # Were more queued, a peer that slept through their publication would sleep on while
        # they wait behind our task. Off the per-task path: only after an announced sleep.
        # A joining worker leaves its inbox's tasks to its peers: one that sleeps is woken
        # for them (the coordinator woke this worker, the inbox's owner, for them).
        if header.sleepers() and (
            sum(len(slot) for slot in self.slots) > 1 or (joining and len(me))
        ):
            self.wake_one_sleeper()

    def watch_signals(self) -> None:
        """Make this worker's pipe the process's signal wakeup fd (again: a task may have set
        one of its own, e.g. an asyncio loop's, and left -1 behind when its loop closed). Main
        thread only, which runs the worker's loop; a C call, on the sleep path only."""
        try:
            signal.set_wakeup_fd(self.signal_write_fd, warn_on_full_buffer=False)
        except (OSError, ValueError) as exc:  # ValueError: not a valid fd any more
            abandon_worker(exc, SIGNAL_FD_FAILED)

    def drain_signal_fd(self, events: list[tuple[int, int]]) -> None:
        for fd, _ in events:
            if fd == self.signal_fd:
                try:
                    while os.read(fd, 512):
                        pass
                except BlockingIOError:
                    pass
                except OSError as exc:
                    abandon_worker(exc, SIGNAL_FD_FAILED)

    def consume_wake(self) -> None:
        try:
            os.eventfd_read(self.my_wake_fd)
        except BlockingIOError:
            pass
        except OSError as exc:
            abandon_worker(exc, WAKE_FD_FAILED)

    def wake_one_sleeper(self) -> None:
        """After publishing work: wake one sleeping peer (which will steal it)."""
        for k, slot in enumerate(self.slots):
            if k != self.slot and slot.is_sleeping() and slot.clear_sleeping():
                write_wake(self.wake_fds[k])
                return

    def read_messages(self) -> None:
        while self.frame_waiting():
            try:
                message = recv_message(self.conn)
            except EOFError:  # the coordinator is gone
                end_process(0)
            self.on_message(*message)

    def on_message(self, tag: int, fields: tuple[Any, ...]) -> None:
        if tag == Tag.DRAIN:
            self.draining = True
        else:
            raise InternalError(f"worker {self.slot} got unexpected {Tag.name(tag)}")

    def statistics(self) -> dict[str, int]:
        return self.me.counters()


def worker_main(
    slot: int,
    views: SegmentViews,
    wake_fds: list[SharedFd],
    conn: Connection,
    options: WorkerOptions,
    peers_dormant: bool = False,
) -> int:
    """Entry point of a worker process (called in the child of the zygote's fork).
    ``peers_dormant``: the other slots have no worker yet (see ``Worker.want_peers``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the coordinator
    _refuse_copied_connections()
    worker = Worker(slot, views, wake_fds, conn, options, peers_dormant)
    _serialize.table_loader = worker.load_function  # for the arguments' stand-ins
    os.register_at_fork(after_in_child=lambda: _forked_by_a_task(worker))
    if options.initializer and not run_initializer(worker, options.initializer):
        return 0  # the coordinator breaks the pool with the initializer's error
    _children._current = worker
    worker.me.bind_owner()
    try:
        if worker.main_loop():  # retired: its queues stay in shared memory for the successor
            if worker.unsettled:  # futures in a reference cycle are dropped by a collection
                gc.collect()
                worker.release_abandoned()
            worker.poke()
            # Children still unsettled (their futures kept past their task, e.g. in a module
            # global) have nobody to collect them: the coordinator frees their blocks.
            conn.send_bytes(encode(Tag.RETIRING, slot, worker.unsettled))
            # Its replacement is forked at its exit (the socket's EOF), so the exit is bounded:
            # a stream that a task left in sys.stdout, whose flush blocked, held the slot for
            # ever (Pool(1) stalled, and the program's exit with it; found in review). The
            # default action of SIGALRM ends the process whatever code blocks.
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.setitimer(signal.ITIMER_REAL, RETIRED_EXIT_TIMEOUT)
            return 0
        worker.poke()
        conn.send_bytes(encode(Tag.DRAINED, slot, worker.statistics()))
        return 0
    except (BrokenPipeError, ConnectionResetError, EOFError):
        # Our socket's other end is closed: the coordinator broke the pool (e.g. a peer's
        # initializer failed) or is gone, and the zygote is about to kill us. The same as EOF
        # in read_messages: exit quietly, not with a traceback that blames mpsched.
        return 0
    except BaseException as exc:
        import traceback  # here, not at the top: see _protocol.dump_exception

        text = traceback.format_exc()
        if _raised_by_user_code(exc):
            # EBADF from the worker's own socket (a frame of multiprocessing's): a task closed
            # the worker's fds, which the message blamed on a signal handler (leak hunt).
            why = (
                "a file descriptor of the worker was closed (a task's os.close or os.closerange?)"
                if isinstance(exc, OSError) and exc.errno == errno.EBADF
                else "user code raised outside a task (a signal handler a task installed? a "
                "finalizer?)"
            )
            with contextlib.suppress(Exception):  # a task may have taken stderr away
                sys.stderr.write(
                    f"mpsched: worker {slot} (pid {os.getpid()}): {why}; the worker exits and "
                    f"is replaced:\n{text}"
                )
            return USER_ERROR_EXIT
        try:
            conn.send_bytes(encode(Tag.FATAL, slot, text))
        except OSError:
            sys.stderr.write(text)
        return MPSCHED_BUG_EXIT
    finally:
        _children._current = None


def _raised_by_user_code(exc: BaseException) -> bool:
    """Whether ``exc``, escaping the worker's loop, came from user code run outside any task:
    its innermost frame is not mpsched's (a Python signal handler, a ``__del__``), or it is
    what mpsched never raises there (KeyboardInterrupt and SystemExit: a worker ignores SIGINT;
    MemoryError, as an OOM kill would be). Such an error costs the worker, not the pool: it
    broke the pool as an internal error (a SIGALRM handler raising after its task returned)."""
    if not isinstance(exc, Exception) or isinstance(exc, MemoryError):
        return True
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return not tb.tb_frame.f_code.co_filename.startswith(PACKAGE_DIR)


def _forked_by_a_task(worker: Worker) -> None:
    """In a process that a task (or the initializer) forked from this worker: it is no worker.
    It lets go of its copy of the worker's socket, whose EOF is how the coordinator learns of
    the worker's death: a copy kept by a process that outlives its task (a daemon) hid the
    worker's death, so its task never failed, its slot was not replaced and the shutdown
    waited the drain's timeout. ``mpsched.submit`` refuses to run here: it would push into the
    worker's deque beside the worker, the deque's one owner. Once the task's code comes back
    into the worker's, this process ends (``end_forked_child``)."""
    worker.forked_child = True
    _children._current = None
    worker.conn.close()
    # Its signals are its own: the worker's wakeup fd would wake the worker for them. (One
    # that a task set, an asyncio loop's, stays: the child's copy of that loop reads it.)
    with contextlib.suppress(ValueError):  # no main thread here to set it from
        previous = signal.set_wakeup_fd(-1)
        if previous != worker.signal_write_fd:
            signal.set_wakeup_fd(previous)


def _refuse_copied_connections() -> None:
    """In this worker, a multiprocessing ``Connection`` neither loads nor goes from plain
    pickle, which copies it as the bare number of its fd: in a task's arguments it named
    another file here, or none (found in review: under spawn the pool's own shared memory,
    which the task's ``send`` wrote into), and as a result or a child's argument a file of
    another process. Multiprocessing's own pickler (``ForkingPickler``, which passes the fd
    itself) has its own reduction, which this does not touch; nor are the user's processes
    touched. The way to give workers a pipe's end is the pool's ``initargs``."""

    def refuse(connection: Connection, *_: object) -> None:
        raise TaskPicklingError(_COPIED_CONNECTION)

    Connection.__setstate__ = refuse  # type: ignore[attr-defined]
    Connection.__reduce_ex__ = refuse  # type: ignore[assignment,method-assign]


_COPIED_CONNECTION = (
    "a multiprocessing Connection cannot be pickled or copied in a pool's worker (as a task's "
    "argument or result, say): pickled, it is the number of its file descriptor, which names "
    "another file in another process. Give it to the workers in the pool's initargs "
    "(inherited, as ProcessPoolExecutor does), or use a multiprocessing.Manager's queue."
)


def run_initializer(worker: Worker, initializer: bytes | InheritedInitializer) -> bool:
    """Run the pool's initializer; on error, report it (INIT_FAILED) and return False."""
    conn = worker.conn
    try:
        fn, args = (
            pickle.loads(initializer) if isinstance(initializer, bytes) else initializer.load()
        )
        fn(*args)
        if worker.forked_child:
            end_forked_child(None)
    except BaseException as exc:  # user code: report any error, never die silently
        if worker.forked_child:
            end_forked_child(exc)
        # EPIPE: the coordinator already closed our socket (a peer's initializer failed first
        # and broke the pool, or the pool is gone): nobody is left to tell, and the zygote
        # would print this send's traceback as if mpsched had failed.
        with contextlib.suppress(OSError):
            conn.send_bytes(encode(Tag.INIT_FAILED, worker.slot, dump_exception(exc)))
        return False
    return True
