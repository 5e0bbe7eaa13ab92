"""The task of ``bench_pool``'s ``recycle`` workload: a module whose import is heavy, as a data
pipeline's task module is (one that imports pandas or torch). Here it imports ``distributed``
(~0.3 s on this machine), which the ``bench`` extra installs. Only the probe imports it, inside
its function: so no pool's process (a forkserver, a zygote) has it before the pool's first task.
"""

from __future__ import annotations

import distributed  # noqa: F401  the heavy import: what each new worker would pay


def ident(x: int) -> int:
    return x
