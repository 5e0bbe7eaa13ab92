"""An importable function that reads a module global (``test_main_globals``)."""

from __future__ import annotations

FACTOR = 1


def scaled(x: int) -> int:
    return x * FACTOR
