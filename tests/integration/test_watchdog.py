"""ferry-init's fencing watchdog, on a real PID 1: a word arms it, silence stops the job, a newer
word lets it go on, and a word of -1 disarms it (docs/recovery.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from agent import config
from agent.jobs import fence
from agent.jobs.record import JobKind, JobRecord, JobState
from agent.testing.poll import wait_for

TICK = "import time\nwhile True:\n    print(f'{time.time():.3f}', flush=True)\n    time.sleep(0.02)\n"


def record(pid: int) -> JobRecord:
    from agent.jobs import procs

    return JobRecord(
        "w", JobKind.LAUNCHED, JobState.RUNNING, pid, [], "/", pid_started=procs.create_time(pid)
    )


def child_state(init: int) -> str:
    """The state letter of PID 1's child (the job's command)."""
    kids = Path(f"/proc/{init}/task/{init}/children").read_text().split()
    return Path(f"/proc/{kids[0]}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_silence_stops_the_job_and_a_word_lets_it_go_on() -> None:
    outer = subprocess.Popen(
        [config.init_binary(), "--", sys.executable, "-c", TICK], stdout=subprocess.DEVNULL
    )
    init = 0
    try:
        kids = Path(f"/proc/{outer.pid}/task/{outer.pid}/children")
        init = int(str(wait_for("PID 1", lambda: kids.read_text().strip(), 10)).split()[0])
        wait_for("the job", lambda: Path(f"/proc/{init}/task/{init}/children").read_text().strip(), 10)
        rec = record(init)
        time.sleep(0.5)
        assert child_state(init) in "RS"  # never armed: it runs on with no word at all
        assert fence.word(rec, 300)
        wait_for("the watchdog's stop", lambda: child_state(init) == "T", 5)
        assert fence.word(rec, 5000)
        wait_for("the job going on", lambda: child_state(init) in "RS", 5)
        assert fence.word(rec, fence.DISARM)
        time.sleep(0.6)
        assert child_state(init) in "RS"
    finally:
        if init:
            os.kill(init, signal.SIGKILL)  # PID 1 takes its namespace, the job, along
        outer.wait(10)


def test_a_word_goes_only_to_a_namespaces_pid_1() -> None:
    plain = subprocess.Popen(["sleep", "30"])
    try:
        assert not fence.word(record(plain.pid), 1000)  # a plain process would be killed by it
        time.sleep(0.2)
        assert plain.poll() is None
    finally:
        plain.kill()
        plain.wait()
