"""Take a frozen job's TCP connections out of repair mode, so its source copy can go on.

A dump with `--leave-stopped` leaves every established TCP socket of the tree in repair mode
(CRIU unlocks connections only when the tree keeps running): the kernel then neither sends
nor ACKs on it, which is what keeps a moved connection whole, and the source copy is killed
without a FIN or RST. When a move aborts instead, the source copy must talk again: its
sockets leave repair mode (TCP_REPAIR off, as CRIU's own unlock does) before it continues.
The agent reaches each socket through a duplicate of the job's fd (agent.jobs.pidfd).
"""

from __future__ import annotations

import errno
import logging
import socket
import stat
from collections.abc import Iterable

from agent.criu.dumpable import ProcFs
from agent.jobs.pidfd import dup_fd

log = logging.getLogger(__name__)

TCP_REPAIR = 19  # linux/tcp.h
TCP_REPAIR_OFF = 0


def release(pids: Iterable[int]) -> int:
    """Every TCP socket of these processes out of repair mode; returns how many were. Sockets
    not in repair mode (listening, never dumped) are left as they are."""
    released = 0
    fs = ProcFs()
    for pid in pids:
        for fd, _link, mode, _rdev in fs.fds(pid):
            if not stat.S_ISSOCK(mode):
                continue
            dup = dup_fd(pid, fd)
            if dup is None:
                continue
            with socket.socket(fileno=dup) as sk:
                if sk.family not in (socket.AF_INET, socket.AF_INET6) or sk.type != socket.SOCK_STREAM:
                    continue
                try:
                    sk.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, TCP_REPAIR_OFF)
                    released += 1
                except OSError as e:
                    if e.errno != errno.EPERM:  # EPERM: a socket that is not in a repairable state
                        log.warning("pid %d fd %d: cannot leave TCP repair mode: %s", pid, fd, e)
    return released
