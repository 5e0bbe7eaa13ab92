"""The forkserver preloads the zygote's modules (``_shm.preload_in_forkserver``), in a fresh
interpreter each: the preload list is read once, when the forkserver starts.

What a forkserver imported is seen in a process that it forks for a plain ``Process``, whose
target lives in the user's script (``__mp_main__`` there imports only the package itself).
"""

from __future__ import annotations

import json
import pathlib

import pytest

from .test_main_module import _run_main

SCRIPT = """
import json, multiprocessing as mp, sys
from multiprocessing import forkserver
import mpsched

def loaded(conn):
    conn.send(sorted(m for m in sys.modules if m.startswith("mpsched.")))

def forkserver_modules():
    ctx = mp.get_context("forkserver")
    ours, theirs = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=loaded, args=(theirs,))
    proc.start()
    theirs.close()
    modules = ours.recv()
    proc.join()
    return modules

if __name__ == "__main__":
    if sys.argv[1] == "running":  # the user's own forkserver Process came first
        forkserver_modules()
    else:
        mp.set_forkserver_preload(["__main__", "json"])
    with mpsched.Pool(2, start_method="forkserver") as pool:
        result = pool.submit(pow, 2, 5).result(timeout=20)
    print(json.dumps({
        "result": result,
        "preload": forkserver._forkserver._preload_modules,
        "modules": forkserver_modules(),
    }))
"""


@pytest.mark.timeout(60)
def test_a_pool_that_starts_the_forkserver_has_it_preload_the_zygote(
    tmp_path: pathlib.Path,
) -> None:
    out = json.loads(_run_main(tmp_path, SCRIPT, "first").stdout)
    assert out["result"] == 32
    assert out["preload"] == ["__main__", "json", "mpsched._zygote"]
    assert {"mpsched._zygote", "mpsched._worker"} <= set(out["modules"])


@pytest.mark.timeout(60)
def test_a_running_forkserver_is_used_as_it_is(tmp_path: pathlib.Path) -> None:
    out = json.loads(_run_main(tmp_path, SCRIPT, "running").stdout)
    assert out["result"] == 32
    assert out["preload"] == ["__main__"]
    assert "mpsched._zygote" not in out["modules"]
