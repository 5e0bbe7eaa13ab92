"""The task side of a worker: children (``mpsched.submit``, ``ChildFuture``) and the running task's
context (``mpsched.current_task``, ``TaskContext``).

Runs in each worker process only (a ``ChildFuture`` never leaves the worker that spawned its
child). Called from: user code in a running task (``submit``, ``current_task``,
``announce_result``, the ``ChildFuture`` methods; ``announce_result`` only by ``_chunks``), and
the rest of the worker (``_worker``): ``Worker.run`` calls ``finish_child`` after a child's run,
the main loop and ``join`` call ``release_abandoned`` after a task, ``Worker.stash`` takes its
key from ``next_uid``, ``worker_main`` sets ``_current``.

Owns: ``_current`` (this process's ``Worker``), the task-side API, and ``Children``, the part of
``Worker`` (``class Worker(Children)``) that spawns children (``spawn``, or ``run_inline`` when
the child cannot be queued), finishes them as their executor (``finish_child``), collects and
frees them as their parent (``child_state``, ``collect_child``, ``free_child``,
``free_unread_child``, ``release_abandoned``), helps while joining (``join``) and makes uids
(``next_uid``). Methods stay methods of the one ``Worker`` object (no indirection on the
per-task paths); ``Children`` declares what it uses from ``_worker`` under ``TYPE_CHECKING``
only, so that mypy checks it alone.

Invariants (docs/design.md, "Failure model"): a child's block ``state`` changes only under its
*parent's* slot lock; whoever sees the second of DONE and ABANDONED frees the block, exactly
once; a child's uid names its spawner from its allocation on (its executor, once it takes an
ABANDONED child over to free it); bytes a child's outcome stashed in the coordinator are
fetched before its block is freed (only a FETCH empties the stash). Not handled: cancelling a
child (see ``ChildFuture``), and a child's cancel flag (``TaskContext.cancel_requested`` is
always False in a child).
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from _thread import get_ident
from types import GenericAlias

from mpsched._clock import wait_seconds
from mpsched._errors import InternalError, TaskCancelled, timeout_error
from mpsched._payloads import BlockField
from mpsched._protocol import (
    USER_ERROR_EXIT,
    Buffer,
    ChildState,
    ResultStatus,
    TopState,
    dump_exception,
    load_exception,
    unpickling_failed,
)
from mpsched._serialize import INLINE, decode_call, encode_call
from mpsched._slot_region import MAX_NESTING

# typing.TYPE_CHECKING without importing typing at run time (why: mpsched/__init__.py).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Hashable
    from typing import Any, Generic, NoReturn, ParamSpec, TypeVar

    from mpsched._layout import GlobalHeader
    from mpsched._payloads import Slab
    from mpsched._shm_deque import SlotQueues
    from mpsched._worker import Worker

    _T = TypeVar("_T")  # a child's result
    _P = ParamSpec("_P")  # a child function's parameters

    class _Generic(Generic[_T]):
        __slots__ = ()

else:
    # What makes ChildFuture generic to type checkers, and ``ChildFuture[int]`` valid at run
    # time (as ``concurrent.futures.Future[int]``), without importing typing (why: above).
    class _Generic:
        __slots__ = ()
        __class_getitem__ = classmethod(GenericAlias)

    _T = _P = None  # in annotations only (strings at run time)

CHILD_QUEUED = ChildState.QUEUED
CHILD_DONE = ChildState.DONE
CHILD_ABANDONED = ChildState.ABANDONED

# A uid or stash key is pid << 31 | counter: the counter wraps at 2**31 (a uid is reused only
# after 2**31 more from the same process, long after its task ended).
UID_COUNTER_MASK = (1 << 31) - 1
# The end of a worker's process (and of the zygote's, and of a task's forked child), bound at
# import: a task may leave ``os._exit`` replaced (a ``mock.patch`` never stopped). The
# replacement returned, and the worker ran on into the zygote's code, which then SIGKILLed pid
# 0: the pool's whole process group (found in review).
end_process = os._exit
_OK = ResultStatus.OK
_ERROR = ResultStatus.ERROR
_STATE = BlockField.STATE
_NBYTES = BlockField.NBYTES
_RESULT_STATUS = BlockField.RESULT_STATUS
_RESULT_NBYTES = BlockField.RESULT_NBYTES
_CANCEL_REQUESTED = TopState.CANCEL_REQUESTED
# A context entry's handle once its run ended (``Worker.run``): a ``TaskContext`` kept past its
# run reads this, not the block's word, which a later task may own by then.
ENDED = -1  # as a child's: never flagged
ENDED_CANCEL_REQUESTED = -2  # the run ended with a cancel requested

# The Worker of this process, set by worker_main; None outside workers.
_current: Worker | None = None

# Frames of mpsched's own between a task and a task it runs nested in it: ``ChildFuture.result``,
# ``_wait``, ``join`` and ``Worker.run`` when a join helps; ``submit``, ``spawn`` and
# ``run_inline`` when a child runs inline. The recursion limit rises by them for the nested
# run, so that they do not count against the tasks' own recursion: with the default limit of
# 1,000, a chain of tasks each joining its child stopped at ~230 levels (RecursionError), where
# the same recursion in one process goes ~990 deep.
JOIN_FRAMES = 4
INLINE_FRAMES = 3


def abandon_worker(exc: BaseException, why: str) -> NoReturn:
    """End this worker now, as a crash (``USER_ERROR_EXIT``), after saying ``why`` and ``exc``
    on its stderr: its shared state may be half-changed, or a wake-up it owes a peer cannot be
    sent, so neither raising on nor going on is safe. The coordinator's recovery, made for a
    worker killed at any point, repairs what it left (a lock taken, a child claimed and never
    run) and wakes every sleeper (the wake-up it owed included); the task it ran fails with
    ``WorkerCrashedError`` and the worker is replaced. Not an exception: it would unwind
    through the task's code, which may catch it and go on. The coordinator gone (a FETCH's or
    STASH's socket at its end) is no crash: the worker exits quietly, as ``worker_main`` does."""
    if isinstance(exc, (BrokenPipeError, ConnectionResetError, EOFError)):
        end_process(0)
    import traceback  # here, not at the top: see _protocol.dump_exception

    try:
        text = "".join(traceback.format_exception(exc))
        sys.stderr.write(
            f"mpsched: worker pid {os.getpid()}: {why}; the worker exits and is replaced:\n{text}"
        )
        sys.stderr.flush()
    except BaseException:  # a task may have taken stderr away
        pass
    end_process(USER_ERROR_EXIT)


def end_forked_child(exc: BaseException | None) -> NoReturn:
    """In a process that a task forked (``_worker._forked_by_a_task`` marked it): the task's
    code came back into the worker's, returning or raising (``sys.exit()`` is the usual end of a
    fork's child). That process is no worker: it ends as a Python program ends at its top level
    (0 on a return; a SystemExit's code; else 1, the traceback on stderr) and writes nothing to
    the pool's memory. Going on, it reported the task as done in the worker's place (its value,
    or its SystemExit, became the task's outcome), then ran the worker's loop beside it, and the
    worker's own report found its run stack popped: an internal error, a broken pool."""
    code: int = 0
    try:
        if isinstance(exc, SystemExit):
            if isinstance(exc.code, int):
                code = exc.code
            elif exc.code is not None:  # sys.exit("message"), as the interpreter does
                code = 1
                print(exc.code, file=sys.stderr)
        elif exc is not None:
            import traceback  # here, not at the top: see _protocol.dump_exception

            code = 1
            traceback.print_exception(exc)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    except BaseException:  # a task may have taken stdout or stderr away
        pass
    end_process(code)


# An exception that mpsched's own code inside a task did not raise: a Python signal handler that
# the task installed, raising as its alarm fires (a common way to bound a run's time), or a
# RecursionError or MemoryError at a mpsched frame. Raised on into the task from the middle of
# a join (a child claimed onto the run stack and never run, a slot lock taken), it broke the
# pool later, at the next top-level completion ("not the innermost running task").
_INTERRUPTED = (
    "an exception that mpsched did not raise (a signal handler's, that a task installed?) "
    "interrupted mpsched's own code in a task, in {}"
)
# A task closed or replaced (os.close, os.dup2, os.closerange) a wake-up eventfd of the worker:
# reading its own raised in the loop, which broke the pool as an internal error; writing a
# peer's raised into the task, and that peer, asleep in a join, was never woken (a hang).
WAKE_FD_FAILED = "a wake-up file descriptor failed: a task closed or replaced it"


def write_wake(fd: int) -> None:
    """Wake the worker whose eventfd is ``fd`` (its sleeping flag cleared by the caller).

    Checked to be an eventfd still (every eventfd is the same anonymous inode): a task that had
    put a file in place of a peer's eventfd (``os.close`` then ``open``, or ``os.dup2``) got 8
    bytes written into its file at each wake-up, which succeeded, and the peer slept on (found
    in review). ~1.5 us, only when a peer sleeps (its wake-up takes far longer)."""
    try:
        status = os.fstat(fd)
        if (status.st_dev, status.st_ino) != eventfd_inode:
            raise OSError(f"fd {fd} is no longer an eventfd ({os.readlink(f'/proc/self/fd/{fd}')})")
        os.eventfd_write(fd, 1)
    except OSError as exc:
        abandon_worker(exc, WAKE_FD_FAILED)


eventfd_inode = (0, 0)  # (st_dev, st_ino) of every eventfd here; set as the worker starts


# A worker's children (their deque, blocks and futures) are the state of the thread that runs
# its tasks, unlocked on its side: from another thread of a task, a submit or a join raced it
# (InternalError "not the innermost running task": a broken pool; or a join asleep for good).
_OFF_THREAD = (
    "{} only works in the thread that runs the task (a worker's children and their futures "
    "belong to it), not in another thread the task started: submit and join the children "
    "there, and pass their results to the other threads"
)


def submit(fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> ChildFuture[_T]:
    """Inside a task: run ``fn(*args, **kwargs)`` as a child task on this worker's own deque.

    The child may be stolen by an idle worker. ``result()`` on the returned future runs other
    children while it waits (join-helping), so recursive fork-join finishes even with one
    worker.

    Raises:
        RuntimeError: called outside a task running in an mpsched pool (use ``Pool.submit``),
            or in another thread than the task's.
        TypeError: ``fn`` is not callable.
        TaskPicklingError: the function or an argument cannot be pickled.
    """
    worker = _current
    if worker is None:
        raise RuntimeError(
            "mpsched.submit() only works inside a task running in an mpsched pool; "
            "outside one, use pool.submit()"
        )
    if get_ident() != worker.thread:
        raise RuntimeError(_OFF_THREAD.format("mpsched.submit()"))
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
    if worker is not None:
        contexts = worker.contexts
        # From a thread the task started: the worker's outermost run, not its innermost (a
        # thread that asked while its task joined a child got the child's context: no id,
        # never flagged; found in review). IndexError: the task ended meanwhile.
        try:
            entry = contexts[-1] if get_ident() == worker.thread else contexts[0]
        except IndexError:
            pass
        else:
            if len(entry) == 2:  # handed out: its run's end keeps the flag (see TaskContext)
                entry.append(True)
            return TaskContext(worker.slot, worker.slab, entry)
    raise RuntimeError("mpsched.current_task() only works inside a task running in a pool")


class TaskContext:
    """What a running task knows about itself (``mpsched.current_task()``).

    Attributes:
        task_id: the id given to ``pool.schedule``; None for ``submit``/``map`` tasks and
            children.
        version: the version of ``task_id`` this run belongs to (0 without an id).
        worker_id: the slot of the worker running the task (0 .. workers - 1).
    """

    __slots__ = ("_entry", "_slab", "task_id", "version", "worker_id")

    def __init__(self, worker_id: int, slab: Any, entry: list[Any]) -> None:
        meta = entry[1]
        self.worker_id = worker_id
        self.task_id: Hashable | None = meta[0] if meta else None
        self.version: int = meta[1] if meta else 0
        self._slab = slab
        # The worker's entry for the run: [the block's handle (-1 for a child: nobody can
        # cancel a child by id; ENDED or ENDED_CANCEL_REQUESTED once the run ended), meta,
        # True once a context was handed out]. A context holds the entry, not the handle: kept
        # past its run (in a global, or by a thread the task started), it read the block's
        # word, which a later task owned by then, and reported that task's flag (found in
        # review).
        self._entry = entry

    @property
    def cancel_requested(self) -> bool:
        """True once ``pool.cancel(task_id)`` (or the task's timeout) asked this run to stop.
        Reads one word of shared memory: cheap enough to poll in a loop. Once the run ended,
        its flag as it was then. Always False in a child (``mpsched.submit``): a cancel of its
        parent does not reach it (a child may outlive its parent, whose block is then reused);
        pass it what it needs to stop."""
        entry = self._entry
        handle: int = entry[0]
        if handle >= 0:
            requested: bool = self._slab.get_word(handle, _STATE) == _CANCEL_REQUESTED
            # Still the run's handle: the run had not ended when the word was read, so the
            # block was still its (it is freed only after the result it writes next).
            if entry[0] == handle:
                return requested
            handle = entry[0]
        return handle == ENDED_CANCEL_REQUESTED

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


_NOT_WAITABLE = (
    "a child task's future cannot be waited on by concurrent.futures.wait or as_completed "
    "(such a wait runs no other child meanwhile: a pool of one worker would wait for ever); "
    "join it with result() or exception(), which run other children while they wait"
)


class ChildFuture(_Generic[_T]):
    """The future of a child task (``mpsched.submit``); lives in the spawning worker only.

    ``result()`` and ``exception()`` help: while the child is not done, this worker runs other
    children (its own deque first, where the child most likely still is; never a top-level
    task: see ``Children.join``). Only for the thread that
    runs the task (RuntimeError in another: ``_OFF_THREAD``; once settled, any thread may read
    it), and not picklable: it refers to a block of this pool's shared memory.

    It has the query methods of ``concurrent.futures.Future`` (``done``, ``running``,
    ``cancelled``, ``cancel``, ``result``, ``exception``) but no callbacks. A child cannot be
    cancelled: ``cancel()`` always returns False and ``cancelled()`` is always False. (A queued
    child sits in the middle of this worker's deque, which only gives up its ends, and a peer
    may steal it at any moment; withdrawing it safely would need a claim protocol like the
    top-level tasks' inbox cancel.) To stop caring about a child, drop its future: a child
    nobody waits for still runs, and its result is discarded.
    """

    __slots__ = ("__weakref__", "_error", "_error_data", "_handle", "_settled", "_value", "_worker")

    def __init__(self, worker: Children, handle: int) -> None:
        self._worker = worker
        self._handle = handle  # -1 once settled
        self._settled = False
        self._value: Any = None
        self._error: BaseException | None = None  # what exception() returns; never raised
        # The child's pickled error: result() raises a fresh copy of it (see result()).
        self._error_data: bytes | None = None

    @property
    def _condition(self) -> NoReturn:
        """What ``concurrent.futures.wait`` and ``as_completed`` take first: say why a child's
        future is not for them (they failed on a missing attribute)."""
        raise TypeError(_NOT_WAITABLE)

    @classmethod
    def settled(cls, worker: Children, value: Any, error: bytes | None) -> ChildFuture[Any]:
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
        """Whether the child has ended (returned or raised); never blocks."""
        if not self._settled:
            self._check_thread("ChildFuture.done()")
            if self._worker.child_state(self._handle) == CHILD_DONE:
                self._settle("ChildFuture.done()")
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

    def result(self, timeout: float | None = None) -> _T:
        """The child's return value; re-raises its exception. Runs other children meanwhile.

        The exception raised is a new copy at each call (equal type and arguments, not the
        object ``exception()`` returns): the raise gives it a traceback holding the caller's
        frame, and a copy this future kept would close a reference cycle through that frame,
        keeping the caller's other child futures alive, and their blocks taken, until a
        garbage collection (docs/design.md, "Dropped child futures").

        ``timeout`` is checked between the tasks this worker runs while it waits, not during
        them: most often it runs the awaited child itself, so the wait can last as long as the
        child (docs/design.md, "Futures", known gap). A ``timeout`` that is no number raises
        TypeError, NaN ValueError; infinite is no limit."""
        self._wait(timeout)
        if self._error_data is not None:
            raise load_exception(self._error_data)
        return self._value  # type: ignore[no-any-return]  # the child returned it

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The child's exception, or None if it returned; waits as ``result`` does."""
        self._wait(timeout)
        return self._error

    def _wait(self, timeout: float | None) -> None:
        if not self._settled:
            self._check_thread("a child's result() or exception()")
            if timeout is not None:  # a bad one fails here, in the task: see wait_seconds
                timeout = wait_seconds(timeout)
            worker = self._worker
            try:
                done = worker.join(self, timeout)
            except BaseException as exc:
                # Raised in the join's sleep, which it left cleanly (``Worker.idle``), it goes
                # on into the task, as it would have without the join. Else see _INTERRUPTED.
                if exc is not worker.interrupted_sleep:
                    abandon_worker(exc, _INTERRUPTED.format("a join"))
                worker.interrupted_sleep = None
                raise
            if not done:
                raise timeout_error("the child task did not finish in time")
            self._settle("a join")

    def _check_thread(self, what: str) -> None:
        """RuntimeError unless called in the thread that runs the tasks (``_OFF_THREAD``)."""
        if get_ident() != self._worker.thread:
            raise RuntimeError(_OFF_THREAD.format(what))
        if self._worker.forked_child:  # a process forked by a task: not the deque's owner
            raise RuntimeError(f"{what} does not work in a process forked by a task")

    def _settle(self, where: str) -> None:
        """Read the done child's outcome and free its block."""
        try:
            status, value = self._worker.collect_child(self._handle)
        except BaseException as exc:
            abandon_worker(exc, _INTERRUPTED.format(where))
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


class Children:
    """The children part of ``Worker`` (see the module docstring). Methods run in the worker
    process's main thread only."""

    if TYPE_CHECKING:  # Worker's attributes (Worker.__init__) and methods this part uses
        slot: int
        thread: int
        me: SlotQueues
        slots: tuple[SlotQueues, ...]
        slab: Slab
        header: GlobalHeader
        wake_fds: list[int]
        fid_of: dict[Callable[..., Any], int]
        abandoned: list[int]
        unsettled: int
        depth: int
        contexts: list[list[Any]]
        uid_base: int
        stash_counter: int
        interrupted_sleep: BaseException | None
        peers_dormant: bool
        forked_child: bool

        def find_child_work(self) -> int: ...
        def want_peers(self) -> None: ...
        def run(self, handle: int, recorded: bool = True) -> None: ...
        def load_function(self, fid: int) -> Callable[..., Any]: ...
        def idle(
            self, awaited: int | None, deadline: float | None = None, steal: bool = True
        ) -> None: ...
        def stash(self, data: bytes, handle: int, field: int) -> int: ...
        def fetch(self, key: int) -> Buffer: ...
        def wake_one_sleeper(self) -> None: ...

    def spawn(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> ChildFuture[Any]:
        try:
            fid = self.fid_of.get(fn, INLINE)
        except Exception:  # unhashable (its hash raises, e.g. a frozen dataclass with a list)
            fid = INLINE  # (checking __hash__ for None let those through: TypeError here)
        payload = encode_call(fid, None if fid != INLINE else fn, args, kwargs)
        if self.peers_dormant:  # no peer to steal the child yet: ask for them, once
            self.want_peers()
        if self.depth >= MAX_NESTING - 1:
            # join() stops helping at this depth (the run stack is full): a child pushed now
            # would wait in our own deque for a joiner that never runs it, and with no idle
            # peer to steal it (Pool(1)) forever. Run it inline, as when the deque is full.
            return self.run_inline(payload)
        slab = self.slab
        try:  # shared state from here on: see _INTERRUPTED
            handle = slab.alloc(self.next_uid())  # the block names us from its allocation on
            if handle >= 0:
                stashed = 0
                if not slab.write_child(handle, payload, self.slot, CHILD_QUEUED):
                    slab.write_child(handle, b"", self.slot, CHILD_QUEUED)
                    stashed = self.stash(payload, handle, _NBYTES)
                self.header.add_live_children(1)
                if self.me.push(handle):
                    if self.header.sleepers():
                        self.wake_one_sleeper()
                    self.unsettled += 1
                    return ChildFuture(self, handle)
                # The deque is full.
                self.header.add_live_children(-1)
                if stashed:  # only a FETCH empties the coordinator's stash: drop them so,
                    # before the free: until then the block names the key to the crash
                    # recovery (an unpublished child), which drops it (freed first, a death
                    # before the FETCH left the bytes in the stash, named by no block)
                    self.fetch(stashed)
                    slab.set_word(handle, _NBYTES, 0)
                slab.free_children([handle])
        except BaseException as exc:
            abandon_worker(exc, _INTERRUPTED.format("mpsched.submit()"))
        # The slab or the deque is full: run the child here and now (rayon runs inline too).
        return self.run_inline(payload)

    def run_inline(self, payload: bytes) -> ChildFuture[Any]:
        # Decoding runs user code (the arguments' unpickling, the function's import): its
        # error is the child's, as when a peer runs it (it escaped from mpsched.submit).
        contexts = self.contexts
        pushed = raised = False
        try:
            fid, fn, args, kwargs, _ = decode_call(payload)
            if fid != INLINE:
                fn = self.load_function(fid)
            # A child's context, as in run(): current_task() in the child reported the
            # parent's id and version, and its cancel flag (a child has none).
            contexts.append([-1, False])
            pushed = True
            sys.setrecursionlimit(sys.getrecursionlimit() + INLINE_FRAMES)
            raised = True
            value = fn(*args, **kwargs)
            if self.forked_child:
                end_forked_child(None)
        except BaseException as exc:  # user code: reported as a child's error is
            if self.forked_child:
                end_forked_child(exc)
            return ChildFuture.settled(self, None, dump_exception(exc))
        finally:
            if pushed:
                contexts.pop()
            # Counted as a peer's run of a child is (statistics' executed counts every
            # child): uncounted, a deep chain or a full deque made the per-worker counts
            # fall short of what ran.
            self.me.count_inline_run()
            # Last, with no Python call (a helper's frame, or contextlib.suppress's __enter__,
            # at the limit's depth raised RecursionError instead of lowering it: it crept up).
            if raised:
                try:  # noqa: SIM105
                    sys.setrecursionlimit(sys.getrecursionlimit() - INLINE_FRAMES)
                except RecursionError:  # the task set a limit under this depth: leave it
                    pass
        return ChildFuture.settled(self, value, None)

    def finish_child(self, handle: int, parent: int, recorded: bool = True) -> None:
        """Executor of a child: publish DONE under the parent's slot lock and wake the parent.

        The run-stack pop happens in the same lock hold (``finished_by``): the parent frees
        the block only after confirming DONE under that lock, so a handle is never both on a
        run stack and free (the uniqueness crash repair relies on). A child run unrecorded
        (past the helping depth, see ``join``) has no record to pop.

        An ABANDONED child stays ABANDONED (``unless``): this worker frees it, and DONE would
        tell the crash recovery of a dead parent (``orphan_children``) that the block is the
        parent's to free, so that it freed it too (a double free) while this worker was
        between the exchange and its free. In the same hold the block's uid becomes this
        worker's (``taker``): the recovery of the parent no longer takes it for the parent's,
        and that of this worker, dying before its free commits, finds it (an ABANDONED block
        in no ring and on no run stack is its uid's to free).
        """
        if not recorded:
            self.me.count_inline_run()
        previous = self.slots[parent].exchange_block_state(
            self.slab,
            handle,
            CHILD_DONE,
            finished_by=self.me if recorded else None,
            unless=CHILD_ABANDONED,
            taker=self.uid_base,
        )
        self.header.add_live_children(-1)
        if previous == CHILD_ABANDONED:
            self.free_unread_child(handle)
        elif self.slots[parent].clear_sleeping():
            write_wake(self.wake_fds[parent])

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
        data: Buffer
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

    def join(self, future: ChildFuture[Any], timeout: float | None) -> bool:
        """Help until ``future``'s child is done (True) or ``timeout`` passed (False): run
        other children (from the own deque, or stolen from a peer's), or sleep until woken.
        It raises nothing of its own (``_wait`` tells an exception from it for an interrupt).

        Never a top-level task from an inbox, as Java's ForkJoinPool never runs an external
        submission inside a join: run nested above the waiting task, an unrelated task that
        waited for that task's progress (a later task joining a child future the waiting
        task keeps, or polling for what it writes after its join) waited for ever, and so
        did the pool's shutdown; and a top-level task's forced timeout or cancel, which kills
        its worker, killed the task it was nested in. Its peers take those (see ``idle``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        handle = future._handle
        # Past the helping depth the run stack takes no more claims, and this worker's own
        # children run unrecorded instead: left in the own deque, one that the joined task
        # waits for (a sibling's future kept in a global: a memo of futures) waited for ever
        # with no idle peer to steal it (Pool(1)), the worker spinning. Only its own: a death
        # loses them with their parent, and the recovery frees a block of a dead parent that
        # is in no ring and on no run stack (``orphan_children``). A peer's child, stolen so,
        # would be lost to the peer's task that waits for it.
        recorded = self.depth < MAX_NESTING - 1
        while self.child_state(handle) != CHILD_DONE:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            found = self.find_child_work() if recorded else self.me.pop_or_take(False, False)
            if found >= 0:
                sys.setrecursionlimit(sys.getrecursionlimit() + JOIN_FRAMES)
                try:
                    self.run(found, recorded)
                finally:  # as in run_inline: no Python call
                    try:  # noqa: SIM105
                        sys.setrecursionlimit(sys.getrecursionlimit() - JOIN_FRAMES)
                    except RecursionError:
                        pass
                if self.abandoned:
                    self.release_abandoned()
            else:
                self.idle(handle, deadline, recorded)
        return True

    def next_uid(self) -> int:
        # The counter wraps within its 31 bits: past them it spilled into the pid's bits, and
        # the crash recovery, which finds a dead worker's children and stashed bytes by
        # ``uid >> 31 == pid``, missed them (after 2**31 spawns in one worker's life).
        self.stash_counter = counter = (self.stash_counter + 1) & UID_COUNTER_MASK
        return self.uid_base | counter
