"""Task payload encoding: a call ``fn(*args, **kwargs)`` to bytes and back.

Called in the *submitting* process (``Pool.submit`` in the user's thread, ``mpsched.submit`` in a
worker), so an unpicklable function or argument fails there, at the call, with a clear error
(bpo-31699: a pickling error inside the pool machinery must never hang it). Decoded in the worker
that claims the task.

Payload = ``pickle.dumps((fid, fn, args, kwargs, meta))``. ``meta`` is False for a plain call;
for a task scheduled with an id (``mpsched.current_task()`` reports it) it is ``(task_id,)``, and
the pickle is followed by the version number (8 bytes), which the coordinator appends when it
writes the task to shared memory (``with_version``): off the path of ``Pool.schedule``, whose
rate is a target, and only for versions that come due. Everything that can fail or take time
(pickling the call with its task id) happens before, in the caller, in one ``pickle.dumps``: a
second one for the id alone cost a tenth of a ``Pool.schedule``. Then:

* ``fid >= 0``: ``fn`` is None; the function lives in the pool's function table under ``fid``
  (pickled once per pool; pickling a function by reference is half the per-task pickle cost).
  Only functions that plain pickle serializes *by reference* (module-level names) are tabled:
  their bytes cannot go stale. Lambdas and closures are pickled by value with cloudpickle on every
  call, because their captured state may change between calls.
* ``fid == -1``: ``fn`` is inline.

Plain pickle is tried first (fast, and by reference); cloudpickle is the fallback for lambdas
and local functions. A function of ``__main__`` pickles by reference in the caller but a worker
may not have that name (see ``portable``), so it carries a copy by value as well. That copy holds
the globals the function read when it was made, so the submitting side watches them
(``_MainEntry``): when one is rebound, the function is tabled again with a fresh copy. Other
objects of ``__main__`` (classes, their instances in arguments) still go by reference.
"""

from __future__ import annotations

import contextlib
import marshal
import pickle
import sys
import threading
import types
import weakref
from collections.abc import Callable

from mpsched._protocol import PICKLE_PROTOCOL, safe_repr

# typing.TYPE_CHECKING without importing typing at run time (why: mpsched/__init__.py).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Literal

INLINE = -1  # fid of a payload that carries its function
if TYPE_CHECKING:
    Call = tuple[int, Any, tuple[Any, ...], dict[str, Any], "tuple[Any, ...] | Literal[False]"]

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
                f"cannot pickle {_describe(obj)}: {safe_repr(cloud_error)} (plain pickle: "
                f"{safe_repr(plain_error)}). Pass picklable arguments, or share the data "
                "another way."
            ) from cloud_error


def _cloudpickle() -> Any:
    """cloudpickle, imported on first need (workers that never see a lambda never load it)."""
    import cloudpickle

    return cloudpickle


def _describe(obj: Any) -> str:
    """A short repr of ``obj`` for an error message: bounded while it is built (reprlib: the
    full repr of a big result cost its size in memory and time, only to be cut), and safe (a
    repr that raised replaced the TaskPicklingError with its own error)."""
    import reprlib  # here: error paths only

    describer = reprlib.Repr()
    describer.maxstring = describer.maxother = 200
    try:
        return describer.repr(obj)
    except BaseException:  # user code (__repr__) ran
        return f"<{type(obj).__qualname__} object (repr failed)>"


def encode_call(
    fid: int,
    fn: Callable[..., Any] | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    meta: tuple[Any] | Literal[False] = False,
) -> bytes:
    """The payload of ``fn(*args, **kwargs)`` (``fn`` None: tabled under ``fid``); ``meta``
    ``(task_id,)`` for a scheduled task, whose payload ``with_version`` then completes."""
    call = (fid, fn, args, kwargs, meta)
    try:
        return _dumps(call, PICKLE_PROTOCOL)
    except Exception:
        return _encode_with_cloudpickle(call)


def _encode_with_cloudpickle(call: Call) -> bytes:
    """``encode_call`` once plain pickle has failed: cloudpickle, or a TaskPicklingError that
    says what could not be pickled."""
    fn, meta = call[1], call[4]
    if meta:
        check_task_id_picklable(meta[0])
    try:
        return _cloudpickle().dumps(call, PICKLE_PROTOCOL)  # type: ignore[no-any-return]
    except Exception as exc:
        what = "arguments" if fn is None else f"function {_describe(fn)} or its arguments"
        raise TaskPicklingError(
            f"cannot pickle the task's {what}: {safe_repr(exc)}. Tasks run in other processes, so "
            "their function and arguments must be picklable (lambdas and local functions are "
            "fine; open files, locks, sockets and generators are not)."
        ) from exc


def check_task_id_picklable(task_id: Any) -> None:
    """TypeError unless plain pickle serializes ``task_id`` (ids are compared by equality in
    the worker's ``current_task()``, so they must survive plain pickling)."""
    try:
        _dumps(task_id, PICKLE_PROTOCOL)
    except Exception as exc:
        raise TypeError(f"task_id must be hashable and picklable: {exc!r}") from exc


_VERSION_BYTES = 8  # little-endian version number, after the pickled call


def with_version(call: bytes, version: int) -> bytes:
    """A scheduled task's payload: ``call`` (encoded with its ``meta``), then its version."""
    return call + version.to_bytes(_VERSION_BYTES, "little")


def decode_call(data: bytes | memoryview) -> Call:
    """``(fid, fn, args, kwargs, meta)``; ``meta`` is ``(task_id, version)``, or False for a
    call without one (the decoded tuple itself: no second tuple on the per-task path)."""
    call: Call = _loads(data)  # stops at the call's STOP opcode, before the version
    meta = call[4]
    if not meta:
        return call
    fid, fn, args, kwargs, _ = call
    version = int.from_bytes(data[len(data) - _VERSION_BYTES :], "little")
    return (fid, fn, args, kwargs, (meta[0], version))


MAIN_BY_VALUE_MAX = 64 * 1024  # bytes; a bigger copy (large captured globals) is not carried


def portable(fn: Any, *, name_first: bool = True) -> Any:
    """``fn``, or for a function of ``__main__`` that plain pickle serializes by reference, a
    stand-in that unpickles to ``__main__.<qualname>`` where that name exists (only if
    ``name_first``), else to a copy of ``fn`` made by cloudpickle.

    Why: the name resolves in the pool's process, but a worker's ``__main__`` differs: under
    spawn and forkserver it is the main script run again as ``__mp_main__`` without its
    ``if __name__ == "__main__":`` block, or empty (``python -c``, notebooks); under fork it is
    the copy taken when the zygote forked, without what was defined later. By reference alone,
    such a task or initializer failed in the worker with "Can't get attribute". The name is
    tried first so that a function the worker can see keeps the worker's globals (e.g. those
    an initializer set), as before; but only if the worker's function there has ``fn``'s code:
    the name may hold an older body (redefined since: a notebook cell run again), which ran
    instead of the new one.
    """
    if getattr(fn, "__module__", None) != "__main__" or type(fn) not in _TABLED_TYPES:
        return fn
    try:
        _dumps(fn, PICKLE_PROTOCOL)  # by reference, or not at all: then cloudpickle inline
        by_value = _cloudpickle().dumps(fn, PICKLE_PROTOCOL)
    except Exception:
        return fn
    if len(by_value) > MAIN_BY_VALUE_MAX:
        return fn
    return _MainFunction(fn.__qualname__, by_value, code_bytes(fn) if name_first else None)


class _MainFunction:
    """Pickles as ``load_main_function(qualname, by_value, code)`` (see ``portable``)."""

    __slots__ = ("by_value", "code", "qualname")

    def __init__(self, qualname: str, by_value: bytes, code: bytes | None) -> None:
        self.qualname = qualname
        self.by_value = by_value
        self.code = code

    def __reduce__(self) -> tuple[Any, ...]:
        return (load_main_function, (self.qualname, self.by_value, self.code))


def load_main_function(qualname: str, by_value: bytes, code: bytes | None) -> Any:
    """In a worker: ``__main__.<qualname>`` if it exists there with the code ``code``, else
    the copy ``by_value`` (always when ``code`` is None: see ``FunctionCache._table``)."""
    obj: Any = sys.modules.get("__main__")
    try:
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        return _cloudpickle().loads(by_value)
    if code is None or type(obj) not in _TABLED_TYPES or code_bytes(obj) != code:
        return _cloudpickle().loads(by_value)  # another function (or object) under that name
    return obj


def code_bytes(fn: Any) -> bytes | None:
    """``fn``'s code, and that of the functions in its closure (a decorator's wrapper has
    the same code whatever it wraps), as bytes that compare equal across processes for equal
    code: b"" without code (a builtin), None if it cannot be written. marshal version 2: later
    versions mark objects referenced more than once, so their bytes depend on reference
    counts, which differ between processes. ~1 us per function."""
    parts: list[bytes] = []
    return b"".join(parts) if _add_code(fn, parts, _CLOSURE_DEPTH) else None


_CLOSURE_DEPTH = 4  # levels of closures compared (decorators of decorators); bounds a cycle


def _add_code(fn: Any, parts: list[bytes], depth: int) -> bool:
    code = getattr(fn, "__code__", None)  # fn is a function: no user __getattr__ runs
    if not isinstance(code, types.CodeType):
        return True
    try:
        data = marshal.dumps(code, 2)
    except ValueError:  # a constant marshal cannot write (hand-made code)
        return False
    parts += (len(data).to_bytes(8, "little"), data)
    for cell in (fn.__closure__ or ()) if depth else ():
        try:
            inner = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if type(inner) is types.FunctionType and not _add_code(inner, parts, depth - 1):
            return False
    return True


# Plain pickle serializes these by reference only, so their bytes never go stale (but a
# __main__ function's copy by value: _MainEntry). Bound methods, partials and callable objects
# are pickled with their (mutable) state and so go inline.
_TABLED_TYPES = (types.FunctionType, types.BuiltinFunctionType)

# Copies of one __main__ function tabled after its first (a global it reads was rebound); from
# the next on, its copy goes inline with each task (made again only when a global changes): a
# global rebound in a loop filled the table otherwise (up to MAIN_BY_VALUE_MAX per copy).
MAIN_RETABLE_MAX = 4

_MISSING = object()  # the value of a name a function's globals lacked (a builtin, or not yet)

if TYPE_CHECKING:
    Bindings = tuple[tuple[dict[str, Any], str, Any], ...]  # (namespace, name, value it held)
    Cells = tuple[tuple[types.CellType, Any], ...]  # (closure cell, value it held)


class _MainEntry:
    """A ``__main__`` function tabled with its copy by value (``portable``), and what that copy
    captured: its bindings (``_captured``) with the values they held. Immutable: submitters
    read it without the lock; a change makes a new one.

    ``hit`` is ``(fid, stand_in)``, what ``FunctionCache._lookup`` returns while the bindings
    hold: ``fid`` is INLINE once ``MAIN_RETABLE_MAX`` fresh copies were tabled, or when the
    table is full; ``stand_in`` (the copy) then goes inline with each task.
    """

    __slots__ = ("bindings", "cells", "hit", "tablings")

    def __init__(
        self, fid: int, stand_in: Any, bindings: Bindings, cells: Cells, tablings: int
    ) -> None:
        self.hit = (fid, stand_in)
        self.bindings = bindings
        self.cells = cells
        self.tablings = tablings  # fresh copies made before this one

    def current(self) -> bool:
        """Whether every binding still holds the value the copy took (``is``: a value changed
        inside, a list appended to, is not seen)."""
        for namespace, name, value in self.bindings:
            if namespace.get(name, _MISSING) is not value:
                return False
        for cell, value in self.cells:
            try:
                if cell.cell_contents is not value:
                    return False
            except ValueError:  # emptied
                if value is not _MISSING:
                    return False
        return True


def _captured(fn: Callable[..., Any]) -> tuple[Bindings, Cells]:
    """The bindings cloudpickle's copy of ``fn`` takes, and their values now: the globals named
    by its code's global-name instructions, nested code's included (cloudpickle's own
    ``_extract_code_globals``: the very names its copy takes), and its closure's cells; then the
    same for every function and class among those values that cloudpickle copies by value too
    (``_should_pickle_by_reference``: those of ``__main__``), whose globals the copy carries.
    A global absent from its namespace is watched as ``_MISSING`` (it may be defined later).

    Call it before making the copy: a binding rebound in between then reads as changed (a
    needless copy), never as current with a stale copy.
    """
    pickler = _cloudpickle().cloudpickle
    # Private to cloudpickle (present since 2.0; pyproject needs 2.2): fall back to a superset.
    code_globals = getattr(pickler, "_extract_code_globals", _code_names)
    by_reference = getattr(pickler, "_should_pickle_by_reference", _outside_main)
    bindings: dict[tuple[int, str], tuple[dict[str, Any], str, Any]] = {}
    cells: list[tuple[types.CellType, Any]] = []
    seen: set[int] = set()  # ids of objects alive throughout (reachable from fn)
    todo: list[Any] = [fn]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        found: list[Any] = []
        if isinstance(obj, type):  # copied with its methods and bases
            found += obj.__bases__
            for member in vars(obj).values():
                if isinstance(member, (staticmethod, classmethod)):
                    found.append(member.__func__)
                elif isinstance(member, property):
                    found += (member.fget, member.fset, member.fdel)
                else:
                    found.append(member)
        else:
            namespace = obj.__globals__
            for name in code_globals(obj.__code__):
                value = namespace.get(name, _MISSING)
                bindings[id(namespace), name] = (namespace, name, value)
                found.append(value)
            for cell in obj.__closure__ or ():
                try:
                    value = cell.cell_contents
                except ValueError:  # an empty cell
                    value = _MISSING
                cells.append((cell, value))
                found.append(value)
        todo += (
            value
            for value in found
            if (type(value) is types.FunctionType or isinstance(value, type))
            and not by_reference(value)
        )
    return tuple(bindings.values()), tuple(cells)


def _code_names(code: types.CodeType) -> list[str]:
    """Every name ``code`` and the code nested in it use (a superset of their globals)."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += _code_names(const)
    return names


def _outside_main(obj: Any) -> bool:
    return getattr(obj, "__module__", None) != "__main__"


class FunctionCache:
    """Submitting side of the function table: ``fn -> fid`` for functions already tabled.

    ``table_add(bytes) -> fid`` writes to the shared table (-1 when full). One per submitting
    process; thread-safe: a hit is one dict read (atomic), a miss tables under ``_lock`` (so
    submitters need no lock of their own around pickling). A ``__main__`` function with a copy
    by value misses ``_fids``: its hit is a read of ``_main`` and a check of its bindings.
    """

    def __init__(self, table_add: Callable[[bytes], int]) -> None:
        self._table_add = table_add
        # Functions whose table entry cannot go stale (by reference), keyed by the function
        # object itself (strong reference: keeps its id from being reused).
        self._fids: dict[Any, int] = {}
        # __main__ functions tabled with a copy by value, which goes stale when a global it
        # captured is rebound: apart from _fids, so that the others' hit checks nothing. As in
        # _fids, one entry per function tabled. Written under _lock; read without it.
        self._main: dict[Any, _MainEntry] = {}
        # Functions that cannot be tabled (lambdas, closures): remembered weakly, so that a
        # repeat skips the failed pickling, but neither they nor what they capture outlive
        # their tasks (held in _fids, every closure ever submitted lived as long as the pool).
        self._untabled: weakref.WeakSet[Any] = weakref.WeakSet()
        self._full = False
        self._lock = threading.Lock()

    def fid(self, fn: Callable[..., Any]) -> int:
        """``fn``'s fid (tabled now if it can be), or INLINE."""
        fid = self._fids.get(fn) if type(fn) in _TABLED_TYPES else INLINE
        return fid if fid is not None else self._lookup(fn)[0]

    def encode(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        meta: tuple[Any] | Literal[False] = False,
    ) -> bytes:
        """``encode_call`` of ``fn``, tabled if it can be: the pool's per-task path, one Python
        frame when ``fn`` is tabled already and plain pickle serializes the call."""
        fid = self._fids.get(fn) if type(fn) in _TABLED_TYPES else INLINE
        if fid is None:
            fid, fn = self._lookup(fn)
        call = (fid, None if fid != INLINE else fn, args, kwargs, meta)
        try:
            return _dumps(call, PICKLE_PROTOCOL)
        except Exception:
            return _encode_with_cloudpickle(call)

    def portable(self, fn: Any) -> Any:
        """``portable(fn)`` for a function that travels as an argument (``map``'s): for a
        ``__main__`` function, the stand-in of its current copy here, which is by value only
        once a global it captured was rebound (``_table_main``), as its tasks' is."""
        if type(fn) is types.FunctionType and fn.__module__ == "__main__" and fn not in self._fids:
            return self._lookup(fn)[1]
        return portable(fn)

    def _lookup(self, fn: Callable[..., Any]) -> tuple[int, Any]:
        """For a function of a tabled type not in ``_fids``: its fid (tabled now if it can be),
        and what a task sends in its place when that is INLINE."""
        entry = self._main.get(fn)
        if entry is not None:  # a __main__ function's hit: no lock (entry.current(), inline)
            for namespace, name, value in entry.bindings:
                if namespace.get(name, _MISSING) is not value:
                    break
            else:
                if not entry.cells or entry.current():
                    return entry.hit
        with self._lock:
            fid = self._fids.get(fn)
            if fid is not None:  # another thread tabled it meanwhile
                return fid, fn
            entry = self._main.get(fn)
            if entry is not None:
                if entry.current():  # another thread made a fresh copy meanwhile
                    return entry.hit
                return self._table_main(fn, entry)
            if fn in self._untabled:
                return INLINE, fn
            if self._full:
                # Not tabled for want of room: a __main__ function then needs its copy by
                # value inline (by reference alone it failed in a worker without the name).
                # A pickling per task, but only once the table is full.
                return INLINE, portable(fn)
            try:
                data = _dumps(fn, PICKLE_PROTOCOL)  # by reference, or not at all
            except Exception:
                with contextlib.suppress(TypeError):  # not weakly referenceable: not remembered
                    self._untabled.add(fn)
                return INLINE, fn
            if type(fn) is types.FunctionType and fn.__module__ == "__main__":
                return self._table_main(fn, None)
            return self._table_by_reference(fn, data)

    def _table_by_reference(self, fn: Callable[..., Any], data: bytes) -> tuple[int, Any]:
        """Under ``_lock``: table ``fn`` (pickled by reference: ``data``) for good."""
        fid = self._table_add(data)
        if fid == INLINE:
            self._full = True
        else:
            self._fids[fn] = fid
        return fid, fn

    def _table_main(self, fn: Callable[..., Any], old: _MainEntry | None) -> tuple[int, Any]:
        """Under ``_lock``: table ``__main__`` function ``fn`` with a copy by value of it now;
        ``old``, its entry whose copy is stale, or None the first time.

        A fresh copy goes under a new fid (the table is append-only; workers cache by fid) and
        unpickles to the copy even where the worker's ``__main__`` has the function: a global
        of the pool's process was rebound, which the worker's own globals do not show (they
        stay in use while nothing is rebound: those an initializer set, for example).
        """
        bindings, cells = _captured(fn)  # before the copy: see _captured
        stand_in = portable(fn, name_first=old is None)
        if stand_in is fn:  # no copy (too big, or the name no longer pickles): by name alone
            self._main.pop(fn, None)
            try:
                data = _dumps(fn, PICKLE_PROTOCOL)
            except Exception:
                return INLINE, fn  # cloudpickle inline (encode_call)
            return self._table_by_reference(fn, data)
        tablings = 0 if old is None else old.tablings + 1
        fid = INLINE
        if tablings <= MAIN_RETABLE_MAX and not self._full:
            fid = self._table_add(_dumps(stand_in, PICKLE_PROTOCOL))
            if fid == INLINE:
                self._full = True
        self._main[fn] = _MainEntry(fid, stand_in, bindings, cells, tablings)
        return fid, stand_in

    def close(self) -> None:
        """The table's memory is about to go: from now on a new function (or a fresh copy of a
        ``__main__`` function) goes inline. (A submitter racing a shutdown may still be here;
        the pool then refuses its task.)"""
        with self._lock:
            self._full = True
