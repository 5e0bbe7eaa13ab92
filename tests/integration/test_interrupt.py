"""Ctrl-C (SIGINT) in the coordinator's process while it waits on a result or inside ``map``:
the KeyboardInterrupt reaches the caller, no worker prints a traceback, and leaving the ``with``
block shuts the pool down without hanging (run as a subprocess, like a user's terminal)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXIT_DEADLINE = 20.0  # s from the SIGINT to the process's exit

SCRIPT = """
import sys, time
import mpsched
from tests.integration import tasks

if __name__ == "__main__":
    mode, start_method = sys.argv[1], sys.argv[2]
    try:
        with mpsched.Pool(2, start_method=start_method) as pool:
            assert pool.submit(tasks.ident, 1).result() == 1
            print("ready", flush=True)  # the test sends SIGINT after this line
            if mode == "result":
                pool.submit(tasks.spin, 60.0).result()
            else:
                for _ in pool.map(tasks.spin, [0.05] * 100_000):
                    pass
    except KeyboardInterrupt:
        print("caught KeyboardInterrupt", flush=True)
        raise
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["result", "map"])
@pytest.mark.parametrize("start_method", ["forkserver", "fork"])
def test_ctrl_c_reaches_the_caller_and_the_pool_shuts_down(mode: str, start_method: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, mode, start_method],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=EXIT_DEADLINE)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "caught KeyboardInterrupt" in out
    assert proc.returncode != 0
    # One traceback: the caller's. A worker printing its own would add another.
    assert err.count("Traceback (most recent call last)") == 1, err
    assert err.rstrip().endswith("KeyboardInterrupt"), err
