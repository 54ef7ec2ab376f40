"""Self-healing end to end: real agents, real CRIU, real PyTorch jobs; only the GPUs are replayed.

Each agent answers NVML calls from its own telemetry file (LocalAgent's nvml_replay, which starts it
under agent.testing.agent --nvml-replay; the double is agent.testing.nvml_replay):
the same calls a real node answers, so the health monitor, the policy, the cluster view and the
target's GPU choice all run as they would on GPUs. The jobs are CPU training runs given a GPU
with `ferry run --gpu`; injecting telemetry is rewriting a file.
"""

from __future__ import annotations

import json
import sys
import time

import pytest

from agent.testing.nvml_replay import one_gpu, write_world
from tests.integration.jobtools import (
    WORKLOAD,
    assert_completed_exactly_once,
    job,
    train_args,
    wait_state,
    wait_steps,
)

CHIP = "NVIDIA H200"
#: Fast enough for a test: health every 0.3 s, resumes checked every second.
HEALTH = "[health]\ninterval_s = 0.3\necc_window_s = 600\n"


def world(uuid: str, **gpu: object) -> dict:
    return one_gpu(uuid, CHIP, **gpu)


@pytest.fixture
def node(agents, tmp_path):
    """Start an agent whose single GPU `uuid` is replayed from a file; peers go in its config."""

    def start(
        name: str, uuid: str, peers: list[tuple[str, bool]] = (), extra: str = "", **gpu: object
    ) -> tuple:
        telemetry = tmp_path / f"{name}-nvml.json"
        write_world(telemetry, world(uuid, **gpu))
        config = tmp_path / f"{name}.toml"
        config.write_text(
            HEALTH
            + extra
            + "".join(f'[[peers]]\naddress = "{a}"\nspare = {str(s).lower()}\n' for a, s in peers)
        )
        env = {"FERRY_HOUSEKEEPING_S": "1"}
        return agents(name, env=env, config=config, nvml_replay=telemetry), telemetry

    return start


def run_on_gpu(agent, name: str, gpu: str, steps: int, *extra: str) -> None:
    agent.cli(
        "run", "--name", name, "--gpu", gpu, *extra, "--", sys.executable, str(WORKLOAD), *train_args(steps)
    )


def events(agent) -> list[dict]:
    return json.loads(agent.cli("events", "--json", "-n", "500").stdout)


def wait_event(agent, kind: str, text: str, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for e in events(agent):
            if e["kind"] == kind and text in e["message"]:
                return e
        time.sleep(0.3)
    raise AssertionError(f"no {kind} event with {text!r} on {agent.node}; events:\n{events(agent)}")


def health(agent) -> dict:
    return {g["uuid"]: g for g in json.loads(agent.cli("health", "--json").stdout)["gpus"]}


def test_degrading_gpu_moves_its_job_to_the_idle_spare(node):
    other, _ = node("node-b", "GPU-b0")
    spare, _ = node("node-s", "GPU-s0")
    # Both peers have an idle GPU and the spare is listed last: it is chosen for being a spare.
    a, a_nvml = node("node-a", "GPU-a0", peers=[(other.address, False), (spare.address, True)])
    run_on_gpu(a, "train", "GPU-a0", steps=100)
    wait_steps(a, "train", 6)
    assert health(a)["GPU-a0"]["state"] == "healthy"
    assert health(a)["GPU-a0"]["jobs"][0]["name"] == "train"

    # A burst of corrected ECC errors: a precursor, the GPU can still copy out.
    write_world(a_nvml, world("GPU-a0", ecc_corrected=40))

    moved = wait_state(a, "train", "moved", timeout_s=120)
    assert moved["moved_to"] == spare.address
    deadline = time.monotonic() + 10  # the policy writes its reason once the move has returned
    while "by ferry" not in moved["note"] and time.monotonic() < deadline:
        time.sleep(0.1)
        moved = job(a, "train")
    assert "by ferry" in moved["note"] and "corrected ECC" in moved["note"], moved["note"]
    arrived = job(spare, "train")  # 100 steps of 0.1 s: still running there
    assert (
        arrived["gpus"] == ["GPU-s0"] and "moved here from node-a (automatic: GPU GPU-a0" in arrived["note"]
    )
    assert_completed_exactly_once(spare, "train", steps=100)

    # The events explain every step, and the GPU that caused the move is quarantined.
    wait_event(a, "health", "GPU-a0 (index 0) healthy → degraded")
    wait_event(a, "decision", "moving job train off GPU GPU-a0")
    wait_event(a, "decision", "target for job train: idle GPU-s0 on spare node node-s")
    wait_event(a, "migration", "moved job train to node node-s")
    gpu = health(a)["GPU-a0"]
    assert gpu["state"] == "degraded" and gpu["quarantined"]
    assert "corrected ECC" in gpu["evidence"][0]["detail"]
    refused = a.cli("run", "--name", "again", "--gpu", "GPU-a0", "--", "true", check=False)
    assert refused.returncode == 1 and "quarantined" in refused.stderr

    # Fixed and cleared by the operator: schedulable again.
    write_world(a_nvml, world("GPU-a0", ecc_corrected=40))  # no new errors: the burst ages out
    a.cli("gpus", "--clear", "GPU-a0")
    assert not health(a)["GPU-a0"]["quarantined"]
    wait_event(a, "quarantine", "GPU-a0 cleared by an operator")
    assert "train" not in {j["name"] for j in json.loads(other.cli("ps", "--json").stdout)}


def test_a_spare_whose_gpu_fails_its_self_test_refuses_the_job_and_the_next_spare_takes_it(node):
    """Verify before trust: the first spare's GPU reads back a word wrong in its self-test at
    Prepare (no schedule there: [verify] every_s = 0), so it refuses the lease with the evidence
    and quarantines the GPU; the policy passes it over, and the second spare, whose GPU passed
    the schedule's self-test while idle, takes the job."""
    bad, _ = node("node-s", "GPU-s0", extra="[verify]\nevery_s = 0\n", selftest={"stuck": 3})
    good, _ = node("node-t", "GPU-t0", extra="[verify]\nevery_s = 4\ncache_s = 600\n")
    a, a_nvml = node("node-a", "GPU-a0", peers=[(bad.address, True), (good.address, True)])
    deadline = time.monotonic() + 30  # the idle spare's verdict is there before any move needs it
    while not (tested := health(good)["GPU-t0"]["selftest"]) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert tested and tested["passed"] and tested["tflops"] == pytest.approx(60.0), tested
    assert health(bad)["GPU-s0"]["selftest"] is None
    run_on_gpu(a, "train", "GPU-a0", steps=80)
    wait_steps(a, "train", 6)

    write_world(a_nvml, world("GPU-a0", ecc_corrected=40))

    moved = wait_state(a, "train", "moved", timeout_s=120)
    assert moved["moved_to"] == good.address
    refused = wait_event(a, "decision", "node node-s did not take job train")
    assert "failed their self-test" in refused["message"] and "read back wrong" in refused["message"]
    s0 = health(bad)["GPU-s0"]
    assert (
        s0["quarantined"]
        and "self-test: 2 word(s) of device memory read back wrong" in s0["quarantine_reason"]
    )
    assert s0["selftest"]["passed"] is False
    wait_event(bad, "verify", "GPU GPU-s0 failed its self-test")
    assert "train" not in {j["name"] for j in json.loads(bad.cli("ps", "--json").stdout)}
    assert_completed_exactly_once(good, "train", steps=80)
    text = good.cli("health").stdout
    assert "self-tests:" in text and "GPU-t0: self-test at " in text and "67 expected" in text


def test_low_priority_job_is_preempted_for_a_failing_gpu_and_resumes_later(node):
    spare, _ = node("node-s", "GPU-s0")
    a, a_nvml = node("node-a", "GPU-a0", peers=[(spare.address, True)])
    run_on_gpu(a, "train", "GPU-a0", steps=150)
    wait_steps(a, "train", 5)
    # Both long enough, the low-priority one started last: on a loaded machine it once ended
    # before the move needed its GPU, and nothing was preempted.
    run_on_gpu(spare, "scavenger", "GPU-s0", 120, "--priority", "low")
    wait_steps(spare, "scavenger", 5)

    # A row remap is pending: degraded, and no idle GPU anywhere but the low-priority job's.
    write_world(a_nvml, world("GPU-a0", remapped={"pending": True}))

    wait_state(a, "train", "moved", timeout_s=120)
    suspended = job(spare, "scavenger")
    # It may already be back, or (on a loaded machine, where the move's result comes late) even
    # finished: the events below say it was preempted and resumed.
    assert suspended["state"] in ("preempted", "running", "exited")
    wait_event(a, "decision", "after suspending low-priority job scavenger")
    wait_event(spare, "preempt", "suspended low-priority job scavenger")
    # The job that needed the GPU finishes there as if never moved ...
    assert_completed_exactly_once(spare, "train", steps=150)
    # ... and the suspended one resumes once the GPU is free, nothing lost.
    wait_event(spare, "resume", "resumed preempted job scavenger on GPU-s0")
    assert_completed_exactly_once(spare, "scavenger", steps=120)
    assert job(spare, "scavenger")["priority"] == "low"
