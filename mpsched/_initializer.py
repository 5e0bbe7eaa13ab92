"""The pool's initializer on its way to the workers.

Owns how ``Pool(initializer=, initargs=)`` is pickled. Called in the user's thread by
``Pool.__init__`` (``pickled_initializer``); what it returns travels in the worker options of
the zygote's config, and each worker runs it once (``_worker.run_initializer``).

Mostly the pair ``(initializer, initargs)`` is pickled at ``Pool()``, as a task is, so that an
unpicklable one fails there. Multiprocessing's synchronization objects are the exception: its
``Lock``, ``Value`` and ``Queue`` pickle only while multiprocessing starts a process, "through
inheritance", and a ``Connection`` pickles at any time as the bare number of its fd, which in
a worker names another file or none. ProcessPoolExecutor passes such ``initargs`` to its
workers as it starts them (the standard way to give them a shared counter or a queue), so here
they go as an ``InheritedInitializer``: the function and every argument that can be pickled
at ``Pool()``, as a task's are, and the others kept as objects, which multiprocessing pickles
with the zygote's config as it starts the zygote (forkserver, spawn: their fds go along) and a
fork passes on as they are. The zygote holds them; each worker has them from its fork. Whether
multiprocessing will pickle them is tried at ``Pool()`` (``_check_inheritable``), so that
their error still comes there.
"""

from __future__ import annotations

from mpsched._serialize import TaskPicklingError, dumps_for_workers, portable

# typing.TYPE_CHECKING without importing typing at run time (why: mpsched/__init__.py).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__all__ = ("InheritedInitializer", "pickled_initializer")

# By this module name a pickle names a Connection's class (plain pickle copies its fd number).
_CONNECTION_MODULE = b"multiprocessing.connection"


class InheritedInitializer:
    """The initializer's function, pickled; its arguments that can be pickled, pickled together
    (so that two of them that are one object stay one), with their positions; and the others
    as objects, with theirs (see the module doc). ``load`` runs in a worker."""

    __slots__ = ("function", "inherited", "pickled", "positions")

    def __init__(
        self,
        function: bytes,
        pickled: bytes,
        positions: tuple[int, ...],
        inherited: tuple[tuple[int, Any], ...],
    ) -> None:
        self.function = function
        self.pickled = pickled
        self.positions = positions
        self.inherited = inherited

    def __reduce__(self) -> tuple[Any, ...]:
        return InheritedInitializer, (self.function, self.pickled, self.positions, self.inherited)

    def load(self) -> tuple[Any, tuple[Any, ...]]:
        import pickle

        args: dict[int, Any] = dict(zip(self.positions, pickle.loads(self.pickled), strict=True))
        args.update(self.inherited)
        return pickle.loads(self.function), tuple(args[i] for i in range(len(args)))


def pickled_initializer(
    fn: Any, args: tuple[Any, ...], start_method: str
) -> bytes | InheritedInitializer:
    """``(fn, args)`` pickled for the workers, or an ``InheritedInitializer`` whose arguments
    that only a process's start can carry stay objects (see the module doc). Decided argument
    by argument: the others go as a task's do, a function of the main script's main block
    included, which multiprocessing's pickler writes by a name that the zygote lacks (the
    whole tuple went so, and the zygote died of it; a diff review).

    Raises:
        TaskPicklingError: ``fn`` cannot be pickled, or an argument neither as a task's nor
            by multiprocessing as it starts the zygote.
    """
    try:
        data: bytes | None = dumps_for_workers((portable(fn), args))
    except TaskPicklingError:
        data = None
    if data is not None and _CONNECTION_MODULE not in data:
        return data
    function = dumps_for_workers(portable(fn))  # the function's own error, if it is it
    inherited = [(i, arg) for i, arg in enumerate(args) if _only_a_start_carries(arg)]
    if data is not None and not inherited:  # its pickle only named the module
        return data
    if start_method != "fork":  # a fork pickles nothing: every object passes
        _check_inheritable(tuple(arg for _, arg in inherited))
    carried = {i for i, _ in inherited}
    positions = tuple(i for i in range(len(args)) if i not in carried)
    pickled = dumps_for_workers(tuple(args[i] for i in positions))
    return InheritedInitializer(function, pickled, positions, tuple(inherited))


def _only_a_start_carries(arg: Any) -> bool:
    """Whether ``arg`` cannot go as a task's argument: it does not pickle so, or it holds a
    multiprocessing ``Connection``, which plain pickle copies as a bare fd number. Its pickle
    naming the module is no proof: a function that calls ``multiprocessing.connection.wait``
    names it too (a diff review); plain pickle's walk of it, stopped at the first one, is (an
    object plain pickle refuses hides none from it: cloudpickle's copy is tried in the
    worker, which refuses a Connection)."""
    try:
        part = dumps_for_workers(arg)
    except TaskPicklingError:
        return True
    if _CONNECTION_MODULE not in part:
        return False
    import io
    import pickle
    from multiprocessing.connection import Connection

    class Finder(pickle.Pickler):
        def reducer_override(self, candidate: Any) -> Any:
            if isinstance(candidate, Connection):
                raise _Found
            return NotImplemented

    try:
        Finder(io.BytesIO(), pickle.HIGHEST_PROTOCOL).dump(arg)
    except _Found:
        return True
    except Exception:  # refused by plain pickle: see above
        pass
    return False


class _Found(Exception):
    """Ends ``_only_a_start_carries``'s walk at its first find."""


class _SpawnProbe:
    """Stands for the zygote's ``Popen`` while ``_check_inheritable`` pickles: what
    multiprocessing's reductions ask of it (an fd to pass on) it answers without a process."""

    class DupFd:
        def __init__(self, fd: int) -> None:
            self.fd = fd

    @staticmethod
    def duplicate_for_child(fd: int) -> int:
        return fd


def _check_inheritable(args: tuple[Any, ...]) -> None:
    """Pickle ``args`` as multiprocessing will as it starts the zygote (its pickler, a process
    being started), to fail at ``Pool()`` as any unpicklable argument does."""
    from multiprocessing import context, reduction

    probe: Any = _SpawnProbe()  # (typed as one of multiprocessing's Popen classes)
    context.set_spawning_popen(probe)
    try:
        reduction.ForkingPickler.dumps(args)
    except Exception as exc:
        raise TaskPicklingError(
            f"cannot pickle the initializer's arguments, nor can multiprocessing as it starts "
            f"a process: {exc!r}"
        ) from exc
    finally:
        context.set_spawning_popen(None)
