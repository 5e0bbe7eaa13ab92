"""A worker killed mid-task: only its running task fails; the pool replaces it and goes on."""

from __future__ import annotations

import os
import signal

import pytest

from mpsched import Pool, WorkerCrashedError

from . import tasks


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["forkserver", "fork"])
def test_sigkill_of_a_worker_fails_only_its_running_task(
    tmp_path: object, start_method: str
) -> None:
    started = os.path.join(str(tmp_path), "started")
    gate = os.path.join(str(tmp_path), "gate")
    os.mkfifo(started)
    os.mkfifo(gate)
    with Pool(2, start_method=start_method) as pool:
        victim = pool.submit(tasks.report_pid_then_gate, started, gate)
        pid = tasks.read_pid(started)  # the task runs in worker `pid` and waits at the gate
        others = [pool.submit(tasks.add, i, i) for i in range(2000)]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerCrashedError, match=r"SIGKILL\(-9\)") as info:
            victim.result()
        assert info.value.exitcode == -9
        assert [f.result() for f in others] == [2 * i for i in range(2000)]  # nothing else lost
        assert pool.submit(tasks.pid_of).result() != pid
        stats = pool.statistics()
        assert stats.crashes == 1
        assert stats.respawns == 1  # a replacement was asked for: the pool keeps its size
