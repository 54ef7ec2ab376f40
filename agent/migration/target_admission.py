"""Whether a target takes an incoming migration: the request's checks, its GPUs (held in the
ledger), its staging and the one-time keys of its data connection.

Everything that may be slow (NVML, the driver, the registry, writing keys) runs before the
protocol lock; under it only the last check that must see every other lease at once
(`admit_locked`: a slot, and staging that no other lease was promised).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

import psutil

from agent import faults
from agent.criu.runner import Criu
from agent.cuda.jobs import CudaJobs
from agent.errors import FerryError, InvalidArgumentError, NotFoundError, PermissionDeniedError, RefusedError
from agent.gpus.inventory import GpuNeed
from agent.gpus.ledger import GpuLedger
from agent.jobs.network import carrying
from agent.jobs.registry import JobRegistry
from agent.migration.chainmove import ChainLoan, same_filesystem
from agent.migration.datatls import DataIdentity, DataTls, check_peer_cert
from agent.migration.staging import private_dir
from agent.migration.states import TargetState
from agent.migration.target_table import Incoming
from agent.rpc import pb

log = logging.getLogger(__name__)

LEASE_S = 600.0
MAX_INCOMING = 2
#: Staging must hold the estimate plus this share (page-aligned files, logs, the manifest).
STAGING_SLACK = 1.2


def safe_id(mid: str) -> str:
    """A migration id names files here: 1-64 letters, digits and '-'."""
    if not mid or not mid.isascii() or not mid.replace("-", "").isalnum() or len(mid) > 64:
        raise InvalidArgumentError(f"invalid migration id {mid!r}: 1-64 letters, digits and '-'")
    return mid


class Admission:
    """The target's checks of a Prepare, and what a granted lease holds."""

    def __init__(
        self,
        registry: JobRegistry,
        criu: Criu,
        cuda: CudaJobs,
        ledger: GpuLedger,
        staging_root: Path,
        node: str,
    ) -> None:
        self.registry = registry
        self.criu = criu
        self.cuda = cuda
        self.ledger = ledger
        self.staging_root = staging_root
        self.node = node
        #: kept(group, round, job, image id, source node) → the image this node's snapshot store
        #: keeps, dumped on that node, or a NotFoundError saying why not
        #: (agent.snapshots.store.SnapshotStore.kept); the agent sets it.
        self.kept: Callable[[str, int, str, str, str], Path] = _keeps_nothing

    def lease(self, req: pb.PrepareRequest, caller: str) -> Incoming:
        """Check the request against this node; the migration it would be, its GPUs claimed in
        the ledger (the caller releases `lease_owner` if it does not grant the lease)."""
        if not req.migration_id or not req.job or not req.source_node:
            raise InvalidArgumentError(
                "prepare needs a migration id, a job name and the source node", node=self.node
            )
        safe_id(req.migration_id)
        if caller and req.source_node != caller:
            log.warning("refused Prepare: node %r claimed to be %r", caller, req.source_node)
            raise PermissionDeniedError(
                f"node {caller!r} may not prepare a migration on behalf of {req.source_node!r}",
                step="prepare",
                node=self.node,
            )
        faults.check("target-prepare", self.node)
        self.registry.reserve_name(req.job)
        self.criu.require_usable()
        private_dir(self.staging_root, self.node)
        if relative := [p for p in [req.cwd, *req.paths] if p and not os.path.isabs(p)]:
            raise InvalidArgumentError(
                f"paths must be absolute, got {relative[0]!r}", step="prepare", node=self.node
            )
        if bad_pids := [p for p in req.pids if p <= 1]:
            raise InvalidArgumentError(
                f"invalid PID {bad_pids[0]} for an adopted job", step="prepare", node=self.node
            )
        if req.cwd and not os.path.isdir(req.cwd):
            raise self.refuse(f"the job's working directory {req.cwd} does not exist here")
        if missing := [p for p in req.paths if not os.path.exists(p)]:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise self.refuse(f"files the job uses are missing here: {shown}", "put them on shared storage")
        if req.address:
            self._require_job_network(req.address)
        if taken := [p for p in req.pids if psutil.pid_exists(p)]:
            raise self.refuse(
                f"the adopted job keeps host PIDs, and PIDs {taken[:5]} are in use here",
                "choose a target where they are free, or run jobs with `ferry run` (own PID namespace)",
            )
        chain = self._chain(req)
        lazy = req.lazy and chain is None  # a chain move's increment comes staged
        if req.data_cert:
            check_peer_cert(req.data_cert, f"source {req.source_node}")
        elif lazy:
            raise self.refuse("post-copy needs a data connection, and the source offered none")
        if lazy and not self.criu.feature("uffd-noncoop"):
            raise self.refuse(
                "CRIU here cannot restore lazily: the kernel offers no non-cooperative userfaultfd",
                "migrate with --pre-copy, or choose a target whose kernel has CONFIG_USERFAULTFD",
            )
        inc = Incoming(
            req.migration_id,
            req.job,
            req.source_node,
            self.staging_root / f"in-{req.migration_id}",
            max_bytes=max(2 * req.estimated_bytes, 1 << 30),
            expires_at=time.time() + LEASE_S,
            peer_name=caller,
            pids=list(req.pids),
            reserved_bytes=int(req.estimated_bytes * STAGING_SLACK),
            lazy=lazy,
            reason=req.reason[:500],
            chain=chain,
        )
        self._claim_gpus(req, inc)
        return inc

    def _chain(self, req: pb.PrepareRequest) -> ChainLoan | None:
        """The kept image a move's increment may go over (agent.migration.chainmove); None: its
        whole memory comes, as for any move (said in the log: the source's result names the method)."""
        if not req.HasField("chain"):
            return None
        c = req.chain
        try:
            kept = self.kept(c.group, c.epoch, req.job, c.image_id, req.source_node)
            self.staging_root.mkdir(parents=True, exist_ok=True, mode=0o700)
            if not same_filesystem(kept, self.staging_root):
                raise RefusedError(f"its snapshot store and staging {self.staging_root} are two filesystems")
        except (FerryError, OSError) as e:
            why = e.cause if isinstance(e, FerryError) else str(e)
            log.info(
                "migration %s: job %s's whole memory comes, not an increment: %s",
                req.migration_id,
                req.job,
                why,
            )
            return None
        return ChainLoan(c.epoch, kept)

    def _claim_gpus(self, req: pb.PrepareRequest, inc: Incoming) -> None:
        """Held from here on, in the ledger, so two leases never share a GPU. Before any lock of
        ours: NVML and the driver may hang, and GetMigration must never wait on them."""
        needs = [GpuNeed(g.uuid, g.name, g.memory_bytes) for g in req.gpus]
        if not needs:
            return
        inv = self.cuda.nvml.inventory()
        self.cuda.check_restorable(inv, req.cuda_driver, bool(req.cuda_driver))

        def pick(taken: dict[str, str], frozen: dict[str, int]) -> tuple[dict[str, str], Iterable[str]]:
            # A GPU the job holds on this very host (two agents, one node) is freed by its checkpoint.
            gpu_map = self.cuda.pick_gpus(
                needs,
                inv,
                reserved=taken,
                releasing={n.uuid: n.memory_bytes for n in needs},
                frozen=frozen,
                cuda_state=bool(req.cuda_driver),
            )
            return gpu_map, gpu_map.values()

        # Unique per attempt: two Prepares of one id must not share (and release) one claim.
        inc.lease_owner = f"the lease of migration {req.migration_id} ({uuid.uuid4().hex[:8]})"
        inc.gpu_map = self.ledger.decide(inc.lease_owner, req.job, pick, lease=True)

    def keys(self, req: pb.PrepareRequest, inc: Incoming) -> tuple[DataTls | None, bytes]:
        """The data connection's one-time TLS files, written before the lock, and the certificate
        the lease hands the source (none: it offered no data connection, or its memory comes as
        an increment over a kept chain). Whoever refuses the lease after this closes them."""
        if not req.data_cert or inc.chain is not None:
            return None, b""
        identity = DataIdentity.new(f"{self.node} {req.migration_id}")
        try:
            return DataTls(identity, req.data_cert, self.staging_root), identity.cert_pem
        except OSError as e:
            raise self.refuse(f"cannot write the data connection's TLS files: {e}") from e

    def admit_locked(self, req: pb.PrepareRequest, busy: list[Incoming], inc: Incoming) -> None:
        """Under the lock: room for one more incoming job, and staging for its image."""
        if any(i.job == req.job for i in busy):
            raise self.refuse(f"job {req.job!r} is already coming in from another migration")
        if len(busy) >= MAX_INCOMING:
            raise self.refuse(f"{len(busy)} migrations are already coming in", "retry when they finish")
        # Space already promised to other leases counts as used: two images that each
        # fit alone must not both be accepted into a staging area that holds one.
        free = shutil.disk_usage(self.staging_root).free
        promised = sum(i.reserved_bytes for i in busy if i.state not in _RESTORE_BEGAN)
        if free - promised < inc.reserved_bytes:
            others = f" ({promised >> 20} MiB of it promised to {len(busy)} other leases)" if promised else ""
            raise self.refuse(
                f"staging {self.staging_root} has {free >> 20} MiB free{others}; "
                f"the image needs about {inc.reserved_bytes >> 20} MiB",
                "free space or point --staging-dir at a larger tmpfs",
            )
        inc.staging.mkdir(mode=0o700)

    def _require_job_network(self, address: str) -> None:
        """The job keeps its address: this node must carry its job network, and no job here may
        hold the same address."""
        carrying(self.registry.network, address, self.node, "prepare")
        if holder := next(
            (r.name for r in self.registry.list() if r.address == address and r.state.active), None
        ):
            raise self.refuse(f"job {holder!r} here already has the address {address}")

    def refuse(self, cause: str, hint: str = "") -> RefusedError:
        return RefusedError(cause, step="prepare", node=self.node, hint=hint)


def _keeps_nothing(group: str, epoch: int, job: str, image_id: str, dumped_on: str) -> Path:
    raise NotFoundError("this agent keeps no snapshots")


#: Its image is written: the space it was promised is what it uses now, counted as free space.
_RESTORE_BEGAN = frozenset({TargetState.RESTORING, TargetState.UNWINDING})
