"""Planned migration of real, unmodified PyTorch training jobs between two real agents, on nodes
that share nothing a cluster's nodes would not (agent/testing/bed.py); the DataLoader case
and the jobs with connections are in test_nodes.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.testing.bed import node_bed
from tests.integration.jobtools import (
    assert_completed_exactly_once,
    job,
    run_training,
    wait_state,
    wait_steps,
)


@pytest.fixture
def agents(tmp_path: Path) -> Iterator:
    """Each agent a node of its own on the bed, with its job network and certificate."""
    with node_bed(tmp_path) as bed:
        yield lambda name, env=None: bed.node(name, env=env)


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
