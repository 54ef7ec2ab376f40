"""A CPU quota on chosen processes: a slowed node, as throttling or a noisy neighbour slows it,
made with the kernel's CFS bandwidth control (cgroup v1's cpu controller, or v2's cpu.max)."""

from __future__ import annotations

import contextlib
from pathlib import Path

from agent.jobs import procs

V1 = Path("/sys/fs/cgroup/cpu")
V2 = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


class Unsupported(RuntimeError):
    """This kernel or mount offers no CFS bandwidth control."""


class CpuQuota:
    """One cgroup whose processes get `share` of one CPU (set/lift), removed on close."""

    def __init__(self, name: str) -> None:
        if (V1 / "cpu.cfs_quota_us").exists():
            self.v2, self.dir, self.top = False, V1 / name, V1
        elif "cpu" in _read(V2 / "cgroup.controllers").split():
            self.v2, self.dir, self.top = True, V2 / name, V2
            (V2 / "cgroup.subtree_control").write_text("+cpu")
        else:
            raise Unsupported("no CPU bandwidth control here (neither cgroup v1's cpu nor v2's cpu.max)")
        self.dir.mkdir(exist_ok=True)
        self.lift()

    def add(self, root: int) -> None:
        """The process tree under `root` (a ferry job's root is its init; the work is below it)."""
        for pid in procs.tree_pids(root):
            with contextlib.suppress(ProcessLookupError):  # one that ended meanwhile
                (self.dir / "cgroup.procs").write_text(str(pid))  # every thread of the process

    def set(self, share: float) -> None:
        quota = max(1000, int(share * PERIOD_US))
        if self.v2:
            (self.dir / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            (self.dir / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.dir / "cpu.cfs_quota_us").write_text(str(quota))

    def lift(self) -> None:
        if self.v2:
            (self.dir / "cpu.max").write_text(f"max {PERIOD_US}")
        else:
            (self.dir / "cpu.cfs_quota_us").write_text("-1")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            for pid in (self.dir / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    (self.top / "cgroup.procs").write_text(pid)
            self.dir.rmdir()
