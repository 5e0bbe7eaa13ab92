"""QuietWeakSet: a set of weakly held objects whose entries run no Python code when they die.

``weakref.WeakSet`` removes a dead entry from a weakref callback written in Python, which the
garbage collector or a reference count runs wherever the object happens to die. The interpreter
prints and ignores any exception raised there, a Ctrl-C's KeyboardInterrupt included. A Ctrl-C
that lands in such a callback is therefore lost: nothing is raised in the caller, who must
press it again. The random-SIGINT harness saw this 3 times in ~1,000 trials, through
``Pool._maps``, one entry per ``map`` call. Here, an entry is a callback-free ``weakref.ref``,
keyed by the object's ``id``, and dead entries are pruned as entries are added, so the set
stays within twice its live size (and at least ``PRUNE_MIN``).

Not thread-safe: each owner calls it under its own lock (``Pool._maps_lock``,
``FunctionCache._lock``). The objects must be weakly referenceable (``add`` raises TypeError
otherwise, as ``WeakSet.add`` does).
"""

from __future__ import annotations

import weakref
from typing import Generic, TypeVar

T = TypeVar("T")

PRUNE_MIN = 64  # entries below which add() never prunes (a scan per add would cost O(n^2))


class QuietWeakSet(Generic[T]):
    __slots__ = ("_prune_at", "_refs")

    def __init__(self) -> None:
        # id -> ref: a dead object's id may be reused by a live one, whose add() replaces it.
        self._refs: dict[int, weakref.ref[T]] = {}
        self._prune_at = PRUNE_MIN

    def add(self, obj: T) -> None:
        ref = weakref.ref(obj)
        refs = self._refs
        if len(refs) >= self._prune_at:
            self._refs = refs = {key: r for key, r in refs.items() if r() is not None}
            self._prune_at = max(PRUNE_MIN, 2 * len(refs))
        refs[id(obj)] = ref

    def __contains__(self, obj: object) -> bool:
        ref = self._refs.get(id(obj))
        return ref is not None and ref() is obj

    def live(self) -> list[T]:
        """The objects still alive (in the order of their entries: a live object that took a
        dead one's id holds that entry)."""
        return [obj for ref in self._refs.values() if (obj := ref()) is not None]
