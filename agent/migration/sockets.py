"""The data connection's sockets, seen from an agent: addresses, a free port, and the cut.

The agents never carry the job's memory (agent/migration/pagestream.py), but they must say where
a CRIU listens, pick a port for one that cannot say, and end a CRIU's connection when its
control call breaks: a shutdown of CRIU's own socket, duplicated through pidfd_getfd, makes
its next read or write fail at once.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterable
from pathlib import Path

from agent.jobs.pidfd import dup_fd


def route_address(host: str) -> str:
    """This node's own address toward host: where a CRIU there can reach one here."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # a UDP "connect" only picks the route; nothing is sent
        return s.getsockname()[0]


def free_port(host: str) -> int:
    """A port free on host now, for a CRIU that cannot say which one it took."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def socket_fds(pid: int) -> dict[str, int]:
    """The process's socket fds, by their socket's inode (none if it is gone)."""
    out = {}
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    out[link[8:-1]] = int(fd)
    return out


def cut_connection(pid: int, port: int, spare: Iterable[int] = ()) -> int:
    """Shut down the TCP sockets process pid holds with `port` at either end, except any that the
    processes in `spare` hold too (a dumping CRIU holds the job's own sockets); returns how many.
    CRIU's next read or write on its data connection then fails at once."""
    ours = set()
    for name in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]:
                f = line.split()
                ends = (int(f[1].rsplit(":", 1)[1], 16), int(f[2].rsplit(":", 1)[1], 16))
                if port in ends:
                    ours.add(f[9])
    for other in spare:
        ours -= socket_fds(other).keys()
    cut = 0
    for inode, fd in socket_fds(pid).items():
        if inode not in ours or (dup := dup_fd(pid, fd)) is None:
            continue
        with socket.socket(fileno=dup) as s, contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
            cut += 1
    return cut
