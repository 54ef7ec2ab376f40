"""Migrations that cannot happen or fail midway leave the job running on the source, unharmed."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

from tests.integration.jobtools import (
    WORKLOAD,
    assert_completed_exactly_once,
    job,
    run_training,
    start_adoptable,
    steps_in,
    train_args,
    wait_steps,
)


def test_unknown_job_is_not_found(agents):
    a, b = agents("node-a"), agents("node-b")
    p = a.cli("migrate", "ghost", "--to", b.address, check=False)
    assert p.returncode == 1
    assert "no job named 'ghost'" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_unreachable_target_leaves_job_running(agents):
    a = agents("node-a")
    run_training(a, "stay", steps=30)
    wait_steps(a, "stay", 3)

    p = a.cli("migrate", "stay", "--to", "127.0.0.1:1", check=False)

    assert p.returncode == 1
    assert "unreachable" in p.stderr and "127.0.0.1:1" in p.stderr
    assert job(a, "stay")["state"] == "running"
    assert_completed_exactly_once(a, "stay", steps=30)


def test_target_refusing_in_prepare_costs_nothing(agents):
    a, b = agents("node-a"), agents("node-b")
    run_training(a, "dup", steps=30)
    # The target already runs a job of that name: a precise refusal before anything is frozen.
    b.cli("run", "--name", "dup", "--", sys.executable, str(WORKLOAD), *train_args(200))
    wait_steps(a, "dup", 3)

    p = a.cli("migrate", "dup", "--to", b.address, check=False)

    assert p.returncode == 1
    assert "already exists" in p.stderr and "node-b" in p.stderr
    j = job(a, "dup")
    assert j["state"] == "running" and "refused" in j["note"]
    assert_completed_exactly_once(a, "dup", steps=30)


def test_restore_failure_on_target_resumes_frozen_source(agents):
    a = agents("node-a")
    b = agents("node-b", env={"FERRY_FAULTS": "target-restore"})
    run_training(a, "abort", steps=40)
    wait_steps(a, "abort", 5)

    p = a.cli("migrate", "abort", "--to", b.address, check=False)

    assert p.returncode == 1
    assert "aborted" in p.stderr and "keeps running on node-a" in p.stderr
    assert job(a, "abort")["state"] == "running"
    assert "abort" not in {j for j in b.cli("ps").stdout.split()}  # no copy on the target
    assert_completed_exactly_once(a, "abort", steps=40)


def test_failure_during_transfer_resumes_source(agents):
    a = agents("node-a")
    b = agents("node-b", env={"FERRY_FAULTS": "target-transfer"})
    run_training(a, "xfer", steps=30)
    wait_steps(a, "xfer", 5)
    before = len(steps_in(a.cli("logs", "xfer").stdout))

    p = a.cli("migrate", "xfer", "--to", b.address, check=False)

    assert p.returncode == 1 and "keeps running" in p.stderr
    wait_steps(a, "xfer", before + 3)
    assert_completed_exactly_once(a, "xfer", steps=30)


def test_a_criu_failure_mid_dump_quotes_the_failing_line_and_keeps_its_log(agents):
    # CRIU's own fault injection: the dump fails while dumping the job's memory pages.
    a = agents("node-a", env={"CRIU_FAULT": "3"})
    b = agents("node-b")
    run_training(a, "crit", steps=40)
    wait_steps(a, "crit", 3)

    p = a.cli("migrate", "crit", "--to", b.address, check=False)

    assert p.returncode == 1, p.stderr
    error = p.stderr.strip().splitlines()[-1]  # the lines before it are the live progress
    assert "Error (criu/mem.c" in error and "fault: Dump VMA pages failure!" in error, error
    assert "RLIMIT_NOFILE" not in p.stderr
    log = re.search(r"CRIU log: (\S+?\.log)", error)
    assert log and Path(log[1]).is_file(), error  # still there to read after the abort
    assert "fault: Dump VMA pages failure!" in Path(log[1]).read_text()
    assert job(a, "crit")["state"] == "running"
    assert_completed_exactly_once(a, "crit", steps=40)


IO_URING_HOLDER = (
    "import ctypes, time\n"
    "fd = ctypes.CDLL(None, use_errno=True).syscall(425, 4, ctypes.create_string_buffer(120))\n"
    "assert fd >= 0, ctypes.get_errno()\n"
    "for i in range(600):\n"
    "    print('tick', i, flush=True)\n"
    "    time.sleep(0.1)\n"
)


def test_an_adopted_process_with_io_uring_is_refused_before_anything_is_frozen(agents, tmp_path):
    a, b = agents("node-a"), agents("node-b")
    out = tmp_path / "uring.log"
    proc = start_adoptable([sys.executable, "-c", IO_URING_HOLDER], out)
    try:
        a.cli("adopt", "--pid", str(proc.pid), "--name", "uring")
        p = a.cli("migrate", "uring", "--to", b.address, check=False)

        assert p.returncode == 1
        error = p.stderr.strip().splitlines()[-1]
        assert "prepare on node-a" in error and "CRIU cannot dump io_uring" in error, error
        assert "anon_inode:[io_uring]" in error and "nothing was frozen" in error
        assert job(a, "uring")["state"] == "running"
        ticks = out.read_text().count("tick")
        time.sleep(0.5)
        assert proc.poll() is None and out.read_text().count("tick") > ticks  # never stopped
    finally:
        proc.kill()
