"""Post-copy with CRIU lazy pages: a dump whose memory stays behind, and the daemon that pulls it.

The source runs `criu dump --lazy-pages`: it writes everything but the memory,
says so, and then serves pages from the frozen tree until the target has them
all, listening on a TCP port of its node. The target runs `criu lazy-pages`,
which takes the restored tree's userfaultfd, connects there and fetches each
page when the job first touches it (and the rest in the background). Their
connection is CRIU's TLS, each trusting only the other's one-time certificate
(agent/migration/datatls.py); the agents only control it
(agent/migration/pagestream.py).

Both are started from the command line, which has --status-fd to say when CRIU
is ready. Errors come from the logs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import select
import signal
import subprocess
import time
from pathlib import Path

from agent.criu import child
from agent.criu import logs as criu_logs
from agent.criu.options import CriuOptions, TlsFiles, dump_options
from agent.criu.runner import DUMP_LOG, STATS_DUMP, Criu, DumpResult, read_stats

# Where a lazy dump can run is a probe of this node, so it lives with the others in runner (which
# must not import this module); still importable from here, where post-copy's callers look.
from agent.criu.runner import LAZY_PIPE_BYTES as LAZY_PIPE_BYTES
from agent.criu.runner import lazy_dump_blocker as lazy_dump_blocker
from agent.errors import CriuError

LAZY_PAGES_LOG = "criu-lazy-pages.log"
#: A backstop for the waits on a post-copy that no caller bounds: it ends once the target has
#: every page, and the source's wait is sized by the job's memory (migration.source_postcopy).
#: A day is 1.7 TiB at the slowest rate the source accepts (20 MB/s).
LAZY_MAX_S = 24 * 3600.0


def _start(criu: Criu, command: str, opts: CriuOptions) -> tuple[subprocess.Popen[bytes], int]:
    """`criu COMMAND` with opts (its page connection at opts.ps_address), without plugins;
    returns it and the read end of its --status-fd, which gets one byte once CRIU is ready (EOF
    if it dies first): _await_ready reads it."""
    ready_r, ready_w = os.pipe()
    cmd = [criu.binary, command, *dataclasses.replace(opts, status_fd=ready_w).to_argv()]
    try:
        proc = subprocess.Popen(
            cmd,
            env=child.env(),
            pass_fds=[ready_w],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    except OSError as e:
        os.close(ready_r)
        raise CriuError(command, f"cannot start {criu.binary}: {e}", node=criu.node) from e
    finally:
        os.close(ready_w)
    return proc, ready_r


def _await_ready(
    proc: subprocess.Popen[bytes], fd: int, timeout_s: float, op: str, criu: Criu, opts: CriuOptions
) -> None:
    """Return once CRIU wrote its ready byte to fd (which this closes). A CRIU that exits first
    is a CriuError quoting its log; one that takes longer than timeout_s is killed."""
    log_path = _log_path(opts)
    try:
        if select.select([fd], [], [], max(timeout_s, 0.0))[0]:
            if os.read(fd, 1) == b"\0":
                return
        else:
            what = f"CRIU did not get ready within {timeout_s:g} s"
            node, images = criu.node, opts.images_dir
            raise child.timed_out(proc, op, what, node=node, images_dir=images, log_path=log_path)
    finally:
        os.close(fd)
    # EOF: it died (or closed the pipe and lives on, which finish() ends).
    code = child.finish(proc)
    what = f"CRIU exited before it was ready ({code})" if code is not None else "CRIU never got ready"
    raise CriuError(op, criu_logs.cause(log_path) or what, log_path=str(log_path), node=criu.node)


_PAGEMAP = re.compile(rb"Pagemap generated: \d+ pages \((\d+) lazy\)")


def lazy_pages_logged(log_path: Path) -> int:
    """How many pages a lazy dump left to fetch, from its log (one line per memory area)."""
    try:
        return sum(int(m[1]) for m in _PAGEMAP.finditer(log_path.read_bytes()))
    except OSError:
        return 0


def _log_path(opts: CriuOptions) -> Path:
    return (opts.work_dir or opts.images_dir) / opts.log_file


class LazyDump:
    """`criu dump --lazy-pages` on the tree at `pid`, its page server listening at `address`.

    `ready()` returns once the image minus the memory is in images_dir; `wait()` once the
    target has every page (or the transfer failed: CRIU then lets the tree go, which a
    tree stopped beforehand survives still stopped).
    """

    def __init__(
        self,
        criu: Criu,
        pid: int,
        images_dir: Path,
        address: tuple[str, int],
        tls: TlsFiles,
        *,
        shell_job: bool = False,
        log_dir: Path | None = None,
        external: list[str] | None = None,
    ) -> None:
        self.criu = criu
        self.work_dir = log_dir or images_dir  # the log and the stats go there
        self.log_path = self.work_dir / DUMP_LOG
        # The same dump as Criu.dump's, but its pages stay behind, served at address.
        self.opts = dump_options(
            pid,
            images_dir,
            DUMP_LOG,
            work_dir=self.work_dir,
            leave_stopped=True,
            shell_job=shell_job,
            external=external,
            page_server=address,
            tls=tls,
            lazy_pages=True,
        )
        self.proc, self._ready_fd = _start(criu, "dump", self.opts)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def ready(self, timeout_s: float) -> None:
        _await_ready(self.proc, self._ready_fd, timeout_s, "dump", self.criu, self.opts)

    def wait(self, timeout_s: float | None = None) -> DumpResult:
        """Until the target has every page, within timeout_s (None: LAZY_MAX_S)."""
        timeout_s = LAZY_MAX_S if timeout_s is None else timeout_s
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise child.timed_out(
                self.proc,
                "dump",
                f"the job's memory was not all fetched within {timeout_s:g} s",
                node=self.criu.node,
                images_dir=self.opts.images_dir,
                log_path=self.log_path,
                hint="the target's `ferry ps` says whether its copy of the job survived; "
                "the CRIU log says which pages were still being served",
            ) from None
        if code != 0:
            raise self._error(f"the lazy page transfer failed (criu exit {code})")
        stats = read_stats(self.work_dir / STATS_DUMP, "dump")
        # The lazy page server starts its statistics afresh, so the count is in the log only.
        stats["pages_lazy"] = lazy_pages_logged(self.log_path)
        return DumpResult(stats=stats)

    def kill(self) -> None:
        child.kill(self.proc)

    def _error(self, what: str) -> CriuError:
        cause = criu_logs.cause(self.log_path) or what
        return CriuError("dump", cause, log_path=str(self.log_path), node=self.criu.node)


class LazyPagesDaemon:
    """`criu lazy-pages` for a restore from images_dir: it listens in work_dir (where the
    restore must run) and fetches pages from the lazy dump at `source`; it exits once all are in."""

    def __init__(
        self,
        criu: Criu,
        images_dir: Path,
        work_dir: Path,
        source: tuple[str, int],
        tls: TlsFiles,
        timeout_s: float,
    ) -> None:
        self.criu = criu
        self.log_path = work_dir / LAZY_PAGES_LOG
        host, port = source
        self.opts = CriuOptions(
            images_dir, LAZY_PAGES_LOG, work_dir=work_dir, ps_address=host, ps_port=port, tls=tls
        )
        self.proc, ready_r = _start(criu, "lazy-pages", self.opts)
        _await_ready(self.proc, ready_r, timeout_s, "lazy-pages", criu, self.opts)

    def wait(self, timeout_s: float | None = None) -> int:
        """Its exit status once every page is in (0) or the transfer broke; within timeout_s
        (None: LAZY_MAX_S), or it is killed."""
        timeout_s = LAZY_MAX_S if timeout_s is None else timeout_s
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise child.timed_out(
                self.proc,
                "lazy-pages",
                f"the restored job's memory did not all arrive within {timeout_s:g} s",
                node=self.criu.node,
                images_dir=self.opts.images_dir,
                log_path=self.log_path,
            ) from None

    def error(self, what: str) -> CriuError:
        cause = criu_logs.cause(self.log_path) or what
        return CriuError("lazy-pages", cause, log_path=str(self.log_path), node=self.criu.node)

    def kill(self) -> None:
        child.kill(self.proc)


def gone_before_restore_end(criu_pid: int, daemon: LazyPagesDaemon) -> None:
    """The fault point target-lazy-gone (tests only): once the daemon logs its first task, stop
    CRIU's restore (criu_pid), give every task time to hand its userfaultfd over, kill the
    daemon, and let CRIU go on to the end of its restore, where it tells a daemon gone."""
    deadline = time.monotonic() + 30.0
    while b"Received PID" not in _read(daemon.log_path):
        if time.monotonic() > deadline or daemon.proc.poll() is not None:
            return
        time.sleep(0.001)
    with contextlib.suppress(ProcessLookupError):
        os.kill(criu_pid, signal.SIGSTOP)
        time.sleep(0.5)
        daemon.kill()
        os.kill(criu_pid, signal.SIGCONT)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""
