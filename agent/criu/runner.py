"""A thin adapter over CRIU's RPC service (`criu swrk`).

Each operation starts `criu swrk FD` on one end of a SOCK_SEQPACKET socketpair
and exchanges one protobuf request and response (CRIU's own rpc.proto,
compiled at build time). The options come from agent.criu.options, which the
command-line runs of post-copy (agent.criu.lazy) share. Every exchange has a
deadline; errors come back structured and always name the images directory
and the CRIU log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from agent import config
from agent.criu import images as criu_images
from agent.criu import logs as criu_logs
from agent.criu import swrk
from agent.criu.options import (
    GHOST_LIMIT,
    LOG_LEVEL,
    CriuOptions,
    InheritFd,
    TlsFiles,
    dump_options,
    restore_options,
)
from agent.criu.swrk import START_TIMEOUT_S, SWRK_TIMEOUT_S, PageServer
from agent.criu.tracking import DirtyTrackers
from agent.criu_pb import rpc_pb2, stats_pb2  # swrk says what to do if they are not compiled
from agent.errors import CriuError, RefusedError, StepTimeoutError

DUMP_LOG = "criu-dump.log"
PAGE_SERVER_LOG = "criu-page-server.log"
RESTORE_LOG = "criu-restore.log"
STATS_DUMP = "stats-dump"
STATS_RESTORE = "stats-restore"
#: `criu --version` and `criu check [--feature]`: probes of the binary and the kernel that take
#: well under a second; a minute allows for a loaded node.
PROBE_TIMEOUT_S = 60.0
#: 4.1.1 cannot dump inet sockets on Linux >= 6.16 (it asks every socket for SO_PASSCRED).
MIN_VERSION = (4, 2, 1)
#: CRIU's lazy page server sizes its pipe to 4 MiB (PIPE_MAX_SIZE pages, rounded up).
LAZY_PIPE_BYTES = 4 << 20
_CAP_SYS_RESOURCE = 24


def lazy_dump_blocker(
    status: Path = Path("/proc/self/status"), pipe_max: Path = Path("/proc/sys/fs/pipe-max-size")
) -> str:
    """Why a lazy dump (agent.criu.lazy) would fail on this node, or "" if it can run.

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


@dataclass
class DumpResult:
    stats: dict[str, int] = field(default_factory=dict)


@dataclass
class RestoreResult:
    pid: int
    stats: dict[str, int] = field(default_factory=dict)


class Criu:
    """One method per CRIU operation; `binary` defaults to config.criu_binary()."""

    def __init__(self, binary: str | None = None, node: str = "") -> None:
        self._binary = binary
        self.node = node
        #: The last version read, and the binary's identity then: GetInfo (which peers' pings
        #: call every second) must not run `criu --version` each time, yet a CRIU replaced
        #: under a running agent is read again.
        self._version: tuple[tuple[int, int, int], tuple[int, int, int]] | None = None
        #: What keeps the written memory of trees dumped with track_mem tracked between dumps,
        #: where CRIU tracks it with userfaultfds (agent.criu.tracking).
        self.trackers = DirtyTrackers()

    @property
    def binary(self) -> str:
        if self._binary is None:
            self._binary = config.criu_binary()
        return self._binary

    def _probe(self, op: str, *args: str) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                [self.binary, *args], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False
            )
        except subprocess.TimeoutExpired:  # run() has killed and reaped it
            raise StepTimeoutError(
                f"`criu {' '.join(args)}` did not finish within {PROBE_TIMEOUT_S:g} s; killed it",
                step=f"criu {op}",
                node=self.node,
                hint=f"run `{self.binary} {' '.join(args)}` by hand to see where it hangs",
            ) from None
        except OSError as e:
            cause = f"cannot run {self.binary}: {e}"
            raise CriuError(op, cause, node=self.node, hint="run `make criu`") from e

    def version(self) -> tuple[int, int, int]:
        try:
            st = os.stat(self.binary)
            same = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            same = None  # _probe says why it cannot run
        if same is not None and self._version is not None and self._version[0] == same:
            return self._version[1]
        out = self._probe("version", "--version").stdout
        m = re.search(r"Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", out)
        if not m:
            raise CriuError(
                "version", f"cannot parse `criu --version` output: {out.strip()!r}", node=self.node
            )
        got = int(m[1]), int(m[2]), int(m[3] or 0)
        if same is not None:
            self._version = (same, got)
        return got

    def check(self) -> tuple[bool, str]:
        """`criu check`: whether this kernel can dump and restore, and what CRIU said (a check
        that hangs is a no, with the reason)."""
        try:
            p = self._probe("check", "check")
        except StepTimeoutError as e:
            return False, str(e)
        return p.returncode == 0, (p.stdout + p.stderr).strip()

    def feature(self, name: str) -> bool:
        return self._probe("check", "check", "--feature", name).returncode == 0

    def lazy_dump_blocker(self) -> str:
        """Why this node cannot serve a post-copy dump now, or "" (agent.criu.lazy)."""
        return lazy_dump_blocker()

    def require_usable(self) -> str:
        """Raise a precise refusal unless CRIU is present and new enough; return its version."""
        major, minor, patch = self.version()
        if (major, minor, patch) < MIN_VERSION:
            need = ".".join(map(str, MIN_VERSION))
            raise RefusedError(
                f"CRIU {major}.{minor}.{patch} at {self.binary} is too old (need >= {need})",
                step="criu check",
                node=self.node,
                hint=f"run `make criu` to build CRIU {need}",
            )
        return f"{major}.{minor}.{patch}"

    def dump(
        self,
        pid: int,
        images_dir: Path,
        *,
        leave_running: bool = False,
        leave_stopped: bool = True,
        shell_job: bool = False,
        timeout_s: int = 0,
        on_start: Callable[[int], None] | None = None,
        page_server: tuple[str, int] | None = None,
        tls: TlsFiles | None = None,
        log_dir: Path | None = None,
        external: list[str] | None = None,
        deadline_s: float | None = None,
        track_mem: bool = False,
        parent_img: str = "",
        log_level: int = LOG_LEVEL,
    ) -> DumpResult:
        """Dump the tree rooted at `pid` into `images_dir` (log: criu-dump.log in log_dir, by
        default images_dir; CRIU's stats go there too).

        on_start gets CRIU's pid as soon as it runs (the migration journal keeps it). With
        page_server (host, port) and tls, the memory pages go to the page server listening there
        instead of into images_dir; the rest of the image is written there.
        `external`: CRIU's --external items (the job's link, `veth[eth0]:NAME`). CRIU never
        locks the network: ferry does, by cutting the job's link (agent.jobs.network).
        timeout_s is CRIU's own limit on freezing the tree; deadline_s (SWRK_TIMEOUT_S by
        default) bounds the whole dump, after which CRIU is killed. track_mem clears the tree's
        dirty bits (or write-protects its memory again, self.trackers keeping what tracks it);
        parent_img (relative to images_dir, with track_mem) makes the dump incremental: the
        pages not written since that dump stay in its images. log_level: CRIU's -v.
        """
        opts = dump_options(
            pid,
            images_dir,
            DUMP_LOG,
            work_dir=log_dir,
            leave_running=leave_running,
            leave_stopped=leave_stopped,
            shell_job=shell_job,
            external=external,
            freeze_timeout_s=timeout_s,
            page_server=page_server,
            tls=tls,
            track_mem=track_mem,
            parent_img=parent_img,
            log_level=log_level,
        )
        keep = None
        if track_mem:
            self.trackers.before_dump(pid, whole=not parent_img)

            def keep(resp: rpc_pb2.criu_resp, fds: list[int]) -> None:
                self.trackers.keep(pid, fds)

        self._call(
            "dump", rpc_pb2.DUMP, opts, pass_fds=[], on_start=on_start, deadline_s=deadline_s, keep_fds=keep
        )
        return DumpResult(stats=read_stats((log_dir or images_dir) / STATS_DUMP, "dump"))

    def restore(
        self,
        images_dir: Path,
        *,
        inherit: list[InheritFd] = (),  # type: ignore[assignment]
        shell_job: bool = False,
        log_dir: Path | None = None,
        on_start: Callable[[int], None] | None = None,
        leave_stopped: bool = False,
        lazy_pages: bool = False,
        root: str = "",
        external: list[str] | None = None,
        deadline_s: float | None = None,
        track_mem: bool = False,
        log_level: int = LOG_LEVEL,
    ) -> RestoreResult:
        """Restore the tree as a sibling of CRIU, i.e. as a child of this process; with
        leave_stopped, every task waits for SIGCONT. With lazy_pages, the memory comes from
        a `criu lazy-pages` daemon already listening in log_dir (criu_lazy.LazyPagesDaemon).
        root: "/" for a job in a mount namespace of its own (CRIU rebuilds it on this root);
        external: its link's new outer end, `veth[eth0]:NAME` (left down, off any bridge).
        deadline_s: as dump's.
        track_mem: the restored tree's written memory is tracked from the restore on (ferry's
        CRIU, where it tracks with userfaultfds: their descriptors stay in `trackers`), so that
        its first dump may be an increment over `images_dir`. log_level: CRIU's -v (a restore
        from a snapshot chain logs some 90,000 debug lines at 4)."""
        opts = restore_options(
            images_dir,
            RESTORE_LOG,
            work_dir=log_dir,
            inherit=inherit,
            shell_job=shell_job,
            leave_stopped=leave_stopped,
            lazy_pages=lazy_pages,
            root=root,
            external=external,
            track_mem=track_mem,
            log_level=log_level,
        )
        resp = self._call(
            "restore",
            rpc_pb2.RESTORE,
            opts,
            pass_fds=[i.fd for i in inherit],
            on_start=on_start,
            deadline_s=deadline_s,
            keep_fds=lambda resp, fds: self.trackers.keep(resp.restore.pid, fds),
        )
        stats = read_stats((log_dir or images_dir) / STATS_RESTORE, "restore")
        return RestoreResult(pid=resp.restore.pid, stats=stats)

    def page_server(
        self,
        images_dir: Path,
        log_dir: Path | None = None,
        *,
        address: str,
        tls: TlsFiles,
        timeout_s: float = START_TIMEOUT_S,
    ) -> PageServer:
        """Start a page server listening on `address` (a port the kernel picks: `.port`) for one
        dump over TLS, writing its pages into `images_dir` (log: criu-page-server.log in
        log_dir, by default images_dir); timeout_s bounds its start.

        It runs until the dumping side closes the protocol; `PageServer.wait` says how it ended.
        """
        opts = CriuOptions(images_dir, PAGE_SERVER_LOG, work_dir=log_dir, ghost_limit=GHOST_LIMIT)
        opts = dataclasses.replace(opts, ps_address=address, tls=tls)
        log_path = _log_path(opts)
        with self._rpc_opts("page-server", opts) as msg:
            proc, ours = swrk.start(self.binary, "page-server", self.node, [], subprocess.DEVNULL)
            server = PageServer(proc, ours, log_path, self.node, images_dir=images_dir)
            # keep_open: the same swrk later waits for the server (WAIT_PID) and reports its status.
            req = rpc_pb2.criu_req(type=rpc_pb2.PAGE_SERVER_CHLD, opts=msg, keep_open=True)
            resp = server.request(req, timeout_s)
        if not resp.success or not resp.ps.pid:
            server.kill()
            cause = criu_logs.cause(log_path, resp.cr_errmsg) or "CRIU could not start a page server"
            raise CriuError("page-server", cause, log_path=log_path, node=self.node)
        server.started(resp.ps.pid, resp.ps.port)
        return server

    # -- plumbing -------------------------------------------------------------

    @contextlib.contextmanager
    def _rpc_opts(self, op: str, opts: CriuOptions) -> Iterator[rpc_pb2.criu_opts]:
        """The RPC rendering of opts. CRIU opens the directories through /proc/<our pid>/fd/N:
        they stay open here until the block (in which CRIU answers) ends."""
        msg = rpc_pb2.criu_opts()
        with contextlib.ExitStack() as fds:
            images_fd = _open_dir(opts.images_dir, op, self.node)
            fds.callback(os.close, images_fd)
            work_fd = -1
            if opts.work_dir is not None:  # saved images may be read-only: CRIU then logs in work_dir
                work_fd = _open_dir(opts.work_dir, op, self.node)
                fds.callback(os.close, work_fd)
            opts.to_rpc(msg, images_dir_fd=images_fd, work_dir_fd=work_fd)
            yield msg

    def _call(
        self,
        op: str,
        req_type: int,
        opts: CriuOptions,
        *,
        pass_fds: list[int],
        on_start: Callable[[int], None] | None,
        deadline_s: float | None,
        keep_fds: Callable[[rpc_pb2.criu_resp, list[int]], None] | None = None,
    ) -> rpc_pb2.criu_resp:
        with self._rpc_opts(op, opts) as msg:
            req = rpc_pb2.criu_req(type=req_type, opts=msg)
            return swrk.exchange(
                self.binary,
                self.node,
                op,
                req,
                images_dir=opts.images_dir,
                log_path=_log_path(opts),
                pass_fds=pass_fds,
                on_start=on_start,
                deadline_s=deadline_s or SWRK_TIMEOUT_S,
                keep_fds=keep_fds,
            )


def _log_path(opts: CriuOptions) -> str:
    return str((opts.work_dir or opts.images_dir) / opts.log_file)


def _open_dir(path: Path, op: str, node: str) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise CriuError(op, f"cannot open directory {path}: {e.strerror}", node=node) from e


def read_stats(path: Path, which: str) -> dict[str, int]:
    """Parse CRIU's stats-dump / stats-restore image into a flat dict (empty if absent)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    first = next(criu_images.entries(raw), None)
    if first is None:
        return {}
    entry = stats_pb2.stats_entry()
    entry.ParseFromString(first)
    part = entry.dump if which == "dump" else entry.restore
    return {f.name: int(v) for f, v in part.ListFields()}
