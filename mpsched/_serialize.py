"""Task payload encoding: a call ``fn(*args, **kwargs)`` to bytes and back.

Called in the *submitting* process (``Pool.submit`` in the user's thread, ``mpsched.submit`` in a
worker), so an unpicklable function or argument fails there, at the call, with a clear error
(bpo-31699: a pickling error inside the pool machinery must never hang it). Decoded in the worker
that claims the task.

Payload = ``pickle.dumps((fid, fn, args, kwargs, meta))``. ``meta`` is False for a plain call;
for a task scheduled with an id (``mpsched.current_task()`` reports it) it is ``(task_id,)``, and
the pickle is followed by the version number (8 bytes), which the coordinator appends when it
writes the task to shared memory (``with_version``): off the path of ``Pool.schedule``, whose
rate is a target, and only for versions that come due. A recurring run under the misfire policy
"skip" also carries its misfire deadline (a ``time.monotonic()`` float, 8 bytes, before the
version, whose top bit then says so): the worker that claims it after that time drops it.
Everything that can fail or take time (pickling the call with its task id) happens before, in
the caller, in one ``pickle.dumps``: a second one for the id alone cost a tenth of a
``Pool.schedule``. Then:

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
(``_function_cache``): when one is rebound, the function is tabled again with a fresh copy. The
classes and functions of ``__main__`` in a task's arguments (an instance's class) get stand-ins
too where the workers may lack them (``with_main_stand_ins``): the worker's own object of that
name, else a copy by value, tabled once per pool (``_function_cache``).
"""

from __future__ import annotations

import contextlib
import functools
import io
import marshal
import pickle
import struct
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterable

from mpsched._errors import MpschedError
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


class TaskPicklingError(MpschedError, pickle.PicklingError, TypeError):
    """A task's function or arguments cannot be pickled (raised at submit, in the caller), or
    its result (in the worker: then it is the task's error, on its future). An
    ``MpschedError`` as every error mpsched raises on its own behalf (it was not: an
    ``except MpschedError`` let it through; found in review)."""


_ARGUMENT_ADVICE = "Pass picklable arguments, or share the data another way."
_RESULT_ADVICE = (
    "A task's result goes back to the pool's process: return picklable values, or share the "
    "data another way."
)


def dumps(obj: Any) -> bytes:
    """Pickle ``obj``: plain pickle first, cloudpickle when plain pickle cannot."""
    try:
        return _dumps(obj, PICKLE_PROTOCOL)
    except MemoryError:  # no pickling problem: a second try would only run out again
        raise
    except Exception as plain_error:
        return _dumps_by_value(obj, plain_error, "", _ARGUMENT_ADVICE, inline_stand_in)


def dumps_result(obj: Any) -> bytes:
    """``dumps`` for what a task returned, in the worker: an error that says it is the result
    (the arguments' advice, given for a result, sent users to the wrong end of the task).

    A SystemExit or KeyboardInterrupt raised here is the result's own (its ``__reduce__``: a
    worker ignores SIGINT), so it fails the result as any pickling error does: passed on, it
    ended the future as if the task had called ``sys.exit()``, and a ``map`` chunk lost the
    results before it."""
    try:
        try:
            return _dumps(obj, PICKLE_PROTOCOL)
        except MemoryError:  # as in dumps
            raise
        except Exception as plain_error:
            return _dumps_by_value(obj, plain_error, "the result ", _RESULT_ADVICE, None)
    except (SystemExit, KeyboardInterrupt) as exc:
        raise TaskPicklingError(
            f"cannot pickle the result {_describe(obj)}: its pickling raised {safe_repr(exc)}. "
            f"{_RESULT_ADVICE}"
        ) from exc


def _dumps_by_value(
    obj: Any, plain_error: Exception, what: str, advice: str, main_stand_in: StandIn | None
) -> bytes:
    """``dumps``'s second try, once plain pickle failed with ``plain_error``: cloudpickle (see
    ``cloud_dumps`` for ``main_stand_in``), or a TaskPicklingError that names ``obj`` (after
    ``what``) and gives both errors. The name is made only then: a repr runs user code, and a
    lambda result pickles here at every task."""
    try:
        return cloud_dumps(obj, main_stand_in)
    except Exception as cloud_error:
        raise TaskPicklingError(
            f"cannot pickle {what}{_describe(obj)}: {safe_repr(cloud_error)} (plain pickle: "
            f"{safe_repr(plain_error)}). {advice}"
        ) from cloud_error


def first_unpicklable(
    objs: list[Any], dump: Callable[[Any], bytes] = dumps
) -> tuple[int, Exception] | None:
    """The index of the first of ``objs`` that ``dump`` cannot pickle alone, and its error;
    None if each pickles alone. One ``dump`` per object: for error paths only, once the list
    as a whole failed (a map chunk's items; its results, with ``dumps_result``)."""
    for index, obj in enumerate(objs):
        try:
            dump(obj)
        except Exception as exc:
            return index, exc
    return None


def _cloudpickle() -> Any:
    """cloudpickle, imported on first need (workers that never see a lambda never load it)."""
    import cloudpickle

    return cloudpickle


def cloud_dumps(obj: Any, main_stand_in: StandIn | None) -> bytes:
    """cloudpickle's pickle of ``obj``, but a class or function that plain pickle would write
    by name, as ``__main__.<qualname>`` (this process's object of that name), goes as
    ``main_stand_in`` says (its reduction; None, or it answering None: by that name).

    Why: cloudpickle copies every class and function of ``__main__`` by value. So one part of
    a call that only cloudpickle could write (a lambda argument, a lambda in a result) turned
    every other object of ``__main__`` in it into a copy: an enum member or an instance then
    belonged to a class other than the receiver's own, and ``is``, ``==`` and ``isinstance``
    answered False, with no error (found in review)."""
    pickler = _main_aware_pickler()
    buffer = io.BytesIO()
    pickler(buffer, main_stand_in).dump(obj)
    return buffer.getvalue()


def copy_by_value(obj: Any, copied: Iterable[type] = (), cached: Any = None) -> bytes:
    """cloudpickle's copy of ``obj``, a class or function of ``__main__``, but each *other*
    class of ``__main__`` in it (a base class, the class of a global it reads, an enum whose
    member it holds) goes as its stand-in (``inline_stand_in``): the receiver's own class of
    that name where it has one, else a copy. cloudpickle copied them all: the copy of a
    function of the script's main block that tests ``c is Color.RED`` or ``isinstance(b,
    Base)`` got a copy of ``Color`` or ``Base`` while its argument, pickled by name, was an
    instance of the worker's own, and answered False, with no error (found in review).
    Functions of ``__main__`` in it are still copied, with their globals as they are now (a
    fresh copy of ``obj``, made after a global was rebound, must see the new value).

    A class in ``copied``, or whose stand-in is being made in this thread (a cycle: ``A``'s
    method reads ``B``, ``B``'s reads ``A``), is copied within this copy, as cloudpickle does.
    A function of ``__main__`` that ``functools.lru_cache`` wraps goes as its stand-in too
    (``_portable_cached``); ``cached``, the wrapper of ``obj`` being copied, goes as None (its
    loader puts itself there: ``load_main_cached``)."""
    making: set[int] = _local.__dict__.setdefault("making", set())
    keys = {id(obj), *map(id, copied)} if cached is None else {id(obj), id(cached)}
    added = [key for key in keys if key not in making]
    making.update(added)
    try:
        buffer = io.BytesIO()
        cached_id = 0 if cached is None else id(cached)
        _main_aware_pickler()(buffer, _copy_stand_in, making, cached_id).dump(obj)
        return buffer.getvalue()
    finally:
        making.difference_update(added)


def _copy_stand_in(obj: Any) -> tuple[Any, ...] | None:
    """``copy_by_value``'s stand-in: a class's or a cached function's (None: copied with the
    rest), never a plain function's."""
    return inline_stand_in(obj) if isinstance(obj, (type, _CACHED)) else None


_local = threading.local()  # copy_by_value's classes in the making, per thread
_MainAwarePickler: Any = None  # made on first need, as cloudpickle is imported


def _main_aware_pickler() -> Any:
    global _MainAwarePickler
    if _MainAwarePickler is None:
        base: Any = _cloudpickle().Pickler

        class MainAwarePickler(base):  # type: ignore[misc]
            """``main_stand_in``'s answer None means by name (``cloud_dumps``), or, with
            ``copied`` (``copy_by_value``: the ids of the objects it is copying), a copy.
            An open text file is refused, as plain pickle refuses it: cloudpickle copies it
            as a ``StringIO`` of the whole file, read in the caller (an argument or a result
            of 100 MB went so, found in review; ``/dev/zero`` would read until memory ran
            out)."""

            def __init__(
                self,
                file: io.BytesIO,
                main_stand_in: StandIn | None,
                copied: set[int] | None = None,
                cached: int = 0,
            ) -> None:
                super().__init__(file, protocol=PICKLE_PROTOCOL)
                self.main_stand_in = main_stand_in
                self.copied = copied
                self.cached = cached  # id() of copy_by_value's ``cached`` (0: none)

            def reducer_override(self, obj: Any) -> Any:
                if type(obj) is io.TextIOWrapper:  # (not a dispatch table: ~0.8 us a miss)
                    return _refuse_open_file(obj)
                if of_main(obj) and _in_main(obj.__qualname__) is obj:
                    copied = self.copied
                    if copied is None or id(obj) not in copied:
                        stand_in = self.main_stand_in
                        reduced = None if stand_in is None else stand_in(obj)
                        if reduced is not None:
                            return reduced
                        if copied is None:
                            return NotImplemented  # by name
                    elif type(obj) is _CACHED:
                        if id(obj) == self.cached:  # the wrapper being copied: its loader
                            return (type(None), ())  # puts itself there (copy_by_value)
                        # Another one being copied (cached functions calling each other): by
                        # name. A None there, which no loader replaced, was called.
                        return NotImplemented
                reduced = super().reducer_override(obj)
                if isinstance(obj, type) and "__slots__" in vars(obj) and not _typed_tuple(obj):
                    return _with_slots(reduced, vars(obj)["__slots__"])
                return reduced

        _MainAwarePickler = MainAwarePickler
    return _MainAwarePickler


def _refuse_open_file(file: io.TextIOWrapper) -> Any:
    if file is sys.stdout or file is sys.stderr:  # by name, as cloudpickle has them
        return getattr, (sys, "stdout" if file is sys.stdout else "stderr")
    name = getattr(file, "name", None)
    raise TypeError(f"cannot pickle an open text file ({name!r}): pass its path instead")


def _typed_tuple(cls: type) -> bool:
    """Whether ``cls`` is a ``typing.NamedTuple``: its copy is remade through typing's
    metaclass (cloudpickle makes it from its ``__orig_bases__``), which gives it its slots
    itself and refuses a namespace that holds ``__slots__``, so that every copy of one, as an
    argument, a result or a task's class, failed ("Cannot overwrite NamedTuple attribute
    __slots__": a pickling hunt). Told without importing typing (see mpsched/__init__.py)."""
    return any(
        getattr(base, "__name__", None) == "NamedTuple"
        and getattr(base, "__module__", None) == "typing"
        for base in vars(cls).get("__orig_bases__", ())
    )


def _with_slots(reduced: Any, slots: Any) -> Any:
    """cloudpickle's reduction of a class copied by value, made to create the class with its
    ``__slots__``: cloudpickle creates the copy without them and sets them as a plain
    attribute afterwards, so the copy's instances have a ``__dict__`` and pickle their state as
    one. A worker's copy of a slotted class of ``__main__`` then sent its instances back in a
    form that the caller's class (the copy maps back to it) cannot take: every such result
    failed, "'S' object has no attribute '__dict__'" (found in review). Another shape of
    reduction (a later cloudpickle's) is left as it is."""
    pickler = _cloudpickle().cloudpickle
    if (
        isinstance(reduced, tuple)
        and len(reduced) >= 2
        and reduced[0] is getattr(pickler, "_make_skeleton_class", None)
        and isinstance(reduced[1], tuple)
        and len(reduced[1]) > 3
        and isinstance(reduced[1][3], dict)
    ):
        args = list(reduced[1])
        args[3] = {**args[3], "__slots__": slots}
        return (reduced[0], tuple(args), *reduced[2:])
    return reduced


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
    except MemoryError:  # as in dumps (it read "cannot pickle ... must be picklable")
        raise
    except Exception:
        return _encode_with_cloudpickle(call)


def _encode_with_cloudpickle(call: Call, main_stand_in: StandIn | None = None) -> bytes:
    """``encode_call`` once plain pickle has failed: cloudpickle (``cloud_dumps``, with
    ``main_stand_in``: None in a worker, whose peers share its ``__main__``), or a
    TaskPicklingError that says what could not be pickled."""
    fn, meta = call[1], call[4]
    if meta:
        check_task_id_picklable(meta[0])
    try:
        return cloud_dumps(call, main_stand_in)
    except Exception as exc:
        what = "arguments" if fn is None else f"function {_describe(fn)} or its arguments"
        raise TaskPicklingError(
            f"cannot pickle the task's {what}: {safe_repr(exc)}. Tasks run in other processes, so "
            "their function and arguments must be picklable (lambdas and local functions are "
            "fine; open files, locks, sockets and generators are not)."
        ) from exc


def dumps_for_workers(obj: Any) -> bytes:
    """``dumps``, for a worker to load: with ``__main__``'s stand-ins (``with_main_stand_ins``,
    each copy inline) where it names ``__main__``. (The per-task path, ``FunctionCache.encode``,
    tables the copies instead.)"""
    data = dumps(obj)
    return with_main_stand_ins(obj, data, inline_stand_in) if data.find(b"__main__") >= 0 else data


if TYPE_CHECKING:
    # stand_in(obj) -> the reduction that replaces ``obj``, a class or function of __main__,
    # in a pickle; None: ``obj`` goes by reference (plain pickle's way).
    StandIn = Callable[[Any], tuple[Any, ...] | None]


def with_main_stand_ins(obj: Any, data: bytes, stand_in: StandIn) -> bytes:
    """``obj`` pickled with ``stand_in``'s reductions for the classes and functions of
    ``__main__`` in it, given ``data``, its plain pickle (which names ``__main__``: callers look
    for it). A stand-in unpickles in the worker to the object of that name in the worker's
    ``__main__``, as plain pickle would, and where that name is missing, to a copy by value.

    Why: a worker's ``__main__`` lacks what the script's ``if __name__ == "__main__":`` block
    defined (spawn and forkserver, the default, run the script again without it), everything a
    notebook or ``python -c`` defined, and under fork what was defined after the pool started.
    By reference alone, an argument that is an instance of such a class failed the task in the
    worker ("Can't get attribute"), as in the stdlib's pools. Plain pickle's ``data`` stays if
    a stand-in cannot be made: the task then fails as it did."""
    buffer = io.BytesIO()
    try:
        _MainPickler(buffer, stand_in).dump(obj)
    except Exception:
        return data
    return buffer.getvalue()


class _MainPickler(pickle.Pickler):
    """Plain pickle (the C pickler), but a class or function of ``__main__`` goes as its
    stand-in. Called once per object pickled: only for payloads that name ``__main__``."""

    def __init__(self, file: io.BytesIO, stand_in: StandIn) -> None:
        super().__init__(file, PICKLE_PROTOCOL)
        self.stand_in = stand_in

    def reducer_override(self, obj: Any) -> Any:
        if not of_main(obj):
            return NotImplemented
        reduced = self.stand_in(obj)
        return NotImplemented if reduced is None else reduced


class MainObject:
    """Pickles as ``load_main_object(qualname, by_value, name_first)``: the stand-in of a class
    of ``__main__``, in a task or in a pool's function table."""

    __slots__ = ("by_value", "name_first", "qualname")

    def __init__(self, cls: type, name_first: bool = True) -> None:
        """Raises what cloudpickle raises if ``cls`` cannot be copied, and ValueError if its
        copy exceeds ``MAIN_BY_VALUE_MAX`` (big class attributes): it then goes by reference,
        as a function's does. ``name_first`` False: always the copy (``cls`` replaced the
        class of that name that the workers have: ``FunctionCache._redefined``)."""
        self.qualname = cls.__qualname__
        self.name_first = name_first
        self.by_value = copy_by_value(cls)
        if len(self.by_value) > MAIN_BY_VALUE_MAX:
            raise ValueError(f"the copy of {self.qualname} takes {len(self.by_value)} bytes")

    def __reduce__(self) -> tuple[Any, ...]:
        return (load_main_object, (self.qualname, self.by_value, self.name_first))


def inline_stand_in(obj: Any) -> tuple[Any, ...] | None:
    """``with_main_stand_ins``'s stand-in with its copy inline (no function table at hand).
    Each object's is made on its first use (a copy takes cloudpickle ~0.1-1 ms) and reused,
    so a change to the object after that (a class attribute set, a global its function reads
    rebound) is not seen where the copy is used, as with any copy."""
    try:
        return _stand_ins[obj]
    except KeyError:
        pass
    reduced: tuple[Any, ...] | None = None
    if isinstance(obj, type):
        with contextlib.suppress(Exception):  # cannot be copied: by reference, as before
            reduced = MainObject(obj).__reduce__()
    else:
        stand_in = portable(obj)  # a function: the stand-in a task's own function has
        reduced = None if stand_in is obj else stand_in.__reduce__()
    # Not one made inside another copy (``copy_by_value``'s): it copies what that copy is
    # making (a cycle) instead of referring to it, which is right there only. Kept, a class's
    # stand-in made first inside such a cycle gave a copy of the other class to every later
    # task: ``isinstance`` said False or True as the tasks' order had it (found in review).
    if not _local.__dict__.get("making"):
        with contextlib.suppress(TypeError):  # not weakly referenceable: made again next time
            _stand_ins[obj] = reduced
    return reduced


# Weak: the entry goes with the object (a notebook redefines them).
_stand_ins: weakref.WeakKeyDictionary[Any, tuple[Any, ...] | None] = weakref.WeakKeyDictionary()

# In a worker: what loads an entry of the pool's function table, by fid (the worker's own
# cached loader, set by worker_main), for the stand-ins that refer to one (load_tabled).
table_loader: Callable[[int], Any] | None = None


def load_tabled(fid: int) -> Any:
    """In a worker: the object in the pool's function table under ``fid``."""
    if table_loader is None:
        raise RuntimeError("a task's stand-in refers to a pool's function table outside a worker")
    return table_loader(fid)


def load_main_object(qualname: str, by_value: bytes, name_first: bool = True) -> Any:
    """In a worker: ``__main__.<qualname>`` if it exists there (and ``name_first``), else the
    copy ``by_value``. (Once per worker for a tabled stand-in: its ``load_function`` caches
    the object.)"""
    obj = _in_main(qualname) if name_first else _ABSENT
    return _cloudpickle().loads(by_value) if obj is _ABSENT else obj


_ABSENT = object()  # _in_main's "no such name"


def _in_main(qualname: str) -> Any:
    """``__main__.<qualname>`` in this process, or ``_ABSENT``."""
    obj: Any = sys.modules.get("__main__")
    try:
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        return _ABSENT
    return obj


def check_task_id_picklable(task_id: Any) -> None:
    """TypeError unless plain pickle serializes ``task_id`` (ids are compared by equality in
    the worker's ``current_task()``, so they must survive plain pickling)."""
    try:
        _dumps(task_id, PICKLE_PROTOCOL)
    except Exception as exc:
        raise TypeError(f"task_id must be hashable and picklable: {exc!r}") from exc


_VERSION_BYTES = 8  # little-endian version number, after the pickled call
# The version word's top bit: a misfire deadline (float64, little-endian) precedes the word.
# Versions count one id's schedules from 1: they never reach it.
_DEADLINE_FLAG = 1 << 63
_DEADLINE = struct.Struct("<d")


def with_version(call: bytes, version: int, deadline: float | None = None) -> bytes:
    """A scheduled task's payload: ``call`` (encoded with its ``meta``), then its misfire
    ``deadline`` if it has one, then its version."""
    if deadline is None:
        return call + version.to_bytes(_VERSION_BYTES, "little")
    word = (version | _DEADLINE_FLAG).to_bytes(_VERSION_BYTES, "little")
    return call + _DEADLINE.pack(deadline) + word


def decode_call(data: bytes | bytearray | memoryview) -> Call:
    """``(fid, fn, args, kwargs, meta)``; ``meta`` is ``(task_id, version)``, or
    ``(task_id, version, deadline)`` for a run with a misfire deadline, or False for a call
    without one (the decoded tuple itself: no second tuple on the per-task path)."""
    call: Call = _loads(data)  # stops at the call's STOP opcode, before the version
    meta = call[4]
    if not meta:
        return call
    fid, fn, args, kwargs, _ = call
    end = len(data) - _VERSION_BYTES
    version = int.from_bytes(data[end:], "little")
    if version & _DEADLINE_FLAG:
        deadline = _DEADLINE.unpack_from(data, end - _DEADLINE.size)[0]
        return (fid, fn, args, kwargs, (meta[0], version ^ _DEADLINE_FLAG, deadline))
    return (fid, fn, args, kwargs, (meta[0], version))


MAIN_BY_VALUE_MAX = 64 * 1024  # bytes; a bigger copy (large captured globals) is not carried


def portable(fn: Any, *, name_first: bool = True, copied: Iterable[type] = ()) -> Any:
    """``fn``, or for a function of ``__main__`` that plain pickle serializes by reference, a
    stand-in that unpickles to ``__main__.<qualname>`` where that name exists (only if
    ``name_first``), else to a copy of ``fn`` (``copy_by_value``, which copies the classes in
    ``copied`` with it).

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
    if getattr(fn, "__module__", None) != "__main__":
        return fn
    if type(fn) is _CACHED:
        return _portable_cached(fn, name_first)
    if type(fn) not in _TABLED_TYPES:
        return fn
    try:
        _dumps(fn, PICKLE_PROTOCOL)  # by reference, or not at all: then cloudpickle inline
        by_value = copy_by_value(fn, copied)
    except Exception:
        return fn
    if len(by_value) > MAIN_BY_VALUE_MAX:
        return fn
    return _MainFunction(fn.__qualname__, by_value, code_bytes(fn) if name_first else None)


def _portable_cached(fn: Any, name_first: bool) -> Any:
    """``portable`` for a function of ``__main__`` wrapped by ``functools.lru_cache`` (or
    ``cache``): plain pickle writes the wrapper by name, which a worker without that name
    failed on ("Can't get attribute"), and one with an older body of that name ran the old
    body (found in review). Its stand-in loads as the worker's wrapper of that name if that
    one wraps the same code, else as a new wrapper, with the same parameters, of a copy of the
    function it wraps (once per worker: ``load_main_cached``)."""
    inner = getattr(fn, "__wrapped__", None)
    if type(inner) is not types.FunctionType:
        return fn
    try:
        by_value = copy_by_value(inner, (), fn)
    except Exception:
        return fn
    if len(by_value) > MAIN_BY_VALUE_MAX:
        return fn
    params = fn.cache_parameters()
    code = code_bytes(inner) if name_first else None
    return _MainCached(fn.__qualname__, by_value, code, params["maxsize"], params["typed"])


class _MainCached:
    """Pickles as ``load_main_cached(qualname, by_value, code, maxsize, typed)``."""

    __slots__ = ("args",)

    def __init__(
        self, qualname: str, by_value: bytes, code: bytes | None, maxsize: int | None, typed: bool
    ) -> None:
        self.args = (qualname, by_value, code, maxsize, typed)

    def __reduce__(self) -> tuple[Any, ...]:
        return (load_main_cached, self.args)


# In a worker: the wrappers load_main_cached made, by their arguments: a stand-in that comes
# with every task would otherwise wrap a new copy each time, with an empty cache.
_cached_copies: dict[tuple[Any, ...], Any] = {}


def load_main_cached(
    qualname: str, by_value: bytes, code: bytes | None, maxsize: int | None, typed: bool
) -> Any:
    """In a worker: see ``_portable_cached``."""
    obj = _in_main(qualname)
    inner = getattr(obj, "__wrapped__", None) if type(obj) is _CACHED else None
    if code is not None and inner is not None and code_bytes(inner) == code:
        return obj
    key = (qualname, by_value, maxsize, typed)
    wrapper = _cached_copies.get(key)
    if wrapper is None:
        inner = _cloudpickle().loads(by_value)
        wrapper = _cached_copies[key] = functools.lru_cache(maxsize, typed)(inner)
        # The copy's own calls of the name (a recursion) reach this wrapper: the copy was
        # made with None there (``copy_by_value``'s ``cached``), as it cannot hold itself.
        namespace = inner.__globals__
        if "." not in qualname and qualname in namespace and namespace[qualname] is None:
            namespace[qualname] = wrapper
    return wrapper


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
    the copy ``by_value`` (always when ``code`` is None: see ``FunctionCache._table_main``)."""
    obj = _in_main(qualname)
    if code is None or type(obj) not in _TABLED_TYPES or code_bytes(obj) != code:
        return _cloudpickle().loads(by_value)  # none, or another function (or object) there
    return obj


def code_bytes(fn: Any) -> bytes | None:
    """``fn``'s code, and that of the functions in its closure (a decorator's wrapper has
    the same code whatever it wraps) with the other values there (plain pickle: a factory's
    wrapper has the same code whatever it was made with), as bytes that compare equal across
    processes for equal code and values: b"" without code (a builtin), None if they cannot
    be written. marshal version 2: later versions mark objects referenced more than once, so
    their bytes depend on reference counts, which differ between processes. A value whose
    pickle differs between processes (a set of strings: hash randomization) only makes the
    worker take the copy. ~1 us per function."""
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
        if type(inner) is types.FunctionType:
            if not _add_code(inner, parts, depth - 1):
                return False
            continue
        try:
            value = _dumps(inner, PICKLE_PROTOCOL)
        except Exception:  # compared by pickle alone: unpicklable, it takes the copy
            return False
        parts += (len(value).to_bytes(8, "little"), value)
    return True


# Plain pickle serializes these by reference only, so their bytes never go stale (but a
# __main__ function's copy by value: _function_cache._MainEntry). Bound methods, partials and
# callable objects are pickled with their (mutable) state and so go inline, and so do the
# builtin methods of instances, which share the builtins' type (``bound_to_state``).
_TABLED_TYPES = (types.FunctionType, types.BuiltinFunctionType)


def bound_to_state(fn: Any) -> bool:
    """``fn`` is a builtin method bound to an instance (``d.get``, ``lst.append``, a
    ``random.Random``'s ``random``): of a tabled type, but plain pickle writes it as
    ``getattr(<the instance, by value>, name)``, a snapshot of state that may change since, so
    it goes inline as any bound method. Tabled, a later ``d.get`` (equal: the same instance)
    ran on the first one's copy of ``d``, which the table kept for the pool's life. Bound to a
    module (``len``, ``math.sqrt``) or a class (``dict.fromkeys``), it is written by name."""
    if type(fn) is not types.BuiltinFunctionType:
        return False
    owner = fn.__self__
    return owner is not None and not isinstance(owner, (types.ModuleType, type))


# What plain pickle writes by name, as a global (classes and functions, and the functions that
# functools.lru_cache and functools.cache wrap, whose __reduce__ gives their qualname).
_CACHED = functools._lru_cache_wrapper
_BY_NAME = (type, *_TABLED_TYPES, _CACHED)


def of_main(obj: Any) -> bool:
    """A class or function defined in ``__main__``: plain pickle writes it as the global
    ``__main__.<qualname>`` (one imported there pickles under its own module's name)."""
    return isinstance(obj, _BY_NAME) and getattr(obj, "__module__", None) == "__main__"


def module_by_name(fn: Any) -> str | None:
    """The module that a worker imports to unpickle ``fn``, if plain pickle writes it by name
    (pickle's own test: its ``__qualname__`` looked up from ``__module__`` is ``fn``); None for
    ``__main__`` (the workers have theirs) and for what travels by value (a lambda, a closure,
    a bound method), which imports no module of its own."""
    name = getattr(fn, "__module__", None)
    if not isinstance(fn, _BY_NAME) or type(name) is not str or name == "__main__":
        return None
    found: Any = sys.modules.get(name)
    for part in getattr(fn, "__qualname__", "").split("."):
        found = getattr(found, part, None)
    return name if found is fn else None
