"""A stopped job's TCP connections, read from its own sockets: each socket fd its processes hold,
duplicated into the agent (pidfd_getfd) and asked for its TCP_INFO and its peer.

This is what the drain before a freeze's cut (agent.migration.peerwait.drain) looks at, over and
over while the job is frozen, so a look must cost what the job's own sockets cost, not what the
host's do. The namespace's tables (/proc/PID/net/tcp and tcp6) cost the host's: reading either
walks every bucket of the kernel's established-connection hash, which a namespace shares with the
host by default and which the kernel sizes by the host's memory (262,144 buckets on a 24 GiB VM,
up to 524,288, its cap without `thash_entries`: 3.2 ms a table here, 6.5 ms a look, idle). A
look here is a readlink per fd and a few calls per TCP socket. (A socket duplicated so takes the
agent's net_cls and net_prio ids under cgroup v1, as the kernel's receive_fd does for any fd
passed; the repair-mode exit of agent.criu.tcp_repair duplicates them the same way. Under cgroup
v2 nothing changes.)
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from dataclasses import dataclass

from agent.jobs.pidfd import getfd
from agent.migration.sockets import socket_fds

_TCP_ESTABLISHED = 1
#: struct tcp_info up to tcpi_unacked: eight one-byte fields, then rto, ato, snd_mss, rcv_mss,
#: unacked (u32 each). tcpi_unacked is the socket's packets_out: segments sent and not yet
#: acknowledged, which is when the kernel runs a retransmission (or loss probe) timer. A shut
#: window's probe is not counted there: nothing sent is lost if the cut comes then.
_TCP_INFO = struct.Struct("=B7xIIIII")
_FAMILIES = (socket.AF_INET, socket.AF_INET6)


@dataclass(frozen=True)
class Conn:
    """An established connection; in_flight: segments it sent are not yet acknowledged."""

    local: str
    peer: str
    in_flight: bool


def _address(addr: tuple) -> str:  # type: ignore[type-arg]
    """(host, port[, flow, scope]) → `10.0.0.1:80` or `[::1]:80`, as /proc/net/tcp's readers say."""
    host, port = addr[0], addr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _tcp(fd: int) -> socket.socket | None:
    """Our duplicate `fd` as a socket object if it is a TCP one (else closed here)."""
    # Its family, type and protocol are read from the socket. Python leaves its flags alone, which
    # the job's fd shares, as long as no default timeout is set (the agent sets none).
    try:
        s = socket.socket(fileno=fd)
    except OSError:  # one Python cannot take as a socket is no TCP one
        os.close(fd)
        return None
    if s.family in _FAMILIES and s.type == socket.SOCK_STREAM and s.proto == socket.IPPROTO_TCP:
        return s
    s.close()
    return None


def _conn(s: socket.socket) -> Conn | None:
    """The connection behind `s` as the kernel has it now, if it is established."""
    info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO.size)
    state, _rto, _ato, _snd_mss, _rcv_mss, unacked = _TCP_INFO.unpack(info)
    if state != _TCP_ESTABLISHED:
        return None
    try:
        peer = s.getpeername()
    except OSError:  # reset since: not established any more
        return None
    return Conn(_address(s.getsockname()), _address(peer), unacked > 0)


class Sockets:
    """The TCP sockets that the processes `pids` hold, each once (a socket shared by several fds
    or processes is one), duplicated when this is made: a stopped tree's fds do not change, so a
    drain that looks again and again asks the same sockets and lists no fd twice. Raises OSError
    if the first process cannot be read (it is gone); later ones that went are skipped (a tree's
    child). Close it (or use it as a context manager): it holds a duplicate of each."""

    def __init__(self, pids: list[int]) -> None:
        self._socks: list[socket.socket] = []
        seen: set[str] = set()
        try:
            for i, pid in enumerate(pids):
                try:
                    pidfd = os.pidfd_open(pid)
                except OSError:
                    if i == 0:
                        raise
                    continue
                try:
                    for inode, fd in socket_fds(pid).items():
                        if inode in seen:
                            continue
                        seen.add(inode)
                        try:
                            dup = getfd(pidfd, fd)
                        except OSError as e:
                            if e.errno == errno.EBADF:  # closed since the listing
                                continue
                            raise  # no socket of this job can be read so (EPERM, ENOSYS): say so
                        if (s := _tcp(dup)) is not None:
                            self._socks.append(s)
                finally:
                    os.close(pidfd)
        except BaseException:
            self.close()
            raise

    def connections(self) -> list[Conn]:
        """The established ones, as they are now."""
        return [c for s in self._socks if (c := _conn(s)) is not None]

    def in_flight(self) -> list[str]:
        """The peers of the established ones with sent bytes not yet acknowledged, now."""
        return [c.peer for c in self.connections() if c.in_flight]

    def close(self) -> None:
        for s in self._socks:
            s.close()
        self._socks = []

    def __enter__(self) -> Sockets:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connections(pids: list[int]) -> list[Conn]:
    """The established TCP connections (IPv4 and IPv6) that the processes `pids` hold now (see
    Sockets)."""
    with Sockets(pids) as socks:
        return socks.connections()


def in_flight(pids: list[int]) -> list[str]:
    """The peers of the connections `pids` hold with sent bytes not yet acknowledged."""
    with Sockets(pids) as socks:
        return socks.in_flight()
