"""QuietWeakSet: membership by identity, weak holding, and pruning that keeps it bounded."""

from __future__ import annotations

import gc

import pytest

from mpsched import _weakset
from mpsched._weakset import QuietWeakSet


class _Item:
    pass


def test_members_are_held_weakly_and_found_by_identity() -> None:
    s: QuietWeakSet[_Item] = QuietWeakSet()
    a, b = _Item(), _Item()
    s.add(a)
    s.add(a)  # a repeat is one entry
    s.add(b)
    assert a in s
    assert b in s
    assert _Item() not in s
    assert s.live() == [a, b]
    del a
    gc.collect()
    assert s.live() == [b]


def test_an_object_that_is_not_weakly_referenceable_is_refused() -> None:
    s: QuietWeakSet[object] = QuietWeakSet()
    with pytest.raises(TypeError):
        s.add(1)


class _Big:
    """Of another allocator size class than ``_Item``: it never takes a dead ``_Item``'s id
    (which would replace that entry, pruning or not)."""

    __slots__ = ("__weakref__", *(f"f{i}" for i in range(20)))


def test_dead_entries_are_pruned_once_the_set_doubles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many short-lived members (a map per call, a lambda per task) leave at most about twice
    the live entries (and ``PRUNE_MIN``), not one per member ever added."""
    monkeypatch.setattr(_weakset, "PRUNE_MIN", 8)
    s: QuietWeakSet[object] = QuietWeakSet()
    batch = [_Item() for _ in range(100)]
    for item in batch:
        s.add(item)
    del batch, item
    gc.collect()
    kept = []
    for _ in range(100):
        kept.append(_Big())
        s.add(kept[-1])
        assert len(s._refs) <= 2 * (100 + len(kept))
    assert all(ref() is not None for ref in s._refs.values())  # the 100 dead ones went
    assert s.live() == kept


def test_an_object_that_took_a_dead_members_id_is_not_a_member() -> None:
    """Entries are keyed by ``id()``, which a dead member's successor may take: membership
    also checks that the entry's referent is that object (a map or a function never added
    was taken for one). CPython's allocator hands a freed block to the next object of its
    size at once, mostly; tried until it does."""
    s: QuietWeakSet[_Item] = QuietWeakSet()
    reused = 0
    for _ in range(1000):
        member = _Item()
        s.add(member)
        dead_id = id(member)
        del member
        stranger = _Item()
        if id(stranger) == dead_id:
            reused += 1
            assert stranger not in s
            if reused == 10:
                break
    assert reused, "no id was reused: nothing was checked"
