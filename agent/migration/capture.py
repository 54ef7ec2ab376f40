"""The dump side that every move shares (a migration's source and a local checkpoint): phase
timings, the checks before a freeze, and what CRIU must be told about the job."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from agent.cuda.jobs import Footprint
from agent.errors import RefusedError
from agent.gpus.inventory import gib
from agent.image import STDERR_LOG, STDOUT_LOG
from agent.jobs import procs
from agent.jobs.network import LinkLock
from agent.jobs.record import LOG_MOUNT, LOG_MOUNT_KEY, JobKind, JobRecord

log = logging.getLogger(__name__)


class Phases:
    """Per-phase wall time."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    def run(self, name: str, fn: Callable[[], object]) -> object:
        t = time.monotonic()
        try:
            return fn()
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.monotonic() - t


def copy_logs(rec: JobRecord, image_dir: Path) -> None:
    """Agent-owned logs travel with the image; the job's fds to them are re-pointed on restore."""
    if rec.kind is not JobKind.LAUNCHED:
        return
    shutil.copyfile(rec.stdout_path, image_dir / STDOUT_LOG)
    shutil.copyfile(rec.stderr_path, image_dir / STDERR_LOG)


def needs_shell_job(rec: JobRecord, pids: list[int]) -> bool:
    """An adopted process whose session leader is outside its tree needs CRIU's --shell-job."""
    return rec.kind is JobKind.ADOPTED and procs.session_id(rec.pid) not in pids


def dump_externals(rec: JobRecord, link: LinkLock | None = None) -> list[str]:
    """What CRIU must treat as outside the job: its log mount and its link."""
    ext = [f"mnt[{LOG_MOUNT}]:{LOG_MOUNT_KEY}"] if rec.private else []
    return ext + (link.external() if link is not None else [])


def estimated_bytes(rec: JobRecord, fp: Footprint) -> int:
    """About what a dump of the job writes: its tree's resident memory, and the device memory its
    CUDA checkpoint copies into it (a move's Prepare asks the target for this much)."""
    return procs.tree_rss(rec.pid) + fp.gpu_bytes


#: How much one step of a warm-up touches: a bound on it stops within about one step's time.
WARM_STEP_BYTES = 64 << 20
#: What a warm-up writes at a time: zeros, from one buffer.
_ZEROS = bytes(4 << 20)


def _touch(fd: int, offset: int, size: int) -> None:
    """Write `size` bytes of zeros at `offset`: each page is written, so the VM's host backs it.
    Not posix_fallocate, which on a tmpfs takes the pages without clearing them (a page is
    cleared when first read or written): the memory went back untouched."""
    end = offset + size
    while offset < end:
        offset += os.pwrite(fd, memoryview(_ZEROS)[: min(len(_ZEROS), end - offset)], offset)


def warm_memory(where: Path, size: int, within_s: float | None = None) -> float:
    """Touch `size` bytes of the memory behind `where` (a tmpfs) and give them back, while the job
    still runs; the seconds it took. The dump that follows then writes into pages the kernel
    reuses at once, instead of touching fresh ones inside the pause: a first touch costs the
    page's zeroing, and far more on a VM whose memory the host backs lazily (this one's idle
    memory takes 0.3 GB/s the first time; memory just freed, 15 times that). `within_s`: stop
    touching after about that long (what was touched still helps)."""
    t0 = time.monotonic()
    path = where / f".warm-{os.getpid()}-{threading.get_ident()}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    try:
        step = size if within_s is None else WARM_STEP_BYTES
        done = 0
        while done < size and (within_s is None or time.monotonic() - t0 < within_s):
            n = min(step, size - done)
            _touch(fd, done, n)
            done += n
    except OSError as e:  # no room: the dump itself says so, if it comes to that
        log.info("could not warm %d bytes in %s: %s", size, where, e)
    finally:
        os.close(fd)
        os.unlink(path)
    return time.monotonic() - t0


#: The longest a granted lease spends touching memory before it answers (the job runs meanwhile).
LEASE_WARM_S = 2.0


def warm_for_lease(where: Path, size: int) -> float:
    """A move's target, its lease granted: the source freezes the job once it hears so, and the
    job's pages arrive after that. Touched first (for LEASE_WARM_S at most), the memory they
    fill is memory the kernel just freed (a first touch here runs at 0.3 GB/s)."""
    return warm_memory(where, size, within_s=LEASE_WARM_S) if size > 0 else 0.0


def log_bytes(rec: JobRecord) -> int:
    """The job's logs, which travel with its image (copy_logs)."""
    if rec.kind is not JobKind.LAUNCHED:
        return 0
    total = 0
    for path in (rec.stdout_path, rec.stderr_path):
        with contextlib.suppress(OSError):
            total += os.stat(path).st_size
    return total


def require_host_memory(fp: Footprint, node: str) -> None:
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
