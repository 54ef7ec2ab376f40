"""The source side of a migration: one SourceMigration drives one job from prepare to commit.

Protocol (docs/architecture.md): prepare (target grants a lease and maps the job's GPUs,
nothing frozen) → freeze (CUDA lock and checkpoint, then CRIU with the tree left stopped)
→ transfer (digested stream) → commit (target restores with CRIU, then CUDA onto its
GPUs, and reports RUNNING; only then the source ends its frozen copy). Any failure before
the target runs the job aborts: the source resumes its frozen copy (agent.migration.rollback).
Every state change goes through SOURCE_TRANSITIONS (agent.migration.states) and is journaled
before the step it names acts.

Why one module: `SourceMigration` is one migration's state machine, and the order of
its steps (each journaled before it acts) is the thing a reader checks; split across
files, that order would be hidden. What other moves share lives in capture, restore
and rollback.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import replace
from pathlib import Path

from agent import faults
from agent.client import split_address
from agent.criu.dumpable import refuse_node_sockets, refuse_undumpable
from agent.criu.lazy import LazyDump
from agent.criu.logs import CriuLogs
from agent.criu.runner import Criu, DumpResult
from agent.cuda import driver as cuda
from agent.cuda.jobs import CudaJobs, Footprint
from agent.errors import (
    CriuError,
    FerryError,
    InvalidArgumentError,
    MigrationAbortedError,
    NotFoundError,
    RefusedError,
    TransferError,
    UnauthenticatedError,
    as_ferry_error,
)
from agent.gpus.inventory import gib
from agent.image import (
    FileEntry,
    JobSpec,
    Manifest,
    StreamDigest,
    host_bytes,
)
from agent.jobs import procs
from agent.jobs.network import LinkLock
from agent.jobs.record import JobKind, JobRecord, JobState
from agent.jobs.registry import JobRegistry
from agent.migration import rollback
from agent.migration.capture import (
    Phases,
    copy_logs,
    dump_externals,
    needs_shell_job,
    require_host_memory,
)
from agent.migration.datapath import SourceDataPath
from agent.migration.fencing import TargetAnswer, Verdict, ask_target, decide
from agent.migration.journal import SOURCE, Journal, MigrationRecord
from agent.migration.limits import RateLog, refuse_long_pause
from agent.migration.model import (
    Emit,
    Method,
    MigrationResult,
    MigrationSpec,
    Peer,
    Progress,
    unresolved_note,
)
from agent.migration.pagestream import lazy_bytes, sent_bytes, staged_page_bytes
from agent.migration.states import (
    NOT_SENT,
    SOURCE_TRANSITIONS,
    CudaLeft,
    MigrationState,
    cuda_left,
)
from agent.migration.transfer import SendStats, send_image
from agent.rpc import pb

log = logging.getLogger(__name__)


#: How long a lazy dump may take to write all but the memory (and to end once its stream is cut).
LAZY_READY_S = 300.0
#: The slowest post-copy ferry waits for before it gives up on the target (bytes per second).
POSTCOPY_MIN_BPS = 20e6
#: After a broken post-copy: how long the target may take to kill its copy and say so.
POSTCOPY_SETTLE_S = 30.0
#: A lazy dump's image beyond this in pages files: CRIU left memory eager (a warning, logs kept).
EAGER_WARN_BYTES = 64 << 20


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
        *,
        cuda_jobs: CudaJobs,
        journal: Journal,
    ) -> None:
        self.spec = spec
        self.journal = journal
        #: CRIU's logs of this migration: kept where the errors say when it fails.
        self.criu_logs = CriuLogs(registry.root.parent)
        self.cuda = cuda_jobs
        self.footprint = Footprint()
        self.link = LinkLock(None, "")  # the job's link, cut during the move (agent.jobs.network)
        self.registry = registry
        self.criu = criu
        self.peer = peer
        self.staging = staging_root / f"out-{spec.migration_id}"
        self.node = node
        self.agent_id = agent_id
        self.emit = emit
        self.state = MigrationState.PREPARING
        self.lease = pb.Lease()
        self.prepare_sent = False
        #: The job's memory goes CRIU to CRIU on a data connection this owns (None: staged push).
        self.data = SourceDataPath(
            spec.migration_id, node, lambda: (self.record.criu_pid, self.record.criu_started), staging_root
        )
        self.direct = False
        self.lazy_dump: LazyDump | None = None
        #: CRIU's logs outlive a success that looked wrong (a lazy dump that went eager).
        self.keep_criu_logs = False
        self.estimated_bytes = 0
        self.phases = Phases()
        #: How fast this agent's moves froze jobs: a member's expected pause is judged by it.
        self.rates = RateLog(registry.root.parent)
        self.result = MigrationResult(spec.migration_id, spec.job, node, target=spec.target)
        self.record = MigrationRecord(
            spec.migration_id, SOURCE, spec.job, self.state.value, peer=spec.target, staging=str(self.staging)
        )

    def _journal(self, **changes: object) -> None:
        """Durable before acting: after a crash the record names the furthest this may have got."""
        for k, v in changes.items():
            setattr(self.record, k, v)
        self.journal.save(self.record)

    def _to(self, state: MigrationState, **changes: object) -> None:
        """Every state change: checked against SOURCE_TRANSITIONS, journaled before it acts."""
        subject = f"{self.spec.migration_id} (job {self.spec.job})"
        self.state = SOURCE_TRANSITIONS.check(self.state, state, subject)
        self._journal(state=state.value, **changes)

    def _set(self, state: MigrationState, phase: str, message: str, **changes: object) -> None:
        self._to(state, **changes)
        log.info("migration %s (job %s): %s", self.spec.migration_id, self.spec.job, message)
        self.emit(Progress(phase, message))

    def _cuda_step(self, step: str) -> None:
        """The freeze's progress (agent.cuda.driver.freeze): each step journaled as it is reached."""
        self._to({"locked": MigrationState.LOCKED, "checkpointing": MigrationState.CHECKPOINTING}[step])

    def run(self) -> MigrationResult:
        t_start = time.monotonic()
        rec = self.registry.begin_move(self.spec.job, self.spec.migration_id, "migration")
        self.record.pids = [rec.pid]
        try:
            self._journal()  # PREPARING: the record exists before anything else happens
            asking = f"asking {self.spec.target} for a lease"
            log.info("migration %s (job %s): %s", self.spec.migration_id, rec.name, asking)
            self.emit(Progress("prepare", asking))
            self.phases.run("prepare", lambda: self._prepare(rec))
        except Exception as exc:
            e = as_ferry_error(exc, "prepare", self.node)
            self._release_lease(e)
            self.registry.update(
                rec.name, state=JobState.RUNNING, migration_id="", note=f"migration refused: {e}"
            )
            self._to(MigrationState.ABORTED, note=str(e))
            e.at(step="prepare", node=self.node)
            if e is exc:
                raise
            raise e from exc

        pids: list[int] = []
        frozen_at = 0.0
        try:
            # The first freezing step, journaled before it acts: the CUDA lock (a crash mid-freeze
            # must be undone), or for a job without CUDA processes the dump itself.
            first = MigrationState.LOCKING if self.footprint.processes else MigrationState.DUMPING
            self._set(first, "dump", "freezing and dumping the job", cuda_pids=self.footprint.pids)
            faults.check("dump", self.node)
            self.staging.mkdir(mode=0o700, parents=True)
            if self.direct:
                # Post-copy sends the memory after the commit, as the target asks for it.
                what = "streaming the job's memory to the target"
                step = "pages" if self.spec.lazy else "dump"
                self.data.open(
                    self.peer.stream_pages, rec.pid, step, lambda n: self.emit(Progress(step, what, n))
                )
                if not self.spec.lazy:  # before anything freezes: where the target's page server is
                    self.data.target(split_address(self.spec.target)[0])
            frozen_at = time.monotonic()
            if self.footprint.processes:
                self.emit(Progress("dump", f"copying {gib(self.footprint.gpu_bytes)} of GPU memory to host"))
                self.cuda.freeze(self.footprint, self.phases.times, self.spec.lock_timeout_s, self._cuda_step)
                self._to(MigrationState.CHECKPOINTED)
                self._to(MigrationState.DUMPING)
            shell_job = needs_shell_job(rec, procs.tree_pids(rec.pid))
            if self.spec.lazy:
                pids = procs.tree_pids(rec.pid)
                self._journal(pids=pids)
                dump = self.phases.run("dump", lambda: self._start_lazy_dump(rec.pid, pids, shell_job))
                pages = None
            else:
                dump = self.phases.run("dump", lambda: self._dump(rec.pid, shell_job))
                pids = procs.tree_pids(rec.pid)  # the stopped tree
                self._journal(pids=pids)
                pages = None
                if self.direct:
                    sent = sent_bytes(dump.stats)  # type: ignore[attr-defined]
                    pages = self.phases.run("pages", lambda: self.data.pages.finish(sent))  # type: ignore[union-attr]
            assert pages is None or isinstance(pages, StreamDigest)
            faults.check("source-dumped", self.node)
            copy_logs(rec, self.staging)

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

            streamed = pages.bytes if pages else 0  # crossed already, during the dump

            def progress(n: int) -> None:
                if n % (64 << 20) < (1 << 20) or n == total:
                    self.emit(Progress("transfer", "streaming the image", streamed + n, streamed + total))

            chunks = send_image(self.spec.migration_id, self.staging, manifest, sent, progress)
            self.phases.run("transfer", lambda: self.peer.push(chunks))
            self.result.image_bytes = sent.bytes + streamed
            self.result.host_bytes = host_bytes(sent.entries) + streamed
            self.result.gpu_bytes = self.footprint.gpu_bytes

            self._set(MigrationState.RESTORING, "restore", f"target {self.result.target_node} restoring")
            faults.check("commit", self.node)
            resp = self.phases.run("commit", self._commit)
        except Exception as exc:
            self._abort(rec, pids, as_ferry_error(exc, self.state.value, self.node))
            raise AssertionError("unreachable") from exc  # _abort always raises
        # Frozen until the target released the job: its answer says how long ago that was.
        self.result.frozen_s = time.monotonic() - resp.answered_after_s - frozen_at
        self._downtime(resp)
        if self.lazy_dump is not None:
            self._to(MigrationState.PAGING)
            pages = self._post_copy(rec, pids)
            self.result.image_bytes += pages.bytes
            self.result.host_bytes += pages.bytes

        # Committed: the target runs the job. Only now the frozen copy goes, and its link.
        rollback.finish(
            self.registry,
            rollback.FrozenCopy(rec, pids, self.link),
            JobState.MOVED,
            f"moved to {self.result.target_node} ({self.spec.target})",
            cuda_gone=lambda: self.cuda.release(self.footprint),
            moved_to=self.spec.target,
            moved_to_node=self.result.target_node,
        )
        self.rates.record(self.result.image_bytes, self.result.frozen_s)
        for t in resp.phases:
            self.phases.times[f"target {t.phase}"] = t.seconds
        if self.lazy_dump is not None and "pages" in self.phases.times:
            self.result.downtime_by += (
                f"; then its memory followed on demand for {self.phases.times['pages']:.2f} s"
            )
        shutil.rmtree(self.staging, ignore_errors=True)
        self.data.close()
        self.result.phases = dict(self.phases.times)
        self.result.total_s = time.monotonic() - t_start
        # Streamed memory crosses during the dump: the copy then spans dump, drain and transfer.
        copy_phases = ("dump", "pages", "transfer") if "pages" in self.phases.times else ("transfer",)
        xfer = sum(self.phases.times.get(p, 0.0) for p in copy_phases)
        self.result.transfer_gbps = self.result.image_bytes / xfer / 1e9 if xfer > 0 else 0.0
        self._set(MigrationState.COMMITTED, "done", f"job {rec.name} runs on {self.result.target_node}")
        if not self.keep_criu_logs:
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
                page_server=(self.data.host, self.data.port) if self.direct else None,
                tls=self.data.tls.files if self.direct and self.data.tls else None,
                log_dir=self.criu_logs.dir_for(self.spec.migration_id),
                external=self._externals(),
            )
        except CriuError:
            # A target that refused or broke the page stream makes CRIU fail with a broken
            # connection; the target's reason is the one to report.
            if self.direct and self.data.pages and (err := self.data.pages.settled_error()) is not None:
                raise err from None
            raise

    def _start_lazy_dump(self, root: int, pids: list[int], shell_job: bool) -> DumpResult:
        """Dump all but the memory, which the target pulls after its restore (post-copy)."""
        assert self.data.pages is not None and self.data.tls is not None
        # Stopped first: when a lazy transfer breaks, CRIU lets the tree go, and it must then
        # stay stopped until the target is known not to run it.
        procs.stop(pids)
        self.link.engage()
        self.lazy_dump = LazyDump(
            self.criu,
            root,
            self.staging,
            self.data.listen(split_address(self.spec.target)[0]),
            self.data.tls.files,
            shell_job=shell_job,
            log_dir=self.criu_logs.dir_for(self.spec.migration_id),
            external=self._externals(),
        )
        self._criu_started(self.lazy_dump.pid)
        try:
            self.lazy_dump.ready(LAZY_READY_S)
        except FerryError:
            if (err := self.data.pages.error) is not None:
                raise err from None
            raise
        self.data.pages.announce(self.data.host, self.data.port)
        self._check_lazy(staged_page_bytes(self.staging))
        return DumpResult()  # CRIU's stats come once the last page is out

    def _check_lazy(self, eager: int) -> None:
        """A lazy dump should leave the memory behind; CRIU has been seen to write it all into the
        image instead (the move then crosses the gRPC relay as a staged pre-copy). Said in the
        result and the log, and CRIU's logs are kept to find out why."""
        if eager < EAGER_WARN_BYTES:
            return
        self.keep_criu_logs = True
        note = f"CRIU dumped {eager / 1e9:.2f} GB of the memory eagerly instead of leaving it lazy"
        self.result.method = f"{self.result.method} ({note})"
        log.warning(
            "migration %s: %s; its CRIU logs are kept in %s",
            self.spec.migration_id,
            note,
            self.criu_logs.dir_for(self.spec.migration_id),
        )

    def _post_copy(self, rec: JobRecord, pids: list[int]) -> StreamDigest:
        """The job runs on the target; serve its memory from the frozen tree until all is there."""
        assert self.lazy_dump is not None and self.data.pages is not None
        pages = self.data.pages
        self.emit(Progress("pages", f"the job runs on {self.result.target_node}; its memory follows"))
        timeout = LAZY_READY_S + self.estimated_bytes / POSTCOPY_MIN_BPS
        try:
            done = self.phases.run("pages", lambda: self.lazy_dump.wait(timeout))  # type: ignore[union-attr]
            return pages.finish(lazy_bytes(done.stats))
        except Exception as exc:
            err = as_ferry_error(exc, "pages", self.node)
        # The transfer broke after the target resumed the job. The tree here is stopped: it runs
        # nowhere until the target says whether its copy (missing pages, so it kills it) is gone.
        verdict = decide(MigrationState.PAGING, self._target_settled())
        if verdict is Verdict.FINISH:
            log.warning(
                "migration %s: post-copy reported %s, but the target has every page",
                self.spec.migration_id,
                err,
            )
            return StreamDigest(0, "")
        if verdict is Verdict.RESUME:
            err = _TargetAborted(
                f"post-copy to {self.result.target_node} failed ({err}); the target killed its copy, so "
                "the job goes on here from where it froze",
                step="pages",
                node=self.node,
            )
        else:
            err = _Unresolved(f"post-copy failed ({err.cause}) and the target has not settled its copy")
        self._abort(rec, pids, err)
        raise AssertionError("unreachable")

    def _target_settled(self) -> TargetAnswer:
        """The target's word once it has left POSTCOPY (UNKNOWN: none in time)."""
        deadline = time.monotonic() + POSTCOPY_SETTLE_S
        while True:
            answer = self._ask_target()
            if answer is not TargetAnswer.UNKNOWN or time.monotonic() >= deadline:
                return answer
            time.sleep(0.5)

    def _criu_started(self, pid: int) -> None:
        self._journal(criu_pid=pid, criu_started=procs.create_time(pid))

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
        self.link = LinkLock(self.registry.network, rec.veth)
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
        self.estimated_bytes = procs.tree_rss(rec.pid) + self.footprint.gpu_bytes
        # A member of a distributed job: its peers wait only so long (agent.migration.limits).
        refuse_long_pause(rec, self.estimated_bytes, self.rates, self.node)
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
        self.prepare_sent = True  # from here the target may hold a lease, answered or not
        lease = self.lease = self.peer.prepare(req)
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

    def _downtime(self, resp: pb.CommitResponse) -> None:
        """The job stopped running at its freeze (it was running: its CPU time grew) and ran again
        when its CPU time grew on the target, which the target timed from the release."""
        if resp.resumed_after_s < 0:
            self.result.downtime_by = "not measured: the target did not see the job run within its look"
            return
        self.result.downtime_s = self.result.frozen_s + resp.resumed_after_s
        self.result.downtime_by = (
            f"CPU time: the job stopped at its freeze and ran again {resp.resumed_after_s * 1000:.1f} ms "
            f"after its release on {self.result.target_node}"
        )

    def _commit(self) -> pb.CommitResponse:
        req = pb.CommitRequest(migration_id=self.spec.migration_id)
        try:
            return self.peer.commit(req)
        except Exception as exc:
            # Whatever the failure, the commit may have reached the target: only its word decides.
            e = as_ferry_error(exc, "commit", self.node)
            verdict = decide(MigrationState.RESTORING, self._ask_target(fence=f"commit failed: {e.cause}"))
            if verdict is Verdict.FINISH:
                log.warning(
                    "migration %s: commit answer lost (%s), but the target runs the job",
                    self.spec.migration_id,
                    e.cause,
                )
                return pb.CommitResponse(node_name=self.result.target_node, resumed_after_s=-1.0)
            if verdict is Verdict.RESUME:
                raise _TargetAborted(
                    f"the commit failed ({e.cause}) and the target confirmed it does not run the job"
                ) from exc
            raise _Unresolved(str(e)) from exc

    def _ask_target(self, fence: str = "") -> TargetAnswer:
        return ask_target(self.peer, self.spec.migration_id, fence=fence, sleep=time.sleep)

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

    def _verdict(self, phase: MigrationState, err: FerryError) -> Verdict:
        """The decision (agent.migration.fencing) for a failure while `phase`: decided already
        where the target's word was taken, else asked now if commit may have been sent."""
        if isinstance(err, _Unresolved):
            return Verdict.HOLD
        if isinstance(err, _TargetAborted):
            return Verdict.RESUME  # the target confirmed it: ask_target's answer, taken already
        if phase in NOT_SENT:
            return decide(phase, TargetAnswer.UNKNOWN)  # commit never sent: its answer is moot
        answer = self._ask_target(fence=f"source {self.node} failed while {phase.value}: {err.cause}")
        return decide(phase, answer)

    def _abort(self, rec: JobRecord, pids: list[int], err: FerryError) -> None:
        phase = self.state
        if self._verdict(phase, err) is not Verdict.RESUME:
            # HOLD, or a late RUNNING met on an error path: frozen, and recovery settles it.
            note = unresolved_note(rec.name, self.spec.target)
            self.registry.update(rec.name, note=note)
            self._to(MigrationState.UNRESOLVED, note=note)
            raise _Unresolved(f"{note} ({err.cause})", step=err.step or "commit", node=self.node) from err
        self._set(MigrationState.ABORTING, "abort", f"aborting: {err}")
        self.data.cut()
        self.data.close()
        if self.lazy_dump is not None:
            self._end_lazy_dump()
        try:
            if phase in NOT_SENT:  # the target frees its lease now; after commit, ask_target fenced it
                self.peer.abort(self.spec.migration_id, str(err))
        except FerryError as e:  # commit was never sent: its lease runs out on its own
            log.warning("migration %s: target abort failed: %s", self.spec.migration_id, e)
        # A freeze that failed undid itself (agent.cuda.driver.freeze); a finished one is undone here.
        left = cuda_left(phase, bool(self.footprint.processes))
        left = left if left is CudaLeft.CHECKPOINTED else CudaLeft.NONE
        copy = rollback.FrozenCopy(rec, pids, self.link, self.footprint.pids, left)
        note = f"migration to {self.spec.target} aborted while {phase.value}: {err.cause}"
        outcome = f"the job keeps running on {self.node}"
        hint = err.hint

        def say(r: rollback.Resumed) -> str:
            nonlocal outcome, hint
            if not r.summary():
                return note
            outcome = f"the job's processes run on {self.node}, but {r.summary()}"
            hint = cuda.UNDO_HINT if r.undone else "see the agent's log"
            return f"{note}; {outcome}; {hint}"

        done = rollback.resume(
            self.registry, self.cuda.driver, copy, say, cuda_back=lambda: self.cuda.release(self.footprint)
        )
        shutil.rmtree(self.staging, ignore_errors=True)
        self._to(MigrationState.ABORTED, note=say(done))
        raise MigrationAbortedError(
            f"{err.cause}; migration aborted, {outcome}",
            step=err.step or phase.value,
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


class _TargetAborted(TransferError):
    """The target has said it aborted (or was fenced just now): nothing more to tell it."""


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
