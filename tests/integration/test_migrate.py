"""Planned migration of real, unmodified PyTorch training jobs between two real agents."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from tests.integration.jobtools import (
    assert_completed_exactly_once,
    job,
    run_training,
    wait_state,
    wait_steps,
)


@pytest.mark.parametrize("staged", [False, True], ids=["streamed", "staged"])
def test_training_job_moves_mid_run_and_finishes_bit_identical(agents, staged):
    a, b = agents("node-a"), agents("node-b")
    run_training(a, "train", steps=40)
    wait_steps(a, "train", 8)

    out = a.cli("migrate", "train", "--to", b.address, "--json", *(["--staged"] if staged else []))
    result = json.loads(out.stdout)

    assert result["target_node"] == "node-b"
    assert result["host_bytes"] > 50 << 20  # a PyTorch process: tens of MiB at least
    assert {"prepare", "dump", "transfer", "commit"} <= set(result["phases_s"])
    # Streamed, the memory crossed during the dump and the drain after it is a phase of its own.
    assert ("pages" in result["phases_s"]) is not staged
    assert result["frozen_s"] > 0
    src = job(a, "train")
    assert src["state"] == "moved" and src["moved_to"] == b.address
    assert job(b, "train")["state"] in ("running", "exited")
    assert_completed_exactly_once(b, "train", steps=40)


def test_job_with_dataloader_workers_moves(agents):
    a, b = agents("node-a"), agents("node-b")
    run_training(a, "loader", steps=40, workers=2)
    wait_steps(a, "loader", 10)

    a.cli("migrate", "loader", "--to", b.address)

    assert job(a, "loader")["state"] == "moved"
    assert_completed_exactly_once(b, "loader", steps=40, workers=2)


def test_job_moves_there_and_back(agents):
    a, b = agents("node-a"), agents("node-b")
    run_training(a, "pingpong", steps=50)
    wait_steps(a, "pingpong", 5)
    a.cli("migrate", "pingpong", "--to", b.address)
    wait_steps(b, "pingpong", 15)

    b.cli("migrate", "pingpong", "--to", a.address)

    back = wait_state(a, "pingpong", "exited")
    assert back["migrations"] == 2
    assert job(b, "pingpong")["state"] == "moved"
    assert_completed_exactly_once(a, "pingpong", steps=50)


def test_sigterm_lets_an_in_flight_migration_finish(agents):
    a, b = agents("node-a"), agents("node-b")
    run_training(a, "graceful", steps=40)
    wait_steps(a, "graceful", 5)
    cmd = [
        sys.executable,
        "-m",
        "agent.cli",
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

    assert a.stop(signal.SIGTERM) == 0

    out, err = migrating.communicate(timeout=120)
    assert migrating.returncode == 0, err
    assert "moved node-a -> node-b" in out
    assert_completed_exactly_once(b, "graceful", steps=40)
