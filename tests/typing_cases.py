"""User code of the public API, checked by mypy --strict in tests/test_quality.py (never run).

Correct uses must pass; each wrong one carries the ``# type: ignore[code]`` of the error mypy
must report there (``warn_unused_ignores``: an ignore with nothing to ignore is itself an error),
so that the API's types are seen to catch it.
"""

from __future__ import annotations

import mpsched
from mpsched import Pol  # type: ignore[attr-defined]


def typo_in_a_module_attribute() -> None:
    mpsched.curent_task()  # type: ignore[attr-defined]
    mpsched.current_task()
    print(Pol)
