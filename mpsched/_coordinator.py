"""The coordinator: one thread in the pool's process that feeds the workers and reaps results.

Owns: the queue of submitted tasks not yet handed out, the records of dispatched tasks (by slab
block), the stash of payloads too big for a block, the worker handles (pid, socket, pidfd), and
the drain handshake. Called from: user threads through ``Pool`` (``submit_records``, ``cancel``,
``begin_shutdown``; each takes ``self.lock`` briefly and wakes the loop), and its own thread
(``run``). Everything else below runs in the coordinator thread only.

The loop has one blocking point, an ``epoll`` over: the wakeup pipe (user calls), the zygote's
control socket (spawns and exits), and every worker's socket (result pokes, stashes, fetches,
drained, fatal; EOF when a worker dies). Each wake is classified and handled in a small named
method; then results are collected from every done ring and the inboxes are refilled.

Dispatch window: at most ``window`` handles wait in a worker's inbox, and at most
``max_inflight`` dispatched tasks are unfinished in all; the rest wait here, in order. A small
window keeps cancels cheap and order close to exact; a large one keeps workers fed between
coordinator wake-ups. The done rings are sized for ``max_inflight``, so they cannot overflow.

Cancel (``cancel``): a task still queued here is dropped; a task in an inbox is cancelled with
``cancel_injected`` under the slot lock, where it races the claim and exactly one wins; a claimed
task cannot be cancelled.

Not handled here (yet): timed and prioritized tasks (the scheduler core drives them later),
recovery from a dead worker beyond failing its running tasks and replacing it.
"""

from __future__ import annotations

import collections
import contextlib
import os
import pickle
import select
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from typing import Any

from mpsched._errors import BrokenPoolError, InternalError, ProtocolError, WorkerCrashedError
from mpsched._future import Future
from mpsched._layout import SegmentViews
from mpsched._payloads import BlockField
from mpsched._protocol import (
    ChildState,
    ResultStatus,
    Tag,
    decode,
    dump_exception,
    encode,
    load_exception,
)
from mpsched._shm import SharedFd

_NBYTES = int(BlockField.NBYTES)
_RESULT_STATUS = int(BlockField.RESULT_STATUS)
_RESULT_NBYTES = int(BlockField.RESULT_NBYTES)
_OK = int(ResultStatus.OK)
_CANCELLED = int(ResultStatus.CANCELLED)
_CHILD_DONE = int(ChildState.DONE)
_CHILD_ABANDONED = int(ChildState.ABANDONED)
_DRAIN = encode(Tag.DRAIN)

DRAIN_TIMEOUT = 10.0  # seconds a worker gets to answer DRAIN before it is killed
RESULT_SWEEP_INTERVAL = 0.005  # seconds between done-ring sweeps while tasks are in flight


@dataclass
class WorkerHandle:
    slot: int
    pid: int
    conn: Connection
    pidfd: int
    drained: bool = False


def signal_description(exitcode: int | None) -> str:
    if exitcode is None:
        return "unknown exit"
    if exitcode < 0:
        try:
            return f"{signal.Signals(-exitcode).name}({exitcode})"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


class Coordinator:
    def __init__(
        self,
        views: SegmentViews,
        wake_fds: list[SharedFd],
        zygote_conn: Connection,
        wakeup_fd: int,
        clear_wakeup: Any,
        n_workers: int,
        window: int,
        max_inflight: int,
    ) -> None:
        self.slots = views.slots
        self.slab = views.slab
        self.header = views.header
        self.wake_fds = [f.fd for f in wake_fds]
        self.zygote = zygote_conn
        self.clear_wakeup = clear_wakeup
        self.n_workers = n_workers
        self.window = window
        self.max_inflight = max_inflight
        # Guards pending, records' location fields and the draining flag against user threads.
        self.lock = threading.Lock()
        self.pending: collections.deque[Future] = collections.deque()
        self.by_handle: dict[int, Future] = {}  # dispatched, unfinished
        self.stash: dict[int, bytes] = {}
        self.parked_fetches: dict[int, list[Connection]] = {}
        self.workers: list[WorkerHandle | None] = [None] * n_workers
        self.by_fd: dict[int, WorkerHandle] = {}
        self.exit_codes: dict[int, int] = {}  # pid -> exit code, from the zygote
        self.draining = False
        self.broken: BaseException | None = None
        self.next_slot = 0
        self.stash_counter = 0
        self.crashes = 0
        self.respawns = 0
        self.completed = 0
        self.final_stats: dict[int, dict[str, int]] = {}
        self.epoll = select.epoll()
        self.wakeup_fd = wakeup_fd
        self.epoll.register(wakeup_fd, select.EPOLLIN)
        self.epoll.register(zygote_conn.fileno(), select.EPOLLIN)
        self.finished = threading.Event()

    # ------------------------------------------------------------------ start-up
    def spawn_all(self, timeout: float) -> None:
        """Before the thread starts: ask the zygote for every worker; wait for the first only
        (the others are registered by the loop as they come, as ProcessPoolExecutor starts its
        workers while the first task already runs). Tasks wait in an unstarted worker's inbox
        or are stolen; they are not lost."""
        for slot in range(self.n_workers):
            self.zygote.send_bytes(encode(Tag.SPAWN, slot))
        deadline = time.monotonic() + timeout
        while all(w is None for w in self.workers):
            if not self.zygote.poll(max(0.0, deadline - time.monotonic())):
                raise BrokenPoolError(f"the pool's zygote did not start within {timeout} s")
            self.on_zygote_message(block=True)

    # ------------------------------------------------------------------ user-thread API
    def submit(self, future: Future) -> bool:
        """Any thread (the caller checked the pool is open): when the pool is idle (nothing
        queued or in flight), hand the task to a worker at once, one thread hop less on the
        latency path; otherwise queue it for the coordinator, which dispatches in batches with
        at most one wake-up per batch (a burst injected task by task would pay one eventfd
        write per task to workers that keep falling asleep). Returns True if the coordinator
        loop must be woken."""
        with self.lock:
            if self.broken is not None:
                raise BrokenPoolError(f"the pool is broken: {self.broken!r}") from self.broken
            if not self.pending and not self.by_handle and self.dispatch_one(future):
                return False
            self.pending.append(future)
        return True

    def dispatch_one(self, future: Future) -> bool:
        """Under ``self.lock``: inject one task into the next inbox with room; False if none."""
        if len(self.by_handle) >= self.max_inflight:
            return False
        n = self.n_workers
        for i in range(n):
            k = (self.next_slot + i) % n
            if self.workers[k] is not None and self.slots[k].inbox_depth() < self.window:
                self.next_slot = (k + 1) % n
                return self.inject(k, [future]) == 1
        return False

    def cancel(self, future: Future) -> bool:
        """Any thread: withdraw a task no worker has claimed. True if it will never run."""
        with self.lock:
            if future._handle < 0:
                if future._withdrawn or future.done():
                    return future._withdrawn
                future._withdrawn = True  # dispatch skips it
                future._payload = b""
                return True
            if not self.slots[future._slot].cancel_injected(future._handle):
                return False  # a worker claimed it first
            self.by_handle.pop(future._handle, None)
            self.slab.free_tasks([future._handle])
            future._handle = -1
            future._withdrawn = True
            return True

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        try:
            self.loop()
        except BaseException as exc:
            self.break_pool(exc)
        finally:
            self.finished.set()

    def loop(self) -> None:
        poll = self.epoll.poll
        while True:
            # While tasks are in flight, also wake on a timer: a worker announces results per
            # batch, when idle, or after its next task, so a result followed on the same worker
            # by a long task would otherwise wait for that task to end.
            for fd, _ in poll(RESULT_SWEEP_INTERVAL if self.by_handle else -1):
                if fd == self.wakeup_fd:
                    self.clear_wakeup()
                elif fd == self.zygote.fileno():
                    self.on_zygote_message(block=False)
                else:
                    worker = self.by_fd.get(fd)
                    if worker is not None:
                        self.on_worker_readable(worker)
            self.collect()
            if self.pending:
                self.dispatch()
            if self.draining and self.all_done():
                self.drain_workers()
                return

    def all_done(self) -> bool:
        return not self.pending and not self.by_handle and self.header.live_children() == 0

    # ------------------------------------------------------------------ dispatch
    def dispatch(self) -> None:
        n = self.n_workers
        with self.lock:
            for i in range(n):
                k = (self.next_slot + i) % n
                if self.workers[k] is None or not self.pending:
                    continue
                room = min(
                    self.window - self.slots[k].inbox_depth(),
                    self.max_inflight - len(self.by_handle),
                )
                if room > 0:
                    batch = self.take_pending(room)
                    taken = self.inject(k, batch)
                    if taken < len(batch):  # slab full: the rest waits for results
                        self.pending.extendleft(reversed(batch[taken:]))
                        break
            self.next_slot = (self.next_slot + 1) % n

    def inject(self, k: int, batch: list[Future]) -> int:
        """Under ``self.lock``: write ``batch`` into slab blocks and inject them into inbox
        ``k`` in one lock round, waking a sleeper. Returns how many went (the slab may be full)."""
        if not batch:
            return 0
        slab = self.slab
        handles = slab.alloc_many(len(batch)) if len(batch) > 1 else [slab.alloc()]
        if not handles or handles[0] < 0:
            return 0
        for future, handle in zip(batch, handles, strict=False):
            payload = future._payload
            if not slab.write(handle, payload, uid=future._uid):
                slab.write(handle, b"", uid=future._uid)
                slab.set_word(handle, _NBYTES, -self.stash_put(payload))
            future._payload = b""
            future._handle = handle
            future._slot = k
            self.by_handle[handle] = future  # before the inject: a result may come at once
        injected, was_sleeping = self.slots[k].inject_wake(handles)
        if injected != len(handles):
            raise BrokenPoolError("inbox overflow: the dispatch window is broken")
        if was_sleeping:
            os.eventfd_write(self.wake_fds[k], 1)
        elif self.header.sleepers():
            self.wake_one_sleeper()
        return len(handles)

    def take_pending(self, n: int) -> list[Future]:
        out: list[Future] = []
        pending = self.pending
        while pending and len(out) < n:
            future = pending.popleft()
            if not future._withdrawn:
                out.append(future)
        return out

    def wake_one_sleeper(self) -> None:
        for k, slot in enumerate(self.slots):
            if slot.is_sleeping() and slot.clear_sleeping():
                os.eventfd_write(self.wake_fds[k], 1)
                return

    def stash_put(self, data: bytes) -> int:
        self.stash_counter += 1
        key = (os.getpid() << 31) | self.stash_counter
        self.stash[key] = data
        return key

    # ------------------------------------------------------------------ results
    def collect(self) -> None:
        slab = self.slab
        for k, slot in enumerate(self.slots):
            if not slot.done_depth():
                continue
            handles = slot.take_done()
            outcomes = []
            unknown = []
            try:
                for handle in handles:
                    future = self.by_handle.pop(handle, None)
                    if future is None:
                        unknown.append(handle)
                        continue
                    status = slab.get_word(handle, _RESULT_STATUS)
                    nbytes = slab.get_word(handle, _RESULT_NBYTES)
                    if nbytes >= 0:
                        data = slab.read_result(handle)[1]
                    else:
                        data = self.stash_take(-nbytes, k)
                    outcomes.append((future, status, data))
            finally:  # settle what was taken even if one entry is bad: nothing is lost
                slab.free_tasks([h for h in handles if h not in unknown] if unknown else handles)
                self.completed += len(outcomes)
                for future, status, data in outcomes:
                    resolve(future, status, data)
            if unknown:
                raise InternalError(f"worker {k} completed unknown task blocks {unknown}")

    def stash_take(self, key: int, slot: int) -> bytes:
        """Stashed result bytes; the STASH message was sent before the done-ring push, so it
        is complete in the worker's socket if it has not been read yet."""
        while key not in self.stash:
            worker = self.workers[slot]
            if worker is None:
                raise ProtocolError(f"stashed result {key} lost with worker {slot}")
            self.on_worker_message(worker, worker.conn.recv_bytes())
        return self.stash.pop(key)

    # ------------------------------------------------------------------ messages
    def on_worker_readable(self, worker: WorkerHandle) -> None:
        conn = worker.conn
        try:
            while conn.poll():
                self.on_worker_message(worker, conn.recv_bytes())
        except (EOFError, OSError):
            self.on_worker_gone(worker)

    def on_worker_message(self, worker: WorkerHandle, frame: bytes) -> None:
        tag, fields = decode(frame)
        if tag is Tag.RESULTS:
            return  # the done rings are collected after every wake
        if tag is Tag.STASH:
            key, data = fields
            self.stash[key] = data
            for conn in self.parked_fetches.pop(key, []):
                self.answer_fetch(conn, key)
        elif tag is Tag.FETCH:
            key = fields[0]
            if key in self.stash:
                self.answer_fetch(worker.conn, key)
            else:
                self.parked_fetches.setdefault(key, []).append(worker.conn)
        elif tag is Tag.DRAINED:
            worker.drained = True
            self.final_stats[worker.slot] = fields[1]
        elif tag is Tag.FATAL:
            raise BrokenPoolError(f"worker {fields[0]} hit an internal error:\n{fields[1]}")
        else:
            raise ProtocolError(f"unexpected {tag.name} from worker {worker.slot}")

    def answer_fetch(self, conn: Connection, key: int) -> None:
        conn.send_bytes(encode(Tag.PAYLOAD, key, self.stash.pop(key)))

    def on_zygote_message(self, block: bool) -> None:
        if not block and not self.zygote.poll():
            return
        try:
            tag, fields = decode(self.zygote.recv_bytes())
        except (EOFError, OSError) as exc:
            raise BrokenPoolError(
                "the pool's zygote process died (if this happened at start-up, its traceback "
                "is above: e.g. the main module could not be imported under spawn)"
            ) from exc
        if tag is Tag.SPAWNED:
            slot, pid = fields
            fd = recv_handle(self.zygote)
            conn = Connection(fd)
            try:
                pidfd = os.pidfd_open(pid)
            except ProcessLookupError:
                pidfd = -1
            worker = WorkerHandle(slot, pid, conn, pidfd)
            self.workers[slot] = worker
            self.by_fd[conn.fileno()] = worker
            self.epoll.register(conn.fileno(), select.EPOLLIN)
        elif tag is Tag.EXITED:
            _, pid, code = fields
            self.exit_codes[pid] = code
        elif tag is Tag.READY:
            pass
        else:
            raise ProtocolError(f"unexpected {tag.name} from the zygote")

    # ------------------------------------------------------------------ worker death
    def on_worker_gone(self, worker: WorkerHandle) -> None:
        """The worker's socket hit EOF: it exited (after DRAINED) or died."""
        self.forget_worker(worker)
        if worker.drained:
            return
        self.crashes += 1
        code = self.wait_exit_code(worker.pid)
        self.recover_slot(worker, code)
        if not self.draining or not self.all_done():
            self.respawns += 1
            self.zygote.send_bytes(encode(Tag.SPAWN, worker.slot))

    def forget_worker(self, worker: WorkerHandle) -> None:
        fd = worker.conn.fileno()
        self.by_fd.pop(fd, None)
        with contextlib.suppress(OSError, ValueError):
            self.epoll.unregister(fd)
        worker.conn.close()
        if worker.pidfd >= 0:
            os.close(worker.pidfd)
            worker.pidfd = -1
        if self.workers[worker.slot] is worker:
            self.workers[worker.slot] = None

    def wait_exit_code(self, pid: int, timeout: float = 2.0) -> int | None:
        deadline = time.monotonic() + timeout
        while pid not in self.exit_codes and time.monotonic() < deadline:
            if self.zygote.poll(max(0.0, deadline - time.monotonic())):
                self.on_zygote_message(block=True)
        return self.exit_codes.pop(pid, None)

    def recover_slot(self, worker: WorkerHandle, code: int | None) -> None:
        """Fail what the dead worker was running; its queues stay in shared memory."""
        slot = self.slots[worker.slot]
        slot.break_dead_holder(worker.pid, slot)
        for other in self.slots:
            if other is not slot:
                other.break_dead_holder(worker.pid, slot)
        self.slab.break_dead_holder(worker.pid)
        self.header.break_dead_holder(worker.pid)
        self.collect()
        for handle in slot.take_running():
            future = self.by_handle.pop(handle, None)
            if future is None:  # a child: its parent waits on the block
                self.fail_child(handle, worker, code)
                continue
            self.slab.free_tasks([handle])
            future._owner = None
            with contextlib.suppress(Exception):
                future.set_exception(WorkerCrashedError(crash_message(worker, code), code))

    def fail_child(self, handle: int, worker: WorkerHandle, code: int | None) -> None:
        """A child was running in the dead worker: settle it with the crash, wake its parent.
        A child that reached DONE before the death (its run-stack entry was not popped yet)
        keeps its result."""
        slab = self.slab
        if slab.get_word(handle, int(BlockField.STATE)) == _CHILD_DONE:
            return
        error = WorkerCrashedError(crash_message(worker, code), code)
        if not slab.write_result(handle, int(ResultStatus.ERROR), dump_exception(error)):
            raise ProtocolError("a crash report does not fit in a block")
        parent = slab.get_word(handle, int(BlockField.PARENT))
        previous = self.slots[parent].exchange_block_state(slab, handle, _CHILD_DONE)
        self.header.add_live_children(-1)
        if previous == _CHILD_ABANDONED:
            slab.set_word(handle, int(BlockField.STATE), 0)
            slab.free_tasks([handle])
        elif self.slots[parent].clear_sleeping():
            os.eventfd_write(self.wake_fds[parent], 1)

    # ------------------------------------------------------------------ shutdown
    def begin_shutdown(self, cancel_futures: bool) -> None:
        """Any thread: no more submissions reach here (the pool checks); drain from now on."""
        with self.lock:
            self.draining = True
        if cancel_futures:
            self.cancel_everything_unclaimed()

    def cancel_everything_unclaimed(self) -> None:
        with self.lock:
            pending, self.pending = self.pending, collections.deque()
            injected = list(self.by_handle.values())
        for future in pending:
            if not future._withdrawn:
                future._withdrawn = True
                future._mark_cancelled()
        for future in injected:
            future.cancel()  # wins only against a claim that has not happened

    def drain_workers(self) -> None:
        """The handshake: DRAIN to every worker, read until DRAINED or EOF, then STOP."""
        live = [w for w in self.workers if w is not None]
        for worker in live:
            with contextlib.suppress(OSError):
                worker.conn.send_bytes(_DRAIN)
        deadline = time.monotonic() + DRAIN_TIMEOUT
        while any(self.workers[w.slot] is w for w in live):
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                break
            for fd, _ in self.epoll.poll(timeout):
                if fd == self.zygote.fileno():
                    with contextlib.suppress(BrokenPoolError):
                        self.on_zygote_message(block=False)
                elif (readable := self.by_fd.get(fd)) is not None:
                    self.on_worker_readable(readable)
        for worker in live:
            if self.workers[worker.slot] is worker:  # did not answer in time
                self.forget_worker(worker)
        with contextlib.suppress(OSError):
            self.zygote.send_bytes(encode(Tag.STOP))

    def break_pool(self, exc: BaseException) -> None:
        """An internal error: fail every unfinished future with BrokenPoolError."""
        error = BrokenPoolError(f"the pool broke: {exc!r}")
        error.__cause__ = exc
        with self.lock:
            self.broken = exc  # under the lock: no submit can queue behind the sweep below
            self.draining = True
            futures = list(self.pending) + list(self.by_handle.values())
            self.pending.clear()
            self.by_handle.clear()
        for future in futures:
            future._owner = None
            with contextlib.suppress(Exception):
                if not future.done():
                    future.set_exception(error)
        for worker in list(self.workers):
            if worker is not None:
                self.forget_worker(worker)
        with contextlib.suppress(OSError):
            self.zygote.send_bytes(encode(Tag.STOP))

    def close(self) -> None:
        self.epoll.close()


def crash_message(worker: WorkerHandle, code: int | None) -> str:
    return (
        f"the worker process (pid {worker.pid}, slot {worker.slot}) running this task died "
        f"with {signal_description(code)}. Likely causes: it ran out of memory and was killed "
        "(check dmesg for the OOM killer), a crash in native code (a C extension), or "
        "os._exit() / a signal sent to it. The pool replaced the worker and goes on."
    )


def resolve(future: Future, status: int, data: bytes) -> None:
    """Settle a task's future from its result bytes (coordinator thread, no lock held)."""
    future._owner = None
    if future.done():  # cancelled meanwhile: a race the claim decided; nothing to report
        return
    try:
        if status == _OK:
            future.set_result(pickle.loads(data))
        elif status == _CANCELLED:
            future._mark_cancelled()
        else:
            future.set_exception(load_exception(data))
    except Exception as exc:
        with contextlib.suppress(Exception):
            future.set_exception(RuntimeError(f"the task's result could not be unpickled: {exc!r}"))
