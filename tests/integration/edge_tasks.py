"""Task functions for test_engine_edges.py; module-level so that workers import them."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from typing import Any

import mpsched

from .tasks import gate, ident, read_log, record  # noqa: F401  (re-exported for the tests)


def record_ident(path: str, x: int) -> int:
    """Record ``x`` in the log at ``path`` (a side effect that shows each run), return it."""
    return record(path, x)


def fail_at(x: int, bad: int) -> int:
    if x == bad:
        raise ValueError(f"bad item {x}")
    return x


def stop_at(x: int, *more: int, bad: int) -> int:
    """``x`` (plus ``more``), or StopIteration at item ``bad``: a function that calls ``next()``
    on an exhausted iterator, say."""
    if x == bad:
        raise StopIteration(f"no value for {x}")
    return x + sum(more)


def started_gate_record(started: str, gate_path: str, path: str, x: int) -> int:
    """Announce (FIFO ``started``), wait at ``gate_path``, then record ``x``."""
    with open(started, "wb") as fifo:
        fifo.write(b"s")
    gate(gate_path)
    return record(path, x)


def parent_raises_after_children(path: str, n: int) -> None:
    for k in range(n):
        mpsched.submit(record, path, k)
    raise ValueError("parent failed")


def child_boom(message: str) -> None:
    raise KeyError(message)


def parent_catches_child_error() -> str:
    child = mpsched.submit(child_boom, "from child")
    try:
        child.result()
    except KeyError as exc:
        return f"caught {exc.args[0]}"
    return "not raised"


def chain(depth: int) -> int:
    """A chain of nested tasks ``depth`` deep, each joining its only child."""
    if depth == 0:
        return 0
    return mpsched.submit(chain, depth - 1).result() + 1


# Futures of the children of one task that its other children join (a memo of futures, say).
_SIBLINGS: list[Any] = []


def join_siblings_at(depth: int, siblings: int, big: int = 0, die_at_done: bool = False) -> int:
    """A chain of nested joins ``depth`` links deep whose last link spawns ``siblings + 1``
    children, each joining the one before it through a module global, and joins the last.
    ``big``: the length of the first child's result, bytes (past a chain's room: stashed).
    ``die_at_done``: the first child's DONE kills this worker (its result written first)."""
    if depth > 1:
        return mpsched.submit(join_siblings_at, depth - 1, siblings, big, die_at_done).result()
    if die_at_done:
        _die_at_the_next_done()
    _SIBLINGS.clear()  # Pool(1): every child runs in this process, with this list
    _SIBLINGS.extend(mpsched.submit(_join_the_sibling_before, k, big) for k in range(siblings + 1))
    try:
        return int(_SIBLINGS[-1].result())
    finally:
        _SIBLINGS.clear()


def _join_the_sibling_before(k: int, big: int) -> Any:
    if k == 0:
        return b"x" * big
    before = _SIBLINGS[k - 1].result()
    return (len(before) if k == 1 else before) + 1


def _die_at_the_next_done() -> None:
    """This worker SIGKILLs itself in its next child's DONE exchange, before the store."""
    from mpsched import _children

    worker = _children._current
    assert worker is not None
    slot = worker.slots[worker.slot]
    real = slot.exchange_block_state

    def exchange(states: Any, handle: int, value: int, **kwargs: Any) -> int:
        if value == _children.CHILD_DONE:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(states, handle, value, **kwargs)

    slot.exchange_block_state = exchange  # type: ignore[method-assign]


def exit_now(code: int) -> None:
    os._exit(code)


def huge_result(n: int) -> bytes:
    return b"y" * n


def kill_self_with_children(path: str, n: int) -> int:
    """Push ``n`` children into this worker's deque, then SIGKILL this worker: the children
    sit in the dead worker's deque."""
    for k in range(n):
        mpsched.submit(record, path, k)
    os.kill(os.getpid(), signal.SIGKILL)
    return -1  # pragma: no cover


def join_children_then_die(started: str, gate_path: str, path: str, n: int) -> int:
    futures = [mpsched.submit(record, path, k) for k in range(n)]
    with open(started, "wb") as fifo:
        fifo.write(str(os.getpid()).encode())
    gate(gate_path)
    return sum(f.result() for f in futures)


def unpicklable_result() -> Any:
    return lambda: None


def generator_result() -> Any:
    return (x for x in range(3))


def version() -> str:
    return sys.version


def spawn_and_join(n: int) -> int:
    """Spawn ``n`` children and join them all."""
    return sum(f.result() for f in [mpsched.submit(ident, k) for k in range(n)])


def child_returns_unpicklable() -> str:
    child = mpsched.submit(generator_result)
    try:
        child.result()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def child_huge(n: int) -> int:
    return len(mpsched.submit(huge_result, n).result())


def gated_parent_of_children(started: str, gate_path: str, path: str, n: int) -> int:
    """Spawn ``n`` recording children (pushed, unclaimed: we hold the only worker), announce,
    wait at the gate, then join them."""
    futures = [mpsched.submit(record, path, k) for k in range(n)]
    with open(started, "wb") as fifo:
        fifo.write(b"s")
    gate(gate_path)
    return sum(f.result() for f in futures)


def child_signals_then_gated(to_parent: str, to_test: str, gate_path: str) -> int:
    """A child that tells its parent it runs (FIFO ``to_parent``), tells the test its pid
    (FIFO ``to_test``), then waits at the gate."""
    with open(to_parent, "wb") as fifo:
        fifo.write(b"s")
    with open(to_test, "wb") as fifo:
        fifo.write(str(os.getpid()).encode())
    gate(gate_path)
    return os.getpid()


def parent_of_stolen_child(to_parent: str, to_test: str, gate_path: str) -> str:
    """Spawn the child, wait until it runs (so on a peer: this worker is busy here), join it
    and return the error it ended with."""
    child = mpsched.submit(child_signals_then_gated, to_parent, to_test, gate_path)
    with open(to_parent, "rb") as fifo:
        assert fifo.read(1) == b"s"
    try:
        child.result()
    except BaseException as exc:
        return type(exc).__name__
    return "no error"


def parent_dies_while_child_runs_elsewhere(
    to_parent: str, to_test: str, gate_path: str, parent_pid: str
) -> None:
    child = mpsched.submit(child_signals_then_gated, to_parent, to_test, gate_path)
    with open(to_parent, "rb") as fifo:
        assert fifo.read(1) == b"s"
    with open(parent_pid, "wb") as fifo:
        fifo.write(str(os.getpid()).encode())
    child.result()


def fire_children(path: str, i: int, n: int) -> int:
    """Spawn ``n`` recording children and return without joining them."""
    for k in range(n):
        mpsched.submit(record, path, i * 10 + k)
    return i


def forget_big_children(n: int, size: int) -> int:
    """Spawn ``n`` children with results too big for a block (stashed), and drop them."""
    for _ in range(n):
        mpsched.submit(huge_result, size)
    return n


def join_big_child_args(size: int) -> int:
    return mpsched.submit(len, b"a" * size).result()


def spawn_big_children(n: int, size: int) -> int:
    """Spawn ``n`` children with arguments too big for a block (stashed) and join them."""
    futures = [mpsched.submit(len, bytes([k]) * size) for k in range(n)]
    return sum(f.result() for f in futures)


def initializer_fails_after(path: str, allowed: int) -> None:
    """A pool initializer that works in the first ``allowed`` workers only (counted by
    appends to the file at ``path``)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, b"x")
    finally:
        os.close(fd)
    if os.path.getsize(path) > allowed:
        raise OSError("initializer failed in a replacement")


_kept: list[Any] = []


def keep_child_futures(n: int) -> int:
    """Spawn ``n`` children and keep their futures past the task's end (a module global)."""
    _kept.extend(mpsched.submit(ident, k) for k in range(n))
    return n


def child_futures_in_a_cycle(n: int) -> int:
    """Spawn ``n`` children whose futures sit in a reference cycle (freed only by the GC)."""
    holder: dict[str, Any] = {}
    holder["self"] = holder
    holder["futures"] = [mpsched.submit(ident, k) for k in range(n)]
    return n


def second_item_gated(started: str, gate_path: str, x: int) -> int:
    """For ``map``: item 1 announces itself (FIFO ``started``) and waits at the gate."""
    if x == 1:
        started_gate_then_ident(started, gate_path)
    return x


def started_gate_then_ident(started: str, gate_path: str) -> None:
    with open(started, "wb") as fifo:
        fifo.write(b"s")
    gate(gate_path)


def announce(started: str) -> None:
    """Write one byte to the FIFO ``started`` (blocks until the test reads it), then return."""
    with open(started, "wb") as fifo:
        fifo.write(b"s")


def keep_done_big_children(n: int, size: int, die: bool) -> int:
    """Spawn ``n`` children with results too big for a block (stashed), let them run to DONE
    without reading them, and keep their futures past the task's end (a module global), or
    die with them unread (``die``: SIGKILL)."""
    last = mpsched.submit(ident, n)  # joined below; the deque pops LIFO: the big ones first
    _kept.extend(mpsched.submit(huge_result, size) for _ in range(n))
    result: int = last.result()
    if die:
        os.kill(os.getpid(), signal.SIGKILL)
    return result


def die_after_a_peer_ran_a_big_child(size: int) -> None:
    """Spawn a child with a result too big for a block (stashed), keep this worker busy until
    a peer has stolen and finished it (DONE, unread), then die (SIGKILL)."""
    from mpsched._children import CHILD_DONE

    child = mpsched.submit(huge_result, size)
    _kept.append(child)
    worker, handle = child._worker, child._handle  # read DONE without settling (no FETCH)
    while worker.child_state(handle) != CHILD_DONE:
        pass  # a peer steals it: this worker runs only this task meanwhile
    os.kill(os.getpid(), signal.SIGKILL)


def die_after_a_peer_ran_a_big_child_in(pid: int, size: int) -> bool:
    """``die_after_a_peer_ran_a_big_child`` if this worker is process ``pid``; else return
    False at once (the caller submits again)."""
    if os.getpid() != pid:
        return False
    die_after_a_peer_ran_a_big_child(size)
    return True


def spawn_big_args_child_for_a_peer(started: str, gate_path: str, size: int) -> int:
    """Write this worker's pid to the FIFO ``started``, wait at the gate, then spawn a child
    with arguments too big for a block (stashed) and, without joining it (a peer must run it),
    wait until it is DONE."""
    from mpsched._children import CHILD_DONE

    with open(started, "wb") as fifo:
        fifo.write(str(os.getpid()).encode())
    gate(gate_path)
    child = mpsched.submit(len, b"a" * size)
    worker, handle = child._worker, child._handle
    while worker.child_state(handle) != CHILD_DONE:
        pass  # a peer steals it: this worker runs only this task meanwhile
    return 1


def gated_child(path: str, gate_path: str, k: int) -> int:
    """Record ``k`` (the child runs), then wait at the gate."""
    record(path, k)
    gate(gate_path)
    return k


def parent_of_gated_children(path: str, gate_path: str, n: int) -> int:
    """Spawn ``n`` children that record and wait at the gate, and join them (so this worker
    runs one of them inline while a peer steals another)."""
    futures = [mpsched.submit(gated_child, path, gate_path, k) for k in range(n)]
    return sum(f.result() for f in futures)


@dataclasses.dataclass(frozen=True)
class ListAdder:
    """A callable whose type has a ``__hash__`` that raises (a frozen dataclass with a list)."""

    terms: list[int]

    def __call__(self, x: int) -> int:
        return x + sum(self.terms)


def run_as_child(fn: Any, x: int) -> Any:
    return mpsched.submit(fn, x).result()


def context_in_a_thread_during_a_join(gate_dir: str) -> tuple[Any, int]:
    """Scheduled with an id: a thread that the task starts asks ``current_task()`` while the
    task joins a child, which waits for that thread's answer (a file) before it ends."""
    import threading

    started, answered = os.path.join(gate_dir, "started"), os.path.join(gate_dir, "answered")
    seen: list[tuple[Any, int]] = []

    def ask() -> None:
        _wait_for_file(started)
        context = mpsched.current_task()
        seen.append((context.task_id, context.version))
        open(answered, "w").close()

    thread = threading.Thread(target=ask)
    thread.start()
    mpsched.submit(_announce_then_wait, started, answered).result()
    thread.join()
    return seen[0]


def _announce_then_wait(started: str, answered: str) -> None:
    open(started, "w").close()
    _wait_for_file(answered)


def _wait_for_file(path: str) -> None:
    """A state to wait for, polled, with a bound (the test's own timeout is longer)."""
    deadline = time.monotonic() + 20
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.001)


def eventfd_ids(fds: list[int]) -> list[str]:
    """The kernel's ids of eventfds ``fds`` of this process (``eventfd-id`` in their fdinfo):
    equal ids in two processes mean the same eventfd."""
    ids = []
    for fd in fds:
        with open(f"/proc/self/fdinfo/{fd}") as info:
            ids += [line.split()[1] for line in info if line.startswith("eventfd-id")]
    return ids


def wake_fd_ids() -> list[str]:
    """The ids of the wake eventfds of the worker that runs this, by slot."""
    from mpsched import _children

    worker = _children._current
    assert worker is not None
    return eventfd_ids(worker.wake_fds)


def initializer_killed_once(marker: str) -> None:
    """A pool initializer SIGKILLed (as by the OOM killer) in the first worker only."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    os.kill(os.getpid(), signal.SIGKILL)


def freeze_clock() -> int:
    """Leave ``time.perf_counter`` frozen in the worker, as a freezegun ``freeze_time().start()``
    never stopped does."""
    frozen = time.perf_counter()
    time.perf_counter = lambda: frozen
    return os.getpid()


class _BlockingStream:
    """A ``sys.stdout`` whose ``flush`` blocks (a pipe whose reader stopped reading)."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        time.sleep(3600)


def block_stdout_flush() -> int:
    """Leave the worker a ``sys.stdout`` whose ``flush`` blocks."""
    sys.stdout = _BlockingStream()
    return os.getpid()


def report_cancel_requested(started: str, gate_path: str, log: str) -> None:
    """Announce the run (FIFO ``started``), wait at the gate, then log whether a cancel was
    asked of it (1) or not (0)."""
    with open(started, "wb") as fifo:
        fifo.write(b"s")
    gate(gate_path)
    record(log, int(mpsched.current_task().cancel_requested))


def record_then_exit_at(path: str, k: int, bad: int) -> int:
    """Log ``k`` (``record``), then end the worker if ``k`` is ``bad``: a map item that
    crashes its worker after a side effect."""
    record(path, k)
    if k == bad:
        os._exit(3)
    return k


def record_then_raise_at(path: str, k: int, bad: int) -> int:
    """Log ``k`` (``record``), then raise if ``k`` is ``bad``: a map item with a side effect
    that fails."""
    record(path, k)
    if k == bad:
        raise ValueError(f"item {k}")
    return k


def spin_plus_len(table: bytes, x: int) -> int:
    """~0.1 ms of work, then ``x`` plus the length of ``table`` (a big argument bound by a
    ``functools.partial``: a map's fn that carries data)."""
    end = time.perf_counter() + 0.0001
    while time.perf_counter() < end:
        pass
    return x + len(table)
