"""A thin adapter over CRIU's RPC service (`criu swrk`).

Each operation starts `criu swrk FD` on one end of a SOCK_SEQPACKET socketpair
and exchanges one protobuf request and response (CRIU's own rpc.proto,
compiled at build time). Errors come back structured and always name the
images directory and the CRIU log.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import re
import socket
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from agent import config
from agent.criu import images as criu_images
from agent.criu import logs as criu_logs
from agent.errors import CriuError, RefusedError

log = logging.getLogger(__name__)

try:
    from agent.criu_pb import rpc_pb2, stats_pb2
except ImportError as e:  # pragma: no cover - only without a build
    raise SystemExit("ferry: CRIU's protos are not compiled (agent/criu_pb); run `make proto`") from e

DUMP_LOG = "criu-dump.log"
PAGE_SERVER_LOG = "criu-page-server.log"
RESTORE_LOG = "criu-restore.log"
STATS_DUMP = "stats-dump"
STATS_RESTORE = "stats-restore"
#: Unlinked files a job holds open (PyTorch's shared-memory tensors) travel
#: inside the image; CRIU's 1 MiB default is far too small for training jobs.
GHOST_LIMIT = 1 << 31
_MAX_MSG = 1 << 20
START_TIMEOUT_S = 60.0
#: 4.1.1 cannot dump inet sockets on Linux >= 6.16 (it asks every socket for SO_PASSCRED).
MIN_VERSION = (4, 2, 1)


@dataclass(frozen=True)
class InheritFd:
    """A file the restored tree gets from us instead of opening by path."""

    path: str  # the path as the job had it open on the source
    fd: int  # an fd of ours to use in its place

    @property
    def key(self) -> str:
        # CRIU keys regular files by their path without the leading slash.
        return self.path.lstrip("/")


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

    @property
    def binary(self) -> str:
        if self._binary is None:
            self._binary = config.criu_binary()
        return self._binary

    def version(self) -> tuple[int, int, int]:
        out = subprocess.run(
            [self.binary, "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
        m = re.search(r"Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", out)
        if not m:
            raise CriuError(
                "version", f"cannot parse `criu --version` output: {out.strip()!r}", node=self.node
            )
        return int(m[1]), int(m[2]), int(m[3] or 0)

    def check(self) -> tuple[bool, str]:
        """`criu check`: whether this kernel can dump and restore, and what CRIU said."""
        p = subprocess.run([self.binary, "check"], capture_output=True, text=True, timeout=60, check=False)
        return p.returncode == 0, (p.stdout + p.stderr).strip()

    def feature(self, name: str) -> bool:
        p = subprocess.run(
            [self.binary, "check", "--feature", name], capture_output=True, text=True, timeout=60, check=False
        )
        return p.returncode == 0

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
        page_server_fd: int = -1,
        log_dir: Path | None = None,
        external: list[str] | None = None,
    ) -> DumpResult:
        """Dump the tree rooted at `pid` into `images_dir` (log: criu-dump.log in log_dir, by
        default images_dir; CRIU's stats go there too).

        on_start gets CRIU's pid as soon as it runs (the migration journal keeps it). With
        page_server_fd, a connected stream socket, the memory pages go to a page server on
        its other end instead of into images_dir; the rest of the image is written there.
        `external`: CRIU's --external items (the job's link, `veth[eth0]:NAME`). CRIU never
        locks the network: ferry does, by cutting the job's link (agent.jobs.network).
        """
        opts = self._opts(images_dir, DUMP_LOG)
        pass_fds = []
        if page_server_fd >= 0:
            opts.ps.fd = page_server_fd
            opts.ps.port = 0
            pass_fds.append(page_server_fd)
        opts.pid = pid
        if leave_running:
            opts.leave_running = True
        elif leave_stopped:
            opts.leave_stopped = True
        opts.shell_job = shell_job
        opts.tcp_established = True
        opts.ext_unix_sk = True
        opts.file_locks = True
        opts.network_lock = rpc_pb2.SKIP
        opts.external.extend(external or [])
        if timeout_s:
            opts.timeout = timeout_s
        self._call(
            "dump",
            rpc_pb2.DUMP,
            opts,
            images_dir,
            DUMP_LOG,
            pass_fds=pass_fds,
            log_dir=log_dir,
            on_start=on_start,
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
    ) -> RestoreResult:
        """Restore the tree as a sibling of CRIU, i.e. as a child of this process; with
        leave_stopped, every task waits for SIGCONT. With lazy_pages, the memory comes from
        a `criu lazy-pages` daemon already listening in log_dir (criu_lazy.LazyPagesDaemon).
        root: "/" for a job in a mount namespace of its own (CRIU rebuilds it on this root);
        external: its link's new outer end, `veth[eth0]:NAME@BRIDGE`."""
        opts = self._opts(images_dir, RESTORE_LOG)
        opts.rst_sibling = True
        opts.lazy_pages = lazy_pages
        if root:
            opts.root = root
        opts.external.extend(external or [])
        if leave_stopped:
            opts.leave_stopped = True
        opts.shell_job = shell_job
        opts.tcp_established = True
        opts.ext_unix_sk = True
        opts.file_locks = True
        for item in inherit:
            opts.inherit_fd.add(key=item.key, fd=item.fd)
        resp = self._call(
            "restore",
            rpc_pb2.RESTORE,
            opts,
            images_dir,
            RESTORE_LOG,
            pass_fds=[i.fd for i in inherit],
            log_dir=log_dir,
            on_start=on_start,
        )
        stats = read_stats((log_dir or images_dir) / STATS_RESTORE, "restore")
        return RestoreResult(pid=resp.restore.pid, stats=stats)

    def page_server(self, images_dir: Path, sock_fd: int, log_dir: Path | None = None) -> PageServer:
        """Start a page server that reads CRIU's page protocol from `sock_fd` (a connected
        stream socket) and writes the pages into `images_dir` (log: criu-page-server.log in
        log_dir, by default images_dir).

        It runs until the dumping side closes the protocol; `PageServer.wait` says how it ended.
        """
        opts = self._opts(images_dir, PAGE_SERVER_LOG)
        opts.ps.fd = sock_fd
        opts.ps.port = 0
        log_path = str((log_dir or images_dir) / PAGE_SERVER_LOG)
        # CRIU opens the directories through /proc/<our pid>/fd/N: they stay open until CRIU answers.
        dir_fd = _open_dir(images_dir, "page-server", self.node)
        work_fd = _open_dir(log_dir, "page-server", self.node) if log_dir is not None else -1
        try:
            opts.images_dir_fd = dir_fd
            if work_fd >= 0:
                opts.work_dir_fd = work_fd
            proc, ours = self._start_swrk("page-server", [sock_fd], stderr=subprocess.DEVNULL)
            server = PageServer(proc, ours, log_path, self.node)
            # keep_open: the same swrk later waits for the server (WAIT_PID) and reports its status.
            req = rpc_pb2.criu_req(type=rpc_pb2.PAGE_SERVER_CHLD, opts=opts, keep_open=True)
            resp = server.request(req, START_TIMEOUT_S)
        finally:
            os.close(dir_fd)
            if work_fd >= 0:
                os.close(work_fd)
        if not resp.success or not resp.ps.pid:
            server.kill()
            cause = criu_logs.cause(log_path, resp.cr_errmsg) or "CRIU could not start a page server"
            raise CriuError("page-server", cause, log_path=log_path, node=self.node)
        server.pid = resp.ps.pid
        return server

    # -- plumbing -------------------------------------------------------------

    def _opts(self, images_dir: Path, log_name: str) -> rpc_pb2.criu_opts:
        opts = rpc_pb2.criu_opts()
        opts.log_file = log_name
        opts.log_level = 4
        opts.ghost_limit = GHOST_LIMIT
        return opts

    def _call(
        self,
        op: str,
        req_type: int,
        opts: rpc_pb2.criu_opts,
        images_dir: Path,
        log_name: str,
        *,
        pass_fds: list[int] = (),  # type: ignore[assignment]
        log_dir: Path | None = None,
        on_start: Callable[[int], None] | None = None,
    ) -> rpc_pb2.criu_resp:
        log_path = str((log_dir or images_dir) / log_name)
        # CRIU opens directories through /proc/<our pid>/fd/N: they stay open here until it answers.
        dir_fds = []
        try:
            opts.images_dir_fd = _open_dir(images_dir, op, self.node)
            dir_fds.append(opts.images_dir_fd)
            if log_dir is not None:
                # Saved images may be read-only: CRIU then writes its log in work_dir.
                opts.work_dir_fd = _open_dir(log_dir, op, self.node)
                dir_fds.append(opts.work_dir_fd)
            return self._exchange(op, req_type, opts, log_path, pass_fds, on_start)
        finally:
            for fd in dir_fds:
                os.close(fd)

    def _start_swrk(
        self, op: str, pass_fds: list[int], stderr: int
    ) -> tuple[subprocess.Popen[bytes], socket.socket]:
        """`criu swrk` on one end of a SEQPACKET pair, no plugins; the other end is returned."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = subprocess.Popen(
                [self.binary, "swrk", str(theirs.fileno())],
                env={**os.environ, "CRIU_LIBS_DIR": no_plugins_dir()},
                pass_fds=[theirs.fileno(), *pass_fds],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
            )
        except OSError as e:
            ours.close()
            raise CriuError(op, f"cannot start {self.binary}: {e}", node=self.node) from e
        finally:
            theirs.close()
        return proc, ours

    def _exchange(
        self,
        op: str,
        req_type: int,
        opts: rpc_pb2.criu_opts,
        log_path: str,
        pass_fds: list[int],
        on_start: Callable[[int], None] | None,
    ) -> rpc_pb2.criu_resp:
        proc, ours = self._start_swrk(op, pass_fds, stderr=subprocess.PIPE)
        try:
            if on_start is not None:
                on_start(proc.pid)
            req = rpc_pb2.criu_req(type=req_type, opts=opts)
            ours.send(req.SerializeToString())
            data = ours.recv(_MAX_MSG)
        except OSError as e:
            raise CriuError(
                op, f"lost the RPC connection to criu swrk: {e}", log_path=log_path, node=self.node
            ) from e
        finally:
            ours.close()
            _, err = proc.communicate(timeout=120)
        if not data:
            detail = err.decode(errors="replace").strip().splitlines()[-1:] or ["no response"]
            raise CriuError(
                op, f"criu swrk exited ({proc.returncode}): {detail[0]}", log_path=log_path, node=self.node
            )
        resp = rpc_pb2.criu_resp()
        resp.ParseFromString(data)
        if not resp.success:
            cause = criu_logs.cause(log_path, resp.cr_errmsg) or "CRIU reported failure"
            raise CriuError(op, cause, log_path=log_path, errno=resp.cr_errno, node=self.node)
        log.debug("criu %s ok (log %s)", op, log_path)
        return resp


class PageServer:
    """A running `criu page-server` child of a `criu swrk` we hold the RPC socket of."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket, log_path: str, node: str) -> None:
        self.proc = proc
        self.sock = sock
        self.log_path = log_path
        self.node = node
        self.pid = 0

    def request(self, req: rpc_pb2.criu_req, timeout_s: float | None = None) -> rpc_pb2.criu_resp:
        self.sock.settimeout(timeout_s)
        try:
            self.sock.send(req.SerializeToString())
            data = self.sock.recv(_MAX_MSG)
        except OSError as e:
            raise CriuError(
                "page-server",
                f"lost the RPC connection to criu swrk: {e}",
                log_path=self.log_path,
                node=self.node,
            ) from e
        if not data:
            raise CriuError("page-server", "criu swrk exited", log_path=self.log_path, node=self.node)
        resp = rpc_pb2.criu_resp()
        resp.ParseFromString(data)
        return resp

    def wait(self, timeout_s: float | None) -> None:
        """Until the server has exited; raise unless it wrote every page it was sent."""
        try:
            resp = self.request(rpc_pb2.criu_req(type=rpc_pb2.WAIT_PID, pid=self.pid), timeout_s)
        finally:
            self.close()
        status = resp.status if resp.HasField("status") else -1
        if not resp.success or status != 0:
            cause = criu_logs.cause(self.log_path) or f"page server ended with wait status {status}"
            raise CriuError("page-server", cause, log_path=self.log_path, node=self.node)

    def kill(self) -> None:
        """Stop it now (an aborted migration); its swrk parent then exits too."""
        if self.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, 9)
        self.close()

    def close(self) -> None:
        self.sock.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@functools.cache
def no_plugins_dir() -> str:
    """An empty directory of ours for CRIU's plugin search.

    ferry drives the CUDA checkpoint itself. CRIU's own CUDA plugin (in
    /usr/lib/criu on some installs) would restore CUDA a second time, which
    fails, so CRIU never loads plugins from the system directory.
    """
    path = tempfile.mkdtemp(prefix="ferry-criu-no-plugins-")

    def remove() -> None:
        with contextlib.suppress(OSError):
            os.rmdir(path)

    atexit.register(remove)
    return path


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
