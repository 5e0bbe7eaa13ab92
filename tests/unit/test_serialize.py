"""Payload encoding (``_serialize``): calls with and without a task id, errors, function table."""

from __future__ import annotations

import functools
import pickle
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpsched import _serialize
from mpsched._errors import MpschedError
from mpsched._function_cache import NAMES_SCANNED_BYTES_MAX, FunctionCache
from mpsched._protocol import PICKLE_PROTOCOL
from mpsched._serialize import (
    INLINE,
    TaskPicklingError,
    decode_call,
    encode_call,
    with_version,
)

pytestmark = pytest.mark.timeout(60)

# Task ids include falsy ones (0, "", None, False): a payload must not mistake them for "no id".
task_ids = st.one_of(
    st.integers(),
    st.text(max_size=20),
    st.none(),
    st.booleans(),
    st.tuples(st.integers(), st.text(max_size=5)),
)


def test_plain_call_round_trips_without_meta() -> None:
    data = encode_call(3, None, (1, "a"), {"k": 2})
    assert decode_call(data) == (3, None, (1, "a"), {"k": 2}, False)


@given(task_ids, st.integers(min_value=1, max_value=2**63 - 1))
def test_scheduled_call_carries_its_id_and_version(task_id: Any, version: int) -> None:
    payload = with_version(encode_call(INLINE, len, ([1, 2],), {}, (task_id,)), version)
    fid, fn, args, kwargs, meta = decode_call(memoryview(payload))  # workers read views
    assert (fid, fn, args, kwargs) == (INLINE, len, ([1, 2],), {})
    assert meta == (task_id, version)


@given(
    task_ids,
    st.integers(min_value=1, max_value=2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
)
def test_a_run_with_a_misfire_deadline_carries_it_after_its_id_and_version(
    task_id: Any, version: int, deadline: float
) -> None:
    payload = with_version(encode_call(INLINE, len, ([1, 2],), {}, (task_id,)), version, deadline)
    fid, fn, args, kwargs, meta = decode_call(memoryview(payload))
    assert (fid, fn, args, kwargs) == (INLINE, len, ([1, 2],), {})
    assert meta == (task_id, version, deadline)


def test_one_call_many_versions() -> None:
    """A recurrence encodes its call once and appends each run's version."""
    call = encode_call(0, None, (), {}, ("tick",))
    assert [decode_call(with_version(call, v))[4] for v in (1, 2, 300)] == [
        ("tick", 1),
        ("tick", 2),
        ("tick", 300),
    ]


def test_unpicklable_task_id_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="task_id must be hashable and picklable"):
        encode_call(0, None, (), {}, (threading.Lock(),))


def test_unpicklable_argument_names_the_arguments() -> None:
    with pytest.raises(TaskPicklingError, match="cannot pickle the task's arguments"):
        encode_call(0, None, (threading.Lock(),), {}, ("ok",))


def test_a_pickling_error_is_an_mpsched_error() -> None:
    """Raised on mpsched's own behalf, as its docstring says of every MpschedError: an
    ``except MpschedError`` let it through (found in review). Still a PicklingError and a
    TypeError, which code written for the stdlib's pools catches."""
    with pytest.raises(MpschedError) as caught:
        encode_call(-1, None, (threading.Lock(),), {})
    assert isinstance(caught.value, (pickle.PicklingError, TypeError))


@pytest.mark.parametrize("dump", [_serialize.dumps, _serialize.dumps_result])
def test_what_cloudpickle_takes_is_pickled_without_a_repr(dump: Callable[[Any], bytes]) -> None:
    """Plain pickle fails on a local class, cloudpickle takes it: no repr is made for an error
    message that never comes (it runs user code, at every such task's result)."""
    reprs = []

    class Local:
        def __repr__(self) -> str:
            reprs.append(1)
            return "Local()"

    assert type(pickle.loads(dump(Local()))).__name__ == "Local"
    assert reprs == []


def test_a_result_that_does_not_pickle_is_named_as_the_result() -> None:
    with pytest.raises(TaskPicklingError, match=r"cannot pickle the result <unlocked.*return"):
        _serialize.dumps_result(threading.Lock())
    with pytest.raises(TaskPicklingError, match=r"cannot pickle <unlocked.*Pass picklable"):
        _serialize.dumps(threading.Lock())


def test_lambda_goes_inline_by_value() -> None:
    offset = 5
    data = encode_call(INLINE, lambda x: x + offset, (1,), {})
    fid, fn, args, _, _ = decode_call(data)
    assert fid == INLINE
    assert fn(*args) == 6


def test_function_cache_tables_once_under_concurrency() -> None:
    added: list[bytes] = []
    barrier = threading.Barrier(8)

    def table_add(data: bytes) -> int:
        added.append(data)
        return len(added) - 1

    cache = FunctionCache(table_add)
    fids: list[int] = []

    def submitter() -> None:
        barrier.wait()
        fids.append(cache.fid(len))

    threads = [threading.Thread(target=submitter) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(added) == 1
    assert fids == [0] * 8


def test_closed_function_cache_sends_new_functions_inline() -> None:
    cache = FunctionCache(lambda data: 7)
    assert cache.fid(len) == 7
    cache.close()
    assert cache.fid(len) == 7  # already tabled: its table entry stays valid
    assert cache.fid(abs) == INLINE


def test_function_cache_encode_tables_functions_and_inlines_the_rest() -> None:
    """The pool's one-frame path: a tabled function goes by fid, a lambda by value, and an
    unpicklable argument or task id fails as ``encode_call`` says."""
    cache = FunctionCache(lambda data: 4)
    assert decode_call(cache.encode(len, ("ab",), {}, False)) == (4, None, ("ab",), {}, False)
    fid, fn, args, _, _ = decode_call(cache.encode(lambda x: x * 3, (2,), {}))
    assert (fid, fn(*args)) == (INLINE, 6)
    payload = with_version(cache.encode(abs, (-1,), {}, ("id",)), 9)
    assert decode_call(payload) == (4, None, (-1,), {}, ("id", 9))
    with pytest.raises(TaskPicklingError, match="cannot pickle the task's arguments"):
        cache.encode(len, (threading.Lock(),), {})
    with pytest.raises(TypeError, match="task_id must be hashable and picklable"):
        cache.encode(len, (), {}, (threading.Lock(),))


def _main_function() -> Callable[[int], int]:
    """A function that says it is ``__main__.mpsched_test_triple``, as a script's would."""

    def triple(x: int) -> int:
        return 3 * x

    triple.__module__ = "__main__"
    triple.__qualname__ = triple.__name__ = "mpsched_test_triple"
    return triple


@pytest.mark.parametrize("table", ["free", "full"])
def test_a_main_function_reaches_a_worker_that_lacks_its_name(
    monkeypatch: pytest.MonkeyPatch, table: str
) -> None:
    """A worker's ``__main__`` may lack the name (spawn and forkserver run the script again
    without its main block; ``python -c`` and notebooks have none): the function travels with
    its copy by value, tabled or, once the function table is full, inline."""
    fn = _main_function()
    main = sys.modules["__main__"]
    monkeypatch.setattr(main, "mpsched_test_triple", fn, raising=False)
    tabled: list[bytes] = []

    def table_add(data: bytes) -> int:
        if table == "full":
            return INLINE
        tabled.append(data)
        return len(tabled) - 1

    payload = FunctionCache(table_add).encode(fn, (2,), {})
    monkeypatch.delattr(main, "mpsched_test_triple")  # the worker's __main__
    fid, loaded, args, kwargs, _ = decode_call(payload)
    if fid != INLINE:
        loaded = pickle.loads(tabled[fid])
    assert loaded(*args, **kwargs) == 6


def _recording_table() -> tuple[list[bytes], Callable[[bytes], int]]:
    """A function table that keeps what is tabled: the list, and its ``table_add``."""
    tabled: list[bytes] = []

    def table_add(data: bytes) -> int:
        tabled.append(data)
        return len(tabled) - 1

    return tabled, table_add


def _main_class() -> type:
    class Pair:  # a class of the main block, as in _main_function
        def __init__(self, a: int, b: int) -> None:
            self.a = a
            self.b = b

    Pair.__module__ = "__main__"
    Pair.__qualname__ = Pair.__name__ = "mpsched_test_Pair"
    return Pair


@pytest.mark.parametrize("worker_has_it", [False, True])
def test_an_argument_of_a_main_class_reaches_a_worker_with_or_without_its_name(
    monkeypatch: pytest.MonkeyPatch, worker_has_it: bool
) -> None:
    """An instance of a ``__main__`` class in the arguments: its class goes by name to a
    worker whose ``__main__`` has one (that one is used, as plain pickle would), and by value
    to one that lacks it (plain pickle failed there: "Can't get attribute")."""
    cls = _main_class()
    main = sys.modules["__main__"]
    monkeypatch.setattr(main, "mpsched_test_Pair", cls, raising=False)
    tabled, table_add = _recording_table()
    payload = FunctionCache(table_add).encode(len, (cls(1, 2),), {})
    assert len(payload) < 200  # the class's copy went to the table, not into each task
    # The worker: its function table's loader, and its __main__.
    monkeypatch.setattr(_serialize, "table_loader", lambda fid: pickle.loads(tabled[fid]))
    workers_own = _main_class()
    if worker_has_it:
        monkeypatch.setattr(main, "mpsched_test_Pair", workers_own)
    else:
        monkeypatch.delattr(main, "mpsched_test_Pair")
    _, _, (arg,), _, _ = decode_call(payload)
    assert (type(arg).__qualname__, arg.a, arg.b) == ("mpsched_test_Pair", 1, 2)
    assert (type(arg) is workers_own) is worker_has_it


def test_a_main_function_that_lru_cache_wraps_is_tabled_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its stand-in (the worker's wrapper if it wraps the same code, else a wrapper of a copy)
    goes to the function table once: inline, the copy went with every task (found in review:
    53 bytes a task before the stand-in, 792 with it inline, up to 64 KiB with a big constant),
    and each worker loaded it for every task, with a new, empty cache each time."""
    fn = functools.lru_cache(maxsize=None)(_main_function())
    main = sys.modules["__main__"]
    monkeypatch.setattr(main, "mpsched_test_triple", fn, raising=False)
    tabled, table_add = _recording_table()
    cache = FunctionCache(table_add)
    cache.note_worker_main(vars(main))  # the workers have the name: only the code is checked
    payloads = [cache.encode(fn, (x,), {}) for x in (2, 3)]
    assert len(tabled) == 1
    assert all(len(payload) < 200 for payload in payloads)
    monkeypatch.setattr(_serialize, "table_loader", lambda fid: pickle.loads(tabled[fid]))
    monkeypatch.delattr(main, "mpsched_test_triple")  # a worker that lacks the name
    _, loaded, (x,), _, _ = decode_call(payloads[0])
    assert loaded(x) == 6
    assert type(loaded) is type(fn)
    assert loaded is not fn


def test_a_call_that_names_no_main_object_is_plain_pickle() -> None:
    """The per-task path's check (``_`` then ``__main__`` in the bytes) leaves every other
    payload as plain pickle made it, underscores included."""
    call = (0, None, (1, "a_b", {"x": 95}), {"key_word": None}, False)
    assert FunctionCache(lambda data: 0).encode(len, *call[2:4]) == pickle.dumps(
        call, PICKLE_PROTOCOL
    )


def test_only_a_class_the_workers_lack_gets_a_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the workers' ``__main__`` names known (READY), a class they have goes by reference,
    as plain pickle made it (no second pickling); one they lack gets its stand-in."""
    cls = _main_class()
    main = sys.modules["__main__"]
    monkeypatch.setattr(main, "mpsched_test_Pair", cls, raising=False)
    cache = FunctionCache(lambda data: 0)
    args = (cls(1, 2),)
    plain = pickle.dumps((0, None, args, {}, False), PICKLE_PROTOCOL)
    cache.note_worker_main(vars(main))  # the workers' __main__ has every name of this one
    assert cache.encode(len, args, {}) == plain
    cache.note_worker_main(set(vars(main)) - {"mpsched_test_Pair"})
    assert cache.encode(len, args, {}) != plain


@pytest.mark.parametrize("pad", [0, NAMES_SCANNED_BYTES_MAX], ids=["short", "long"])
def test_a_long_call_gets_stand_ins_without_its_names_being_searched(
    monkeypatch: pytest.MonkeyPatch, pad: int
) -> None:
    """A call past ``NAMES_SCANNED_BYTES_MAX`` (an array beside the object) is searched for
    ``__main__`` only while something of this ``__main__`` is missing in the workers, and then
    for nothing else: a class they lack still gets its stand-in, and a call that names nothing
    of ``__main__`` stays plain pickle whatever the workers lack."""
    cls = _main_class()
    main = sys.modules["__main__"]
    monkeypatch.setattr(main, "mpsched_test_Pair", cls, raising=False)
    cache = FunctionCache(lambda data: 0)
    array = bytes(range(256)) * (pad // 256)  # every byte value, "_" included
    args = (array, cls(1, 2))
    plain = pickle.dumps((0, None, args, {}, False), PICKLE_PROTOCOL)
    assert len(plain) > NAMES_SCANNED_BYTES_MAX or not pad
    cache.note_worker_main(vars(main))
    assert cache.encode(len, args, {}) == plain
    cache.note_worker_main(set(vars(main)) - {"mpsched_test_Pair"})
    assert cache.encode(len, args, {}) != plain
    unnamed = (array, "__main__ as text")
    assert cache.encode(len, unnamed, {}) == pickle.dumps((0, None, unnamed, {}, False), 5)
    if pad:  # the searches of a long call: none while nothing is missing, then one
        counted = _FindCounter(plain)
        cache.note_worker_main(vars(main))
        assert not cache._may_name_a_missing_object(counted)
        assert counted.finds == 0
        cache.note_worker_main(set(vars(main)) - {"mpsched_test_Pair"})
        assert cache._may_name_a_missing_object(counted)
        assert counted.finds == 1


class _FindCounter(bytes):
    finds = 0

    def find(self, *args: Any) -> int:
        self.finds += 1
        return super().find(*args)


class _Holder:
    @staticmethod
    def static() -> None: ...

    def method(self) -> None: ...


def test_module_by_name_is_the_module_a_worker_imports_to_unpickle_a_function() -> None:
    """What the zygote imports for the pool's first task (``Pool._release_workers``): the
    module of a function or class that plain pickle writes by name, nothing else."""
    import functools
    import json

    from mpsched._serialize import module_by_name

    assert module_by_name(json.dumps) == "json"
    assert module_by_name(json.JSONDecoder) == "json.decoder"  # where it is defined
    assert module_by_name(len) == "builtins"
    assert module_by_name(_Holder.static) == __name__
    assert module_by_name(_Holder.method) == __name__
    assert module_by_name(_Holder().method) is None  # a bound method travels by value
    assert module_by_name(lambda: None) is None
    assert module_by_name(functools.partial(len)) is None
    assert module_by_name({}.get) is None

    def local() -> None: ...

    assert module_by_name(local) is None
    main_function = types.FunctionType(local.__code__, {"__name__": "__main__"})
    assert main_function.__module__ == "__main__"
    assert module_by_name(main_function) is None
