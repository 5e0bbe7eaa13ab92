"""SIGKILL of the coordinator's process: its zygote and workers are gone within 2 s, and
nothing of the pool stays in /dev/shm. SIGKILL of the zygote: its workers go with it, even
busy ones (PR_SET_PDEATHSIG), and the pool breaks."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import psutil
import pytest

import mpsched

from . import tasks

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEATH_DEADLINE = 2.0  # seconds, from the issue

SCRIPT = """
import json, sys, time
import mpsched
from tests.integration import tasks

if __name__ == "__main__":
    pool = mpsched.Pool(2, start_method=sys.argv[1])
    busy = [pool.submit(tasks.spin, 60.0) for _ in range(4)]  # workers are mid-task when killed
    while True:  # until both workers have started (the coordinator knows their pids)
        pids = [w.pid for w in pool.statistics().per_worker]
        if all(pids):
            break
        time.sleep(0.01)
    print(json.dumps({"workers": sorted(pids), "zygote": pool._zygote.pid}), flush=True)
    busy[0].result()
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["forkserver", "spawn", "fork"])
def test_sigkill_of_the_coordinator_takes_everything_with_it(start_method: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, start_method],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
        assert len(info["workers"]) == 2
        ours = [psutil.Process(pid) for pid in [*info["workers"], info["zygote"]]]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        _, alive = psutil.wait_procs(ours, timeout=DEATH_DEADLINE)
        assert not alive, f"still alive {DEATH_DEADLINE} s after the coordinator died: {alive}"
        left = [n for n in os.listdir("/dev/shm") if n.startswith(f"sem.mpsched-{proc.pid}-")]
        assert not left, f"left in /dev/shm: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["forkserver", "spawn", "fork"])
def test_sigkill_of_the_zygote_takes_its_busy_workers_with_it(start_method: str) -> None:
    pool = mpsched.Pool(2, start_method=start_method)
    try:
        busy = [pool.submit(tasks.spin, 60.0) for _ in range(2)]
        deadline = time.monotonic() + 20.0
        # Until both workers run a task: an idle worker would also exit on its socket's EOF.
        # And until the coordinator registered both (a worker takes a task from its inbox
        # before the coordinator reads its SPAWNED: statistics() says pid 0 until then).
        while sum(slot.run_depth() for slot in pool._views.slots) < 2 or not all(
            w.pid for w in pool.statistics().per_worker
        ):
            assert time.monotonic() < deadline, "the workers did not start their tasks"
            time.sleep(0.01)
        workers = [psutil.Process(w.pid) for w in pool.statistics().per_worker]
        os.kill(pool._zygote.pid, signal.SIGKILL)
        _, alive = psutil.wait_procs(workers, timeout=DEATH_DEADLINE)
        assert not alive, f"still alive {DEATH_DEADLINE} s after the zygote died: {alive}"
        for future in busy:
            with pytest.raises(mpsched.BrokenPoolError):
                future.result(timeout=20.0)
    finally:
        pool.shutdown(wait=True)
