"""Post-copy with CRIU lazy pages: a dump whose memory stays behind, and the daemon that pulls it.

The source runs `criu dump --lazy-pages`: it writes everything but the memory,
says so, and then serves pages from the frozen tree until the target has them
all. The target runs `criu lazy-pages`, which takes the restored tree's
userfaultfd and fetches each page when the job first touches it (and the rest in
the background). Both talk CRIU's page-server protocol over a socket whose other
end the agents relay (agent/migration/pagestream.py).

Both are started from the command line, not through `criu swrk`: over RPC, CRIU
ignores the page-server socket in lazy mode and would listen on a TCP port
instead, an unauthenticated door to the job's memory. Errors come from the logs.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import time
from pathlib import Path

from agent.criu import logs as criu_logs
from agent.criu.runner import (
    DUMP_LOG,
    GHOST_LIMIT,
    STATS_DUMP,
    Criu,
    DumpResult,
    no_plugins_dir,
    read_stats,
)
from agent.errors import CriuError, StepTimeoutError

LAZY_PAGES_LOG = "criu-lazy-pages.log"
#: CRIU's lazy page server sizes its pipe to 4 MiB (PIPE_MAX_SIZE pages, rounded up).
LAZY_PIPE_BYTES = 4 << 20
_CAP_SYS_RESOURCE = 24


def lazy_dump_blocker(
    status: Path = Path("/proc/self/status"), pipe_max: Path = Path("/proc/sys/fs/pipe-max-size")
) -> str:
    """Why a lazy dump would fail on this node, or "" if it can run.

    Without CAP_SYS_RESOURCE, CRIU cannot grow a pipe past fs.pipe-max-size; its lazy
    page server then sends a short first answer and the transfer fails.
    """
    caps = next((ln.split()[1] for ln in status.read_text().splitlines() if ln.startswith("CapEff:")), "0")
    if int(caps, 16) >> _CAP_SYS_RESOURCE & 1:
        return ""
    limit = int(pipe_max.read_text())
    if limit >= LAZY_PIPE_BYTES:
        return ""
    return (
        f"this agent lacks CAP_SYS_RESOURCE and fs.pipe-max-size is {limit}; CRIU's lazy page "
        f"server needs pipes of {LAZY_PIPE_BYTES} bytes (`sysctl fs.pipe-max-size={LAZY_PIPE_BYTES}`)"
    )


def _start(criu: Criu, op: str, args: list[str], sock_fd: int) -> tuple[subprocess.Popen[bytes], int]:
    """`criu ARGS` talking page-server protocol on sock_fd, without plugins; returns it and the
    read end of its --status-fd, which gets one byte once CRIU is ready (EOF if it dies first)."""
    ready_r, ready_w = os.pipe()
    cmd = [criu.binary, *args, "-v4", "--ps-socket", str(sock_fd), "--status-fd", str(ready_w)]
    try:
        proc = subprocess.Popen(
            cmd,
            env={**os.environ, "CRIU_LIBS_DIR": no_plugins_dir()},
            pass_fds=[sock_fd, ready_w],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    except OSError as e:
        os.close(ready_r)
        raise CriuError(op, f"cannot start {criu.binary}: {e}", node=criu.node) from e
    finally:
        os.close(ready_w)
    return proc, ready_r


def _kill(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGKILL)
    proc.wait()


def _wait_status_fd(fd: int, proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """True once CRIU wrote its ready byte; False if it exited (closing the pipe) first."""
    deadline = time.monotonic() + timeout_s
    try:
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if ready:
                return os.read(fd, 1) == b"\0"
        proc.kill()
        raise StepTimeoutError(f"CRIU did not get ready within {timeout_s:.0f} s")
    finally:
        os.close(fd)


class LazyDump:
    """`criu dump --lazy-pages` on the tree at `pid`, its page server on `sock_fd`.

    `ready()` returns once the image minus the memory is in images_dir; `wait()` once the
    target has every page (or the transfer failed: CRIU then lets the tree go, which a
    tree stopped beforehand survives still stopped).
    """

    def __init__(
        self,
        criu: Criu,
        pid: int,
        images_dir: Path,
        sock_fd: int,
        *,
        shell_job: bool = False,
        log_dir: Path | None = None,
        external: list[str] | None = None,
    ) -> None:
        self.criu = criu
        self.work_dir = log_dir or images_dir  # the log and the stats go there
        self.log_path = self.work_dir / DUMP_LOG
        args = [
            "dump", "--tree", str(pid), "--images-dir", str(images_dir), "--work-dir", str(self.work_dir),
            "--log-file", DUMP_LOG,
            "--lazy-pages", "--leave-stopped", "--tcp-established", "--ext-unix-sk", "--file-locks",
            "--ghost-limit", str(GHOST_LIMIT), "--network-lock", "skip",
        ]  # fmt: skip
        for item in external or []:
            args += ["--external", item]
        if shell_job:
            args.append("--shell-job")
        self.proc, self._ready_fd = _start(criu, "dump", args, sock_fd)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def ready(self, timeout_s: float) -> None:
        if not _wait_status_fd(self._ready_fd, self.proc, timeout_s):
            self.proc.wait()
            raise self._error("the dump failed")

    def wait(self, timeout_s: float | None = None) -> DumpResult:
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise StepTimeoutError(
                f"the job's memory was not all fetched within {timeout_s:.0f} s", step="pages"
            ) from None
        if code != 0:
            raise self._error(f"the lazy page transfer failed (criu exit {code})")
        return DumpResult(stats=read_stats(self.work_dir / STATS_DUMP, "dump"))

    def kill(self) -> None:
        _kill(self.proc)

    def _error(self, what: str) -> CriuError:
        cause = criu_logs.cause(self.log_path) or what
        return CriuError("dump", cause, log_path=str(self.log_path), node=self.criu.node)


class LazyPagesDaemon:
    """`criu lazy-pages` for a restore from images_dir: it listens in work_dir (where the
    restore must run) and fetches pages through `sock_fd`; it exits once all are in."""

    def __init__(self, criu: Criu, images_dir: Path, work_dir: Path, sock_fd: int, timeout_s: float) -> None:
        self.criu = criu
        self.log_path = work_dir / LAZY_PAGES_LOG
        args = [
            "lazy-pages", "--images-dir", str(images_dir), "--work-dir", str(work_dir),
            "--log-file", LAZY_PAGES_LOG, "--page-server",
        ]  # fmt: skip
        self.proc, ready_r = _start(criu, "lazy-pages", args, sock_fd)
        if not _wait_status_fd(ready_r, self.proc, timeout_s):
            self.proc.wait()
            raise self.error("the lazy-pages daemon did not start")

    def wait(self) -> int:
        return self.proc.wait()

    def error(self, what: str) -> CriuError:
        cause = criu_logs.cause(self.log_path) or what
        return CriuError("lazy-pages", cause, log_path=str(self.log_path), node=self.criu.node)

    def kill(self) -> None:
        _kill(self.proc)
