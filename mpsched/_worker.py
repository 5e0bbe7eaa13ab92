"""The worker process: find work, run it, report it, sleep without losing a wake-up, drain.

Runs in each worker process (forked by the zygote, ``_zygote``); ``worker_main`` is its entry.
Also owns the task-side API that runs inside workers: ``submit`` (``mpsched.submit``) and
``ChildFuture`` (join-helping).

find_work, in order (rayon's ``find_work``; "finish what we started before we take on something
new"): the own deque's back (LIFO: the children our tasks just spawned), then the own inbox's
front (FIFO: the coordinator's order), then a steal from the front of a peer's deque or inbox,
starting at a random peer and retrying only while some peer answered RETRY (crossbeam).

Claims are exactly-once by the rings (``_shm_deque``: removal under the slot lock is the claim),
and each claim is recorded in this worker's run stack in the same lock hold.

Task kinds, by the block's ``parent`` word:
  * top-level (parent -1, from the coordinator): after running, the result goes into the task's
    own block and the handle into this worker's done ring, popping the run stack in the same lock
    round (``SlotQueues.complete``): at every instant the handle is in exactly one of a ring, a
    run stack or a done ring, so a crash can lose nothing silently. The coordinator is poked
    (RESULTS) per batch, when idle and after a task that asked (``announce_result``: a map
    chunk); the coordinator's timer sweep covers the rest.
  * child (parent = the spawning worker's slot): the result goes into the child's block, whose
    ``state`` becomes DONE under the *parent's* slot lock; the parent's future reads it from
    there. A child that nobody waits for (its future was dropped) is ABANDONED, and whoever sees
    the second of DONE / ABANDONED frees the block.

Sleep protocol ("announce, recheck, then block"; the lost-wake-up argument is in design.md):
    1. sleepers += 1 (global lock);  2. announce_sleep() on the own slot (sets ``sleeping`` under
    the own lock if both own rings are empty);  3. recheck every peer with ``probe()`` (under each
    peer's lock) and, when joining, the awaited child's state (under the own lock);  4. block in
    ``poll`` on the own wake eventfd and the coordinator socket. Wakers push first, then read
    ``sleepers`` and clear a sleeper's flag under its lock before writing its eventfd. A waker
    wakes one sleeper per publication, so a worker whose sleep ends passes the wake-up on to
    one more sleeper while more than one entry is queued in all.

Exceptions from user code are caught and reported as the task's error (including SystemExit and
KeyboardInterrupt raised by a task); exceptions from mpsched's own code end the worker with a
FATAL message and a non-zero exit code (rayon ``AbortIfPanic``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import random
import select
import signal
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from mpsched._errors import InternalError, TaskCancelled
from mpsched._layout import SegmentViews
from mpsched._payloads import BlockField
from mpsched._protocol import (
    ChildState,
    ResultStatus,
    Tag,
    TopState,
    decode,
    dump_exception,
    encode,
    load_exception,
    unpickling_failed,
)
from mpsched._serialize import INLINE, decode_call, dumps, encode_call
from mpsched._shm import SharedFd
from mpsched._shm_deque import StealResult
from mpsched._slot_region import MAX_NESTING

# typing.TYPE_CHECKING without importing typing at run time (why: mpsched/__init__.py).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Literal

CHILD_QUEUED = int(ChildState.QUEUED)
CHILD_DONE = int(ChildState.DONE)
CHILD_ABANDONED = int(ChildState.ABANDONED)

# A uid or stash key is pid << 31 | counter: the counter wraps at 2**31 (a uid is reused only
# after 2**31 more from the same process, long after its task ended).
UID_COUNTER_MASK = (1 << 31) - 1
STEAL_RETRY_ROUNDS = 64  # full rounds over the peers while some answered RETRY, then sleep
# Before sleeping, watch the own queues this long (s): a caller that waits for each result
# before it submits the next task (a latency-bound loop) hands the next one over within tens of
# microseconds, and a sleeping worker costs it a cross-process wake-up (~35 us here) each time.
IDLE_SPIN = 200e-6
_SUCCESS = StealResult.SUCCESS
_RETRY = StealResult.RETRY
_OK = int(ResultStatus.OK)
_ERROR = int(ResultStatus.ERROR)
_CANCELLED = int(ResultStatus.CANCELLED)
_STATE = int(BlockField.STATE)
_NBYTES = int(BlockField.NBYTES)
_PARENT = int(BlockField.PARENT)
_RESULT_STATUS = int(BlockField.RESULT_STATUS)
_RESULT_NBYTES = int(BlockField.RESULT_NBYTES)
_POKE = encode(Tag.RESULTS)
_CANCEL_REQUESTED = int(TopState.CANCEL_REQUESTED)


class WorkerOptions:
    """Worker tunables, fixed per pool. A plain class, not a dataclass: the zygote imports this
    module, and dataclasses (with inspect, ast and dis) would add ~10 ms to every start-up."""

    __slots__ = ("initializer", "max_tasks", "result_batch")

    def __init__(
        self, *, result_batch: int = 32, max_tasks: int = 0, initializer: bytes = b""
    ) -> None:
        # Results: poke the coordinator after this many unannounced ones (and whenever idle);
        # the coordinator also sweeps done rings on a timer, which bounds any result's wait.
        self.result_batch = result_batch
        # Top-level tasks a worker runs before it retires and is replaced (0: no limit).
        self.max_tasks = max_tasks
        # The pool's initializer and its arguments, pickled (b"": none); run once per worker.
        self.initializer = initializer


# The Worker of this process, set by worker_main; None outside workers.
_current: Worker | None = None


def submit(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> ChildFuture:
    """Inside a task: run ``fn(*args, **kwargs)`` as a child task on this worker's own deque.

    The child may be stolen by an idle worker. ``result()`` on the returned future runs other
    tasks while it waits (join-helping), so recursive fork-join finishes even with one worker.

    Raises:
        RuntimeError: called outside a task running in an mpsched pool (use ``Pool.submit``).
        TaskPicklingError: the function or an argument cannot be pickled.
    """
    worker = _current
    if worker is None:
        raise RuntimeError(
            "mpsched.submit() only works inside a task running in an mpsched pool; "
            "outside one, use pool.submit()"
        )
    if not callable(fn):
        raise TypeError(f"fn must be callable, not {type(fn).__name__}")
    return worker.spawn(fn, args, kwargs)


def announce_result() -> None:
    """Inside a top-level task: announce its result to the coordinator as soon as it is in the
    done ring, not with the worker's batch (``WorkerOptions.result_batch``) or when the worker
    idles. For a task whose caller waits on it while later tasks queue behind it on the same
    worker (a chunk of ``Pool.map``, consumed in order): otherwise its result would wait for
    those. Should only be used by ``_chunks``; a no-op outside a worker."""
    worker = _current
    if worker is not None:
        worker.announce = True


def current_task() -> TaskContext:
    """Inside a task: the running task's context (its id, version, worker and cancel flag).

    Raises:
        RuntimeError: called outside a task running in an mpsched pool.
    """
    worker = _current
    if worker is None or not worker.contexts:
        raise RuntimeError("mpsched.current_task() only works inside a task running in a pool")
    handle, meta = worker.contexts[-1]
    return TaskContext(worker.slot, worker.slab, handle, meta)


class TaskContext:
    """What a running task knows about itself (``mpsched.current_task()``).

    Attributes:
        task_id: the id given to ``pool.schedule``; None for ``submit``/``map`` tasks and
            children.
        version: the version of ``task_id`` this run belongs to (0 without an id).
        worker_id: the slot of the worker running the task (0 .. workers - 1).
    """

    __slots__ = ("_handle", "_slab", "task_id", "version", "worker_id")

    def __init__(
        self, worker_id: int, slab: Any, handle: int, meta: tuple[Any, int] | Literal[False]
    ) -> None:
        self.worker_id = worker_id
        self.task_id: Any = meta[0] if meta else None
        self.version: int = meta[1] if meta else 0
        self._slab = slab
        self._handle = handle  # -1 for a child: nobody can cancel a child by id

    @property
    def cancel_requested(self) -> bool:
        """True once ``pool.cancel(task_id)`` (or the task's timeout) asked this run to stop.
        Reads one word of shared memory: cheap enough to poll in a loop. Always False in a
        child (``mpsched.submit``): a cancel of its parent does not reach it (a child may
        outlive its parent, whose block is then reused); pass it what it needs to stop."""
        return self._handle >= 0 and self._slab.get_word(self._handle, _STATE) == _CANCEL_REQUESTED

    def raise_if_cancelled(self) -> None:
        """Raise ``mpsched.TaskCancelled`` if a cancel was requested: the future then ends
        cancelled."""
        if self.cancel_requested:
            raise TaskCancelled(f"task {self.task_id!r} v{self.version} was asked to cancel")

    def __repr__(self) -> str:
        return (
            f"<TaskContext task_id={self.task_id!r} version={self.version} "
            f"worker_id={self.worker_id} cancel_requested={self.cancel_requested}>"
        )


class ChildFuture:
    """The future of a child task (``mpsched.submit``); lives in the spawning worker only.

    ``result()`` and ``exception()`` help: while the child is not done, this worker runs other
    tasks (its own deque first, where the child most likely still is). Not thread-safe, and not
    picklable: it refers to a block of this pool's shared memory.

    It has the query methods of ``concurrent.futures.Future`` (``done``, ``running``,
    ``cancelled``, ``cancel``, ``result``, ``exception``) but no callbacks. A child cannot be
    cancelled: ``cancel()`` always returns False and ``cancelled()`` is always False. (A queued
    child sits in the middle of this worker's deque, which only gives up its ends, and a peer
    may steal it at any moment; withdrawing it safely would need a claim protocol like the
    top-level tasks' inbox cancel.) To stop caring about a child, drop its future: a child
    nobody waits for still runs, and its result is discarded.
    """

    __slots__ = ("__weakref__", "_error", "_error_data", "_handle", "_settled", "_value", "_worker")

    def __init__(self, worker: Worker, handle: int) -> None:
        self._worker = worker
        self._handle = handle  # -1 once settled
        self._settled = False
        self._value: Any = None
        self._error: BaseException | None = None  # what exception() returns; never raised
        # The child's pickled error: result() raises a fresh copy of it (see result()).
        self._error_data: bytes | None = None

    @classmethod
    def settled(cls, worker: Worker, value: Any, error: bytes | None) -> ChildFuture:
        """A child run inline: its value, or its error pickled (``dump_exception``) as a
        child's is, so that it reads the same whichever way the child ran."""
        fut = cls(worker, -1)
        fut._settled = True
        fut._value = value
        if error is not None:
            fut._error_data = error
            fut._error = load_exception(error)
        return fut

    def done(self) -> bool:
        if not self._settled and self._worker.child_state(self._handle) == CHILD_DONE:
            self._settle()
        return self._settled

    def running(self) -> bool:
        """Whether a worker has started the child and it is not done: False while it waits in
        this worker's deque. A snapshot: a peer may steal and start it right after."""
        if self.done():
            return False
        if self._worker.me.in_deque(self._handle):
            return False
        return not self.done()

    def cancelled(self) -> bool:
        """Always False: a child is never cancelled (see ``cancel``)."""
        return False

    def cancel(self) -> bool:
        """Always False (as ``concurrent.futures.Future.cancel`` for a call it cannot stop): a
        child cannot be withdrawn once spawned (see the class docstring); it runs to its end."""
        return False

    def result(self, timeout: float | None = None) -> Any:
        """The child's return value; re-raises its exception. Runs other tasks while waiting.

        The exception raised is a new copy at each call (equal type and arguments, not the
        object ``exception()`` returns): the raise gives it a traceback holding the caller's
        frame, and a copy this future kept would close a reference cycle through that frame,
        keeping the caller's other child futures alive, and their blocks taken, until a
        garbage collection (docs/design.md, "Dropped child futures").

        ``timeout`` is checked between the tasks this worker runs while it waits, not during
        them: most often it runs the awaited child itself, so the wait can last as long as the
        child (docs/design.md, "Futures", known gap)."""
        self._wait(timeout)
        if self._error_data is not None:
            raise load_exception(self._error_data)
        return self._value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._wait(timeout)
        return self._error

    def _wait(self, timeout: float | None) -> None:
        if not self._settled:
            self._worker.join(self, timeout)
            self._settle()

    def _settle(self) -> None:
        status, value = self._worker.collect_child(self._handle)
        self._worker.unsettled -= 1
        self._handle = -1
        self._settled = True
        if status == _OK:
            self._value = value
        else:
            self._error_data = value
            self._error = load_exception(value)

    def __del__(self) -> None:
        # No lock here: __del__ may run inside any critical section of this process (a GC
        # pass). The worker processes abandoned children at its next safe point.
        if not self._settled and self._handle >= 0 and _current is self._worker:
            self._worker.abandoned.append(self._handle)

    def __reduce__(self) -> Any:
        raise TypeError("a ChildFuture cannot leave the worker that spawned the child")


class Worker:
    """The state of one worker process. Methods run in that process's main thread only."""

    def __init__(
        self,
        slot: int,
        views: SegmentViews,
        wake_fds: list[SharedFd],
        conn: Connection,
        options: WorkerOptions,
    ) -> None:
        self.slot = slot
        self.views = views
        self.me = views.slots[slot]
        self.peers = [q for k, q in enumerate(views.slots) if k != slot]
        self.slots = views.slots
        self.slab = views.slab
        self.header = views.header
        self.wake_fds = [f.fd for f in wake_fds]
        self.my_wake_fd = self.wake_fds[slot]
        self.conn = conn
        self.options = options
        self.fn_cache: dict[int, Callable[..., Any]] = {}
        self.fid_of: dict[Callable[..., Any], int] = {}  # reverse of fn_cache, for children
        self.abandoned: list[int] = []  # children whose futures were dropped (see __del__)
        # Children in blocks whose futures have neither settled nor been released as
        # abandoned: nonzero when the worker retires means futures outlived their task.
        self.unsettled = 0
        self.depth = 0  # tasks running in this process (join-helping nests them)
        # current_task()'s raw material, innermost last: (top-level handle or -1, meta). The
        # TaskContext object is built only when a task asks for it, not for every task.
        self.contexts: list[tuple[int, Any]] = []
        self.unannounced = 0  # results in the done ring since the last poke
        self.announce = False  # the running task asked for a poke once it is done
        self.top_level_done = 0  # for max_tasks (children do not count)
        self.draining = False
        self.pid = os.getpid()
        # This worker's part of every uid and stash key it makes (next_uid), and the uid it
        # stamps on an ABANDONED child it takes over to free (finish_child).
        self.uid_base = self.pid << 31
        self.stash_counter = 0
        self.rng = random.Random(self.pid)
        self.poller = select.poll()
        self.poller.register(self.my_wake_fd, select.POLLIN)
        self.poller.register(conn.fileno(), select.POLLIN)

    # ------------------------------------------------------------------ main loop
    def main_loop(self) -> bool:
        """Run until drained (returns False) or retired by ``max_tasks`` (returns True)."""
        max_tasks = self.options.max_tasks
        while not self.draining:
            handle = self.find_work()
            if handle >= 0:
                self.run(handle)
                if self.abandoned:
                    self.release_abandoned()
                if max_tasks and self.top_level_done >= max_tasks:
                    return True
            else:
                self.idle(None)
        return False

    def find_work(self) -> int:
        handle = self.me.pop_or_take(True)
        return handle if handle >= 0 else self.steal()

    def steal(self) -> int:
        peers = self.peers
        n = len(peers)
        if not n:
            return -1
        me = self.me
        for _ in range(STEAL_RETRY_ROUNDS):
            retry = False
            start = self.rng.randrange(n)
            for k in range(n):
                result, handle = peers[(start + k) % n].steal(me)
                if result is _SUCCESS:
                    return handle
                if result is _RETRY:
                    retry = True
            if not retry:
                return -1
        return -1

    # ------------------------------------------------------------------ running
    def run(self, handle: int) -> None:
        """Run the claimed task ``handle`` (already on the run stack) and report it."""
        slab = self.slab
        parent = slab.get_word(handle, _PARENT)
        nbytes = slab.get_word(handle, _NBYTES)
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
        pushed = False
        try:
            fid, fn, args, kwargs, meta = decode_call(data)
            del data
            if fid != INLINE:
                fn = self.load_function(fid)
            contexts.append((handle if parent < 0 else -1, meta))
            pushed = True
            value = fn(*args, **kwargs)
            del fn, args, kwargs
            status, out = _OK, dumps(value)
            del value
        except TaskCancelled as exc:
            # Cancelled only if asked to: a TaskCancelled raised unprompted is an error.
            requested = parent < 0 and slab.get_word(handle, _STATE) == _CANCEL_REQUESTED
            status, out = (_CANCELLED if requested else _ERROR), dump_exception(exc)
        except BaseException as exc:  # user code: any exception is the task's outcome
            status, out = _ERROR, dump_exception(exc)
        finally:
            self.depth -= 1
            if pushed:
                contexts.pop()
        if not slab.write_result(handle, status, out):
            slab.set_word(handle, _RESULT_STATUS, status)
            self.stash(out, handle, _RESULT_NBYTES)
        del out
        if parent < 0:
            self.me.complete(handle)
            self.top_level_done += 1
            self.unannounced += 1
            # A task that asked (announce_result) is announced at once, unless a user thread
            # is collecting the done rings itself (as in idle(): see Coordinator.help_wait).
            if self.unannounced >= self.options.result_batch or (
                self.announce and not self.header.collector()
            ):
                self.poke()
        else:
            self.finish_child(handle, parent)
        self.announce = False

    def load_function(self, fid: int) -> Callable[..., Any]:
        fn = self.fn_cache.get(fid)
        if fn is None:
            fn = pickle.loads(self.views.functions.get(fid))
            self.fn_cache[fid] = fn
            with contextlib.suppress(TypeError):  # unhashable: children pickle it inline
                self.fid_of[fn] = fid
        return fn

    def poke(self) -> None:
        """Tell the coordinator that results wait in this worker's done ring."""
        if self.unannounced:
            self.unannounced = 0
            self.conn.send_bytes(_POKE)

    # ------------------------------------------------------------------ children
    def spawn(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> ChildFuture:
        fid = self.fid_of.get(fn, INLINE) if type(fn).__hash__ is not None else INLINE
        payload = encode_call(fid, None if fid != INLINE else fn, args, kwargs)
        if self.depth >= MAX_NESTING - 1:
            # join() stops helping at this depth (the run stack is full): a child pushed now
            # would wait in our own deque for a joiner that never runs it, and with no idle
            # peer to steal it (Pool(1)) forever. Run it inline, as when the deque is full.
            return self.run_inline(payload)
        slab = self.slab
        uid = self.next_uid()
        handle = slab.alloc(uid)  # the block names us from its allocation on
        if handle < 0:  # slab full: run the child here and now (rayon runs inline too)
            return self.run_inline(payload)
        stashed = 0
        if not slab.write_child(handle, payload, self.slot, CHILD_QUEUED):
            slab.write_child(handle, b"", self.slot, CHILD_QUEUED)
            stashed = self.stash(payload, handle, _NBYTES)
        self.header.add_live_children(1)
        if not self.me.push(handle):  # deque full
            self.header.add_live_children(-1)
            if stashed:  # only a FETCH empties the coordinator's stash: drop them so,
                # before the free: until then the block names the key to the crash recovery
                # (an unpublished child), which drops it (freed first, a death before the
                # FETCH left the bytes in the stash, named by no block)
                self.fetch(stashed)
                slab.set_word(handle, _NBYTES, 0)
            slab.free_children([handle])
            return self.run_inline(payload)
        if self.header.sleepers():
            self.wake_one_sleeper()
        self.unsettled += 1
        return ChildFuture(self, handle)

    def run_inline(self, payload: bytes) -> ChildFuture:
        # Decoding runs user code (the arguments' unpickling, the function's import): its
        # error is the child's, as when a peer runs it (it escaped from mpsched.submit).
        contexts = self.contexts
        pushed = False
        try:
            fid, fn, args, kwargs, _ = decode_call(payload)
            if fid != INLINE:
                fn = self.load_function(fid)
            # A child's context, as in run(): current_task() in the child reported the
            # parent's id and version, and its cancel flag (a child has none).
            contexts.append((-1, False))
            pushed = True
            value = fn(*args, **kwargs)
        except BaseException as exc:  # user code: reported as a child's error is
            return ChildFuture.settled(self, None, dump_exception(exc))
        finally:
            if pushed:
                contexts.pop()
        return ChildFuture.settled(self, value, None)

    def finish_child(self, handle: int, parent: int) -> None:
        """Executor of a child: publish DONE under the parent's slot lock and wake the parent.

        The run-stack pop happens in the same lock hold (``finished_by``): the parent frees
        the block only after confirming DONE under that lock, so a handle is never both on a
        run stack and free (the uniqueness crash repair relies on).

        An ABANDONED child stays ABANDONED (``unless``): this worker frees it, and DONE would
        tell the crash recovery of a dead parent (``orphan_children``) that the block is the
        parent's to free, so that it freed it too (a double free) while this worker was
        between the exchange and its free. In the same hold the block's uid becomes this
        worker's (``taker``): the recovery of the parent no longer takes it for the parent's,
        and that of this worker, dying before its free commits, finds it (an ABANDONED block
        in no ring and on no run stack is its uid's to free).
        """
        previous = self.slots[parent].exchange_block_state(
            self.slab,
            handle,
            CHILD_DONE,
            finished_by=self.me,
            unless=CHILD_ABANDONED,
            taker=self.uid_base,
        )
        self.header.add_live_children(-1)
        if previous == CHILD_ABANDONED:
            self.free_unread_child(handle)
        elif self.slots[parent].clear_sleeping():
            os.eventfd_write(self.wake_fds[parent], 1)

    def child_state(self, handle: int) -> int:
        """Racy read (a hint): whether a child looks done; confirmed under the lock by join."""
        return self.slab.get_word(handle, _STATE)

    def collect_child(self, handle: int) -> tuple[int, Any]:
        """Parent: read a DONE child's outcome and free its block: its value, or its error as
        pickled (``dump_exception``: the future loads it)."""
        slab = self.slab
        if self.me.block_state(slab, handle) != CHILD_DONE:  # under the lock: see finish_child
            raise InternalError(f"collecting child block {handle} that is not done")
        status = slab.get_word(handle, _RESULT_STATUS)
        nbytes = slab.get_word(handle, _RESULT_NBYTES)
        if nbytes >= 0:
            data = slab.read_result(handle)[1]
        else:
            data = self.fetch(-nbytes)
            # Fetched: a death in the free below leaves a DONE block that the crash recovery
            # frees, and it must not wait for the bytes (unwanted_stash) as if still stashed.
            slab.set_word(handle, _RESULT_NBYTES, 0)
        self.free_child(handle)
        if status == _OK:
            try:
                return status, pickle.loads(data)
            except BaseException as exc:  # user code (__reduce__, __setstate__) ran
                # The child's error, as a top-level task's (the block is freed: an error
                # escaping here left the future unsettled on a free block, and a second
                # result() waited on it forever).
                return _ERROR, dump_exception(unpickling_failed(exc))
        return status, data

    def free_child(self, handle: int) -> None:
        self.slab.free_children([handle])

    def free_unread_child(self, handle: int) -> None:
        """Free a DONE child whose future was dropped. An outcome too big for the block waits
        in the coordinator's stash, which only a FETCH empties: fetch it (and drop it), or
        every such child would leak its result's bytes in the coordinator. (A FETCH, not a
        "drop" message: the executor's STASH may still be in flight on its own socket; the
        coordinator parks a FETCH until the STASH comes.)"""
        nbytes = self.slab.get_word(handle, _RESULT_NBYTES)
        if nbytes < 0:
            self.fetch(-nbytes)
            # Fetched: a death in the free below leaves a block that the crash recovery frees,
            # and it must not wait for the bytes (unwanted_stash) as if still stashed.
            self.slab.set_word(handle, _RESULT_NBYTES, 0)
        self.free_child(handle)

    def release_abandoned(self) -> None:
        """At a safe point (no lock held): children nobody waits for go to their executor."""
        while self.abandoned:
            handle = self.abandoned.pop()
            self.unsettled -= 1
            if self.me.exchange_block_state(self.slab, handle, CHILD_ABANDONED) == CHILD_DONE:
                self.free_unread_child(handle)

    def join(self, future: ChildFuture, timeout: float | None) -> None:
        """Help until ``future``'s child is done: run other tasks, or sleep until woken."""
        deadline = None if timeout is None else time.monotonic() + timeout
        handle = future._handle
        while self.child_state(handle) != CHILD_DONE:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError("the child task did not finish in time")
            found = self.find_work() if self.depth < MAX_NESTING - 1 else -1
            if found >= 0:
                self.run(found)
                if self.abandoned:
                    self.release_abandoned()
            else:
                self.idle(handle, deadline)

    def next_uid(self) -> int:
        # The counter wraps within its 31 bits: past them it spilled into the pid's bits, and
        # the crash recovery, which finds a dead worker's children and stashed bytes by
        # ``uid >> 31 == pid``, missed them (after 2**31 spawns in one worker's life).
        self.stash_counter = counter = (self.stash_counter + 1) & UID_COUNTER_MASK
        return self.uid_base | counter

    # ------------------------------------------------------------------ big payloads
    def stash(self, data: bytes, handle: int, field: int) -> int:
        """Hand bytes too big for a block to the coordinator; returns their key (> 0), stored
        (negated) in ``handle``'s word ``field`` before the STASH is sent: a worker that dies
        during or after the send leaves the key where the coordinator's recovery finds it (it
        drops the bytes; stored after the send, they leaked)."""
        key = self.next_uid()
        self.slab.set_word(handle, field, -key)
        self.conn.send_bytes(encode(Tag.STASH, key, data))
        return key

    def fetch(self, key: int) -> bytes:
        """Get stashed bytes from the coordinator (blocks until it answers)."""
        self.conn.send_bytes(encode(Tag.FETCH, key))
        while True:
            tag, fields = decode(self.conn.recv_bytes())
            if tag is Tag.PAYLOAD and fields[0] == key:
                return fields[1]  # type: ignore[no-any-return]
            self.on_message(tag, fields)

    # ------------------------------------------------------------------ idle and wake-ups
    def idle(self, awaited: int | None, deadline: float | None = None) -> None:
        """Nothing to run: poke results, then announce, recheck and block until woken.

        ``awaited`` is the block of a child being joined (its DONE also ends the sleep).
        """
        header = self.header
        if not header.collector():  # else a user thread is reading the done rings itself
            self.poke()
        me = self.me
        if awaited is None:
            end = time.perf_counter() + IDLE_SPIN
            while me.is_empty():
                if time.perf_counter() > end:
                    break
            else:
                return  # work arrived: back to find_work
        header.add_sleepers(1)
        try:
            if not me.announce_sleep():
                return
            if (awaited is not None and me.block_state(self.slab, awaited) == CHILD_DONE) or any(
                peer.probe() for peer in self.peers
            ):
                if not me.clear_sleeping():
                    self.consume_wake()  # a waker got there first and wrote our eventfd
            else:
                timeout_ms = -1
                if deadline is not None:
                    timeout_ms = max(0, int((deadline - time.monotonic()) * 1e3))
                for fd, _ in self.poller.poll(timeout_ms):
                    if fd == self.my_wake_fd:
                        self.consume_wake()
                    else:
                        self.read_messages()
                me.clear_sleeping()
        finally:
            header.add_sleepers(-1)
        # Pass the wake-up on: a waker wakes one sleeper for a batch (the coordinator's inject
        # into a sleeping inbox wakes only its owner), and this worker takes one task of it.
        # Were more queued, a peer that slept through their publication would sleep on while
        # they wait behind our task. Off the per-task path: only after an announced sleep.
        if header.sleepers() and sum(len(slot) for slot in self.slots) > 1:
            self.wake_one_sleeper()

    def consume_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self.my_wake_fd)

    def wake_one_sleeper(self) -> None:
        """After publishing work: wake one sleeping peer (which will steal it)."""
        for k, slot in enumerate(self.slots):
            if k != self.slot and slot.is_sleeping() and slot.clear_sleeping():
                os.eventfd_write(self.wake_fds[k], 1)
                return

    def read_messages(self) -> None:
        while self.conn.poll():
            try:
                frame = self.conn.recv_bytes()
            except EOFError:  # the coordinator is gone
                os._exit(0)
            self.on_message(*decode(frame))

    def on_message(self, tag: Tag, fields: tuple[Any, ...]) -> None:
        if tag is Tag.DRAIN:
            self.draining = True
        else:
            raise InternalError(f"worker {self.slot} got unexpected {tag.name}")

    def statistics(self) -> dict[str, int]:
        return self.me.counters()


def worker_main(
    slot: int,
    views: SegmentViews,
    wake_fds: list[SharedFd],
    conn: Connection,
    options: WorkerOptions,
) -> int:
    """Entry point of a worker process (called in the child of the zygote's fork)."""
    global _current
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the coordinator
    worker = Worker(slot, views, wake_fds, conn, options)
    os.register_at_fork(after_in_child=lambda: _forked_by_a_task(conn))
    if options.initializer and not run_initializer(conn, slot, options.initializer):
        return 0  # the coordinator breaks the pool with the initializer's error
    _current = worker
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
            return 0
        worker.poke()
        conn.send_bytes(encode(Tag.DRAINED, slot, worker.statistics()))
        return 0
    except (BrokenPipeError, ConnectionResetError, EOFError):
        # Our socket's other end is closed: the coordinator broke the pool (e.g. a peer's
        # initializer failed) or is gone, and the zygote is about to kill us. The same as EOF
        # in read_messages: exit quietly, not with a traceback that blames mpsched.
        return 0
    except BaseException:
        import traceback  # here, not at the top: see _protocol.dump_exception

        text = traceback.format_exc()
        try:
            conn.send_bytes(encode(Tag.FATAL, slot, text))
        except OSError:
            sys.stderr.write(text)
        return 70  # EX_SOFTWARE: an mpsched bug
    finally:
        _current = None


def _forked_by_a_task(conn: Connection) -> None:
    """In a process that a task (or the initializer) forked from this worker: it is no worker.
    It lets go of its copy of the worker's socket, whose EOF is how the coordinator learns of
    the worker's death: a copy kept by a process that outlives its task (a daemon) hid the
    worker's death, so its task never failed, its slot was not replaced and the shutdown
    waited the drain's timeout. ``mpsched.submit`` refuses to run here: it would push into the
    worker's deque beside the worker, the deque's one owner."""
    global _current
    _current = None
    conn.close()


def run_initializer(conn: Connection, slot: int, initializer: bytes) -> bool:
    """Run the pool's initializer; on error, report it (INIT_FAILED) and return False."""
    try:
        fn, args = pickle.loads(initializer)
        fn(*args)
    except BaseException as exc:  # user code: report any error, never die silently
        # EPIPE: the coordinator already closed our socket (a peer's initializer failed first
        # and broke the pool, or the pool is gone): nobody is left to tell, and the zygote
        # would print this send's traceback as if mpsched had failed.
        with contextlib.suppress(OSError):
            conn.send_bytes(encode(Tag.INIT_FAILED, slot, dump_exception(exc)))
        return False
    return True
