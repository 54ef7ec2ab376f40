"""Saving and resuming on this node: `ferry checkpoint` (and a group snapshot's hold), `ferry
restore`, and the resume of a job that a preemption suspended.

Why one module: the three are one journaled protocol with the image standing in for the
target (docs/architecture.md, "Local operations are journaled moves"); split, the kinds and
states that recovery reads back would be defined apart from the code that writes them.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from agent import faults
from agent.criu.dumpable import refuse_undumpable
from agent.criu.logs import CriuLogs
from agent.criu.runner import Criu
from agent.cuda import driver as cuda
from agent.cuda.jobs import CudaJobs, Footprint
from agent.errors import FerryError, InvalidArgumentError, NotFoundError, as_ferry_error
from agent.gpus.inventory import GpuNeed
from agent.image import JobSpec, Manifest, build_manifest, image_files, read_manifest, verify
from agent.jobs import procs
from agent.jobs.network import LinkLock
from agent.jobs.record import JobRecord, JobState
from agent.jobs.registry import JobRegistry
from agent.migration import copies, peerwait, rollback
from agent.migration.capture import (
    Phases,
    copy_logs,
    dump_externals,
    estimated_bytes,
    log_bytes,
    needs_shell_job,
    require_host_memory,
    warm_memory,
)
from agent.migration.journal import SOURCE, TARGET, Journal, JournaledRecord, MigrationRecord
from agent.migration.model import Emit, MigrationResult, Progress
from agent.migration.outdir import OutDir
from agent.migration.restore import restore_tree
from agent.migration.states import (
    SOURCE_TRANSITIONS,
    TARGET_TRANSITIONS,
    CudaLeft,
    MigrationState,
    TargetState,
)

log = logging.getLogger(__name__)


def checkpoint(
    registry: JobRegistry,
    criu: Criu,
    name: str,
    out_dir: Path,
    node: str,
    leave_running: bool,
    emit: Emit = lambda p: None,
    *,
    journal: Journal,
    cuda_jobs: CudaJobs,
    suspend: bool = False,
    hold: Callable[[Dumped], None] | None = None,
    went_on: Callable[[float], None] = lambda frozen_s: None,
    track_mem: bool = False,
    parent: Path | None = None,
) -> MigrationResult:
    """Save a job to `out_dir`; unless leave_running, it then ends here (state CHECKPOINTED, or
    PREEMPTED for a preemption's `suspend`).

    `hold` (a group snapshot's member, leave_running only) is called once the image is dumped,
    while the job is still frozen and cut off; it returns when the job may go on
    (agent.snapshots.member). The job then goes on before the image's digests are computed: its
    files no longer change, and hashing them is no part of the pause; `went_on` hears how long
    it was frozen as soon as it goes on. track_mem (a snapshot, where the kernel tracks dirty
    memory) lets the next dump be an increment; `parent` (an earlier image of this job that was
    dumped with track_mem, beside out_dir's in a snapshot store) makes this one that increment.

    A CUDA job's device memory is saved too; ending it frees its GPUs. Every step is journaled
    as a move's is (kind "checkpoint" or "suspend", no peer): after a crash, recovery resumes
    the frozen job, or ends it once RESTORING says the image holds it (SourceRecovery).

    Before anything freezes, `out_dir` must take files and have room for the image's estimate.
    CRIU logs where a migration's does (`<state>/criu-logs/<id>/`, kept if it fails): never in
    `out_dir`, which may be read-only or full. A failure resumes the job and removes what the
    checkpoint wrote in `out_dir` (OutDir), naming a full filesystem as such.
    """
    cj = cuda_jobs
    over = read_manifest(parent).image_id if parent is not None else ""  # unreadable: refused now
    if out_dir.exists() and any(out_dir.iterdir()):
        raise InvalidArgumentError(f"{out_dir} is not empty; choose a new directory for the image", node=node)
    kind = KIND_SUSPEND if suspend else KIND_SNAPSHOT if hold is not None else KIND_CHECKPOINT
    mid = f"{kind}-{uuid.uuid4().hex[:12]}"
    rec = registry.begin_move(name, mid, kind)
    link = LinkLock(registry.network, rec.veth, address=rec.address)
    record = MigrationRecord(mid, SOURCE, name, MigrationState.PREPARING.value, kind=kind, image=str(out_dir))
    op = JournaledRecord(journal, record, SOURCE_TRANSITIONS, MigrationState)
    op.save(pids=[rec.pid])
    out = OutDir(out_dir, node)
    criu_logs = CriuLogs(registry.root.parent)

    def frozen(pids: list[int], left: CudaLeft) -> rollback.FrozenCopy:
        return rollback.FrozenCopy(rec, pids, link, fp.pids, left, since=t0)

    phases = Phases()
    pids: list[int] = []
    fp = Footprint()
    left = CudaLeft.NONE  # a freeze that fails undoes itself; a finished one is undone by rollback
    t0 = time.monotonic()
    stopped_at = frozen_s = 0.0
    resumed: rollback.Resumed | None = None  # a snapshot's member goes on before its digests

    def saved(r: rollback.Resumed) -> str:
        note = f"checkpointed to {out_dir}"
        if r.fenced and not r.undone:
            return f"{note}; {r.summary()}"
        return f"{note}; but here {r.summary()}: its CUDA calls stay blocked" if r.summary() else note

    def go_on() -> rollback.Resumed:
        nonlocal frozen_s
        op.to(MigrationState.ABORTING)  # the frozen copy goes on here: a move's abort, by request
        done = rollback.resume(
            registry, cj.driver, frozen(pids, left), saved, cuda_back=lambda: cj.release(fp)
        )
        op.to(MigrationState.ABORTED, note=saved(done))
        frozen_s = time.monotonic() - stopped_at
        return done

    try:
        tree = procs.tree_pids(rec.pid)
        refuse_undumpable(tree, node, step="checkpoint", same_node=True)
        fp = cj.inspect(tree)
        require_host_memory(fp, node)
        out.prepare(estimated_bytes(rec, fp) + log_bytes(rec))
        if hold is not None:  # a snapshot, again and again: its dump's memory is touched now, not frozen
            phases.times["warm"] = warm_memory(out_dir.parent, estimated_bytes(rec, fp))
        emit(Progress("dump", f"dumping job {name} to {out_dir}"))
        if fp.processes:
            op.to(MigrationState.LOCKING, cuda_pids=fp.pids)
            cj.freeze(fp, phases.times, on_step=lambda step: op.to(CUDA_STEPS[step]))
            left = CudaLeft.CHECKPOINTED
            op.to(MigrationState.CHECKPOINTED)
        shell_job = needs_shell_job(rec, tree)
        # Stopped, not killed, so the logs copied below end exactly where the dump did.
        op.to(MigrationState.DUMPING, pids=tree)
        pids = tree  # a failure from here resumes the stopped tree
        stopped_at = time.monotonic()
        procs.stop(tree)
        if link.network is not None:  # its sent bytes acknowledged before the cut (peerwait.drain)
            peerwait.drain(rec.pid, rec.address)
        link.engage()
        faults.check("checkpoint", node)
        dump = phases.run(
            "dump",
            lambda: criu.dump(
                rec.pid,
                out_dir,
                shell_job=shell_job,
                external=dump_externals(rec, link),
                log_dir=criu_logs.dir_for(mid),
                on_start=lambda pid: op.save(criu_pid=pid, criu_started=procs.create_time(pid)),
                track_mem=track_mem,
                parent_img=os.path.relpath(parent, out_dir) if parent is not None else "",
            ),
        )
        pids = procs.tree_pids(rec.pid)
        op.to(MigrationState.TRANSFERRING, pids=pids)
        faults.check("checkpoint-dumped", node)
        copy_logs(rec, out_dir)
        if hold is not None:
            try:
                hold(Dumped(sum(f.stat().st_size for f in image_files(out_dir)), fp.gpu_bytes))
            except Exception:  # whatever the hold met, the job goes on: it is this node's one copy
                log.exception("job %s: its snapshot's hold failed", name)
            resumed = go_on()
            went_on(frozen_s)
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
                image_id=mid,
                parent=over,
            ),
        )
    except Exception as exc:
        e = out.failed(as_ferry_error(exc, "checkpoint", node), exc)
        if resumed is not None:  # the job went on already: only its image is incomplete
            if removed := out.remove():
                e.cause += f"; {removed}"
            raise e.at(step="checkpoint", node=node) from exc
        note = f"checkpoint failed: {e.cause}"

        def failed(r: rollback.Resumed) -> str:
            if not r.summary():
                return note
            return f"{note}; {r.summary()}; {cuda.UNDO_HINT}" if r.undone else f"{note}; {r.summary()}"

        op.to(MigrationState.ABORTING)
        done = rollback.resume(
            registry, cj.driver, frozen(pids, left), failed, cuda_back=lambda: cj.release(fp)
        )
        op.to(MigrationState.ABORTED, note=failed(done))
        if removed := out.remove():  # an unfinished image (no manifest): nothing can restore it
            e.cause += f"; {removed}"
        if done.summary():
            e.cause += f"; {done.summary()}"
            e.hint = cuda.UNDO_HINT if done.undone else e.hint
        e.at(step="checkpoint", node=node)
        if e is exc:
            raise
        raise e from exc
    assert isinstance(m, Manifest)
    criu_logs.done(mid)
    if leave_running:
        done = resumed or go_on()
        if done.summary():
            raise FerryError(
                f"saved to {out_dir}, but {done.summary()}",
                step="checkpoint",
                node=node,
                hint=f"the image is complete: `ferry stop {name}`, then `ferry restore {out_dir}`",
            )
    else:
        # From here the image holds the job: a crash leaves recovery to end the frozen copy.
        op.to(MigrationState.RESTORING)
        faults.check("checkpoint-saved", node)
        end_saved(registry, frozen(pids, left), out_dir, suspend, cuda_gone=lambda: cj.release(fp))
        op.to(MigrationState.COMMITTED)
    res = MigrationResult("", name, node, phases=phases.times, image_dir=str(out_dir))
    if leave_running:
        res.frozen_s = frozen_s
    res.host_bytes, res.image_bytes, res.gpu_bytes = m.host_bytes, m.image_bytes, m.gpu_bytes
    res.total_s = time.monotonic() - t0
    emit(Progress("done", f"job {name} saved to {out_dir}"))
    return res


KIND_CHECKPOINT, KIND_SUSPEND, KIND_SNAPSHOT = "checkpoint", "suspend", "snapshot"


@dataclass(frozen=True)
class Dumped:
    """A snapshot member's image as its hold sees it: dumped, its digests still to come."""

    image_bytes: int
    gpu_bytes: int


#: The CUDA freeze's progress (agent.cuda.driver.freeze), journaled as it is reached.
CUDA_STEPS = {"locked": MigrationState.LOCKED, "checkpointing": MigrationState.CHECKPOINTING}


def end_saved(
    registry: JobRegistry,
    copy: rollback.FrozenCopy,
    image_dir: Path,
    suspend: bool,
    cuda_gone: Callable[[], None] = lambda: None,
) -> None:
    """The image holds the job: the frozen copy ends here, and the job is CHECKPOINTED (or,
    suspended by a preemption, PREEMPTED, which resumes here by itself once a GPU is free)."""
    rollback.finish(
        registry,
        copy,
        JobState.CHECKPOINTED,
        f"saved to {image_dir}",
        cuda_gone=cuda_gone,
        checkpoint_dir=str(image_dir),
    )
    if suspend:
        note = f"preempted; resumes here by itself once a GPU is free (image {image_dir})"
        registry.update(copy.rec.name, state=JobState.PREEMPTED, note=note)


def restore_image(
    registry: JobRegistry,
    criu: Criu,
    image_dir: Path,
    name: str,
    node: str,
    cuda_jobs: CudaJobs,
    journal: Journal,
    *,
    as_copy: bool = False,
    hold: Callable[[JobRecord], None] | None = None,
    keep_logs: bool = False,
) -> JobRecord:
    """Resume a saved image on this node, after checking every digest; a CUDA job onto suitable
    GPUs, claimed in the node's GPU ledger until the restored job holds them. Journaled as a
    target's restore is (LocalRestore): a crash before its commit point leaves nothing running.
    `hold` (a rollback's member) returns when the recorded, still stopped copy may go on.

    Refused while the image's job runs here, or once the image was restored (agent.migration.copies),
    unless `as_copy`: a second copy, under its own `name` and, on a job network, its own address.
    """
    if not image_dir.is_dir():
        raise NotFoundError(f"no image directory {image_dir} on this node", node=node)
    with copies.one_restore(image_dir, node):
        # An earlier ferry's image (no section digests) still restores: a launched job's restored
        # PID 1 is checked against its command, cwd and env all the same (copies.CheckedRestore).
        m = verify(image_dir, allow_legacy=True)
        if m.legacy:
            log.warning("image %s is an earlier ferry's: no digest covers its job section", image_dir)
        if as_copy:
            here, old = copies.copy_of(registry, m, name, node)
        else:
            copies.refuse_duplicate(registry, journal, image_dir, m, node)
            here, old = m, ""
        job = name or m.job.name
        owner = f"the restore of job {job}"
        checked = copies.CheckedRestore(criu, here.job, image_dir, registry.network, old)
        copy = f"; a second copy of job {m.job.name!r}" if as_copy else ""
        at = f", at its own address {here.job.address}" if old else ""
        try:
            gpu_map = claim_gpus(cuda_jobs, m, owner, job)
            onto = f" onto {', '.join(gpu_map.values())}" if gpu_map else ""
            local = LocalRestore(
                journal, job, node, image=copies.image_key(image_dir), mark=image_dir, copy=as_copy
            )
            rec = local.restore(
                registry,
                cast(Criu, checked),
                image_dir,
                here,
                note=f"restored from {image_dir}{onto}{copy}{at}",
                cuda_jobs=cuda_jobs,
                gpu_map=gpu_map,
                hold=hold,
                keep_logs=keep_logs,
            )
        finally:
            cuda_jobs.ledger.release(owner)
    log.info("job %s: restored from %s as pid %d", rec.name, image_dir, rec.pid)
    return rec


class LocalRestore:
    """`ferry restore` (kind restore) and a preempted job's resume (kind resume, with its image)
    journaled as a target's restore is: RESTORING before CRIU starts (with
    CRIU's pid once it runs), RUNNING at the commit point, before the restored job is released.
    After a crash, target recovery kills a restore that did not reach RUNNING
    (agent.migration.target_recovery), so no copy runs that its node has not recorded.
    A restore's record names its image; once RUNNING is journaled, the restore is also added to
    the image's own record of restores (`mark`: the image directory), which a later restore reads."""

    def __init__(
        self,
        journal: Journal,
        job: str,
        node: str,
        kind: str = copies.KIND_RESTORE,
        image: str = "",
        mark: Path | None = None,
        copy: bool = False,
    ) -> None:
        self.node = node
        self.mark, self.copy = mark, copy
        mid = f"{kind}-{uuid.uuid4().hex[:12]}"
        record = MigrationRecord(mid, TARGET, job, TargetState.VERIFIED.value, kind=kind, image=image)
        self.op = JournaledRecord(journal, record, TARGET_TRANSITIONS, TargetState)
        self.op.to(TargetState.RESTORING)

    def restore(
        self,
        registry: JobRegistry,
        criu: Criu,
        image_dir: Path,
        manifest: Manifest,
        *,
        note: str,
        cuda_jobs: CudaJobs,
        gpu_map: dict[str, str],
        resuming: bool = False,
        hold: Callable[[JobRecord], None] | None = None,
        keep_logs: bool = False,
    ) -> JobRecord:
        """restore_tree, journaled: RUNNING at its commit point, ABORTED if it failed before."""
        job = self.op.record.job

        def commit_then_hold(rec: JobRecord) -> None:
            self.commit_point(rec)
            if hold is not None:
                hold(rec)

        try:
            return restore_tree(
                registry,
                criu,
                image_dir,
                manifest,
                job,
                note=note,
                cuda_jobs=cuda_jobs,
                gpu_map=gpu_map,
                resuming=resuming,
                on_criu_start=self.criu_started,
                before_release=commit_then_hold,
                keep_logs=keep_logs,
            )
        except BaseException as e:
            self.failed(f"{self.op.record.kind} failed: {e}")
            raise

    def criu_started(self, pid: int) -> None:
        self.op.save(criu_pid=pid, criu_started=procs.create_time(pid))

    def commit_point(self, rec: JobRecord) -> None:
        faults.check("restore-held", self.node)
        self.op.to(TargetState.RUNNING)
        if self.mark is not None:
            copies.mark(self.mark, rec.name, self.node, self.op.record.migration_id, self.copy)

    def failed(self, why: str) -> None:
        if self.op.record.state == TargetState.RESTORING.value:  # past RUNNING the job runs on
            self.op.to(TargetState.ABORTED, note=why)


def claim_gpus(cj: CudaJobs, m: Manifest, owner: str, job: str) -> dict[str, str]:
    """GPUs here for a saved job (its CUDA state's and those `ferry run --gpu` gave it), held in
    the ledger for `owner` until released. NVML and the driver are asked before the ledger's lock."""
    needs = list(m.cuda.gpus) if m.cuda else []
    seen = {n.uuid for n in needs}
    needs += [GpuNeed(u, m.job.gpu_chip, 0) for u in m.job.gpus if u not in seen]
    if not needs:
        return {}
    inv = cj.nvml.inventory()
    cj.check_restorable(inv, m.cuda.driver_version if m.cuda else "", m.cuda is not None)

    def pick(taken: dict[str, str], frozen: dict[str, int]) -> tuple[dict[str, str], Iterable[str]]:
        gpu_map = cj.pick_gpus(needs, inv, reserved=taken, frozen=frozen, cuda_state=m.cuda is not None)
        return gpu_map, gpu_map.values()

    return cj.ledger.decide(owner, job, pick)


def resume_preempted(
    registry: JobRegistry,
    criu: Criu,
    rec: JobRecord,
    node: str,
    cuda_jobs: CudaJobs,
    journal: Journal,
) -> JobRecord:
    """Resume a job suspended by a preemption; NoFreeGpuError while no GPU here can take it.

    Its GPUs are claimed in the ledger until the restore is over. The record stays PREEMPTED
    until the restored job replaces it: a failure on the way leaves it waiting, never lost. The
    restore is journaled (LocalRestore, kind resume): a crash before its commit point leaves
    target recovery to kill the restored copy and make the job PREEMPTED again.
    """
    image_dir = Path(rec.checkpoint_dir)
    m = read_manifest(image_dir)  # cheap; the digests are checked once a GPU is free
    owner = f"the resume of job {rec.name}"
    try:
        gpu_map = claim_gpus(cuda_jobs, m, owner, rec.name)
        try:
            verify(image_dir, m, allow_legacy=True)  # written by this agent, into its state directory
            new = LocalRestore(journal, rec.name, node, kind="resume", image=str(image_dir)).restore(
                registry,
                criu,
                image_dir,
                m,
                note=f"resumed after preemption from {image_dir}",
                cuda_jobs=cuda_jobs,
                gpu_map=gpu_map,
                resuming=True,
            )
        except FerryError as e:
            registry.update(rec.name, note=f"{rec.note}; the last resume failed: {e}")
            raise
    finally:
        cuda_jobs.ledger.release(owner)
    shutil.rmtree(image_dir, ignore_errors=True)
    log.info("job %s: resumed after preemption as pid %d", rec.name, new.pid)
    return new
