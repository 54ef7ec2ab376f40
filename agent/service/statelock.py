"""One agent per state directory: `<state-dir>/agent.lock`, flocked for the agent's life.

Two agents on one state directory would both adopt its jobs, settle its migrations and write
its records, each telling a different end for the same job. The lock is an flock (released by
the kernel when the agent dies, however it dies), on a descriptor that no child inherits
(O_CLOEXEC: a job outliving the agent must not keep a restarted one out). The file holds the
holder's PID, so the refusal can name it.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from agent.errors import RefusedError

LOCK_FILE = "agent.lock"


def lock_state_dir(state_dir: Path, node: str = "") -> int:
    """Take the state directory for this agent; returns the lock's descriptor (keep it open)."""
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = state_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RefusedError(
            f"another agent (pid {holder}) is running on the state directory {state_dir}",
            step="start",
            node=node,
            hint="stop that agent first, or give this one a --state-dir of its own",
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
