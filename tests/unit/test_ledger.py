"""The GPU ledger (agent.gpus.ledger): every kind of claim on a GPU, decided in one place."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from agent.errors import AlreadyExistsError, NoFreeGpuError
from agent.gpus.ledger import GpuLedger
from agent.gpus.quarantine import Quarantine
from agent.jobs.record import JobKind, JobRecord, JobState
from agent.jobs.registry import JobRegistry


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def ledger(tmp_path: Path) -> GpuLedger:
    reg = JobRegistry(tmp_path / "state", "nodea")
    return GpuLedger(reg, Quarantine(tmp_path / "state"), clock=Clock())


def take(gpus: list[str]):
    """A chooser that takes `gpus` unless any is unavailable (then it refuses, as choose() does)."""

    def pick(taken: dict[str, str], frozen: dict[str, int]) -> tuple[list[str], list[str]]:
        if busy := [u for u in gpus if u in taken]:
            raise NoFreeGpuError(f"GPU {busy[0]} {taken[busy[0]]}")
        return gpus, gpus

    return pick


def test_a_claim_holds_its_gpus_until_released_and_a_refused_pick_holds_nothing(ledger: GpuLedger) -> None:
    assert ledger.decide("the start of job a", "a", take(["G0"])) == ["G0"]
    with pytest.raises(NoFreeGpuError, match="G0 is being taken by the start of job a"):
        ledger.decide("the start of job b", "b", take(["G0", "G1"]))
    assert ledger.promised() == {"G0"}  # b's refused pick left nothing behind
    ledger.release("the start of job a")
    assert ledger.decide("the start of job b", "b", take(["G0"])) == ["G0"]


def test_leases_say_so(ledger: GpuLedger) -> None:
    ledger.decide("the lease of migration m1", "train", take(["G0"]), lease=True)
    assert ledger.unavailable("other") == {"G0": "is promised to another incoming job"}
    ledger.release("the lease of migration m1")
    assert ledger.unavailable("other") == {}


def test_job_records_quarantine_and_health_all_count(ledger: GpuLedger, tmp_path: Path) -> None:
    assert ledger.registry is not None and ledger.quarantine is not None
    ledger.registry.save(
        JobRecord("prod", JobKind.LAUNCHED, JobState.RUNNING, 1, ["x"], "/", gpus=["G1"], gpu_chip="H200")
    )
    ledger.quarantine.add("G2", "xid 79")

    class Sick:
        uuid, evidence = "G3", []
        state = type("S", (), {"value": "degraded", "__str__": lambda self: "degraded"})()

    ledger.health = lambda: [Sick()]  # type: ignore[list-item,return-value]
    out = ledger.unavailable("train")
    assert out["G1"] == "is held by job prod"
    assert out["G2"].startswith("is quarantined (xid 79;")
    assert out["G3"].startswith("is degraded")
    assert "G1" not in ledger.unavailable("prod")  # a job's own GPUs are its own


def test_frozen_memory_is_handed_to_every_decision(ledger: GpuLedger) -> None:
    ledger.hold_frozen([10, 11], {"G0": 4 << 30})
    seen: list[dict[str, int]] = []

    def pick(taken: dict[str, str], frozen: dict[str, int]) -> tuple[None, list[str]]:
        seen.append(frozen)
        return None, []

    ledger.decide("x", "x", pick)
    assert seen == [{"G0": 4 << 30}]
    ledger.release_frozen([10, 11])
    assert ledger.frozen_bytes() == {}


def test_a_preemption_hold_ends_when_it_expires_or_its_job_arrives(ledger: GpuLedger) -> None:
    clock = ledger.clock
    assert isinstance(clock, Clock)
    ledger.hold_for(["G0"], "train", 60)
    assert ledger.unavailable("someone") == {
        "G0": "is kept for job train (it suspended a low-priority job to get it)"
    }
    assert ledger.unavailable("train") == {}
    clock.now += 61
    assert ledger.held_for() == {}
    ledger.hold_for(["G0"], "train", 60)
    assert ledger.registry is not None
    ledger.registry.save(
        JobRecord("train", JobKind.LAUNCHED, JobState.RUNNING, 1, ["x"], "/", started_at=clock.now + 1)
    )
    assert ledger.held_for() == {}  # it arrived


def test_two_racing_starts_never_get_the_same_gpu(ledger: GpuLedger) -> None:
    won: list[str] = []
    gate = threading.Barrier(8)

    def start(i: int) -> None:
        gate.wait()
        try:
            ledger.decide(f"start {i}", f"job{i}", take(["G0"]))
            won.append(f"start {i}")
        except NoFreeGpuError:
            pass

    threads = [threading.Thread(target=start, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and ledger.promised() == {"G0"}


def test_one_claim_per_owner(ledger: GpuLedger) -> None:
    """Two restores of one name at once: the second is refused, and the first keeps its claim."""
    ledger.decide("the restore of job x", "x", take(["G0"]))
    with pytest.raises(AlreadyExistsError, match="the restore of job x is already choosing or holding GPUs"):
        ledger.decide("the restore of job x", "x", take(["G1"]))
    assert ledger.promised() == {"G0"}


def test_a_record_saved_while_deciding_is_seen(ledger: GpuLedger) -> None:
    """Job records are read before the lock; a claim released meanwhile (its job's record now holds
    the GPU) makes the decision read them again, so the GPU is never given twice."""
    assert ledger.registry is not None
    ledger.decide("the start of job a", "a", take(["G0"]))
    calls = 0
    real = ledger._jobs_holding

    def racing(for_job: str) -> dict[str, str]:
        nonlocal calls
        calls += 1
        seen = real(for_job)
        if calls == 1:  # job a's start finishes between our read and our lock
            ledger.registry.save(  # type: ignore[union-attr]
                JobRecord("a", JobKind.LAUNCHED, JobState.RUNNING, 1, ["x"], "/", gpus=["G0"])
            )
            ledger.release("the start of job a")
        return seen

    ledger._jobs_holding = racing  # type: ignore[method-assign]
    with pytest.raises(NoFreeGpuError, match="G0 is held by job a"):
        ledger.decide("the start of job b", "b", take(["G0"]))
    assert calls == 2
