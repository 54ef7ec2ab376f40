"""The agent's gRPC service. No logic here: it calls jobs/migrate and maps errors to status codes."""

from __future__ import annotations

import functools
import logging
import os
import queue
import shutil
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent import futures
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from agent import __version__, client, tls
from agent.agent_config import AgentConfig
from agent.criu.runner import Criu
from agent.cuda.driver import DriverInfo
from agent.cuda.jobs import CudaJobs
from agent.errors import FerryError, InvalidArgumentError, NotFoundError, PermissionDeniedError, RefusedError
from agent.gpus.inventory import Inventory, nvml_module
from agent.gpus.quarantine import Quarantine
from agent.health.events import Event, EventLog
from agent.health.healing import Holder, Hooks, SelfHealing
from agent.health.monitor import GpuHealth, HealthMonitor
from agent.image import read_manifest
from agent.jobs.network import JobNetwork
from agent.jobs.registry import JobRecord, JobRegistry, JobState, OnDegraded, Priority, check_job_name
from agent.migration.journal import Journal
from agent.migration.recovery import SourceRecovery
from agent.migration.source import (
    MigrationResult,
    MigrationSpec,
    Progress,
    SourceMigration,
    checkpoint,
    default_cuda_jobs,
    restore_image,
    resume_preempted,
)
from agent.migration.target import TargetMigrations, private_dir
from agent.rpc import pb, pb_grpc
from agent.service import access

log = logging.getLogger(__name__)

STATUS_BY_KIND = {
    "not_found": grpc.StatusCode.NOT_FOUND,
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "failed_precondition": grpc.StatusCode.FAILED_PRECONDITION,
    "already_exists": grpc.StatusCode.ALREADY_EXISTS,
    "deadline_exceeded": grpc.StatusCode.DEADLINE_EXCEEDED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "aborted": grpc.StatusCode.ABORTED,
    "internal": grpc.StatusCode.INTERNAL,
    "unauthenticated": grpc.StatusCode.UNAUTHENTICATED,
    "permission_denied": grpc.StatusCode.PERMISSION_DENIED,
}

_PHASES = {
    "prepare": pb.PHASE_PREPARE,
    "dump": pb.PHASE_DUMP,
    "transfer": pb.PHASE_TRANSFER,
    "restore": pb.PHASE_RESTORE,
    "commit": pb.PHASE_COMMIT,
    "abort": pb.PHASE_ABORT,
    "done": pb.PHASE_DONE,
    "pages": pb.PHASE_PAGES,
}
_STATES = {s: getattr(pb, f"JOB_STATE_{s.name}") for s in JobState}

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")
#: How often an agent expires leases and asks about unresolved migrations.
HOUSEKEEPING_S = float(os.environ.get("FERRY_HOUSEKEEPING_S", "5"))


def status_for(err: BaseException) -> tuple[grpc.StatusCode, str]:
    """Every error a user can see, as a status code and one line; never UNKNOWN."""
    if isinstance(err, FerryError):
        return STATUS_BY_KIND.get(err.kind, grpc.StatusCode.INTERNAL), str(err)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(err).__name__}: {err}; see the agent's log"


def _abort_with(context: grpc.ServicerContext, err: BaseException, node: str) -> None:
    if isinstance(err, FerryError):
        err.at(node=node)
    else:
        log.exception("unexpected error")
    code, msg = status_for(err)
    context.abort(code, msg)


def rpc(fn: F) -> F:
    """A unary-answer RPC: the caller is authorized first; every error becomes a status."""

    @functools.wraps(fn)
    def wrapper(self: AgentService, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            access.authorize(context, fn.__name__, self.insecure, self.node)
            return fn(self, request, context)
        except Exception as e:
            _abort_with(context, e, self.node)

    return wrapper  # type: ignore[return-value]


def stream_rpc(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(self: AgentService, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            access.authorize(context, fn.__name__, self.insecure, self.node)
            yield from fn(self, request, context)
        except Exception as e:
            _abort_with(context, e, self.node)

    return wrapper  # type: ignore[return-value]


def job_pb(rec: JobRecord, node: str) -> pb.Job:
    return pb.Job(
        name=rec.name,
        state=_STATES[rec.state],
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
        priority=rec.priority,
        on_degraded=rec.on_degraded,
        gpus=rec.gpus,
        address=rec.address,
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
        state=g.state.value,
        evidence=[
            pb.Evidence(signal=e.signal, severity=e.severity.value, detail=e.detail, since=e.since)
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
            pb.GpuHolder(job=h.job.name, priority=h.job.priority, used_bytes=h.used_bytes) for h in holders
        ],
        held=g.uuid in held,
    )


def event_pb(e: Event) -> pb.Event:
    return pb.Event(time=e.time, kind=e.kind, node=e.node, gpu=e.gpu, job=e.job, message=e.message)


class AgentService(pb_grpc.AgentServicer):
    def __init__(
        self,
        state_dir: Path,
        node: str,
        staging_root: Path,
        criu: Criu | None = None,
        cuda_jobs: CudaJobs | None = None,
        dial: client.Dial | None = None,
        config: AgentConfig | None = None,
    ) -> None:
        self.node = node
        #: How this agent reaches peers: its node certificate, or plaintext on loopback (--insecure).
        self.dial = dial or client.Dial(insecure=True)
        #: Plaintext loopback callers are trusted only when the agent was started with --insecure.
        self.insecure = self.dial.identity is None
        self.agent_id = uuid.uuid4().hex
        self.staging_root = staging_root
        self.criu = criu or Criu(node=node)
        self.config = config or AgentConfig()
        self.cuda = cuda_jobs or default_cuda_jobs(node, self.config.cuda)
        self.registry = JobRegistry(state_dir, node, network=JobNetwork(self.config.network, node))
        self.journal = Journal(state_dir)
        self.targets = TargetMigrations(self.registry, self.criu, staging_root, node, self.cuda, self.journal)
        self.recovery = SourceRecovery(
            self.registry, self.journal, self.cuda.driver, node, lambda a: client.PeerClient(a, self.dial)
        )
        self._moves = 0
        self._moves_lock = threading.Condition()
        self._stopping = threading.Event()
        self.events = EventLog(state_dir, node)
        self.quarantine = Quarantine(state_dir)
        self.healing = SelfHealing(
            node=node,
            registry=self.registry,
            events=self.events,
            quarantine=self.quarantine,
            config=self.config,
            hooks=Hooks(
                inventory=self.cuda.nvml.inventory,
                peer=lambda address: client.PeerClient(address, self.dial),
                migrate=self._auto_migrate,
                spawn=self._spawn,
                suspend=self._suspend,
                resume=self._resume,
                promised=self.targets.promised_gpus,
                agent_id=self.agent_id,
            ),
            state_dir=state_dir,
            health=lambda: self.monitor.snapshot(),
        )
        self.monitor = HealthMonitor(
            nvml_module(), self.config.health, node=node, on_poll=self.healing.on_poll
        )
        self.targets.unavailable_gpus = self.healing.unavailable_gpus

    # -- start and housekeeping ----------------------------------------------------------

    def recover(self) -> None:
        """Before serving: unwind incoming migrations the last run left; then, in the background
        (it asks peers), settle outgoing ones, and keep expiring leases and asking about
        unresolved migrations."""
        for line in self.targets.recover():
            log.warning("recovered incoming migration %s", line)

        def loop() -> None:
            for line in self.recovery.recover():
                log.warning("recovered outgoing migration %s", line)
            while not self._stopping.wait(HOUSEKEEPING_S):
                try:
                    self.targets.expire()
                    self.recovery.poll()
                    self.healing.resume_preempted()
                except Exception:
                    log.exception("housekeeping failed; trying again in %.0f s", HOUSEKEEPING_S)

        threading.Thread(target=loop, name="housekeeping", daemon=True).start()
        threading.Thread(target=self.monitor.run, args=(self._stopping,), name="health", daemon=True).start()

    def stop_housekeeping(self) -> None:
        self._stopping.set()

    # -- bookkeeping for graceful stop -------------------------------------------------

    def _in_flight(self, delta: int) -> None:
        with self._moves_lock:
            self._moves += delta
            self._moves_lock.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        with self._moves_lock:
            return self._moves_lock.wait_for(lambda: self._moves == 0, timeout=timeout_s)

    def _spawn(self, work: Callable[[], None]) -> None:
        """Self-healing's work on its own thread, counted as a move in flight."""

        def run() -> None:
            try:
                work()
            finally:
                self._in_flight(-1)

        self._in_flight(+1)
        try:
            threading.Thread(target=run, name="healing", daemon=True).start()
        except BaseException:
            self._in_flight(-1)
            raise

    def _claimed(self, owner: str, job: str, pick: Callable[[dict[str, str]], tuple[T, Iterable[str]]]) -> T:
        """Run `pick` (GPUs `job` may not take → its result and the GPUs it chose) as one claim for
        `owner`, released by the caller once the job holds its GPUs."""
        out: list[T] = []
        # Read before the claim's lock: it asks NVML, the registry and (under that lock) the leases.
        unavailable = self.healing.unavailable_gpus(job)

        def choose(taken: dict[str, str]) -> Iterable[str]:
            result, gpus = pick({**unavailable, **taken})
            out.append(result)
            return gpus

        self.targets.claim(owner, choose)
        return out[0]

    @staticmethod
    def _by_map(
        choose: Callable[[Mapping[str, str]], dict[str, str]],
    ) -> Callable[[dict[str, str]], tuple[dict[str, str], Iterable[str]]]:
        def pick(taken: dict[str, str]) -> tuple[dict[str, str], Iterable[str]]:
            gpu_map = choose(taken)
            return gpu_map, gpu_map.values()

        return pick

    def _resume(self, rec: JobRecord, _unavailable: Callable[[str], dict[str, str]]) -> JobRecord:
        owner = f"the resume of job {rec.name}"

        def claim(pick: Callable[[Mapping[str, str]], dict[str, str]]) -> dict[str, str]:
            return self._claimed(owner, rec.name, self._by_map(pick))

        self._in_flight(+1)
        try:
            return resume_preempted(self.registry, self.criu, rec, claim, self.node, self.cuda)
        finally:
            self.targets.release(owner)
            self._in_flight(-1)

    def _source_migration(
        self, spec: MigrationSpec, emit: Callable[[Progress], None] = lambda p: None
    ) -> SourceMigration:
        peer = client.PeerClient(spec.target, self.dial)
        return SourceMigration(
            spec,
            self.registry,
            self.criu,
            peer,
            self.staging_root,
            self.node,
            self.agent_id,
            emit,
            cuda_jobs=self.cuda,
        )

    def _auto_migrate(self, job: str, target: str, reason: str, lock_timeout_s: float | None) -> object:
        spec = MigrationSpec(job, target, uuid.uuid4().hex[:16], reason=reason, lock_timeout_s=lock_timeout_s)
        return self._source_migration(spec).run()

    def _suspend(self, job: str, out_dir: Path) -> None:
        checkpoint(self.registry, self.criu, job, out_dir, self.node, False, cuda_jobs=self.cuda)

    def _background(
        self, work: Callable[[Callable[[Progress], None]], MigrationResult]
    ) -> Iterator[pb.ProgressEvent]:
        """Run a move on its own thread so a client that goes away cannot cut it in half."""
        events: queue.Queue[object] = queue.Queue()
        t0 = time.monotonic()

        def run() -> None:
            try:
                events.put(work(events.put))
            except BaseException as e:
                events.put(e)
            finally:
                self._in_flight(-1)

        self._in_flight(+1)
        threading.Thread(target=run, name="move", daemon=True).start()
        while True:
            item = events.get()
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, MigrationResult):
                yield pb.ProgressEvent(
                    phase=pb.PHASE_DONE, elapsed_s=time.monotonic() - t0, result=result_pb(item)
                )
                return
            assert isinstance(item, Progress)
            yield pb.ProgressEvent(
                phase=_PHASES.get(item.phase, pb.PHASE_UNSPECIFIED),
                message=item.message,
                bytes_done=item.bytes_done,
                bytes_total=item.bytes_total,
                elapsed_s=time.monotonic() - t0,
            )

    # -- node --------------------------------------------------------------------------

    @rpc
    def GetInfo(self, request: pb.GetInfoRequest, context: grpc.ServicerContext) -> pb.NodeInfo:
        try:
            criu_version = self.criu.require_usable()
        except FerryError as e:
            criu_version = f"unusable: {e.cause}"
        self.staging_root.mkdir(mode=0o700, parents=True, exist_ok=True)
        return pb.NodeInfo(
            node_name=self.node,
            version=__version__,
            criu_version=criu_version,
            staging_dir=str(self.staging_root),
            staging_free_bytes=shutil.disk_usage(self.staging_root).free,
            agent_id=self.agent_id,
        )

    @rpc
    def ListGpus(self, request: pb.ListGpusRequest, context: grpc.ServicerContext) -> pb.GpuInventory:
        return inventory_pb(self.cuda.nvml.inventory(), self.cuda.driver.probe())

    # -- jobs --------------------------------------------------------------------------

    @rpc
    def Run(self, request: pb.RunRequest, context: grpc.ServicerContext) -> pb.Job:
        check_job_name(request.name)
        priority = request.priority or Priority.NORMAL.value
        on_degraded = request.on_degraded or OnDegraded.MIGRATE.value
        if priority not in {p.value for p in Priority}:
            raise InvalidArgumentError(f"invalid priority {priority!r}: expected normal or low")
        if on_degraded not in {p.value for p in OnDegraded}:
            raise InvalidArgumentError(
                f"invalid on-degraded policy {on_degraded!r}: expected migrate or alert"
            )
        gpus = list(request.gpus)
        if len(set(gpus)) != len(gpus):
            raise InvalidArgumentError(f"--gpu lists a GPU twice: {', '.join(gpus)}")
        owner = f"the start of job {request.name}"
        chip = ""
        if gpus:
            chip = self._claimed(owner, request.name, lambda taken: (self._check_gpus(gpus, taken), gpus))
        try:
            rec = self.registry.launch(
                request.name,
                list(request.command),
                request.cwd or "/",
                list(request.env),
                priority=priority,
                on_degraded=on_degraded,
                gpus=gpus,
                gpu_chip=chip,
            )
        finally:
            self.targets.release(owner)
        return job_pb(rec, self.node)

    def _check_gpus(self, gpus: list[str], unavailable: dict[str, str]) -> str:
        """GPUs for `ferry run --gpu`: present, one chip, and free; returns the chip."""
        inv = self.cuda.nvml.inventory()
        if not inv.available:
            raise RefusedError(f"--gpu needs this node's GPUs, but {inv.detail}", step="run", node=self.node)
        chips = set()
        for u in gpus:
            g = inv.by_uuid(u)
            if g is None:
                known = ", ".join(f"{x.uuid} (index {x.index})" for x in inv.gpus) or "none"
                raise InvalidArgumentError(
                    f"no GPU {u} on {self.node}; its GPUs: {known}", hint="see `ferry gpus`"
                )
            if why := unavailable.get(u):
                raise RefusedError(f"GPU {u} {why}", step="run", node=self.node, hint="see `ferry health`")
            chips.add(g.name)
        if len(chips) > 1:
            raise InvalidArgumentError(
                f"--gpu mixes chips ({', '.join(sorted(chips))}); a job runs on one kind"
            )
        return chips.pop()

    @rpc
    def Adopt(self, request: pb.AdoptRequest, context: grpc.ServicerContext) -> pb.Job:
        check_job_name(request.name)
        return job_pb(self.registry.adopt(request.name, request.pid), self.node)

    @rpc
    def ListJobs(self, request: pb.ListJobsRequest, context: grpc.ServicerContext) -> pb.ListJobsResponse:
        return pb.ListJobsResponse(jobs=[job_pb(r, self.node) for r in self.registry.list()])

    @rpc
    def StopJob(self, request: pb.StopJobRequest, context: grpc.ServicerContext) -> pb.Job:
        timeout = request.timeout_s or 10.0
        if not 0 < timeout <= 3600:  # NaN fails this too
            raise InvalidArgumentError(
                f"invalid stop timeout {request.timeout_s}: expected 0 < seconds <= 3600"
            )
        return job_pb(self.registry.stop(request.name, timeout), self.node)

    @stream_rpc
    def Logs(self, request: pb.LogsRequest, context: grpc.ServicerContext) -> Iterator[pb.LogChunk]:
        rec = self.registry.get(request.name)
        streams = [(pb.LOG_STREAM_STDOUT, rec.stdout_path), (pb.LOG_STREAM_STDERR, rec.stderr_path)]
        if request.stream:
            if request.stream not in (pb.LOG_STREAM_STDOUT, pb.LOG_STREAM_STDERR):
                raise InvalidArgumentError(f"unknown log stream {request.stream}: expected stdout or stderr")
            streams = [s for s in streams if s[0] == request.stream]
        streams = [(k, p) for k, p in streams if p]
        if not streams:
            raise InvalidArgumentError(f"job {rec.name!r} has no log files this agent can read")
        files = []
        try:
            for kind, path in streams:
                files.append((kind, open(path, "rb")))  # noqa: SIM115 - closed below
        except FileNotFoundError as e:
            for _, f in files:
                f.close()
            raise NotFoundError(f"job {rec.name!r}: its log {e.filename} is gone from this node") from e
        try:
            ended = not request.follow
            while context.is_active():
                sent = False
                for kind, f in files:
                    if data := f.read(1 << 16):
                        sent = True
                        yield pb.LogChunk(stream=kind, data=data)
                if sent:
                    continue
                if ended:
                    return
                # One more pass after the job ends drains what it wrote last.
                ended = not self.registry.get(rec.name).state.active
                if not ended:
                    time.sleep(0.1)
        finally:
            for _, f in files:
                f.close()

    # -- moves -------------------------------------------------------------------------

    @stream_rpc
    def Migrate(
        self, request: pb.MigrateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.ProgressEvent]:
        client.split_address(request.target)
        self.registry.get(request.name)  # NOT_FOUND before anything starts
        if request.lazy and request.staged:
            raise InvalidArgumentError("--lazy and --staged exclude each other (post-copy stages nothing)")
        spec = MigrationSpec(
            request.name, request.target, uuid.uuid4().hex[:16], staged=request.staged, lazy=request.lazy
        )
        yield from self._background(lambda emit: self._source_migration(spec, emit).run())

    @stream_rpc
    def Checkpoint(
        self, request: pb.CheckpointRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.ProgressEvent]:
        if not request.out_dir or not os.path.isabs(request.out_dir) or "\0" in request.out_dir:
            raise InvalidArgumentError(f"--out must be an absolute directory path, got {request.out_dir!r}")
        if os.path.exists(request.out_dir) and not os.path.isdir(request.out_dir):
            raise InvalidArgumentError(f"--out {request.out_dir} exists and is not a directory")
        self.registry.get(request.name)
        out = Path(request.out_dir)

        def work(emit: Callable[[Progress], None]) -> MigrationResult:
            return checkpoint(
                self.registry,
                self.criu,
                request.name,
                out,
                self.node,
                request.leave_running,
                emit,
                cuda_jobs=self.cuda,
            )

        yield from self._background(work)

    @rpc
    def Restore(self, request: pb.RestoreRequest, context: grpc.ServicerContext) -> pb.Job:
        if not os.path.isabs(request.image_dir):
            raise InvalidArgumentError(f"image directory must be an absolute path, got {request.image_dir!r}")
        if request.name:
            check_job_name(request.name)
        image_dir = Path(request.image_dir)
        name = request.name or (read_manifest(image_dir).job.name if image_dir.is_dir() else "")
        owner = f"the restore of job {name or image_dir}"
        try:
            rec = restore_image(
                self.registry,
                self.criu,
                image_dir,
                request.name,
                self.node,
                self.cuda,
                claim=lambda pick: self._claimed(owner, name, self._by_map(pick)),
            )
        finally:
            self.targets.release(owner)
        return job_pb(rec, self.node)

    @rpc
    def Resolve(self, request: pb.ResolveRequest, context: grpc.ServicerContext) -> pb.Job:
        check_job_name(request.name)
        if request.action not in ("", "resume", "finish"):
            raise InvalidArgumentError(f"unknown action {request.action!r}: expected resume or finish")
        self.recovery.resolve(request.name, request.action)
        return job_pb(self.registry.get(request.name), self.node)

    # -- peer protocol -----------------------------------------------------------------

    def _peer_name(self, context: grpc.ServicerContext) -> str:
        """The calling node's certificate name ("" on the insecure loopback)."""
        return access.identify(context, self.insecure).name

    @rpc
    def Prepare(self, request: pb.PrepareRequest, context: grpc.ServicerContext) -> pb.Lease:
        return self.targets.prepare(request, self._peer_name(context))

    @stream_rpc
    def StreamPages(
        self, request_iterator: Iterator[pb.PageData], context: grpc.ServicerContext
    ) -> Iterator[pb.PageData]:
        yield from self.targets.stream_pages(request_iterator, self._peer_name(context))

    @rpc
    def PushImage(
        self, request_iterator: Iterator[pb.ImageChunk], context: grpc.ServicerContext
    ) -> pb.PushImageResponse:
        return self.targets.push(request_iterator, self._peer_name(context))

    @rpc
    def Commit(self, request: pb.CommitRequest, context: grpc.ServicerContext) -> pb.CommitResponse:
        return self.targets.commit(request, self._peer_name(context))

    @rpc
    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        self.targets.abort(request.migration_id, request.reason, self._peer_name(context))
        return pb.AbortResponse()

    @rpc
    def GetMigration(
        self, request: pb.GetMigrationRequest, context: grpc.ServicerContext
    ) -> pb.MigrationStatus:
        state = self.targets.status(request.migration_id, self._peer_name(context))
        return pb.MigrationStatus(migration_id=request.migration_id, state=state)

    # -- self-healing ------------------------------------------------------------------

    @rpc
    def GetHealth(self, request: pb.GetHealthRequest, context: grpc.ServicerContext) -> pb.HealthReport:
        holders = self.healing.jobs_by_gpu()
        held = self.healing.held()
        return pb.HealthReport(
            node_name=self.node,
            nvml_available=self.monitor.available,
            nvml_detail=self.monitor.detail,
            gpus=[
                health_pb(g, holders.get(g.uuid, []), self.quarantine, held) for g in self.monitor.snapshot()
            ],
            agent_id=self.agent_id,
            interval_s=self.config.health.interval_s,
        )

    @stream_rpc
    def Events(self, request: pb.EventsRequest, context: grpc.ServicerContext) -> Iterator[pb.Event]:
        limit = request.limit or 50
        if not request.follow:
            yield from (event_pb(e) for e in self.events.recent(limit))
            return
        for e in self.events.follow(limit, alive=lambda: context.is_active() and not self._stopping.is_set()):
            yield event_pb(e)

    @rpc
    def ClearGpu(self, request: pb.ClearGpuRequest, context: grpc.ServicerContext) -> pb.GpuHealth:
        g = self.monitor.get(request.uuid)
        entry = self.quarantine.clear(request.uuid)
        if g is None and entry is None:
            known = ", ".join(x.uuid for x in self.monitor.snapshot()) or "none"
            raise NotFoundError(f"no GPU {request.uuid!r} here; its GPUs: {known}", hint="see `ferry health`")
        self.monitor.clear(request.uuid)
        self.healing.cleared(request.uuid)
        self.monitor.poll()  # the answer shows the GPU as read after the clear
        was = (
            f"quarantined since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(entry.since))}"
            if entry
            else "not quarantined"
        )
        self.events.record(
            "quarantine", f"GPU {request.uuid} cleared by an operator ({was})", gpu=request.uuid
        )
        g = self.monitor.get(request.uuid) or g
        if g is None:  # quarantined, but NVML no longer lists it
            return pb.GpuHealth(uuid=request.uuid)
        return health_pb(g, self.healing.jobs_by_gpu().get(g.uuid, []), self.quarantine, self.healing.held())

    @rpc
    def Preempt(self, request: pb.PreemptRequest, context: grpc.ServicerContext) -> pb.PreemptResponse:
        check_job_name(request.job)
        caller = self._peer_name(context)
        if caller and request.source_node != caller:
            raise PermissionDeniedError(
                f"node {caller!r} may not preempt a job on behalf of {request.source_node!r}", step="preempt"
            )
        return self.healing.preempt(request)


def check_listen(address: str, insecure: bool, identity: tls.Identity | None) -> None:
    host, _ = client.split_address(address, listen=True)
    if insecure and identity is not None:
        raise InvalidArgumentError("--insecure and --tls-dir exclude each other: serve TLS or plaintext")
    if insecure and not client.is_loopback(host):
        raise InvalidArgumentError(f"--insecure serves plaintext only on loopback, not on {host}")
    if not insecure and identity is None:
        raise InvalidArgumentError(
            "serving on TCP needs this node's certificate (--tls-dir), or --insecure on loopback"
        )


def create_server(
    address: str,
    service: AgentService,
    max_workers: int = 32,
    identity: tls.Identity | None = None,
    socket_path: Path | None = None,
) -> tuple[grpc.Server, int]:
    """Bind the agent, health and reflection services; port 0 picks a free port.

    TCP is mutual TLS with `identity`, else plaintext; `socket_path` adds the local
    root-only unix socket.
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"),
        options=client.SERVER_OPTIONS,
    )
    pb_grpc.add_AgentServicer_to_server(service, server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("ferry.v1.Agent", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (
        pb.DESCRIPTOR.services_by_name["Agent"].full_name,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(names, server)
    if identity is not None:
        port = server.add_secure_port(address, identity.server_credentials())
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise InvalidArgumentError(f"cannot listen on {address} (in use or not a local address)")
    if socket_path is not None:
        bind_local_socket(server, socket_path)
    return server, port


def bind_local_socket(server: grpc.Server, path: Path) -> None:
    """The local CLI's way in: a socket only root can open, in a directory only root can enter."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.is_socket():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # a previous agent's, left by a crash
        else:
            raise InvalidArgumentError(
                f"another agent serves on {path}", hint="give each agent on a host its own --socket"
            )
        finally:
            probe.close()
    elif path.exists() or path.is_symlink():
        raise InvalidArgumentError(f"--socket {path} exists and is not a socket; remove it or pick another")
    old = os.umask(0o177)
    try:
        if not server.add_insecure_port(f"unix:{path}"):
            raise InvalidArgumentError(f"cannot listen on unix socket {path}")
    finally:
        os.umask(old)
    os.chmod(path, 0o600)


def serve(
    address: str,
    state_dir: Path,
    node: str,
    staging_root: Path,
    insecure: bool,
    identity: tls.Identity | None = None,
    socket_path: Path | None = None,
    config: AgentConfig | None = None,
) -> None:
    """Run until SIGTERM/SIGINT; in-flight moves finish (or abort) before the agent exits."""
    check_listen(address, insecure, identity)
    if identity is not None and identity.name != node:
        raise InvalidArgumentError(
            f"this node is {node!r} but its certificate names {identity.name!r}; peers check that they match",
            hint=f"pass --node-name {identity.name}, or issue a certificate for {node}",
        )
    private_dir(staging_root, node)  # refuse a planted or shared staging dir before serving
    service = AgentService(state_dir, node, staging_root, dial=client.Dial(identity, insecure), config=config)
    server, port = create_server(address, service, identity=identity, socket_path=socket_path)
    service.recover()
    server.start()
    host, _ = client.split_address(address, listen=True)
    mode = f"mutual TLS as {identity.name}" if identity else "plaintext (--insecure)"
    log.info(
        "ferry agent %s (node %s) listening on %s:%d (%s), state in %s",
        __version__,
        node,
        host,
        port,
        mode,
        state_dir,
    )
    if socket_path is not None:
        log.info("local socket %s (root only)", socket_path)
    cfg = service.config
    spares = sum(p.spare for p in cfg.peers)
    log.info(
        "self-healing: %d peer(s) (%d spare) from %s; health every %g s",
        len(cfg.peers),
        spares,
        cfg.path or "no --config",
        cfg.health.interval_s,
    )
    print(f"ferry agent: node {node} listening on {host}:{port}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    service.healing.draining.set()  # no new automatic move or resume from here on
    log.info("stopping: waiting for in-flight migrations")
    if not service.wait_idle(timeout_s=600):
        log.warning("in-flight migrations did not finish in 600 s; stopping anyway")
    service.stop_housekeeping()
    server.stop(grace=10).wait()
    if socket_path is not None:
        socket_path.unlink(missing_ok=True)
    log.info("stopped")
