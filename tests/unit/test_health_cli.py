"""`ferry health`, `ferry events`, `ferry gpus --clear`, `ferry run --gpu` and the Preempt RPC
against an in-process agent whose NVML is replayed from a file (installed with entry.use_nvml)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import grpc
import pynvml
import pytest
from fakes import SLEEP, wait_for

from agent.cli import main as cli
from agent.gpus import inventory, selftest
from agent.rpc import pb, pb_grpc
from agent.testing import agent as entry
from agent.testing.fake_selftest import ReplayedSelfTest
from agent.testing.nvml_replay import ReplayNvml


@pytest.fixture
def gpu_agent(make_agent, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    telemetry = tmp_path / "nvml.json"
    telemetry.write_text(
        json.dumps(
            {
                "driver_version": "580.65.06",
                "gpus": [
                    {"uuid": "GPU-a0", "name": "NVIDIA H200", "temperature": 41},
                    {"uuid": "GPU-a1", "name": "NVIDIA H200", "temperature": 43},
                ],
            }
        )
    )
    previous = entry.use_nvml(ReplayNvml.from_file(telemetry), f"the replay of {telemetry}")
    try:
        svc, address, _ = make_agent("nodea")
        svc.monitor.poll()
        monkeypatch.setenv("FERRY_AGENT", address)
        yield svc, address
        for rec in svc.registry.list():
            if rec.state.active:
                svc.registry.stop(rec.name, 1)
    finally:
        entry.use_nvml(previous)  # the next test's agent reads real NVML again


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_health_lists_each_gpu_with_its_state(gpu_agent, capsys):
    code, out, _ = run(capsys, "health", "--json")
    assert code == 0
    gpus = {g["uuid"]: g for g in json.loads(out)["gpus"]}
    assert gpus["GPU-a0"]["state"] == "healthy" and gpus["GPU-a0"]["readings"]["temperature_c"] == 41
    assert not gpus["GPU-a1"]["quarantined"] and gpus["GPU-a1"]["jobs"] == []
    code, out, _ = run(capsys, "health")
    assert "node nodea: 2 GPU(s)" in out and "GPU-a1" in out and "43 C" in out


def test_run_gives_a_job_its_gpu_and_health_shows_it(gpu_agent, capsys):
    code, _out, err = run(
        capsys, "run", "--name", "j", "--gpu", "GPU-a0", "--priority", "low", "--", SLEEP, "60"
    )
    assert code == 0, err
    job = json.loads(run(capsys, "ps", "--json")[1])[0]
    assert (job["gpus"], job["priority"], job["on_degraded"]) == (["GPU-a0"], "low", "migrate")
    gpus = {g["uuid"]: g for g in json.loads(run(capsys, "health", "--json")[1])["gpus"]}
    assert gpus["GPU-a0"]["jobs"] == [{"name": "j", "priority": "low", "used_bytes": 0}]
    # The GPU is the job's alone.
    code, _, err = run(capsys, "run", "--name", "k", "--gpu", "GPU-a0", "--", SLEEP, "60")
    assert code == 1 and "GPU GPU-a0 is held by job j" in err


@pytest.mark.parametrize(
    ("argv", "code", "words"),
    [
        (["--gpu", "GPU-zz"], 2, "no GPU GPU-zz on nodea; its GPUs: GPU-a0 (index 0), GPU-a1 (index 1)"),
        (["--gpu", "GPU-a0", "--gpu", "GPU-a0"], 2, "lists a GPU twice"),
        (["--priority", "high"], 2, "invalid choice: 'high'"),
        (["--on-degraded", "panic"], 2, "invalid choice: 'panic'"),
    ],
)
def test_run_refuses_bad_gpu_choices_in_one_line(gpu_agent, capsys, argv, code, words):
    got, _out, err = run(capsys, "run", "--name", "j", *argv, "--", SLEEP, "1")
    assert got == code and words in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_quarantine_blocks_placement_until_cleared(gpu_agent, capsys):
    svc, _ = gpu_agent
    svc.quarantine.add("GPU-a1", "GPU GPU-a1 is degraded: XID 74")
    code, _, err = run(capsys, "run", "--name", "j", "--gpu", "GPU-a1", "--", SLEEP, "1")
    assert code == 1 and "GPU GPU-a1 is quarantined (GPU GPU-a1 is degraded: XID 74" in err
    out = run(capsys, "health")[1]
    assert "healthy (quarantined)" in out and "`ferry gpus --clear GPU-a1` once fixed" in out

    code, out, _ = run(capsys, "gpus", "--clear", "GPU-a1")
    assert code == 0 and "GPU GPU-a1 cleared" in out and "(now healthy)" in out
    assert svc.quarantine.all() == {}
    events = json.loads(run(capsys, "events", "--json")[1])
    assert (
        events[-1]["kind"] == "quarantine"
        and "cleared by an operator (quarantined since" in events[-1]["message"]
    )
    assert run(capsys, "run", "--name", "j", "--gpu", "GPU-a1", "--", SLEEP, "60")[0] == 0


def test_clearing_an_unknown_gpu_is_not_found(gpu_agent, capsys):
    code, _, err = run(capsys, "gpus", "--clear", "GPU-nope")
    assert code == 1 and "no GPU 'GPU-nope' here; its GPUs: GPU-a0, GPU-a1" in err


def test_events_when_there_are_none(gpu_agent, capsys):
    assert run(capsys, "events") == (0, "no events yet\n", "")
    code, out, _ = run(capsys, "events", "--json")
    assert code == 0 and json.loads(out) == []
    code, _, err = run(capsys, "events", "--limit", "0")
    assert code == 2 and "--limit 0" in err


def test_preempt_refusals_are_precise(gpu_agent):
    svc, address = gpu_agent
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.AgentStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.Preempt(pb.PreemptRequest(job="../x", for_job="t", source_node="b"), timeout=10)
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as e:
            stub.Preempt(pb.PreemptRequest(job="ghost", for_job="t", source_node="b"), timeout=10)
        assert e.value.code() is grpc.StatusCode.NOT_FOUND
        svc.registry.launch("prod", [SLEEP, "60"], "/", [])
        with pytest.raises(grpc.RpcError) as e:
            stub.Preempt(pb.PreemptRequest(job="prod", for_job="t", source_node="b"), timeout=10)
        assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "normal priority; only low-priority jobs are preempted" in e.value.details()


def test_a_gpu_being_taken_by_a_resume_is_not_given_to_anyone_else(gpu_agent, capsys):
    svc, _ = gpu_agent
    svc.gpus.decide("the resume of job scav", "scav", lambda taken, frozen: (None, ["GPU-a0"]))
    code, _, err = run(capsys, "run", "--name", "j", "--gpu", "GPU-a0", "--", SLEEP, "60")
    assert code == 1 and "GPU GPU-a0 is being taken by the resume of job scav" in err
    assert svc.gpus.promised() == {"GPU-a0"}
    svc.gpus.release("the resume of job scav")
    assert run(capsys, "run", "--name", "j", "--gpu", "GPU-a0", "--", SLEEP, "60")[0] == 0
    assert svc.gpus.promised() == set()  # the job holds it now, not the claim


def test_events_follow_gives_the_last_n_then_each_new_one(gpu_agent):
    svc, address = gpu_agent
    for i in range(3):
        svc.events.record("decision", f"past {i}")
    with grpc.insecure_channel(address) as ch:
        stream = pb_grpc.AgentStub(ch).Events(pb.EventsRequest(follow=True, limit=2), timeout=20)
        got = [next(stream).message, next(stream).message]
        svc.events.record("alert", "new one", job="j")
        new = next(stream)
        stream.cancel()
        # The agent notices within one wait slice; its call must be over before the next test counts fds.
        wait_for(lambda: svc.events.followers == 0, what="the agent to end the cancelled follow")
    assert got == ["past 1", "past 2"]
    assert (new.event_kind, new.message, new.job, new.node) == (pb.EVENT_KIND_ALERT, "new one", "j", "nodea")


# --- how a test chooses the NVML double ---------------------------------------------------------


def test_use_nvml_installs_a_stand_in_for_every_reader_until_put_back(tmp_path: Path, caplog):
    stand_in = ReplayNvml.from_file(tmp_path / "nvml.json")
    assert inventory.nvml_module() is pynvml
    with caplog.at_level(logging.WARNING, logger="agent.testing.agent"):
        previous = entry.use_nvml(stand_in, "the replay of nvml.json")
    try:
        assert inventory.nvml_module() is stand_in
        assert inventory.Nvml()._nvml() is stand_in  # the inventory and the monitor see one NVML
        warned = [r.getMessage() for r in caplog.records]
        assert warned == ["NVML answers from the replay of nvml.json: these are not real GPUs"]  # once
    finally:
        assert entry.use_nvml(previous) is stand_in
    assert previous is None and inventory.nvml_module() is pynvml


def test_the_test_entry_point_replays_nvml_then_runs_the_usual_cli(tmp_path: Path, monkeypatch):
    telemetry = tmp_path / "nvml.json"
    telemetry.write_text(
        json.dumps({"driver_version": "580.65.06", "gpus": [{"uuid": "GPU-r0", "name": "X"}]})
    )
    seen: list[tuple[list[str], object]] = []

    def ferry_main(argv: list[str]) -> int:
        seen.append((argv, inventory.nvml_module()))
        return 7

    monkeypatch.setattr(entry, "ferry_main", ferry_main)
    # The entry point installs the replayed GPUs' self-test for the process it is: put back after.
    monkeypatch.setattr(selftest, "run", selftest.run)
    monkeypatch.setattr(selftest, "unavailable", selftest.unavailable)
    try:
        assert (
            entry.main(["--nvml-replay", str(telemetry), "agent", "--listen", "127.0.0.1:0", "--help"]) == 7
        )
        ((argv, nv),) = seen
        assert argv == ["agent", "--listen", "127.0.0.1:0", "--help"]  # the rest is ferry's, as it was
        assert isinstance(nv, ReplayNvml)
        inv = inventory.Nvml(nv).inventory()
        assert inv.available and [g.uuid for g in inv.gpus] == ["GPU-r0"]
        assert entry.main([f"--nvml-replay={telemetry}", "health"]) == 7 and seen[1][0] == ["health"]
    finally:
        entry.use_nvml(None)
    assert inventory.nvml_module() is pynvml
    for bad in ([], ["health"], ["--nvml-replay"], ["--nvml-replay=", "health"]):
        assert entry.main(bad) == 2
    assert len(seen) == 2
    assert isinstance(selftest.run, ReplayedSelfTest)  # what the put-back above undoes
