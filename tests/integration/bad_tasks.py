"""Bad input for the crash/bad-input matrix (``test_bad_input.py``): objects that fail or exit
when pickled or unpickled (after CPython's test_concurrent_futures/test_deadlock.py), and tasks
that exit, crash, recurse, fork or start threads. Module-level, so workers import them."""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import threading
from typing import Any

import mpsched

BIG = 200 * 1024 * 1024  # bytes: the "200 MB" argument and results
CHILD_TIMEOUT = 5.0  # s; a child's future that hangs fails its case (within CASE_TIMEOUT)


def _raise(exc: BaseException) -> None:
    raise exc


def _exit_now(code: int) -> None:
    os._exit(code)


class ErrorAtPickle:
    """Pickling raises a PicklingError."""

    def __reduce__(self) -> Any:
        raise pickle.PicklingError("error at pickle")


class ExitAtPickle:
    """Pickling raises SystemExit (a BaseException, not an Exception)."""

    def __reduce__(self) -> Any:
        raise SystemExit("exit at pickle")


class InterruptAtPickle:
    """Pickling raises KeyboardInterrupt (a BaseException, not an Exception)."""

    def __reduce__(self) -> Any:
        raise KeyboardInterrupt("interrupt at pickle")


def exit_at_pickle_at(i: int, bad: int) -> Any:
    """``i``, or at ``bad`` a result whose pickling raises SystemExit."""
    return ExitAtPickle() if i == bad else i


class ErrorAtUnpickle:
    """Pickles fine; unpickling raises a ValueError."""

    def __reduce__(self) -> Any:
        return _raise, (ValueError("error at unpickle"),)


class ExitAtUnpickle:
    """Pickles fine; unpickling raises SystemExit."""

    def __reduce__(self) -> Any:
        return _raise, (SystemExit("exit at unpickle"),)


class InterruptAtUnpickle:
    """Pickles fine; unpickling raises KeyboardInterrupt."""

    def __reduce__(self) -> Any:
        return _raise, (KeyboardInterrupt("interrupt at unpickle"),)


class CrashAtUnpickle:
    """Pickles fine; unpickling ends the process with ``os._exit(7)``."""

    def __reduce__(self) -> Any:
        return _exit_now, (7,)


class TwoArgError(Exception):
    """Pickles (as ``(cls, args)``) but cannot be unpickled: ``__init__`` needs two arguments
    and ``args`` holds one (the classic custom-exception mistake)."""

    def __init__(self, what: str, extra: int) -> None:
        super().__init__(f"{what} ({extra})")


class HostileError(Exception):
    """Cannot be pickled, and even its ``repr()`` and ``str()`` raise."""

    def __reduce__(self) -> Any:
        raise TypeError("HostileError cannot be pickled")

    def __repr__(self) -> str:
        raise RuntimeError("HostileError has no repr")

    def __str__(self) -> str:
        raise RuntimeError("HostileError has no str")


class HostileCallable:
    """A callable that cannot be pickled, and whose ``repr()`` raises."""

    def __call__(self) -> None:
        pass

    def __reduce__(self) -> Any:
        raise TypeError("HostileCallable cannot be pickled")

    def __repr__(self) -> str:
        raise RuntimeError("HostileCallable has no repr")


class ExitAtPickleError(Exception):
    """An exception whose pickling raises SystemExit."""

    def __reduce__(self) -> Any:
        raise SystemExit("exit while pickling the exception")


class NotAnExceptionAtUnpickle(Exception):
    """Pickles fine, but unpickles as a ``str``, not as an exception."""

    def __reduce__(self) -> Any:
        return str, ("not an exception",)


class ReprRaisesError(Exception):
    """Travels fine, but its ``repr()`` raises (user code that an error message may call)."""

    def __repr__(self) -> str:
        raise RuntimeError("ReprRaisesError has no repr")


class ReprRaisesAtUnpickle:
    """Pickles fine; unpickling raises an exception whose ``repr()`` raises too."""

    def __reduce__(self) -> Any:
        return _raise, (ReprRaisesError("at unpickle"),)


def return_instance(cls: type) -> Any:
    return cls()


def raise_error(kind: str) -> None:
    """Raise an exception that does not travel well (``kind`` selects it)."""
    if kind == "unpicklable-arg":
        raise ValueError(threading.Lock())
    if kind == "two-arg":
        raise TwoArgError("bad exception", 2)
    if kind == "hostile":
        raise HostileError
    if kind == "exit-at-pickle":
        raise ExitAtPickleError("boom")
    if kind == "not-an-exception":
        raise NotAnExceptionAtUnpickle("boom")
    raise AssertionError(kind)


def recurse(n: int = 0) -> int:
    return recurse(n + 1) + 1


def exit_process(code: int) -> None:
    os._exit(code)


def segfault() -> None:
    faulthandler.disable()  # no traceback dump on stderr (pytest enables it; fork inherits it)
    faulthandler._sigsegv()  # type: ignore[attr-defined]


def fork_and_reap() -> tuple[int, int]:
    """Fork; the child ``_exit(0)``s at once; the parent reaps it. Returns (its exit code, this
    worker's pid)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), os.getpid()


_lingering: list[threading.Thread] = []


def start_threads(n: int, leave_one_blocked: bool) -> list[int]:
    """Run ``n`` threads to completion (each sums a range) and return their results; with
    ``leave_one_blocked``, also leave a non-daemon thread blocked for good in this worker."""
    results = [0] * n

    def work(i: int) -> None:
        results[i] = sum(range(i * 1000))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if leave_one_blocked:
        forever = threading.Event()
        t = threading.Thread(target=forever.wait, name="lingering", daemon=False)
        t.start()
        _lingering.append(t)
    return results


def big_result_of_child(n: int) -> int:
    """A child returns ``n`` bytes to this task (through the coordinator's stash)."""
    return len(mpsched.submit(make_zeros, n).result())


def child_result_asked_twice(cls: type) -> list[str]:
    """A child returns an instance of ``cls``; this task asks its future for the result twice
    (each wait bounded), then runs one more child. Returns what each of the three gave, as
    ``repr(value)`` or ``"<type>: <message>"``."""
    future = mpsched.submit(return_instance, cls)
    outcomes = []
    for _ in range(2):
        try:
            outcomes.append(repr(future.result(CHILD_TIMEOUT)))
        except BaseException as exc:  # what the future raised, whatever it is, is the outcome
            outcomes.append(f"{type(exc).__name__}: {exc}")
    del future
    outcomes.append(repr(mpsched.submit(size_of, b"ok").result(CHILD_TIMEOUT)))
    return outcomes


def nest_then_submit_bad_argument(depth: int) -> str:
    """Nest ``depth`` more tasks (each waits for its child; past the run stack's depth a worker
    runs children inline), then submit a child whose argument cannot be unpickled. Says which
    raised, ``submit()`` or the child's ``result()``, and what."""
    if depth:
        return str(mpsched.submit(nest_then_submit_bad_argument, depth - 1).result())
    try:
        future = mpsched.submit(size_of, ErrorAtUnpickle())
    except BaseException as exc:  # what submit() raised is the outcome
        return f"submit() raised {exc!r}"
    try:
        return f"result() returned {future.result(CHILD_TIMEOUT)!r}"
    except BaseException as exc:
        return f"result() raised {exc!r}"


def make_zeros(n: int) -> bytes:
    return bytes(n)


def size_of(data: bytes) -> int:
    return len(data)


class ShiftyId:
    """A task id whose hash changes at every call: the id breaks the dict contract that ids are
    matched by, so the pool may break, but every future must still end."""

    calls = 0

    def __hash__(self) -> int:
        ShiftyId.calls += 1
        return ShiftyId.calls

    def __eq__(self, other: object) -> bool:
        return self is other


def _eventfds() -> list[int]:
    """This process's eventfds, lowest first (a worker's: one per slot, slot order)."""
    fds = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if "eventfd" in os.readlink(f"/proc/self/fd/{name}"):
                fds.append(int(name))
        except OSError:  # the listing's own fd, closed meanwhile
            continue
    return sorted(fds)


def close_wake_fd(slot: int | None = None, file: str | None = None) -> int:
    """Close this worker's copy of slot ``slot``'s wake-up eventfd (a stray ``os.close``; None:
    the peer's, in a pool of 2 workers); returns the fd closed. With ``file``, that file takes
    its place (``os.dup2``, as an ``open`` after the close would take the lowest free fd)."""
    if slot is None:
        slot = 1 - mpsched.current_task().worker_id
    fd = _eventfds()[slot]
    if file is None:
        os.close(fd)
    else:
        opened = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(opened, fd)
        os.close(opened)
    return fd


def close_signal_pipe(end: str) -> None:
    """Close one end of this worker's signal wake-up pipe (a stray ``os.close``): ``write``,
    the process's wakeup fd; ``read``, the end its sleep polls."""
    if end == "write":
        os.close(signal.set_wakeup_fd(-1))
    else:
        worker = mpsched._children._current
        assert worker is not None
        os.close(worker.signal_fd)


def _raise_timeout(signum: int, frame: Any) -> None:
    raise TimeoutError("the task's own time limit")


def fib_under_alarm(n: int, seconds: float) -> int:
    """``tasks.fib`` bounded by the task's own SIGALRM timer, whose handler raises (a common
    way to limit a run's time): the alarm may fire anywhere in the fork-join, mpsched's code
    in ``mpsched.submit`` and the joins included."""
    from . import tasks

    previous = signal.signal(signal.SIGALRM, _raise_timeout)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return tasks.fib(n)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def send_on(conn: Any, value: Any) -> None:
    """Send ``value`` on ``conn``, a multiprocessing ``Connection`` given as an argument."""
    conn.send(value)


def pipe_end() -> Any:
    """Return one end of a pipe made here (a ``Connection`` as a task's result)."""
    import multiprocessing

    return multiprocessing.Pipe()[0]


def open_for_reading(path: str) -> Any:
    """Return ``path`` opened as a text file (an open file as a task's result)."""
    return open(path)


# The futures that a WaitsAtUnpickle's unpickling waits for, in the pool's process.
WAITED: list[Any] = []


def _wait_then_make(*args: Any) -> WaitsAtUnpickleError:
    if WAITED:
        WAITED[0].result()  # no timeout
    return WaitsAtUnpickleError(*args)


class WaitsAtUnpickleError(Exception):
    """Unpickled in the pool's process (where the pool settles futures), it waits for
    ``WAITED[0]`` first."""

    def __reduce__(self) -> Any:
        return _wait_then_make, self.args


def raise_waits_at_unpickle(message: str) -> None:
    raise WaitsAtUnpickleError(message)
