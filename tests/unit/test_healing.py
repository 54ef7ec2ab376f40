"""The self-healing policy, driven by scripted NVML timelines (agent.testing.nvml_replay) through the real
health monitor. The peers, the migration and the suspend/resume are fakes: their real paths run
in tests/integration/test_selfheal.py."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest

from agent.agent_config import AgentConfig, PeerSpec, PolicyConfig
from agent.errors import JobBusyError, NoFreeGpuError, RefusedError, TransferError
from agent.gpus.inventory import Nvml
from agent.gpus.ledger import GpuLedger
from agent.gpus.quarantine import Quarantine
from agent.health.events import EventLog
from agent.health.healing import Hooks, SelfHealing
from agent.health.monitor import HealthConfig, HealthMonitor
from agent.jobs.record import JobKind, JobRecord, JobState
from agent.jobs.registry import JobRegistry
from agent.rpc import pb
from agent.testing.nvml_replay import FakeClock, ReplayNvml, Timeline

H200 = "NVIDIA H200"


def world(*uuids: str) -> dict:
    return {
        "driver_version": "580.65.06",
        "gpus": [{"uuid": u, "name": H200, "temperature": 40} for u in uuids],
    }


class FakePeer:
    def __init__(self, node: str, *gpus: pb.GpuHealth) -> None:
        self.report = pb.HealthReport(node_name=node, nvml_available=True, gpus=list(gpus), agent_id=node)
        self.preempted: list[pb.PreemptRequest] = []

    def health(self, timeout_s: float) -> pb.HealthReport:
        return self.report

    def preempt(self, req: pb.PreemptRequest) -> pb.PreemptResponse:
        self.preempted.append(req)
        return pb.PreemptResponse(image_dir="/x", gpus=["GPU-s0"])


class Rig:
    """One agent's policy over a scripted timeline: monitor → SelfHealing → recorded actions."""

    def __init__(self, tmp: Path, steps: list, policy: PolicyConfig | None = None, gpus=("GPU-a0",)) -> None:
        self.clock = FakeClock(1000.0)
        self.t0 = self.clock.now
        self.nvml = ReplayNvml.from_timeline(Timeline(world(*gpus), steps), lambda: self.clock.now - self.t0)
        self.registry = JobRegistry(tmp / "state", "node-a")
        self.events = EventLog(tmp / "state", "node-a")
        self.quarantine = Quarantine(tmp / "state")
        idle = pb.GpuHealth(uuid="GPU-s0", name=H200, health_state=pb.HEALTH_STATE_HEALTHY)
        self.peers = {"s:1": FakePeer("node-s", idle)}
        self.moves: list[tuple[str, str, str, float | None]] = []
        self.fail_with: Exception | None = None
        self.refusing: dict[str, Exception] = {}  # target → its refusal at Prepare (nothing froze)
        self.gate: threading.Event | None = None
        cfg = AgentConfig(
            health=HealthConfig(interval_s=1, temperature_sustain_s=60),
            policy=policy or PolicyConfig(),
            peers=(PeerSpec("s:1", spare=True),),
        )
        self.threads: list[threading.Thread] = []
        self.ledger = GpuLedger(
            self.registry, self.quarantine, health=lambda: self.monitor.snapshot(), clock=self.clock
        )
        self.healing = SelfHealing(
            node="node-a",
            registry=self.registry,
            events=self.events,
            ledger=self.ledger,
            config=cfg,
            hooks=Hooks(
                inventory=Nvml(self.nvml).inventory,
                peer=lambda a: self.peers[a],
                migrate=self._migrate,
                spawn=self._spawn,
                suspend=self._suspend,
                resume=self._resume,
            ),
            state_dir=tmp / "state",
            health=lambda: self.monitor.snapshot(),
            clock=self.clock,
        )
        self.monitor = HealthMonitor(
            self.nvml, cfg.health, node="node-a", on_poll=self.healing.on_poll, clock=self.clock
        )
        self.resumable = False

    def job(self, name: str, gpu: str = "GPU-a0", **kw: object) -> None:
        self.registry.save(
            JobRecord(
                name,
                JobKind.LAUNCHED,
                JobState.RUNNING,
                999_999,
                ["train"],
                "/",
                gpus=[gpu],
                gpu_chip=H200,
                **kw,
            )  # type: ignore[arg-type]
        )

    def _migrate(self, job: str, target: str, reason: str, lock: float | None) -> object:
        self.moves.append((job, target, reason, lock))
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail_with is not None:
            raise self.fail_with
        if target in self.refusing:  # as a real move's Prepare refusal: the job runs on, untouched
            raise self.refusing[target]
        # As a real move does: MIGRATING while it runs, then MOVED.
        self.registry.begin_move(job, "m-fake", "migration")
        self.registry.update(job, state=JobState.MOVED)
        return None

    def _suspend(self, job: str, out: Path) -> None:
        # As `ferry checkpoint` does: MIGRATING while it dumps, then CHECKPOINTED.
        self.registry.begin_move(job, "checkpoint-fake", "checkpoint")
        self.registry.update(job, state=JobState.CHECKPOINTED, checkpoint_dir=str(out))

    def _spawn(self, work) -> None:
        t = threading.Thread(target=work)
        self.threads.append(t)
        t.start()
        if self.gate is None:
            t.join()

    def _resume(self, rec: JobRecord) -> JobRecord:
        if not self.resumable or set(rec.gpus) & set(self.ledger.unavailable(rec.name)):
            raise NoFreeGpuError("no free GPU")
        # As a real resume does: the restored job's new record replaces the preempted one.
        back = dataclasses.replace(rec, state=JobState.RUNNING)
        self.registry.save(back)
        return back

    def run(self, seconds: float, step: float = 1.0) -> None:
        """Advance the clock, polling as the agent's monitor would."""
        end = self.clock.now + seconds
        while self.clock.now < end:
            self.clock.advance(step)
            self.monitor.poll()

    def kinds(self, kind: str) -> list[str]:
        return [e.message for e in self.events.recent(1000) if e.kind == kind]


def test_slow_temperature_climb_moves_the_job_once_to_the_spare_and_quarantines_the_gpu(tmp_path):
    steps = [(t, "GPU-a0", {"temperature": 60 + t // 4}) for t in range(0, 200, 5)]  # 60 → 109 °C over 200 s
    rig = Rig(tmp_path, steps)
    rig.job("train")
    rig.run(90)  # reaches 85 °C at t=100: nothing yet
    assert rig.moves == [] and rig.kinds("decision") == []
    rig.run(120)  # sustained past 60 s (or critical): degraded
    assert len(rig.moves) == 1
    job, target, reason, lock = rig.moves[0]
    assert (job, target, lock) == ("train", "s:1", None)
    assert "GPU GPU-a0 is degraded" in reason and "°C" in reason
    assert rig.quarantine.get("GPU-a0") is not None
    assert any("healthy → degraded" in m for m in rig.kinds("health"))
    assert rig.kinds("decision")[0].startswith("moving job train off GPU GPU-a0")
    assert "idle GPU-s0 on spare node node-s" in rig.kinds("decision")[1]
    assert rig.kinds("migration") == ["moved job train to node node-s (s:1)"]
    assert "by ferry" in rig.registry.get("train").note


class SilentPeer(FakePeer):
    """A dead node's agent: no answer until its timeout. Its callers meet at a barrier, which
    only breaks (and then every peer answers) if every peer was asked at once."""

    def __init__(self, node: str, met: threading.Barrier) -> None:
        super().__init__(node)
        self.met = met

    def health(self, timeout_s: float) -> pb.HealthReport:
        self.met.wait()
        raise TransferError(f"agent on {self.report.node_name} did not answer in time", step="health")


class WaitingPeer(FakePeer):
    def __init__(self, node: str, met: threading.Barrier, *gpus: pb.GpuHealth) -> None:
        super().__init__(node, *gpus)
        self.met = met

    def health(self, timeout_s: float) -> pb.HealthReport:
        self.met.wait()
        return self.report


def test_the_spares_are_asked_at_once_so_dead_ones_cost_one_timeout_not_one_each(tmp_path):
    steps = [(10, "GPU-a0", {"ecc_corrected": 40})]
    rig = Rig(tmp_path, steps)
    met = threading.Barrier(3, timeout=5)  # asked one after the other, the first waits in vain
    idle = pb.GpuHealth(uuid="GPU-s0", name=H200, health_state=pb.HEALTH_STATE_HEALTHY)
    rig.peers = {"d:1": SilentPeer("node-d", met), "f:1": SilentPeer("node-f", met)}
    rig.peers["s:1"] = WaitingPeer("node-s", met, idle)
    peers = tuple(PeerSpec(a, spare=True) for a in rig.peers)
    rig.healing.config = dataclasses.replace(rig.healing.config, peers=peers)
    rig.job("train")
    rig.run(30)
    assert [(job, target) for job, target, _, _ in rig.moves] == [("train", "s:1")]
    assert not met.broken


def test_ignored_xids_cause_nothing(tmp_path):
    steps = [(float(i + 1), "GPU-a0", {"xid": x}) for i, x in enumerate((13, 31, 43, 45, 68, 109))]
    rig = Rig(tmp_path, steps)
    rig.job("train")
    rig.run(20)
    assert rig.moves == [] and rig.events.recent() == [] and rig.quarantine.all() == {}


def test_xid_79_tries_once_with_a_short_lock_then_leaves_the_job_to_the_operator(tmp_path):
    rig = Rig(tmp_path, [(5.0, "GPU-a0", {"xid": 79})], PolicyConfig(cooldown_s=10, failing_lock_timeout_s=2))
    rig.job("train")
    rig.fail_with = TransferError("dump on node-a: CUDA lock timed out after 2 s")
    rig.run(100)  # far past the cooldown: still one try
    assert [(m[0], m[3]) for m in rig.moves] == [("train", 2)]
    alerts = rig.kinds("alert")
    assert len(alerts) == 1 and "is failing and job train could not be moved" in alerts[0]
    assert "leaves it to you" in rig.registry.get("train").note


def spares(rig: Rig, *nodes: str) -> None:
    idle = lambda n: pb.GpuHealth(uuid=f"GPU-{n}0", name=H200, health_state=pb.HEALTH_STATE_HEALTHY)  # noqa: E731
    rig.peers = {f"{n}:1": FakePeer(f"node-{n}", idle(n)) for n in nodes}
    peers = tuple(PeerSpec(a, spare=True) for a in rig.peers)
    rig.healing.config = dataclasses.replace(rig.healing.config, peers=peers)


def test_a_spare_that_refuses_before_anything_froze_is_passed_over_for_the_next_even_off_a_failing_gpu(
    tmp_path,
):
    """A spare whose GPU fails its self-test refuses the lease: nothing froze, so the one try of a
    failing GPU is not spent, and the next spare takes the job."""
    rig = Rig(tmp_path, [(2.0, "GPU-a0", {"xid": 79})])
    spares(rig, "s", "t")
    rig.refusing["s:1"] = RefusedError(
        "prepare self-test on node-s: 1 GPU(s) failed their self-test before taking job train", step="prepare"
    )
    rig.job("train")
    rig.run(5)
    assert [m[1] for m in rig.moves] == ["s:1", "t:1"]
    assert rig.registry.get("train").state is JobState.MOVED
    passed = [m for m in rig.kinds("decision") if "did not take job train" in m]
    assert len(passed) == 1 and "failed their self-test" in passed[0]
    assert rig.kinds("migration") == ["moved job train to node node-t (t:1)"]


def test_a_refusal_after_something_froze_is_not_passed_on_to_another_target(tmp_path):
    rig = Rig(tmp_path, [(2.0, "GPU-a0", {"xid": 79})])
    spares(rig, "s", "t")
    rig.refusing["s:1"] = RefusedError("target restore failed", step="restore")
    rig.job("train")
    rig.run(5)
    assert [m[1] for m in rig.moves] == ["s:1"]
    assert len(rig.kinds("alert")) == 1


def test_at_most_three_targets_are_tried_for_one_move(tmp_path):
    rig = Rig(tmp_path, [(2.0, "GPU-a0", {"remapped": {"pending": True}})], PolicyConfig(cooldown_s=600))
    spares(rig, "s", "t", "u", "v")
    for a in rig.peers:
        rig.refusing[a] = RefusedError("the path is too slow", step="prepare path probe")
    rig.job("train")
    rig.run(5)
    assert len(rig.moves) == 3 and rig.registry.get("train").state is JobState.RUNNING
    assert any("automatic move of job train failed" in m for m in rig.kinds("migration"))


def test_a_failed_move_off_a_degraded_gpu_waits_out_the_cooldown(tmp_path):
    rig = Rig(tmp_path, [(1.0, "GPU-a0", {"remapped": {"pending": True}})], PolicyConfig(cooldown_s=30))
    rig.job("train")
    rig.fail_with = TransferError("the target went away")
    rig.run(25)
    assert len(rig.moves) == 1
    held = [m for m in rig.kinds("decision") if "not moving job train again yet" in m]
    assert len(held) == 1  # said once, not every poll
    rig.run(10)
    assert len(rig.moves) == 2


@pytest.mark.parametrize(
    "change", [{"remapped": {"pending": True}}, {"xid": 79}], ids=["degraded", "failing"]
)
def test_a_move_that_finds_the_job_busy_is_tried_again_once_it_ends_with_no_cooldown_or_lost_try(
    tmp_path, change
):
    """A snapshot round held the job when the move began: nothing was tried, so neither the
    cooldown nor a failing GPU's one try is spent; the next poll moves it."""
    rig = Rig(tmp_path, [(1.0, "GPU-a0", change)], PolicyConfig(cooldown_s=600))
    rig.job("train")
    rig.fail_with = JobBusyError("job 'train' is held for a group snapshot round (migration snapshot-1)")
    rig.run(3)
    busy = [m for m in rig.kinds("decision") if "is busy" in m]
    assert len(busy) == 1 and "held for a group snapshot round" in busy[0]
    assert rig.kinds("alert") == []
    rig.fail_with = None
    rig.run(2)
    assert len(rig.moves) >= 2 and rig.registry.get("train").state is JobState.MOVED
    assert rig.kinds("migration")[-1].startswith("moved job train to node node-s")


def test_a_job_a_snapshot_round_holds_when_its_target_is_chosen_is_moved_once_the_round_ends(tmp_path):
    """The round froze the job between the decision and the move's start (seen on the fault
    bench: the move failed as "no longer running here", its cooldown then kept it from trying
    again, and the node died with the job on it): nothing was tried, so no cooldown."""
    rig = Rig(tmp_path, [(1.0, "GPU-a0", {"remapped": {"pending": True}})], PolicyConfig(cooldown_s=600))
    rig.job("train")

    rounds = ["snapshot-1"]

    class RoundBegins(dict):  # the target asked for as the move starts: a round freezes the job then
        def __getitem__(self, address: str) -> FakePeer:
            if rounds:
                rig.registry.begin_move("train", rounds.pop(), "snapshot")
            return super().__getitem__(address)

    rig.peers = RoundBegins(rig.peers)
    rig.run(3)
    busy = [m for m in rig.kinds("decision") if "is busy" in m]
    assert len(busy) == 1 and "being saved or moved (migration snapshot-1)" in busy[0]
    assert not [m for m in rig.kinds("migration") if "failed" in m] and rig.moves == []
    rig.registry.update("train", state=JobState.RUNNING, migration_id="")  # the round released it
    rig.run(2)
    assert rig.registry.get("train").state is JobState.MOVED
    assert rig.kinds("migration")[-1].startswith("moved job train to node node-s")


def test_a_job_is_never_moved_twice_at_once(tmp_path):
    rig = Rig(tmp_path, [(1.0, "GPU-a0", {"remapped": {"pending": True}})], PolicyConfig(cooldown_s=0))
    rig.job("train")
    rig.gate = threading.Event()
    rig.run(10)  # ten polls while the first move hangs
    rig.gate.set()
    for t in rig.threads:
        t.join()
    assert len(rig.moves) == 1


def test_storm_guard_limits_moves_per_node(tmp_path):
    steps = [(1.0, u, {"remapped": {"pending": True}}) for u in ("GPU-a0", "GPU-a1")]
    rig = Rig(tmp_path, steps, PolicyConfig(max_moves=1, window_s=600), gpus=("GPU-a0", "GPU-a1"))
    rig.job("one", "GPU-a0")
    rig.job("two", "GPU-a1")
    rig.run(5)
    assert len(rig.moves) == 1
    assert len([m for m in rig.kinds("decision") if "1 automatic moves already started" in m]) == 1


def test_alert_policy_only_reports_once(tmp_path):
    rig = Rig(tmp_path, [(3.0, "GPU-a0", {"ecc_corrected": 500})])
    rig.job("train", on_degraded="alert")
    rig.run(10)
    assert rig.moves == [] and rig.quarantine.all() == {}
    alerts = rig.kinds("alert")
    assert len(alerts) == 1 and "job train stays on it (policy alert)" in alerts[0]


def test_no_target_is_reported_with_every_reason(tmp_path):
    rig = Rig(tmp_path, [(1.0, "GPU-a0", {"remapped": {"failure": True}})])
    rig.peers["s:1"] = FakePeer(
        "node-s",
        pb.GpuHealth(
            uuid="GPU-s0",
            name=H200,
            health_state=pb.HEALTH_STATE_HEALTHY,
            holders=[pb.GpuHolder(job="prod", priority_class=pb.PRIORITY_NORMAL)],
        ),
    )
    rig.job("train")
    rig.run(3)
    assert rig.moves == []
    failed = rig.kinds("migration")
    assert len(failed) == 1 and "no peer can take the job: node-s: GPU-s0 is held by job prod" in failed[0]


def test_a_member_is_never_suspended_for_its_own_group(tmp_path):
    rig = Rig(tmp_path, [])
    rig.job("llm-r2", priority="low")
    rig.registry.update("llm-r2", group="llm")
    with pytest.raises(RefusedError, match="member of group 'llm', as is job 'llm-r1'"):
        rig.healing.preempt(
            pb.PreemptRequest(job="llm-r2", for_job="llm-r1", for_group="llm", source_node="b")
        )
    assert rig.registry.get("llm-r2").state is JobState.RUNNING
    resp = rig.healing.preempt(
        pb.PreemptRequest(job="llm-r2", for_job="x", for_group="other", source_node="b")
    )
    assert rig.registry.get("llm-r2").state is JobState.PREEMPTED and list(resp.gpus) == ["GPU-a0"]


def test_preempting_a_low_priority_job_keeps_its_gpu_for_the_job_moving_in(tmp_path):
    rig = Rig(tmp_path, [])
    rig.job("scav", priority="low")
    rig.job("prod2", gpu="GPU-a1")
    with pytest.raises(RefusedError, match="only low-priority jobs"):
        rig.healing.preempt(pb.PreemptRequest(job="prod2", for_job="x", source_node="node-b"))
    resp = rig.healing.preempt(
        pb.PreemptRequest(job="scav", for_job="train", source_node="node-b", reason="r")
    )
    assert list(resp.gpus) == ["GPU-a0"]
    rec = rig.registry.get("scav")
    assert rec.state is JobState.PREEMPTED and "preempted for job train from node-b" in rec.note
    assert "GPU-a0" in rig.ledger.unavailable("someone-else")
    assert "GPU-a0" not in rig.ledger.unavailable("train")
    assert set(rig.ledger.held_for()) == {"GPU-a0"}

    # It does not come back while its GPU is kept for the incoming job, then does.
    rig.resumable = True
    assert rig.healing.resume_preempted() == []
    rig.clock.advance(PolicyConfig().preempt_hold_s + 1)
    assert rig.healing.resume_preempted() == ["scav"]
    assert rig.kinds("resume") == ["resumed preempted job scav on GPU-a0"]


def test_a_resume_that_can_never_work_is_reported_not_waited_on_silently(tmp_path):
    rig = Rig(tmp_path, [])
    rig.job("scav", priority="low")
    rig.healing.preempt(pb.PreemptRequest(job="scav", for_job="train", source_node="node-b"))

    def wrong_chip(rec):
        raise RefusedError("no NVIDIA H200 here (restore needs the same chip)")

    rig.healing.preemptions.resume = wrong_chip
    rig.clock.advance(PolicyConfig().preempt_hold_s + 1)
    assert rig.healing.resume_preempted() == []
    assert rig.healing.resume_preempted() == []  # backs off: said once, not every pass
    said = rig.kinds("resume")
    assert (
        len(said) == 1 and "could not resume preempted job scav (next try in 60 s): no NVIDIA H200" in said[0]
    )
    assert rig.registry.get("scav").state is JobState.PREEMPTED


def test_nothing_new_starts_once_the_agent_is_stopping(tmp_path):
    rig = Rig(tmp_path, [(1.0, "GPU-a0", {"remapped": {"pending": True}})])
    rig.job("train")
    rig.healing.draining.set()
    rig.run(5)
    assert rig.moves == [] and rig.healing.resume_preempted() == []


def test_no_peers_means_no_quarantine(tmp_path):
    rig = Rig(tmp_path, [(1.0, "GPU-a0", {"remapped": {"pending": True}})])
    rig.healing.config = AgentConfig(health=rig.healing.config.health, peers=())
    rig.job("train")
    rig.run(3)
    assert rig.moves == [] and rig.quarantine.all() == {}
    failed = rig.kinds("migration")
    assert len(failed) == 1 and "no peers are configured" in failed[0]


@pytest.mark.parametrize(
    ("what", "bad"),
    [
        ("clocks slowed by HW slowdown", {"clocks_event_reasons": 0x8}),
        ("row remapping pending", {"remapped": {"pending": True}}),
        ("PCIe link trained down to x4 of x16", {"pcie": {"width": 4}}),
    ],
)
def test_a_spare_whose_replayed_gpu_is_not_fit_is_passed_over_for_another(
    tmp_path: Path, what: str, bad: dict
) -> None:
    """Each spare's health report comes from its own monitor over a replayed timeline: the first
    spare (preferred by the config's order) shows the fault, and the move goes to the second."""
    from agent.service.convert import health_pb

    def report(node: str, uuid: str, fault: dict) -> pb.HealthReport:
        clock = FakeClock(0.0)
        nv = ReplayNvml.from_timeline(Timeline(world(uuid), [(0, uuid, fault)] if fault else []), clock)
        mon = HealthMonitor(nv, HealthConfig(interval_s=1, throttle_sustain_s=30), node=node, clock=clock)
        for t in range(0, 40, 5):  # a sustained signal (the clocks' 30 s) has held by then
            clock.now = float(t)
            mon.poll()
        q = Quarantine(tmp_path / node)
        gpus = [health_pb(g, [], q, set()) for g in mon.snapshot()]
        return pb.HealthReport(node_name=node, nvml_available=True, gpus=gpus, agent_id=node)

    rig = Rig(tmp_path, [(1.0, "GPU-a0", {"remapped": {"pending": True}})])
    rig.healing.config = dataclasses.replace(
        rig.healing.config, peers=(PeerSpec("s1:1", spare=True), PeerSpec("s2:1", spare=True))
    )
    rig.peers = {"s1:1": FakePeer("node-s1"), "s2:1": FakePeer("node-s2")}
    rig.peers["s1:1"].report = report("node-s1", "GPU-s1", bad)
    rig.peers["s2:1"].report = report("node-s2", "GPU-s2", {})
    assert what in rig.peers["s1:1"].report.gpus[0].evidence[0].detail
    rig.job("train")
    rig.run(5)
    assert [(j, t) for j, t, _, _ in rig.moves] == [("train", "s2:1")]
