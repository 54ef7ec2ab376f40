"""`ferry restore` and the resume of a job that a preemption suspended: an image on this node
restored as a target restores (journaled as LocalRestore, so that a crash before the commit
point leaves nothing running), its GPUs claimed in the node's ledger. The save side, whose
kinds and states recovery reads back, is agent.migration.local.
"""

from __future__ import annotations

import logging
import shutil
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import cast

from agent import faults
from agent.criu.options import LOG_LEVEL
from agent.criu.runner import Criu
from agent.cuda.jobs import CudaJobs
from agent.errors import FerryError, NotFoundError
from agent.gpus.inventory import GpuNeed
from agent.image import Manifest, read_manifest, verify
from agent.jobs import procs
from agent.jobs.record import JobRecord
from agent.jobs.registry import JobRegistry
from agent.migration import copies
from agent.migration.journal import TARGET, Journal, JournaledRecord, MigrationRecord
from agent.migration.restore import restore_tree
from agent.migration.states import (
    TARGET_TRANSITIONS,
    TargetState,
)

log = logging.getLogger(__name__)


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
    verified: bool = False,
    track_mem: bool = False,
    log_level: int = LOG_LEVEL,
) -> JobRecord:
    """Resume a saved image on this node, after checking every digest; a CUDA job onto suitable
    GPUs, claimed in the node's GPU ledger until the restored job holds them. Journaled as a
    target's restore is (LocalRestore): a crash before its commit point leaves nothing running.
    `hold` (a rollback's member) returns when the recorded, still stopped copy may go on.

    Refused while the image's job runs here, or once the image was restored (agent.migration.copies),
    unless `as_copy`: a second copy, under its own `name` and, on a job network, its own address.
    `verified`: the caller checked this directory, which it owns, as it brought it here (a
    rollback's fetch): its manifest is read, and its files are not hashed a second time.
    `track_mem`: its written memory is tracked from the restore on (not a CUDA job's: a GPU's DMA
    writes no page table), so that its next dump may be an increment over this image.
    `log_level`: CRIU's -v for the restore.
    """
    if not image_dir.is_dir():
        raise NotFoundError(f"no image directory {image_dir} on this node", node=node)
    with copies.one_restore(image_dir, node):
        # An earlier ferry's image (no section digests) still restores: a launched job's restored
        # PID 1 is checked against its command, cwd and env all the same (copies.CheckedRestore).
        m = read_manifest(image_dir) if verified else verify(image_dir, allow_legacy=True)
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
                track_mem=track_mem and m.cuda is None,
                log_level=log_level,
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
        track_mem: bool = False,
        log_level: int = LOG_LEVEL,
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
                track_mem=track_mem,
                log_level=log_level,
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
