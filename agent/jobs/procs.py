"""Process-tree helpers: find, freeze-aware signalling and liveness of a job's tree."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


_CLK_TCK = os.sysconf("SC_CLK_TCK")
#: A start time above this is a wall-clock one (seconds since 1970), recorded by an older agent.
_WALL_CLOCK_S = 1e8


def create_time(pid: int) -> float:
    """When pid started, in seconds since boot (0.0 if it does not exist).

    The kernel's own count (/proc/PID/stat, field 22), not psutil's wall-clock create time:
    that one is boot time plus this count, and the boot time it derives moves whenever the
    wall clock is stepped (NTP, a VM resumed), so a record written before a step would no
    longer match its own process after it.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return 0.0
    # comm, field 2, is in parentheses and may hold spaces; state, field 3, follows it.
    return int(stat[stat.rindex(b")") + 2 :].split()[19]) / _CLK_TCK


def parent(pid: int) -> int:
    """pid's parent (0 if pid does not exist)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return 0
    return int(stat[stat.rindex(b")") + 2 :].split()[1])  # ppid, field 4


def alive(pid: int, started: float = 0.0) -> bool:
    """Whether pid runs and (when `started` is known) is the same process, not a reused PID."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        if not started:
            return True
        now = proc.create_time() if started > _WALL_CLOCK_S else create_time(pid)
        return abs(now - started) < 0.05
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
    return _tree_memory(root, lambda m: m.rss)


def tree_private(root: int) -> int:
    """The tree's resident memory of its own (anonymous: neither file pages nor shared memory),
    about what a whole dump of it writes."""
    return _tree_memory(root, lambda m: max(0, m.rss - m.shared))


def _tree_memory(root: int, of: Callable[[Any], int]) -> int:
    """`of` each process's psutil memory_info, summed over the tree (one gone meanwhile counts 0)."""
    total = 0
    for pid in tree_pids(root):
        with contextlib.suppress(psutil.Error):
            total += of(psutil.Process(pid).memory_info())
    return total


def open_paths(root: int) -> set[str]:
    """Regular files the tree holds open, plus each process's cwd and executable: what must exist
    on a target. Files on the job's own /tmp, /dev/shm and /run (ferry-init's fresh tmpfs) travel
    inside the image, so they are left out."""
    paths: set[str] = set()
    for pid in tree_pids(root):
        own = _fresh_devices(pid)
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            paths.update(f.path for f in p.open_files() if _dev(f"/proc/{pid}/fd/{f.fd}") not in own)
            if _dev(f"/proc/{pid}/cwd") not in own:
                paths.add(p.cwd())
            if _dev(f"/proc/{pid}/exe") not in own:
                paths.add(p.exe())
    return {p for p in paths if p.startswith("/") and not p.endswith(" (deleted)")}


#: What ferry-init gives every job fresh (tmpfs in its mount namespace; the node's are hidden).
FRESH = ("/tmp", "/dev/shm", "/run")


def _fresh_devices(pid: int) -> set[int]:
    """Devices of the tmpfs the process sees at /tmp, /dev/shm and /run, if they are its own
    (a process in the agent's mount namespace has none)."""
    try:
        if os.readlink(f"/proc/{pid}/ns/mnt") == os.readlink("/proc/self/ns/mnt"):
            return set()
    except OSError:
        return set()
    return {d for d in (_dev(f"/proc/{pid}/root{p}") for p in FRESH) if d is not None}


def _dev(path: str) -> int | None:
    try:
        return os.stat(path).st_dev
    except OSError:
        return None


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


def holders(paths: list[Path | str]) -> list[int]:
    """Processes that hold any of these files open, by the file itself (device and inode), not
    its name: a job in its own mount namespace sees its logs under another path."""
    want = set()
    for path in paths:
        with contextlib.suppress(OSError):
            st = os.stat(path)
            want.add((st.st_dev, st.st_ino))
    if not want:
        return []
    found = []
    for pid in psutil.pids():
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    st = os.stat(f"/proc/{pid}/fd/{fd}")
                    if (st.st_dev, st.st_ino) in want:
                        found.append(pid)
                        break
    return found
