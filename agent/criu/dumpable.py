"""What CRIU cannot dump, found in /proc before anything is frozen.

CRIU fails a dump half-way on a file it has no driver for (CRIU 4.2.1,
`criu/files.c`, `criu/sockets.c`): an anonymous inode other than eventfd,
eventpoll, inotify, fanotify, signalfd, timerfd, pidfd and bpf-map (io_uring
above all: the libuv behind torchrun's store opens one); a socket of a family
other than unix, inet, inet6, packet and netlink; a raw inet socket other than
ICMP; a character device other than the memory devices, tun and ttys. The
source refuses such a job in Prepare, one line per cause with its fix, and the
job goes on untouched. NVIDIA device files are CUDA's business (agent.cuda.jobs)
and pass here: the driver's checkpoint closes them.

A job that shares the agent's mount namespace (an adopted process) and uses
a file in `/dev/shm` is refused too: that is this node's shared memory,
which no other node has; jobs started by `ferry run` have a `/dev/shm` of
their own that travels with them.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from agent.errors import RefusedError
from agent.jobs.pidfd import dup_fd

#: anon_inode kinds CRIU 4.2.1 dumps.
ANON_OK = (
    "[eventfd]",
    "[eventpoll]",
    "inotify",
    "[fanotify]",
    "[signalfd]",
    "[timerfd]",
    "[pidfd]",
    "bpf-map",
)
#: Memory devices (major 1) CRIU dumps as files: null, zero, full, random, urandom.
MEM_OK = {3, 5, 7, 8, 9}
MEM_MAJOR, TTY_MAJORS, MISC_MAJOR, TUN_MINOR = 1, {4, 5, *range(136, 144)}, 10, 200
NVIDIA_MAJOR = 195
#: Socket families CRIU 4.2.1 dumps; of inet's raw sockets, only ICMP ones.
FAMILIES_OK = {socket.AF_UNIX, socket.AF_INET, socket.AF_INET6, socket.AF_PACKET, socket.AF_NETLINK}
ICMP_PROTOCOLS = {socket.IPPROTO_ICMP, socket.IPPROTO_ICMPV6}
_SOCKET = re.compile(r"^socket:\[(\d+)\]$")

IO_URING_FIX = (
    "start it with `ferry run`, where io_uring is unavailable and libraries fall back (libuv does), "
    "or disable io_uring in the program"
)


@dataclass(frozen=True)
class Obstacle:
    pid: int
    what: str  # "fd 11 (anon_inode:[io_uring])"
    why: str  # what CRIU cannot do
    fix: str


class ProcFs:
    """The few /proc reads this needs (tests give another root)."""

    def __init__(self, root: str = "/proc") -> None:
        self.root = Path(root)

    def fds(self, pid: int) -> list[tuple[int, str, int, int]]:
        """(fd, link, st_mode, st_rdev) of each open fd."""
        out = []
        with contextlib.suppress(OSError):
            for entry in (self.root / str(pid) / "fd").iterdir():
                with contextlib.suppress(OSError):
                    st = os.stat(entry)
                    out.append((int(entry.name), os.readlink(entry), st.st_mode, st.st_rdev))
        return sorted(out)

    def maps(self, pid: int) -> list[str]:
        try:
            return (self.root / str(pid) / "maps").read_text(errors="replace").splitlines()
        except OSError:
            return []

    def socket_kind(self, pid: int, fd: int) -> tuple[int, int, int] | None:
        """(family, type, protocol) of the process's socket fd, read from a duplicate of it
        (pidfd_getfd); None when it cannot be duplicated (kernel before 5.6, or gone)."""
        dup = dup_fd(pid, fd)
        if dup is None:
            return None
        with socket.socket(fileno=dup) as sk:  # closes the duplicate; the job's fd is untouched
            return int(sk.family), int(sk.type), sk.proto

    def net_ns(self, pid: int) -> str:
        try:
            return os.readlink(self.root / str(pid) / "ns" / "net")
        except OSError:
            return ""

    def mount_ns(self, pid: int) -> str:
        try:
            return os.readlink(self.root / str(pid) / "ns" / "mnt")
        except OSError:
            return ""


def obstacles(
    pids: Iterable[int], fs: ProcFs | None = None, agent_mount_ns: str | None = None
) -> list[Obstacle]:
    """Everything in the tree that CRIU cannot dump, or that no other node would have."""
    fs = fs or ProcFs()
    mine = agent_mount_ns if agent_mount_ns is not None else fs.mount_ns(os.getpid())
    found: list[Obstacle] = []
    for pid in pids:
        shares_host_shm = bool(mine) and fs.mount_ns(pid) == mine
        for fd, link, mode, rdev in fs.fds(pid):
            what = f"fd {fd} ({link})"
            if link.startswith("anon_inode:"):
                kind = link.removeprefix("anon_inode:")
                if kind == "[io_uring]":
                    found.append(Obstacle(pid, what, "CRIU cannot dump io_uring", IO_URING_FIX))
                elif not kind.startswith(ANON_OK):
                    found.append(Obstacle(pid, what, "CRIU cannot dump this kind of file", "close it first"))
            elif _SOCKET.match(link):
                if why := _socket(fs.socket_kind(pid, fd)):
                    found.append(Obstacle(pid, what, why, "close it before moving the job"))
            elif stat.S_ISCHR(mode):
                if why := _chrdev(rdev, link):
                    found.append(Obstacle(pid, what, why, "close the device before moving the job"))
            elif shares_host_shm and link.startswith("/dev/shm/") and not link.endswith(" (deleted)"):
                found.append(_host_shm(pid, what))
        if shares_host_shm:
            shm = sorted({ln.split(maxsplit=5)[5] for ln in fs.maps(pid) if " /dev/shm/" in ln})
            found += [_host_shm(pid, f"maps {p}") for p in shm if not p.endswith("(deleted)")]
    return found


def refuse_undumpable(
    pids: Iterable[int],
    node: str,
    fs: ProcFs | None = None,
    *,
    step: str = "prepare",
    same_node: bool = False,
) -> None:
    """One refusal naming every obstacle, before anything is frozen. same_node: the image comes
    back here (ferry checkpoint), so this node's /dev/shm is no obstacle."""
    if found := obstacles(pids, fs, "" if same_node else None):
        causes: dict[tuple[str, str], list[str]] = {}
        for o in found:
            causes.setdefault((o.why, o.fix), []).append(f"pid {o.pid} {o.what}")
        lines = [f"{_listed(where, 3)}: {why}; {fix}" for (why, fix), where in causes.items()]
        raise RefusedError(
            "CRIU cannot move this job: " + " | ".join(lines),
            step=step,
            node=node,
            hint="nothing was frozen; the job keeps running here",
        )


def _listed(items: list[str], most: int) -> str:
    """The first `most` items, and how many more."""
    more = f" and {len(items) - most} more" if len(items) > most else ""
    return ", ".join(items[:most]) + more


def _host_shm(pid: int, what: str) -> Obstacle:
    return Obstacle(
        pid,
        what,
        "that is this node's shared memory (/dev/shm), which another node does not have",
        "start the job with `ferry run`, whose /dev/shm is the job's own and moves with it",
    )


def _chrdev(rdev: int, link: str) -> str:
    major, minor = os.major(rdev), os.minor(rdev)
    if major == MEM_MAJOR and minor in MEM_OK:
        return ""
    if major in TTY_MAJORS or (major == MISC_MAJOR and minor == TUN_MINOR):
        return ""
    if major == NVIDIA_MAJOR or link.startswith("/dev/nvidia"):
        return ""  # CUDA checkpoint releases it (agent.cuda.jobs decides whether the job can move)
    return f"CRIU cannot dump character device {major}:{minor}"


def _socket(kind: tuple[int, int, int] | None) -> str:
    if kind is None:
        return ""  # cannot tell: CRIU will say, with the line quoted
    family, type_, proto = kind
    if family not in FAMILIES_OK:
        name = socket.AddressFamily(family).name if family in _FAMILY_NAMES else str(family)
        return f"CRIU cannot dump a socket of family {name} (only unix, inet, inet6, packet and netlink)"
    if (
        family in (socket.AF_INET, socket.AF_INET6)
        and type_ == socket.SOCK_RAW
        and proto not in ICMP_PROTOCOLS
    ):
        return f"CRIU cannot dump a raw inet socket of protocol {proto} (only ICMP)"
    return ""


_FAMILY_NAMES = {int(f) for f in socket.AddressFamily}


def refuse_node_sockets(pids: Iterable[int], node: str, fs: ProcFs | None = None) -> None:
    """A job on the node's own network (no job network address) cannot take inet sockets to
    another node: their addresses are this node's. Refused before anything is frozen."""
    fs = fs or ProcFs()
    mine = fs.net_ns(os.getpid())
    where = []
    for pid in pids:
        if not mine or fs.net_ns(pid) != mine:
            continue
        for fd, link, _mode, _rdev in fs.fds(pid):
            kind = fs.socket_kind(pid, fd) if _SOCKET.match(link) else None
            if kind and kind[0] in (socket.AF_INET, socket.AF_INET6) and kind[1] != socket.SOCK_RAW:
                where.append(f"pid {pid} fd {fd}")
    if where:
        raise RefusedError(
            f"the job holds inet sockets ({_listed(where, 4)}) on this node's own network, whose addresses "
            "another node does not have",
            step="prepare",
            node=node,
            hint="give the agents a job network ([network] in their config) and start the job with "
            "`ferry run`, so its address moves with it; nothing was frozen",
        )
