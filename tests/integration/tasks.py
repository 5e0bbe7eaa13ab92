"""Task functions for the integration tests; module-level so workers can import them."""

from __future__ import annotations

import errno
import os
import pathlib
import select
import signal
import struct
import sys
import threading
import time
from typing import Any

import mpsched

_log_fds: dict[str, int] = {}


def ident(x: Any) -> Any:
    return x


def add(a: int, b: int = 0) -> int:
    return a + b


def pid_of(_: Any = None) -> int:
    return os.getpid()


def process_context() -> tuple[str, bool, int | None, bool, str]:
    """What a task sees of multiprocessing's process state and of stdin."""
    import multiprocessing

    me = multiprocessing.current_process()
    parent = multiprocessing.parent_process()
    return (
        me.name,
        bool(me.daemon),
        None if parent is None else parent.pid,
        parent is not None and parent.is_alive(),
        sys.stdin.read(),
    )


def boom(message: str) -> None:
    raise ValueError(message)


def record(path: str, task_id: int) -> int:
    """Append ``task_id`` to the log at ``path`` (one atomic O_APPEND write: a side effect that
    shows how many times each task ran)."""
    fd = _log_fds.get(path)
    if fd is None:
        fd = _log_fds[path] = os.open(path, os.O_WRONLY | os.O_APPEND)
    os.write(fd, struct.pack("q", task_id))
    return task_id


def read_log(path: str) -> list[int]:
    with open(path, "rb") as f:
        data = f.read()
    return [v for (v,) in struct.iter_unpack("q", data)]


def record_with_children(path: str, task_id: int, children: int) -> int:
    """Record ``task_id`` and spawn ``children`` children that record ids below zero."""
    futures = [mpsched.submit(record, path, -(task_id * 100 + k) - 1) for k in range(children)]
    record(path, task_id)
    return sum(f.result() for f in futures)


def fib(n: int) -> int:
    if n < 2:
        return n
    a = mpsched.submit(fib, n - 1)
    b = fib(n - 2)
    return a.result() + b


def chain(n: int) -> int:
    """``n``, counted by a chain of ``n`` nested tasks, each joining the child it spawns."""
    return 0 if n == 0 else 1 + mpsched.submit(chain, n - 1).result()


_SHALLOW: list[mpsched.ChildFuture[int]] = []  # children of every level of the chain below


def chain_joining_shallow_children(n: int) -> int:
    """A chain of ``n`` nested tasks; each level first spawns a child that it leaves in its
    deque, and the deepest level joins them all: past the helping depth it runs them
    unrecorded. Returns how many ran."""
    if n == 0:
        return sum(child.result() for child in _SHALLOW)
    _SHALLOW.append(mpsched.submit(ident, 1))
    return 1 + mpsched.submit(chain_joining_shallow_children, n - 1).result()


def chain_raise(n: int) -> int:
    """A chain of ``n`` nested tasks, each joining its child; the last raises ValueError("leaf"),
    and each level re-raises its child's error."""
    if n == 0:
        raise ValueError("leaf")
    return 1 + mpsched.submit(chain_raise, n - 1).result()


def recursion_limit() -> int:
    return sys.getrecursionlimit()


def rsum(lo: int, hi: int, leaf: int) -> int:
    if hi - lo <= leaf:
        return sum(range(lo, hi))
    mid = (lo + hi) // 2
    left = mpsched.submit(rsum, lo, mid, leaf)
    right = mpsched.submit(rsum, mid, hi, leaf)
    return left.result() + right.result()


def spin(seconds: float) -> float:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
    return seconds


def spin_record(path: str, task_id: int, seconds: float) -> int:
    spin(seconds)
    return record(path, task_id)


def gate(path: str) -> bool:
    """Block until the test opens the FIFO at ``path`` for writing and writes a byte (a
    cross-process event: no sleeping, no polling)."""
    with open(path, "rb") as fifo:
        return fifo.read(1) == b"x"


def gated_ident(path: str, x: Any) -> Any:
    gate(path)
    return x


def started_then_gated(started: str, path: str, x: Any) -> Any:
    """Tell the test this task runs (FIFO ``started``), then wait at the gate ``path``."""
    with open(started, "wb") as fifo:
        fifo.write(b"s")
    return gated_ident(path, x)


def wait_started(started: str) -> None:
    """Test side: block until a ``started_then_gated`` task is running."""
    with open(started, "rb") as fifo:
        assert fifo.read(1) == b"s"


def open_gate(path: str) -> None:
    """Test side: release one ``gate(path)`` (blocks until a task is waiting at it)."""
    with open(path, "wb") as fifo:
        fifo.write(b"x")


def open_gate_within(path: str, timeout: float) -> bool:
    """Release a task waiting at the FIFO gate ``path``; False if none waits there within
    ``timeout`` (a task that never started: the bounded twin of ``tasks.open_gate``)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno != errno.ENXIO or time.monotonic() > deadline:
                return False
            time.sleep(0.001)  # polling for a reader: no task is at the gate yet
            continue
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
        return True


def wait_started_within(path: str, timeout: float) -> bool:
    """The bounded twin of ``tasks.wait_started``."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            readable, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if readable:
                data = os.read(fd, 1)
                if data == b"s":
                    return True
                if not data:  # no writer yet (EOF): wait for the task to open its end
                    time.sleep(0.001)
        return False
    finally:
        os.close(fd)


def echo_size(data: bytes) -> int:
    return len(data)


def make_bytes(n: int) -> bytes:
    return b"x" * n


class Blob:
    """A result that a weak reference can watch (bytes cannot be weakly referenced)."""

    def __init__(self, n: int) -> None:
        self.data = b"x" * n


def make_blob(n: int) -> Blob:
    return Blob(n)


def nested_big(n: int) -> int:
    child = mpsched.submit(make_bytes, n)
    return len(child.result())


def submit_outside() -> None:
    assert mpsched.submit(ident, 1).result() == 1


def unpicklable_result() -> Any:
    import threading

    return threading.Lock()


def exit_task(code: int) -> None:
    sys.exit(code)


def raise_keyboard_interrupt() -> None:
    raise KeyboardInterrupt


def fire_and_forget(path: str, task_id: int) -> int:
    mpsched.submit(record, path, task_id)
    return task_id


def send_fatal() -> None:
    """Pretend mpsched's own code failed in this worker (tests the broken-pool path)."""
    from mpsched import _children, _protocol

    worker = _children._current
    assert worker is not None
    worker.conn.send_bytes(_protocol.encode(_protocol.Tag.FATAL, worker.slot, "simulated bug"))


def report_pid_then_gate(started: str, path: str) -> int:
    """Tell the test this worker's pid (FIFO ``started``), then wait at the gate ``path``."""
    with open(started, "wb") as fifo:
        fifo.write(str(os.getpid()).encode())
    gate(path)
    return os.getpid()


def read_pid(started: str) -> int:
    with open(started, "rb") as fifo:
        return int(fifo.read())


def boom_cancelled() -> None:
    """Raise TaskCancelled although nobody asked: that is an error, not a cancel."""
    raise mpsched.TaskCancelled("unprompted")


_initialized: list[Any] = []


def remember(*args: Any) -> None:
    """A pool initializer: record its arguments in this worker process."""
    _initialized.append(args)


def initialized() -> list[Any]:
    return list(_initialized)


def send_on_remembered(position: int, value: Any) -> str:
    """Send ``value`` on the pipe's end that ``remember`` kept at ``position``."""
    _initialized[0][position].send(value)
    return "sent"


def remembered_are_one(i: int, j: int) -> bool:
    """Whether ``remember``'s arguments ``i`` and ``j`` are one object."""
    return _initialized[0][i] is _initialized[0][j]


def leave_a_full_queue(_: Any = None) -> int:
    """Put more than a pipe holds on a multiprocessing queue of the task's own, which nobody
    reads, and return: its thread is still writing as the worker's exit comes."""
    import multiprocessing

    multiprocessing.get_context("fork").Queue().put(b"x" * 200_000)
    return os.getpid()


def call_remembered(index: int) -> Any:
    """Call ``remember``'s argument ``index`` (a function given in ``initargs``)."""
    return _initialized[0][index]()


def count_and_report(n: int) -> int:
    """With ``remember``'s arguments (a multiprocessing ``Value``, its ``Lock``, a ``Queue``
    and a pipe's sending end): add 1 to the counter, put ``n`` in the queue and send it."""
    counter, lock, queue, conn = _initialized[0]
    with lock:
        counter.value += 1
    queue.put(n)
    conn.send(n)
    return n


def failing_initializer(message: str) -> None:
    raise OSError(message)


def failing_initializer_late_in_peers(directory: str) -> None:
    """A pool initializer that raises at once in the first worker to get here, and in every
    other worker only once ``directory/go`` exists (the pool's break kills them first: no test
    makes it); those first write their pid to ``directory/late-<pid>``."""
    try:
        os.close(os.open(os.path.join(directory, "first"), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        with open(os.path.join(directory, f"late-{os.getpid()}.tmp"), "w"):
            pass
        os.rename(  # whole, for a reader of the directory
            os.path.join(directory, f"late-{os.getpid()}.tmp"),
            os.path.join(directory, f"late-{os.getpid()}"),
        )
        while not os.path.exists(os.path.join(directory, "go")):
            time.sleep(0.005)  # the test creates the file; this only paces the poll
        raise OSError("late initializer") from None
    raise OSError("first initializer")


def exit_at_once(code: int) -> None:
    """A pool initializer (or task) that ends its process without Python's clean-up."""
    os._exit(code)


def kill_self() -> None:
    """A pool initializer (or task) whose process is SIGKILLed, as by the OOM killer."""
    os.kill(os.getpid(), signal.SIGKILL)


def initializer_failing_at_gate(directory: str, gate_path: str) -> None:
    """A pool initializer that succeeds in the first worker to get here; every other worker
    waits at the gate ``gate_path``, then raises (breaking the pool)."""
    try:
        os.close(os.open(os.path.join(directory, "first"), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        gate(gate_path)
        raise OSError("initializer failed at the gate") from None


def initializer_waiting_at_gate(directory: str, gate_path: str) -> None:
    """A pool initializer that returns at once in the first worker to get here; every other
    worker returns only once the test opens the gate ``gate_path``."""
    try:
        os.close(os.open(os.path.join(directory, "first"), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        gate(gate_path)


def die_holding_lock(which: str, record_pid: bool) -> None:
    """Take one of the pool's cross-process locks and die with it held, with or without the
    holder pid recorded (the second is the window between acquire and the pid store)."""
    from mpsched import _children

    worker = _children._current
    assert worker is not None
    structure: Any = worker.me if which == "slot" else worker.slab
    assert structure._acquire(True, 5.0)
    if record_pid:
        structure._w[0 if which == "slot" else 1] = os.getpid()  # HOLDER_PID word
    os._exit(3)


def _child_states(child: mpsched.ChildFuture) -> dict[str, bool]:
    return {
        "done": child.done(),
        "running": child.running(),
        "cancel": child.cancel(),
        "cancelled": child.cancelled(),
    }


def child_future_states() -> tuple[dict[str, bool], dict[str, bool]]:
    """In a Pool(1) task: a child's future states while it is queued, then once done."""
    child = mpsched.submit(ident, 1)
    before = _child_states(child)
    assert child.result() == 1
    return before, _child_states(child)


def child_running_states(started: str, gate: str) -> dict[str, Any]:
    """In a Pool(2) task: a child that the peer steals and runs (it blocks at ``gate``)."""
    child = mpsched.submit(started_then_gated, started, gate, 7)
    try:
        wait_started(started)  # the peer runs it now (this worker does not help meanwhile)
        states = {"running": child.running(), "cancel": child.cancel()}
    finally:  # else a failure here left the child at the gate and the pool's exit waiting
        open_gate(gate)
    states["result"] = child.result()
    states["after"] = child.running()
    return states


def nested_pool(start_method: str) -> int:
    """A task that runs a pool of its own (a worker is a daemonic process)."""
    with mpsched.Pool(1, start_method=start_method) as pool:
        return pool.submit(add, 20, 22).result(timeout=30)  # type: ignore[no-any-return]


def lock_at(x: int, bad: int = 3) -> Any:
    """``x``, but at ``bad`` a result that no pickler takes."""
    import threading

    return threading.Lock() if x == bad else x


def children_from_another_thread() -> list[Any]:
    """From a thread this task started, ``mpsched.submit``, a child's ``result()`` and its
    ``done()`` each raise RuntimeError (True for each that names the rule); the task's own
    thread then joins the child (5)."""
    child = mpsched.submit(ident, 5)
    named: list[bool] = []

    def other() -> None:
        for call in (lambda: mpsched.submit(ident, 1), child.result, child.done):
            try:
                call()
            except RuntimeError as exc:
                named.append("the thread that runs the task" in str(exc))

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    return [*named, child.result()]


class HandlerError(Exception):
    """Raised by ``raise_on_sigusr1``'s handler."""


def _raise_handler_error(signum: int, frame: object) -> None:
    raise HandlerError(f"signal {signum} after the task returned")


def raise_on_sigusr1() -> int:
    """Leave a SIGUSR1 handler that raises installed in this worker; return its pid."""
    signal.signal(signal.SIGUSR1, _raise_handler_error)
    return os.getpid()


def raise_on_sigusr1_sent_by_a_thread(path: str) -> int:
    """Leave a raising SIGUSR1 handler installed, and a thread that, once the test opens the
    gate at ``path``, sends SIGUSR1 to itself (``pthread_kill``): the signal reaches that
    thread, not the worker's main thread asleep in ``poll``, which only a wakeup fd wakes to
    run the handler. Returns this worker's pid."""
    import threading

    signal.signal(signal.SIGUSR1, _raise_handler_error)

    def send() -> None:
        gate(path)
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)

    threading.Thread(target=send, daemon=True).start()
    return os.getpid()


def _gated_child(path: str) -> str:
    gate(path)
    return "child"


def join_a_stolen_child(joining: str, gate_path: str) -> int:
    """Spawn a child that waits at ``gate_path``, let a peer steal it, then tell the test
    (FIFO ``joining``) and join it: the join has nothing of its own to help with."""
    child = mpsched.submit(_gated_child, gate_path)
    deadline = time.monotonic() + 20
    while not child.running():  # a state, not a time: the idle peer steals it
        if time.monotonic() > deadline:
            raise TimeoutError("no peer stole the child")
        time.sleep(0.001)
    with open(joining, "wb") as fifo:
        fifo.write(b"j")
    assert child.result() == "child"
    return os.getpid()


def flag_seen(path: str) -> tuple[int, bool]:
    """This worker's pid, and whether the file ``path`` exists."""
    return os.getpid(), os.path.exists(path)


def collect_garbage() -> int:
    """A full collection in the worker; the number of unreachable objects it found."""
    import gc

    return gc.collect()


def private_growth_of_a_collection() -> int:
    """Bytes of this worker's own memory (USS) that one full collection added."""
    import gc

    import psutil

    me = psutil.Process()
    before = me.memory_full_info().uss
    gc.collect()
    return int(me.memory_full_info().uss - before)


def push_a_child_between_gates(directory: str) -> tuple[int, int]:
    """In a worker: publish its pid (file ``worker``), wait at the gate ``push``, push a child
    that writes the pid of the worker running it to file ``child``, say so (file ``pushed``),
    wait at the gate ``join``, then join the child. Returns (the child's worker's pid, this
    worker's pid)."""
    folder = pathlib.Path(directory)
    write_atomically(folder / "worker", str(os.getpid()))
    gate(str(folder / "push"))
    child = mpsched.submit(pid_into, str(folder / "child"))
    (folder / "pushed").touch()
    gate(str(folder / "join"))
    return child.result(), os.getpid()


def pid_into(path: str) -> int:
    """Write this process's pid to ``path`` (whole, by a rename) and return it."""
    write_atomically(pathlib.Path(path), str(os.getpid()))
    return os.getpid()


def write_atomically(path: pathlib.Path, text: str) -> None:
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    part.rename(path)
