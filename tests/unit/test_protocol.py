"""Frames over the pool's sockets: raw data frames beside pickled ones (no processes).

``send_data`` writes a STASH/PAYLOAD with its bytes uncopied; ``recv_message`` reads both kinds,
including the frames ``Connection.send_bytes`` writes, and fails as ``recv_bytes`` does.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection

import pytest

from mpsched import _protocol
from mpsched._protocol import Buffer, Tag, encode, frame_watch, recv_message, send_data


@pytest.fixture
def pair() -> Iterator[tuple[Connection, Connection]]:
    left, right = socket.socketpair()
    a, b = Connection(left.detach()), Connection(right.detach())
    try:
        yield a, b
    finally:
        a.close()
        b.close()


@contextlib.contextmanager
def _writing_in_a_thread(write: Callable[[], object]) -> Iterator[None]:
    """Frames bigger than the socket's buffer need a reader while ``write`` writes them."""
    writer = threading.Thread(target=write)
    writer.start()
    try:
        yield
    finally:
        writer.join(10)


def _written_by_a_thread(
    send: Connection, frames: list[tuple[int, int, Buffer]]
) -> contextlib.AbstractContextManager[None]:
    """``frames`` sent raw (``send_data``) by a thread."""
    return _writing_in_a_thread(lambda: [send_data(send, *frame) for frame in frames])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("size", [0, 1, 1000, _protocol._SMALL_FRAME, 5 * 2**20])
def test_a_raw_frame_carries_its_bytes_whatever_their_size(
    pair: tuple[Connection, Connection], size: int
) -> None:
    send, recv = pair
    data = os.urandom(size)
    with _written_by_a_thread(
        send, [(Tag.STASH, 7, data), (Tag.PAYLOAD, -(2**62), bytearray(data))]
    ):
        assert recv_message(recv) == (Tag.STASH, (7, data))
        tag, (key, got) = recv_message(recv)
        assert (tag, key, got) == (Tag.PAYLOAD, -(2**62), data)


@pytest.mark.timeout(30)
def test_pickled_frames_of_connection_send_bytes_read_between_raw_ones(
    pair: tuple[Connection, Connection],
) -> None:
    """The coordinator reads a worker's pickled messages (RESULTS, DRAINED...) with the same
    reader: small ones, and one past the size read in a single read."""
    send, recv = pair
    big_text = "x" * (3 * _protocol._SMALL_FRAME)

    def write() -> None:
        send.send_bytes(encode(Tag.RESULTS))
        send_data(send, Tag.STASH, 1, b"abc")
        send.send_bytes(encode(Tag.FATAL, 3, big_text))
        send.send_bytes(encode(Tag.DRAINED, 0, {"executed": 5}))

    with _writing_in_a_thread(write):
        assert recv_message(recv) == (Tag.RESULTS, ())
        assert recv_message(recv) == (Tag.STASH, (1, b"abc"))
        assert recv_message(recv) == (Tag.FATAL, (3, big_text))
        assert recv_message(recv) == (Tag.DRAINED, (0, {"executed": 5}))


@pytest.mark.timeout(10)
def test_the_end_of_the_channel_is_eof_before_a_frame_and_oserror_inside_one(
    pair: tuple[Connection, Connection],
) -> None:
    """As Connection.recv_bytes: the coordinator takes either for the worker's death, and a
    worker exits on EOFError (its coordinator is gone)."""
    send, recv = pair
    send.send_bytes(b"")  # an empty frame is a frame: the pickle inside it is malformed
    with pytest.raises(_protocol.ProtocolError):
        recv_message(recv)
    os.write(send.fileno(), struct.pack("!i", 100) + b"\x00" * 40)  # a writer killed mid-frame
    send.close()
    with pytest.raises(OSError, match="end of file during message"):
        recv_message(recv)
    with pytest.raises(EOFError):
        recv_message(recv)


@pytest.mark.timeout(10)
def test_frame_watch_says_what_connection_poll_says(
    pair: tuple[Connection, Connection],
) -> None:
    send, recv = pair
    waiting = frame_watch(recv)  # made once, checked many times
    assert not waiting()
    assert not recv.poll()
    send_data(send, Tag.STASH, 2, b"z")
    assert waiting()
    assert recv.poll()
    recv_message(recv)
    assert not waiting()
    send.close()  # the end of the channel is readable: the reader learns of it at once
    assert waiting()
    assert recv.poll()


def test_a_raw_frame_too_big_for_memory_is_read_past_and_fails_its_reader(
    pair: tuple[Connection, Connection], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A big result that the coordinator could not allocate raised MemoryError in its thread,
    which broke the pool. Now the frame is read past (the channel stays in step) and its data
    stand for the error: whoever unpickles them, where the result or call was expected, gets
    the MemoryError."""
    send, recv = pair
    big = b"x" * (3 * _protocol.SKIP_CHUNK + 123)  # several chunks of the skip and a rest

    def small_memory(size: int = 0) -> bytearray:
        if size > _protocol.SKIP_CHUNK:
            raise MemoryError
        return bytearray(size)

    monkeypatch.setattr(_protocol, "bytearray", small_memory, raising=False)
    with _written_by_a_thread(send, [(Tag.STASH, 7, big), (Tag.PAYLOAD, 8, b"y" * 20_000)]):
        tag, (key, data) = recv_message(recv)
        assert (tag, key) == (Tag.STASH, 7)
        with pytest.raises(MemoryError, match=f"{len(big):,} bytes"):
            pickle.loads(data)
        tag, (key, data) = recv_message(recv)
    assert (tag, key, bytes(data)) == (Tag.PAYLOAD, 8, b"y" * 20_000)


# In a process with no fd free below its open-file limit (a fork zygote has every fd of the
# pool's process): send_fd takes no fd, and recv_fd one, where multiprocessing's send_handle
# failed with EMFILE (its duplicate of the socket: the zygote took that for the coordinator's
# end, exited, and the pool broke saying that the zygote had died; found by a hunt).
FD_LIMIT_PROGRAM = """
import errno, os, resource, socket, sys
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from mpsched._protocol import recv_fd, send_fd

a, b = (Connection(s.detach()) for s in socket.socketpair())
payload = os.eventfd(0)
spare = os.open(os.devnull, os.O_RDONLY)  # freed for the receiver below
filler = []
while True:  # every number below the limit taken
    fd = os.open(os.devnull, os.O_RDONLY)
    filler.append(fd)
    if fd >= 60:
        break
resource.setrlimit(resource.RLIMIT_NOFILE, (61, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
try:
    send_handle(a, payload, os.getpid())
    print("send_handle: sent")
except OSError as exc:
    print("send_handle:", errno.errorcode[exc.errno])
send_fd(a, payload)
print("send_fd: sent")
os.close(spare)  # one number free: enough for the fd received, none for a duplicate
received = recv_fd(b)
print("recv_fd:", os.readlink(f"/proc/self/fd/{received}"), os.get_inheritable(received))
send_fd(a, payload)
try:
    recv_fd(b)
except RuntimeError as exc:
    print("no fd free:", exc)
"""


@pytest.mark.timeout(60)
def test_fds_pass_between_the_zygote_and_the_pool_without_a_spare_fd() -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", FD_LIMIT_PROGRAM], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "send_handle: EMFILE",  # the stdlib's way, for the record
        "send_fd: sent",
        "recv_fd: anon_inode:[eventfd] False",
        "no fd free: the file descriptor sent was dropped: none was free to receive it",
    ], result.stdout


# A peer gone: EPIPE (BrokenPipeError), not the SIGPIPE that kills a program that gave it its
# default action (socket.send_fds drops its MSG_NOSIGNAL flag: a diff review).
PEER_GONE_PROGRAM = """
import os, signal, socket
from multiprocessing.connection import Connection
from mpsched._protocol import send_fd

signal.signal(signal.SIGPIPE, signal.SIG_DFL)
a, b = socket.socketpair()
b.close()
try:
    send_fd(Connection(a.detach()), 0)
except BrokenPipeError:
    print("BrokenPipeError")
"""


@pytest.mark.timeout(60)
def test_an_fd_sent_to_a_peer_gone_raises_rather_than_kill_the_process() -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", PEER_GONE_PROGRAM], capture_output=True, text=True, timeout=30
    )
    assert (result.returncode, result.stdout) == (0, "BrokenPipeError\n"), result


def _read_exactly(fd: int, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        assert chunk, "end of the channel inside the frame"
        data += chunk
    return data


@pytest.mark.timeout(10)
def test_a_raw_frame_past_the_signed_length_takes_the_long_length_form(
    pair: tuple[Connection, Connection], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past ``_LENGTH_MAX`` (2 GiB; made small here) the prefix is -1 and an 8-byte length, as
    ``Connection.send_bytes`` writes it: a signed 4-byte length would be negative there, and
    ``recv_message`` (or ``recv_bytes``) would misread it. Just past the limit pins the
    comparison (a mutation hunt found a doubled limit unnoticed)."""
    monkeypatch.setattr(_protocol, "_LENGTH_MAX", 100)
    send, recv = pair
    data = b"x" * 150
    send_data(send, Tag.STASH, 7, data)
    size = _protocol._RAW_HEADER.size + len(data)
    prefix = _read_exactly(recv.fileno(), 4)
    assert struct.unpack("!i", prefix) == (-1,)
    frame = prefix + _read_exactly(recv.fileno(), 8 + size)
    assert struct.unpack_from("!Q", frame, 4) == (size,)
    os.write(send.fileno(), frame)  # the same bytes again, for the reader
    assert recv_message(recv) == (Tag.STASH, (7, data))
    send_data(send, Tag.STASH, 8, b"y" * 90)  # within the limit: the short form
    assert struct.unpack("!i", _read_exactly(recv.fileno(), 4)) == (10 + 90,)


@pytest.mark.timeout(10)
def test_a_raw_frame_with_an_unknown_tag_is_refused(pair: tuple[Connection, Connection]) -> None:
    """A raw frame's tag is checked as a pickled frame's is (``Tag.check``), small or big: a
    misread frame fails where it is read, not as a tag no handler expects."""
    send, recv = pair
    send_data(send, 99, 1, b"abc")
    with pytest.raises(ValueError, match="99 is not a valid Tag"):
        recv_message(recv)
    big = [(99, 2, b"z" * (2 * _protocol._SMALL_FRAME))]
    with _written_by_a_thread(send, big), pytest.raises(ValueError, match="99 is not a valid"):
        recv_message(recv)


@pytest.mark.timeout(30)
def test_a_pickled_frame_too_big_for_memory_raises_memoryerror_and_is_read_past(
    pair: tuple[Connection, Connection], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a raw frame's data can stand for the error (``TooBig``): a pickled frame that does
    not fit is read past and raises MemoryError. Its first bytes (the pickle's PROTO, then 5)
    must not be read as a raw header: that was a STOP message."""
    send, recv = pair
    big = encode(Tag.RESULTS, b"z" * (2 * _protocol.SKIP_CHUNK))
    after = encode(Tag.DRAINED, 0, {"executed": 1})

    def small_memory(size: int = 0) -> bytearray:
        if size > _protocol.SKIP_CHUNK:
            raise MemoryError
        return bytearray(size)

    monkeypatch.setattr(_protocol, "bytearray", small_memory, raising=False)
    with _writing_in_a_thread(lambda: [send.send_bytes(big), send.send_bytes(after)]):
        with pytest.raises(MemoryError):
            recv_message(recv)
        assert recv_message(recv) == (Tag.DRAINED, (0, {"executed": 1}))  # still in step


@pytest.mark.timeout(10)
def test_a_byte_without_its_fd_is_a_dropped_fd_not_the_end_of_the_channel(
    pair: tuple[Connection, Connection],
) -> None:
    """The kernel drops an fd that the receiver had no number free for, leaving the message's
    byte alone (not always with MSG_CTRUNC): that is RuntimeError, as ``recv_handle`` said;
    EOFError is kept for the end of the channel (the coordinator takes it for the zygote's
    death)."""
    send, recv = pair
    os.write(send.fileno(), b"F")
    with pytest.raises(RuntimeError, match="dropped"):
        _protocol.recv_fd(recv)
    send.close()
    with pytest.raises(EOFError):
        _protocol.recv_fd(recv)


@pytest.mark.timeout(10)
def test_socket_of_leaves_the_connection_blocking_under_a_default_timeout(
    pair: tuple[Connection, Connection],
) -> None:
    """A socket object made with ``socket.setdefaulttimeout()`` set made the fd (the file
    description shared with the Connection) non-blocking: the Connection's reads then failed
    with BlockingIOError. ``socket_of`` sets it blocking again."""
    conn = pair[0]
    before = socket.getdefaulttimeout()
    socket.setdefaulttimeout(5)
    try:
        sock = _protocol.socket_of(conn)
        try:
            assert sock.gettimeout() is None
        finally:
            sock.detach()
    finally:
        socket.setdefaulttimeout(before)
    assert os.get_blocking(conn.fileno())


class _ClaimsToBeAnError:
    """Unpickles as itself, while its ``__class__`` says ValueError: ``isinstance`` believes
    that, ``type()`` does not."""

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # type: ignore[override]
        return ValueError

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return _ClaimsToBeAnError, ()


@pytest.mark.timeout(10)
def test_an_exception_that_unpickles_as_a_non_exception_is_replaced() -> None:
    """Whatever its ``__class__`` claims: the coordinator raises what ``load_exception``
    returns, and raising a non-exception is a TypeError in the coordinator thread (a broken
    pool), so the check reads ``type()``."""
    data = pickle.dumps((pickle.dumps(_ClaimsToBeAnError()), "remote text"))
    exc = _protocol.load_exception(data)
    assert type(exc) is _protocol.TaskOutcomeError
    assert "unpickled as _ClaimsToBeAnError, not an exception" in str(exc)
    assert isinstance(exc.__cause__, _protocol.RemoteTraceback)
    assert exc.__cause__.tb == "remote text"
