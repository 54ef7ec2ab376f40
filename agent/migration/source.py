"""Moving jobs: the source and target sides of a migration, and local save / resume.

Protocol (DESIGN.md): prepare (target grants a lease and maps the job's GPUs,
nothing frozen) → dump (CUDA lock and checkpoint, then CRIU with the tree left
stopped) → transfer (digested stream) → commit (target restores with CRIU, then
CUDA onto its GPUs, and reports RUNNING; only then the source kills its frozen
copy). Any failure before the target runs the job aborts: the source resumes
its frozen copy, CUDA included.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import psutil

from agent import faults
from agent.compat import StrEnum
from agent.criu import tcp_repair
from agent.criu.dumpable import refuse_node_sockets, refuse_undumpable
from agent.criu.images import bound_socket_dirs
from agent.criu.lazy import LazyDump, lazy_dump_blocker
from agent.criu.logs import CriuLogs
from agent.criu.runner import Criu, DumpResult, InheritFd
from agent.cuda import driver as cuda
from agent.cuda.jobs import CudaConfig, CudaJobs, Footprint, ProcView, restore_plan
from agent.errors import (
    CriuError,
    FerryError,
    InvalidArgumentError,
    MigrationAbortedError,
    NotFoundError,
    RefusedError,
    StepTimeoutError,
    TransferError,
    UnauthenticatedError,
    UnavailableError,
)
from agent.gpus.inventory import GpuNeed, Nvml, gib
from agent.image import (
    STDERR_LOG,
    STDOUT_LOG,
    FileEntry,
    JobSpec,
    Manifest,
    StreamDigest,
    build_manifest,
    host_bytes,
    read_manifest,
    verify,
)
from agent.jobs import procs
from agent.jobs.network import LinkLock, carrying, veth_name
from agent.jobs.registry import LOG_MOUNT, LOG_MOUNT_KEY, JobKind, JobRecord, JobRegistry, JobState
from agent.migration.journal import SOURCE, Journal, MigrationRecord
from agent.migration.pagestream import PageCall, SourceRelay
from agent.migration.transfer import SendStats, send_image
from agent.rpc import pb

log = logging.getLogger(__name__)


class MigrationState(StrEnum):
    """PREPARING → DUMPING → TRANSFERRING → RESTORING → COMMITTED.

    Any failure before the target reports RUNNING: → ABORTING → ABORTED, with
    the source's frozen copy resumed. UNRESOLVED: the target stopped answering
    during commit, so whether it runs the job is unknown; the frozen copy is
    kept (never resumed blindly) and the job's note says so.

    Post-copy (--lazy) stays RESTORING after the commit answer until the target has
    pulled every page: the job then runs there on memory partly still here.
    """

    PREPARING = "preparing"
    DUMPING = "dumping"
    TRANSFERRING = "transferring"
    RESTORING = "restoring"
    COMMITTED = "committed"
    ABORTING = "aborting"
    ABORTED = "aborted"
    UNRESOLVED = "unresolved"


#: How long a lazy dump may take to write all but the memory (and to end once its stream is cut).
LAZY_READY_S = 300.0
#: The slowest post-copy ferry waits for before it gives up on the target (bytes per second).
POSTCOPY_MIN_BPS = 20e6
#: After a broken post-copy: how long the target may take to kill its copy and say so.
POSTCOPY_SETTLE_S = 30.0


@dataclass(frozen=True)
class Progress:
    phase: str  # prepare | dump | transfer | restore | commit | abort | done
    message: str
    bytes_done: int = 0
    bytes_total: int = 0


@dataclass(frozen=True)
class MigrationSpec:
    job: str
    target: str
    migration_id: str
    staged: bool = False  # dump into staging here, then copy: no page stream
    lazy: bool = False  # post-copy: resume on the target first, its memory follows on demand
    reason: str = ""  # why it moves ("" by hand); the target's record says it
    lock_timeout_s: float | None = None  # the CUDA lock's bound; None: the agent's default


@dataclass
class MigrationResult:
    migration_id: str
    job: str
    source_node: str
    target_node: str = ""
    target: str = ""
    phases: dict[str, float] = field(default_factory=dict)
    host_bytes: int = 0
    image_bytes: int = 0
    gpu_bytes: int = 0
    frozen_s: float = 0.0
    downtime_s: float = -1.0
    total_s: float = 0.0
    transfer_gbps: float = 0.0
    image_dir: str = ""


class Peer(Protocol):
    """The target agent as the source sees it. UnavailableError / StepTimeoutError
    mean "no answer"; any other FerryError is the target's definite answer."""

    address: str

    def info(self) -> pb.NodeInfo: ...
    def prepare(self, req: pb.PrepareRequest) -> pb.Lease: ...
    def stream_pages(self, requests: Iterable[pb.PageData]) -> PageCall: ...
    def push(self, chunks: Iterator[pb.ImageChunk]) -> pb.PushImageResponse: ...
    def commit(self, req: pb.CommitRequest) -> pb.CommitResponse: ...
    def abort(self, migration_id: str, reason: str) -> None: ...
    def status(self, migration_id: str) -> int: ...


Emit = Callable[[Progress], None]


class _Phases:
    """Per-phase wall time."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    def run(self, name: str, fn: Callable[[], object]) -> object:
        t = time.monotonic()
        try:
            return fn()
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.monotonic() - t


def _log_mtime(rec: JobRecord) -> float:
    times = [os.stat(p).st_mtime for p in (rec.stdout_path, rec.stderr_path) if p and os.path.exists(p)]
    return max(times, default=0.0)


def _copy_logs(rec: JobRecord, image_dir: Path) -> None:
    """Agent-owned logs travel with the image; the job's fds to them are re-pointed on restore."""
    if rec.kind is not JobKind.LAUNCHED:
        return
    shutil.copyfile(rec.stdout_path, image_dir / STDOUT_LOG)
    shutil.copyfile(rec.stderr_path, image_dir / STDERR_LOG)


def _needs_shell_job(rec: JobRecord, pids: list[int]) -> bool:
    """An adopted process whose session leader is outside its tree needs CRIU's --shell-job."""
    return rec.kind is JobKind.ADOPTED and procs.session_id(rec.pid) not in pids


class SourceMigration:
    """One outgoing migration, driven start to end by `run()` on its own thread."""

    def __init__(
        self,
        spec: MigrationSpec,
        registry: JobRegistry,
        criu: Criu,
        peer: Peer,
        staging_root: Path,
        node: str,
        agent_id: str,
        emit: Emit = lambda p: None,
        cuda_jobs: CudaJobs | None = None,
        journal: Journal | None = None,
    ) -> None:
        self.spec = spec
        self.journal = journal or Journal(registry.root.parent)
        #: CRIU's logs of this migration: kept where the errors say when it fails.
        self.criu_logs = CriuLogs(registry.root.parent)
        self.cuda = cuda_jobs or default_cuda_jobs(node)
        self.footprint = Footprint()
        self.link = LinkLock(None, "")  # the job's link, cut during the move (agent.jobs.network)
        self.cuda_frozen = False
        self.target_aborted = False
        self.registry = registry
        self.criu = criu
        self.peer = peer
        self.staging = staging_root / f"out-{spec.migration_id}"
        self.node = node
        self.agent_id = agent_id
        self.emit = emit
        self.state = MigrationState.PREPARING
        self.lease = pb.Lease()
        self.relay: SourceRelay | None = None
        self.lazy_dump: LazyDump | None = None
        self.estimated_bytes = 0
        self.phases = _Phases()
        self.result = MigrationResult(spec.migration_id, spec.job, node, target=spec.target)
        self.record = MigrationRecord(
            spec.migration_id, SOURCE, spec.job, self.state.value, peer=spec.target, staging=str(self.staging)
        )

    def _journal(self, **changes: object) -> None:
        """Durable before acting: after a crash the record names the furthest this may have got."""
        for k, v in changes.items():
            setattr(self.record, k, v)
        self.journal.save(self.record)

    def _set(self, state: MigrationState, phase: str, message: str) -> None:
        self.state = state
        self._journal(state=state.value)
        log.info("migration %s (job %s): %s", self.spec.migration_id, self.spec.job, message)
        self.emit(Progress(phase, message))

    def run(self) -> MigrationResult:
        t_start = time.monotonic()
        rec = self.registry.begin_move(self.spec.job, self.spec.migration_id, "migration")
        self.record.pids = [rec.pid]
        try:
            self._set(MigrationState.PREPARING, "prepare", f"asking {self.spec.target} for a lease")
            self.phases.run("prepare", lambda: self._prepare(rec))
        except Exception as exc:
            e = as_ferry_error(exc, "prepare", self.node)
            self.registry.update(
                rec.name, state=JobState.RUNNING, migration_id="", note=f"migration refused: {e}"
            )
            self.state = MigrationState.ABORTED
            self._journal(state=self.state.value, note=str(e))
            e.at(step="prepare", node=self.node)
            if e is exc:
                raise
            raise e from exc

        pids: list[int] = []
        frozen_at = 0.0
        try:
            self._set(MigrationState.DUMPING, "dump", "freezing and dumping the job")
            faults.check("dump", self.node)
            self.staging.mkdir(mode=0o700, parents=True)
            frozen_at = time.monotonic()
            if self.footprint.processes:
                self.emit(Progress("dump", f"copying {gib(self.footprint.gpu_bytes)} of GPU memory to host"))
                self._journal(cuda_pids=self.footprint.pids)  # before: a crash mid-freeze must unfreeze
                self.cuda.freeze(self.footprint, self.phases.times, self.spec.lock_timeout_s)
                self.cuda_frozen = True
            shell_job = _needs_shell_job(rec, procs.tree_pids(rec.pid))
            if self.lease.page_stream and not self.spec.staged:
                # Post-copy sends the memory after the commit, as the target asks for it.
                phase, what = (
                    ("pages", "sending the job's memory as the target asks for it")
                    if self.spec.lazy
                    else ("dump", "streaming the job's memory to the target")
                )
                self.relay = SourceRelay(
                    self.peer.stream_pages,
                    self.spec.migration_id,
                    self.node,
                    lambda n: self.emit(Progress(phase, what, n)),
                )
            if self.spec.lazy:
                pids = procs.tree_pids(rec.pid)
                self._journal(pids=pids)
                dump = self.phases.run("dump", lambda: self._start_lazy_dump(rec.pid, pids, shell_job))
                pages = None
            else:
                dump = self.phases.run("dump", lambda: self._dump(rec.pid, shell_job))
                pids = procs.tree_pids(rec.pid)  # the stopped tree
                self._journal(pids=pids)
                pages = self.phases.run("pages", self.relay.finish) if self.relay else None
            assert pages is None or isinstance(pages, StreamDigest)
            faults.check("source-dumped", self.node)
            last_progress = _log_mtime(rec)
            _copy_logs(rec, self.staging)

            self._set(MigrationState.TRANSFERRING, "transfer", "streaming the image")
            faults.check("transfer", self.node)
            job = rec.spec()
            job = JobSpec(**{**job.__dict__, "migrations": rec.migrations + 1, "shell_job": shell_job})
            sent = SendStats()
            total = sum(p.stat().st_size for p in self.staging.iterdir())

            def manifest(entries: list[FileEntry]) -> Manifest:
                return Manifest(
                    job=job,
                    source_node=self.node,
                    files=entries,
                    host_bytes=host_bytes(entries) + (pages.bytes if pages else 0),
                    gpu_bytes=self.footprint.gpu_bytes,
                    criu_stats=dump.stats,  # type: ignore[attr-defined]
                    timings=dict(self.phases.times),
                    cuda=self.footprint.section(),
                    page_stream=pages,
                )

            def progress(n: int) -> None:
                if n % (64 << 20) < (1 << 20) or n == total:
                    self.emit(Progress("transfer", "streaming the image", n, total))

            chunks = send_image(self.spec.migration_id, self.staging, manifest, sent, progress)
            self.phases.run("transfer", lambda: self.peer.push(chunks))
            streamed = pages.bytes if pages else 0
            self.result.image_bytes = sent.bytes + streamed
            self.result.host_bytes = host_bytes(sent.entries) + streamed
            self.result.gpu_bytes = self.footprint.gpu_bytes

            self._set(MigrationState.RESTORING, "restore", f"target {self.result.target_node} restoring")
            faults.check("commit", self.node)
            resp = self.phases.run("commit", lambda: self._commit(last_progress))
        except Exception as exc:
            self._abort(rec, pids, as_ferry_error(exc, self.state.value, self.node))
            raise AssertionError("unreachable") from exc  # _abort always raises
        if self.lazy_dump is not None:
            pages = self._post_copy(rec, pids)
            self.result.image_bytes += pages.bytes
            self.result.host_bytes += pages.bytes

        # Committed: the target runs the job. Only now the frozen copy goes, and its link.
        self.registry.kill_tree(rec, pids)
        if self.link.network is not None:
            self.link.network.delete(self.link.veth)
        self.cuda.release(self.footprint)
        self.result.frozen_s = time.monotonic() - frozen_at
        assert isinstance(resp, pb.CommitResponse)
        for t in resp.phases:
            self.phases.times[f"target {t.phase}"] = t.seconds
        if resp.first_progress_at and last_progress:
            self.result.downtime_s = resp.first_progress_at - last_progress
        self.registry.update(
            rec.name,
            state=JobState.MOVED,
            moved_to=self.spec.target,
            moved_to_node=self.result.target_node,
            note=f"moved to {self.result.target_node} ({self.spec.target})",
        )
        shutil.rmtree(self.staging, ignore_errors=True)
        self.state = MigrationState.COMMITTED
        self._journal(state=self.state.value)
        self.result.phases = dict(self.phases.times)
        self.result.total_s = time.monotonic() - t_start
        # Streamed memory crosses during the dump: the copy then spans dump, drain and transfer.
        copy_phases = ("dump", "pages", "transfer") if "pages" in self.phases.times else ("transfer",)
        xfer = sum(self.phases.times.get(p, 0.0) for p in copy_phases)
        self.result.transfer_gbps = self.result.image_bytes / xfer / 1e9 if xfer > 0 else 0.0
        self._set(MigrationState.COMMITTED, "done", f"job {rec.name} runs on {self.result.target_node}")
        self.criu_logs.done(self.spec.migration_id)
        return self.result

    def _externals(self) -> list[str]:
        return dump_externals(self.registry.get(self.spec.job), self.link)

    def _dump(self, root: int, shell_job: bool) -> DumpResult:
        self.link.engage()  # from here nothing reaches the job until the target runs it
        try:
            return self.criu.dump(
                root,
                self.staging,
                shell_job=shell_job,
                on_start=self._criu_started,
                page_server_fd=self.relay.criu_fd if self.relay else -1,
                log_dir=self.criu_logs.dir_for(self.spec.migration_id),
                external=self._externals(),
            )
        except CriuError:
            # A target that refused or broke the page stream makes CRIU fail with a broken
            # pipe; the target's reason is the one to report.
            if self.relay is not None and self.relay.error is not None:
                raise self.relay.error from None
            raise

    def _start_lazy_dump(self, root: int, pids: list[int], shell_job: bool) -> DumpResult:
        """Dump all but the memory, which the target pulls after its restore (post-copy)."""
        assert self.relay is not None
        # Stopped first: when a lazy transfer breaks, CRIU lets the tree go, and it must then
        # stay stopped until the target is known not to run it.
        procs.stop(pids)
        self.link.engage()
        self.lazy_dump = LazyDump(
            self.criu,
            root,
            self.staging,
            self.relay.criu_fd,
            shell_job=shell_job,
            log_dir=self.criu_logs.dir_for(self.spec.migration_id),
            external=self._externals(),
        )
        self._criu_started(self.lazy_dump.pid)
        try:
            self.lazy_dump.ready(LAZY_READY_S)
        except FerryError:
            if self.relay.error is not None:
                raise self.relay.error from None
            raise
        return DumpResult()  # CRIU's stats come once the last page is out

    def _post_copy(self, rec: JobRecord, pids: list[int]) -> StreamDigest:
        """The job runs on the target; serve its memory from the frozen tree until all is there."""
        assert self.lazy_dump is not None and self.relay is not None
        self.emit(Progress("pages", f"the job runs on {self.result.target_node}; its memory follows"))
        timeout = LAZY_READY_S + self.estimated_bytes / POSTCOPY_MIN_BPS
        try:
            self.phases.run("pages", lambda: self.lazy_dump.wait(timeout))  # type: ignore[union-attr]
            return self.relay.finish()
        except Exception as exc:
            err = as_ferry_error(exc, "pages", self.node)
        # The transfer broke after the target resumed the job. The tree here is stopped: it runs
        # nowhere until the target says whether its copy (missing pages, so it kills it) is gone.
        state = self._target_settled()
        if state == pb.TARGET_STATE_RUNNING:
            log.warning(
                "migration %s: post-copy reported %s, but the target has every page",
                self.spec.migration_id,
                err,
            )
            return StreamDigest(self.relay.sent.bytes, "")
        if state in (pb.TARGET_STATE_ABORTED, pb.TARGET_STATE_UNKNOWN):
            self.target_aborted = True
            err = TransferError(
                f"post-copy to {self.result.target_node} failed ({err}); the target killed its copy, so "
                "the job goes on here from where it froze",
                step="pages",
                node=self.node,
            )
        else:
            err = _Unresolved(f"post-copy failed ({err.cause}) and the target has not settled its copy")
        self._abort(rec, pids, err)
        raise AssertionError("unreachable")

    def _target_settled(self) -> int | None:
        """The target's state once it has left POSTCOPY (None: no answer in time)."""
        deadline = time.monotonic() + POSTCOPY_SETTLE_S
        while time.monotonic() < deadline:
            state = self._ask_target()
            if state is not None and state != pb.TARGET_STATE_POSTCOPY:
                return state
            time.sleep(0.5)
        return None

    def _criu_started(self, pid: int) -> None:
        self._journal(criu_pid=pid, criu_started=procs.create_time(pid))

    def _prepare(self, rec: JobRecord) -> None:
        if self.spec.lazy and (why := lazy_dump_blocker()):
            raise RefusedError(
                f"cannot serve post-copy from {self.node}: {why}", hint="or migrate without --lazy"
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
        self.link = LinkLock(self.registry.network, rec.veth)
        if rec.veth and self.registry.network is None:
            raise RefusedError(
                f"job {rec.name!r} has a job-network address ({rec.address}) but this agent has no [network]",
                hint="start the agent with the [network] it had when the job started",
            )
        # Before anything is frozen: what CUDA state there is, and whether the driver can take it.
        self.footprint = self.cuda.inspect(pids)
        _require_host_memory(self.footprint, self.node)
        own = {rec.stdout_path, rec.stderr_path} if rec.kind is JobKind.LAUNCHED else set()
        self.estimated_bytes = procs.tree_rss(rec.pid) + self.footprint.gpu_bytes
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
        )
        lease = self.lease = self.peer.prepare(req)
        if self.spec.lazy and not lease.lazy:
            raise RefusedError(
                f"target {self.spec.target} does not offer post-copy",
                hint="upgrade the target agent, or migrate without --lazy",
            )
        if unmapped := sorted({g.uuid for g in self.footprint.gpus} - {p.old_uuid for p in lease.gpu_map}):
            raise RefusedError(
                f"target {self.spec.target} leased no GPU for {', '.join(unmapped)}",
                hint="upgrade the target agent: it does not move CUDA jobs",
            )

    def _commit(self, last_progress: float) -> pb.CommitResponse:
        req = pb.CommitRequest(migration_id=self.spec.migration_id, last_progress_at=last_progress)
        try:
            return self.peer.commit(req)
        except (UnavailableError, StepTimeoutError) as e:
            # No answer: the target may or may not run the job. Ask before anything else.
            state = self._ask_target()
            if state == pb.TARGET_STATE_RUNNING:
                log.warning(
                    "migration %s: commit answer lost, but the target runs the job", self.spec.migration_id
                )
                return pb.CommitResponse(node_name=self.result.target_node)
            if state in (None, pb.TARGET_STATE_RESTORING):
                raise _Unresolved(str(e)) from e
            if state in (pb.TARGET_STATE_ABORTED, pb.TARGET_STATE_UNKNOWN):
                raise TransferError(f"target lost the migration during commit: {e.cause}") from e
            # It has not started restoring, but our commit may still be on its way: fence it first.
            try:
                self.peer.abort(self.spec.migration_id, f"commit unanswered: {e.cause}")
            except FerryError as abort_err:
                raise _Unresolved(f"{e}; and the target could not be told to abort") from abort_err
            self.target_aborted = True
            raise TransferError(f"target did not act on the commit ({e.cause}); aborted there") from e

    def _ask_target(self) -> int | None:
        for _ in range(5):
            try:
                return self.peer.status(self.spec.migration_id)
            except (UnavailableError, StepTimeoutError):
                time.sleep(1.0)
        return None

    def _abort(self, rec: JobRecord, pids: list[int], err: FerryError) -> None:
        phase = self.state.value
        if isinstance(err, _Unresolved):
            self.state = MigrationState.UNRESOLVED
            note = unresolved_note(rec.name, self.spec.target)
            self.registry.update(rec.name, note=note)
            self._journal(state=self.state.value, note=note)
            raise _Unresolved(note, step="commit", node=self.node) from err
        self._set(MigrationState.ABORTING, "abort", f"aborting: {err}")
        if self.relay is not None:
            self.relay.close()
        if self.lazy_dump is not None:
            self._end_lazy_dump()
        try:
            if not self.target_aborted:
                self.peer.abort(self.spec.migration_id, str(err))
        except FerryError as e:
            log.warning("migration %s: target abort failed: %s", self.spec.migration_id, e)
        _go_on(pids, self.link)  # first: the driver's restore thread must run for the CUDA calls below
        note = f"migration to {self.spec.target} aborted while {phase}: {err.cause}"
        outcome = f"the job keeps running on {self.node}"
        hint = err.hint
        if self.cuda_frozen and (undone := self.cuda.unfreeze(self.footprint)):
            outcome = f"the job's processes run on {self.node}, but {undone.summary()}"
            hint = cuda.UNDO_HINT
            note += f"; {outcome}; {hint}"
        running = procs.alive(rec.pid, rec.pid_started)
        self.registry.update(
            rec.name,
            state=JobState.RUNNING if running else JobState.EXITED,
            migration_id="",
            note=note,
        )
        shutil.rmtree(self.staging, ignore_errors=True)
        self.state = MigrationState.ABORTED
        self._journal(state=self.state.value, note=note)
        raise MigrationAbortedError(
            f"{err.cause}; migration aborted, {outcome}",
            step=err.step or phase,
            node=err.node or self.node,
            hint=hint,
        ) from err

    def _end_lazy_dump(self) -> None:
        """Its page stream is closed, so CRIU fails and lets the (stopped) tree go: wait for that,
        or a SIGCONT sent meanwhile is undone when CRIU puts the tree back the way it found it."""
        assert self.lazy_dump is not None
        try:
            self.lazy_dump.wait(LAZY_READY_S)
        except FerryError as e:
            log.info("migration %s: lazy dump ended: %s", self.spec.migration_id, e)


class _Unresolved(FerryError):
    # Not "unavailable": a client would read that as this agent being unreachable.
    kind = "aborted"


def gpu_needs(rec: JobRecord, fp: Footprint) -> list[pb.GpuNeed]:
    """What the target must offer: the GPUs the job's CUDA processes hold, and those `ferry run
    --gpu` gave it (a job keeps its GPUs to itself, even before or without a CUDA context)."""
    out = [pb.GpuNeed(uuid=g.uuid, name=g.name, memory_bytes=g.memory_bytes) for g in fp.gpus]
    seen = {g.uuid for g in fp.gpus}
    out += [pb.GpuNeed(uuid=u, name=rec.gpu_chip, memory_bytes=0) for u in rec.gpus if u not in seen]
    return out


def unresolved_note(job: str, target: str) -> str:
    return (
        f"UNRESOLVED: target {target} stopped answering while restoring, so whether it runs the job is "
        "unknown; this copy is kept frozen so that two never run. The agent keeps asking the target and "
        f"settles it when it answers. To settle it now: `ferry resolve {job} --resume` if the job does "
        f"not run on {target}, `ferry resolve {job} --finish` if it does"
    )


def as_ferry_error(exc: BaseException, step: str, node: str) -> FerryError:
    """Ours as is; anything else (an OSError on a full tmpfs, say) named by step and node."""
    if isinstance(exc, FerryError):
        return exc
    cause = f"{exc.strerror}: {exc.filename}" if isinstance(exc, OSError) and exc.strerror else repr(exc)
    err = FerryError(cause, step=step, node=node)
    err.__cause__ = exc
    return err


def restore_tree(
    registry: JobRegistry,
    criu: Criu,
    image_dir: Path,
    manifest: Manifest,
    name: str,
    note: str,
    *,
    cuda_jobs: CudaJobs,
    gpu_map: dict[str, str],
    times: dict[str, float] | None = None,
    on_criu_start: Callable[[int], None] | None = None,
    before_release: Callable[[JobRecord], None] | None = None,
    lazy_pages: bool = False,
    resuming: bool = False,
    log_dir: Path | None = None,
) -> JobRecord:
    """Restore a verified image as job `name` on this node, its logs re-pointed to our job dir.
    CRIU logs in log_dir (by default the job's dir); a lazy restore's daemon must listen there.

    CRIU restores the tree stopped. A CUDA job then gets SIGCONT (the driver's
    restore thread must run) and its device memory back onto the GPUs of
    gpu_map, still locked, so its CUDA calls wait. Until `before_release` has
    returned (a target journals RUNNING there), the job cannot make progress,
    and any failure kills it: no copy runs that its node has not recorded.
    Only then the tree continues (SIGCONT, or the CUDA unlock).
    """
    times = {} if times is None else times
    spec = manifest.job
    registry.reserve_name(name, resuming=resuming)
    job_dir = registry.job_dir(name)
    job_dir.mkdir(parents=True, exist_ok=True)
    out, err = job_dir / "stdout.log", job_dir / "stderr.log"
    inherit: list[InheritFd] = []
    fds: list[int] = []
    try:
        external: list[str] = []
        if spec.kind == JobKind.LAUNCHED.value:
            for src, dst, key in ((STDOUT_LOG, out, spec.stdout_path), (STDERR_LOG, err, spec.stderr_path)):
                shutil.copyfile(image_dir / src, dst)
                if not spec.private:
                    fds.append(os.open(dst, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC))
                    inherit.append(InheritFd(key, fds[-1]))
            if spec.private:  # CRIU binds our copy of the logs where the job sees them, and reopens them
                external.append(f"mnt[{LOG_MOUNT_KEY}]:{job_dir}")
            paths = (str(out), str(err))
        else:
            paths = (spec.stdout_path, spec.stderr_path)
        if not spec.private:  # a private job's sockets live in its own /tmp, which CRIU restores
            for d in bound_socket_dirs(image_dir):
                d.mkdir(mode=0o700, parents=True, exist_ok=True)
        net = _job_link(registry, spec, name)
        if net and registry.network is not None:
            external.append(registry.network.criu_restore_external(net))
        t = time.monotonic()
        try:
            res = criu.restore(
                image_dir,
                inherit=inherit,
                shell_job=spec.shell_job,
                log_dir=log_dir or job_dir,
                on_start=on_criu_start,
                leave_stopped=True,
                lazy_pages=lazy_pages,
                root="/" if spec.private else "",
                external=external,
            )
        except BaseException:
            if net and registry.network is not None:
                registry.network.delete(net)  # whatever CRIU made of the job's link before failing
            raise
        times["restore"] = time.monotonic() - t
    finally:
        for fd in fds:
            os.close(fd)
    # From here a restored tree exists: any failure must take it down, or two copies could run.
    pids: list[int] = []
    try:
        pids = procs.tree_pids(res.pid)
        if manifest.cuda is not None:
            procs.resume(pids)
            plan = restore_plan(cuda_jobs.view, pids, manifest.cuda, gpu_map, criu.node)
            cuda_jobs.thaw(plan, times, unlock=False)
        gpus_here = [gpu_map.get(u, u) for u in spec.gpus]
        spec_here = JobSpec(**{**spec.__dict__, "name": name, "gpus": gpus_here})
        rec = registry.register_restored(spec_here, res.pid, paths[0], paths[1], note=note, veth=net)
        if before_release is not None:
            before_release(rec)
    except BaseException:
        _kill_restored(res.pid)
        if net and registry.network is not None:
            registry.network.delete(net)
        raise
    # Recorded as running: from now on this is the job's one copy, so it is never killed here.
    if net and registry.network is not None:
        registry.network.announce(res.pid, spec.address)  # the segment learns the job's new port
    try:
        if manifest.cuda is not None:
            cuda_jobs.unlock([pid for pid, _ in plan], times)
        else:
            procs.resume(pids)
    except Exception as e:
        log.error("job %s: restored, but could not be released: %s", name, e)
        rec = registry.update(name, note=f"{note}; its CUDA calls stay blocked: unlock failed: {e}")
    return rec


def _go_on(pids: list[int], link: LinkLock) -> None:
    """The dumped tree runs on here: its TCP sockets out of repair mode, its link back on the
    bridge, then SIGCONT (CRIU left it stopped)."""
    tcp_repair.release(pids)
    link.release()
    procs.resume(pids)


def dump_externals(rec: JobRecord, link: LinkLock | None = None) -> list[str]:
    """What CRIU must treat as outside the job: its log mount and its link."""
    ext = [f"mnt[{LOG_MOUNT}]:{LOG_MOUNT_KEY}"] if rec.private else []
    return ext + (link.external() if link is not None else [])


def _job_link(registry: JobRegistry, spec: JobSpec, name: str) -> str:
    """The name of the job's new link here ("" for a job on the node's network); refuses a job
    whose address this node's job network does not carry."""
    if not spec.address:
        return ""
    carrying(registry.network, spec.address, registry.node, "restore")
    return veth_name(f"{registry.node}/{name}/{time.time_ns()}")


def _require_host_memory(fp: Footprint, node: str) -> None:
    """The CUDA checkpoint stages device memory in the job's host memory: refuse if it cannot fit."""
    available = psutil.virtual_memory().available
    if fp.gpu_bytes and fp.gpu_bytes > available:
        raise RefusedError(
            f"the job holds {gib(fp.gpu_bytes)} of GPU memory, which its checkpoint copies into host "
            f"memory, but only {gib(available)} is available",
            step="cuda check",
            node=node,
            hint="free host memory on this node first",
        )


def _kill_restored(root: int) -> None:
    """A restored tree that must not run: kill it and reap its root (our child, via rst_sibling)."""
    procs.signal_all(list(reversed(procs.tree_pids(root))), 9)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(root, 0)


def default_cuda_jobs(node: str, config: CudaConfig | None = None) -> CudaJobs:
    cfg = config or CudaConfig()
    driver = cuda.CudaDriver(node=node, explicit_gpu_pairs=cfg.explicit_gpu_pairs)
    return CudaJobs(driver, Nvml(node=node), node, ProcView(), cfg.lock_timeout_s)


def wait_for_output(rec: JobRecord, timeout_s: float) -> float:
    """Unix time of the job's first new output after restore (0 if none came in time)."""
    paths = [p for p in (rec.stdout_path, rec.stderr_path) if p]
    sizes = {p: os.path.getsize(p) for p in paths if os.path.exists(p)}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p, size in sizes.items():
            if os.path.getsize(p) > size:
                return os.stat(p).st_mtime
        time.sleep(0.002)
    return 0.0


# -- local save and resume --------------------------------------------------------


def checkpoint(
    registry: JobRegistry,
    criu: Criu,
    name: str,
    out_dir: Path,
    node: str,
    leave_running: bool,
    emit: Emit = lambda p: None,
    cuda_jobs: CudaJobs | None = None,
) -> MigrationResult:
    """Save a job to `out_dir`; unless leave_running, it then ends here (state CHECKPOINTED).

    A CUDA job's device memory is saved too; ending it frees its GPUs.
    """
    cj = cuda_jobs or default_cuda_jobs(node)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise InvalidArgumentError(f"{out_dir} is not empty; choose a new directory for the image", node=node)
    rec = registry.begin_move(name, f"checkpoint-{int(time.time())}", "checkpoint")
    link = LinkLock(registry.network, rec.veth)
    phases = _Phases()
    pids: list[int] = []
    fp = Footprint()
    frozen = False
    t0 = time.monotonic()
    try:
        tree = procs.tree_pids(rec.pid)
        refuse_undumpable(tree, node, step="checkpoint", same_node=True)
        fp = cj.inspect(tree)
        _require_host_memory(fp, node)
        out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # the job's memory: root only
        emit(Progress("dump", f"dumping job {name} to {out_dir}"))
        if fp.processes:
            cj.freeze(fp, phases.times)
            frozen = True
        shell_job = _needs_shell_job(rec, tree)
        # Stopped, not killed, so the logs copied below end exactly where the dump did.
        link.engage()
        dump = phases.run(
            "dump",
            lambda: criu.dump(rec.pid, out_dir, shell_job=shell_job, external=dump_externals(rec, link)),
        )
        pids = procs.tree_pids(rec.pid)
        _copy_logs(rec, out_dir)
        emit(Progress("transfer", "writing the manifest and digests"))
        job = JobSpec(**{**rec.spec().__dict__, "shell_job": shell_job})
        m = phases.run(
            "digest",
            lambda: build_manifest(
                out_dir,
                job,
                node,
                criu_stats=dump.stats,  # type: ignore[attr-defined]
                timings=dict(phases.times),
                gpu_bytes=fp.gpu_bytes,
                cuda=fp.section(),
            ),
        )
    except Exception as exc:
        e = as_ferry_error(exc, "checkpoint", node)
        _go_on(pids, link)
        note = f"checkpoint failed: {e.cause}"
        if frozen and (undone := cj.unfreeze(fp)):
            note += f"; {undone.summary()}; {cuda.UNDO_HINT}"
            e.cause += f"; {undone.summary()}"
            e.hint = cuda.UNDO_HINT
        registry.update(name, state=JobState.RUNNING, migration_id="", note=note)
        e.at(step="checkpoint", node=node)
        if e is exc:
            raise
        raise e from exc
    assert isinstance(m, Manifest)
    if leave_running:
        _go_on(pids, link)
        undone = cj.unfreeze(fp) if frozen else cuda.UndoReport()
        note = f"checkpointed to {out_dir}"
        if undone:
            note += f"; but here {undone.summary()}: its CUDA calls stay blocked"
        registry.update(name, state=JobState.RUNNING, migration_id="", note=note)
        if undone:
            raise FerryError(
                f"saved to {out_dir}, but {undone.summary()}",
                step="checkpoint",
                node=node,
                hint=f"the image is complete: `ferry stop {name}`, then `ferry restore {out_dir}`",
            )
    else:
        registry.kill_tree(rec, pids)
        if link.network is not None:
            link.network.delete(link.veth)
        cj.release(fp)
        registry.update(
            name, state=JobState.CHECKPOINTED, checkpoint_dir=str(out_dir), note=f"saved to {out_dir}"
        )
    res = MigrationResult("", name, node, phases=phases.times, image_dir=str(out_dir))
    res.host_bytes, res.image_bytes, res.gpu_bytes = m.host_bytes, m.image_bytes, m.gpu_bytes
    res.total_s = time.monotonic() - t0
    emit(Progress("done", f"job {name} saved to {out_dir}"))
    return res


def restore_image(
    registry: JobRegistry,
    criu: Criu,
    image_dir: Path,
    name: str,
    node: str,
    cuda_jobs: CudaJobs | None = None,
    claim: Callable[[Callable[[Mapping[str, str]], dict[str, str]]], dict[str, str]] | None = None,
) -> JobRecord:
    """Resume a saved image on this node, after checking every digest; a CUDA job onto suitable GPUs.

    `claim` chooses its GPUs, given those it may not take, and holds them for it
    (TargetMigrations.claim); without one, any suitable GPU will do.
    """
    if not image_dir.is_dir():
        raise NotFoundError(f"no image directory {image_dir} on this node", node=node)
    m = verify(image_dir)
    cj = cuda_jobs or default_cuda_jobs(node)
    claim = claim or (lambda pick: pick({}))
    gpu_map = claim(lambda reserved: local_gpu_map(cj, m, reserved))
    rec = restore_tree(
        registry,
        criu,
        image_dir,
        m,
        name or m.job.name,
        note=f"restored from {image_dir}" + (f" onto {', '.join(gpu_map.values())}" if gpu_map else ""),
        cuda_jobs=cj,
        gpu_map=gpu_map,
    )
    log.info("job %s: restored from %s as pid %d", rec.name, image_dir, rec.pid)
    return rec


def local_gpu_map(cj: CudaJobs, m: Manifest, reserved: Mapping[str, str]) -> dict[str, str]:
    """GPUs here for a saved job: its CUDA state's and those `ferry run --gpu` gave it."""
    needs = list(m.cuda.gpus) if m.cuda else []
    seen = {n.uuid for n in needs}
    needs += [GpuNeed(u, m.job.gpu_chip, 0) for u in m.job.gpus if u not in seen]
    return cj.choose_gpus(
        needs,
        driver_version=m.cuda.driver_version if m.cuda else "",
        reserved=reserved,
        cuda_state=m.cuda is not None,
    )


def resume_preempted(
    registry: JobRegistry,
    criu: Criu,
    rec: JobRecord,
    claim: Callable[[Callable[[Mapping[str, str]], dict[str, str]]], dict[str, str]],
    node: str,
    cuda_jobs: CudaJobs,
) -> JobRecord:
    """Resume a job suspended by a preemption; NoFreeGpuError while no GPU here can take it.

    `claim` chooses its GPUs and holds them until the restore is over (TargetMigrations.claim).
    The record stays PREEMPTED until the restored job replaces it: a failure or a crash on
    the way leaves it waiting, never lost.
    """
    image_dir = Path(rec.checkpoint_dir)
    m = read_manifest(image_dir)  # cheap; the digests are checked once a GPU is free
    gpu_map = claim(lambda reserved: local_gpu_map(cuda_jobs, m, reserved))
    try:
        verify(image_dir, m)
        new = restore_tree(
            registry,
            criu,
            image_dir,
            m,
            rec.name,
            note=f"resumed after preemption from {image_dir}",
            cuda_jobs=cuda_jobs,
            gpu_map=gpu_map,
            resuming=True,
        )
    except FerryError as e:
        registry.update(rec.name, note=f"{rec.note}; the last resume failed: {e}")
        raise
    shutil.rmtree(image_dir, ignore_errors=True)
    log.info("job %s: resumed after preemption as pid %d", rec.name, new.pid)
    return new
