"""Incremental dumps with real CRIU where the kernel tracks written memory (soft-dirty, or, as on
this VM, ferry's CRIU with userfaultfd write-protect: native/criu/uffd-track.patch): a process's
increments carry what it wrote since the last dump, and the chain restores it exactly, pages it
zapped since (zero now, not what the older dump held) and mappings it made since included.

Under a seccomp filter it is tracked too, such as ferry-init's (io_uring_setup answers ENOSYS)
or one that would kill it for opening a userfaultfd: CRIU holds the task with
PTRACE_O_SUSPEND_SECCOMP, so the syscalls it runs in it pass no filter, and the job lives on."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from agent.criu.runner import Criu

MIB = 1 << 20
SIZE, CHUNK = 64 * MIB, 1 * MIB

# Private anonymous memory, as an allocator maps it. Writes chunk i % 32 of the first half with
# byte i each step; on SIGUSR2 it zaps the second half's first 4 MiB (MADV_DONTNEED: zero from
# then on) and maps 8 MiB more, filled with 7s. On SIGUSR1 it appends "step zapped digest" to
# argv[1], the digest over all of it.
TARGET = textwrap.dedent(
    f"""
    import ctypes, hashlib, mmap, signal, struct, sys, time
    SIZE, CHUNK = {SIZE}, {CHUNK}
    if sys.argv[2] != "none":  # a seccomp filter: nr's answer is act, every other syscall's ALLOW
        nr, act = {{"io_uring": (425, 0x50026), "kill_uffd": (323, 0x80000000)}}[sys.argv[2]]
        allow = 0x7FFF0000
        prog = [(0x20, 0, 0, 4), (0x15, 1, 0, 0xC000003E), (0x06, 0, 0, allow),
                (0x20, 0, 0, 0), (0x15, 0, 1, nr), (0x06, 0, 0, act), (0x06, 0, 0, allow)]
        code = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in prog))
        fprog = ctypes.create_string_buffer(struct.pack("HxxxxxxQ", len(prog), ctypes.addressof(code)))
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.prctl(38, 1, 0, 0, 0) == 0 and libc.prctl(22, 2, fprog, 0, 0) == 0
    buf = mmap.mmap(-1, SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for k in range(SIZE // CHUNK):
        buf[k * CHUNK:(k + 1) * CHUNK] = bytes([(k * 37 + 11) & 255]) * CHUNK
    extra, zap, i = None, False, 0
    def report(*a):
        h = hashlib.sha256(buf)
        if extra is not None:
            h.update(extra)
        with open(sys.argv[1], "a") as f:
            f.write(f"{{i}} {{int(extra is not None)}} {{h.hexdigest()}}\\n")
    def zap_now(*a):
        global zap
        zap = True
    signal.signal(signal.SIGUSR1, report)
    signal.signal(signal.SIGUSR2, zap_now)
    print("ready", flush=True)
    while True:
        if zap and extra is None:
            buf.madvise(mmap.MADV_DONTNEED, SIZE // 2, 4 * CHUNK)
            extra = mmap.mmap(-1, 8 * CHUNK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            extra.write(bytes([7]) * 8 * CHUNK)
        off = (i % 32) * CHUNK
        buf[off:off + CHUNK] = bytes([i & 255]) * CHUNK
        i += 1
        time.sleep(0.05)
    """
)


def expected(step: int, zapped: bool) -> str:
    buf = bytearray()
    for k in range(SIZE // CHUNK):
        buf += bytes([(k * 37 + 11) & 255]) * CHUNK
    for j in range(step):
        off = (j % 32) * CHUNK
        buf[off : off + CHUNK] = bytes([j & 255]) * CHUNK
    h = hashlib.sha256()
    if zapped:
        buf[SIZE // 2 : SIZE // 2 + 4 * CHUNK] = bytes(4 * CHUNK)
        h.update(buf)
        h.update(bytes([7]) * 8 * CHUNK)
    else:
        h.update(buf)
    return h.hexdigest()


def pages(d: Path) -> int:
    return sum(f.stat().st_size for f in d.glob("pages-*.img"))


def report(path: Path, pid: int) -> tuple[int, bool, str]:
    before = path.read_text().count("\n") if path.exists() else 0
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) > before:
            step, zapped, digest = lines[-1].split()
            return int(step), zapped == "1", digest
        time.sleep(0.05)
    raise AssertionError("the job did not report")


def start_target(tmp_path: Path, seccomp: str) -> tuple[Criu, subprocess.Popen[bytes], Path]:
    """The CRIU that tracks here (else the test is skipped), and TARGET running under `seccomp`,
    ready; its reports go to the returned path."""
    criu = Criu()
    if not criu.feature("mem_dirty_track"):
        pytest.skip("this kernel tracks no dirty memory, and this CRIU cannot either")
    script, out = tmp_path / "target.py", tmp_path / "report"
    script.write_text(TARGET)
    job = subprocess.Popen(
        [sys.executable, str(script), str(out), seccomp], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert job.stdout is not None and job.stdout.readline().strip() == b"ready"
    except BaseException:
        job.kill()
        job.wait()
        raise
    return criu, job, out


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the test's seccomp filter is x86-64's")
@pytest.mark.parametrize("seccomp", ["none", "io_uring", "kill_uffd"])
def test_a_chain_of_increments_carries_what_changed_and_restores_the_job_exactly(
    tmp_path: Path, seccomp: str
) -> None:
    criu, job, out = start_target(tmp_path, seccomp)
    restored = 0
    try:
        dirs = [tmp_path / f"d{k}" for k in range(3)]
        for k, d in enumerate(dirs):
            d.mkdir()
            if k == 1:
                os.kill(job.pid, signal.SIGUSR2)  # zap and map, between the first dump and the second
            time.sleep(0.6)
            parent = f"../d{k - 1}" if k else ""
            criu.dump(
                job.pid,
                d,
                leave_running=True,
                leave_stopped=False,
                shell_job=True,
                track_mem=True,
                parent_img=parent,
            )
        whole, increments = pages(dirs[0]), [pages(d) for d in dirs[1:]]
        assert whole > SIZE
        # ~12 steps of 1 MiB each, the 8 MiB mapped since and the zapped 4 MiB (as zeros): far
        # below a whole dump. The Python interpreter writes some memory of its own each step.
        assert all(n < whole // 2 for n in increments), (whole, increments)
        assert criu.trackers.held(job.pid) >= 1  # what keeps it tracked stays here
        live = report(out, job.pid)  # it keeps running after the dumps
        assert live[1] and live[2] == expected(live[0], True)
        job.kill()
        job.wait()
        r = criu.restore(dirs[-1], shell_job=True)
        restored = r.pid
        step, zapped, digest = report(out, restored)
        assert zapped and digest == expected(step, True)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        if restored:
            os.kill(restored, signal.SIGKILL)
            os.waitpid(restored, 0)


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the test's seccomp filter is x86-64's")
@pytest.mark.parametrize("seccomp", ["none", "kill_uffd"])
def test_a_restored_job_is_tracked_from_its_restore_so_its_first_dump_is_an_increment(
    tmp_path: Path, seccomp: str
) -> None:
    """A rollback restores every member: untracked, each one's next dump would be whole. Restored
    with tracking, a job's first dump carries only what it wrote since its restore, over the image
    it was restored from, and the two restore it exactly; its restored seccomp filter, even one
    that would kill it for opening a userfaultfd, sees nothing of it (CRIU suspends it)."""
    criu, job, out = start_target(tmp_path, seccomp)
    restored: list[int] = []
    try:
        whole, increment = tmp_path / "d0", tmp_path / "d1"
        whole.mkdir()
        increment.mkdir()
        time.sleep(0.3)
        criu.dump(job.pid, whole, leave_running=False, leave_stopped=False, shell_job=True, track_mem=True)
        job.wait(10)
        restored.append(criu.restore(whole, shell_job=True, track_mem=True).pid)
        time.sleep(0.6)
        criu.dump(
            restored[0],
            increment,
            leave_running=True,
            leave_stopped=False,
            shell_job=True,
            track_mem=True,
            parent_img="../d0",
        )
        assert pages(increment) < pages(whole) // 2, (pages(whole), pages(increment))
        step, _, digest = report(out, restored[0])
        assert digest == expected(step, False)  # it runs on after the dump
        os.kill(restored[0], signal.SIGKILL)
        os.waitpid(restored[0], 0)
        restored.append(criu.restore(increment, shell_job=True).pid)
        step, _, digest = report(out, restored[1])
        assert digest == expected(step, False)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        for pid in restored:
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
