"""The staging root: where incoming images land, so it must be this agent's alone."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from agent.errors import RefusedError, TransferError


def private_dir(path: Path, node: str) -> Path:
    """The staging root: created 0700 if missing, else it must be a real directory of ours that
    no one else can write, and so must every directory above it unless sticky (like /dev/shm):
    otherwise another user could swap in files or links where images land."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    me = os.geteuid()
    problem = ""
    if not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory (a symlink?)"
    elif st.st_uid != me:
        problem = f"belongs to uid {st.st_uid}, not to this agent (uid {me})"
    elif st.st_mode & 0o022:
        problem = f"is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    for parent in path.absolute().parents:
        if problem:
            break
        pst = os.stat(parent)
        if pst.st_uid not in (0, me):
            problem = f"lies in {parent}, which belongs to uid {pst.st_uid}"
        elif pst.st_mode & 0o022 and not pst.st_mode & stat.S_ISVTX:
            problem = f"lies in {parent}, which others can write (mode {stat.S_IMODE(pst.st_mode):o})"
    if problem:
        raise RefusedError(
            f"staging directory {path} {problem}",
            step="staging",
            node=node,
            hint="remove it, or point --staging-dir at a directory only root can write",
        )
    return path


#: Less than this left where an image lands: the writer is failing for lack of space.
FULL_BYTES = 1 << 20


def free_bytes(path: Path) -> int:
    """What root may still write on path's filesystem (root may use the reserved blocks)."""
    st = os.statvfs(path)
    return st.f_bfree * st.f_frsize


def no_space(path: Path, node: str, step: str = "transfer intake") -> TransferError:
    """A staging area that filled up, named as such: its writer only sees a failed write, and the
    source a connection reset. `path` may be gone already (the migration was dropped): its
    filesystem is then read at the nearest directory above it."""
    where = path
    while not where.exists() and where != where.parent:
        where = where.parent
    st = os.statvfs(where)
    total = st.f_blocks * st.f_frsize
    return TransferError(
        f"no space left in the staging area {path} ({total >> 20} MiB, all in use)",
        step=step,
        node=node,
        hint="free space there, or start the agent with a --staging-dir on a larger filesystem",
    )


def is_full(path: Path) -> bool:
    try:
        return free_bytes(path) < FULL_BYTES
    except OSError:  # staging already removed: an abort, not a full disk
        return False
