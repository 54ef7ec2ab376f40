"""Local save and resume, adoption, and agent restarts, with real CRIU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from agent.criu.images import bound_socket_dirs
from agent.testing.localcluster import LocalAgent
from tests.integration.jobtools import (
    WORKLOAD,
    assert_completed_exactly_once,
    final_digest,
    job,
    reference_digest,
    run_training,
    start_adoptable,
    steps_in,
    train_args,
    wait_state,
    wait_steps,
)


def test_checkpoint_then_restore(agents, tmp_path):
    a = agents("node-a")
    run_training(a, "save", steps=30)
    wait_steps(a, "save", 5)
    image = tmp_path / "image"

    a.cli("checkpoint", "save", "--out", str(image))

    assert job(a, "save")["state"] == "checkpointed"
    info = json.loads(a.cli("inspect", str(image), "--json").stdout)
    assert info["verified"] and info["version"] == 1 and info["job"]["name"] == "save"
    assert info["host_bytes"] > 0 and any(f["name"].startswith("pages-") for f in info["files"])
    a.cli("restore", str(image))
    assert_completed_exactly_once(a, "save", steps=30)


def test_restore_refuses_a_tampered_image(agents, tmp_path):
    a = agents("node-a")
    run_training(a, "tamper", steps=200)
    wait_steps(a, "tamper", 2)
    image = tmp_path / "image"
    a.cli("checkpoint", "tamper", "--out", str(image))
    pages = next(image.glob("pages-*.img"))
    data = bytearray(pages.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pages.write_bytes(bytes(data))

    p = a.cli("restore", str(image), check=False)

    assert p.returncode == 1 and "digest does not match" in p.stderr
    assert a.cli("inspect", str(image), check=False).returncode == 1


def test_adopted_process_migrates_to_a_node_with_its_pids_free(agents, tmp_path):
    a = agents("node-a")
    # The second "node" runs in its own PID namespace, so the adopted job's host PIDs are free there.
    # --kill-child: stopping the test's agent signals unshare, and the agent must not outlive it.
    b = agents("node-b", prefix=["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"])
    out = tmp_path / "adopted.log"
    proc = start_adoptable([sys.executable, str(WORKLOAD), *train_args(30)], out, stderr=subprocess.DEVNULL)
    try:
        a.cli("adopt", "--pid", str(proc.pid), "--name", "adoptee")
        deadline = time.monotonic() + 60
        while len(steps_in(out.read_text())) < 5:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        a.cli("migrate", "adoptee", "--to", b.address)

        assert job(a, "adoptee")["state"] == "moved"
        proc.wait(timeout=30)  # the frozen source copy is gone
        wait_state(b, "adoptee", "exited")
        log = out.read_text()
        assert steps_in(log) == list(range(30))
        assert final_digest(log) == reference_digest(30)
    finally:
        proc.kill()


def test_adopt_refuses_target_where_pids_are_taken(agents, tmp_path):
    a, b = agents("node-a"), agents("node-b")  # same PID namespace: the PIDs are in use
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        a.cli("adopt", "--pid", str(proc.pid), "--name", "pinned")
        p = a.cli("migrate", "pinned", "--to", b.address, check=False)
        assert p.returncode == 1 and "PIDs" in p.stderr and "in use" in p.stderr
        assert job(a, "pinned")["state"] == "running" and proc.poll() is None
    finally:
        proc.kill()


def test_jobs_survive_an_agent_restart(agents):
    a = agents("node-a")
    run_training(a, "durable", steps=40)
    wait_steps(a, "durable", 3)

    a.stop()
    a.start()

    assert job(a, "durable")["state"] == "running"
    wait_state(a, "durable", "exited")
    log = a.cli("logs", "durable").stdout
    assert steps_in(log) == list(range(40)) and final_digest(log) == reference_digest(40)


def test_stop_ends_a_job(agents):
    a = agents("node-a")
    a.cli("run", "--name", "long", "--", sys.executable, str(WORKLOAD), *train_args(1000))
    wait_steps(a, "long", 1)
    a.cli("stop", "long")
    assert job(a, "long")["state"] == "stopped"
    p = a.cli("migrate", "long", "--to", "127.0.0.1:9", check=False)
    assert p.returncode == 1 and "not running" in p.stderr


PY_HANDLER = """
import signal, sys, time
def saved(signum, frame):
    print("saving on", signal.Signals(signum).name, flush=True)
    sys.exit(4)
signal.signal(signal.SIGTERM, saved)
print("up", flush=True)
while True:
    time.sleep(0.2)
"""


@pytest.mark.parametrize(
    "cmd",
    [
        ["sh", "-c", 'trap "echo got TERM; exit 4" TERM; echo up; while :; do sleep 0.2; done'],
        [sys.executable, "-c", PY_HANDLER],
    ],
    ids=["shell-trap", "python-handler"],
)
def test_stop_reaches_the_jobs_sigterm_handler(agents, cmd):
    """A job that saves on SIGTERM gets the chance: PID 1 of its namespace forwards the signal
    (a namespace's init gets no signal it has no handler for, and its re-exec reset them)."""
    a = agents("node-a")
    a.cli("run", "--name", "trapper", "--", *cmd)
    deadline = time.monotonic() + 20
    while "up" not in a.cli("logs", "trapper").stdout and time.monotonic() < deadline:
        time.sleep(0.1)
    t0 = time.monotonic()
    a.cli("stop", "trapper")
    took = time.monotonic() - t0
    out = a.cli("logs", "trapper").stdout
    assert "got TERM" in out or "saving on SIGTERM" in out, out
    assert job(a, "trapper")["exit_code"] == 4  # its own status, not a SIGKILL's 137
    assert took < 5, f"ferry stop took {took:.1f} s: the job only ended at the SIGKILL"


def test_a_second_agent_on_the_same_state_directory_refuses_to_start(agents, tmp_path):
    a = agents("node-a")
    second = LocalAgent(tmp_path, "node-a")  # the same state directory, its own socket and port
    try:
        with pytest.raises(RuntimeError, match=rf"another agent \(pid {a.proc.pid}\) is running"):
            second.start(timeout_s=20)
        assert second.proc is not None and second.proc.wait(10) == 1
    finally:
        second.stop()
    assert "Traceback" not in a.log_path.read_text()
    assert a.cli("ps").returncode == 0  # the first one is untouched


def test_finished_job_after_completion(agents):
    a = agents("node-a")
    run_training(a, "short", steps=3)
    assert_completed_exactly_once(a, "short", steps=3)


def test_restore_on_a_host_without_the_dataloader_socket_dirs(agents, tmp_path):
    """DataLoader workers listen on /tmp/pymp-*/listener-*. A job's /tmp is its own: the node
    never has these directories, and the restore brings the job's /tmp back from the image."""
    a = agents("node-a")
    run_training(a, "workers", steps=30, workers=2)
    wait_steps(a, "workers", 5)
    image = tmp_path / "image"
    a.cli("checkpoint", "workers", "--out", str(image))
    dirs = bound_socket_dirs(image)
    assert dirs and all(d.name.startswith("pymp-") for d in dirs)
    assert not any(d.exists() for d in dirs), "the job's /tmp leaked into the node's"

    a.cli("restore", str(image))

    assert_completed_exactly_once(a, "workers", steps=30, workers=2)


def test_sigterm_lets_an_in_flight_migration_finish(agents):
    a, b = agents("node-a"), agents("node-b")
    run_training(a, "graceful", steps=40)
    wait_steps(a, "graceful", 5)
    cmd = [
        sys.executable,
        "-m",
        "agent.cli.main",
        "migrate",
        "graceful",
        "--agent",
        f"unix:{a.socket}",
        "--to",
        b.address,
    ]
    migrating = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while job(a, "graceful")["state"] != "migrating":
        assert time.monotonic() < deadline and migrating.poll() is None
        time.sleep(0.01)

    # The move in flight finishes first: on a loaded machine that may take a while.
    stopped = a.stop(signal.SIGTERM, timeout_s=120)
    assert stopped == 0, a.log_path.read_text(errors="replace")[-6000:]

    out, err = migrating.communicate(timeout=120)
    assert migrating.returncode == 0, err
    assert "moved node-a -> node-b" in out
    assert_completed_exactly_once(b, "graceful", steps=40)


def test_an_open_logs_follow_does_not_hold_the_agents_graceful_stop(agents):
    """A follower held a stopping agent for gRPC's 10 s grace; it is told the agent is stopping
    (UNAVAILABLE: the job goes on) as soon as the work in flight is done."""
    a = agents("node-a")
    a.cli("run", "--name", "chatty", "--", "sh", "-c", "while :; do echo tick; sleep 0.2; done")
    follower = subprocess.Popen(
        [*a.ferry(), "logs", "--agent", f"unix:{a.socket}", "--follow", "chatty"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=a.env,
        start_new_session=True,
    )
    try:
        assert follower.stdout is not None and follower.stdout.readline().strip() == b"tick"
        t0 = time.monotonic()
        a.stop()
        took = time.monotonic() - t0
        assert took < 5, f"the agent took {took:.1f} s to stop with a follower open"
    finally:
        os.killpg(follower.pid, signal.SIGKILL)
        follower.wait()
    a.start()
    assert job(a, "chatty")["state"] == "running"  # the job went on
