"""Done-callbacks, and code woken by ``wait``/``as_completed``, that re-enter the pool.

A pool's future is settled in one of several threads (docs/design.md, "Where done-callbacks
run"): the coordinator's (a result its loop collected), a user thread blocked in ``result()``
that collects done rings itself (``help_wait``), or the user thread that cancels it
(``Future.cancel``, ``pool.cancel(id)``, a reschedule, ``shutdown(cancel_futures=True)``). In
each of these contexts a done-callback chains work (``submit``, ``schedule``, ``map``), waits
for another future of the same pool that is not done yet, cancels or queries other tasks, shuts
the pool down, or raises. None of it may hang or break the pool: the other future completes by
itself once the pool can collect it, so mpsched must not be what keeps it from completing.

Layout (two workers): ``other`` runs on one worker, held at a FIFO gate; the settled future
``f`` runs on the other one, or waits unclaimed behind a ``blocker`` there (the cancel
contexts), or waits in the timetable (the reschedule). A callback that is about to block sets
``blocking``; the test then opens the gates.

Every wait is bounded: a callback's own blocking call times out after ``CALLBACK_WAIT``, the
test's waits after ``WAIT``, so a deadlock fails the test with a message. The scene's close
then unblocks what such a deadlock leaves stuck (a collector's lock held by a thread that waits
for it itself) and ends the pool, so that the test process does not hang at its exit.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, as_completed, wait
from pathlib import Path
from typing import Any

import pytest

import mpsched
import mpsched._future
from mpsched import Pool, PoolClosedError, TaskState

from . import tasks
from .conditions import Fifos, wait_until

CALLBACK_WAIT = 3.0  # seconds a callback's own blocking call may take (a deadlock: it times out)
WAIT = 6.0  # seconds the test waits for a callback or a result
FAR = 3600.0  # seconds ahead: a timed task that stays in the timetable

CONTEXTS = ["coordinator", "collector", "future_cancel", "cancel_by_id", "supersede", "shutdown"]
ACTIONS = ["submit", "schedule", "result", "map", "cancel_state", "shutdown", "raise"]
CALLBACK_LOG = "exception calling callback for"  # the stdlib's message (concurrent.futures)


class Scene:
    """One pool, its gates, and the callback under test (see the module docstring)."""

    def __init__(self, tmp: Path, context: str) -> None:
        self.context = context
        self.tmp = tmp
        self.gates: dict[str, str] = {}
        self.opened: set[str] = set()
        for name in ("f", "other", "blocker"):
            self.gates[name] = str(tmp / f"gate-{name}")
            os.mkfifo(self.gates[name])
            os.mkfifo(str(tmp / f"started-{name}"))
        self.blocking = threading.Event()  # the callback is about to block: open the gates
        self.done = threading.Event()  # the callback returned
        self.outcome: dict[str, Any] = {}
        self.actor: threading.Thread | None = None
        self.actor_errors: list[BaseException] = []
        # The collector context holds the coordinator thread at the entry of its collect()
        # (a profile hook, as in tests/stress), so that a user thread collects.
        self.park = threading.Event()
        self.parked = threading.Event()
        self.unpark = threading.Event()
        if context == "collector":
            threading.setprofile(self._coordinator_hook)  # the threads started from here on
            try:
                self.pool = Pool(2, timed_after_shutdown=False)
            finally:
                threading.setprofile(None)  # type: ignore[arg-type]
        else:
            self.pool = Pool(2, timed_after_shutdown=False)
        self.coordinator = self.pool._coordinator

    def _coordinator_hook(self, frame: Any, event: str, arg: Any) -> None:
        if (
            event == "call"
            and self.park.is_set()
            and not self.unpark.is_set()
            and frame.f_code.co_name == "collect"
            and frame.f_globals.get("__name__") == "mpsched._coord_collect"
        ):
            self.parked.set()
            self.unpark.wait(WAIT)

    # ---------------------------------------------------------------- set-up
    def start_gated(self, name: str, value: Any) -> mpsched.Future:
        """A task that announces itself and waits at the gate ``name``; returns once it runs."""
        started = str(self.tmp / f"started-{name}")
        future = self.pool.submit(tasks.started_then_gated, started, self.gates[name], value)
        assert tasks.wait_started_within(started, WAIT), f"task {name!r} did not start"
        return future

    def arm(self) -> tuple[mpsched.Future, Callable[[], Any]]:
        """The future to settle, and the call (made in the actor thread) that settles it in
        this scene's context."""
        pool = self.pool
        self.other = self.start_gated("other", 2)
        now = time.monotonic()
        self.victim = pool.schedule("victim", now + FAR, 0, tasks.ident, 0)
        self.victim2 = pool.schedule("victim2", now + FAR, 0, tasks.ident, 0)
        context = self.context
        if context in ("coordinator", "collector"):
            f = self.start_gated("f", 1)
            if context == "coordinator":
                return f, lambda: self.open("f")
            return f, lambda: self.collect_in_this_thread(f)
        if context == "supersede":
            f = pool.schedule("f", now + FAR, 0, tasks.ident, 1)
            return f, lambda: pool.schedule("f", time.monotonic() + FAR, 0, tasks.ident, 3)
        self.blocker = self.start_gated("blocker", "blocker")  # f waits unclaimed behind it
        if context == "future_cancel":
            f = pool.submit(tasks.ident, 1)
            return f, f.cancel
        if context == "cancel_by_id":
            f = pool.schedule("f", now, 0, tasks.ident, 1)
            return f, lambda: pool.cancel("f")
        assert context == "shutdown"
        f = pool.submit(tasks.ident, 1)
        return f, lambda: pool.shutdown(wait=False, cancel_futures=True)

    def collect_in_this_thread(self, f: mpsched.Future) -> Any:
        """Hold the coordinator thread out of collecting, let ``f`` finish, and wait for it
        here: this thread collects the done ring (``help_wait``) and settles ``f``."""
        self.park.set()
        assert self.parked.wait(WAIT), "the coordinator thread was not held"
        assert self.open("f"), "f did not wait at its gate"
        deadline = time.monotonic() + WAIT
        while not any(slot.done_depth() for slot in self.coordinator.slots):
            assert time.monotonic() < deadline, "f's result never reached its done ring"
            time.sleep(0.001)
        self.coordinator.help_misses = 0  # help_wait spins (collects) on this result
        return f.result(CALLBACK_WAIT + WAIT)

    def open(self, name: str, timeout: float = WAIT) -> bool:
        if name in self.opened:
            return True
        if tasks.open_gate_within(self.gates[name], timeout):
            self.opened.add(name)
            return True
        return False

    def release(self) -> None:
        """Let everything held go on: the blocker, ``other``, the coordinator thread."""
        self.unpark.set()
        if self.context not in ("coordinator", "collector", "supersede"):
            self.open("blocker")
        self.open("other")

    # ---------------------------------------------------------------- the run
    def settle(self, settle: Callable[[], Any]) -> None:
        def actor() -> None:
            try:
                settle()
            except BaseException as exc:
                self.actor_errors.append(exc)

        self.actor = threading.Thread(target=actor, name="actor")
        self.actor.start()

    def wait_callback(self) -> None:
        """Until the callback returned; open the gates once it is about to block (or done)."""
        deadline = time.monotonic() + WAIT + CALLBACK_WAIT
        while not self.done.wait(0.005):
            if self.blocking.is_set():
                self.release()
            if time.monotonic() > deadline:
                break
        self.release()
        assert self.done.is_set(), (
            f"the done-callback never returned (settled in the {self.context} context): a deadlock"
        )

    def close(self) -> None:
        """End the pool, also after a deadlock (best effort: a test failed already then)."""
        self.release()
        actor = self.actor
        if actor is not None:
            actor.join(CALLBACK_WAIT + 1)
            deadline = time.monotonic() + WAIT
            # A thread that waits for the collector's lock it holds itself: release it for
            # it (a threading.Lock may be released by any thread) until it gets out.
            while actor.is_alive() and time.monotonic() < deadline:
                lock = self.coordinator.collect_lock
                if lock.locked():
                    with contextlib.suppress(RuntimeError):
                        lock.release()
                actor.join(0.05)
        self.pool.shutdown(wait=False, cancel_futures=True)
        for name in self.gates:  # a task still at a gate (an unfinished scene)
            self.open(name, timeout=0.05)
        assert self.pool.await_termination(WAIT), "the pool did not end"


@pytest.fixture
def scenes(tmp_path: Path) -> Iterator[Callable[[str], Scene]]:
    made: list[Scene] = []

    def make(context: str) -> Scene:
        scene = Scene(tmp_path, context)
        made.append(scene)
        return scene

    yield make
    for scene in made:
        scene.close()


def make_callback(scene: Scene, action: str) -> Callable[[mpsched.Future], None]:
    pool = scene.pool
    outcome = scene.outcome

    def callback(f: mpsched.Future) -> None:
        outcome["thread"] = threading.current_thread()
        outcome["coordinator_held"] = scene.parked.is_set() and not scene.unpark.is_set()
        outcome["done_when_called"] = f.done()
        try:
            if action == "submit":
                outcome["value"] = pool.submit(tasks.add, 40, 2)
            elif action == "schedule":
                outcome["value"] = pool.schedule("chained", time.monotonic(), 0, tasks.add, 1, 2)
            elif action == "result":
                scene.blocking.set()
                outcome["value"] = scene.other.result(CALLBACK_WAIT)
            elif action == "map":
                scene.blocking.set()
                it = pool.map(tasks.add, [1, 2], [10, 20], timeout=CALLBACK_WAIT)
                outcome["value"] = list(it)
            elif action == "cancel_state":
                cancelled = pool.cancel("victim")
                outcome["value"] = (
                    isinstance(cancelled, bool),
                    pool.state("victim"),
                    scene.victim2.cancel(),
                )
            elif action == "shutdown":
                pool.shutdown(wait=False)
                outcome["value"] = "returned"
            else:
                assert action == "raise"
                raise ValueError("a callback that raises")
        except Exception as exc:
            outcome["value"] = exc
            if action == "raise":
                raise
        finally:
            scene.done.set()

    return callback


def closed(scene: Scene) -> bool:
    return scene.context == "shutdown"


# ---------------------------------------------------------------- the matrix
@pytest.mark.timeout(30)
@pytest.mark.parametrize("action", ACTIONS)
@pytest.mark.parametrize("context", CONTEXTS)
def test_a_done_callback_re_enters_the_pool(
    scenes: Callable[[str], Scene],
    context: str,
    action: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    scene = scenes(context)
    f, settle = scene.arm()
    later: list[mpsched.Future] = []
    after = threading.Event()

    def second(future: mpsched.Future) -> None:
        later.append(future)
        after.set()

    f.add_done_callback(make_callback(scene, action))
    f.add_done_callback(second)  # a second callback still runs after one that raises
    scene.settle(settle)
    scene.wait_callback()
    scene.actor.join(WAIT)  # type: ignore[union-attr]
    assert not scene.actor_errors, scene.actor_errors
    assert scene.outcome["done_when_called"], "a callback ran before its future was done"
    if context == "collector":
        assert scene.outcome["coordinator_held"], "the interleaving was not forced"
    # A future the pool collected calls back in the pool's callback thread, whoever collected
    # it; one cancelled, in the thread that cancelled it (as the stdlib's).
    if context in ("coordinator", "collector"):
        assert scene.outcome["thread"].name == "mpsched-callbacks"
    else:
        assert scene.outcome["thread"] is scene.actor
    value = scene.outcome.get("value")
    if action in ("submit", "schedule", "map") and closed(scene):
        assert isinstance(value, PoolClosedError), value
    elif action == "submit":
        assert value.result(WAIT) == 42
    elif action == "schedule":
        assert value.result(WAIT) == 3
    elif action == "result":
        assert value == 2, f"the callback's result() of another future gave {value!r}"
    elif action == "map":
        assert value == [11, 22], f"the callback's map gave {value!r}"
    elif action == "cancel_state":
        assert value == (True, TaskState.CANCELLED, True)
    elif action == "shutdown":
        assert value == "returned"
        assert scene.other.result(WAIT) == 2
        assert scene.pool.await_termination(WAIT), "the pool did not end after the callback"
    else:
        assert isinstance(value, ValueError)
        assert after.wait(WAIT), "the callback after the one that raised did not run"
        assert later == [f]
        assert any(CALLBACK_LOG in r.getMessage() for r in caplog.records), caplog.records
        assert scene.other.result(WAIT) == 2  # the pool goes on
        if not closed(scene):
            assert scene.pool.submit(tasks.add, 1, 1).result(WAIT) == 2
    assert after.wait(WAIT), "the second callback did not run"
    assert later == [f]
    if context in ("future_cancel", "cancel_by_id", "supersede", "shutdown"):
        assert f.cancelled()
    else:
        assert f.result(WAIT) == 1


# ---------------------------------------------------------------- beyond the matrix
@pytest.mark.timeout(30)
def test_callbacks_run_when_the_callback_thread_cannot_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Python 3.12 and later start no thread once the interpreter's finalization began: a pool left
    running at exit (dropped, or shut down without waiting) whose first future with callbacks
    settled then broke, its tasks killed or failed (found in review). Here every start of the
    callback thread fails as it does then: the coordinator thread calls the callbacks itself
    (the stdlib's pools call them in their manager thread), and the pool goes on."""

    class NoNewThread(threading.Thread):
        def start(self) -> None:
            if self.name == "mpsched-callbacks":
                raise RuntimeError("can't create new thread at interpreter shutdown")
            super().start()

    monkeypatch.setattr(mpsched._future.threading, "Thread", NoNewThread)
    called: list[int] = []
    with Pool(2) as pool:
        futures = [pool.submit(tasks.ident, i) for i in range(20)]
        for f in futures:
            f.add_done_callback(lambda f: called.append(f.result()))
        assert [f.result(WAIT) for f in futures] == list(range(20))
        assert pool._coordinator.callbacks.thread is None
    assert sorted(called) == list(range(20))


@pytest.mark.timeout(30)
def test_a_callback_of_what_a_result_call_collected_runs_outside_that_call(
    scenes: Callable[[str], Scene],
) -> None:
    """A thread in ``result()`` that collects the done rings itself settles ``f``: ``f``'s
    callback used to run in that thread, inside its ``result()``, so a callback that takes a
    lock the caller holds around ``result()`` deadlocked (found in review; the stdlib's pools
    call back from their manager thread). It runs in the pool's callback thread now, and gets
    the lock once ``result()`` returned and the caller let it go."""
    scene = scenes("collector")
    f, _ = scene.arm()
    held = threading.Lock()

    def callback(_: mpsched.Future) -> None:
        scene.outcome["coordinator_held"] = not scene.unpark.is_set()
        scene.outcome["thread"] = threading.current_thread()
        got = held.acquire(timeout=CALLBACK_WAIT)
        if got:
            held.release()
        scene.outcome["got"] = got
        scene.done.set()

    def wait_holding_the_lock() -> Any:
        with held:
            return scene.collect_in_this_thread(f)

    f.add_done_callback(callback)
    scene.settle(wait_holding_the_lock)
    scene.actor.join(WAIT + CALLBACK_WAIT)  # type: ignore[union-attr]
    scene.wait_callback()
    assert not scene.actor_errors, scene.actor_errors
    assert scene.outcome["coordinator_held"], "the interleaving was not forced"
    assert scene.outcome["thread"] is not scene.actor
    assert scene.outcome["got"], "the callback ran inside result(), under the caller's lock"
    assert f.result(WAIT) == 1


@pytest.mark.timeout(30)
@pytest.mark.parametrize("context", ["coordinator", "collector"])
def test_a_done_callback_that_shuts_the_pool_down_and_waits(
    scenes: Callable[[str], Scene], context: str
) -> None:
    """``shutdown(wait=True)`` in a callback: it waits for the drain, which needs the other
    task's result collected; or, called where it would wait for itself, returns at once. Either
    way the callback returns and the pool ends."""
    scene = scenes(context)
    f, settle = scene.arm()

    def callback(_: mpsched.Future) -> None:
        try:
            scene.blocking.set()
            scene.pool.shutdown(wait=True)
            scene.outcome["value"] = "returned"
        finally:
            scene.done.set()

    f.add_done_callback(callback)
    scene.settle(settle)
    scene.wait_callback()
    assert scene.outcome.get("value") == "returned"
    assert scene.other.result(WAIT) == 2
    assert scene.pool.await_termination(WAIT), "the pool did not end"


@pytest.mark.timeout(30)
def test_a_callback_raising_a_base_exception_does_not_break_the_pool(
    scenes: Callable[[str], Scene], caplog: pytest.LogCaptureFixture
) -> None:
    """A callback of a future that the coordinator settled raises SystemExit: it is logged,
    and the pool goes on (it broke: the exception left the coordinator's loop, and every
    unfinished future failed with BrokenPoolError)."""
    scene = scenes("coordinator")
    f, settle = scene.arm()

    def callback(_: mpsched.Future) -> None:
        scene.done.set()
        raise SystemExit(3)

    f.add_done_callback(callback)
    scene.settle(settle)
    scene.wait_callback()
    scene.release()
    assert scene.other.result(WAIT) == 2, "the pool broke"
    assert scene.pool.submit(tasks.add, 1, 1).result(WAIT) == 2
    assert f.result(WAIT) == 1
    deadline = time.monotonic() + WAIT
    while not any(CALLBACK_LOG in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, "the callback's SystemExit was not logged"
        time.sleep(0.001)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["wait", "as_completed"])
@pytest.mark.parametrize("context", ["coordinator", "collector"])
def test_a_thread_woken_by_wait_re_enters_the_pool(
    scenes: Callable[[str], Scene], context: str, how: str
) -> None:
    """A thread blocked in ``wait``/``as_completed`` on ``f`` is woken while ``f`` is settled
    (the waiter is notified inside the settling thread's collection) and at once waits for
    another future, submits and cancels."""
    scene = scenes(context)
    f, settle = scene.arm()
    outcome: dict[str, Any] = {}

    def waiter() -> None:
        if how == "wait":
            done, _ = wait([f], timeout=WAIT + CALLBACK_WAIT, return_when=FIRST_COMPLETED)
        else:
            done = set(as_completed([f], timeout=WAIT + CALLBACK_WAIT))
        assert done == {f}
        scene.blocking.set()
        outcome["other"] = scene.other.result(CALLBACK_WAIT)
        outcome["submit"] = scene.pool.submit(tasks.add, 2, 2).result(CALLBACK_WAIT)
        outcome["cancel"] = scene.victim.cancel()
        scene.done.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    try:
        scene.settle(settle)
        scene.wait_callback()
    finally:
        thread.join(WAIT + CALLBACK_WAIT)
    assert outcome == {"other": 2, "submit": 4, "cancel": True}


class _HeldCallback:
    """A done-callback that says it runs (``entered``), then waits for ``proceed`` (at most
    ``WAIT``) and appends 1 to ``ran``."""

    def __init__(self) -> None:
        self.entered, self.proceed = threading.Event(), threading.Event()
        self.ran: list[int] = []

    def __call__(self, _: mpsched.Future) -> None:
        self.entered.set()
        self.proceed.wait(WAIT)
        self.ran.append(1)


@pytest.mark.timeout(30)
def test_shutdown_wait_returns_after_the_callbacks_of_what_the_pool_settled() -> None:
    """The callbacks of futures the coordinator settled run in the pool's callback thread;
    ``shutdown(wait=True)`` returns only once they ran (as when the coordinator thread itself
    ran them): a ``with Pool()`` block's results are all reported when it is left."""
    held = _HeldCallback()
    entered, proceed, ran = held.entered, held.proceed, held.ran
    seen_at_return: list[list[int]] = []

    pool = Pool(1)
    try:
        pool.submit(tasks.add, 1, 1).add_done_callback(held)
        assert entered.wait(WAIT), "the callback did not run"

        def shut() -> None:
            pool.shutdown(wait=True)
            seen_at_return.append(list(ran))

        thread = threading.Thread(target=shut)
        thread.start()
        # The pool ended under the running callback: its coordinator thread is gone.
        assert pool._coordinator.finished.wait(WAIT), "the pool did not drain"
        pool._thread.join(WAIT)
        # Unfixed, shutdown returns now; fixed, it waits for the callback (either way the
        # outcome below does not depend on this wait's length, only how soon a bug shows).
        thread.join(0.2)
        proceed.set()
        thread.join(WAIT)
        assert seen_at_return == [[1]], "shutdown(wait=True) returned before the callback ended"
    finally:
        proceed.set()
        pool.shutdown(wait=True)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("first", ["await_termination", "shutdown", "thread_ended"])
def test_a_shutdown_wait_after_the_pool_was_released_waits_for_the_callbacks(first: str) -> None:
    """An earlier call released the pool while a callback ran (``await_termination`` that
    timed out on it, or another thread's ``shutdown(wait=True)`` still waiting for it), or the
    coordinator thread ended after a ``shutdown(wait=False)``: a ``shutdown(wait=True)`` after
    that returned at once, the callback still running. It waited only while the pool was not
    released, and not in a thread with the coordinator thread's ident, which a new thread gets
    once that one ended (the OS reuses them)."""
    held = _HeldCallback()
    entered, proceed, ran = held.entered, held.proceed, held.ran
    seen_at_return: list[list[int]] = []

    def shut() -> None:
        pool.shutdown(wait=True)
        seen_at_return.append(list(ran))

    pool = Pool(1)
    threads = [threading.Thread(target=shut) for _ in range(2)]
    try:
        pool.submit(tasks.add, 1, 1).add_done_callback(held)
        assert entered.wait(WAIT), "the callback did not run"
        if first == "await_termination":
            pool.shutdown(wait=False)
            assert pool._coordinator.finished.wait(WAIT), "the pool did not drain"
            assert not pool.await_termination(timeout=0)  # released; the callback still runs
            del threads[1]
        elif first == "thread_ended":
            pool.shutdown(wait=False)
            pool._thread.join(WAIT)
            assert not pool._thread.is_alive(), "the coordinator thread did not end"
            del threads[1]
        else:
            threads[1].start()
            deadline = time.monotonic() + WAIT
            while pool._started:  # released by that shutdown, which waits for the callback
                assert time.monotonic() < deadline, "the pool was not released"
                time.sleep(0.001)
        threads[0].start()
        # Unfixed, that shutdown returns now; fixed, it waits for the callback (the outcome
        # does not depend on this wait's length, only how soon a bug shows).
        threads[0].join(0.2)
        proceed.set()
        for thread in threads:
            thread.join(WAIT)
        assert seen_at_return == [[1]] * len(threads), "a shutdown returned before the callback"
    finally:
        proceed.set()
        pool.shutdown(wait=True)


@pytest.mark.timeout(30)
def test_every_future_cancelled_by_a_shutdown_ends_cancelled_when_many_callbacks_raise(
    fifos: Fifos,
) -> None:
    """``shutdown(cancel_futures=True)`` calls the done-callbacks of the futures it cancels in
    the caller's thread: six in the ready queue, which it marks cancelled, and two in the
    worker's inbox, which it cancels against their claims. Every callback raises
    KeyboardInterrupt (as a Ctrl-C landing in them would). The first goes on to the caller once
    every future was cancelled and the other callbacks were called: the marking survived only
    two such exceptions (four futures stayed pending for ever, their waiters with them), and
    the first exception in the inbox's cancels left the rest of the inbox to run."""
    calls: list[mpsched.Future] = []

    def raising(future: mpsched.Future) -> None:
        calls.append(future)
        raise KeyboardInterrupt(f"callback {len(calls)}")

    pool = Pool(1, dispatch_window=2)
    try:
        blocker = pool.submit(tasks.started_then_gated, fifos.started, fifos.gate, 0)
        tasks.wait_started(fifos.started)  # claimed: the one worker holds it at the gate
        futures = [pool.submit(tasks.add, i, 1) for i in range(8)]
        coordinator = pool._coordinator
        # The blocker and a full inbox (the window) are handed out; the rest wait in the queue.
        wait_until(lambda: len(coordinator.by_handle) == 3, "the inbox filled")
        for future in futures:
            future.add_done_callback(raising)
        try:
            with pytest.raises(KeyboardInterrupt, match=r"^callback 1$"):
                pool.shutdown(wait=False, cancel_futures=True)
        finally:
            tasks.open_gate(fifos.gate)
        assert [f.cancelled() for f in futures] == [True] * 8
        assert len(calls) == 8
        assert blocker.result(WAIT) == 0
    finally:
        pool.shutdown(wait=True)


@pytest.mark.timeout(60)
def test_asyncio_awaits_the_pools_futures() -> None:
    """``asyncio.wrap_future`` chains a pool's future to the event loop through a done-callback
    (``call_soon_threadsafe`` from whichever thread settles it): results and errors arrive."""
    import asyncio

    async def gather(pool: Pool) -> tuple[list[Any], BaseException]:
        values = await asyncio.gather(
            *(asyncio.wrap_future(pool.submit(tasks.ident, i)) for i in range(50))
        )
        try:
            await asyncio.wrap_future(pool.submit(tasks.boom, "from a task"))
        except ValueError as exc:
            return list(values), exc
        raise AssertionError("the task's error did not reach the awaiting coroutine")

    with Pool(2) as pool:
        values, error = asyncio.run(asyncio.wait_for(gather(pool), WAIT))
    assert values == list(range(50))
    assert "from a task" in str(error)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["ready_queue", "inbox", "timed"])
def test_a_callback_of_a_future_a_shutdown_cancels_finds_the_others_cancelled(
    fifos: Fifos, where: str
) -> None:
    """A shutdown that cancels what has not started marks every future before it calls their
    callbacks: one that waited for a later future of the same shutdown (a ``wait``, or a lock
    that a thread in that future's ``result()`` holds) found it withdrawn but pending, and the
    shutdown waited for ever; in an inbox, the later task ran meanwhile (found in review).
    ``timed``: a plain shutdown of a pool with ``timed_after_shutdown=False``."""
    seen: list[bool] = []

    def waits_for_second(_: mpsched.Future) -> None:
        # Bounded, so that the unfixed code fails here rather than hangs.
        done = wait([second], timeout=CALLBACK_WAIT).done
        seen.append(done == {second} and second.cancelled())

    pool = Pool(1, dispatch_window=1 if where == "ready_queue" else 8, timed_after_shutdown=False)
    try:
        blocker = pool.submit(tasks.started_then_gated, fifos.started, fifos.gate, 0)
        tasks.wait_started(fifos.started)  # claimed: the one worker holds it at the gate
        coordinator = pool._coordinator
        if where == "timed":
            far = time.monotonic() + FAR
            first = pool.schedule("first", far, 0, tasks.ident, 1)
            second = pool.schedule("second", far, 0, tasks.ident, 2)
        else:
            if where == "ready_queue":  # the window's one place goes to a task before them
                pool.submit(tasks.ident, 0)
                wait_until(lambda: len(coordinator.by_handle) == 2, "the inbox filled")
            first = pool.submit(tasks.ident, 1)
            second = pool.submit(tasks.ident, 2)
            handed = 2 if where == "ready_queue" else 3
            wait_until(lambda: len(coordinator.by_handle) == handed, "the tasks were handed")
        first.add_done_callback(waits_for_second)
        try:
            pool.shutdown(wait=False, cancel_futures=where != "timed")
        finally:
            tasks.open_gate(fifos.gate)
        assert seen == [True]
        assert blocker.result(WAIT) == 0
    finally:
        pool.shutdown(wait=True)
