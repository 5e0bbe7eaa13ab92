"""Tasks that die at a chosen point of mpsched's own code (``test_crash_windows.py``).

A SIGKILL can land between any two bytecodes of a worker. These tasks reproduce, on purpose and
deterministically, the deaths that the chaos test (tests/stress/test_chaos.py) hits at random:
inside a shared lock, inside ``mpsched.submit``, in a parent with children still queued, and
in a child's executor between its DONE and its parent's wake-up.
They reach into the worker's internals (``mpsched._children._current``): white-box by design.
"""

from __future__ import annotations

import os
import select
import signal
from typing import Any

import mpsched
from mpsched import _children
from mpsched._protocol import ChildState
from mpsched._slot_region import HOLDER_PID

HELPER_MAX_S = 120.0  # s; the helper of die_holding_own_slot_lock exits by then in any case


def _current() -> Any:
    worker = _children._current
    assert worker is not None, "not in a worker"
    return worker


def die_holding_own_slot_lock(started: str, release: str, record_pid: bool) -> None:
    """Die holding this worker's slot lock, with its pid recorded as the holder (as inside any
    SlotQueues method) or not (``record_pid=False``: killed right after ``acquire``, before
    ``holder_pid = pid``). A forked helper keeps the worker's socket open until the test opens
    the FIFO ``release``, so the coordinator sees the death (EOF) only then: meanwhile it must
    get past the lock the dead worker holds. Writes the worker's pid into the FIFO ``started``
    once the lock is held."""
    worker = _current()
    _keep_socket_open(worker, release)
    queues = worker.me
    queues._acquire()
    if record_pid:
        queues._w[HOLDER_PID] = os.getpid()
    with open(started, "wb") as fifo:
        fifo.write(str(os.getpid()).encode())
    os.kill(os.getpid(), signal.SIGKILL)


def die_inside_submit() -> None:
    """Die in ``mpsched.submit`` after the child was counted as live, before it was pushed."""
    worker = _current()
    worker.me.push = lambda handle: os._exit(1)
    mpsched.submit(abs, -1)


def die_between_a_childs_alloc_and_its_write() -> None:
    """Die in ``mpsched.submit`` right after the child's block was allocated, before its
    write: nothing of the child is in the block yet (before ``Slab.alloc`` stamped
    the uid, its words were the previous task's, which name nobody)."""
    slab = _current().slab
    slab.write = slab.write_child = lambda *args, **kwargs: os._exit(1)  # write: before 0f12551
    mpsched.submit(abs, -1)


class _DieAtCopy:
    """Stands for a slab's data view (``Slab._bytes``) and ends the process at its
    ``die_at``-th store: a death in the middle of writing a chain of blocks."""

    def __init__(self, view: memoryview, die_at: int, code: int) -> None:
        self.view = view
        self.left = die_at
        self.code = code

    def __getitem__(self, key: Any) -> Any:
        return self.view[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self.left -= 1
        if not self.left:
            os._exit(self.code)
        self.view[key] = value


def die_writing_a_childs_long_arguments(nbytes: int) -> None:
    """Spawn a child with ``nbytes`` of arguments (a chain of blocks) and die in the middle of
    copying them in, after the first block's data (its continuation blocks are taken)."""
    slab = _current().slab
    slab._bytes = _DieAtCopy(slab._bytes, 2, 1)
    mpsched.submit(len, bytes(nbytes))


def return_a_long_result_and_die_writing_it(nbytes: int) -> bytes:
    """Return ``nbytes`` (a result that takes a chain of blocks); the worker dies in the middle
    of copying it into the task's block, after the first block's data."""
    slab = _current().slab
    slab._bytes = _DieAtCopy(slab._bytes, 2, 1)
    return bytes(nbytes)


def die_at_the_next_slab_lock() -> None:
    """From now on this worker dies (exit code 3) when it next takes the slab's lock: the next
    task's ``release_args``, if its arguments took a chain of blocks."""
    _current().slab._acquire = lambda *args: os._exit(3)


def spawn_then_die(children: int) -> None:
    """Spawn ``children`` children (queued on this worker's deque), then die before joining
    them: they are orphans."""
    futures = [mpsched.submit(abs, -i) for i in range(children)]
    assert futures
    os._exit(3)


def child_dies_after_publishing_done(started: str, gate_path: str, value: int) -> int:
    """A child that, once a peer stole it, writes its executor's pid into the FIFO
    ``started``, waits at ``gate_path`` and returns ``value``: its executor then dies right
    after publishing DONE (``finish_child``'s exchange), before it wakes the parent (the
    ``live_children`` update comes in between)."""
    worker = _current()
    worker.header.add_live_children = lambda delta: os._exit(3)
    with open(started, "wb") as fifo:
        fifo.write(str(os.getpid()).encode())
    with open(gate_path, "rb") as fifo:
        fifo.read(1)
    return value


def join_a_stolen_child(started: str, gate_path: str, value: int) -> int:
    """Spawn ``child_dies_after_publishing_done``, wait until a peer stole it (so that this
    worker, finding nothing to help with, sleeps in the join), then join it."""
    child = mpsched.submit(child_dies_after_publishing_done, started, gate_path, value)
    while not child.running():  # this worker takes nothing meanwhile: only a peer can steal it
        pass
    return child.result()  # type: ignore[no-any-return]


def child_frees_slowly(started: str, gate_path: str, window: str, release: str) -> int:
    """A child whose executor, once the child's parent dropped its future, stops inside the
    free of the child's block (``free_unread_child``): it writes its pid into the FIFO
    ``window`` and waits at ``release`` before it frees. Announces itself on ``started`` and
    waits at ``gate_path`` before it returns."""
    worker = _current()
    free = worker.free_unread_child

    def free_unread_child(handle: int) -> None:
        with open(window, "wb") as fifo:
            fifo.write(str(os.getpid()).encode())
        with open(release, "rb") as fifo:
            fifo.read(1)
        free(handle)

    worker.free_unread_child = free_unread_child
    with open(started, "wb") as fifo:
        fifo.write(b"s")
    with open(gate_path, "rb") as fifo:
        fifo.read(1)
    return 1


def abandon_a_stolen_child(
    started: str, gate_path: str, window: str, release: str, parent: str
) -> None:
    """Spawn ``child_frees_slowly``, wait until a peer stole it, drop its future (the child is
    ABANDONED: its executor frees its block), then write this worker's pid into the FIFO
    ``parent`` and wait there until the test kills this worker."""
    worker = _current()
    child = mpsched.submit(child_frees_slowly, started, gate_path, window, release)
    while not child.running():  # this worker takes nothing meanwhile: only a peer can steal it
        pass
    del child
    worker.release_abandoned()  # as after the task: the executor owns the block now
    with open(parent, "wb") as fifo:
        fifo.write(str(os.getpid()).encode())
    signal.pause()


def child_dies_freeing_itself(started: str, gate_path: str, nbytes: int) -> bytes:
    """A child whose executor, finding it ABANDONED (its parent dropped the future), dies in
    the free of its block, before the commit (``free_unread_child``; its result
    ``bytes(nbytes)`` is stashed if too big for the slab). Writes its executor's pid into the
    FIFO ``started`` and waits at ``gate_path`` before it returns."""
    worker = _current()
    worker.free_child = lambda handle: os._exit(3)
    with open(started, "wb") as fifo:
        fifo.write(str(os.getpid()).encode())
    with open(gate_path, "rb") as fifo:
        fifo.read(1)
    return bytes(nbytes)


def drop_a_stolen_child(started: str, gate_path: str, nbytes: int) -> None:
    """Spawn ``child_dies_freeing_itself``, wait until a peer stole it, drop its future (the
    child is ABANDONED: its executor frees its block) and return."""
    worker = _current()
    child = mpsched.submit(child_dies_freeing_itself, started, gate_path, nbytes)
    while not child.running():  # this worker takes nothing meanwhile: only a peer can steal it
        pass
    del child
    worker.release_abandoned()


def die_freeing_a_dropped_done_child(nbytes: int) -> None:
    """Spawn a child (result ``bytes(nbytes)``, stashed if too big for the slab), wait until a
    peer ran it (DONE), then drop its future and die in the free of its block, before the
    commit (``release_abandoned``: this worker saw DONE, so the block is its to free)."""
    worker = _current()
    child = mpsched.submit(bytes, nbytes)
    handle = child._handle
    while worker.child_state(handle) != ChildState.DONE:  # only a peer can run it
        pass
    worker.free_child = lambda handle: os._exit(3)
    del child
    worker.release_abandoned()


def die_freeing_a_joined_child(nbytes: int) -> None:
    """Join a child that a peer stole (its result ``bytes(nbytes)``, stashed if too big for
    the slab), then die in the free of its block, waiting for the allocator lock (as a SIGKILL
    there does, while a peer holds that lock)."""
    worker = _current()
    child = mpsched.submit(bytes, nbytes)
    while worker.me.in_deque(child._handle):  # only a peer can take it meanwhile
        pass
    worker.slab._acquire = lambda *args: os._exit(3)
    child.result()


def _keep_socket_open(worker: Any, release: str) -> None:
    """Fork a helper that keeps ``worker``'s socket open (so the coordinator does not see the
    worker's death) until the test writes to the FIFO ``release``. A forked process lets go of
    the worker's socket (``_worker._forked_by_a_task``): the helper keeps it through a copy of
    the fd that the worker does not know of."""
    gate = os.open(release, os.O_RDONLY | os.O_NONBLOCK)  # open before the test writes to it
    socket_copy = os.dup(worker.conn.fileno())
    if os.fork() == 0:
        try:
            select.select([gate], [], [], HELPER_MAX_S)
        finally:
            os._exit(0)
    os.close(gate)
    os.close(socket_copy)


def child_dies_inside_its_done(started: str, release: str, value: int) -> None:
    """A stolen child whose executor dies inside ``finish_child``'s exchange, after the DONE
    store and before the pop of its run-stack record, holding the parent's slot lock (its
    result ``value`` is written). The coordinator sees the death only once the test writes
    to ``release``; the executor's pid goes to the FIFO ``started``."""
    from mpsched._payloads import BlockField
    from mpsched._protocol import ResultStatus
    from mpsched._serialize import dumps

    worker = _current()
    handle = worker.me.running()[-1]
    parent = worker.slots[worker.slab.get_word(handle, BlockField.PARENT)]
    _keep_socket_open(worker, release)
    assert worker.slab.write_result(handle, ResultStatus.OK, dumps(value))
    parent._acquire()
    parent._w[HOLDER_PID] = os.getpid()
    worker.slab.set_state(handle, ChildState.DONE)  # the exchange's commit; no pop
    with open(started, "wb") as fifo:
        fifo.write(str(os.getpid()).encode())
    os.kill(os.getpid(), signal.SIGKILL)


def join_a_child_whose_executor_dies_inside_done(
    started: str, release: str, report: str, gate_path: str
) -> tuple[bool, int]:
    """Join ``child_dies_inside_its_done`` (stolen by the peer); once the coordinator repaired
    this slot's lock, the child's result is read and its block freed: spawn a new child,
    which takes that block again (the free stack is LIFO). Write whether it did into the FIFO
    ``report``, wait at ``gate_path`` (the test lets the coordinator recover the executor
    meanwhile), then join the new child. Returns (block reused, the new child's result)."""
    worker = _current()
    child = mpsched.submit(child_dies_inside_its_done, started, release, 7)
    while worker.me.in_deque(child._handle):  # only a peer can take it meanwhile
        pass
    old = child._handle
    assert child.result() == 7
    again = mpsched.submit(abs, -5)
    reused = again._handle == old
    with open(report, "wb") as fifo:
        fifo.write(b"1" if reused else b"0")
    with open(gate_path, "rb") as fifo:
        fifo.read(1)
    return reused, again.result()


def die_between_a_fetch_and_its_zeroing(nbytes: int) -> None:
    """Join a child that a peer stole (its result ``bytes(nbytes)``, stashed), then die right
    after the coordinator answered the FETCH of that result, before ``collect_child`` zeroes
    the block's ``result_nbytes``: the bytes are taken, yet the block still names their key."""
    worker = _current()
    child = mpsched.submit(bytes, nbytes)
    while worker.me.in_deque(child._handle):  # only a peer can take it meanwhile
        pass
    real_fetch = worker.fetch

    def fetch_then_die(key: int) -> bytes:
        real_fetch(key)
        os._exit(3)

    worker.fetch = fetch_then_die
    child.result()


def die_after_a_full_deque_refused_a_stashed_child(nbytes: int) -> None:
    """Spawn a child with ``nbytes`` of arguments (stashed: too big for a chain of blocks)
    into a deque that refuses it (full: the child runs inline), and die right after the
    child's block is freed."""
    worker = _current()
    worker.me.push = lambda handle: False
    free = worker.slab.free_children

    def free_then_die(handles: Any) -> None:
        free(handles)
        os._exit(3)

    worker.slab.free_children = free_then_die
    mpsched.submit(len, bytes(nbytes))
