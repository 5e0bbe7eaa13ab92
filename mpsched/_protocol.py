"""Messages over the pool's pipes: tags, framing, encode/decode. No policy.

Two kinds of channel carry them, both ``multiprocessing.connection.Connection`` over a Unix socket
pair (so file descriptors can travel beside them with ``send_handle``):

* coordinator <-> zygote: one per pool, for the lifetime of the pool;
* coordinator <-> worker: one per worker *incarnation* (a replacement gets a fresh one, so a worker
  that died mid-write can never leave a torn frame in front of its successor's messages).

Every frame is ``send_bytes(pickle.dumps((tag, *fields)))``. Task payloads travel in shared memory
(``_payloads``), never here, except payloads and results too big for a slab block (STASH).

| tag      | direction      | when sent                          | receiver must                   |
|----------|----------------|------------------------------------|---------------------------------|
| READY    | zygote -> coord| zygote opened locks and segment;   | unlink the semaphore names;     |
|          |                | with the names in its ``__main__`` | note them (stand-ins)           |
| SPAWN    | coord -> zygote| a worker slot needs a process      | fork a worker, answer SPAWNED   |
| SPAWNED  | zygote -> coord| after fork; the socket fd follows  | ``recv_handle`` the worker end  |
| EXITED   | zygote -> coord| a worker was reaped                | record the exit code            |
| STOP     | coord -> zygote| shutdown: no more spawns           | reap its children, exit         |
| RESULTS  | worker -> coord| a batch done, or the worker idle   | drain the worker's done ring    |
| STASH    | worker -> coord| bytes too big for a slab block     | keep them under their key       |
| FETCH    | worker -> coord| a claimed task's bytes are stashed | answer PAYLOAD (now or on STASH)|
| PAYLOAD  | coord -> worker| answer to FETCH                    | (the worker is blocked on it)   |
| DRAIN    | coord -> worker| shutdown: all work done            | answer DRAINED, exit            |
| DRAINED  | worker -> coord| last message of a worker           | join the worker                 |
| FATAL    | worker -> coord| an mpsched bug inside the worker   | break the pool                  |

Unknown tags and short reads raise ``ProtocolError``; the coordinator turns it into a broken pool.
A remote exception travels as ``(pickled exception, formatted traceback)`` and is re-raised
locally with ``__cause__ = RemoteTraceback(text)`` (CPython ``_ExceptionWithTraceback``); one that
cannot be unpickled is replaced by a RuntimeError with that same cause.
"""

from __future__ import annotations

import enum
import pickle

from mpsched._errors import ProtocolError

# typing.TYPE_CHECKING without importing typing at run time (why: mpsched/__init__.py).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

PICKLE_PROTOCOL = 5  # out-of-band capable; the newest every supported Python reads


class Tag(enum.IntEnum):
    READY = 1
    SPAWN = 2
    SPAWNED = 3
    EXITED = 4
    STOP = 5
    RESULTS = 10
    STASH = 11
    FETCH = 12
    PAYLOAD = 13
    DRAIN = 14
    DRAINED = 15
    FATAL = 16
    INIT_FAILED = 17  # worker -> coordinator: the pool's initializer raised (exception bytes)
    # worker -> coordinator: max_tasks_per_worker reached; it exits cleanly next. Field: how many
    # of its children's futures were still unsettled (the coordinator frees those blocks).
    RETIRING = 18


class ResultStatus(enum.IntEnum):
    """How a task ended, in a RESULTS entry or a child's block."""

    OK = 0  # payload is the pickled return value
    ERROR = 1  # payload is a pickled (exception, traceback text) pair
    CANCELLED = 2  # the task raised TaskCancelled; payload as for ERROR


class ChildState(enum.IntEnum):
    """A child task's block ``state`` word, written under the *parent's* slot lock."""

    QUEUED = 1  # pushed; not finished
    DONE = 2  # result written; the parent reads it and frees the block
    # The parent dropped its future; whoever sees the second of DONE/ABANDONED frees. An executor
    # that finishes an ABANDONED child leaves it ABANDONED (DONE: the parent's to free).
    ABANDONED = 3


class TopState(enum.IntEnum):
    """A top-level task's block ``state`` word: the coordinator's cancel request to a running
    task, read by the worker without a round trip (``current_task().cancel_requested``).
    Written only by the coordinator thread, and only while the task's future is unsettled (so
    the block is still that task's: the coordinator frees top-level blocks itself)."""

    PLAIN = 0  # written by inject
    CANCEL_REQUESTED = 1  # pool.cancel(task_id) or a timeout asked the running task to stop


def encode(tag: Tag, *fields: Any) -> bytes:
    return pickle.dumps((int(tag), *fields), PICKLE_PROTOCOL)


def decode(frame: bytes) -> tuple[Tag, tuple[Any, ...]]:
    try:
        msg = pickle.loads(frame)
        return Tag(msg[0]), msg[1:]
    except Exception as exc:
        raise ProtocolError(f"malformed frame of {len(frame)} bytes: {exc!r}") from exc


class RemoteTraceback(Exception):
    """The formatted traceback of an exception raised in a worker; set as its ``__cause__``."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


def dump_exception(exc: BaseException) -> bytes:
    """Pickle ``exc`` with its traceback text, as ``(pickled exc, text)``: the exception nested
    as bytes, so that the text survives an exception that cannot be unpickled (it was lost with
    it). Plain pickle first, cloudpickle where it cannot. An exception that cannot be pickled
    (its ``__reduce__`` may even raise SystemExit) is replaced by a RuntimeError that says so
    and carries its repr, or its type name if the repr fails too: a hostile exception never
    takes the worker down."""
    try:
        # Imported here: traceback (with linecache, tokenize, textwrap) costs a few ms, which a
        # worker should pay at its first error, not every process at start-up.
        import traceback

        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    except BaseException:  # user code (__str__) ran in there
        tb = f"{type(exc).__qualname__} (its traceback could not be formatted)"
    tb = f'\n"""\n{tb}"""'
    try:
        pickled = pickle.dumps(exc, PICKLE_PROTOCOL)
    except BaseException:
        pickled = b""
    try:
        if not pickled:
            # As for a result (``_serialize.dumps``): a class plain pickle cannot name (a local
            # one, or one of ``__main__`` that the worker's lacks) goes by value. Imported
            # here: only such an error pays for it.
            import cloudpickle

            pickled = cloudpickle.dumps(exc, PICKLE_PROTOCOL)
    except BaseException as pickling_error:
        substitute = RuntimeError(
            f"the task raised {safe_repr(exc)}, which could not be pickled to send it back "
            f"({safe_repr(pickling_error)})"
        )
        pickled = pickle.dumps(substitute, PICKLE_PROTOCOL)
    return pickle.dumps((pickled, tb), PICKLE_PROTOCOL)


def safe_repr(obj: object) -> str:
    """``repr(obj)``, or its type's name if that raises (a repr is user code: in an error
    message it must not replace the error)."""
    try:
        return repr(obj)
    except BaseException:
        return f"<{type(obj).__qualname__} object (repr failed)>"


def load_exception(data: bytes) -> BaseException:
    """Rebuild an exception made by ``dump_exception`` with the remote traceback as its cause.
    One that cannot be rebuilt, or that ``__reduce__`` rebuilds as something other than an
    exception, is replaced by a RuntimeError that says so, with the same cause: this runs in
    the coordinator thread (and in a joining worker), which an error escaping here broke (and
    the future hung)."""
    try:
        pickled, tb = pickle.loads(data)  # bytes and str: no user code, only a bug fails here
    except Exception as error:
        return RuntimeError(f"the task's exception could not be read: {error!r}")
    cause = RemoteTraceback(tb)
    try:
        exc = pickle.loads(pickled)
        if not issubclass(type(exc), BaseException):  # type(): __class__ can lie
            raise TypeError(f"unpickled as {type(exc).__qualname__}, not an exception")
        exc.__cause__ = cause
    except BaseException as unpickling_error:  # user code (__setstate__, __reduce__) ran
        exc = RuntimeError(
            f"the task's exception could not be unpickled: {safe_repr(unpickling_error)}"
        )
        exc.__cause__ = cause
    return exc  # type: ignore[no-any-return]


def unpickling_failed(error: BaseException) -> RuntimeError:
    """The error of a task whose result pickled but could not be unpickled (``error``)."""
    return RuntimeError(f"the task's result could not be unpickled: {safe_repr(error)}")
