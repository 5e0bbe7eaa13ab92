"""A signal whose handler is due while the main thread is blocked in one of the pool's waits
ends that wait (``_clock.wait_interruptibly``, docs/design.md "Ctrl-C"). The shutdown's wait is
``await_termination``'s; the shutdown itself gives the GIL up before it (its map sends the rest
of its input), so the signal would not be certain to come during the wait.

Python runs a signal's handler in the main thread, when its eval loop next checks; a Ctrl-C
that came just before the thread blocked in a lock's wait, or that the kernel handed to another
thread, woke nothing, and the wait went on for as long as the task ran. Here the signal is made
to reach another thread while the main thread is blocked, every time: a helper thread sends
SIGUSR1 to itself (``pthread_kill``: its C handler runs there) as soon as it gets the GIL, and
with a switch interval far above the test's length the main thread gives the GIL up only when
it blocks. (SIGUSR1 with a handler that raises an ordinary exception stands for SIGINT and its
KeyboardInterrupt, which would stop pytest itself.)
"""

from __future__ import annotations

import os
import pathlib
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import mpsched
from mpsched import Pool

from . import tasks
from .conditions import Fifos

WATCHDOG_S = 15.0  # s; without the sliced wait, the gate opens then (the test then fails)
SWITCH_INTERVAL_S = 1000.0  # s: no thread is asked to give the GIL up during the test


class Signalled(Exception):
    """Raised by the test's SIGUSR1 handler."""


def _raise_signalled(signum: int, frame: object) -> None:
    raise Signalled


def _result(pool: Pool, first: mpsched.Future, it: Iterator[Any]) -> object:
    return first.result()


def _exception(pool: Pool, first: mpsched.Future, it: Iterator[Any]) -> object:
    return first.exception()


def _map(pool: Pool, first: mpsched.Future, it: Iterator[Any]) -> object:
    return next(it)


def _await_termination(pool: Pool, first: mpsched.Future, it: Iterator[Any]) -> object:
    return pool.await_termination()


WAITS: dict[str, Callable[[Pool, mpsched.Future, Iterator[Any]], object]] = {
    "result": _result,
    "exception": _exception,
    "map": _map,
    "await_termination": _await_termination,
}


def _open_the_gates(gates: tuple[str, str]) -> None:
    """Let the two tasks through their gates. (One FIFO for both let the second through when
    it opened the FIFO before the test's writer for the first had closed it: it read EOF.)"""
    for gate in gates:
        tasks.open_gate(gate)


def _interrupted_in_the_sliced_wait(tb: Any) -> bool:
    """The handler's exception came up through ``wait_interruptibly``: it ran during the
    pool's wait, not before it."""
    return any(frame.f_code.co_name == "wait_interruptibly" for frame, _ in traceback.walk_tb(tb))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("wait", list(WAITS))
def test_a_signal_that_reaches_another_thread_ends_a_wait_of_the_main_thread(
    wait: str, fifos: Fifos, tmp_path: pathlib.Path
) -> None:
    assert threading.current_thread() is threading.main_thread()
    gates = (fifos.gate, str(tmp_path / "second_gate"))
    os.mkfifo(gates[1])
    go = threading.Event()

    def send_to_self() -> None:
        go.wait()  # then it waits for the GIL, which the main thread holds until it blocks
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, _raise_signalled)
    try:
        with mpsched.Pool(1) as pool:
            first = pool.submit(tasks.started_then_gated, fifos.started, fifos.gate, 1)
            tasks.wait_started(fifos.started)
            # Queued behind it: more tasks than workers, so that a result() does not first
            # spin collecting (``help_wait``), whose wake-up of the loop gives the GIL up.
            second = pool.submit(tasks.gated_ident, gates[1], 2)
            it = pool.map(tasks.ident, [3])
            opened: list[int] = []

            def watchdog() -> None:  # ends the tasks, and the pool, had the wait gone on
                opened.append(1)
                _open_the_gates(gates)
                pool.shutdown(wait=False)

            timer = threading.Timer(WATCHDOG_S, watchdog)
            timer.daemon = True
            timer.start()
            sender = threading.Thread(target=send_to_self, daemon=True)
            sender.start()
            interval = sys.getswitchinterval()
            sys.setswitchinterval(SWITCH_INTERVAL_S)
            try:
                go.set()  # the sender's turn comes when the wait gives the GIL up
                with pytest.raises(Signalled) as caught:
                    WAITS[wait](pool, first, it)
            finally:
                sys.setswitchinterval(interval)
                timer.cancel()
            sender.join()
            assert not opened, "the wait lasted until the watchdog opened the gate"
            assert _interrupted_in_the_sliced_wait(caught.tb), "".join(
                traceback.format_exception(caught.value)
            )
            assert not first.done()
            _open_the_gates(gates)
            assert (first.result(), second.result()) == (1, 2)
            # An interrupted map has ended, as a generator does at an exception.
            assert list(it) == ([] if wait == "map" else [3])
    finally:
        signal.signal(signal.SIGUSR1, previous)
