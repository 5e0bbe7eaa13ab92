"""Tasks whose module records the process that imported it (the first-task preload tests).

Imported by the test process only through its test module, never by ``__main__``: so a
forkserver or spawn zygote has it only if it imported it for the pool's first task.
"""

from __future__ import annotations

import os

IMPORTED_IN = os.getpid()


def where_imported(_: object = None) -> tuple[int, int]:
    """(the pid of the process that imported this module, this task's pid)."""
    return IMPORTED_IN, os.getpid()
