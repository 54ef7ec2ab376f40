"""Writes that are on disk when they return: every byte of a buffer, and a whole file replaced
atomically and durably (the migration journal and the job records share this one sequence)."""

from __future__ import annotations

import os
from pathlib import Path


def write_all(fd: int, data: bytes | memoryview) -> None:
    """Write every byte of data: os.write may write fewer (a signal, a full pipe or disk quota)
    and says how many; a caller that hashes `data` must not hash bytes that were never written."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:  # a regular file never answers 0 to a non-empty write; never loop on it
            raise OSError(f"write returned {n} with {len(view)} bytes left")
        view = view[n:]


def replace_file(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Replace path with data so that a crash leaves either the old file or the new one, never
    a torn one, and the new one survives power loss once this returns: a temporary file beside
    it, fsynced, renamed over it, then the directory fsynced (which makes the rename durable)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
