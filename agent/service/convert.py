"""Between the product's types and the wire: records, results and reports as protobuf messages.

Closed sets keep their Python enums inside the agent and travel as proto enums, each through
its table in agent.wire.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from agent.coord.liveness import LostMember
from agent.cuda.driver import DriverInfo
from agent.errors import InvalidArgumentError
from agent.gpus.inventory import Inventory
from agent.gpus.quarantine import Quarantine
from agent.gpus.selftest import EXPECTED_TFLOPS
from agent.gpus.verify import Verdict
from agent.health.events import Event
from agent.health.monitor import GpuHealth
from agent.jobs.record import JobRecord, JobState
from agent.migration.model import Method, MigrationResult, Progress
from agent.migration.peerwait import PeerWait
from agent.rpc import pb
from agent.wire import DEGRADED_POLICIES, EVENT_KINDS, HEALTH_STATES, METHODS, PRIORITIES

if TYPE_CHECKING:  # annotations only: these modules need none of this one at import
    from agent.health.healing import Holder
    from agent.service.node import NodeInfo

PHASES = {
    "prepare": pb.PHASE_PREPARE,
    "dump": pb.PHASE_DUMP,
    "transfer": pb.PHASE_TRANSFER,
    "restore": pb.PHASE_RESTORE,
    "commit": pb.PHASE_COMMIT,
    "abort": pb.PHASE_ABORT,
    "done": pb.PHASE_DONE,
    "pages": pb.PHASE_PAGES,
}
STATES = {s: getattr(pb, f"JOB_STATE_{s.name}") for s in JobState}


def job_pb(rec: JobRecord, node: str) -> pb.Job:
    return pb.Job(
        name=rec.name,
        state=STATES[rec.state],
        kind=pb.JOB_KIND_ADOPTED if rec.kind.value == "adopted" else pb.JOB_KIND_LAUNCHED,
        pid=rec.pid,
        command=rec.command,
        cwd=rec.cwd,
        exit_code=rec.exit_code or 0,
        has_exit_code=rec.exit_code is not None,
        started_at=rec.started_at,
        updated_at=rec.updated_at,
        moved_to=rec.moved_to,
        moved_to_node=rec.moved_to_node,
        migration_id=rec.migration_id,
        checkpoint_dir=rec.checkpoint_dir,
        stdout_path=rec.stdout_path,
        stderr_path=rec.stderr_path,
        node_name=node,
        note=rec.note,
        env=rec.env,
        migrations=rec.migrations,
        gpus=rec.gpus,
        address=rec.address,
        group=rec.group,
        rank=rec.rank or 0,
        has_rank=rec.rank is not None,
        max_pause_s=rec.max_pause_s,
        priority_class=PRIORITIES.shown(rec.priority),
        degraded_policy=DEGRADED_POLICIES.shown(rec.on_degraded),
    )


def method_of(req: pb.MigrateRequest) -> Method:
    """The method a request asks for; an older client says it with the two booleans."""
    if req.method:
        return METHODS.py(req.method)
    if req.lazy and req.staged:
        raise InvalidArgumentError("--post-copy and --staged exclude each other (post-copy stages nothing)")
    return Method.POST_COPY if req.lazy else Method.STAGED if req.staged else Method.DEFAULT


def info_pb(i: NodeInfo) -> pb.NodeInfo:
    return pb.NodeInfo(
        node_name=i.node,
        version=i.version,
        criu_version=i.criu_version,
        staging_dir=i.staging_dir,
        staging_free_bytes=i.staging_free_bytes,
        agent_id=i.agent_id,
        peers=list(i.peers),
        post_copy=i.post_copy,
    )


def result_pb(r: MigrationResult) -> pb.MigrationResult:
    return pb.MigrationResult(
        migration_id=r.migration_id,
        job=r.job,
        source_node=r.source_node,
        target_node=r.target_node,
        target=r.target,
        phases=[pb.PhaseTiming(phase=k, seconds=v) for k, v in r.phases.items()],
        host_bytes=r.host_bytes,
        image_bytes=r.image_bytes,
        gpu_bytes=r.gpu_bytes,
        frozen_s=r.frozen_s,
        downtime_s=r.downtime_s,
        downtime_by=r.downtime_by,
        total_s=r.total_s,
        transfer_gbps=r.transfer_gbps,
        image_dir=r.image_dir,
        method=r.method,
        group_pause_s=r.group_pause_s,
        group_pause_by=r.group_pause_by,
        path_mbps=r.path_mbps,
    )


def peer_wait_pb(w: PeerWait) -> pb.PeerWait:
    return pb.PeerWait(
        not_measured=w.not_measured,
        wait_s=w.wait_s,
        connections=w.connections,
        resumed=w.resumed,
        silent=w.silent,
        stuck=w.stuck,
        window_s=w.window_s,
    )


def inventory_pb(inv: Inventory, drv: DriverInfo) -> pb.GpuInventory:
    return pb.GpuInventory(
        nvml_available=inv.available,
        nvml_detail=inv.detail,
        driver_version=inv.driver_version,
        cuda_loaded=drv.loaded,
        cuda_checkpoint=drv.checkpoint,
        cuda_custom_storage=drv.custom_storage,
        cuda_detail=drv.detail,
        gpus=[
            pb.Gpu(
                index=g.index,
                uuid=g.uuid,
                name=g.name,
                memory_total=g.memory_total,
                memory_used=g.memory_used,
                memory_free=g.memory_free,
                persistence=g.persistence,
                mig=g.mig,
                processes=[pb.GpuProcess(pid=p.pid, used_bytes=p.used_bytes) for p in g.processes],
            )
            for g in inv.gpus
        ],
    )


def health_pb(
    g: GpuHealth,
    holders: list[Holder],
    quarantine: Quarantine,
    held: set[str],
    verdicts: Mapping[str, Verdict] | None = None,
) -> pb.GpuHealth:
    q = quarantine.get(g.uuid)
    v = (verdicts or {}).get(g.uuid)
    return pb.GpuHealth(
        uuid=g.uuid,
        index=g.index,
        name=g.name,
        health_state=HEALTH_STATES.pb(g.state),
        evidence=[
            pb.Evidence(
                signal=e.signal, severity_level=HEALTH_STATES.pb(e.severity), detail=e.detail, since=e.since
            )
            for e in g.evidence
        ],
        since=g.since,
        sampled_at=g.sampled_at,
        readings=g.readings,
        quarantined=q is not None,
        quarantine_reason=q.reason if q else "",
        quarantined_at=q.since if q else 0.0,
        memory_total=g.memory_total,
        memory_used=g.memory_used,
        memory_free=g.memory_free,
        holders=[
            pb.GpuHolder(
                job=h.job.name,
                priority_class=PRIORITIES.shown(h.job.priority),
                used_bytes=h.used_bytes,
                group=h.job.group,
            )
            for h in holders
        ],
        held=g.uuid in held,
        selftest=selftest_pb(v) if v is not None else None,
    )


def selftest_pb(v: Verdict) -> pb.SelfTestVerdict:
    f = v.figures
    return pb.SelfTestVerdict(
        at=v.at,
        problems=list(v.problems),
        untested=v.untested,
        memory_gbps=f.memory_gbps if f else 0.0,
        tflops=f.tflops if f else 0.0,
        expected_tflops=EXPECTED_TFLOPS.get(f.name, 0.0) if f else 0.0,
        memory_bytes=f.memory_bytes if f else 0,
        took_s=f.took_s if f else 0.0,
    )


def event_pb(e: Event) -> pb.Event:
    # A kind no table knows (a line from another version) still reaches the operator, kind unspecified.
    kind = EVENT_KINDS.to_pb.get(e.kind, pb.EVENT_KIND_UNSPECIFIED)
    return pb.Event(time=e.time, event_kind=kind, node=e.node, gpu=e.gpu, job=e.job, message=e.message)


def progress_pb(p: Progress, elapsed_s: float) -> pb.ProgressEvent:
    return pb.ProgressEvent(
        phase=PHASES.get(p.phase, pb.PHASE_UNSPECIFIED),
        message=p.message,
        bytes_done=p.bytes_done,
        bytes_total=p.bytes_total,
        elapsed_s=elapsed_s,
    )


def lost_pb(lost: LostMember, seen_by: str) -> pb.LostMember:
    m = lost.member
    return pb.LostMember(
        group=m.group,
        name=m.job,
        node=m.node,
        agent=m.agent,
        address=m.address,
        rank=m.rank,
        since=lost.since,
        why=lost.why,
        seen_by=seen_by,
    )
