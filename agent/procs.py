"""Process-tree helpers: find, freeze-aware signalling and liveness of a job's tree."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import psutil


def tree_pids(root: int) -> list[int]:
    """The root and all its descendants (host PIDs), root first."""
    try:
        proc = psutil.Process(root)
        return [root, *(c.pid for c in proc.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def resume(pids: list[int]) -> None:
    """Undo CRIU's --leave-stopped: every task of the tree continues."""
    signal_all(pids, signal.SIGCONT)


def create_time(pid: int) -> float:
    try:
        return psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return 0.0


def alive(pid: int, started: float = 0.0) -> bool:
    """Whether pid runs and (when `started` is known) is the same process, not a reused PID."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return not started or abs(proc.create_time() - started) < 0.05
    except psutil.NoSuchProcess:
        return False


def end_within(pid: int, started: float, timeout_s: float) -> None:
    """Let a process finish on its own for up to timeout_s, then SIGKILL it."""
    deadline = time.monotonic() + timeout_s
    while alive(pid, started) and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive(pid, started):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def tree_rss(root: int) -> int:
    total = 0
    for pid in tree_pids(root):
        with contextlib.suppress(psutil.Error):
            total += psutil.Process(pid).memory_info().rss
    return total


def open_paths(root: int) -> set[str]:
    """Regular files the tree holds open, plus each process's cwd and executable."""
    paths: set[str] = set()
    for pid in tree_pids(root):
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            paths.update(f.path for f in p.open_files())
            paths.add(p.cwd())
            paths.add(p.exe())
    return {p for p in paths if p.startswith("/") and not p.endswith(" (deleted)")}


def session_id(pid: int) -> int:
    try:
        return os.getsid(pid)
    except ProcessLookupError:
        return -1


def stop(pids: list[int], timeout_s: float = 10.0) -> None:
    """SIGSTOP every task and wait until each thread has stopped (a pending stop is not one)."""
    signal_all(pids, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while not _all_threads_stopped(pid) and time.monotonic() < deadline:
            time.sleep(0.005)


def _all_threads_stopped(pid: int) -> bool:
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True  # gone
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except (FileNotFoundError, IndexError):
            continue
        if state not in "TtXZ":
            return False
    return True
