"""The coordinator's stash (payloads too big for a block chain) at the edges of its lifetime:
deaths between a STASH and the push that hands its key over, and a user thread that collects a
stashed result before the coordinator thread has read its STASH."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from mpsched import Pool, WorkerCrashedError, _coord_drain, _payloads, _pool, _protocol, _worker
from mpsched._coordinator import Coordinator
from mpsched._protocol import Tag
from mpsched._worker import Worker

from . import edge_tasks as et
from . import tasks
from .conditions import start_every_worker

BIG = 500_000  # more than a block chain holds: it goes through the stash


def _poll(condition: Any, what: str) -> None:
    deadline = time.monotonic() + 20
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


@pytest.mark.timeout(60)
def test_stashed_arguments_and_results_travel_byte_for_byte() -> None:
    """Raw frames (``_protocol.send_data``) carry a stash's bytes both ways, to each worker."""
    data = os.urandom(3 * BIG)
    with Pool(2) as pool:
        futures = [pool.submit(tasks.ident, data) for _ in range(6)]
        assert all(f.result(timeout=30) == data for f in futures)
        assert pool._coordinator.stash == {}


@pytest.mark.timeout(60)
def test_submit_lets_the_gil_go_after_a_payload_for_the_stash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A caller submitting big payloads one after another starved the coordinator thread,
    which answers the workers' FETCHes: ``submit`` sleeps 0 s after a payload past a chain."""
    sleeps: list[float] = []
    real_sleep = time.sleep

    def noted_sleep(seconds: float) -> None:
        if threading.current_thread() is threading.main_thread():
            sleeps.append(seconds)
        real_sleep(seconds)

    with Pool(2) as pool:
        assert pool.submit(tasks.ident, 0).result(timeout=20) == 0
        monkeypatch.setattr(_pool.time, "sleep", noted_sleep)
        small = pool.submit(len, b"s" * (_pool.YIELD_AFTER_BYTES // 2))
        assert sleeps == []
        big = pool.submit(len, b"b" * _pool.YIELD_AFTER_BYTES)
        assert sleeps == [0]
        assert small.result(timeout=20) == _pool.YIELD_AFTER_BYTES // 2
        assert big.result(timeout=20) == _pool.YIELD_AFTER_BYTES


@pytest.mark.timeout(60)
def test_a_worker_killed_inside_a_raw_frame_fails_only_its_task(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A STASH cut off in the middle of its bytes: the coordinator reads an end of file inside
    the frame, takes the worker for dead (as for a torn pickled frame), fails its task, and
    replaces it; nothing of the half-sent bytes stays."""

    def half_then_die(conn: Any, tag: int, key: int, data: bytes) -> None:
        if tag == Tag.STASH:
            header = _protocol._RAW_HEADER
            frame = _protocol._LENGTH.pack(header.size + len(data))
            frame += header.pack(_protocol._RAW_MARK, tag, key)
            os.write(conn.fileno(), frame + data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        real_send(conn, tag, key, data)

    real_send = _worker.send_data
    monkeypatch.setattr(_worker, "send_data", half_then_die)
    pool = Pool(1, start_method="fork")  # the worker inherits the patch
    try:
        with pytest.raises(WorkerCrashedError):
            pool.submit(tasks.make_bytes, BIG).result(timeout=20)
        assert pool.submit(tasks.ident, 1).result(timeout=20) == 1  # replaced
        assert pool.statistics().crashes == 1
        assert pool._coordinator.stash == {}
    finally:
        pool.shutdown(wait=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nested", [False, True], ids=["top-level", "child"])
def test_a_worker_dying_after_stashing_a_result_leaves_no_stash(
    nested: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker sends a big result's STASH before the push that hands its key over (the done
    ring for a top-level task, DONE in the block for a child). Dying in between, it left the
    bytes in the stash for ever: the crash recovery settles the task from its run stack and
    frees (or overwrites) the block without looking at its stashed result."""
    real_stash = Worker.stash

    def stash_then_die(self: Worker, data: bytes, *where: int) -> int:
        key = real_stash(self, data, *where)
        if len(data) >= BIG:  # the result (arguments here are small)
            os.kill(os.getpid(), signal.SIGKILL)
        return key

    monkeypatch.setattr(Worker, "stash", stash_then_die)
    pool = Pool(1, start_method="fork")  # the workers inherit the patched Worker
    try:
        fn, arg = (tasks.nested_big, BIG) if nested else (tasks.make_bytes, BIG)
        with pytest.raises(WorkerCrashedError):
            pool.submit(fn, arg).result(timeout=20)
        assert pool.submit(tasks.ident, 1).result(timeout=20) == 1  # replaced
        assert pool.statistics().crashes == 1
        assert pool._coordinator.stash == {}
        slab = pool._views.slab
        assert slab.free_count() == slab.capacity
    finally:
        pool.shutdown(wait=True)


@pytest.mark.timeout(60)
def test_a_user_thread_collector_leaves_an_unarrived_stash_to_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A caller of result() collects the done rings itself (help_wait). When a result's STASH
    was not read yet (only the coordinator thread reads sockets), it waited for it; if the wait
    failed (timed out, or interrupted), the task failed with BrokenPoolError although the pool
    was not broken, result() raised the internal error, and the STASH that came later stayed
    in the stash for ever. Here the loop holds the STASH until the caller's help has ended."""
    monkeypatch.setattr(_coord_drain, "DRAIN_TIMEOUT", 0.2)  # the caller's wait, if it waits
    stash_read = threading.Event()
    release = threading.Event()
    helped = threading.Event()
    real_message = Coordinator.on_worker_message
    real_help = Coordinator.help_wait

    def hold_stash(self: Coordinator, worker: Any, tag: int, fields: tuple[Any, ...]) -> None:
        if tag == Tag.STASH:
            stash_read.set()
            assert release.wait(20)
        real_message(self, worker, tag, fields)

    def help_then_note(self: Coordinator, future: Any, timeout: float | None = None) -> None:
        try:
            real_help(self, future, timeout)
        finally:
            helped.set()

    with Pool(1) as pool:
        assert pool.submit(tasks.ident, 0).result(timeout=20) == 0  # the worker is registered
        monkeypatch.setattr(Coordinator, "on_worker_message", hold_stash)
        monkeypatch.setattr(Coordinator, "help_wait", help_then_note)
        big = pool.submit(tasks.make_bytes, BIG)
        try:
            assert stash_read.wait(20)  # the loop is held; the result's handle is on its way
            slot = pool._views.slots[0]
            _poll(lambda: slot.done_depth() == 1, "the result never reached the done ring")
            outcome: dict[str, Any] = {}

            def wait_result() -> None:
                try:
                    outcome["value"] = len(big.result(timeout=20))
                except BaseException as exc:
                    outcome["error"] = exc

            waiter = threading.Thread(target=wait_result)
            waiter.start()
            assert helped.wait(20)
            assert slot.done_depth() == 0  # the caller took the handle
            # Another collection in a user thread while the STASH is still unread: it leaves
            # the handle to the loop again, and returns (the loop, which alone reads the
            # STASH, may wait for collect_lock meanwhile).
            again = threading.Thread(target=pool._coordinator.collect, daemon=True)
            again.start()
            again.join(5)
            assert not again.is_alive(), "a user-thread collection spins on an unread STASH"
        finally:
            release.set()
        waiter.join(20)
        assert outcome == {"value": BIG}
        assert pool.submit(tasks.ident, 1).result(timeout=20) == 1
        assert pool._coordinator.stash == {}
        assert pool._coordinator.broken is None


@pytest.mark.timeout(60)
def test_a_dead_parents_done_child_stashed_by_an_unregistered_peer_leaves_no_stash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A peer whose SPAWNED the loop has not read yet (a worker takes tasks before that: it
    steals) ran a dead parent's child to DONE with a stashed result. The recovery frees the
    child's block and must note the STASH still unread in that peer's socket as unwanted: it
    did so only for registered peers, and this one's bytes stayed in the stash for ever. The
    zygote's messages are held here from the first registration until after the recovery.
    Chains are cut to two blocks, so that a small result is stashed: a STASH bigger than the
    socket's buffer cannot be sent before the loop reads the socket, which it does only after
    the registration (the slab short of blocks stashes small results too)."""
    monkeypatch.setattr(_payloads, "MAX_CHAIN_BLOCKS", 2)
    hold = threading.Event()
    released = threading.Event()
    stash_read = threading.Event()
    real_zygote = Coordinator.on_zygote_message
    real_exit_code = Coordinator.wait_exit_code
    real_orphan = Coordinator.orphan_children
    real_message = Coordinator.on_worker_message

    def hold_after_first(self: Coordinator, block: bool) -> None:
        if hold.is_set():
            return
        real_zygote(self, block)
        if not released.is_set() and any(w is not None for w in self.workers):
            hold.set()

    def exit_code_unknown(self: Coordinator, pid: int, timeout: float = 2.0) -> int | None:
        return real_exit_code(self, pid, 0.05) if hold.is_set() else real_exit_code(self, pid)

    def orphan_then_release(self: Coordinator, k: int, pid: int) -> None:
        real_orphan(self, k, pid)
        released.set()
        hold.clear()  # the peer registers on the loop's next pass, then its STASH is read

    def note_stash(self: Coordinator, worker: Any, tag: int, fields: tuple[Any, ...]) -> None:
        real_message(self, worker, tag, fields)
        if tag == Tag.STASH:
            stash_read.set()

    monkeypatch.setattr(Coordinator, "on_zygote_message", hold_after_first)
    monkeypatch.setattr(Coordinator, "wait_exit_code", exit_code_unknown)
    monkeypatch.setattr(Coordinator, "orphan_children", orphan_then_release)
    monkeypatch.setattr(Coordinator, "on_worker_message", note_stash)
    with Pool(2, start_method="fork") as pool:  # the workers inherit the short chains
        coordinator = pool._coordinator
        assert hold.wait(20)
        registered = [k for k, w in enumerate(coordinator.workers) if w is not None]
        assert len(registered) == 1
        assert coordinator.starting or coordinator.dormant  # the other is not registered
        worker = coordinator.workers[registered[0]]
        assert worker is not None
        pid = worker.pid
        # Until the parent runs in the registered worker (the other one may steal it first).
        for _ in range(100):
            parent = pool.submit(et.die_after_a_peer_ran_a_big_child_in, pid, 10_000)
            if parent.exception(timeout=20) is not None or parent.result():
                break
        assert isinstance(parent.exception(), WorkerCrashedError)
        assert stash_read.wait(20)
        assert pool.submit(tasks.ident, 1).result(timeout=20) == 1
        assert coordinator.stash == {}
        assert coordinator.unwanted_stash == set()


@pytest.mark.timeout(60)
def test_a_fetcher_dying_while_its_fetch_waits_for_the_stash_fails_no_other_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer claimed a child whose arguments its spawner stashed, and its FETCH came before the
    spawner's STASH (different sockets): the coordinator parks the FETCH. The peer died there.
    When the STASH came, the answer went to the dead peer's closed socket; the OSError was taken
    for the death of the spawner, a live worker (its task failed, its slot was respawned
    beside it), and the arguments were left in the stash. Here the spawner's socket is not read
    until the peer's death has been recovered (chains cut to two blocks: a small payload is
    stashed and fits in the socket's buffer, so the spawner does not wait for the read)."""
    monkeypatch.setattr(_payloads, "MAX_CHAIN_BLOCKS", 2)
    started, gate = str(tmp_path / "started"), str(tmp_path / "gate")
    os.mkfifo(started)
    os.mkfifo(gate)
    held: list[int] = []  # the spawner's socket, not read while listed
    real_readable = Coordinator.on_worker_readable

    def skip_held(self: Coordinator, worker: Any) -> None:
        if worker.conn.fileno() not in held:
            real_readable(self, worker)

    monkeypatch.setattr(Coordinator, "on_worker_readable", skip_held)
    with Pool(2, start_method="fork") as pool:  # the workers inherit the short chains
        coordinator = pool._coordinator
        start_every_worker(pool)
        # Both listed: a slot leaves ``starting`` before its worker is (its socket comes next),
        # and the task may run in a worker that the coordinator thread has yet to list.
        _poll(
            lambda: not coordinator.starting and None not in coordinator.workers,
            "the workers never registered",
        )
        parent = pool.submit(et.spawn_big_args_child_for_a_peer, started, gate, 10_000)
        with open(started, "rb") as fifo:
            pid = int(fifo.read())
        spawner = next(w for w in coordinator.workers if w is not None and w.pid == pid)
        held.append(spawner.conn.fileno())
        tasks.open_gate(gate)
        _poll(lambda: bool(coordinator.parked_fetches), "the peer's FETCH was never parked")
        fetcher = next(w for w in coordinator.workers if w is not None and w is not spawner)
        os.kill(fetcher.pid, signal.SIGKILL)
        _poll(lambda: coordinator.workers[fetcher.slot] is not fetcher, "the death is not seen")
        assert parent.result(timeout=20) == 1  # its child failed with the crash: DONE
        held.clear()  # the STASH is read on the loop's next pass
        _poll(lambda: not coordinator.unwanted_stash, "the STASH never came")
        assert [pool.submit(tasks.ident, i).result(timeout=20) for i in range(4)] == [0, 1, 2, 3]
        assert coordinator.workers[spawner.slot] is spawner
        assert pool.statistics().crashes == 1
        assert coordinator.stash == {}
        assert coordinator.parked_fetches == {}


class _TakeThenInterrupt(dict):  # type: ignore[type-arg]
    """The coordinator's stash, whose next take of an entry (``pop`` or ``del``) in the main
    thread is followed by a Ctrl-C's KeyboardInterrupt (one that lands right after it)."""

    armed = True

    def interrupt(self) -> None:
        if self.armed and threading.current_thread() is threading.main_thread():
            self.armed = False
            raise KeyboardInterrupt

    def pop(self, *args: Any) -> Any:
        value = super().pop(*args)
        self.interrupt()
        return value

    def __delitem__(self, key: Any) -> None:
        super().__delitem__(key)
        self.interrupt()


@pytest.mark.timeout(60)
def test_a_user_thread_collector_interrupted_after_taking_a_stashed_result_loses_it_not() -> None:
    """A collector in a user thread (``help_wait``) took a stashed result out of the stash and
    a Ctrl-C hit it before the result was settled: the handle is left to the loop (``unread``)
    with the rest of its batch, but its bytes were gone, and the loop waited in the worker's
    socket for a STASH that had come already: the pool hung, and so did the shutdown."""
    with Pool(1) as pool:
        assert pool.submit(tasks.ident, 0).result(timeout=20) == 0
        coordinator = pool._coordinator
        slot = pool._views.slots[0]
        # The loop reads the STASH and skips its collections until this is set: the result is
        # left to the collector below. (Holding collect_lock instead stopped the loop before
        # it read the STASH whenever it woke first for another reason: a sweep, a dispatch.)
        loop_collects = threading.Event()
        real_collect = coordinator.collect

        def collect() -> None:
            if loop_collects.is_set():
                real_collect()

        coordinator.collect = collect  # type: ignore[method-assign]
        try:
            big = pool.submit(tasks.make_bytes, BIG)
            _poll(lambda: bool(coordinator.stash) and slot.done_depth() == 1, "no result")
            coordinator.stash = _TakeThenInterrupt(coordinator.stash)
            with coordinator.collect_lock, pytest.raises(KeyboardInterrupt):
                coordinator.collect_locked(False)  # what help_wait runs, interrupted
        finally:
            loop_collects.set()
            pool._wakeup.wakeup()
        assert len(big.result(timeout=20)) == BIG
        assert pool.submit(tasks.ident, 1).result(timeout=20) == 1
        assert coordinator.stash == {}
        assert coordinator.broken is None


class _DeleteThenInterrupt(dict):  # type: ignore[type-arg]
    """``Coordinator.by_handle``, whose next ``del`` in the main thread is followed by a
    Ctrl-C's KeyboardInterrupt."""

    armed = True

    def __delitem__(self, key: Any) -> None:
        super().__delitem__(key)
        if self.armed and threading.current_thread() is threading.main_thread():
            self.armed = False
            raise KeyboardInterrupt


@pytest.mark.timeout(60)
def test_a_user_thread_collector_interrupted_after_taking_a_task_out_settles_it() -> None:
    """The same Ctrl-C, between a collector's removal of a task from ``by_handle`` and the
    keeping of its outcome (a result in its block): the handle was left to the loop, which
    found no task for it ("completed unknown task blocks") and broke the pool."""
    with Pool(1) as pool:
        assert pool.submit(tasks.ident, 0).result(timeout=20) == 0
        coordinator = pool._coordinator
        slot = pool._views.slots[0]
        coordinator.collect_lock.acquire()  # the loop waits for this before it collects
        try:
            small = pool.submit(tasks.ident, 7)
            _poll(lambda: slot.done_depth() == 1, "no result")
            with coordinator.lock:
                coordinator.by_handle = _DeleteThenInterrupt(coordinator.by_handle)
            with pytest.raises(KeyboardInterrupt):
                coordinator.collect_locked(False)  # what help_wait runs, interrupted
        finally:
            coordinator.collect_lock.release()
        assert small.result(timeout=20) == 7
        assert pool.submit(tasks.ident, 1).result(timeout=20) == 1
        assert coordinator.broken is None
