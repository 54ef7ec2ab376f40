"""Where a job leaving a bad GPU goes: the cluster view from the peers' health reports.

A target GPU must be healthy, not quarantined, of the same chip, with room for the
job's memory there. Preference, best first: an idle GPU on a spare node, an idle GPU on
another peer, then GPUs held only by low-priority jobs (which are suspended to make
room; a spare first again), fewest suspended jobs first; among those alike, the peer that
keeps the job's last snapshot image. Ties keep the config's order.
The target's own Prepare checks everything again; this only decides whom to ask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agent.agent_config import PeerSpec
from agent.errors import FerryError, RefusedError
from agent.gpus.inventory import GpuNeed, gib
from agent.health.verdicts import State
from agent.jobs.record import Priority
from agent.rpc import pb
from agent.wire import HEALTH_STATES, PRIORITIES


@dataclass(frozen=True)
class Placement:
    peer: PeerSpec
    node: str
    gpus: dict[str, str]  # the job's GPU → the peer's GPU it is expected to land on
    preempt: tuple[str, ...] = ()  # low-priority jobs there to suspend first

    def describe(self) -> str:
        where = ", ".join(self.gpus.values())
        kind = "spare " if self.peer.spare else ""
        if self.preempt:
            return f"{where} on {kind}node {self.node}, after suspending low-priority {_jobs(self.preempt)}"
        return f"idle {where} on {kind}node {self.node}"


View = tuple[PeerSpec, "pb.HealthReport | FerryError"]


def choose_target(
    needs: Sequence[GpuNeed],
    priority: str,
    views: Sequence[View],
    node: str = "",
    group: str = "",
    apart: bool = False,
    keeper: str = "",
) -> Placement:
    """The best placement, or a refusal that says, peer by peer, why none would do. `apart`:
    no peer that runs a member of `group` (a straggler's move: it would share that node).
    `keeper`: the peer (address) that keeps the job's last snapshot image, preferred among
    spares alike (the move then carries only what changed since: agent.migration.chainmove)."""
    if not views:
        raise RefusedError(
            "no peers are configured to move the job to",
            step="placement",
            node=node,
            hint="list peers (and spares) in the agent's --config file",
        )
    best: tuple[tuple[int, ...], Placement] | None = None
    why: list[str] = []
    for order, (peer, report) in enumerate(views):
        if isinstance(report, FerryError):
            why.append(f"{peer.address}: {report.cause}")
            continue
        fit = _fit(needs, priority, report, group)
        if apart and group in report.groups:
            fit = f"runs a member of group {group} already"
        if isinstance(fit, str):
            why.append(f"{report.node_name or peer.address}: {fit}")
            continue
        gpus, preempt = fit
        placement = Placement(peer, report.node_name, gpus, preempt)
        cost = (bool(preempt), not peer.spare, peer.address != keeper, len(preempt), order)
        if best is None or cost < best[0]:
            best = (cost, placement)
    if best is None:
        raise RefusedError(
            "no peer can take the job: " + "; ".join(why),
            step="placement",
            node=node,
            hint="free or add a spare GPU of the same chip, or clear a quarantined one once fixed",
        )
    return best[1]


def _fit(
    needs: Sequence[GpuNeed], priority: str, report: pb.HealthReport, group: str = ""
) -> tuple[dict[str, str], tuple[str, ...]] | str:
    """GPUs on one peer for every need (and the jobs to suspend), or why not. A low-priority
    member of the moving job's own group is never suspended for it: it would stall the group."""
    if not needs:
        return {}, ()  # a job without GPUs fits any live peer
    if not report.nvml_available:
        return f"no usable GPUs ({report.nvml_detail or 'NVML unavailable'})"
    may_preempt = priority != Priority.LOW.value
    taken: set[str] = set()
    preempt: list[str] = []
    out: dict[str, str] = {}
    for need in sorted(needs, key=lambda n: -n.memory_bytes):
        usable, refused = [], []
        for g in report.gpus:
            if g.name != need.name or g.uuid in taken:
                continue
            if bad := _unusable(g):
                refused.append(f"{g.uuid} {bad}")
                continue
            holders = [h.job for h in g.holders]
            if not holders:
                if g.memory_free >= need.memory_bytes:
                    usable.append((0, -g.memory_free, g.uuid, ()))
                else:
                    refused.append(f"{g.uuid} has {gib(g.memory_free)} free, {gib(need.memory_bytes)} needed")
                continue
            normal = [
                h.job for h in g.holders if _priority(h) is not Priority.LOW or (group and h.group == group)
            ]
            room = g.memory_free + sum(h.used_bytes for h in g.holders)
            if normal or not may_preempt:
                refused.append(f"{g.uuid} is held by {_jobs(normal or holders)}")
            elif room < need.memory_bytes:
                refused.append(f"{g.uuid} would have {gib(room)} free, {gib(need.memory_bytes)} needed")
            else:
                new = tuple(j for j in holders if j not in preempt)
                usable.append((len(new) or 0, -room, g.uuid, new))
        if not usable:
            chips = {g.name for g in report.gpus}
            if need.name not in chips:
                return f"no {need.name} (it has {', '.join(sorted(chips)) or 'no GPUs'})"
            return "; ".join(refused)
        # Idle first, then the GPU that suspends the fewest more jobs.
        _, _, uuid, new = min(usable, key=lambda u: (bool(u[3]), u[0], u[1]))
        out[need.uuid] = uuid
        taken.add(uuid)
        preempt.extend(new)
    return out, tuple(preempt)


def _unusable(g: pb.GpuHealth) -> str:
    if g.quarantined:
        return f"is quarantined ({g.quarantine_reason})"
    try:
        state = HEALTH_STATES.py(g.health_state)
    except FerryError as e:  # a peer of another version: not a GPU to move a job onto
        return f"has a state this agent cannot read ({e.cause})"
    if state is not State.HEALTHY:
        return f"is {state}"
    if g.held:
        return "is held for another incoming job"
    return ""


def _priority(h: pb.GpuHolder) -> Priority:
    """A holder's priority as the peer reports it; one this agent cannot read is never preempted."""
    try:
        return PRIORITIES.py(h.priority_class)
    except FerryError:
        return Priority.NORMAL


def _jobs(names: Sequence[str]) -> str:
    return ("job " if len(names) == 1 else "jobs ") + ", ".join(names)
