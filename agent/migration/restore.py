"""Restoring a verified image as a job on this node: the one restore that a migration's target,
`ferry restore` and a preempted job's resume share."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from agent.criu.images import bound_socket_dirs
from agent.criu.options import LOG_LEVEL
from agent.criu.runner import Criu, InheritFd
from agent.cuda.jobs import CudaJobs, restore_plan
from agent.image import STDERR_LOG, STDOUT_LOG, JobSpec, Manifest
from agent.jobs import procs
from agent.jobs.network import LinkLock, carrying, veth_name
from agent.jobs.record import LOG_MOUNT_KEY, JobKind, JobRecord
from agent.jobs.registry import JobRegistry
from agent.jobs.threadhold import ThreadHold

log = logging.getLogger(__name__)


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
    keep_logs: bool = False,
    track_mem: bool = False,
    log_level: int = LOG_LEVEL,
) -> JobRecord:
    """Restore a verified image as job `name` on this node, its logs re-pointed to our job dir.
    CRIU logs in log_dir (by default the job's dir); a lazy restore's daemon must listen there.

    CRIU restores the tree stopped. A CUDA job then gets SIGCONT (the driver's
    restore thread must run) and its device memory back onto the GPUs of
    gpu_map, still locked, so its CUDA calls wait. Until `before_release` has
    returned (a target journals RUNNING there), the job cannot make progress,
    and any failure kills it: no copy runs that its node has not recorded.
    Only then the tree continues (SIGCONT, or the CUDA unlock).

    keep_logs: a job rolled back in place appends to the logs it has here (what it printed
    since the snapshot stays), instead of taking the image's copy of them. track_mem: CRIU
    tracks the tree's written memory from the restore on (Criu.restore). log_level: CRIU's -v.
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
                if not (keep_logs and dst.exists()):
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
        net = job_link(registry, spec, name)
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
                track_mem=track_mem,
                log_level=log_level,
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
    # Until the commit point it stays stopped and off the bridge, where CRIU left its link (its
    # sockets live in its namespace: a peer's bytes it acknowledged would die with a copy that
    # never runs); the link comes up now, so that it has its carrier long before the release.
    link = LinkLock(registry.network, net, engaged=True)
    hold: ThreadHold | None = None
    pids: list[int] = []
    try:
        if net and registry.network is not None:
            registry.network.up(net)
        pids = procs.tree_pids(res.pid)
        if manifest.cuda is not None:
            plan = restore_plan(cuda_jobs.view, pids, manifest.cuda, gpu_map, criu.node)
            cuda_pids = [pid for pid, _ in plan]
            # Only the driver's restore threads run (CRIU's CUDA plugin does the same).
            hold = ThreadHold(cuda_pids, {cuda_jobs.driver.restore_thread(pid) for pid in cuda_pids})
            cuda_jobs.thaw(plan, times, unlock=False)
            hold.release()
        gpus_here = [gpu_map.get(u, u) for u in spec.gpus]
        spec_here = JobSpec(**{**spec.__dict__, "name": name, "gpus": gpus_here})
        # Refused if a job took the name while CRIU ran: this copy is then killed below.
        rec = registry.register_restored(
            spec_here, res.pid, paths[0], paths[1], resuming=resuming, note=note, veth=net
        )
        if before_release is not None:
            before_release(rec)
    except BaseException:
        if hold is not None:
            hold.release()
        # Its link first: killed, the copy's kernel would close its TCP connections with FIN or RST
        # from the job's own address, and its peers would drop the connections the source's copy
        # goes on with. Without a link nothing leaves its namespace.
        if net and registry.network is not None:
            registry.network.delete(net)
        kill_restored(res.pid)
        raise
    # Recorded as running: from now on this is the job's one copy, so it is never killed here,
    # and it goes on even unreachable: stopped, it would be stranded.
    joined = False
    try:
        link.release()
        joined = True
    except Exception as e:
        log.error("job %s: restored, but its link could not join the bridge: %s", name, e)
        note = f"{note}; its peers cannot reach it: its link could not join the bridge ({e})"
        rec = registry.update(name, note=note)
    procs.resume(pids)
    try:
        if manifest.cuda is not None:
            cuda_jobs.unlock([pid for pid, _ in plan], times)
    except Exception as e:
        log.error("job %s: restored, but could not be released: %s", name, e)
        rec = registry.update(name, note=f"{note}; its CUDA calls stay blocked: unlock failed: {e}")
    if joined and net and registry.network is not None:
        # Once it runs, CUDA calls too (two requests 50 ms apart, no part of its pause): the
        # segment learns its new port, and what its kernel asked of its peers off the bridge is
        # asked again.
        registry.network.announce(res.pid, spec.address)
    return rec


def job_link(registry: JobRegistry, spec: JobSpec, name: str) -> str:
    """The name of the job's new link here ("" for a job on the node's network); refuses a job
    whose address this node's job network does not carry."""
    if not spec.address:
        return ""
    net = carrying(registry.network, spec.address, registry.node, "restore")
    net.require_bridge()  # the job's new link joins it at the release: its MAC must not follow its ports
    return veth_name(f"{registry.node}/{name}/{time.time_ns()}")


def kill_restored(root: int) -> None:
    """A restored tree that must not run: kill it and reap its root (our child, via rst_sibling)."""
    procs.signal_all(list(reversed(procs.tree_pids(root))), 9)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(root, 0)


def cpu_ns(pids: list[int]) -> int:
    """CPU time the processes' threads have had, in nanoseconds (schedstat: finer than ticks)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with (
                    contextlib.suppress(OSError, ValueError, IndexError),
                    open(f"/proc/{pid}/task/{tid}/schedstat") as f,
                ):
                    total += int(f.read().split()[0])
    return total


def resumed_after(rec: JobRecord, held_ns: int, timeout_s: float) -> float:
    """Seconds from now (just after the job's release) until its CPU time passes held_ns, what it
    had while still held: any job runs at once, even one that only returns into a sleep. -1 if
    it did not within timeout_s."""
    t0 = time.monotonic()
    pids = procs.tree_pids(rec.pid)
    while (elapsed := time.monotonic() - t0) < timeout_s:
        if cpu_ns(pids) > held_ns:
            return elapsed
        time.sleep(0.0005)
    return -1.0
