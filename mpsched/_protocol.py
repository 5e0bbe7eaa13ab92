"""Messages over the pool's pipes: tags, framing, encode/decode. No policy.

Two kinds of channel carry them, both ``multiprocessing.connection.Connection`` over a Unix socket
pair (so file descriptors can travel beside them with ``send_fd``):

* coordinator <-> zygote: one per pool, for the lifetime of the pool;
* coordinator <-> worker: one per worker *incarnation* (a replacement gets a fresh one, so a worker
  that died mid-write can never leave a torn frame in front of its successor's messages).

Every frame is ``send_bytes(pickle.dumps((tag, *fields)))``, but for the two that carry a task's
bytes: task payloads travel in shared memory (``_payloads``), never here, except payloads and
results too big for a slab block (STASH and its answer PAYLOAD). Those are *raw* frames
(``send_data``): the same length prefix as ``Connection.send_bytes``, then ``_RAW_HEADER`` (a 0
byte, where a pickle starts with PROTO, the tag, the key) and the bytes themselves, written with
one ``writev`` from the object that holds them and read (``recv_message``) into one buffer of
their size. Pickled, each MiB was copied once more on each side, and ``Connection.recv_bytes``
reads a big frame in chunks into fresh buffers: the pool's process spent ~2.5 ms of CPU per MiB
of arguments, against ProcessPoolExecutor's ~0.9 (measured, docs/design.md "Big payloads").

| tag      | direction      | when sent                          | receiver must                   |
|----------|----------------|------------------------------------|---------------------------------|
| READY    | zygote -> coord| zygote opened locks and segment;   | unlink the semaphore names;     |
|          |                | with the names in its ``__main__`` | note them (stand-ins)           |
| START    | coord -> zygote| the pool's first task (forkserver, | import its function's module,   |
|          |                | spawn; no initializer), or drain   | then fork the initial workers   |
| SPAWN    | coord -> zygote| a worker slot needs a process      | fork a worker, answer SPAWNED   |
|          |                | (with: are other slots dormant)    | (the worker gets the flag)      |
| SPAWNED  | zygote -> coord| after fork; the socket fd follows  | ``recv_fd`` the worker end      |
| EXITED   | zygote -> coord| a worker was reaped                | record the exit code            |
| STOP     | coord -> zygote| shutdown: no more spawns           | reap its children, exit         |
| RESULTS  | worker -> coord| a batch done, or the worker idle   | drain the worker's done ring    |
| STASH    | worker -> coord| bytes too big for a slab block     | keep them under their key       |
| FETCH    | worker -> coord| a claimed task's bytes are stashed | answer PAYLOAD (now or on STASH)|
| PAYLOAD  | coord -> worker| answer to FETCH                    | (the worker is blocked on it)   |
| DRAIN    | coord -> worker| shutdown: all work done            | answer DRAINED, exit            |
| DRAINED  | worker -> coord| last message of a worker           | join the worker                 |
| FATAL    | worker -> coord| an mpsched bug inside the worker   | break the pool                  |
| WANT_PEERS| worker -> coord| its first child, peers dormant    | SPAWN every dormant slot        |

Unknown tags and short reads raise ``ProtocolError``; the coordinator turns it into a broken pool.
A remote exception travels as ``(pickled exception, formatted traceback)`` and is re-raised
locally with ``__cause__ = RemoteTraceback(text)`` (CPython ``_ExceptionWithTraceback``); one that
cannot be unpickled is replaced by a RuntimeError with that same cause.
"""

from __future__ import annotations

import array
import contextlib
import functools
import os
import pickle
import select
import signal
import socket
import struct
from collections.abc import Iterator

from mpsched._constants import Constants
from mpsched._errors import ProtocolError, TaskOutcomeError

# typing.TYPE_CHECKING without importing typing at run time (why: mpsched/__init__.py).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from multiprocessing.connection import Connection
    from typing import Any, Final, NoReturn

PICKLE_PROTOCOL = 5  # out-of-band capable; the newest every supported Python reads
# Characters of a task's traceback text that travel (``dump_exception``): past this, its first
# and last halves, the middle left out. A task that re-raises a child's error embeds the child's
# whole text in its own (the child's RemoteTraceback is the cause), so a chain of nested tasks
# sent text that grew with the square of its depth: 900 levels made 517 KB at the top and took
# 3.3 s to propagate. The first half holds the root error, the last the outer frames; one task's
# traceback, however deep its recursion (Python folds repeated lines), is far shorter.
TRACEBACK_TEXT_MAX = 32 * 1024
# A worker's exit code after user code raised outside any task (a signal handler a task left
# installed, a finalizer) into the worker's own code: it exits as if killed there (the crash
# recovery covers every point), after printing the traceback, and is replaced; the coordinator
# names the code in the crash's message. 70 (EX_SOFTWARE) is an mpsched bug: the pool breaks.
USER_ERROR_EXIT = 75
MPSCHED_BUG_EXIT = 70


class Tag(Constants):
    READY: Final = 1
    SPAWN: Final = 2
    SPAWNED: Final = 3
    EXITED: Final = 4
    STOP: Final = 5
    START: Final = 6
    RESULTS: Final = 10
    STASH: Final = 11
    FETCH: Final = 12
    PAYLOAD: Final = 13
    DRAIN: Final = 14
    DRAINED: Final = 15
    FATAL: Final = 16
    # worker -> coordinator: the pool's initializer raised (field: the exception's bytes)
    INIT_FAILED: Final = 17
    # worker -> coordinator: max_tasks_per_worker reached; it exits cleanly next. Field: how many
    # of its children's futures were still unsettled (the coordinator frees those blocks).
    RETIRING: Final = 18
    # worker -> coordinator: it pushed a child while its peers were dormant (not forked yet):
    # fork them, so that they can steal (sent once, by a worker forked with peers dormant).
    WANT_PEERS: Final = 19
    # zygote -> coordinator, instead of SPAWNED: the worker could not be forked for now
    # (fields: slot, the error's text).
    SPAWN_FAILED: Final = 20


class ResultStatus(Constants):
    """How a task ended, in a RESULTS entry or a child's block."""

    OK: Final = 0  # payload is the pickled return value
    ERROR: Final = 1  # payload is a pickled (exception, traceback text) pair
    CANCELLED: Final = 2  # the task raised TaskCancelled; payload as for ERROR
    # A recurring run that its worker claimed after its misfire deadline (the policy "skip"):
    # dropped unstarted, its function never called; payload empty.
    MISFIRED: Final = 3


class ChildState(Constants):
    """A child task's block ``state`` word, written under the *parent's* slot lock."""

    QUEUED: Final = 1  # pushed; not finished
    DONE: Final = 2  # result written; the parent reads it and frees the block
    # The parent dropped its future; whoever sees the second of DONE/ABANDONED frees. An executor
    # that finishes an ABANDONED child leaves it ABANDONED (DONE: the parent's to free).
    ABANDONED: Final = 3


class TopState(Constants):
    """A top-level task's block ``state`` word: the coordinator's cancel request to a running
    task, read by the worker without a round trip (``current_task().cancel_requested``).
    Written only by the coordinator thread, and only while the task's future is unsettled (so
    the block is still that task's: the coordinator frees top-level blocks itself)."""

    PLAIN: Final = 0  # written by inject
    CANCEL_REQUESTED: Final = 1  # pool.cancel(task_id) or a timeout asked the running task to stop


def encode(tag: int, *fields: Any) -> bytes:
    return pickle.dumps((tag, *fields), PICKLE_PROTOCOL)


# The data of a raw frame as received: bytes if small, else the buffer they were read into.
Buffer = bytes | bytearray

# multiprocessing.connection's framing (3.8+): a signed length, or -1 and an unsigned 8-byte one
# for frames past 2 GiB. recv_message reads frames that Connection.send_bytes wrote.
_LENGTH = struct.Struct("!i")
_LONG_LENGTH = struct.Struct("!Q")
_LENGTH_MAX = 0x7FFFFFFF
# A raw frame's header: _RAW_MARK, the tag, the key; the data follow.
_RAW_HEADER = struct.Struct("!BBq")
_RAW_MARK = 0  # a pickled frame starts with PROTO (0x80)
# Frames up to this size (bytes) are read with one read; larger ones read their first bytes,
# then a raw frame's data straight into a buffer of their size. 16 KiB: past every frame but
# a stash's, whose data is longer than a slab chain's ~60 KiB unless the slab ran short.
_SMALL_FRAME = 1 << 14
SKIP_CHUNK = 1 << 20  # bytes read at a time past a frame that does not fit in memory


@contextlib.contextmanager
def sigpipe_blocked() -> Iterator[None]:
    """SIGPIPE blocked in this thread around a write of the pool's process to a child's
    socket. A write to the socket of a child that died raises SIGPIPE in the writing thread:
    ignored by Python's default, it killed a program that had set its default action back (as
    command-line tools do, for ``| head``), silently, where the pool meant to fail one task or
    break (found by a review). Blocked, the write fails with EPIPE; the signal then pending in
    the thread is taken before the mask is put back (unblocked, it would be delivered at once).
    Around each write, not for the coordinator thread's life: a thread it starts (the
    callbacks' runner) inherited the mask, and programs those threads started inherited it
    through exec (``yes | head`` then ended with an error, not SIGPIPE). Three system calls a
    write; the writes are rare (a worker's spawn, a big argument, the drain, START)."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGPIPE})
    try:
        yield
    finally:
        if signal.SIGPIPE not in before:
            while signal.sigtimedwait({signal.SIGPIPE}, 0) is not None:
                pass
            signal.pthread_sigmask(signal.SIG_SETMASK, before)


def send_data(conn: Connection, tag: int, key: int, data: Buffer) -> None:
    """Send ``data`` under ``key`` as a raw frame (see the module doc): the bytes go from
    ``data`` to the socket without a copy in this process. Blocks until all is written, as
    ``send_bytes`` does; an error may leave a torn frame, as there (the reader's EOF or
    OSError ends the channel)."""
    size = _RAW_HEADER.size + len(data)
    if size > _LENGTH_MAX:
        prefix = _LENGTH.pack(-1) + _LONG_LENGTH.pack(size)
    else:
        prefix = _LENGTH.pack(size)
    parts = [memoryview(prefix + _RAW_HEADER.pack(_RAW_MARK, tag, key)), memoryview(data)]
    fd = conn.fileno()
    while parts:
        written = os.writev(fd, parts)
        while parts and written >= len(parts[0]):  # an empty part goes too
            written -= len(parts.pop(0))
        if written:
            parts[0] = parts[0][written:]


def recv_message(conn: Connection) -> tuple[int, tuple[Any, ...]]:
    """Read one frame from ``conn`` (pickled or raw) and decode it; a raw frame's data come
    back as a ``bytearray`` (``pickle.loads`` reads it as bytes). Raises as
    ``Connection.recv_bytes``: EOFError at the end of the channel, OSError at an end inside a
    frame."""
    fd = conn.fileno()
    (size,) = _LENGTH.unpack(_read(fd, _LENGTH.size))
    if size == -1:
        (size,) = _LONG_LENGTH.unpack(_read(fd, _LONG_LENGTH.size))
    if size <= _SMALL_FRAME:
        frame = _read(fd, size)
        if size >= _RAW_HEADER.size and frame[0] == _RAW_MARK:
            _, tag, key = _RAW_HEADER.unpack_from(frame)
            return Tag.check(tag), (key, frame[_RAW_HEADER.size :])
        return decode(frame)
    head = _read(fd, _RAW_HEADER.size)
    try:
        body = bytearray(size - _RAW_HEADER.size)
    except MemoryError:
        # A big result or argument that does not fit here: it broke the pool (the coordinator
        # thread's error). Read past it; its reader fails alone, with MemoryError (TooBig).
        _skip(fd, size - _RAW_HEADER.size)
        if head[0] != _RAW_MARK:
            raise
        _, tag, key = _RAW_HEADER.unpack(head)
        return Tag.check(tag), (key, pickle.dumps(TooBig(size - _RAW_HEADER.size)))
    _read_into(fd, body)
    if head[0] == _RAW_MARK:
        _, tag, key = _RAW_HEADER.unpack(head)
        return Tag.check(tag), (key, body)
    return decode(head + body)


def frame_watch(conn: Connection) -> Callable[[], list[tuple[int, int]]]:
    """Made once per connection: a check, true (a non-empty list) when a frame, or the end of
    the channel, can be read from ``conn`` at once. ``conn.poll()`` without
    ``multiprocessing.connection.wait``'s selector (~10 us), called at least twice per wake-up
    of the coordinator by a worker: 0.7 us here, where a poll object made and registered per
    check took 1.4."""
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN)
    return functools.partial(poller.poll, 0)


def _read(fd: int, size: int) -> bytes:
    """``size`` bytes from ``fd`` (one read when they are all there, as they mostly are)."""
    data = os.read(fd, size)
    if len(data) == size:
        return data
    if not data:
        raise EOFError
    rest = bytearray(size - len(data))
    _read_into(fd, rest)
    return data + rest


def _read_into(fd: int, buf: bytearray | memoryview) -> None:
    view = memoryview(buf)
    got = 0
    while got < len(buf):
        n = os.readv(fd, [view[got:]])
        if not n:
            raise OSError("got end of file during message")
        got += n


def _skip(fd: int, size: int) -> None:
    """Read ``size`` bytes from ``fd`` and drop them, ``SKIP_CHUNK`` at a time."""
    buf = bytearray(min(size, SKIP_CHUNK))
    while size > len(buf):
        _read_into(fd, buf)
        size -= len(buf)
    _read_into(fd, memoryview(buf)[:size])


class TooBig:
    """Stands for raw bytes that did not fit in this process's memory: whoever loads its pickle
    where it expected theirs (a result, a call) gets the MemoryError (``refuse_too_big``)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def __reduce__(self) -> tuple[Callable[[int], NoReturn], tuple[int]]:
        return refuse_too_big, (self.nbytes,)


def refuse_too_big(nbytes: int) -> NoReturn:
    raise MemoryError(
        f"{nbytes:,} bytes that another process of the pool sent (a task's result or "
        "arguments) did not fit in this process's memory"
    )


def decode(frame: bytes) -> tuple[int, tuple[Any, ...]]:
    try:
        msg = pickle.loads(frame)
        return Tag.check(msg[0]), msg[1:]
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
    """Pickle ``exc`` with its traceback text (at most ``TRACEBACK_TEXT_MAX`` characters), as
    ``(pickled exc, text)``: the exception nested as bytes, so that the text survives an
    exception that cannot be unpickled (it was lost with it). Plain pickle first, cloudpickle
    where it cannot. An exception that cannot be pickled (its ``__reduce__`` may even raise
    SystemExit) is replaced by a RuntimeError that says so and carries its repr, or its type
    name if the repr fails too: a hostile exception never takes the worker down."""
    try:
        # Imported here: traceback (with linecache, tokenize, textwrap) costs a few ms, which a
        # worker should pay at its first error, not every process at start-up.
        import traceback

        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    except BaseException:  # user code (__str__) ran in there
        tb = f"{type(exc).__qualname__} (its traceback could not be formatted)"
    if len(tb) > TRACEBACK_TEXT_MAX:
        half = TRACEBACK_TEXT_MAX // 2
        tb = f"{tb[:half]}\n[... {len(tb) - 2 * half:,} characters left out ...]\n{tb[-half:]}"
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
        substitute = TaskOutcomeError(
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


def load_exception(data: Buffer) -> BaseException:
    """Rebuild an exception made by ``dump_exception`` with the remote traceback as its cause.
    One that cannot be rebuilt, or that ``__reduce__`` rebuilds as something other than an
    exception, is replaced by a RuntimeError that says so, with the same cause: this runs in
    the coordinator thread (and in a joining worker), which an error escaping here broke (and
    the future hung)."""
    try:
        pickled, tb = pickle.loads(data)  # bytes and str: no user code, only a bug fails here
    except Exception as error:
        return TaskOutcomeError(f"the task's exception could not be read: {error!r}")
    cause = RemoteTraceback(tb)
    try:
        exc = pickle.loads(pickled)
        if not issubclass(type(exc), BaseException):  # type(): __class__ can lie
            raise TypeError(f"unpickled as {type(exc).__qualname__}, not an exception")
        exc.__cause__ = cause
    except BaseException as unpickling_error:  # user code (__setstate__, __reduce__) ran
        exc = TaskOutcomeError(
            f"the task's exception could not be unpickled: {safe_repr(unpickling_error)}"
        )
        exc.__cause__ = cause
    return exc  # type: ignore[no-any-return]


def unpickling_failed(error: BaseException) -> TaskOutcomeError:
    """The error of a task whose result pickled but could not be unpickled (``error``, its
    cause: where the user's ``__reduce__`` or ``__setstate__`` failed; a future's error said
    only its repr, found by a hunt). The cause's traceback starts below the frame that caught
    it, whose locals held the result's bytes for as long as the error lived."""
    failure = TaskOutcomeError(f"the task's result could not be unpickled: {safe_repr(error)}")
    if error.__traceback__ is not None:
        error.__traceback__ = error.__traceback__.tb_next
    failure.__cause__ = error
    return failure


def socket_of(conn: Connection) -> socket.socket:
    """A socket object on ``conn``'s fd (``detach()`` it after use: the fd stays ``conn``'s)."""
    sock = socket.socket(fileno=conn.fileno())
    # Blocking, as the Connection's fd is: under socket.setdefaulttimeout() the new object
    # would have made the shared file description non-blocking.
    sock.setblocking(True)
    return sock


def send_fd(conn: Connection, fd: int) -> None:
    """Send ``fd`` over ``conn`` beside its frames (``recv_fd`` takes it). As multiprocessing's
    ``send_handle``, without its duplicate of the socket: in a zygote at its open-file limit
    (under fork it has every fd of the pool's process) that duplicate failed with EMFILE, the
    zygote took it for the coordinator's end and exited, and the pool broke, saying that the
    zygote had died (found by a hunt)."""
    sock = socket_of(conn)
    try:
        send_fds(sock, [fd])
    finally:
        sock.detach()


def send_fds(sock: socket.socket, fds: list[int]) -> None:
    """``socket.send_fds(sock, [b"F"], fds)`` with MSG_NOSIGNAL: a peer gone is an EPIPE,
    not a SIGPIPE that kills a program that gave it its default action. 3.10-3.13's
    ``send_fds`` drops its ``flags`` argument, as ``recv_fds`` does (a diff review)."""
    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
    sock.sendmsg([b"F"], rights, socket.MSG_NOSIGNAL)


def recv_fds(sock: socket.socket, maxfds: int) -> tuple[bytes, list[int], int]:
    """``socket.recv_fds(sock, 1, maxfds)`` with the fds CLOEXEC (a later exec would leak
    them; ``os.fork()`` still inherits them): 3.10-3.13's ``recv_fds`` drops its ``flags``
    argument, so MSG_CMSG_CLOEXEC given there did nothing. Returns (message, fds, flags)."""
    fds = array.array("i")
    msg, ancdata, flags, _ = sock.recvmsg(
        1, socket.CMSG_LEN(maxfds * fds.itemsize), socket.MSG_CMSG_CLOEXEC
    )
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return msg, list(fds), flags


def recv_fd(conn: Connection) -> int:
    """The fd that ``send_fd`` sent, CLOEXEC. EOFError at EOF; RuntimeError if this process
    had no fd free for it (the kernel dropped it, as ``recv_handle`` would have said)."""
    sock = socket_of(conn)
    try:
        msg, fds, flags = recv_fds(sock, 1)
    finally:
        sock.detach()
    if flags & socket.MSG_CTRUNC or (msg and not fds):
        for fd in fds:
            os.close(fd)
        raise RuntimeError("the file descriptor sent was dropped: none was free to receive it")
    if not fds:
        raise EOFError
    return fds[0]
