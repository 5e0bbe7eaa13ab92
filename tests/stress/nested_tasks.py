"""Task bodies of the nested-task and map model test (``test_nested_model``); module-level and
light, so that workers import them by reference without pulling in pytest or hypothesis.

A tree node is a plain tuple (picklable, compared by value):
``(node_id, children, joins, fail)``:

* ``children``: the child nodes, each spawned with ``mpsched.submit`` in this order;
* ``joins``: ``(child index, mode)`` pairs in join order, each index at most once; a child not
  listed is never joined (its future is dropped: it still runs, its outcome is discarded).
  Modes: ``"result"`` (a child's error propagates: the node raises it, and the joins after it
  never happen), ``"catch"`` (``result()``, its error caught and recorded), ``"exception"``
  (``exception()``, then ``result()`` of a child that did not raise);
* ``fail``: None, or the name of an exception type (``EXCEPTIONS``) that the node raises after
  its joins (instead of returning).

The same code is the reference: ``run_node(..., sequential=True)`` runs each child in the
calling process at its spawn. Every run logs its node id with one ``O_APPEND`` write, so that
"ran exactly once" is read off the log."""

from __future__ import annotations

from typing import Any

import mpsched
from tests.stress.model_tasks import append

JOIN_TIMEOUT = 30.0  # s a node waits for a child: a hang fails the tree, not the test run


class TreeError(Exception):
    """A user exception type of this module (pickled by reference across the pool)."""


EXCEPTIONS: dict[str, type[Exception]] = {
    "ValueError": ValueError,
    "KeyError": KeyError,
    "TreeError": TreeError,
}

Node = tuple[str, tuple[Any, ...], tuple[tuple[int, str], ...], str | None]


def read_log(path: str) -> list[Any]:
    """The complete records of the log, in write order."""
    import ast

    try:
        with open(path) as f:
            return [ast.literal_eval(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def describe(exc: BaseException) -> tuple[str, tuple[Any, ...]]:
    """An exception as a comparable value (exceptions compare by identity)."""
    return type(exc).__name__, exc.args


class Ran:
    """The sequential reference's stand-in for a ``ChildFuture``: ran at its spawn."""

    def __init__(self, value: Any, error: BaseException | None) -> None:
        self.value, self.error = value, error

    def result(self, timeout: float | None = None) -> Any:
        if self.error is not None:
            raise self.error
        return self.value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self.error


def _run_now(node: Node, log: str) -> Ran:
    try:
        return Ran(run_node(node, log, True), None)
    except Exception as exc:
        return Ran(None, exc)


def run_node(node: Node, log: str, sequential: bool = False) -> tuple[str, tuple[Any, ...]]:
    """Run one node (see the module docstring); returns ``(node_id, parts)``, one part per
    join, in join order."""
    node_id, children, joins, fail = node
    append(log, node_id)
    futures: list[Any] = [
        _run_now(child, log) if sequential else mpsched.submit(run_node, child, log)
        for child in children
    ]
    parts: list[Any] = []
    for index, mode in joins:
        future = futures[index]
        if mode == "exception":
            error = future.exception(JOIN_TIMEOUT)
            if error is None:
                parts.append(("value", future.result(0)))
            else:
                parts.append(("exception", describe(error)))
        elif mode == "catch":
            try:
                parts.append(("value", future.result(JOIN_TIMEOUT)))
            except Exception as exc:
                parts.append(("caught", describe(exc)))
        else:
            parts.append(("value", future.result(JOIN_TIMEOUT)))
    del futures  # the children never joined are abandoned here (if not by a raise above)
    if fail is not None:
        raise EXCEPTIONS[fail](node_id)
    return node_id, tuple(parts)


def map_item(log: str | None, bad: frozenset[int], x: int, y: int | None = None) -> Any:
    """A ``Pool.map`` function: logs ``x`` (its position), raises on the positions in
    ``bad``, returns a value of ``x`` (and ``y``)."""
    if log is not None:
        append(log, x)
    if x in bad:
        raise (KeyError if x % 2 else ValueError)(f"bad item {x}")
    return x * 3 + 1 if y is None else (x, y)


def echo(x: Any) -> Any:
    return x
