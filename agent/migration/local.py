"""Saving on this node: `ferry checkpoint` (and a group snapshot's hold) and a preemption's
suspend, journaled as a move's source is, with the image standing in for the target
(docs/architecture.md, "Local operations are journaled moves"). The kinds and states recovery
reads back are defined here, beside the code that writes them; the restore side (`ferry
restore`, resuming a preempted job) is agent.migration.local_restore.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent import faults
from agent.criu.dumpable import refuse_undumpable
from agent.criu.logs import CriuLogs
from agent.criu.options import LOG_LEVEL
from agent.criu.runner import Criu
from agent.cuda import driver as cuda
from agent.cuda.jobs import CudaJobs, Footprint
from agent.errors import FerryError, InvalidArgumentError, as_ferry_error
from agent.image import JobSpec, Manifest, build_manifest, image_files, read_manifest
from agent.jobs import procs
from agent.jobs.network import LinkLock
from agent.jobs.record import JobState
from agent.jobs.registry import JobRegistry
from agent.migration import peerwait, rollback
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
from agent.migration.journal import SOURCE, Journal, JournaledRecord, MigrationRecord
from agent.migration.model import Emit, MigrationResult, Progress
from agent.migration.outdir import OutDir
from agent.migration.states import (
    SOURCE_TRANSITIONS,
    CudaLeft,
    MigrationState,
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
    warm: bool = True,
    log_level: int = LOG_LEVEL,
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
    A CUDA job's dumps are always whole (what its GPUs write into host memory is not tracked).
    A snapshot's dump touches its memory first (capture.warm_memory), unless `warm` says a WARM
    of its round did just now. log_level: CRIU's, for the dump (a snapshot's is its own).

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
        # Until its processes were let go on, not until the records were written after that.
        frozen_s = (done.continued_at or time.monotonic()) - stopped_at
        return done

    try:
        tree = procs.tree_pids(rec.pid)
        refuse_undumpable(tree, node, step="checkpoint", same_node=True)
        fp = cj.inspect(tree)
        require_host_memory(fp, node)
        if fp.processes and (track_mem or parent is not None):
            # A GPU's DMA into host memory writes no page table: dirty tracking would miss it.
            track_mem, parent, over = False, None, ""
        out.prepare(estimated_bytes(rec, fp) + log_bytes(rec))
        # A snapshot, again and again: its dump's memory is touched now, not frozen.
        if hold is not None and warm:
            phases.times["warm"] = warm_memory(out_dir.parent, estimated_bytes(rec, fp))
        link.prepare()  # its stand-ins open while it runs: every way out of here ends the lock
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
        phases.run("stop", lambda: procs.stop(tree))
        # Its sent bytes acknowledged before the cut (peerwait.drain), so that neither a restored
        # copy waits on its first retransmission timeout (1 s) nor a snapshot's member, whose
        # retransmissions into its cut link back off. In a group's round the wait may run out
        # (its peers are cut at the same moment); the one suite run without it saw a group
        # rolled back while rounds went on make no step for a minute (docs/distributed.md).
        if link.network is not None:
            phases.run("drain", lambda: peerwait.drain(tree, rec.address))
        phases.run("cut", link.engage)
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
                log_level=log_level,
            ),
        )
        pids = procs.tree_pids(rec.pid)
        op.to(MigrationState.TRANSFERRING, pids=pids)
        faults.check("checkpoint-dumped", node)
        phases.run("logs", lambda: copy_logs(rec, out_dir))
        if hold is not None:
            try:
                size = sum(f.stat().st_size for f in image_files(out_dir))
                phases.run("held", lambda: hold(Dumped(size, fp.gpu_bytes)))
            except Exception:  # whatever the hold met, the job goes on: it is this node's one copy
                log.exception("job %s: its snapshot's hold failed", name)
            resumed = phases.run("resume", go_on)  # type: ignore[assignment]
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
