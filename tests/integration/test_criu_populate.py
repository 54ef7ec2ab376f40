"""ferry's CRIU faults in the private memory a restore reads with one madvise per range
(native/criu/restore-populate.patch), where it took one page fault per 4 KiB page as the read
filled it: a sixth of a restore's time. A page the read faults in is a page-fault event (the
kernel's software counter, which perf reads), one populated ahead is not (the task's minor
fault count has both), so the events of the restore tell the two apart; the restored memory
must still be what was dumped. Both of CRIU's ways of reading are tested: into place by the
restorer (a whole image) and into premapped memory (an image with a parent)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.criu.runner import Criu

MIB = 64
PAGES = MIB << 8  # 4 KiB pages
#: Holds MIB MiB it wrote, a pattern no zero page has; writes the buffer's digest to the file
#: it was given once ready, and again on SIGUSR1.
TARGET = f"""
import hashlib, signal, sys, time
buf = bytearray(b"ferry-" * (({MIB} << 20) // 6 + 1))[: {MIB} << 20]
def report(*_):
    with open(sys.argv[1], "a") as f:
        f.write(hashlib.sha256(buf).hexdigest() + "\\n")
signal.signal(signal.SIGUSR1, report)
report()
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""
#: perf_event_open(2)'s number where the test runs.
PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241}


@contextlib.contextmanager
def page_fault_events() -> Iterator[Callable[[], int]]:
    """Counts the page faults taken from here on by this process and every process it starts
    from now (CRIU, and the tree CRIU restores: counted once they end); skips the test where
    the kernel lets no one count them."""
    number = PERF_EVENT_OPEN.get(platform.machine())
    if number is None:
        pytest.skip(f"no perf_event_open number known for {platform.machine()}")
    # perf_event_attr as first published (64 bytes): PERF_TYPE_SOFTWARE, PERF_COUNT_SW_PAGE_FAULTS,
    # and of its flags only `inherit` (bit 1): counting from now, in children too.
    attr = struct.pack("=IIQQQQQIIQ", 1, 64, 2, 0, 0, 0, 1 << 1, 0, 0, 0)
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(number, ctypes.c_char_p(attr), 0, -1, -1, 0)
    if fd < 0:
        err = ctypes.get_errno()
        if err in (errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOSYS, errno.EOPNOTSUPP):
            pytest.skip(f"page faults cannot be counted here: {os.strerror(err)}")
        raise OSError(err, os.strerror(err))
    try:
        yield lambda: struct.unpack("=Q", os.read(fd, 8))[0]
    finally:
        os.close(fd)


def digest_of(pid: int, out: Path) -> str:
    before = len(out.read_text().splitlines())
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = out.read_text().splitlines()
        if len(lines) > before:
            return lines[-1]
        time.sleep(0.05)
    raise AssertionError(f"pid {pid} did not report its buffer's digest")


@pytest.mark.parametrize("parent", [False, True], ids=["whole", "increment"])
def test_a_restore_populates_the_memory_it_reads_instead_of_faulting_each_page(
    tmp_path: Path, parent: bool
) -> None:
    criu = Criu()
    if parent and not criu.feature("mem_dirty_track"):
        pytest.skip("this kernel tracks no dirty memory, and this CRIU cannot either")
    out = tmp_path / "digests"
    job = subprocess.Popen(
        [sys.executable, "-c", TARGET, str(out)], stdout=subprocess.PIPE, start_new_session=True
    )
    restored = 0
    try:
        assert job.stdout is not None and job.stdout.readline().strip() == b"ready"
        dumped = out.read_text().split()[0]
        images = tmp_path / "img"
        if parent:  # a whole dump first, then the increment over it that the restore reads
            base = tmp_path / "base"
            base.mkdir()
            criu.dump(job.pid, base, leave_running=True, leave_stopped=False, shell_job=True, track_mem=True)
        images.mkdir()
        criu.dump(
            job.pid,
            images,
            leave_running=False,
            leave_stopped=False,
            shell_job=True,
            track_mem=parent,
            parent_img="../base" if parent else "",
        )
        job.wait(10)
        with page_fault_events() as faults:
            restored = criu.restore(images, shell_job=True).pid
            assert digest_of(restored, out) == dumped, "the restored buffer is not what was dumped"
            os.kill(restored, signal.SIGKILL)
            os.waitpid(restored, 0)  # its events are counted here once it has ended
            restored, taken = 0, faults()
        # Populated: CRIU's own faults and the interpreter's, a few thousand; faulted page by
        # page: as many again as the buffer has pages.
        assert taken < PAGES // 2, f"{taken} page faults: the restore faulted {PAGES} pages one by one"
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        if restored:
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.kill(restored, signal.SIGKILL)
                os.waitpid(restored, 0)
