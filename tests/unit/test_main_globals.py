"""A ``__main__`` function's copy by value follows the globals it captured (``_serialize``).

The function table holds a ``__main__`` function as its name plus a copy by value (cloudpickle),
which holds the globals the function read when the copy was made. A worker that lacks the name
runs the copy: a global rebound in the pool's process since must make a fresh copy, without
filling the table when rebound in a loop, and without a cost to importable functions.
"""

from __future__ import annotations

import contextlib
import pickle
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import pytest

from mpsched._function_cache import MAIN_RETABLE_MAX, FunctionCache
from mpsched._serialize import INLINE, decode_call
from tests.unit import globals_tasks

pytestmark = pytest.mark.timeout(60)

MAIN_SOURCE = """
factor = 1

def scaled(x):
    return x * factor

def parent(x):  # calls another __main__ function: the copy carries that one's copy too
    return scaled(x) + 1000

def deco(fn):
    def wrapper(x):
        return fn(x)
    wrapper.__qualname__ = wrapper.__name__ = fn.__name__
    return wrapper

@deco
def wrapped(x):  # its closure holds the function decorated, whose globals the copy carries
    return x * factor + 2000

def late_user(x):  # reads a global not defined yet
    return x * later

def stepper():
    step = 1
    def stepped(x):  # a closure over state that set_step rebinds (a decorator's counter)
        return x + 100 * step
    def set_step(value):
        nonlocal step
        step = value
    stepped.__qualname__ = "stepped"  # as functools.wraps names a decorated function
    return stepped, set_step

stepped, set_step = stepper()
"""


class Table:
    """The function table's ``add``, in memory, with room for ``max_fids`` functions."""

    def __init__(self, max_fids: int = 4096) -> None:
        self.entries: list[bytes] = []
        self.max_fids = max_fids

    def add(self, data: bytes) -> int:
        if len(self.entries) >= self.max_fids:
            return INLINE
        self.entries.append(data)
        return len(self.entries) - 1


class Main:
    """Functions of a script's ``__main__``: ``ns`` is their globals. The pool's process has
    their names (``sys.modules["__main__"]``); ``run`` decodes a payload as a worker whose
    ``__main__`` lacks them (``python -c``, a notebook), or holds ``worker_names``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ns: dict[str, Any] = {"__name__": "__main__"}
        exec(MAIN_SOURCE, self.ns)
        self.names = [k for k, v in self.ns.items() if callable(v) and not k.startswith("__")]
        self.main = sys.modules["__main__"]
        for name in self.names:
            monkeypatch.setattr(self.main, name, self.ns[name], raising=False)

    def __getitem__(self, name: str) -> Any:
        return self.ns[name]

    def run(self, table: Table, payload: bytes, worker_names: dict[str, Any] | None = None) -> Any:
        fid, fn, args, kwargs, _ = decode_call(payload)
        with self._as_worker(worker_names or {}):
            if fid != INLINE:
                fn = pickle.loads(table.entries[fid])
            return fn(*args, **kwargs)

    @contextlib.contextmanager
    def _as_worker(self, worker_names: dict[str, Any]) -> Iterator[None]:
        saved = {name: getattr(self.main, name) for name in self.names}
        for name in self.names:
            delattr(self.main, name)
        for name, value in worker_names.items():
            setattr(self.main, name, value)
        try:
            yield
        finally:
            for name in worker_names:
                delattr(self.main, name)
            for name, value in saved.items():
                setattr(self.main, name, value)


@pytest.fixture
def main(monkeypatch: pytest.MonkeyPatch) -> Main:
    return Main(monkeypatch)


def test_a_rebound_global_makes_a_fresh_copy(main: Main) -> None:
    table = Table()
    cache = FunctionCache(table.add)
    assert main.run(table, cache.encode(main["scaled"], (1,), {})) == 1
    assert main.run(table, cache.encode(main["scaled"], (1,), {})) == 1
    assert len(table.entries) == 1  # unchanged globals: the copy stays
    main.ns["factor"] = 2
    assert main.run(table, cache.encode(main["scaled"], (1,), {})) == 2
    assert main.run(table, cache.encode(main["scaled"], (1,), {}, ("id",))) == 2
    assert len(table.entries) == 2


def test_a_fresh_copy_wins_over_the_workers_own_function(main: Main) -> None:
    """A worker's ``__main__`` may hold the function (fork; spawn's run of the script again),
    with globals of its own: used until the pool's process rebinds one, then the copy."""
    table = Table()
    cache = FunctionCache(table.add)
    worker_ns: dict[str, Any] = {"__name__": "__main__"}
    exec(MAIN_SOURCE, worker_ns)
    worker_ns["factor"] = 5  # e.g. what an initializer set in the worker
    worker = {"scaled": worker_ns["scaled"]}
    assert main.run(table, cache.encode(main["scaled"], (1,), {}), worker) == 5
    main.ns["factor"] = 2
    assert main.run(table, cache.encode(main["scaled"], (1,), {}), worker) == 2


@pytest.mark.parametrize(
    ("name", "offset"),
    [("parent", 1000), ("wrapped", 2000)],
)
def test_a_global_read_by_what_the_copy_carries_is_watched(
    main: Main, name: str, offset: int
) -> None:
    """Through another __main__ function it calls, and through a closure. (A __main__ class's
    methods: in ``test_main_module``, as unpickling a class in the process that pickled it
    updates that very class.)"""
    table = Table()
    cache = FunctionCache(table.add)
    payload = cache.encode(main[name], (1,), {})
    assert decode_call(payload)[0] == 0  # tabled
    assert main.run(table, payload) == 1 + offset
    main.ns["factor"] = 3
    assert main.run(table, cache.encode(main[name], (1,), {})) == 3 + offset


def test_a_rebound_closure_cell_makes_a_fresh_copy(main: Main) -> None:
    """A cell of the function's closure rebound (``nonlocal``) since its copy was made: the
    copy held the old value, and the lock-free hit path must check the cells too."""
    table = Table()
    cache = FunctionCache(table.add)
    assert main.run(table, cache.encode(main["stepped"], (1,), {})) == 101
    assert main.run(table, cache.encode(main["stepped"], (1,), {})) == 101
    assert len(table.entries) == 1
    main["set_step"](5)
    assert main.run(table, cache.encode(main["stepped"], (1,), {})) == 501


def test_a_redefined_callee_makes_a_fresh_copy(main: Main) -> None:
    table = Table()
    cache = FunctionCache(table.add)
    assert main.run(table, cache.encode(main["parent"], (2,), {})) == 1002
    exec("def scaled(x):\n    return -x\n", main.ns)  # a notebook cell run again
    assert main.run(table, cache.encode(main["parent"], (2,), {})) == 998


def test_a_global_defined_after_the_first_submit_is_seen(main: Main) -> None:
    table = Table()
    cache = FunctionCache(table.add)
    with pytest.raises(NameError):
        main.run(table, cache.encode(main["late_user"], (1,), {}))
    main.ns["later"] = 7
    assert main.run(table, cache.encode(main["late_user"], (1,), {})) == 7


def test_a_global_rebound_in_a_loop_does_not_fill_the_table(main: Main) -> None:
    table = Table(max_fids=2 + MAIN_RETABLE_MAX)
    cache = FunctionCache(table.add)
    for factor in range(1000):
        main.ns["factor"] = factor
        assert main.run(table, cache.encode(main["scaled"], (1,), {})) == factor
    assert len(table.entries) == 1 + MAIN_RETABLE_MAX
    fid, *_ = decode_call(cache.encode(globals_tasks.scaled, (1,), {}))
    assert fid == 1 + MAIN_RETABLE_MAX  # room left for the next function
    # Unchanged since, the copy that goes inline is not made again.
    first, second = (cache.encode(main["scaled"], (1,), {}) for _ in range(2))
    assert first == second
    assert main.run(table, first) == 999


def test_an_importable_function_is_tabled_once_whatever_its_globals(
    main: Main, monkeypatch: pytest.MonkeyPatch
) -> None:
    """By reference, the worker reads its own module's globals: nothing to watch."""
    table = Table()
    cache = FunctionCache(table.add)
    payloads = [cache.encode(globals_tasks.scaled, (1,), {})]
    monkeypatch.setattr(globals_tasks, "FACTOR", 2)
    payloads.append(cache.encode(globals_tasks.scaled, (1,), {}))
    assert payloads[0] == payloads[1]
    assert decode_call(payloads[0])[:2] == (0, None)
    assert pickle.loads(table.entries[0]) is globals_tasks.scaled
    assert len(table.entries) == 1
    assert cache._fids == {globals_tasks.scaled: 0}
    assert not cache._main


def test_concurrent_submits_after_a_rebinding_make_one_fresh_copy(main: Main) -> None:
    table = Table()
    cache = FunctionCache(table.add)
    cache.encode(main["scaled"], (1,), {})
    main.ns["factor"] = 4
    barrier = threading.Barrier(8)
    payloads: list[bytes] = []

    def submitter() -> None:
        barrier.wait()
        payloads.append(cache.encode(main["scaled"], (1,), {}))

    threads = [threading.Thread(target=submitter) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(table.entries) == 2
    assert {main.run(table, p) for p in payloads} == {4}


def test_without_cloudpickles_private_helpers_a_superset_is_watched(
    main: Main, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``_captured`` uses cloudpickle's own rule, private to it: without it, all names."""
    import cloudpickle

    from mpsched import _function_cache

    public = types.SimpleNamespace(
        cloudpickle=types.SimpleNamespace(), dumps=cloudpickle.dumps, loads=cloudpickle.loads
    )
    monkeypatch.setattr(_function_cache, "_cloudpickle", lambda: public)
    table = Table()
    cache = FunctionCache(table.add)
    assert main.run(table, cache.encode(main["parent"], (1,), {})) == 1001
    main.ns["factor"] = 2
    assert main.run(table, cache.encode(main["parent"], (1,), {})) == 1002
    assert len(table.entries) == 2


def test_a_function_sent_as_an_argument_gets_the_current_copy(main: Main) -> None:
    """``map`` sends its function in its chunks' arguments (``FunctionCache.portable``)."""
    table = Table()
    cache = FunctionCache(table.add)
    worker_ns: dict[str, Any] = {"__name__": "__main__"}
    exec(MAIN_SOURCE, worker_ns)
    worker = {"scaled": worker_ns["scaled"]}  # the worker's own, with its own globals
    worker_ns["factor"] = 5

    def run_map() -> Any:
        payload = pickle.dumps(cache.portable(main["scaled"]))
        with main._as_worker(worker):
            return pickle.loads(payload)(1)

    assert run_map() == 5
    main.ns["factor"] = 2
    assert run_map() == 2
    assert cache.portable(globals_tasks.scaled) is globals_tasks.scaled
