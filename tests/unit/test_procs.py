"""agent/jobs/procs.py: a process's identity survives a step of the wall clock."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from agent.jobs import procs


@pytest.fixture
def child():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p
    p.kill()
    p.wait()


def test_create_time_is_the_kernels_seconds_since_boot(child: subprocess.Popen) -> None:
    with open(f"/proc/{child.pid}/stat", "rb") as f:
        ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
    assert procs.create_time(child.pid) == ticks / os.sysconf("SC_CLK_TCK")
    # psutil adds a boot time derived from the wall clock; ours does not move with it.
    wall = psutil.Process(child.pid).create_time() - psutil.boot_time()
    assert abs(procs.create_time(child.pid) - wall) < 0.05
    assert procs.create_time(2**22 + 1) == 0.0  # above pid_max: no such process


def test_alive_tells_the_recorded_process_from_a_reused_pid(child: subprocess.Popen) -> None:
    started = procs.create_time(child.pid)
    assert procs.alive(child.pid, started)
    assert procs.alive(child.pid)
    assert not procs.alive(child.pid, started - 1.0)  # another process under the same PID
    # A record written by an older agent holds psutil's wall-clock time.
    assert procs.alive(child.pid, psutil.Process(child.pid).create_time())
    child.kill()
    child.wait()
    assert not procs.alive(child.pid, started)
