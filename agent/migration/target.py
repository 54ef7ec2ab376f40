"""The target side of a migration: leases, a checked intake into staging, restore on commit.

Every step is written to the migration journal before it acts, and only the
node that prepared a migration (by its certificate) may push, commit, abort or
ask about it. After a restart, `recover()` unwinds whatever was in flight: no
lease outlives the agent that granted it, and a restore the agent did not see
finish is killed, so the source may safely resume its frozen copy.

Why one module: `TargetMigrations` is one protocol state machine under one lock;
every RPC handler checks and changes the same table of migrations in flight, and the
lock discipline is checked most easily in one place. Recovery after a restart
(target_recovery) and the staging policy (staging) are outside.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import grpc
import psutil

from agent import faults
from agent.criu.logs import CriuLogs
from agent.criu.runner import START_TIMEOUT_S, Criu
from agent.cuda.jobs import CudaJobs
from agent.errors import (
    FerryError,
    ImageError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    RefusedError,
    TransferError,
)
from agent.gpus.inventory import GpuNeed, Inventory
from agent.gpus.ledger import GpuLedger
from agent.image import Manifest, StreamDigest
from agent.jobs import procs
from agent.jobs.network import carrying
from agent.jobs.record import JobRecord, JobState
from agent.jobs.registry import JobRegistry
from agent.migration.capture import default_cuda_jobs
from agent.migration.datatls import DataIdentity, DataTls, check_peer_cert
from agent.migration.journal import TARGET, Journal, MigrationRecord
from agent.migration.pagestream import LazyTargetPages, TargetPages
from agent.migration.restore import cpu_ns, restore_tree, resumed_after
from agent.migration.staging import no_space, private_dir
from agent.migration.states import TARGET_TRANSITIONS, TargetState
from agent.migration.target_recovery import journaled, recover_incoming
from agent.migration.transfer import Intake
from agent.rpc import pb

log = logging.getLogger(__name__)

#: How long a target looks, after the job's release, for it to run (for the downtime figure):
#: a job runs within milliseconds of its release, so this bounds an answer that comes at once.
RESUME_LOOK_S = 0.5
LEASE_S = 600.0
MAX_INCOMING = 2
#: Staging must hold the estimate plus this share (page-aligned files, logs, the manifest).
STAGING_SLACK = 1.2


@dataclass
class Incoming:
    migration_id: str
    job: str
    source_node: str
    staging: Path
    max_bytes: int
    expires_at: float
    peer_name: str = ""  # the certificate that prepared it: the only one that may go on
    state: TargetState = TargetState.PREPARED
    manifest: Manifest | None = None
    gpu_map: dict[str, str] = field(default_factory=dict)  # the job's GPU → the GPU here
    pids: list[int] = field(default_factory=list)  # an adopted job's host PIDs
    reserved_bytes: int = 0
    criu_pid: int = 0
    criu_started: float = 0.0
    stream: TargetPages | LazyTargetPages | None = None  # the page stream's target side while it runs
    data_tls: DataTls | None = None  # the data connection's one-time TLS files (None: not leased)
    pages: StreamDigest | None = None  # what the page stream delivered
    lazy: bool = False  # post-copy: the memory comes after the restore, on demand
    postcopy_failed: str = ""  # why the post-copy transfer broke; the job must not run on
    reason: str = ""  # why the source moves it (automatic moves say which GPU and what it showed)
    lease_owner: str = ""  # its GPUs' claim in the ledger ("" once released, or when it holds none)

    def record(self) -> MigrationRecord:
        return MigrationRecord(
            migration_id=self.migration_id,
            role=TARGET,
            job=self.job,
            state=self.state.value,
            peer=self.source_node,
            peer_name=self.peer_name,
            staging=str(self.staging),
            pids=list(self.pids),
            criu_pid=self.criu_pid,
            criu_started=self.criu_started,
            expires_at=self.expires_at,
            max_bytes=self.max_bytes,
            reserved_bytes=self.reserved_bytes,
            gpu_map=dict(self.gpu_map),
        )


class TargetMigrations:
    """Incoming migrations on this node."""

    def __init__(
        self,
        registry: JobRegistry,
        criu: Criu,
        staging_root: Path,
        node: str,
        cuda_jobs: CudaJobs | None = None,
        journal: Journal | None = None,
        ledger: GpuLedger | None = None,
    ) -> None:
        self.registry = registry
        self.criu = criu
        self.cuda = cuda_jobs or default_cuda_jobs(node)
        self.staging_root = staging_root
        self.node = node
        self.journal = journal or Journal(registry.root.parent)
        #: CRIU's logs of each incoming migration: kept where the errors say when it fails.
        self.criu_logs = CriuLogs(registry.root.parent)
        self._lock = threading.Lock()
        self._incoming: dict[str, Incoming] = {}
        #: Every GPU claim on this node (agent.gpus.ledger); a lease's GPUs are held there until
        #: its restore ends. The agent gives the node's one ledger.
        self.ledger = ledger or self.cuda.ledger
        #: Told how each incoming migration ended: "committed" (the job runs here) or "aborted".
        self.on_end: Callable[[str], None] = lambda result: None
        #: Where this node's page servers listen for a source's CRIU (the agent's own address).
        self.data_host = "0.0.0.0"

    # -- the protocol ------------------------------------------------------------

    def prepare(self, req: pb.PrepareRequest, caller: str = "") -> pb.Lease:
        if not req.migration_id or not req.job or not req.source_node:
            raise InvalidArgumentError(
                "prepare needs a migration id, a job name and the source node", node=self.node
            )
        _safe_id(req.migration_id)
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
            raise self._refuse(f"the job's working directory {req.cwd} does not exist here")
        if missing := [p for p in req.paths if not os.path.exists(p)]:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise self._refuse(f"files the job uses are missing here: {shown}", "put them on shared storage")
        if req.address:
            self._require_job_network(req.address)
        if taken := [p for p in req.pids if psutil.pid_exists(p)]:
            raise self._refuse(
                f"the adopted job keeps host PIDs, and PIDs {taken[:5]} are in use here",
                "choose a target where they are free, or run jobs with `ferry run` (own PID namespace)",
            )
        staging = self.staging_root / f"in-{req.migration_id}"
        need = int(req.estimated_bytes * STAGING_SLACK)
        inc = Incoming(
            req.migration_id,
            req.job,
            req.source_node,
            staging,
            max_bytes=max(2 * req.estimated_bytes, 1 << 30),
            expires_at=time.time() + LEASE_S,
            peer_name=caller,
            pids=list(req.pids),
            reserved_bytes=need,
            lazy=req.lazy,
            reason=req.reason[:500],
        )
        if req.data_cert:
            check_peer_cert(req.data_cert, f"source {req.source_node}")
        elif req.lazy:
            raise self._refuse("post-copy needs a data connection, and the source offered none")
        if req.lazy and not self.criu.feature("uffd-noncoop"):
            raise self._refuse(
                "CRIU here cannot restore lazily: the kernel offers no non-cooperative userfaultfd",
                "migrate with --pre-copy, or choose a target whose kernel has CONFIG_USERFAULTFD",
            )
        # Before any lock: NVML and the driver may hang, and GetMigration (the source's fencing
        # query) must never wait on them.
        needs = [GpuNeed(g.uuid, g.name, g.memory_bytes) for g in req.gpus]
        inv = self.cuda.nvml.inventory() if needs else Inventory(False)
        if needs:
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

        if needs:  # held from here on, in the ledger, so two leases never share a GPU
            # Unique per attempt: two Prepares of one id must not share (and release) one claim.
            inc.lease_owner = f"the lease of migration {req.migration_id} ({uuid.uuid4().hex[:8]})"
            inc.gpu_map = self.ledger.decide(inc.lease_owner, req.job, pick, lease=True)
        try:
            with self._lock:
                self._expire_locked()
                if req.migration_id in self._incoming or self.journal.get(TARGET, req.migration_id):
                    raise self._refuse(
                        f"migration {req.migration_id} is already known here; ids are never reused"
                    )
                self._admit_locked(
                    req, [i for i in self._incoming.values() if i.state.in_flight], need, staging
                )
                self.journal.save(inc.record())
                self._incoming[req.migration_id] = inc
        except BaseException:
            self.ledger.release(inc.lease_owner)
            raise
        # Outside our lock (the registry's may be held across a launch): no ended record of the
        # name answers for the arriving job from here on.
        self.registry.forget_final(req.job)
        data_cert = b""
        if req.data_cert:
            identity = DataIdentity.new(f"{self.node} {req.migration_id}")
            try:
                inc.data_tls = DataTls(identity, req.data_cert, self.staging_root)
            except OSError as e:
                with self._lock:
                    self._drop(inc, f"cannot write its data connection's TLS files: {e}")
                raise self._refuse(f"cannot write the data connection's TLS files: {e}") from e
            data_cert = identity.cert_pem
        log.info(
            "migration %s: lease granted for job %s from %s (%s)",
            req.migration_id,
            req.job,
            req.source_node,
            f"certificate {caller}" if caller else "insecure loopback",
        )
        return pb.Lease(
            migration_id=req.migration_id,
            node_name=self.node,
            max_bytes=inc.max_bytes,
            expires_at=inc.expires_at,
            gpu_map=[pb.GpuPair(old_uuid=o, new_uuid=n) for o, n in inc.gpu_map.items()],
            page_stream=bool(data_cert),
            lazy=inc.lazy,
            data_cert=data_cert,
        )

    def _admit_locked(self, req: pb.PrepareRequest, busy: list[Incoming], need: int, staging: Path) -> None:
        """Under the lock: room for one more incoming job, and staging for its image."""
        if any(i.job == req.job for i in busy):
            raise self._refuse(f"job {req.job!r} is already coming in from another migration")
        if len(busy) >= MAX_INCOMING:
            raise self._refuse(f"{len(busy)} migrations are already coming in", "retry when they finish")
        # Space already promised to other leases counts as used: two images that each
        # fit alone must not both be accepted into a staging area that holds one.
        free = shutil.disk_usage(self.staging_root).free
        promised = sum(i.reserved_bytes for i in busy if i.state is not TargetState.RESTORING)
        if free - promised < need:
            others = f" ({promised >> 20} MiB of it promised to {len(busy)} other leases)" if promised else ""
            raise self._refuse(
                f"staging {self.staging_root} has {free >> 20} MiB free{others}; "
                f"the image needs about {need >> 20} MiB",
                "free space or point --staging-dir at a larger tmpfs",
            )
        staging.mkdir(mode=0o700)

    def stream_pages(self, requests: Iterator[pb.PageData], caller: str = "") -> Iterator[pb.PageData]:
        """The control of the job's memory, which the source's CRIU sends to a page server here
        (pre-copy, while it dumps) or which a lazy-pages daemon here fetches (post-copy).

        The last message says what arrived; push must then bring a manifest that names the same.
        """
        first = next(requests, None)
        if first is None or not first.migration_id:
            raise InvalidArgumentError("a page stream must start with its migration id", step="transfer")
        inc = self._get(first.migration_id, caller)
        with self._lock:
            if inc.pages is not None or inc.stream is not None:
                raise RefusedError(
                    f"migration {inc.migration_id} already has its page stream",
                    step="transfer",
                    node=self.node,
                )
            self._require_lease(inc, (TargetState.PREPARED,), "a page stream")
            if inc.data_tls is None:
                raise RefusedError(
                    f"migration {inc.migration_id} leased no data connection", step="transfer", node=self.node
                )
            tls = inc.data_tls.files
            if inc.lazy:
                inc.stream = LazyTargetPages(self.node, tls, lambda why: self._post_copy_failed(inc, why))
            else:
                self._set(inc, TargetState.STREAMING)
                log_dir = self.criu_logs.dir_for(inc.migration_id)
                inc.stream = TargetPages(
                    self.criu, inc.staging, inc.max_bytes, self.node, tls, self.data_host, log_dir
                )
        if isinstance(inc.stream, LazyTargetPages):
            yield from self._post_copy(inc, inc.stream, requests)
            return
        try:
            digest = yield from inc.stream.run(requests)
        except BaseException as e:
            inc.stream.kill()
            with self._lock:
                if inc.state is TargetState.STREAMING:
                    self._drop(inc, f"page stream failed: {e}")
            self._stream_failed(e, "transfer", "the page stream")
        with self._lock:
            inc.stream = None
            if inc.state is not TargetState.STREAMING:  # aborted while the last bytes came in
                raise RefusedError(f"migration {inc.migration_id} was aborted", node=self.node)
            inc.pages = digest
            # Waiting, under the lease's expiry, for the rest of the image.
            self._set(inc, TargetState.STREAMED)
        log.info("migration %s: %d bytes of memory streamed in", inc.migration_id, digest.bytes)
        yield pb.PageData(end=pb.PageStreamEnd(bytes=digest.bytes, check=digest.check))

    def _stream_failed(self, e: BaseException, step: str, what: str) -> NoReturn:
        """Re-raise a StreamPages failure as the error the source sees (with step and node)."""
        if isinstance(e, GeneratorExit):  # the call was cancelled: nobody to tell
            raise e
        if isinstance(e, FerryError):
            raise e.at(step=step, node=self.node) from None
        raise TransferError(f"{what} failed: {e!r}", step=step, node=self.node) from e

    def _post_copy(
        self, inc: Incoming, stream: LazyTargetPages, requests: Iterator[pb.PageData]
    ) -> Iterator[pb.PageData]:
        """Post-copy: the stream stays open across push and commit and ends once the restored
        job has all its memory. Until then the job here needs the source's frozen copy."""
        try:
            digest = yield from stream.run(requests)
        except BaseException as e:
            stream.kill()
            self._post_copy_failed(inc, str(e) if isinstance(e, FerryError) else repr(e))
            self._stream_failed(e, "pages", "the post-copy transfer")
        with self._lock:
            inc.stream = None
            inc.pages = digest
            if inc.state is TargetState.POSTCOPY:
                self._set(inc, TargetState.RUNNING)
        shutil.rmtree(inc.staging, ignore_errors=True)
        self._forget_data(inc)
        self.criu_logs.done(inc.migration_id)
        log.info("migration %s: post-copy done, %d bytes of memory pulled in", inc.migration_id, digest.bytes)
        yield pb.PageData(end=pb.PageStreamEnd(bytes=digest.bytes, check=digest.check))

    def _require_job_network(self, address: str) -> None:
        """The job keeps its address: this node must carry its job network, and no job here may
        hold the same address."""
        carrying(self.registry.network, address, self.node, "prepare")
        if holder := next(
            (r.name for r in self.registry.list() if r.address == address and r.state.active), None
        ):
            raise self._refuse(f"job {holder!r} here already has the address {address}")

    def _post_copy_failed(self, inc: Incoming, why: str) -> None:
        """The job's missing pages will never come: its copy here must not run on (they would
        read as zeros), and the source may resume its own once we say ABORTED."""
        with self._lock:
            inc.postcopy_failed = why
            if inc.state is TargetState.POSTCOPY:
                try:
                    job = self.registry.get(inc.job)
                except NotFoundError:
                    job = None
                try:
                    if job is not None and job.state.active:
                        # Recorded first, so the job's end reads as this loss, not as an exit.
                        self.registry.update(
                            inc.job,
                            state=JobState.LOST,
                            note=f"post-copy from {inc.source_node} failed ({why}); killed here, "
                            "the source resumes its frozen copy",
                        )
                        if job.veth and self.registry.network is not None:
                            # Its link first: killed, it would close the job's TCP connections
                            # (FIN/RST from the job's address) under the source's copy.
                            self.registry.network.delete(job.veth)
                        if procs.alive(job.pid, job.pid_started):
                            procs.signal_all(procs.tree_pids(job.pid), signal.SIGKILL)
                finally:  # the source resumes its copy only on our ABORTED: say it whatever happened
                    self._drop(inc, f"post-copy failed: {why}")
            elif inc.state in (TargetState.PREPARED, TargetState.VERIFIED):
                self._drop(inc, f"page stream failed: {why}")
            # RESTORING: the commit sees postcopy_failed at its commit point and kills the restore.

    def _require_lease(self, inc: Incoming, states: tuple[TargetState, ...], what: str) -> None:
        """Under the lock: the migration is in one of `states` and its lease holds."""
        if inc.state not in states:
            raise RefusedError(
                f"migration {inc.migration_id} is {inc.state.value}, not waiting for {what}",
                step="transfer",
                node=self.node,
            )
        if time.time() > inc.expires_at:
            self._drop(inc, f"its lease expired before {what} came")
            raise RefusedError(f"the lease of migration {inc.migration_id} expired", node=self.node)

    def push(self, chunks: Iterator[pb.ImageChunk], caller: str = "") -> pb.PushImageResponse:
        first = next(chunks, None)
        if first is None:
            raise InvalidArgumentError("empty image stream", step="transfer", node=self.node)
        inc = self._get(first.migration_id, caller)
        with self._lock:
            self._require_lease(inc, (TargetState.PREPARED, TargetState.STREAMED), "an image")
            self._set(inc, TargetState.RECEIVING)
        streamed = inc.pages.bytes if inc.pages else 0
        intake = Intake(inc.staging, inc.max_bytes - streamed, self.node)
        try:
            intake.feed(first)
            listed = sum((intake.expected or {}).values())
            if listed > (free := shutil.disk_usage(inc.staging).free) + intake.bytes:
                raise TransferError(
                    f"the image lists {listed >> 20} MiB but staging {self.staging_root} has "
                    f"{free >> 20} MiB free",
                    step="transfer intake",
                    node=self.node,
                    hint="free space or point --staging-dir at a larger tmpfs",
                )
            faults.check("target-receiving", self.node)
            for chunk in chunks:
                intake.feed(chunk)
            faults.check("target-transfer", self.node)
            manifest = intake.finish()
            if manifest.job.name != inc.job:
                raise ImageError(f"image is of job {manifest.job.name!r}, the lease is for {inc.job!r}")
            if manifest.page_stream != inc.pages:
                raise ImageError(
                    f"the manifest names a page stream of {manifest.page_stream}, but "
                    f"{inc.pages or 'none'} arrived"
                )
        except BaseException as e:
            intake.close()
            if isinstance(e, grpc.RpcError):  # the request stream itself broke: the source went away
                e = TransferError(
                    "the source's stream broke off before the image was complete",
                    step="transfer",
                    node=self.node,
                )
                with self._lock:
                    self._drop(inc, e.cause)
                raise e from None
            with self._lock:  # an Abort may have dropped it meanwhile: then this is a no-op
                self._drop(inc, f"intake failed: {e}")
            if isinstance(e, OSError) and e.errno == errno.ENOSPC:
                raise no_space(inc.staging, self.node) from e
            if isinstance(e, OSError):  # a transfer failure, not a crash
                raise TransferError(
                    f"cannot write the image into {inc.staging}: {e.strerror}", node=self.node
                ) from e
            raise
        with self._lock:
            if inc.state is not TargetState.RECEIVING:  # aborted while the last bytes came in
                raise RefusedError(f"migration {inc.migration_id} was aborted", node=self.node)
            inc.manifest = manifest
            inc.expires_at = time.time() + LEASE_S  # the commit must come within a lease from now
            self._set(inc, TargetState.VERIFIED)
        return pb.PushImageResponse(bytes=intake.bytes, files=len(intake.received))

    def commit(self, req: pb.CommitRequest, caller: str = "") -> pb.CommitResponse:
        inc = self._get(req.migration_id, caller)
        with self._lock:
            if inc.manifest is None or inc.state is not TargetState.VERIFIED:
                raise RefusedError(
                    f"migration {inc.migration_id} has no verified image to restore", node=self.node
                )
            if inc.lazy and not isinstance(inc.stream, LazyTargetPages):
                raise RefusedError(
                    f"post-copy migration {inc.migration_id} has no page stream to take memory from",
                    node=self.node,
                )
            self._set(inc, TargetState.RESTORING)
        times: dict[str, float] = {}

        held_ns = [0]  # the job's CPU time while it is still held, just before its release

        def commit_point(rec: JobRecord) -> None:
            self._commit_point(inc)
            held_ns[0] = cpu_ns(procs.tree_pids(rec.pid))

        def criu_started(pid: int) -> None:
            inc.criu_pid, inc.criu_started = pid, procs.create_time(pid)
            self.journal.save(inc.record())

        try:
            faults.check("target-restore", self.node)
            work_dir = self.criu_logs.dir_for(inc.migration_id)  # CRIU's logs; a lazy daemon listens there
            if isinstance(inc.stream, LazyTargetPages):
                inc.stream.attach(self.criu, inc.staging, work_dir, START_TIMEOUT_S)
            rec = restore_tree(
                self.registry,
                self.criu,
                inc.staging,
                inc.manifest,
                inc.job,
                note=f"moved here from {inc.source_node}" + (f" ({inc.reason})" if inc.reason else ""),
                cuda_jobs=self.cuda,
                gpu_map=inc.gpu_map,
                times=times,
                on_criu_start=criu_started,
                before_release=commit_point,
                lazy_pages=inc.lazy,
                log_dir=work_dir,
            )
        except BaseException as e:
            with self._lock:
                if inc.state in (TargetState.RUNNING, TargetState.POSTCOPY):
                    # Past the commit point the job is this node's one copy: the commit succeeded,
                    # whatever failed after it, or the source would resume a second copy.
                    log.error(
                        "migration %s: the job runs here, but after its release: %s", inc.migration_id, e
                    )
                else:
                    self._drop(inc, f"restore failed: {e}")
                    raise
            rec = self.registry.get(inc.job)
        released = time.monotonic()
        resumed = resumed_after(rec, held_ns[0], RESUME_LOOK_S)
        if isinstance(inc.stream, LazyTargetPages):
            inc.stream.watch(rec.pid)
        if not inc.lazy:  # post-copy: the daemon reads the page maps there until it is done
            shutil.rmtree(inc.staging, ignore_errors=True)
            self._forget_data(inc)
            self.criu_logs.done(inc.migration_id)
        log.info("migration %s: job %s runs here as pid %d", inc.migration_id, inc.job, rec.pid)
        return pb.CommitResponse(
            node_name=self.node,
            pid=rec.pid,
            phases=[pb.PhaseTiming(phase=k, seconds=v) for k, v in times.items()],
            resumed_after_s=resumed,
            answered_after_s=time.monotonic() - released,
        )

    def _commit_point(self, inc: Incoming) -> None:
        """The restored job is registered and still held (stopped or CUDA-locked): once RUNNING is
        on disk it is the job's one copy. A crash before this line leaves it held, and recovery
        kills it; after, recovery answers RUNNING."""
        faults.check("target-restored", self.node)
        with self._lock:
            if inc.postcopy_failed:  # the job would run on memory that is not there
                raise TransferError(f"the post-copy transfer failed: {inc.postcopy_failed}", step="restore")
            self._set(inc, TargetState.POSTCOPY if inc.lazy else TargetState.RUNNING)

    def abort(self, mid: str, reason: str, caller: str = "") -> None:
        _safe_id(mid)
        with self._lock:
            inc = self._incoming.get(mid)
            if inc is None:
                if self.journal.get(TARGET, mid) is None:
                    # Fencing: an id aborted before it arrived can never be prepared later.
                    tomb = MigrationRecord(mid, TARGET, "", "aborted", peer_name=caller, note=reason)
                    self.journal.save(tomb)
                    log.info("migration %s: aborted before it reached this node: %s", mid, reason)
                    return
                inc = self._from_journal(mid)
        self._check_caller(inc, caller)
        with self._lock:
            if inc.state in (TargetState.RESTORING, TargetState.RUNNING, TargetState.POSTCOPY):
                what = "is restoring" if inc.state is TargetState.RESTORING else "already runs"
                raise RefusedError(
                    f"migration {mid} {what} the job here; it cannot be aborted", node=self.node
                )
            if inc.state is TargetState.ABORTED:
                return
            self._drop(inc, f"aborted by the source: {reason}")

    def status(self, mid: str, caller: str = "") -> int:
        _safe_id(mid)
        with self._lock:
            inc = self._incoming.get(mid)
        if inc is None:
            rec = self.journal.get(TARGET, mid)
            if rec is None:
                return pb.TARGET_STATE_UNKNOWN
            inc = self._from_journal(mid)
        self._check_caller(inc, caller)
        return inc.state.wire

    # -- housekeeping --------------------------------------------------------------

    def recover(self) -> list[str]:
        """After a restart (agent.migration.target_recovery); returns what was done."""
        return recover_incoming(self.journal, self.registry)

    def expire(self) -> None:
        """Leases whose source went silent: free their slot and staging (run periodically)."""
        with self._lock:
            self._expire_locked()

    def shutdown(self) -> int:
        """The agent stops, its server already closed: every incoming migration that has not
        begun its restore is dropped with its staging (its source, fencing, finds it aborted and
        resumes the job). Returns how many were dropped."""
        with self._lock:
            waiting = [i for i in self._incoming.values() if i.state in _BEFORE_RESTORE]
            for inc in waiting:
                self._drop(inc, f"the agent on {self.node} stopped")
        return len(waiting)

    # -- internals -------------------------------------------------------------------

    def _get(self, mid: str, caller: str = "") -> Incoming:
        _safe_id(mid)
        with self._lock:
            inc = self._incoming.get(mid)
        if inc is None:
            if self.journal.get(TARGET, mid) is None:
                raise NotFoundError(f"no migration {mid!r} on this node", node=self.node)
            inc = self._from_journal(mid)
        self._check_caller(inc, caller)
        return inc

    def _from_journal(self, mid: str) -> Incoming:
        """A migration this run of the agent did not serve (finished, or unwound by recover())."""
        rec = self.journal.get(TARGET, mid)
        assert rec is not None
        return Incoming(
            rec.migration_id,
            rec.job,
            rec.peer,
            Path(rec.staging),
            rec.max_bytes,
            rec.expires_at,
            peer_name=rec.peer_name,
            state=journaled(rec),
        )

    def _check_caller(self, inc: Incoming, caller: str) -> None:
        if inc.peer_name and caller != inc.peer_name:
            log.warning(
                "migration %s: %r tried to act on %r's migration", inc.migration_id, caller, inc.peer_name
            )
            raise PermissionDeniedError(
                f"migration {inc.migration_id} belongs to node {inc.peer_name!r}, "
                f"not {caller or 'this caller'!r}",
                node=self.node,
            )

    def _refuse(self, cause: str, hint: str = "") -> RefusedError:
        return RefusedError(cause, step="prepare", node=self.node, hint=hint)

    def _set(self, inc: Incoming, state: TargetState) -> None:
        """Every state change: checked against TARGET_TRANSITIONS, and durable before the agent
        acts on it."""
        inc.state = TARGET_TRANSITIONS.check(inc.state, state, f"{inc.migration_id} (job {inc.job})")
        if not state.in_flight:  # RUNNING: the job's record holds its GPUs now
            self.ledger.release(inc.lease_owner)
        self.journal.save(inc.record())
        if state is TargetState.RUNNING:
            self.on_end("committed")

    def _drop(self, inc: Incoming, why: str) -> None:
        """Under the lock: end the migration here (ABORTED) with nothing left of it. Dropping
        one already dropped (an Abort racing a failing transfer) changes nothing."""
        if inc.state is TargetState.ABORTED:
            log.info("migration %s: already dropped; also %s", inc.migration_id, why)
            return
        if inc.stream is not None:
            inc.stream.kill()  # a page server still writing into staging
        self._forget_data(inc)
        # Staging first: "aborted" on disk then also means nothing is left (recovery cleans both ways).
        shutil.rmtree(inc.staging, ignore_errors=True)
        subject = f"{inc.migration_id} (job {inc.job})"
        inc.state = TARGET_TRANSITIONS.check(inc.state, TargetState.ABORTED, subject)
        self.ledger.release(inc.lease_owner)
        rec = inc.record()
        rec.note = why
        self.journal.save(rec)
        log.info("migration %s: dropped (%s)", inc.migration_id, why)
        self.on_end("aborted")

    @staticmethod
    def _forget_data(inc: Incoming) -> None:
        """The data connection's one-time key is of no more use: it goes."""
        if inc.data_tls is not None:
            inc.data_tls.close()
            inc.data_tls = None

    def _expire_locked(self) -> None:
        now = time.time()
        for inc in self._incoming.values():
            waiting = (TargetState.PREPARED, TargetState.STREAMED, TargetState.VERIFIED)
            if inc.state in waiting and now > inc.expires_at:
                log.warning("migration %s: lease expired; dropping its staged image", inc.migration_id)
                self._drop(inc, "lease expired")


#: Incoming states whose image is still only in staging: safe to drop at any time.
_BEFORE_RESTORE = frozenset(
    {
        TargetState.PREPARED,
        TargetState.STREAMING,
        TargetState.STREAMED,
        TargetState.RECEIVING,
        TargetState.VERIFIED,
    }
)


def _safe_id(mid: str) -> str:
    if not mid or not mid.isascii() or not mid.replace("-", "").isalnum() or len(mid) > 64:
        raise InvalidArgumentError(f"invalid migration id {mid!r}: 1-64 letters, digits and '-'")
    return mid
