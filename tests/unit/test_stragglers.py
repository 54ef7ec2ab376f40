"""Who holds a group back: the pace read from /proc (real processes), the verdict (a pure
function of the members' samples), and the watch that asks the peers and acts through
self-healing (peers and moves are fakes here; the real path runs in
tests/integration/test_stragglers.py)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.agent_config import AgentConfig, PeerSpec, PolicyConfig, parse
from agent.errors import InvalidArgumentError, RefusedError, UnavailableError
from agent.health.judging import brakes
from agent.health.pace import PaceMeter, Sample, between, read_threads
from agent.health.placement import choose_target
from agent.health.straggler_watch import StragglerWatch, gpu_pace
from agent.health.stragglers import MemberPace, StragglerConfig, judge
from agent.health.verdicts import GpuHealth, State
from agent.jobs.record import JobKind, JobRecord, JobState
from agent.rpc import pb
from tests.unit.test_healing import FakePeer, Rig

WINDOW, SAMPLE, MARGIN = 20.0, 2.0, 0.3


def series(busy: list[float], end: float = 100.0, waited_share: float = 0.7) -> list[Sample]:
    """Samples every SAMPLE s ending at `end`, one per busy share given."""
    t0 = end - SAMPLE * len(busy)
    return [
        Sample(t0 + i * SAMPLE, t0 + (i + 1) * SAMPLE, b, b * (1 - waited_share), b * waited_share)
        for i, b in enumerate(busy)
    ]


def members(**busy: list[float]) -> list[MemberPace]:
    return [MemberPace(job, f"node-{job}", True, series(b)) for job, b in busy.items()]


def verdict(ms: list[MemberPace]):
    return judge(ms, 100.0, WINDOW, MARGIN, SAMPLE)


N = int(WINDOW / SAMPLE) + 1


# -- the pace, from the kernel --------------------------------------------------------


def test_a_spinning_process_is_busy_and_a_sleeping_one_is_not() -> None:
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    nap = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.3)  # both started
        before = {p: read_threads(p.pid) for p in (spin, nap)}
        t0 = time.time()
        time.sleep(1.0)
        t1 = time.time()
        busy = between(before[spin], read_threads(spin.pid), t0, t1)
        idle = between(before[nap], read_threads(nap.pid), t0, t1)
    finally:
        spin.kill()
        nap.kill()
    assert busy.busy > 0.8 and busy.busy == min(1.0, busy.ran + busy.waited), busy
    assert idle.busy < 0.05, idle


def test_the_busiest_thread_counts_and_a_thread_new_since_the_last_reading_does_not() -> None:
    before = {1: (0, 0), 2: (0, 0)}
    after = {1: (int(0.2e9), int(0.7e9)), 2: (int(0.5e9), 0), 3: (int(1e9), 0)}
    s = between(before, after, 10.0, 11.0)
    assert (round(s.busy, 3), round(s.ran, 3), round(s.waited, 3)) == (0.9, 0.2, 0.7)


def test_a_meter_keeps_its_window_and_starts_over_when_the_job_is_a_new_process() -> None:
    now = [0.0]
    counters = {10: {1: (0, 0)}, 20: {1: (0, 0)}}

    def read(pid: int) -> dict[int, tuple[int, int]]:
        ran, waited = counters[pid][1]
        counters[pid][1] = (ran + int(0.5e9), waited)  # half a second on a CPU per reading
        return {1: (ran, waited)}

    meter = PaceMeter(keep_s=5.0, clock=lambda: now[0], read=read)
    for _ in range(10):
        meter.sample({"r0": 10})
        now[0] += 1.0
    got = meter.samples("r0")
    assert 4 <= len(got) <= 6 and all(abs(s.busy - 0.5) < 1e-9 for s in got), got
    meter.sample({"r0": 20})  # restored: another process
    assert meter.samples("r0") == []
    meter.sample({})
    assert meter.samples("r0") == []


# -- the verdict --------------------------------------------------------------------


def test_a_member_that_wants_a_cpu_all_along_while_its_peers_wait_is_the_straggler() -> None:
    v = verdict(members(r0=[0.3] * N, r1=[0.98] * N, r2=[0.35] * N))
    assert v.straggler == "r1", v.why
    assert "waited" in v.why and "CPU quota" in v.why and "r1 on node-r1" in v.why
    assert abs(v.paces["r1"].busy - 0.98) < 1e-6


def test_members_at_the_same_pace_have_no_straggler_even_when_all_are_busy() -> None:
    v = verdict(members(r0=[0.95] * N, r1=[0.99] * N, r2=[0.9] * N))
    assert v.straggler == "" and "leads its peers by" in v.why


def test_a_slowdown_shorter_than_the_window_is_not_a_straggler() -> None:
    brief = [0.3] * (N - 4) + [0.99] * 4
    v = verdict(members(r0=[0.3] * N, r1=brief, r2=[0.3] * N))
    assert v.straggler == "", v.why
    # ... and one that lasts the window with a passing dip is not excused either way: on
    # average it leads, but not all along.
    dip = [0.99] * (N - 1) + [0.3]
    v = verdict(members(r0=[0.2] * N, r1=dip, r2=[0.2] * N))
    assert v.straggler == "" and "not all along" in v.why


def test_a_slowdown_over_part_of_the_window_is_judged_against_the_peers_pace_beside_it() -> None:
    """Slowed over the last half: its peers fell from 50 % to 20 % meanwhile. Against their mean
    over the window (36 %) its first half (55 %) would look ahead by more than half the margin;
    beside their pace then, it is not, so no verdict until the slowdown fills the window."""
    half = N // 2
    peer = [0.5] * (N - half) + [0.2] * half
    v = verdict(members(r0=peer, r1=[0.55] * (N - half) + [1.0] * half, r2=peer))
    assert v.straggler == "" and "not all along" in v.why, v.why


def test_of_two_slow_members_the_slowest_is_the_straggler_first() -> None:
    v = verdict(members(r0=[0.2] * N, r1=[0.98] * N, r2=[0.6] * N, r3=[0.25] * N))
    assert v.straggler == "r1"


def test_no_verdict_while_a_member_is_not_running_or_not_sampled_for_the_window() -> None:
    ms = members(r0=[0.3] * N, r1=[0.98] * N, r2=[0.3] * N)
    moving = [ms[0], MemberPace("r1", "node-r1", False, ms[1].samples), ms[2]]
    assert verdict(moving).straggler == "" and "not running" in verdict(moving).why
    fresh = [ms[0], MemberPace("r1", "node-x", True, series([0.98] * 3)), ms[2]]
    v = verdict(fresh)
    assert v.straggler == "" and "sampled for 6 s of the 20 s window" in v.why
    assert verdict(ms[:1]).straggler == ""


def test_a_member_that_ran_all_along_is_said_slower_not_throttled() -> None:
    ms = [MemberPace(j, "n", True, series(b, waited_share=w)) for j, b, w in (("a", [0.3] * N, 0.0),
          ("b", [1.0] * N, 0.05), ("c", [0.3] * N, 0.0))]  # fmt: skip
    v = verdict(ms)
    assert v.straggler == "b" and "a slower CPU" in v.why


def test_the_config_refuses_a_window_too_short_for_its_samples_and_a_bad_policy() -> None:
    with pytest.raises(InvalidArgumentError, match="at most a third"):
        StragglerConfig(sample_s=5, window_s=10).check()
    with pytest.raises(InvalidArgumentError, match="margin"):
        StragglerConfig(margin=1.5).check()
    with pytest.raises(InvalidArgumentError, match="on_straggler 'move' is not one of alert, migrate"):
        parse({"policy": {"on_straggler": "move"}})
    got = parse({"policy": {"on_straggler": "migrate"}, "stragglers": {"window_s": 30, "sample_s": 1}})
    assert got.policy.on_straggler == "migrate" and got.stragglers.window_s == 30


# -- the watch and the move ----------------------------------------------------------


class Peers:
    """Other agents' GetPace answers (a member each), or a failure."""

    def __init__(self) -> None:
        self.answers: dict[str, pb.GroupPace | Exception] = {}

    def ask(self, address: str, group: str, timeout_s: float) -> pb.GroupPace:
        got = self.answers[address]
        if isinstance(got, Exception):
            raise got
        return got


def remote(job: str, node: str, busy: float, end: float, running: bool = True) -> pb.GroupPace:
    m = pb.MemberPace(job=job, node=node, running=running)
    m.samples.extend(
        pb.PaceSample(t0=s.t0, t1=s.t1, busy=s.busy, ran=s.ran, waited=s.waited)
        for s in series([busy] * N, end)
    )
    return pb.GroupPace(members=[m])


def watch_rig(tmp_path: Path, policy: str) -> tuple[Rig, StragglerWatch, Peers, list[Sample]]:
    """node-a's agent with member g-r1 busy 97 % of the window; g-r0 (node-b) and g-r2 (node-c)
    at about 30 %, reported by their agents; a spare (s:1) that runs no member."""
    rig = Rig(tmp_path, [], policy=PolicyConfig(on_straggler=policy))
    rig.registry.save(
        JobRecord("g-r1", JobKind.LAUNCHED, JobState.RUNNING, 4242, ["train"], "/", group="g", env=["RANK=1"])
    )
    cfg = AgentConfig(
        policy=PolicyConfig(on_straggler=policy),
        peers=(PeerSpec("a:1"), PeerSpec("c:1"), PeerSpec("s:1", spare=True)),
        stragglers=StragglerConfig(sample_s=SAMPLE, window_s=WINDOW, margin=MARGIN),
    )
    rig.healing.config = cfg
    peers = Peers()
    mine = series([0.97] * N, end=rig.clock.now)
    watch = StragglerWatch(
        node="node-a", registry=rig.registry, config=cfg, healing=rig.healing, events=rig.events,
        ask=peers.ask, clock=rig.clock,
    )  # fmt: skip
    watch.meter.samples = lambda job: mine if job == "g-r1" else []  # type: ignore[method-assign]
    now = rig.clock.now
    peers.answers = {
        "a:1": remote("g-r0", "node-b", 0.3, now),
        "c:1": remote("g-r2", "node-c", 0.32, now),
        "s:1": pb.GroupPace(),
    }
    # The spare runs no member; node-b does (a straggler is never moved next to a peer member).
    rig.peers = {
        "a:1": FakePeer("node-b"),
        "c:1": FakePeer("node-c"),
        "s:1": FakePeer("node-s"),
    }
    rig.peers["a:1"].report.groups.append("g")
    rig.peers["c:1"].report.groups.append("g")
    return rig, watch, peers, mine


def test_the_straggler_s_own_agent_moves_it_to_a_spare_and_says_so_once(tmp_path: Path) -> None:
    rig, watch, _, _ = watch_rig(tmp_path, "migrate")
    gp = watch.group_pace("g", whole=True)
    assert gp.straggler == "g-r1", gp.verdict
    assert [(m.job, m.has_rank) for m in gp.members] == [("g-r1", True), ("g-r0", False), ("g-r2", False)]
    watch._act("g", gp)
    assert [(j, t) for j, t, _, _ in rig.moves] == [("g-r1", "s:1")]
    assert "holds its group back" in rig.moves[0][2]
    said = rig.kinds("straggler")
    assert len(said) == 1 and said[0].startswith("group g: g-r1 on node-a holds its group back"), said
    # Moved (MOVED here now): the verdict against it ends, said once.
    watch._act("g", watch.group_pace("g", whole=True))
    assert len(rig.kinds("straggler")) == 2 and "no longer holds it back" in rig.kinds("straggler")[1]


def test_with_policy_alert_the_straggler_is_said_once_and_stays(tmp_path: Path) -> None:
    rig, watch, _, _ = watch_rig(tmp_path, "alert")
    for _ in range(3):
        watch._act("g", watch.group_pace("g", whole=True))
    assert rig.moves == []
    assert len(rig.kinds("straggler")) == 1 and len(rig.kinds("alert")) == 1
    assert "stays (policy on_straggler alert)" in rig.kinds("alert")[0]


def test_a_peer_that_does_not_answer_is_named_and_no_member_is_judged_without_a_peer(tmp_path: Path) -> None:
    rig, watch, peers, _ = watch_rig(tmp_path, "migrate")
    peers.answers["a:1"] = UnavailableError("agent a:1 is unreachable")
    peers.answers["c:1"] = UnavailableError("agent c:1 is unreachable")
    gp = watch.group_pace("g", whole=True)
    assert gp.straggler == "" and "fewer than two members" in gp.verdict
    assert [u.split(":")[0] for u in gp.unreachable] == ["a", "c"]
    watch._act("g", gp)
    assert rig.moves == []


def test_no_move_while_another_member_of_the_group_is_moving(tmp_path: Path) -> None:
    rig, watch, peers, _ = watch_rig(tmp_path, "migrate")
    peers.answers["c:1"] = remote("g-r2", "node-c", 0.32, rig.clock.now, running=False)
    gp = watch.group_pace("g", whole=True)
    assert gp.straggler == "" and "g-r2 is not running" in gp.verdict


def test_a_straggler_is_never_placed_beside_a_member_of_its_group_even_on_a_preferred_peer() -> None:
    b = pb.HealthReport(node_name="node-b", nvml_available=False, groups=["g"])
    c = pb.HealthReport(node_name="node-c", nvml_available=False, groups=["other"])
    views = [(PeerSpec("b:1", spare=True), b), (PeerSpec("c:1"), c)]
    assert choose_target([], "normal", views, "node-a", "g", apart=True).node == "node-c"
    assert choose_target([], "normal", views, "node-a", "g").node == "node-b"  # a GPU move may
    with pytest.raises(RefusedError, match="node-b: runs a member of group g already"):
        choose_target([], "normal", views[:1], "node-a", "g", apart=True)


def test_ferry_health_group_shows_each_member_the_straggler_and_who_did_not_answer() -> None:
    from agent.cli.gpus import pace_dict, pace_text

    gp = pb.GroupPace(group="g", window_s=60, margin=0.3, on_straggler="migrate", straggler="g-r1")
    gp.members.add(
        job="g-r0", node="node-a", rank=0, has_rank=True, running=True, busy=0.3, covered_s=60, gpu_clock=-1
    )
    gp.members.add(
        job="g-r1", node="node-b", rank=1, has_rank=True, running=True, busy=0.98, waited=0.7, gpu_clock=0.55
    )
    gp.verdict = "g-r1 on node-b holds its group back: ..."
    gp.unreachable.append("c:1: agent c:1 is unreachable")
    text = pace_text(gp).splitlines()
    assert text[0] == "group g: the last 60 s, busiest thread of each member"
    assert text[3].split()[:5] == ["g-r1", "1", "node-b", "98%", "0%"] and text[3].endswith("<- straggler")
    assert "<- straggler" not in text[2] and "GPU at" not in text[2]
    assert "GPU at 55% of its max SM clock" in text[3]
    assert "straggler: g-r1 on node-b holds its group back" in text[4]
    assert text[-1] == "not answering: c:1: agent c:1 is unreachable"
    d = pace_dict(gp)
    assert d["straggler"] == "g-r1" and "samples" not in d["members"][0]


def gpu_series(clock: list[float], brakes: str = "") -> list[Sample]:
    """Samples of a GPU member whose CPU pace is its peers' (30 %), its SM clock as given."""
    return [dataclasses.replace(s, gpu_clock=c, gpu_brakes=brakes if c < 0.9 else "") for s, c in
            zip(series([0.3] * len(clock)), clock, strict=True)]  # fmt: skip


def test_a_gpu_member_whose_gpu_slows_itself_all_along_is_the_straggler_with_the_brakes_named() -> None:
    ms = [
        MemberPace("r0", "node-a", True, gpu_series([0.98] * N)),
        MemberPace("r1", "node-b", True, gpu_series([0.55] * N, "HW power brake")),
        MemberPace("r2", "node-c", True, gpu_series([0.97] * N)),
    ]
    v = verdict(ms)
    assert v.straggler == "r1", v.why
    assert "its GPU ran at 55% of its maximum SM clock (HW power brake) while its peers' ran at 98%" in v.why
    brief = [MemberPace("r1", "node-b", True, gpu_series([0.98] * (N - 3) + [0.5] * 3, "HW slowdown"))]
    assert verdict([ms[0], *brief, ms[2]]).straggler == ""


def test_a_job_s_gpu_pace_is_its_slowest_gpu_as_the_monitor_last_read_it() -> None:
    def g(uuid: str, now: float, reasons: int = 0) -> GpuHealth:
        readings = {"sm_clock_mhz": now, "sm_clock_max_mhz": 2000.0, "clocks_event_reasons": float(reasons)}
        return GpuHealth(uuid, 0, "NVIDIA H200", State.HEALTHY, (), 0.0, 0.0, readings, 0, 0, 0)

    import pynvml

    monitor_brakes = lambda r: brakes(pynvml, r)  # noqa: E731
    got = gpu_pace(
        {"GPU-a": ["j1"], "GPU-b": ["j1", "j2"], "GPU-c": []},
        [g("GPU-a", 1900), g("GPU-b", 1000, int(pynvml.nvmlClocksEventReasonHwSlowdown)), g("GPU-c", 500)],
        monitor_brakes,
    )
    assert got == {"j1": (0.5, "HW slowdown"), "j2": (0.5, "HW slowdown")}


def test_the_watch_keeps_a_gpu_member_s_clock_with_its_samples(tmp_path: Path) -> None:
    rig, watch, _, _ = watch_rig(tmp_path, "alert")
    watch.meter = PaceMeter(60.0, clock=rig.clock, read=lambda pid: {1: (0, 0)})
    watch.gpus = lambda: {"g-r1": (0.6, "HW slowdown")}
    for _ in range(3):
        watch.tick()
        rig.clock.advance(1.0)
    (m,) = watch.local("g")
    assert [(s.gpu_clock, s.gpu_brakes) for s in m.samples] == [(pytest.approx(0.6), "HW slowdown")] * 2
