"""The submitting side of the pool's function table: ``FunctionCache`` (``fn -> fid``).

Owns which functions are tabled (sent to the workers once, then named by their fid in every
payload: ``_serialize`` has the payload's format), and for a function of ``__main__``, whose
table entry is a copy by value (``_serialize.portable``), the watch on the globals that copy
captured (``_MainEntry``, ``_captured``): when one is rebound, the function is tabled again with
a fresh copy, so a task sees the globals of the moment it was submitted.

Called from: every submitting thread of the pool's process (``Pool.submit``/``schedule``/``map``
through ``encode`` and ``portable``), and ``close`` at the pool's teardown. A hit is one dict
read without the lock (a ``__main__`` function's: one more, and a check of its bindings); a miss
tables under ``_lock``. The workers' side (``fid -> function``) is ``Worker.load_function``.

Invariants: a fid, once given to a function, names bytes that never change (the table is
append-only); an entry of ``_main`` is immutable and replaced whole, so a reader without the lock
sees an old or a new one, never a mix; a function whose bindings changed since its copy was made
is never encoded with that copy's fid.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Literal

from mpsched._protocol import PICKLE_PROTOCOL
from mpsched._serialize import (
    _CACHED,
    _TABLED_TYPES,
    INLINE,
    MainObject,
    _cloudpickle,
    _dumps,
    _encode_with_cloudpickle,
    bound_to_state,
    inline_stand_in,
    load_tabled,
    of_main,
    portable,
    with_main_stand_ins,
)
from mpsched._weakset import QuietWeakSet

_UNDERSCORE = ord("_")  # a byte, for ``in`` on bytes
# How a global of __main__ starts in a pickle of PICKLE_PROTOCOL (>= 4): its module name as a
# SHORT_BINUNICODE. The first one is always written whole (later ones may be memo hits).
_MAIN_MODULE = b"\x8c\x08__main__"
# Bytes; a longer call is not searched for the names its stand-ins would replace: one scan of
# it costs about as much as the second pickling a false alarm costs (a MiB: ~0.5 ms each here),
# and a big payload (an array) was searched once for __main__ and once per missing name.
NAMES_SCANNED_BYTES_MAX = 1024

# Past this many names of the caller's __main__ that the workers' lacks (a notebook's, or
# ``python -c``'s: theirs is empty), a call that names __main__ gets its stand-ins without
# looking for each name (~0.2 us each): it most likely needs them.
MISSING_NAMES_SCANNED = 16


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

    __slots__ = ("bindings", "cells", "first", "hit", "tablings")

    def __init__(
        self,
        fid: int,
        stand_in: Any,
        bindings: Bindings,
        cells: Cells,
        tablings: int,
        first: Bindings,
    ) -> None:
        self.hit = (fid, stand_in)
        self.bindings = bindings
        self.cells = cells
        self.tablings = tablings  # fresh copies made before this one
        # The bindings of the first copy: what the workers' own objects of those names are
        # taken to read (``_rebound_classes``).
        self.first = first

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


def _captured(fn: Callable[..., Any]) -> tuple[Bindings, Cells, list[type]]:
    """The bindings cloudpickle's copy of ``fn`` takes, and their values now: the globals named
    by its code's global-name instructions, nested code's included (cloudpickle's own
    ``_extract_code_globals``: the very names its copy takes), and its closure's cells; then the
    same for every function and class among those values that cloudpickle copies by value too
    (``_should_pickle_by_reference``: those of ``__main__``), whose globals the copy carries.
    A global absent from its namespace is watched as ``_MISSING`` (it may be defined later).
    Also those classes (``copy_by_value`` sends them as stand-ins: ``_rebound_classes``).

    Call it before making the copy: a binding rebound in between then reads as changed (a
    needless copy), never as current with a stale copy.
    """
    pickler = _cloudpickle().cloudpickle
    # Private to cloudpickle (present since 2.0; pyproject needs 2.2): fall back to a superset.
    code_globals = getattr(pickler, "_extract_code_globals", _code_names)
    by_reference = getattr(pickler, "_should_pickle_by_reference", _outside_main)
    bindings: dict[tuple[int, str], tuple[dict[str, Any], str, Any]] = {}
    cells: list[tuple[types.CellType, Any]] = []
    classes: list[type] = []
    seen: set[int] = set()  # ids of objects alive throughout (reachable from fn)
    todo: list[Any] = [fn]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        found: list[Any] = []
        if isinstance(obj, type):  # copied with its methods and bases
            classes.append(obj)
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
    return tuple(bindings.values()), tuple(cells), classes


def _rebound_classes(classes: list[type], first: Bindings) -> list[type]:
    """Those of ``classes`` (of ``__main__``) that read, through their methods, a global whose
    value is not the one it held at the first copy (``first``). A copy sends the others as
    stand-ins, which load as the worker's class of that name where it has one (so that ``is``
    and ``isinstance`` agree with the arguments, pickled by name); these go by value, so that
    their methods see the rebound value, as the function's copy does."""
    held = {(id(namespace), name): value for namespace, name, value in first}
    return [
        cls
        for cls in classes
        if any(
            value is not held.get((id(namespace), name), _MISSING)
            for namespace, name, value in _captured(cls)[0]
        )
    ]


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
        # Not a WeakSet, whose removal (a Python callback) ran as each such task's function
        # died: a Ctrl-C landing there was lost (see _weakset).
        self._untabled: QuietWeakSet[Any] = QuietWeakSet()
        self._full = False
        self._lock = threading.Lock()
        # The names in the workers' __main__ (None: not known yet), and what the names of the
        # caller's __main__ that they lack look like in a pickle, with the (size, last name) of
        # the caller's __main__ they were taken at (a name defined since changes one of them).
        self._worker_main: frozenset[str] | None = None
        self._missing: tuple[tuple[int, str], list[bytes]] = ((-1, ""), [])
        # The fid of each class of __main__ tabled with its copy (MainObject), and of each
        # function of it that lru_cache wraps (its stand-in), for the calls' stand-ins; weak,
        # as a notebook redefines them. Written under _lock.
        self._stand_in_fids: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        # The classes of this process's __main__ under names that the workers' has, as they
        # were at READY (note_worker_main, _redefined).
        self._classes_at_start: dict[str, weakref.ref[type]] = {}

    def note_worker_main(self, names: Iterable[str]) -> None:
        """The names in the workers' ``__main__`` (their zygote's, at READY), and the classes
        that this process's ``__main__`` has under those names now (``_redefined``)."""
        self._worker_main = worker_main = frozenset(names)
        namespace = getattr(sys.modules.get("__main__"), "__dict__", None) or {}
        self._classes_at_start = {
            name: weakref.ref(value)
            for name, value in list(namespace.items())
            if name in worker_main and isinstance(value, type) and of_main(value)
        }
        self._missing = ((-1, ""), [])  # looked for again

    def _redefined(self, namespace: dict[str, Any]) -> list[str]:
        """The names of the workers' classes of ``__main__`` that this process's ``__main__``
        has bound to another object since the pool started (a class defined again: a notebook's
        cell run again, a script's main block). The workers' class of that name has the old
        body, so an argument of the new class goes as its copy, not by name: by name it ran
        the old methods (found in review). A redefinition before the pool started, in a
        script's main block, is not seen (spawn and forkserver run the script's top level
        again, which has the old one)."""
        return [name for name in self._classes_at_start if self._is_redefined(name, namespace)]

    def _is_redefined(self, name: str, namespace: dict[str, Any]) -> bool:
        """Whether ``namespace`` (this process's ``__main__``) binds ``name``, a class of the
        workers' ``__main__``, to another object than it did at READY (``_redefined``)."""
        ref = self._classes_at_start.get(name)
        return ref is not None and namespace.get(name) is not ref()

    def _may_name_a_missing_object(self, data: bytes) -> bool:
        """Whether ``data``, a call's plain pickle (one that names ``__main__`` if it is short),
        may name an object of ``__main__`` that the workers lack. Not if this process's
        ``__main__`` has no class or function whose name theirs lacks: then nothing is scanned.
        Else a call past ``NAMES_SCANNED_BYTES_MAX`` may if it names ``__main__`` at all, and a
        shorter one if, for such a class or function, it holds the name as a pickled string
        (``SHORT_BINUNICODE``, as a global's name is written, or any equal string that the
        global's name would be a memo hit of) or as the head of a qualname (``name.``). A false
        alarm costs a second pickling. A miss (the task then fails in the worker with "Can't
        get attribute", as before stand-ins) needs a short call and a name of 256 bytes or more,
        or a name that was bound to something else when this last looked and was rebound to a
        class or function since, with no name defined in between. ~0.2 us per name looked for.
        A class of the workers' ``__main__`` that this process's defined again since the pool
        started (``_redefined``) counts as missing (~50 ns per class of theirs), and so does a
        function that ``functools.lru_cache`` wraps (``_serialize._portable_cached``)."""
        worker_main = self._worker_main
        namespace = getattr(sys.modules.get("__main__"), "__dict__", None)
        patterns: list[bytes] | None = None  # None: the workers' names are not known
        if worker_main is not None and namespace:
            redefined = self._redefined(namespace) if self._classes_at_start else []
            state = (len(namespace), next(reversed(namespace)), *redefined)
            seen, patterns = self._missing
            if state != seen:
                patterns = []
                for name, value in list(namespace.items()):
                    raw = name.encode()
                    # A cached function's stand-in checks its code in the worker (as a task's
                    # own function does), which the name alone would not.
                    missing = name not in worker_main or name in redefined or type(value) is _CACHED
                    if missing and of_main(value) and len(raw) < 256:
                        patterns += (b"\x8c" + bytes((len(raw),)) + raw, raw + b".")
                self._missing = (state, patterns)
            if not patterns:
                return False
        if len(data) > NAMES_SCANNED_BYTES_MAX:
            return data.find(_MAIN_MODULE) >= 0
        if patterns is None or len(patterns) > 2 * MISSING_NAMES_SCANNED:
            return True  # a short call names __main__: encode looked
        return any(data.find(pattern) >= 0 for pattern in patterns)

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
            data = _dumps(call, PICKLE_PROTOCOL)
        except MemoryError:  # as in _serialize.dumps
            raise
        except Exception:
            return _encode_with_cloudpickle(call, self._stand_in)
        # An object of __main__ (an argument's class) may be missing in the workers. A "_"
        # first: a memchr (~15 ns), where looking for "__main__" costs ~0.1 us (bytes.find's
        # argument parsing), and a call of numbers and None has no "_" at all. A long call is
        # searched for __main__ only if something of this __main__ is missing in the workers.
        if (
            _UNDERSCORE in data
            and (len(data) > NAMES_SCANNED_BYTES_MAX or data.find(_MAIN_MODULE) >= 0)
            and self._may_name_a_missing_object(data)
        ):
            return with_main_stand_ins(call, data, self._stand_in)
        return data

    def _stand_in(self, obj: Any) -> tuple[Any, ...] | None:
        """``with_main_stand_ins``'s stand-in for ``obj`` (a class or function of ``__main__``)
        in a task: a reference to its entry in the function table, which loads (once per
        worker) to the worker's object of that name or else to the copy (a few bytes a task,
        where a copy inline is KBs: a dataclass's ~3 KB). A class the workers' ``__main__``
        has goes by reference (None); a function goes as a task's own function does (``fid``:
        by name only if the worker's has the same code)."""
        if isinstance(obj, type):
            worker_main = self._worker_main
            head = obj.__qualname__.partition(".")[0]
            namespace = getattr(sys.modules.get("__main__"), "__dict__", None) or {}
            redefined = self._is_redefined(head, namespace)
            if worker_main is not None and head in worker_main and not redefined:
                return None
            fid = self._stand_in_fids.get(obj)
            if fid is None:
                fid = self._table_stand_in(obj, name_first=not redefined)
        elif type(obj) is _CACHED:
            # Tabled as a class is: inline, its copy (up to MAIN_BY_VALUE_MAX) went with every
            # task, and was loaded by each (found in review: 53 -> 792 bytes a task).
            fid = self._stand_in_fids.get(obj)
            if fid is None:
                fid = self._table_stand_in(obj, name_first=True)
        else:
            fid = self.fid(obj)
        return inline_stand_in(obj) if fid == INLINE else (load_tabled, (fid,))

    def _table_stand_in(self, obj: Any, name_first: bool) -> int:
        """``obj`` (a class of ``__main__``, or a function of it that ``lru_cache`` wraps)
        tabled with its copy (its fid), or INLINE if the table is full or the copy cannot be
        made (for good: a copy past ``MAIN_BY_VALUE_MAX``). ``name_first``: see
        ``MainObject``. Its copy holds what it refers to as it is now (a global its methods
        read), as any copy does."""
        with self._lock:
            fid = self._stand_in_fids.get(obj)
            if fid is not None or self._full:
                return INLINE if fid is None else fid
            try:
                stand_in = MainObject(obj, name_first) if isinstance(obj, type) else portable(obj)
                if stand_in is obj:
                    raise ValueError("no copy")  # too big: by reference, as inline_stand_in's
                data = _dumps(stand_in, PICKLE_PROTOCOL)
            except Exception:  # no copy: by reference (inline_stand_in's answer, kept too)
                self._stand_in_fids[obj] = INLINE  # not tried again on every task
                return INLINE
            fid = self._table_add(data)
            if fid == INLINE:
                self._full = True
            else:
                self._stand_in_fids[obj] = fid
            return fid

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
        if bound_to_state(fn):  # no lock, nothing remembered: each ``d.get`` is a new object
            return INLINE, fn
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
        bindings, cells, classes = _captured(fn)  # before the copy: see _captured
        first = bindings if old is None else old.first
        copied = [] if old is None else _rebound_classes(classes, first)
        stand_in = portable(fn, name_first=old is None, copied=copied)
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
        self._main[fn] = _MainEntry(fid, stand_in, bindings, cells, tablings, first)
        return fid, stand_in

    def close(self) -> None:
        """The table's memory is about to go: from now on a new function (or a fresh copy of a
        ``__main__`` function) goes inline. (A submitter racing a shutdown may still be here;
        the pool then refuses its task.)"""
        with self._lock:
            self._full = True
