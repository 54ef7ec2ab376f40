"""Starting a job under ferry-init: finding its PID 1, ending a start that failed, and the
paths a job's fresh /tmp must keep or must not hide."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil

from agent.errors import InvalidArgumentError
from agent.jobs import procs


def wait_for_child(outer: subprocess.Popen[bytes], timeout_s: float = 5.0) -> int | None:
    """PID 1 of the new namespace is ferry-init's only child."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            kids = psutil.Process(outer.pid).children()
        except psutil.NoSuchProcess:
            return None
        if kids:
            return kids[0].pid
        if outer.poll() is not None:
            return None
        time.sleep(0.005)
    return None


def end_unstarted(outer: subprocess.Popen[bytes]) -> None:
    """A job that never ran: its init and everything under it."""
    for pid in reversed(procs.tree_pids(outer.pid)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        outer.wait(10)


def tmp_keeps(paths: list[str]) -> list[str]:
    """The top directories under /tmp that these paths need (symlink and target alike): ferry-init
    binds them into the job's fresh /tmp, so code, cwd and logs there stay visible."""
    keep: set[str] = set()
    for p in paths:
        if not p or not p.startswith("/"):
            continue
        for path in {os.path.abspath(p), os.path.realpath(p)}:
            parts = Path(path).parts
            if len(parts) > 2 and parts[1] == "tmp" and os.path.exists(path):
                keep.add(f"/tmp/{parts[2]}")
    return sorted(keep)


def refuse_hidden(path: str, what: str, node: str) -> None:
    real = os.path.realpath(path)
    for fresh in procs.FRESH[1:]:  # /tmp keeps what the job needs (tmp_keeps)
        if real == fresh or real.startswith(fresh + "/"):
            raise InvalidArgumentError(
                f"the job's {what} {path} lies under {fresh}, which every job gets fresh",
                node=node,
                hint="use a directory on the node's disk or on shared storage",
            )


def which(cmd: str, env: dict[str, str]) -> str:
    return cmd if "/" in cmd else (shutil.which(cmd, path=env.get("PATH")) or "")


def fd_path(pid: int, fd: int) -> str:
    try:
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return ""
    return target if target.startswith("/") and os.path.isfile(target) else ""


def tail(path: Path, limit: int = 300) -> str:
    try:
        text = path.read_text(errors="replace").strip()
    except OSError:
        return "no output"
    return text[-limit:].replace("\n", " | ") or "no output"
