"""Saving and resuming on this node: `ferry checkpoint`, `ferry restore`, and the resume of a
job that a preemption suspended."""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

from agent.criu.dumpable import refuse_undumpable
from agent.criu.runner import Criu
from agent.cuda import driver as cuda
from agent.cuda.jobs import CudaJobs, Footprint
from agent.errors import FerryError, InvalidArgumentError, NotFoundError, as_ferry_error
from agent.gpus.inventory import GpuNeed
from agent.image import JobSpec, Manifest, build_manifest, read_manifest, verify
from agent.jobs import procs
from agent.jobs.network import LinkLock
from agent.jobs.record import JobRecord, JobState
from agent.jobs.registry import JobRegistry
from agent.migration import rollback
from agent.migration.capture import (
    Phases,
    copy_logs,
    default_cuda_jobs,
    dump_externals,
    needs_shell_job,
    require_host_memory,
)
from agent.migration.model import Emit, MigrationResult, Progress
from agent.migration.restore import restore_tree
from agent.migration.states import CudaLeft

log = logging.getLogger(__name__)


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

    def frozen(pids: list[int], left: CudaLeft) -> rollback.FrozenCopy:
        return rollback.FrozenCopy(rec, pids, link, fp.pids, left)

    phases = Phases()
    pids: list[int] = []
    fp = Footprint()
    left = CudaLeft.NONE  # a freeze that fails undoes itself; a finished one is undone by rollback
    t0 = time.monotonic()
    try:
        tree = procs.tree_pids(rec.pid)
        refuse_undumpable(tree, node, step="checkpoint", same_node=True)
        fp = cj.inspect(tree)
        require_host_memory(fp, node)
        out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # the job's memory: root only
        emit(Progress("dump", f"dumping job {name} to {out_dir}"))
        if fp.processes:
            cj.freeze(fp, phases.times)
            left = CudaLeft.CHECKPOINTED
        shell_job = needs_shell_job(rec, tree)
        # Stopped, not killed, so the logs copied below end exactly where the dump did.
        link.engage()
        dump = phases.run(
            "dump",
            lambda: criu.dump(rec.pid, out_dir, shell_job=shell_job, external=dump_externals(rec, link)),
        )
        pids = procs.tree_pids(rec.pid)
        copy_logs(rec, out_dir)
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
        note = f"checkpoint failed: {e.cause}"

        def failed(r: rollback.Resumed) -> str:
            return f"{note}; {r.summary()}; {cuda.UNDO_HINT}" if r.summary() else note

        done = rollback.resume(
            registry, cj.driver, frozen(pids, left), failed, cuda_back=lambda: cj.release(fp)
        )
        if done.summary():
            e.cause += f"; {done.summary()}"
            e.hint = cuda.UNDO_HINT if done.undone else e.hint
        e.at(step="checkpoint", node=node)
        if e is exc:
            raise
        raise e from exc
    assert isinstance(m, Manifest)
    if leave_running:

        def saved(r: rollback.Resumed) -> str:
            note = f"checkpointed to {out_dir}"
            return f"{note}; but here {r.summary()}: its CUDA calls stay blocked" if r.summary() else note

        done = rollback.resume(
            registry, cj.driver, frozen(pids, left), saved, cuda_back=lambda: cj.release(fp)
        )
        if done.summary():
            raise FerryError(
                f"saved to {out_dir}, but {done.summary()}",
                step="checkpoint",
                node=node,
                hint=f"the image is complete: `ferry stop {name}`, then `ferry restore {out_dir}`",
            )
    else:
        rollback.finish(
            registry,
            frozen(pids, left),
            JobState.CHECKPOINTED,
            f"saved to {out_dir}",
            cuda_gone=lambda: cj.release(fp),
            checkpoint_dir=str(out_dir),
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
) -> JobRecord:
    """Resume a saved image on this node, after checking every digest; a CUDA job onto suitable
    GPUs, claimed in the node's GPU ledger until the restored job holds them."""
    if not image_dir.is_dir():
        raise NotFoundError(f"no image directory {image_dir} on this node", node=node)
    m = verify(image_dir)
    cj = cuda_jobs or default_cuda_jobs(node)
    job = name or m.job.name
    owner = f"the restore of job {job}"
    try:
        gpu_map = claim_gpus(cj, m, owner, job)
        rec = restore_tree(
            registry,
            criu,
            image_dir,
            m,
            job,
            note=f"restored from {image_dir}" + (f" onto {', '.join(gpu_map.values())}" if gpu_map else ""),
            cuda_jobs=cj,
            gpu_map=gpu_map,
        )
    finally:
        cj.ledger.release(owner)
    log.info("job %s: restored from %s as pid %d", rec.name, image_dir, rec.pid)
    return rec


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
) -> JobRecord:
    """Resume a job suspended by a preemption; NoFreeGpuError while no GPU here can take it.

    Its GPUs are claimed in the ledger until the restore is over. The record stays PREEMPTED
    until the restored job replaces it: a failure or a crash on the way leaves it waiting,
    never lost.
    """
    image_dir = Path(rec.checkpoint_dir)
    m = read_manifest(image_dir)  # cheap; the digests are checked once a GPU is free
    owner = f"the resume of job {rec.name}"
    try:
        gpu_map = claim_gpus(cuda_jobs, m, owner, rec.name)
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
    finally:
        cuda_jobs.ledger.release(owner)
    shutil.rmtree(image_dir, ignore_errors=True)
    log.info("job %s: resumed after preemption as pid %d", rec.name, new.pid)
    return new
