"""CUDA jobs migrated, suspended and refused on a real GPU, between two nodes on one host.

The nodes are the multi-node bed's (agent/testing/bed.py, the `bed` fixture): each its own network
and mount namespaces, its agent on TLS at its own address, and a job network, so every job runs
in a network namespace of its own with its own address, and the copy a move restores on node-b
never shares a network namespace (abstract unix sockets included) with the frozen source on
node-a. Only the host's kernel, driver and GPU are common to both.

Each job's device memory must survive: the CUDA counter keeps its counter and
a checksum of a large buffer only on the GPU and prints both every step, so
the step lines of a migrated run must equal an uninterrupted run's line for
line; the PyTorch job must end with the same parameter digest. After every
move, NVML must list the job on the GPU (by UUID) the target gave it. Each
migration's figures go to the device report (tests/gpu/devicetools.record).
"""

from __future__ import annotations

import json
import re

import pytest

from agent.cuda.driver import CudaDriver
from agent.testing.bed import Bed, BedAgent
from tests.gpu.devicetools import (
    counter_cmd,
    gpu_of_job,
    gpus,
    migrate,
    record,
    record_note,
    same_as_uninterrupted,
    torch_cmd,
    tree_pids,
)
from tests.integration.jobtools import job, wait_steps

MIB = 512
CUDA_PHASES = {"cuda lock", "cuda checkpoint", "target cuda restore", "target cuda unlock"}


def run(agent: BedAgent, name: str, cmd: list[str]) -> None:
    agent.cli("run", "--name", name, "--", *cmd)
    assert job(agent, name)["address"], f"job {name} has no address of its own on the job network"


def move_and_check(
    a: BedAgent, b: BedAgent, name: str, cmd: list[str], steps: int, label: str, gpu_bytes: int
) -> None:
    before = gpu_of_job(a, name)
    address = job(a, name)["address"]
    result = migrate(a, b, name)
    assert result["gpu_bytes"] >= gpu_bytes
    assert set(result["phases_s"]) >= CUDA_PHASES
    assert job(a, name)["state"] == "moved"
    assert job(b, name)["address"] == address  # the job's address (and namespace) went with it
    after = gpu_of_job(b, name)
    gpus_b = {g["uuid"] for g in gpus(b)}
    assert after in gpus_b, f"job runs on {after}, not a GPU of {b.node}: {gpus_b}"
    try:
        same_as_uninterrupted(b, name, cmd, steps)
    except AssertionError:
        record(label, result, bit_identical=False, gpu=f"{before} -> {after}")
        raise
    record(label, result, bit_identical=True, gpu=f"{before} -> {after}")


def test_cuda_counter_1gib_moves_and_resumes_at_the_next_step(bed: Bed):
    cmd = counter_cmd(40, mib=1024)  # first: it skips where the counter cannot start
    a, b = bed.node("node-a"), bed.node("node-b")
    run(a, "counter", cmd)
    wait_steps(a, "counter", 5)
    move_and_check(a, b, "counter", cmd, 40, "cuda-counter 1 GiB", 1 << 30)


def test_cuda_counter_16gib_moves_and_resumes_at_the_next_step(bed: Bed):
    cmd = counter_cmd(20, mib=16384, step_time=0.2)
    a, b = bed.node("node-a"), bed.node("node-b")
    run(a, "big", cmd)
    wait_steps(a, "big", 3, timeout_s=60)
    move_and_check(a, b, "big", cmd, 20, "cuda-counter 16 GiB", 16 << 30)


def test_pytorch_cuda_training_moves_bit_identical(bed: Bed):
    a, b = bed.node("node-a"), bed.node("node-b")
    cmd = torch_cmd(40)
    run(a, "torch", cmd)
    wait_steps(a, "torch", 8, timeout_s=90)
    move_and_check(a, b, "torch", cmd, 40, "pytorch cuda training", 1)


def test_a_group_snapshot_of_cuda_members_leaves_them_running_unchanged(bed: Bed):
    """Two CUDA counters in one group, on two nodes: a snapshot round locks, checkpoints, dumps,
    restores and unlocks each in place; each member's device memory is in its image (kept on
    the other node), and both finish exactly as an uninterrupted run."""
    cmd = counter_cmd(40, mib=1024)
    a, b = bed.node("node-a"), bed.node("node-b")
    for agent, name in ((a, "g-r0"), (b, "g-r1")):
        agent.cli("run", "--name", name, "--group", "g", "--", *cmd)
    wait_steps(a, "g-r0", 5)
    wait_steps(b, "g-r1", 5)
    a.cli("protect", "g", "--every", "1h", "--members-on", a.address, "--members-on", b.address)
    a.cli("snapshot", "g")
    last = json.loads(a.cli("snapshot", "g", "--last", "--json").stdout)["last"]
    assert {m["job"] for m in last["members"]} == {"g-r0", "g-r1"}
    for m in last["members"]:
        gpu = int(m["gpu_bytes"])
        assert gpu >= 1 << 30 and m["buddy_node"] != m["node"], m
        d2h = gpu / m["cuda_checkpoint_s"] / 1e9 if m["cuda_checkpoint_s"] else 0.0
        h2d = gpu / m["resume_s"] / 1e9 if m["resume_s"] else 0.0
        record_note(
            f"group snapshot, {m['job']}",
            frozen_s=m["frozen_s"],
            gpu_bytes=gpu,
            d2h_gbps=round(d2h, 2),
            resume_gbps=round(h2d, 2),
            image_bytes=int(m["bytes"]),
        )
    same_as_uninterrupted(a, "g-r0", cmd, 40)
    same_as_uninterrupted(b, "g-r1", cmd, 40)


def test_restore_with_explicit_identity_gpu_pairs(bed: Bed):
    """A one-GPU node never remaps, so only `[cuda] explicit_gpu_pairs` makes the pair path
    (CUcheckpointRestoreArgs with CUuuid pairs covering every checkpointed GPU) meet the driver."""
    cmd = counter_cmd(40)
    a = bed.node("node-a")
    b = bed.node("node-b", config="[cuda]\nexplicit_gpu_pairs = true\n")
    run(a, "pairs", cmd)
    wait_steps(a, "pairs", 5)
    before = gpu_of_job(a, "pairs")
    move_and_check(a, b, "pairs", cmd, 40, "cuda-counter, explicit pairs", MIB << 20)
    if len(gpus(b)) == 1:
        assert before == gpus(b)[0]["uuid"]  # the identity pair: the same GPU


def test_suspend_frees_the_gpu_and_resume_finishes(bed: Bed):
    cmd = counter_cmd(50)
    a = bed.node("node-a")
    run(a, "suspend", cmd)
    wait_steps(a, "suspend", 8)
    gpu = gpu_of_job(a, "suspend")

    a.cli("checkpoint", "suspend", "--out", str(bed.shared / "img"))

    assert job(a, "suspend")["state"] == "checkpointed"
    assert not any(
        p for g in gpus(a) if g["uuid"] == gpu for p in g["processes"] if p["used_bytes"] > MIB << 19
    )
    a.cli("restore", str(bed.shared / "img"), "--name", "resumed")
    assert gpu_of_job(a, "resumed") == gpu
    same_as_uninterrupted(a, "resumed", cmd, 50)


def test_abort_after_the_cuda_checkpoint_resumes_the_source_on_its_gpu(bed: Bed):
    cmd = counter_cmd(50)
    a = bed.node("node-a", env={"FERRY_FAULTS": "transfer"})  # every move out of node-a fails
    b = bed.node("node-b")
    run(a, "abort", cmd)
    wait_steps(a, "abort", 8)
    gpu = gpu_of_job(a, "abort")

    p = a.cli("migrate", "abort", "--to", b.address, check=False)

    assert p.returncode == 1 and "aborted" in p.stderr, p.stderr
    assert job(a, "abort")["state"] == "running"
    assert gpu_of_job(a, "abort") == gpu
    same_as_uninterrupted(a, "abort", cmd, 50)


@pytest.mark.timeout(75)  # the bed's two nodes start and stop within it
def test_managed_memory_is_refused_not_moved_and_its_fate_is_told_truthfully(bed: Bed):
    """Documented: the driver cannot checkpoint managed (UVM) memory, and after meeting it "does not
    attempt to keep the process in a good state". So: refused, not moved, and whatever the job's
    fate, the error and `ferry ps` say it. The driver's real answer goes into the device report."""
    cmd = counter_cmd(400, "--managed")
    a, b = bed.node("node-a"), bed.node("node-b")
    run(a, "managed", cmd)
    wait_steps(a, "managed", 5, timeout_s=30)

    p = a.cli("migrate", "managed", "--to", b.address, check=False, timeout_s=45)

    codes = re.findall(r"\b(CUDA_ERROR_\w+) \((\d+)\)", p.stderr)
    j = job(a, "managed")
    states = {}
    for pid in tree_pids(a, "managed"):
        try:
            s = CudaDriver().state(pid)
            states[pid] = s.value if s else "no context"
        except Exception as e:  # the report records it, whatever it is
            states[pid] = f"error: {e}"
    record_note("managed memory", stderr=p.stderr.strip(), results=codes, states=states, note=j["note"])

    assert p.returncode == 1, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    assert "managed (UVM) memory" in p.stderr or "putting CUDA back failed" in p.stderr, p.stderr
    assert {x["name"] for x in _jobs(b)} == set()  # not moved
    if "putting CUDA back failed" in p.stderr:
        # The job could not be put back: the error, the note and ps say so and what to do.
        assert "the driver now reports" in p.stderr and "ferry stop" in p.stderr
        assert "the driver now reports" in j["note"]
    else:
        assert "the job keeps running" in p.stderr
        assert j["state"] == "running"
        assert all(s in ("running", "no context") for s in states.values()), states
        a.cli("stop", "managed")


def _jobs(agent: BedAgent) -> list[dict]:
    return json.loads(agent.cli("ps", "--json").stdout)
