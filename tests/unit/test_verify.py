"""Verify before trust (agent/gpus/verify.py, agent/migration/probe.py): a GPU's self-test before
a lease, cached, quarantined on failure; idle GPUs on a schedule; a path probed before a large
move. The self-tests run the real measure and judge against the fake driver
(agent.testing.fake_selftest); the real driver runs them in tests/gpu and the device check."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from agent.agent_config import parse
from agent.errors import InvalidArgumentError, RefusedError
from agent.gpus import selftest
from agent.gpus.ledger import GpuLedger
from agent.gpus.quarantine import Quarantine
from agent.gpus.verify import GpuVerifier, Verdict, VerifyConfig
from agent.migration.probe import MAX_PROBE_BYTES, PathCheck, probe, receive_probe
from agent.rpc import pb
from agent.testing.fake_selftest import ReplayedSelfTest
from agent.testing.nvml_replay import FakeClock

WORLD: dict[str, Any] = {
    "gpus": [
        {"uuid": "GPU-a0", "name": "NVIDIA H200"},
        {"uuid": "GPU-a1", "name": "NVIDIA H200", "selftest": {"stuck": 7}},
        {"uuid": "GPU-a2", "name": "NVIDIA H200", "selftest": {"tflops": 20.0}},
        {"uuid": "GPU-a3", "name": "NVIDIA H200", "selftest": {"hang": True}},
    ]
}


class Rig:
    def __init__(self, tmp: Path, cfg: VerifyConfig | None = None, unavailable: str = "") -> None:
        self.clock = FakeClock(1000.0)
        self.ledger = GpuLedger(quarantine=Quarantine(tmp))
        self.events: list[tuple[str, str, str]] = []
        self.ran: list[str] = []
        self.seen: list[Verdict] = []
        replay = ReplayedSelfTest(lambda: WORLD)

        def runner(uuid: str, share: float, timeout_s: float) -> selftest.SelfTest:
            self.ran.append(uuid)
            return replay(uuid, share, timeout_s)

        self.verifier = GpuVerifier(
            cfg or VerifyConfig(),
            self.ledger.quarantine_gpu,
            lambda kind, message, gpu: self.events.append((kind, message, gpu)),
            runner=runner,
            unavailable=lambda: unavailable,
            clock=self.clock,
            observe=self.seen.append,
        )


def test_a_sound_gpu_passes_and_its_verdict_stands_until_it_is_too_old(tmp_path: Path) -> None:
    rig = Rig(tmp_path, VerifyConfig(cache_s=600, every_s=300))
    rig.verifier.require(["GPU-a0"], "job train from node-b")
    rig.verifier.require(["GPU-a0"], "job other from node-b")
    assert rig.ran == ["GPU-a0"]
    v = rig.verifier.verdicts()["GPU-a0"]
    assert v.passed and v.figures is not None and v.figures.tflops == pytest.approx(60.0)
    assert v.describe().startswith("passed: ") and "60.0 TFLOP/s" in v.describe()
    rig.clock.advance(601)
    rig.verifier.require(["GPU-a0"], "job train from node-b")
    assert rig.ran == ["GPU-a0", "GPU-a0"] and rig.events == []


@pytest.mark.parametrize(
    ("uuid", "evidence"),
    [
        ("GPU-a1", "2 word(s) of device memory read back wrong"),
        ("GPU-a2", "FP32 throughput 20.0 TFLOP/s, below 50% of a NVIDIA H200's 67"),
        ("GPU-a3", "did not end within 30 s (killed)"),
    ],
    ids=["memory", "compute", "hang"],
)
def test_a_gpu_that_fails_refuses_the_lease_with_the_evidence_and_is_quarantined(
    tmp_path: Path, uuid: str, evidence: str
) -> None:
    rig = Rig(tmp_path)
    with pytest.raises(RefusedError) as e:
        rig.verifier.require(["GPU-a0", uuid], "job train from node-b")
    assert e.value.step == "prepare self-test"
    assert f"GPU {uuid}: " in e.value.cause and evidence in e.value.cause and "GPU-a0" not in e.value.cause
    assert "ferry gpus --clear" in e.value.hint
    q = rig.ledger.quarantine.get(uuid)  # type: ignore[union-attr]
    assert q is not None and evidence in q.reason
    assert rig.ledger.quarantine.get("GPU-a0") is None  # type: ignore[union-attr]
    assert [k for k, _, g in rig.events if g == uuid] == ["quarantine", "verify"]
    assert uuid in rig.ledger.unavailable("")  # placement's view: never offered again
    assert sorted(v.uuid for v in rig.seen) == sorted(["GPU-a0", uuid])


def test_the_gpus_of_one_lease_are_tested_at_once(tmp_path: Path) -> None:
    """Prepare's deadline bounds the whole check: two GPUs take one test's time, not two."""
    rig = Rig(tmp_path)
    met = threading.Barrier(2, timeout=5)
    inner = rig.verifier.runner

    def together(uuid: str, share: float, timeout_s: float) -> selftest.SelfTest:
        met.wait()  # breaks (BrokenBarrierError: a failure) unless both run at the same time
        return inner(uuid, share, timeout_s)

    rig.verifier.runner = together
    got = rig.verifier.check(["GPU-a0", "GPU-a2"], 0)  # a2 fails: judged, not raised here
    assert [v.passed for v in got] == [True, False] and not met.broken


def test_a_node_that_cannot_self_test_takes_gpus_on_nvml_alone_unless_required(tmp_path: Path) -> None:
    rig = Rig(tmp_path, unavailable="no self-test kernels at /x.ptx")
    rig.verifier.require(["GPU-a1"], "job train")  # a1 would fail, but nothing ran
    rig.verifier.require(["GPU-a1"], "job train")
    v = rig.verifier.verdicts()["GPU-a1"]
    assert v.passed and v.untested == "no self-test kernels at /x.ptx" and rig.ran == []
    assert v.describe() == "not self-tested (no self-test kernels at /x.ptx)"
    assert [k for k, _, _ in rig.events] == ["verify"]  # said once
    strict = Rig(
        tmp_path / "s", VerifyConfig(selftest="required"), unavailable="cuda-bindings is not installed"
    )
    with pytest.raises(RefusedError, match=r"cannot self-test its GPUs \(cuda-bindings is not installed\)"):
        strict.verifier.require(["GPU-a0"], "job train")
    assert strict.ledger.quarantine.all() == {}  # type: ignore[union-attr]  # the node's fault, not the GPU's


def test_off_never_tests(tmp_path: Path) -> None:
    rig = Rig(tmp_path, VerifyConfig(selftest="off"))
    rig.verifier.require(["GPU-a1"], "job train")
    assert rig.verifier.idle_round(["GPU-a1"]) == [] and rig.ran == []


def test_the_schedule_tests_idle_gpus_whose_verdict_is_older_than_every_s(tmp_path: Path) -> None:
    rig = Rig(tmp_path, VerifyConfig(cache_s=600, every_s=100))
    rig.verifier.idle_round(["GPU-a0", "GPU-a1"])
    assert sorted(rig.ran) == ["GPU-a0", "GPU-a1"] and rig.ledger.quarantine.get("GPU-a1") is not None  # type: ignore[union-attr]
    rig.clock.advance(50)
    rig.verifier.idle_round(["GPU-a0"])
    assert len(rig.ran) == 2
    rig.clock.advance(51)
    rig.verifier.idle_round(["GPU-a0"])
    assert rig.ran[-1] == "GPU-a0" and len(rig.ran) == 3


@pytest.mark.parametrize(
    ("table", "error"),
    [
        ('selftest = "sometimes"', "not one of auto, required, off"),
        ("share = 0.95", "share 0.95 must be above 0 and at most 0.9"),
        ("timeout_s = 90", "Prepare, whose deadline is 60 s"),
        ("cache_s = 600\nevery_s = 900", "must be below cache_s"),
        ("probe_mib = 0", "must be above 0"),
        ("colour = 1", "unknown"),
    ],
)
def test_a_bad_verify_table_is_refused_with_the_reason(table: str, error: str) -> None:
    import tomllib

    with pytest.raises(InvalidArgumentError, match=error):
        parse(tomllib.loads(f"[verify]\n{table}\n"))


def test_the_defaults_test_before_a_lease_and_every_half_hour() -> None:
    cfg = parse({}).verify
    assert (cfg.selftest, cfg.every_s, cfg.cache_s, cfg.probe_above_mib) == ("auto", 1800.0, 3600.0, 1024)


# -- the path probe ----------------------------------------------------------------------------


def loopback(chunks: Any) -> pb.ProbeResult:
    return receive_probe(chunks, "node-b")


def test_the_probe_counts_every_byte_and_times_the_call() -> None:
    rate = probe(loopback, 5 << 20)
    assert rate.bytes == 5 << 20 and rate.seconds > 0 and rate.mbps > 1


def test_a_target_takes_no_more_than_a_probe_is() -> None:
    def endless() -> Any:
        while True:
            yield pb.ProbeChunk(data=b"x" * (1 << 20))

    with pytest.raises(InvalidArgumentError, match=f"at most {MAX_PROBE_BYTES >> 20} MiB"):
        receive_probe(endless(), "node-b")


def test_a_path_below_the_floor_refuses_a_large_move_with_what_it_would_cost() -> None:
    said: list[tuple[str, str, str]] = []
    cfg = VerifyConfig(probe_above_mib=100, probe_mib=4, path_min_mbps=1e9)  # no path is this fast
    check = PathCheck(cfg, lambda address: loopback, lambda k, m, j: said.append((k, m, j)))
    with pytest.raises(RefusedError) as e:
        check("b:1", "node-b", "train", 4 << 30)
    assert e.value.step == "prepare path probe"
    assert e.value.cause.startswith("the path to node-b carries ")
    assert "below [verify] path_min_mbps 1e+09: job train's 4.00 GiB would take" in e.value.cause
    assert said and said[0][0] == "verify" and said[0][2] == "train"


def test_a_small_move_is_not_probed_and_a_fast_path_passes() -> None:
    asked: list[str] = []

    def send(address: str) -> Any:
        asked.append(address)
        return loopback

    check = PathCheck(VerifyConfig(probe_above_mib=100, probe_mib=4, path_min_mbps=1), send)
    assert check("b:1", "node-b", "train", 99 << 20) is None and asked == []
    rate = check("b:1", "node-b", "train", 100 << 20)
    assert rate is not None and rate.bytes == 4 << 20 and asked == ["b:1"]


def test_a_gpu_cleared_by_hand_is_tested_again_before_its_next_job(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    with pytest.raises(RefusedError):
        rig.verifier.require(["GPU-a1"], "job train")
    rig.verifier.forget("GPU-a1")  # `ferry gpus --clear`
    assert "GPU-a1" not in rig.verifier.verdicts()
    with pytest.raises(RefusedError):
        rig.verifier.require(["GPU-a1"], "job train")
    assert rig.ran == ["GPU-a1", "GPU-a1"]


def test_a_target_whose_agent_predates_the_probe_is_moved_to_unprobed() -> None:
    def older(chunks: Any) -> None:  # PeerClient.probe_path's answer to UNIMPLEMENTED
        for _ in chunks:
            pass

    check = PathCheck(VerifyConfig(probe_above_mib=0, probe_mib=1, path_min_mbps=1e9), lambda a: older)
    assert check("b:1", "node-b", "train", 1 << 30) is None
