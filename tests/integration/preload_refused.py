"""A task module that refuses to be imported in any process of a pool (its zygote and its
workers carry the zygote's process name): the zygote's import of it for the first task
fails, and so does each worker's."""

from __future__ import annotations

import multiprocessing

if multiprocessing.current_process().name == "mpsched-zygote":
    raise ImportError("preload_refused: not in a pool's process")


def one() -> int:
    return 1
