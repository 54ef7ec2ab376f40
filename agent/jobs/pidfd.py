"""Another process's fd, duplicated into ours (pidfd_getfd, Linux 5.6): how the agent reads a
socket's family and takes a frozen job's TCP sockets out of repair mode without touching it."""

from __future__ import annotations

import ctypes
import functools
import os

_SYS_PIDFD_GETFD = 438  # x86_64 and aarch64 alike (the common syscall table)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def dup_fd(pid: int, fd: int) -> int | None:
    """A new fd of ours for the process's `fd` (the caller closes it), or None when it cannot be
    had: the process or fd is gone, or the kernel has no pidfd_getfd."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return None
    try:
        return getfd(pidfd, fd)
    except OSError:
        return None
    finally:
        os.close(pidfd)


def getfd(pidfd: int, fd: int) -> int:
    """As dup_fd, through a pidfd the caller holds (one per process, however many fds); an
    OSError with the kernel's errno says why not (EBADF: the fd is closed)."""
    dup = _libc().syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
    if dup < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"pidfd_getfd of fd {fd}: {os.strerror(err)}")
    return dup
