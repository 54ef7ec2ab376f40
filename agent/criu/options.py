"""One set of CRIU options, rendered to `criu swrk` RPC fields and to a command line.

Dump, restore and the pre-copy page server go over RPC (agent/criu/runner.py); the
post-copy pair, `criu dump --lazy-pages` and `criu lazy-pages`, runs from the command
line (agent/criu/lazy.py). Both are rendered from one CriuOptions, and the factories
below say once what a ferry dump or restore needs, so the two paths cannot drift
apart: tests/unit/test_criu_options.py checks that every field reaches both
renderings, or is in ONE_PATH_ONLY with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

try:
    from agent.criu_pb import rpc_pb2
except ImportError as e:  # pragma: no cover - only without a build
    raise SystemExit("ferry: CRIU's protos are not compiled (agent/criu_pb); run `make proto`") from e

#: Unlinked files a job holds open (PyTorch's shared-memory tensors) travel
#: inside the image; CRIU's 1 MiB default is far too small for training jobs.
GHOST_LIMIT = 1 << 31
#: Debug: CRIU's log is the only record of why a step failed, and errors quote it.
LOG_LEVEL = 4
#: CRIU's network_lock methods; ferry locks the network itself (agent.jobs.network), so "skip".
NETWORK_LOCKS = ("iptables", "nftables", "skip")
#: CRIU's cgroup modes ferry uses: "ignore" leaves cgroups alone on dump and restore, so a job
#: runs in the cgroup of the agent that restored it. The source's cgroup path means nothing on
#: another node (CRIU would make it there, outside the target's resource control), and a
#: throttled cgroup, the very reason a straggler moves, must not follow it.
CGROUP_MODES = ("ignore",)

#: Fields only one rendering carries, and why.
ONE_PATH_ONLY: dict[str, str] = {
    "status_fd": "argv only: over RPC CRIU's answer is the readiness signal (rpc.proto marks "
    "status_fd obsolete); a command-line CRIU has only --status-fd to say it is ready",
}


@dataclass(frozen=True)
class TlsFiles:
    """TLS for CRIU's page connection: the peer's certificate (the only one trusted), ours, our
    key (agent.migration.datatls makes them for one migration)."""

    cacert: Path
    cert: Path
    key: Path


@dataclass(frozen=True)
class InheritFd:
    """A file the restored tree gets from us instead of opening by path."""

    path: str  # the path as the job had it open on the source
    fd: int  # an fd of ours to use in its place

    @property
    def key(self) -> str:
        # CRIU keys regular files by their path without the leading slash.
        return self.path.lstrip("/")


@dataclass(frozen=True)
class CriuOptions:
    """What one CRIU run is told. Defaults but log_level render as nothing: CRIU's own apply."""

    images_dir: Path
    log_file: str  # a name in work_dir: CRIU allows no subdirectories
    work_dir: Path | None = None  # logs and stats; images_dir if None
    log_level: int = LOG_LEVEL
    pid: int = 0  # the root of the tree to dump
    leave_running: bool = False
    leave_stopped: bool = False
    shell_job: bool = False
    tcp_established: bool = False
    ext_unix_sk: bool = False
    file_locks: bool = False
    network_lock: str = ""  # one of NETWORK_LOCKS
    cgroups: str = ""  # one of CGROUP_MODES ("": CRIU's default, soft)
    ghost_limit: int = 0
    freeze_timeout_s: int = 0  # CRIU's --timeout: how long collecting (freezing) the tree may take
    external: tuple[str, ...] = ()
    root: str = ""
    restore_sibling: bool = False
    lazy_pages: bool = False
    #: Dirty tracking (soft-dirty, or userfaultfd write-protect: agent.criu.tracking): the dump
    #: clears the bits, so that the next one knows what changed.
    track_mem: bool = False
    inherit_fd: tuple[InheritFd, ...] = ()
    #: A connected stream socket of ours speaking CRIU's page protocol (pass it to the child).
    page_server_fd: int = -1
    #: CRIU's page protocol on TCP instead: where a page server listens (port 0: one the kernel
    #: picks), or where a dump or a lazy-pages daemon connects to.
    ps_address: str = ""
    ps_port: int = 0
    #: TLS on that connection (CRIU's own, GnuTLS): the peer's pinned certificate, ours, our key.
    tls: TlsFiles | None = None
    status_fd: int = -1
    #: An incremental dump: where the previous dump's images are, relative to images_dir (CRIU
    #: links it as `parent`); pages the job has not written since stay there. Needs track_mem.
    parent_img: str = ""

    def __post_init__(self) -> None:
        if self.leave_running and self.leave_stopped:
            raise ValueError("leave_running and leave_stopped exclude each other")
        if self.network_lock and self.network_lock not in NETWORK_LOCKS:
            raise ValueError(f"network_lock {self.network_lock!r} is not one of {NETWORK_LOCKS}")
        if self.cgroups and self.cgroups not in CGROUP_MODES:
            raise ValueError(f"cgroups {self.cgroups!r} is not one of {CGROUP_MODES}")
        if self.ps_address and self.page_server_fd >= 0:
            raise ValueError("a page server is reached through a socket or at an address, not both")

    def to_rpc(self, msg: rpc_pb2.criu_opts, *, images_dir_fd: int, work_dir_fd: int = -1) -> None:
        """Fill in `msg`. CRIU opens the directories as /proc/<our pid>/fd/N, so the
        caller opens them (images_dir, work_dir) and keeps them open until CRIU has answered."""
        if self.lazy_pages and self.page_server_fd >= 0:
            # Over RPC a lazy dump ignores the socket and listens on a TCP port instead: an
            # unauthenticated door to the job's memory. The command line honours it (lazy.py).
            raise ValueError("lazy pages with a page-server socket run from the command line only")
        if self.work_dir is not None and work_dir_fd < 0:
            raise ValueError("work_dir is set: pass its open fd as work_dir_fd")
        msg.images_dir_fd = images_dir_fd
        if self.work_dir is not None:
            msg.work_dir_fd = work_dir_fd
        msg.log_file = self.log_file
        msg.log_level = self.log_level
        if self.pid:
            msg.pid = self.pid
        for name in _FLAGS:
            if getattr(self, name):
                setattr(msg, _RPC_NAME.get(name, name), True)
        if self.network_lock:
            msg.network_lock = rpc_pb2.criu_network_lock_method.Value(self.network_lock.upper())
        if self.cgroups:
            msg.manage_cgroups_mode = rpc_pb2.criu_cg_mode.Value(self.cgroups.upper())
        if self.ghost_limit:
            msg.ghost_limit = self.ghost_limit
        if self.freeze_timeout_s:
            msg.timeout = self.freeze_timeout_s
        msg.external.extend(self.external)
        if self.root:
            msg.root = self.root
        if self.parent_img:
            msg.parent_img = self.parent_img
        for item in self.inherit_fd:
            msg.inherit_fd.add(key=item.key, fd=item.fd)
        if self.page_server_fd >= 0:
            msg.ps.fd = self.page_server_fd
            msg.ps.port = 0  # no TCP: the socket is the connection
        if self.ps_address or self.ps_port:
            msg.ps.address = self.ps_address
            msg.ps.port = self.ps_port
        if self.tls is not None:
            msg.tls = True
            msg.tls_cacert, msg.tls_cert, msg.tls_key = (str(p) for p in _tls_paths(self.tls))
            msg.tls_no_cn_verify = True  # the peer's certificate is pinned (agent.migration.datatls)

    def to_argv(self) -> list[str]:
        """The options of a `criu COMMAND` command line (the command itself is the caller's)."""
        argv = ["--images-dir", str(self.images_dir)]
        if self.work_dir is not None:
            argv += ["--work-dir", str(self.work_dir)]
        argv += ["--log-file", self.log_file, f"-v{self.log_level}"]
        if self.pid:
            argv += ["--tree", str(self.pid)]
        argv += [_ARGV_FLAG[name] for name in _FLAGS if getattr(self, name)]
        if self.network_lock:
            argv += ["--network-lock", self.network_lock]
        if self.cgroups:
            argv.append(f"--manage-cgroups={self.cgroups}")  # its argument is optional: one word
        if self.ghost_limit:
            argv += ["--ghost-limit", str(self.ghost_limit)]
        if self.freeze_timeout_s:
            argv += ["--timeout", str(self.freeze_timeout_s)]
        for item in self.external:
            argv += ["--external", item]
        if self.root:
            argv += ["--root", self.root]
        if self.parent_img:
            argv += ["--prev-images-dir", self.parent_img]
        for fd in self.inherit_fd:
            argv += ["--inherit-fd", f"fd[{fd.fd}]:{fd.key}"]
        if self.page_server_fd >= 0:
            # A lazy dump serves its pages on the socket; any other run sends (dump) or fetches
            # (lazy-pages) them through it, which the command line spells --page-server.
            argv += ["--ps-socket", str(self.page_server_fd)]
            if not self.lazy_pages:
                argv.append("--page-server")
        if self.ps_address or self.ps_port:
            # A lazy dump listens there; a dump or a lazy-pages daemon connects with --page-server.
            argv += ["--address", self.ps_address, "--port", str(self.ps_port)]
            if not self.lazy_pages:
                argv.append("--page-server")
        if self.tls is not None:
            cacert, cert, key = (str(p) for p in _tls_paths(self.tls))
            argv += [
                "--tls",
                "--tls-cacert",
                cacert,
                "--tls-cert",
                cert,
                "--tls-key",
                key,
                "--tls-no-cn-verify",
            ]
        if self.status_fd >= 0:
            argv += ["--status-fd", str(self.status_fd)]
        return argv


def _tls_paths(tls: TlsFiles) -> tuple[Path, Path, Path]:
    return tls.cacert, tls.cert, tls.key


#: The boolean fields, their command-line flags, and their RPC names where those differ.
_ARGV_FLAG = {
    "leave_running": "--leave-running",
    "leave_stopped": "--leave-stopped",
    "shell_job": "--shell-job",
    "tcp_established": "--tcp-established",
    "ext_unix_sk": "--ext-unix-sk",
    "file_locks": "--file-locks",
    "restore_sibling": "--restore-sibling",
    "lazy_pages": "--lazy-pages",
    "track_mem": "--track-mem",
}
_FLAGS = tuple(_ARGV_FLAG)
_RPC_NAME = {"restore_sibling": "rst_sibling"}


def dump_options(
    pid: int,
    images_dir: Path,
    log_file: str,
    *,
    work_dir: Path | None = None,
    leave_running: bool = False,
    leave_stopped: bool = True,
    shell_job: bool = False,
    external: list[str] | tuple[str, ...] | None = None,
    freeze_timeout_s: int = 0,
    page_server: tuple[str, int] | None = None,
    tls: TlsFiles | None = None,
    lazy_pages: bool = False,
    track_mem: bool = False,
    parent_img: str = "",
    log_level: int = LOG_LEVEL,
) -> CriuOptions:
    """A dump of a ferry job, over RPC or (lazy) from the command line. page_server: where its
    page server listens (a lazy dump: where it listens itself), reached with tls. track_mem and
    parent_img: a group snapshot's dump, incremental against `parent_img` where given; log_level
    its own (agent.snapshots.config).

    Established TCP connections, external unix sockets and file locks travel with the
    job. CRIU never locks the network: ferry does, by cutting the job's link.
    """
    return CriuOptions(
        images_dir=images_dir,
        log_file=log_file,
        work_dir=work_dir,
        log_level=log_level,
        pid=pid,
        leave_running=leave_running,
        leave_stopped=leave_stopped and not leave_running,
        shell_job=shell_job,
        tcp_established=True,
        ext_unix_sk=True,
        file_locks=True,
        network_lock="skip",
        cgroups="ignore",
        ghost_limit=GHOST_LIMIT,
        freeze_timeout_s=freeze_timeout_s,
        external=tuple(external or ()),
        ps_address=page_server[0] if page_server else "",
        ps_port=page_server[1] if page_server else 0,
        tls=tls,
        lazy_pages=lazy_pages,
        track_mem=track_mem,
        parent_img=parent_img,
    )


def restore_options(
    images_dir: Path,
    log_file: str,
    *,
    work_dir: Path | None = None,
    inherit: list[InheritFd] | tuple[InheritFd, ...] = (),
    shell_job: bool = False,
    leave_stopped: bool = False,
    lazy_pages: bool = False,
    root: str = "",
    external: list[str] | tuple[str, ...] | None = None,
    track_mem: bool = False,
    log_level: int = LOG_LEVEL,
) -> CriuOptions:
    """A restore of a ferry job as a sibling of CRIU, i.e. a child of the agent."""
    return CriuOptions(
        images_dir=images_dir,
        log_file=log_file,
        work_dir=work_dir,
        leave_stopped=leave_stopped,
        shell_job=shell_job,
        tcp_established=True,
        ext_unix_sk=True,
        file_locks=True,
        cgroups="ignore",
        ghost_limit=GHOST_LIMIT,
        external=tuple(external or ()),
        root=root,
        restore_sibling=True,
        lazy_pages=lazy_pages,
        inherit_fd=tuple(inherit),
        track_mem=track_mem,
        log_level=log_level,
    )
