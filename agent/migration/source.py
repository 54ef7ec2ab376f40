"""The source side of a migration: one SourceMigration drives one job from prepare to commit.

Protocol (docs/architecture.md): prepare (target grants a lease and maps the job's GPUs,
nothing frozen) → freeze (CUDA lock and checkpoint, then CRIU with the tree left stopped)
→ transfer (digested stream) → commit (target restores with CRIU, then CUDA onto its
GPUs, and reports RUNNING; only then the source ends its frozen copy). Any failure before
the target runs the job aborts: the source resumes its frozen copy (agent.migration.rollback).
Every state change goes through SOURCE_TRANSITIONS (agent.migration.states) and is journaled
before the step it names acts.

`SourceMigration` is one migration's state machine, and the order of its steps (each
journaled before it acts) is the thing a reader checks: that order is `run()`, here, with
the record, `_to` (the one way to change state) and the commit. What a step does at length
is a part of the same object in its own module: the Prepare step and its lease
(source_prepare), post-copy's lazy dump, serving and settling (source_postcopy), and the
abort path, which holds or resumes the frozen copy by the one decision (source_abort). What
other moves share lives in capture, restore and rollback.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

from agent import faults
from agent.client import split_address
from agent.criu.lazy import LazyDump
from agent.criu.logs import CriuLogs
from agent.criu.runner import Criu, DumpResult
from agent.cuda.jobs import CudaJobs, Footprint
from agent.errors import CriuError, FerryError, as_ferry_error
from agent.gpus.inventory import gib
from agent.image import FileEntry, JobSpec, Manifest, StreamDigest, host_bytes
from agent.jobs import procs
from agent.jobs.network import LinkLock
from agent.jobs.record import JobState
from agent.jobs.registry import JobRegistry
from agent.migration import peerwait, rollback, stops
from agent.migration.capture import Phases, copy_logs, dump_externals, needs_shell_job
from agent.migration.chainmove import ChainTip, MoveChains
from agent.migration.datapath import SourceDataPath
from agent.migration.fencing import TargetAnswer, Verdict, ask_target, decide
from agent.migration.journal import SOURCE, Journal, JournaledRecord, MigrationRecord, state_of
from agent.migration.limits import RateLog
from agent.migration.model import Emit, MigrationResult, MigrationSpec, Peer, Progress
from agent.migration.pagestream import sent_bytes
from agent.migration.probe import PathCheck
from agent.migration.source_abort import AbortPath, _TargetAborted, _Unresolved
from agent.migration.source_postcopy import PostCopyStep
from agent.migration.source_prepare import PrepareStep
from agent.migration.states import SOURCE_TRANSITIONS, MigrationState
from agent.migration.transfer import SendStats, send_image
from agent.rpc import pb

log = logging.getLogger(__name__)


class SourceMigration(PrepareStep, PostCopyStep, AbortPath):
    """One outgoing migration, driven start to end by `run()` on its own thread. Its longer steps
    are parts of this one object (one record, one state), each in its module: `PrepareStep`,
    `PostCopyStep` and `AbortPath`."""

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
        path_check: PathCheck | None = None,
        chains: MoveChains | None = None,
    ) -> None:
        self.spec = spec
        #: A protected member's chain of snapshot images, which its move may be an increment over.
        self.chains = chains
        self.chain: ChainTip | None = None  # the image the target granted the increment over
        #: A large move's path to the target, probed before its Prepare (agent.migration.probe).
        self.path_check = path_check
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
        self.started = 0.0  # monotonic, before anything froze: a resume's lease check (rollback)
        #: How fast this agent's moves froze jobs: a member's expected pause is judged by it.
        self.rates = RateLog(registry.root.parent)
        self.result = MigrationResult(spec.migration_id, spec.job, node, target=spec.target)
        record = MigrationRecord(
            spec.migration_id, SOURCE, spec.job, "preparing", peer=spec.target, staging=str(self.staging)
        )
        #: The move's journal record, as a local checkpoint's is: every state change checked
        #: against SOURCE_TRANSITIONS and durable before the step it names acts.
        self.op = JournaledRecord(self.journal, record, SOURCE_TRANSITIONS, MigrationState)
        self.record = record
        self._journal = self.op.save  # after a crash the record names the furthest this may have got
        self._to = self.op.to

    @property
    def state(self) -> MigrationState:
        return state_of(self.record, MigrationState)

    def _set(self, state: MigrationState, phase: str, message: str, **changes: object) -> None:
        self._to(state, **changes)
        log.info("migration %s (job %s): %s", self.spec.migration_id, self.spec.job, message)
        self.emit(Progress(phase, message))

    def _cuda_step(self, step: str) -> None:
        """The freeze's progress (agent.cuda.driver.freeze): each step journaled as it is reached."""
        self._to({"locked": MigrationState.LOCKED, "checkpointing": MigrationState.CHECKPOINTING}[step])

    def run(self) -> MigrationResult:
        t_start = self.started = time.monotonic()
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
                pids = procs.tree_pids(rec.pid)
                self._journal(pids=pids)  # stopped before the dump: an abort must let them go on
                dump = self.phases.run("dump", lambda: self._dump(rec.pid, pids, shell_job))
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
                    # An increment over a kept chain is named: the member's next dump may go over it.
                    image_id=self.spec.migration_id if self.chain is not None else "",
                    parent=self.chain.image_id if self.chain is not None else "",
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
        stops.pass_on(self.registry, self.peer, rec.name, self.spec.migration_id)
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
        if peerwait.watched(rec):
            self._group_pause()
        return self.result

    def _externals(self) -> list[str]:
        return dump_externals(self.registry.get(self.spec.job), self.link)

    def _dump(self, root: int, pids: list[int], shell_job: bool) -> DumpResult:
        chain = self.chain
        if chain is not None and (self.chains is None or not self.chains.take_move_tip(chain)):
            raise FerryError(
                f"job {self.spec.job}'s chain of snapshot images changed since the Prepare: the increment "
                f"granted over its image of round {chain.epoch} cannot be dumped",
                step="dump",
                node=self.node,
                hint="move it again",
            )
        # Stopped, then its sent bytes acknowledged, then cut: bytes it sent into the cut link would
        # wait after the release for the restored socket's first retransmission (peerwait.drain).
        procs.stop(pids)
        if self.link.network is not None and (held := peerwait.drain(pids, self.link.address)) > 0:
            log.info(
                "migration %s: %d connection(s) still held unacknowledged bytes at the cut",
                self.spec.migration_id,
                held,
            )
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
                # An increment: only the pages written since the chain's last dump.
                track_mem=chain is not None,
                parent_img=os.path.relpath(chain.image, self.staging) if chain is not None else "",
            )
        except CriuError:
            # A target that refused or broke the page stream makes CRIU fail with a broken
            # connection; the target's reason is the one to report.
            if self.direct and self.data.pages and (err := self.data.pages.settled_error()) is not None:
                raise err from None
            raise

    def _criu_started(self, pid: int) -> None:
        self._journal(criu_pid=pid, criu_started=procs.create_time(pid))

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

    def _group_pause(self) -> None:
        """A member of a distributed job: its peers were without it for its frozen time and then
        until their connections to it carried bytes again, which the target watched after the
        release (agent.migration.peerwait). Asked once committed; a failure fails nothing."""
        what = f"measuring how long its peers went without it (up to {peerwait.ASK_WAIT_S:.0f} s)"
        self.emit(Progress("done", what))
        wait = peerwait.ask(self.peer, self.spec.migration_id)
        log.info("migration %s (job %s): %s", self.spec.migration_id, self.spec.job, wait.words())
        if not wait.measured:
            self.result.group_pause_by = wait.words()
            return
        frozen = self.result.frozen_s
        self.result.group_pause_s = frozen + wait.wait_s
        at_least = "at least: " if wait.stuck else ""
        self.result.group_pause_by = f"{at_least}frozen {frozen:.2f} s, then {wait.words()}"

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
