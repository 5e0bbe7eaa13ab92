"""Task payload encoding: a call ``fn(*args, **kwargs)`` to bytes and back.

Called in the *submitting* process (``Pool.submit`` in the user's thread, ``mpsched.submit`` in a
worker), so an unpicklable function or argument fails there, at the call, with a clear error
(bpo-31699: a pickling error inside the pool machinery must never hang it). Decoded in the worker
that claims the task.

Payload = ``pickle.dumps((fid, fn, args, kwargs, has_meta))``, followed, if ``has_meta``, by the
meta of a task scheduled with an id (``mpsched.current_task()`` reports it): the pickled task id,
the version (8 bytes) and the task id's length (4 bytes). The coordinator appends the meta under
its lock (``with_meta``), where the version number is known; everything that can fail or take
time (pickling the call and the task id) happens before, in the caller. Then:

* ``fid >= 0``: ``fn`` is None; the function lives in the pool's function table under ``fid``
  (pickled once per pool; pickling a function by reference is half the per-task pickle cost).
  Only functions that plain pickle serializes *by reference* (module-level names) are tabled:
  their bytes cannot go stale. Lambdas and closures are pickled by value with cloudpickle on every
  call, because their captured state may change between calls.
* ``fid == -1``: ``fn`` is inline.

Plain pickle is tried first (fast, and by reference); cloudpickle is the fallback for lambdas,
local functions and objects defined in ``__main__`` that a worker cannot import.
"""

from __future__ import annotations

import pickle
import types
from collections.abc import Callable

from mpsched._protocol import PICKLE_PROTOCOL

# typing.TYPE_CHECKING without importing typing at run time (why: mpsched/__init__.py).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Literal

INLINE = -1  # fid of a payload that carries its function

_dumps = pickle.dumps
_loads = pickle.loads


class TaskPicklingError(pickle.PicklingError, TypeError):
    """A task's function or arguments cannot be pickled (raised at submit, in the caller)."""


def dumps(obj: Any) -> bytes:
    """Pickle ``obj``: plain pickle first, cloudpickle when plain pickle cannot."""
    try:
        return _dumps(obj, PICKLE_PROTOCOL)
    except Exception as plain_error:
        try:
            return _cloudpickle().dumps(obj, PICKLE_PROTOCOL)  # type: ignore[no-any-return]
        except Exception as cloud_error:
            raise TaskPicklingError(
                f"cannot pickle {_describe(obj)}: {cloud_error!r} (plain pickle: "
                f"{plain_error!r}). Pass picklable arguments, or share the data another way."
            ) from cloud_error


def _cloudpickle() -> Any:
    """cloudpickle, imported on first need (workers that never see a lambda never load it)."""
    import cloudpickle

    return cloudpickle


def _describe(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 200 else text[:197] + "..."


def encode_call(
    fid: int,
    fn: Callable[..., Any] | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    has_meta: bool = False,
) -> bytes:
    call = (fid, fn, args, kwargs, has_meta)
    try:
        return _dumps(call, PICKLE_PROTOCOL)
    except Exception:
        pass
    try:
        return _cloudpickle().dumps(call, PICKLE_PROTOCOL)  # type: ignore[no-any-return]
    except Exception as exc:
        what = "arguments" if fn is None else f"function {fn!r} or its arguments"
        raise TaskPicklingError(
            f"cannot pickle the task's {what}: {exc!r}. Tasks run in other processes, so "
            "their function and arguments must be picklable (lambdas and local functions are "
            "fine; open files, locks, sockets and generators are not)."
        ) from exc


if TYPE_CHECKING:
    Call = tuple[int, Any, tuple[Any, ...], dict[str, Any], "tuple[Any, int] | Literal[False]"]
_LEN_BYTES = 4  # little-endian length of the pickled task id, at the very end
_VERSION_BYTES = 8  # little-endian version number, before it


def with_meta(call: bytes, task_id: bytes, version: int) -> bytes:
    """A payload: ``call`` (encoded with ``has_meta=True``), then the meta: the pickled task id
    (``dumps_task_id``, done once outside the coordinator's lock) and the version number."""
    return b"".join(
        (
            call,
            task_id,
            version.to_bytes(_VERSION_BYTES, "little"),
            len(task_id).to_bytes(_LEN_BYTES, "little"),
        )
    )


def dumps_task_id(task_id: Any) -> bytes:
    return _dumps(task_id, PICKLE_PROTOCOL)


def decode_call(data: bytes | memoryview) -> Call:
    """``(fid, fn, args, kwargs, meta)``; ``meta`` is ``(task_id, version)``, or False for a
    call without one (the decoded tuple itself: no second tuple on the per-task path)."""
    call: Call = _loads(data)  # stops at the call's STOP opcode
    if not call[4]:
        return call
    fid, fn, args, kwargs, _ = call
    end = len(data) - _LEN_BYTES
    n = int.from_bytes(data[end:], "little")
    version = int.from_bytes(data[end - _VERSION_BYTES : end], "little")
    return (
        fid,
        fn,
        args,
        kwargs,
        (_loads(data[end - _VERSION_BYTES - n : end - _VERSION_BYTES]), version),
    )


def function_bytes(fn: Callable[..., Any]) -> bytes | None:
    """``fn`` pickled by reference, or None if plain pickle cannot (so it must go inline)."""
    try:
        return _dumps(fn, PICKLE_PROTOCOL)
    except Exception:
        return None


# Plain pickle serializes these by reference only, so their bytes never go stale. Bound methods,
# partials and callable objects are pickled with their (mutable) state and so go inline.
_TABLED_TYPES = (types.FunctionType, types.BuiltinFunctionType)


class FunctionCache:
    """Submitting side of the function table: ``fn -> fid`` for functions already tabled.

    ``table_add(bytes) -> fid`` writes to the shared table (-1 when full). One per submitting
    process; not thread-safe by itself (callers hold their submit lock).
    """

    def __init__(self, table_add: Callable[[bytes], int]) -> None:
        self._table_add = table_add
        # Keyed by the function object itself (strong reference: keeps its id from being reused).
        self._fids: dict[Any, int] = {}
        self._full = False

    def fid(self, fn: Callable[..., Any]) -> int:
        fid = self._fids.get(fn) if type(fn) in _TABLED_TYPES else INLINE
        if fid is not None:
            return fid
        if self._full:
            return INLINE
        data = function_bytes(fn)
        fid = INLINE if data is None else self._table_add(data)
        if data is not None and fid == INLINE:
            self._full = True
        self._fids[fn] = fid
        return fid
