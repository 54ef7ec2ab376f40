"""The straggler watch: this agent's part in finding who holds a group back.

Every `[stragglers] sample_s` it reads the pace of this node's group members
(agent.health.pace), asks the configured peers for their members of each group that has one
here (GetPace), judges each such group (agent.health.stragglers.judge) and acts on a verdict
against a member of this node only, through self-healing (which owns every automatic move).
A peer that does not answer within `[policy] peer_timeout_s` is left out of that judgement: its
member cannot be compared, and with fewer than two members there is no verdict.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from agent.agent_config import AgentConfig
from agent.errors import FerryError
from agent.health.events import EventLog
from agent.health.healing import SelfHealing
from agent.health.pace import PaceMeter, Sample
from agent.health.stragglers import MemberPace, judge
from agent.health.verdicts import GpuHealth
from agent.jobs.record import JobRecord, JobState
from agent.jobs.registry import JobRegistry
from agent.rpc import pb

log = logging.getLogger(__name__)

#: (peer address, group, timeout) → that agent's members of the group (GetPace, not whole).
Ask = Callable[[str, str, float], pb.GroupPace]


class StragglerWatch:
    def __init__(
        self,
        *,
        node: str,
        registry: JobRegistry,
        config: AgentConfig,
        healing: SelfHealing,
        events: EventLog,
        ask: Ask,
        observe: Callable[[str, dict[str, float], str], None] = lambda group, busy, new: None,
        arriving: Callable[[str], str] = lambda job: "",  # why its copy is not whole yet ("": it is)
        gpus: Callable[[], dict[str, tuple[float, str]]] = dict,  # job → its slowest GPU now (gpu_pace)
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.node, self.registry, self.config = node, registry, config
        self.healing, self.events, self.ask, self.observe, self.clock = healing, events, ask, observe, clock
        self.arriving, self.gpus = arriving, gpus
        cfg = config.stragglers
        self.meter = PaceMeter(cfg.window_s + 3 * cfg.sample_s + 2.0, clock=clock)
        self._standing: dict[str, str] = {}  # group → its straggler here whose verdict stands
        self._lock = threading.Lock()  # guards _standing

    def run(self, stopping: threading.Event) -> None:
        while not stopping.wait(self.config.stragglers.sample_s):
            try:
                self.tick()
            except Exception:
                log.exception("straggler watch: a round of sampling failed; trying again")

    def tick(self) -> None:
        members = self._members_here()
        self.meter.sample({r.name: r.pid for r in members if r.state is JobState.RUNNING}, self.gpus())
        for group in sorted({r.group for r in members}):
            if self.healing.draining.is_set():
                return
            self._act(group, self.group_pace(group, whole=True))

    def _members_here(self, group: str = "") -> list[JobRecord]:
        return [
            r for r in self.registry.list() if r.group and r.state.active and (not group or r.group == group)
        ]

    def local(self, group: str) -> list[pb.MemberPace]:
        out = []
        for r in self._members_here(group):
            # A member whose post-copy pages still come is still moving: no other member of its
            # group is judged (and moved) until it has arrived.
            running = r.state is JobState.RUNNING and not self.arriving(r.name)
            m = pb.MemberPace(job=r.name, node=self.node, running=running)
            if (rank := r.rank) is not None:
                m.rank, m.has_rank = rank, True
            m.samples.extend(
                pb.PaceSample(
                    t0=s.t0,
                    t1=s.t1,
                    busy=s.busy,
                    ran=s.ran,
                    waited=s.waited,
                    gpu_clock=s.gpu_clock,
                    gpu_brakes=s.gpu_brakes,
                )
                for s in self.meter.samples(r.name)
            )
            out.append(m)
        return out

    def group_pace(self, group: str, whole: bool) -> pb.GroupPace:
        """This node's members of `group`; with `whole`, every member the peers report too,
        each one's pace over the window and the verdict."""
        cfg = self.config.stragglers
        policy = self.config.policy.on_straggler
        out = pb.GroupPace(group=group, window_s=cfg.window_s, margin=cfg.margin, on_straggler=policy)
        members = {m.job: m for m in self.local(group)}
        if not whole:
            out.members.extend(members.values())
            return out
        for got in self._ask_peers(group):
            if isinstance(got, str):
                out.unreachable.append(got)
                continue
            for m in got.members:  # a member seen twice (a move's two ends): the one running
                if m.job not in members or (m.running and not members[m.job].running):
                    members[m.job] = m
        listed = sorted(members.values(), key=lambda m: (m.rank if m.has_rank else 1 << 30, m.job))
        verdict = judge(
            [
                MemberPace(
                    m.job,
                    m.node,
                    m.running,
                    [
                        Sample(s.t0, s.t1, s.busy, s.ran, s.waited, s.gpu_clock, s.gpu_brakes)
                        for s in m.samples
                    ],
                )
                for m in listed
            ],
            self.clock(),
            cfg.window_s,
            cfg.margin,
            cfg.sample_s,
        )
        for m in listed:
            p = verdict.paces[m.job]
            m.busy, m.ran, m.waited, m.covered_s, m.gpu_clock = (
                p.busy,
                p.ran,
                p.waited,
                p.covered_s,
                p.gpu_clock,
            )
        out.members.extend(listed)
        out.straggler, out.verdict = verdict.straggler, verdict.why
        return out

    def _ask_peers(self, group: str) -> list[pb.GroupPace | str]:
        peers = [p.address for p in self.config.peers]
        timeout = self.config.policy.peer_timeout_s

        def one(address: str) -> pb.GroupPace | str:
            try:
                got = self.ask(address, group, timeout)
            except FerryError as e:
                return f"{address}: {e.cause}"
            # This agent may be in its own peer list: its members are counted once, as its own.
            return pb.GroupPace(members=[m for m in got.members if m.node != self.node])

        if not peers:
            return []
        with ThreadPoolExecutor(len(peers)) as pool:  # a dead peer costs its timeout once
            return list(pool.map(one, peers))

    def _act(self, group: str, gp: pb.GroupPace) -> None:
        here = {r.name: r for r in self._members_here(group)}
        with self._lock:
            before = self._standing.get(group, "")
            now = gp.straggler if gp.straggler in here else ""
            if now:
                self._standing[group] = now
            else:
                self._standing.pop(group, None)
        busy = {m.job: m.busy for m in gp.members if m.job in here}
        self.observe(group, busy, now if now != before else "")
        if before and before != now:
            said = f"group {group}: {before} no longer holds it back: {gp.verdict}"
            self.events.record("straggler", said, job=before)
            self.healing.straggler_ended(before)
        if now:
            if now != before:
                self.events.record("straggler", f"group {group}: {gp.verdict}", job=now)
            migrate = self.config.policy.on_straggler == "migrate"
            self.healing.straggler(here[now], gp.verdict, migrate=migrate)


def gpu_pace(
    holders: dict[str, list[str]], health: list[GpuHealth], brakes: Callable[[int], list[str]]
) -> dict[str, tuple[float, str]]:
    """Each job holding GPUs (GPU → its jobs) → its slowest GPU's SM clock against its maximum,
    as the health monitor last read it, and the brakes on that GPU, in words."""
    out: dict[str, tuple[float, str]] = {}
    for g in health:
        now, top = g.readings.get("sm_clock_mhz"), g.readings.get("sm_clock_max_mhz")
        if not now or not top:
            continue
        why = ", ".join(brakes(int(g.readings.get("clocks_event_reasons", 0))))
        for job in holders.get(g.uuid, []):
            if job not in out or now / top < out[job][0]:
                out[job] = (now / top, why)
    return out
