"""The agent's gRPC service: RPC methods only. Each authorizes (agent.service.status), calls the
agent (agent.service.node) and converts (agent.service.convert); errors become status codes."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc

from agent.client import split_address
from agent.errors import InvalidArgumentError, NotFoundError, PermissionDeniedError, UnavailableError
from agent.jobs.logs import STDERR, STDOUT, read_logs
from agent.jobs.record import check_group_name, check_job_name
from agent.migration.model import MigrationResult, Progress
from agent.migration.probe import receive_probe
from agent.rpc import pb, pb_grpc
from agent.service import access
from agent.service.convert import (
    event_pb,
    health_pb,
    info_pb,
    inventory_pb,
    job_pb,
    lost_pb,
    method_of,
    peer_wait_pb,
    progress_pb,
    result_pb,
)
from agent.service.follow import FollowSlots
from agent.service.node import AgentNode
from agent.service.status import rpc, stream_rpc
from agent.snapshots.restores import image_chunks
from agent.wire import DEGRADED_POLICIES, PRIORITIES, RESOLUTIONS

_STREAMS = {pb.LOG_STREAM_STDOUT: STDOUT, pb.LOG_STREAM_STDERR: STDERR}
_STREAM_PB = {v: k for k, v in _STREAMS.items()}


class AgentService(pb_grpc.AgentServicer):
    def __init__(self, agent: AgentNode, follow: FollowSlots | None = None) -> None:
        self.agent = agent
        self.node = agent.node
        #: Plaintext loopback callers are trusted only when the agent was started with --insecure.
        self.insecure = agent.insecure
        self.follow = follow or FollowSlots()

    def _moves(self, items: Iterator[Progress | MigrationResult]) -> Iterator[pb.ProgressEvent]:
        t0 = time.monotonic()
        # Counted until gRPC has taken the last message (or the caller left): a graceful stop
        # that waited only for the move itself cut the stream before its result went out.
        with self.agent.counted():
            for item in items:
                if isinstance(item, MigrationResult):
                    yield pb.ProgressEvent(
                        phase=pb.PHASE_DONE, elapsed_s=time.monotonic() - t0, result=result_pb(item)
                    )
                else:
                    yield progress_pb(item, time.monotonic() - t0)

    def _peer_name(self, context: grpc.ServicerContext) -> str:
        """The calling node's certificate name ("" on the insecure loopback)."""
        return access.identify(context, self.insecure).name

    # -- node --------------------------------------------------------------------------

    @rpc
    def GetInfo(self, request: pb.GetInfoRequest, context: grpc.ServicerContext) -> pb.NodeInfo:
        return info_pb(self.agent.info())

    @rpc
    def ListGpus(self, request: pb.ListGpusRequest, context: grpc.ServicerContext) -> pb.GpuInventory:
        cuda = self.agent.cuda
        return inventory_pb(cuda.nvml.inventory(), cuda.driver.probe())

    # -- jobs --------------------------------------------------------------------------

    @rpc
    def Run(self, request: pb.RunRequest, context: grpc.ServicerContext) -> pb.Job:
        rec = self.agent.run_job(
            request.name,
            list(request.command),
            request.cwd,
            list(request.env),
            PRIORITIES.py(request.priority_class),
            DEGRADED_POLICIES.py(request.degraded_policy),
            list(request.gpus),
            request.group,
            request.max_pause_s,
            request.protect_every_s,
        )
        return job_pb(rec, self.node)

    @rpc
    def Adopt(self, request: pb.AdoptRequest, context: grpc.ServicerContext) -> pb.Job:
        check_job_name(request.name)
        return job_pb(self.agent.registry.adopt(request.name, request.pid), self.node)

    @rpc
    def ListJobs(self, request: pb.ListJobsRequest, context: grpc.ServicerContext) -> pb.ListJobsResponse:
        live = self.agent.liveness
        lost = [lost_pb(m, self.node) for m in live.lost.values()] if live is not None else []
        return pb.ListJobsResponse(jobs=[job_pb(r, self.node) for r in self.agent.registry.list()], lost=lost)

    @rpc
    def StopJob(self, request: pb.StopJobRequest, context: grpc.ServicerContext) -> pb.Job:
        return job_pb(self.agent.registry.stop(request.name, _grace(request.timeout_s)), self.node)

    @rpc
    def ForgetJob(self, request: pb.ForgetJobRequest, context: grpc.ServicerContext) -> pb.Job:
        return job_pb(self.agent.registry.forget(request.name), self.node)

    @stream_rpc
    def Logs(self, request: pb.LogsRequest, context: grpc.ServicerContext) -> Iterator[pb.LogChunk]:
        registry = self.agent.registry
        rec = registry.get(request.name)
        if request.stream and request.stream not in _STREAMS:
            raise InvalidArgumentError(f"unknown log stream {request.stream}: expected stdout or stderr")
        streams = [_STREAMS[request.stream]] if request.stream else [STDOUT, STDERR]

        stopping = self.agent.stopping

        def chunks() -> Iterator[pb.LogChunk]:
            active = lambda: registry.get(rec.name).state.active  # noqa: E731
            alive = lambda: context.is_active() and not stopping.is_set()  # noqa: E731
            for kind, data in read_logs(rec, streams, request.follow, active, alive):
                yield pb.LogChunk(stream=_STREAM_PB[kind], data=data)
            if stopping.is_set() and active():
                # Ended for the agent's stop, not the job's end: a follower must not mistake it
                # for one, nor hold the agent's graceful stop for its grace.
                raise UnavailableError(
                    f"the agent on {self.node} is stopping; job {rec.name} goes on",
                    hint="follow it again once the agent is back",
                )

        if not request.follow:
            yield from chunks()
            return
        with self.follow.slot(f"following the logs of job {rec.name}", self.node):
            yield from chunks()

    # -- moves -------------------------------------------------------------------------

    @stream_rpc
    def Migrate(
        self, request: pb.MigrateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.ProgressEvent]:
        yield from self._moves(self.agent.migrate(request.name, request.target, method_of(request)))

    @stream_rpc
    def Checkpoint(
        self, request: pb.CheckpointRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.ProgressEvent]:
        yield from self._moves(self.agent.checkpoint(request.name, request.out_dir, request.leave_running))

    @rpc
    def Restore(self, request: pb.RestoreRequest, context: grpc.ServicerContext) -> pb.Job:
        return job_pb(self.agent.restore(request.image_dir, request.name, request.as_copy), self.node)

    @rpc
    def Resolve(self, request: pb.ResolveRequest, context: grpc.ServicerContext) -> pb.Job:
        return job_pb(self.agent.resolve(request.name, RESOLUTIONS.py(request.resolution)), self.node)

    # -- peer protocol -----------------------------------------------------------------

    @rpc
    def Prepare(self, request: pb.PrepareRequest, context: grpc.ServicerContext) -> pb.Lease:
        return self.agent.targets.prepare(request, self._peer_name(context))

    @stream_rpc
    def StreamPages(
        self, request_iterator: Iterator[pb.PageData], context: grpc.ServicerContext
    ) -> Iterator[pb.PageData]:
        yield from self.agent.targets.stream_pages(request_iterator, self._peer_name(context))

    @rpc
    def PushImage(
        self, request_iterator: Iterator[pb.ImageChunk], context: grpc.ServicerContext
    ) -> pb.PushImageResponse:
        return self.agent.targets.push(request_iterator, self._peer_name(context))

    @rpc
    def Commit(self, request: pb.CommitRequest, context: grpc.ServicerContext) -> pb.CommitResponse:
        with self.agent.counted():  # a graceful stop waits for the restore under it
            return self.agent.targets.commit(request, self._peer_name(context))

    @rpc
    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        self.agent.targets.abort(request.migration_id, request.reason, self._peer_name(context))
        return pb.AbortResponse()

    @rpc
    def GetMigration(
        self, request: pb.GetMigrationRequest, context: grpc.ServicerContext
    ) -> pb.MigrationStatus:
        caller = self._peer_name(context)
        state = self.agent.targets.status(request.migration_id, caller)
        status = pb.MigrationStatus(migration_id=request.migration_id, state=state)
        if request.peer_wait_s > 0:  # the source of a group member's move, once it committed
            waited = self.agent.targets.peer_wait(request.migration_id, request.peer_wait_s, caller)
            status.peer_wait.CopyFrom(peer_wait_pb(waited))
        return status

    @rpc
    def StopMoved(self, request: pb.StopMovedRequest, context: grpc.ServicerContext) -> pb.Job:
        name = self.agent.targets.moved_here(request.migration_id, self._peer_name(context))
        return job_pb(self.agent.registry.stop_later(name, _grace(request.timeout_s)), self.node)

    # -- self-healing ------------------------------------------------------------------

    @rpc
    def GetHealth(self, request: pb.GetHealthRequest, context: grpc.ServicerContext) -> pb.HealthReport:
        a = self.agent
        holders = a.healing.jobs_by_gpu()
        held = set(a.gpus.held_for())
        verdicts = a.verifier.verdicts()
        return pb.HealthReport(
            node_name=self.node,
            nvml_available=a.monitor.available,
            nvml_detail=a.monitor.detail,
            gpus=[
                health_pb(g, holders.get(g.uuid, []), a.quarantine, held, verdicts)
                for g in a.monitor.snapshot()
            ],
            agent_id=a.agent_id,
            interval_s=a.config.health.interval_s,
            groups=sorted({r.group for r in a.registry.list() if r.group and r.state.active}),
        )

    @rpc
    def GetPace(self, request: pb.GetPaceRequest, context: grpc.ServicerContext) -> pb.GroupPace:
        check_group_name(request.group)
        return self.agent.stragglers.group_pace(request.group, request.whole_group)

    @stream_rpc
    def Events(self, request: pb.EventsRequest, context: grpc.ServicerContext) -> Iterator[pb.Event]:
        limit = request.limit or 50
        events = self.agent.events
        if not request.follow:
            yield from (event_pb(e) for e in events.recent(limit))
            return
        with self.follow.slot("following the events", self.node):
            alive = lambda: context.is_active() and not self.agent.stopping.is_set()  # noqa: E731
            for e in events.follow(limit, alive=alive):
                yield event_pb(e)

    @rpc
    def ClearGpu(self, request: pb.ClearGpuRequest, context: grpc.ServicerContext) -> pb.GpuHealth:
        g, _ = self.agent.clear_gpu(request.uuid)
        if g is None:  # quarantined, but NVML no longer lists it
            return pb.GpuHealth(uuid=request.uuid)
        a = self.agent
        return health_pb(g, a.healing.jobs_by_gpu().get(g.uuid, []), a.quarantine, set(a.gpus.held_for()))

    @rpc
    def Preempt(self, request: pb.PreemptRequest, context: grpc.ServicerContext) -> pb.PreemptResponse:
        check_job_name(request.job)
        caller = self._peer_name(context)
        if caller and request.source_node != caller:
            raise PermissionDeniedError(
                f"node {caller!r} may not preempt a job on behalf of {request.source_node!r}", step="preempt"
            )
        with self.agent.counted():  # a graceful stop waits for the suspend
            return self.agent.healing.preempt(request)

    # -- group snapshots ---------------------------------------------------------------

    @rpc
    def Protect(self, request: pb.ProtectRequest, context: grpc.ServicerContext) -> pb.Protection:
        for a in request.agents:
            split_address(a)
        return self.agent.protections.protect(request.group, request.every_s, list(request.agents)).pb()

    @rpc
    def TakeSnapshot(self, request: pb.TakeSnapshotRequest, context: grpc.ServicerContext) -> pb.Protection:
        with self.agent.counted():
            return self.agent.protections.take(request.group).pb()

    @rpc
    def ListProtections(
        self, request: pb.ListProtectionsRequest, context: grpc.ServicerContext
    ) -> pb.ListProtectionsResponse:
        found = self.agent.protections.list(request.group)
        return pb.ListProtectionsResponse(protections=[p.pb() for p in found])

    @rpc
    def SnapshotMember(
        self, request: pb.SnapshotMemberRequest, context: grpc.ServicerContext
    ) -> pb.SnapshotMemberResponse:
        check_group_name(request.group)
        return self.agent.snapshot_member(request)

    @stream_rpc
    def FetchSnapshot(
        self, request: pb.SnapshotKey, context: grpc.ServicerContext
    ) -> Iterator[pb.ImageChunk]:
        d = self.agent.snapshot_store.image_dir(request.group, request.epoch, request.job)
        if not d.is_dir():
            raise NotFoundError(f"this node keeps no image of job {request.job} for round {request.epoch}")
        yield from image_chunks(d, request)

    @rpc
    def Rollback(self, request: pb.RollbackRequest, context: grpc.ServicerContext) -> pb.RollbackResult:
        with self.agent.counted():
            return self.agent.protections.rollback(request.group)

    @rpc
    def StoreSnapshot(
        self, request_iterator: Iterator[pb.ImageChunk], context: grpc.ServicerContext
    ) -> pb.StoredSnapshot:
        return self.agent.snapshot_store.receive(request_iterator)

    @rpc
    def ProbePath(
        self, request_iterator: Iterator[pb.ProbeChunk], context: grpc.ServicerContext
    ) -> pb.ProbeResult:
        return receive_probe(request_iterator, self.node)


def _grace(timeout_s: float) -> float:
    """A stop's grace between SIGTERM and SIGKILL (10 s when not given)."""
    timeout = timeout_s or 10.0
    if not 0 < timeout <= 3600:  # NaN fails this too
        raise InvalidArgumentError(f"invalid stop timeout {timeout_s}: expected 0 < seconds <= 3600")
    return timeout
