"""agent.jobs.threadhold on real processes: a stopped tree's threads held by ptrace, one let run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from fakes import wait_stopped

from agent.jobs import procs
from agent.jobs.threadhold import ThreadHold, ThreadHoldError, threads

SPIN = """
import threading
def spin():
    while True:
        pass
threading.Thread(target=spin, daemon=True).start()
print("ready", flush=True)
spin()
"""


def state(pid: int, tid: int) -> str:
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def user_ticks(pid: int, tid: int) -> int:
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[11])  # utime: user-mode clock ticks


def settled(pid: int, tids: list[int], states: str) -> dict[int, str]:
    """Each thread's state once all are in `states` (or after 2 s, as they are)."""
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and not all(state(pid, t) in states for t in tids):
        time.sleep(0.01)
    return {t: state(pid, t) for t in tids}


@pytest.fixture
def spinner():
    p = subprocess.Popen([sys.executable, "-c", SPIN], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    yield p
    p.kill()
    p.wait()
    p.stdout.close()


def test_only_the_restore_thread_runs_while_the_tree_is_held(spinner) -> None:
    pid = spinner.pid
    main, helper = threads(pid)
    os.kill(pid, signal.SIGSTOP)
    wait_stopped(pid)
    hold = ThreadHold([pid], {helper})
    try:
        time.sleep(0.2)
        assert state(pid, main) == "t"  # in its ptrace stop
        assert state(pid, helper) in "RS"  # running (or waiting for the interpreter's lock)
    finally:
        hold.release()
    # Released: back in the group stop until the caller's SIGCONT, at the commit point.
    assert settled(pid, [main, helper], "T") == {main: "T", helper: "T"}
    ticks = {t: user_ticks(pid, t) for t in (main, helper)}
    time.sleep(0.3)
    assert {t: user_ticks(pid, t) for t in (main, helper)} == ticks
    procs.resume([pid])
    deadline = time.monotonic() + 10  # a loaded machine may take a while to schedule it
    while user_ticks(pid, main) + user_ticks(pid, helper) == sum(ticks.values()):
        assert time.monotonic() < deadline, "the job did not run after its SIGCONT"
        time.sleep(0.05)


def test_a_restore_thread_that_is_not_the_processes_own_is_refused_and_nothing_stays_held(spinner) -> None:
    pid = spinner.pid
    os.kill(pid, signal.SIGSTOP)
    wait_stopped(pid)
    with pytest.raises(ThreadHoldError, match="not threads of processes"):
        ThreadHold([pid], {os.getpid()})
    assert settled(pid, threads(pid), "T") == dict.fromkeys(threads(pid), "T")  # left as it was
    procs.resume([pid])  # and not left traced: SIGCONT lets it go as usual
    assert "T" not in settled(pid, threads(pid), "RS").values()
