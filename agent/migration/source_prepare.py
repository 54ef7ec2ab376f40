"""The Prepare step of an outgoing migration: before anything freezes, check the job and this
node, choose the method, ask the target for a lease; and, on a refusal, give that lease back.

`PrepareStep` is a part of `SourceMigration` (agent.migration.source), whose `run()` keeps the
order of the steps. Prepare journals no state of its own (the migration is `preparing`
throughout); it only records the one-time key's directory, so whoever settles the move removes it.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from agent import faults
from agent.criu.dumpable import refuse_node_sockets, refuse_undumpable
from agent.criu.runner import Criu
from agent.cuda.jobs import CudaJobs, Footprint
from agent.errors import (
    FerryError,
    InvalidArgumentError,
    NotFoundError,
    RefusedError,
    UnauthenticatedError,
)
from agent.jobs import procs
from agent.jobs.network import LinkLock
from agent.jobs.record import JobKind, JobRecord
from agent.jobs.registry import JobRegistry
from agent.migration.capture import estimated_bytes, require_host_memory
from agent.migration.chainmove import ChainTip, MoveChains
from agent.migration.datapath import SourceDataPath
from agent.migration.limits import RateLog, refuse_long_pause
from agent.migration.model import Emit, Method, MigrationResult, MigrationSpec, Peer, Progress
from agent.migration.probe import PathCheck
from agent.rpc import pb

log = logging.getLogger(__name__)


class PrepareStep:
    """Prepare for a `SourceMigration`. The attributes are the migration's own (its constructor
    sets them); what Prepare learns (the target's node, the link, the footprint, the method, the
    lease, whether the memory goes direct) it writes there for the steps after it."""

    spec: MigrationSpec
    registry: JobRegistry
    criu: Criu
    peer: Peer
    cuda: CudaJobs
    node: str
    agent_id: str
    result: MigrationResult
    footprint: Footprint
    link: LinkLock
    rates: RateLog
    data: SourceDataPath
    lease: pb.Lease
    prepare_sent: bool
    direct: bool
    estimated_bytes: int
    path_check: PathCheck | None
    emit: Emit
    chains: MoveChains | None
    chain: ChainTip | None

    if TYPE_CHECKING:  # SourceMigration's, which this is part of

        def _journal(self, **changes: object) -> None: ...

    def _choose_method(self, info: pb.NodeInfo) -> None:
        """Post-copy by default where both nodes can serve it, else pre-copy; the result says
        which ran and, for a fallback, why."""
        if not self.spec.fallback:
            self.result.method = str(self.spec.method)
            return
        why = ""
        if self.footprint.processes:
            # The CUDA restore reads all of the host copy at once, through the target's page faults;
            # no GPU has run that yet (docs/gpu.md), so a CUDA job moves the way that has.
            why = "a CUDA job's post-copy has not run on a GPU yet"
        elif here := self.criu.lazy_dump_blocker():
            why = f"{self.node} cannot serve it: {here}"
        elif not info.post_copy:
            why = (
                f"target {info.node_name or self.spec.target} cannot restore lazily (its kernel "
                "lacks non-cooperative userfaultfd, or its agent is older)"
            )
        if not why:
            self.result.method = str(self.spec.method)
            return
        self.spec = replace(self.spec, lazy=False)
        self.result.method = f"{Method.PRE_COPY} (post-copy unavailable: {why})"
        log.info("migration %s: %s", self.spec.migration_id, self.result.method)

    def _prepare(self, rec: JobRecord) -> None:
        if self.spec.lazy and not self.spec.fallback and (why := self.criu.lazy_dump_blocker()):
            raise RefusedError(
                f"cannot serve post-copy from {self.node}: {why}", hint="or migrate with --pre-copy"
            )
        try:
            info = self.peer.info()
        except UnauthenticatedError:
            raise  # a certificate problem, not an unreachable agent
        except FerryError as e:
            raise RefusedError(
                f"target agent {self.spec.target} is unreachable: {e.cause}",
                hint="check the address and that `ferry agent` runs there",
            ) from e
        if info.agent_id == self.agent_id:
            raise InvalidArgumentError(f"{self.spec.target} is this agent; migrate to another node")
        self.result.target_node = info.node_name
        faults.check("prepare", self.node)
        pids = procs.tree_pids(rec.pid)
        if not pids:
            raise NotFoundError(f"job {rec.name!r} has no running process (pid {rec.pid})")
        refuse_undumpable(pids, self.node)  # what CRIU would fail on half-way through the dump
        if not rec.address:
            refuse_node_sockets(pids, self.node)  # the node's addresses stay here
        self.link = LinkLock(self.registry.network, rec.veth, address=rec.address)
        if rec.veth and self.registry.network is None:
            raise RefusedError(
                f"job {rec.name!r} has a job-network address ({rec.address}) but this agent has no [network]",
                hint="start the agent with the [network] it had when the job started",
            )
        # Before anything is frozen: what CUDA state there is, and whether the driver can take it.
        self.footprint = self.cuda.inspect(pids)
        require_host_memory(self.footprint, self.node)
        self._choose_method(info)
        own = {rec.stdout_path, rec.stderr_path} if rec.kind is JobKind.LAUNCHED else set()
        self.estimated_bytes = estimated_bytes(rec, self.footprint)
        # A member of a distributed job: its peers wait only so long (agent.migration.limits).
        refuse_long_pause(rec, self.estimated_bytes, self.rates, self.node)
        if self.path_check is not None:
            target = info.node_name or self.spec.target
            rate = self.path_check(self.spec.target, target, rec.name, self.estimated_bytes)
            if rate is not None:
                self.result.path_mbps = rate.mbps
                said = f"the path to {target} carries {rate.mbps:.0f} MB/s"
                log.info("migration %s: %s", self.spec.migration_id, said)
                self.emit(Progress("prepare", said))
        req = pb.PrepareRequest(
            migration_id=self.spec.migration_id,
            job=rec.name,
            source_node=self.node,
            kind=pb.JOB_KIND_ADOPTED if rec.kind is JobKind.ADOPTED else pb.JOB_KIND_LAUNCHED,
            # The checkpoint copies device memory into the job's host memory: the image holds both.
            estimated_bytes=self.estimated_bytes,
            paths=sorted(procs.open_paths(rec.pid) - own),
            pids=pids if rec.kind is JobKind.ADOPTED else [],
            cwd=rec.cwd,
            gpus=gpu_needs(rec, self.footprint),
            cuda_driver=self.footprint.driver_version,
            lazy=self.spec.lazy,
            reason=self.spec.reason,
            address=rec.address,
            data_cert=self.data.cert,
        )
        tip = self._chain_tip(rec)
        if tip is not None:
            req.chain.CopyFrom(tip.base())
        self.prepare_sent = True  # from here the target may hold a lease, answered or not
        lease = self.lease = self.peer.prepare(req)
        if lease.chain:
            if tip is None:
                raise RefusedError(f"target {self.spec.target} granted an increment this node did not offer")
            self.chain = tip
            self.spec = replace(self.spec, lazy=False)
            self.result.method = (
                f"{Method.PRE_COPY}: an increment over its snapshot image of round {tip.epoch}, "
                f"which {info.node_name or self.spec.target} keeps"
            )
            log.info("migration %s: %s", self.spec.migration_id, self.result.method)
        self.direct = not self.spec.staged and self.data.accept(lease)
        if self.data.tls is not None:  # whoever settles this move removes it (recovery too)
            self._journal(keys=str(self.data.tls.dir))
        if self.spec.lazy and not (lease.lazy and self.direct):
            raise RefusedError(
                f"target {self.spec.target} does not offer post-copy",
                hint="upgrade the target agent, or migrate with --pre-copy",
            )
        if unmapped := sorted({g.uuid for g in self.footprint.gpus} - {p.old_uuid for p in lease.gpu_map}):
            raise RefusedError(
                f"target {self.spec.target} leased no GPU for {', '.join(unmapped)}",
                hint="upgrade the target agent: it does not move CUDA jobs",
            )

    def _chain_tip(self, rec: JobRecord) -> ChainTip | None:
        """The snapshot image this move may go as an increment over (agent.migration.chainmove):
        a protected member's, moved by default or pre-copy (post-copy asked for is post-copy)."""
        if self.chains is None or self.footprint.processes or self.spec.staged:
            return None
        if self.spec.lazy and not self.spec.fallback:
            return None
        return self.chains.move_tip(rec) if rec.group else None

    def _release_lease(self, err: FerryError) -> None:
        """A refusal after the target granted its lease: the target frees its slot, staging and
        GPUs at once (not when the lease runs out), and our one-time key goes."""
        self.data.close()
        if not self.prepare_sent:
            return
        try:
            self.peer.abort(self.spec.migration_id, f"the source refused after the lease: {err.cause}")
        except FerryError as e:  # nothing froze: its lease still runs out on its own
            log.warning("migration %s: could not release the target's lease: %s", self.spec.migration_id, e)


def gpu_needs(rec: JobRecord, fp: Footprint) -> list[pb.GpuNeed]:
    """What the target must offer: the GPUs the job's CUDA processes hold, and those `ferry run
    --gpu` gave it (a job keeps its GPUs to itself, even before or without a CUDA context)."""
    out = [pb.GpuNeed(uuid=g.uuid, name=g.name, memory_bytes=g.memory_bytes) for g in fp.gpus]
    seen = {g.uuid for g in fp.gpus}
    out += [pb.GpuNeed(uuid=u, name=rec.gpu_chip, memory_bytes=0) for u in rec.gpus if u not in seen]
    return out
