"""CUDA jobs migrated, suspended and refused on a real GPU, between two agents on one host.

Each job's device memory must survive: the CUDA counter keeps its counter and
a checksum of a large buffer only on the GPU and prints both every step, so
the step lines of a migrated run must equal an uninterrupted run's line for
line; the PyTorch job must end with the same parameter digest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.localcluster import LocalAgent
from tests.integration.jobtools import WORKLOAD, final_digest, job, steps_in, wait_state, wait_steps

REPO = Path(__file__).resolve().parents[2]
COUNTER = os.environ.get("FERRY_CUDA_COUNTER") or str(REPO / ".ferry" / "bin" / "cuda-counter")
MIB = 512
CUDA_PHASES = {"cuda lock", "cuda checkpoint", "target cuda restore", "target cuda unlock"}

_REFERENCE: dict[tuple[str, ...], str] = {}


def counter_cmd(steps: int, *extra: str, step_time: float = 0.1) -> list[str]:
    if not os.access(COUNTER, os.X_OK):
        pytest.skip(f"no CUDA counter at {COUNTER} (build it with `make native` where nvcc exists)")
    return [COUNTER, "--steps", str(steps), "--step-time", str(step_time), "--mib", str(MIB), *extra]


def torch_cmd(steps: int, step_time: float = 0.1) -> list[str]:
    return [
        sys.executable,
        str(WORKLOAD),
        "--device",
        "cuda",
        "--steps",
        str(steps),
        "--step-time",
        str(step_time),
    ]


def reference(cmd: list[str]) -> str:
    """The output of the same job run straight through, without ferry (step time 0)."""
    key = tuple(cmd)
    if key not in _REFERENCE:
        fast = [*cmd]
        fast[fast.index("--step-time") + 1] = "0"
        p = subprocess.run(fast, capture_output=True, text=True, timeout=600, check=False)
        assert p.returncode == 0, f"reference run failed: {p.stderr[-2000:]}"
        _REFERENCE[key] = p.stdout
    return _REFERENCE[key]


def step_lines(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.startswith("step ")]


def assert_same_as_uninterrupted(agent: LocalAgent, name: str, cmd: list[str], steps: int) -> None:
    j = wait_state(agent, name, "exited", timeout_s=300)
    out = agent.cli("logs", name).stdout
    assert j["exit_code"] == 0, f"exit {j['exit_code']}; stderr:\n{agent.cli('logs', name).stderr[-2000:]}"
    assert steps_in(out) == list(range(steps))
    ref = reference(cmd)
    assert step_lines(out) == step_lines(ref)
    assert final_digest(out) == final_digest(ref)


def gpu_pids(agent: LocalAgent) -> set[int]:
    """Host PIDs with a CUDA context on any GPU of the agent's node, as `ferry gpus` shows them."""
    return {p["pid"] for g in json.loads(agent.cli("gpus", "--json").stdout)["gpus"] for p in g["processes"]}


def run(agent: LocalAgent, name: str, cmd: list[str]) -> None:
    agent.cli("run", "--name", name, "--", *cmd)


def test_cuda_counter_moves_and_resumes_at_the_next_step(agents):
    a, b = agents("node-a"), agents("node-b")
    cmd = counter_cmd(60)
    run(a, "counter", cmd)
    wait_steps(a, "counter", 10)

    result = json.loads(a.cli("migrate", "counter", "--to", b.address, "--json").stdout)
    print("cuda counter migration:", json.dumps(result, sort_keys=True))

    assert result["gpu_bytes"] >= MIB << 20
    assert set(result["phases_s"]) >= CUDA_PHASES
    assert job(a, "counter")["state"] == "moved"
    assert_same_as_uninterrupted(b, "counter", cmd, 60)


def test_pytorch_cuda_training_moves_bit_identical(agents):
    a, b = agents("node-a"), agents("node-b")
    cmd = torch_cmd(40)
    run(a, "torch", cmd)
    wait_steps(a, "torch", 8, timeout_s=180)

    result = json.loads(a.cli("migrate", "torch", "--to", b.address, "--json").stdout)
    print("pytorch cuda migration:", json.dumps(result, sort_keys=True))

    assert result["gpu_bytes"] > 0 and set(result["phases_s"]) >= CUDA_PHASES
    assert_same_as_uninterrupted(b, "torch", cmd, 40)


def test_suspend_frees_the_gpu_and_resume_finishes(agents, tmp_path):
    a = agents("node-a")
    cmd = counter_cmd(50)
    run(a, "suspend", cmd)
    wait_steps(a, "suspend", 8)
    pids_before = gpu_pids(a)

    a.cli("checkpoint", "suspend", "--out", str(tmp_path / "img"))

    assert job(a, "suspend")["state"] == "checkpointed"
    assert pids_before - gpu_pids(a), "the suspended job still holds a GPU"
    inspect = json.loads(a.cli("inspect", str(tmp_path / "img"), "--json").stdout)
    assert inspect["gpu_bytes"] >= MIB << 20 and inspect["cuda"]["processes"]

    a.cli("restore", str(tmp_path / "img"), "--name", "resumed")
    assert_same_as_uninterrupted(a, "resumed", cmd, 50)


def test_abort_after_the_cuda_checkpoint_resumes_the_source_on_its_gpu(agents):
    a = agents("node-a", env={"FERRY_FAULTS": "transfer"})
    b = agents("node-b")
    cmd = counter_cmd(50)
    run(a, "abort", cmd)
    wait_steps(a, "abort", 8)

    p = a.cli("migrate", "abort", "--to", b.address, check=False)

    assert p.returncode == 1 and "aborted" in p.stderr, p.stderr
    assert job(a, "abort")["state"] == "running"
    assert_same_as_uninterrupted(a, "abort", cmd, 50)


def test_managed_memory_is_refused_and_the_job_runs_on(agents):
    a, b = agents("node-a"), agents("node-b")
    cmd = counter_cmd(40, "--managed")
    run(a, "managed", cmd)
    wait_steps(a, "managed", 5)

    p = a.cli("migrate", "managed", "--to", b.address, check=False)

    assert p.returncode == 1
    assert "managed (UVM) memory" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    assert_same_as_uninterrupted(a, "managed", cmd, 40)
