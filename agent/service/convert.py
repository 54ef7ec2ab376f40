"""Between the product's types and the wire: records, results and reports as protobuf messages.

Closed sets keep their Python enums inside the agent and travel as proto enums; each has one
`EnumMap` here, both ways. UNSPECIFIED (0) on input means the set's documented default, where
it has one; any number this agent does not know is INVALID_ARGUMENT, quoting it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from agent.cuda.driver import DriverInfo
from agent.errors import FerryError, InvalidArgumentError
from agent.gpus.inventory import Inventory
from agent.gpus.quarantine import Quarantine
from agent.health.events import Event
from agent.health.monitor import GpuHealth, State
from agent.jobs.record import JobRecord, JobState, OnDegraded, Priority
from agent.migration.model import MigrationResult, Progress
from agent.migration.recovery import Resolution
from agent.rpc import pb

if TYPE_CHECKING:  # healing reads peers' reports through placement, which converts with this module
    from agent.health.healing import Holder

E = TypeVar("E", bound=str)


@dataclass(frozen=True)
class EnumMap(Generic[E]):
    """One closed set both ways: the product's value <-> the proto enum's number."""

    what: str  # the set, as a message names it: "priority"
    enum: Any  # the generated enum wrapper (pb.Priority): its names for messages
    to_pb: Mapping[E, int]
    #: What UNSPECIFIED means on input; None: the set has no default and 0 is refused.
    default: E | None = None
    from_pb_table: Mapping[int, E] = field(init=False)

    def __post_init__(self) -> None:
        back = {n: v for v, n in self.to_pb.items()}
        assert len(back) == len(self.to_pb) and 0 not in back, f"{self.what}: not one-to-one"
        object.__setattr__(self, "from_pb_table", back)

    def pb(self, value: E | str) -> int:
        """The number for a value; records keep the words, which equal the enum's values."""
        try:
            return self.to_pb[value]  # type: ignore[index]
        except KeyError:
            words = ", ".join(repr(str(v)) for v in self.to_pb)
            raise FerryError(
                f"{self.what} {value!r} has no wire value: expected one of {words}",
                hint="a record written by another ferry version, or edited by hand",
            ) from None

    def py(self, number: int) -> E:
        if number == 0 and self.default is not None:
            return self.default
        if (value := self.from_pb_table.get(number)) is not None:
            return value
        known = ", ".join(f"{self.enum.Name(n)} ({n})" for n in sorted(self.from_pb_table))
        got = f"no {self.what} (0, unspecified)" if number == 0 else f"unknown {self.what} {number}"
        raise InvalidArgumentError(
            f"{got}: expected one of {known}",
            hint="the sender and this agent may be different ferry versions",
        )


PRIORITIES: EnumMap[Priority] = EnumMap(
    "priority",
    pb.Priority,
    {Priority.NORMAL: pb.PRIORITY_NORMAL, Priority.LOW: pb.PRIORITY_LOW},
    default=Priority.NORMAL,
)
DEGRADED_POLICIES: EnumMap[OnDegraded] = EnumMap(
    "on-degraded policy",
    pb.OnDegraded,
    {OnDegraded.MIGRATE: pb.ON_DEGRADED_MIGRATE, OnDegraded.ALERT: pb.ON_DEGRADED_ALERT},
    default=OnDegraded.MIGRATE,
)
RESOLUTIONS: EnumMap[Resolution] = EnumMap(
    "resolve action",
    pb.ResolveAction,
    {
        Resolution.ASK: pb.RESOLVE_ACTION_ASK,
        Resolution.RESUME: pb.RESOLVE_ACTION_RESUME,
        Resolution.FINISH: pb.RESOLVE_ACTION_FINISH,
    },
    default=Resolution.ASK,
)
#: A GPU's state and an evidence's severity: a report always says which, so 0 has no meaning.
HEALTH_STATES: EnumMap[State] = EnumMap(
    "health state",
    pb.HealthState,
    {
        State.HEALTHY: pb.HEALTH_STATE_HEALTHY,
        State.DEGRADED: pb.HEALTH_STATE_DEGRADED,
        State.FAILING: pb.HEALTH_STATE_FAILING,
    },
)
#: Event kinds are the words agent.health.events records (a test holds every recorded kind here).
EVENT_KINDS: EnumMap[str] = EnumMap(
    "event kind",
    pb.EventKind,
    {
        "health": pb.EVENT_KIND_HEALTH,
        "decision": pb.EVENT_KIND_DECISION,
        "migration": pb.EVENT_KIND_MIGRATION,
        "preempt": pb.EVENT_KIND_PREEMPT,
        "resume": pb.EVENT_KIND_RESUME,
        "quarantine": pb.EVENT_KIND_QUARANTINE,
        "alert": pb.EVENT_KIND_ALERT,
    },
)
ENUM_MAPS: tuple[EnumMap[Any], ...] = (PRIORITIES, DEGRADED_POLICIES, RESOLUTIONS, HEALTH_STATES, EVENT_KINDS)

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
        priority_class=PRIORITIES.pb(rec.priority),
        degraded_policy=DEGRADED_POLICIES.pb(rec.on_degraded),
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
        total_s=r.total_s,
        transfer_gbps=r.transfer_gbps,
        image_dir=r.image_dir,
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


def health_pb(g: GpuHealth, holders: list[Holder], quarantine: Quarantine, held: set[str]) -> pb.GpuHealth:
    q = quarantine.get(g.uuid)
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
                job=h.job.name, priority_class=PRIORITIES.pb(h.job.priority), used_bytes=h.used_bytes
            )
            for h in holders
        ],
        held=g.uuid in held,
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
