"""This node's GPUs through NVML (`pynvml`), and the choice of GPUs for an incoming job.

Every agent keeps no NVML state: each call initialises NVML, reads, and shuts
it down, so a driver upgrade or a GPU that falls off the bus shows up at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.errors import NoFreeGpuError, RefusedError


@dataclass(frozen=True)
class GpuProcess:
    pid: int  # host PID
    used_bytes: int  # 0 when NVML cannot tell


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    name: str  # the chip, e.g. "NVIDIA H200": restore needs the same on both sides
    memory_total: int
    memory_used: int
    memory_free: int
    persistence: bool
    mig: bool  # MIG mode enabled: CUDA checkpoint does not support it
    processes: tuple[GpuProcess, ...] = ()
    mps_processes: tuple[GpuProcess, ...] = ()


@dataclass(frozen=True)
class Inventory:
    available: bool
    detail: str = ""  # why NVML is unavailable, or the driver it found
    driver_version: str = ""  # e.g. "580.65.06"
    gpus: tuple[Gpu, ...] = ()

    @property
    def driver_branch(self) -> int:
        """580 for "580.65.06"; 0 when unknown."""
        head = self.driver_version.split(".", 1)[0]
        return int(head) if head.isdigit() else 0

    def by_uuid(self, uuid: str) -> Gpu | None:
        return next((g for g in self.gpus if g.uuid == uuid), None)

    def usage_by_pid(self) -> dict[int, list[tuple[Gpu, int]]]:
        """host PID → the GPUs it holds a context on, with its memory there."""
        out: dict[int, list[tuple[Gpu, int]]] = {}
        for g in self.gpus:
            for p in (*g.processes, *g.mps_processes):
                out.setdefault(p.pid, []).append((g, p.used_bytes))
        return out


@dataclass(frozen=True)
class GpuNeed:
    """One GPU of a job, as the source saw it: what the target must match."""

    uuid: str
    name: str
    memory_bytes: int


def nvml_module() -> Any:
    """pynvml, looked up at each call: every reader in this process (the inventory, the health
    monitor) sees one NVML. No switch here: a test double replaces the `pynvml` module itself,
    from test code only (agent.testing.agent.use_nvml, which the installed package lacks)."""
    import pynvml

    return pynvml


@dataclass
class Nvml:
    """NVML reader; `module` defaults to pynvml (tests pass a fake)."""

    module: Any = None
    node: str = ""
    _loaded: bool = field(default=False, repr=False)

    def _nvml(self) -> Any:
        if self.module is None:
            self.module = nvml_module()
        return self.module

    def inventory(self) -> Inventory:
        """Every GPU with its memory and processes; available=False (with why) when NVML is absent."""
        try:
            nv = self._nvml()
        except ImportError as e:
            return Inventory(False, f"nvidia-ml-py is not installed ({e})")
        try:
            nv.nvmlInit()
        except Exception as e:
            return Inventory(False, f"NVML unavailable: {e}")
        try:
            driver = _text(nv.nvmlSystemGetDriverVersion())
            gpus = tuple(self._gpu(nv, i) for i in range(nv.nvmlDeviceGetCount()))
            return Inventory(True, f"driver {driver}, {len(gpus)} GPU(s)", driver, gpus)
        except Exception as e:
            return Inventory(False, f"NVML query failed: {e}")
        finally:
            with contextlib.suppress(Exception):
                nv.nvmlShutdown()

    @staticmethod
    def _gpu(nv: Any, index: int) -> Gpu:
        h = nv.nvmlDeviceGetHandleByIndex(index)
        mem = nv.nvmlDeviceGetMemoryInfo(h)
        mig = False
        with contextlib.suppress(Exception):  # NOT_SUPPORTED on GPUs without MIG
            mig = bool(nv.nvmlDeviceGetMigMode(h)[0])
        persistence = False
        with contextlib.suppress(Exception):
            persistence = bool(nv.nvmlDeviceGetPersistenceMode(h))
        mps: tuple[GpuProcess, ...] = ()
        with contextlib.suppress(Exception):
            mps = _procs(nv.nvmlDeviceGetMPSComputeRunningProcesses(h))
        return Gpu(
            index=index,
            uuid=_text(nv.nvmlDeviceGetUUID(h)),
            name=_text(nv.nvmlDeviceGetName(h)),
            memory_total=int(mem.total),
            memory_used=int(mem.used),
            memory_free=int(mem.free),
            persistence=persistence,
            mig=mig,
            processes=_procs(nv.nvmlDeviceGetComputeRunningProcesses(h)),
            mps_processes=mps,
        )


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _procs(items: Iterable[Any]) -> tuple[GpuProcess, ...]:
    return tuple(GpuProcess(int(p.pid), int(p.usedGpuMemory or 0)) for p in items)


def choose(
    needs: list[GpuNeed],
    inv: Inventory,
    *,
    reserved: Mapping[str, str] | Iterable[str] = (),
    releasing: Mapping[str, int] | None = None,
    node: str = "",
) -> dict[str, str]:
    """Map each GPU a job used (old UUID) to a distinct GPU here of the same chip with room for it.

    `reserved`: GPUs it may not have: promised to other incoming jobs, or (a mapping) each
    with why (quarantined, unhealthy, held by a job). `releasing`: memory that
    the job itself still holds here (a move between two agents on one host),
    counted as free because the checkpoint releases it. GPUs without other
    processes are preferred, then the one with the most free memory.
    """
    if not needs:
        return {}
    if not inv.available:
        raise RefusedError(
            f"the job uses {len(needs)} GPU(s) but this node has no usable GPU: {inv.detail}",
            step="prepare",
            node=node,
            hint="choose a node with NVIDIA GPUs and driver r580 or newer",
        )
    releasing = releasing or {}
    taken = (
        dict(reserved)
        if isinstance(reserved, Mapping)
        else dict.fromkeys(reserved, "is promised to another incoming job")
    )
    out: dict[str, str] = {}
    for need in sorted(needs, key=lambda n: -n.memory_bytes):
        same_chip = [g for g in inv.gpus if g.name == need.name and not g.mig]
        fits = [g for g in same_chip if g.uuid not in taken and _free(g, releasing) >= need.memory_bytes]
        if not fits:
            raise (NoFreeGpuError if same_chip else RefusedError)(
                _why_none(need, inv, same_chip, taken, releasing),
                step="prepare",
                node=node,
                hint="free a GPU here or choose another node",
            )
        best = min(fits, key=lambda g: (bool(g.processes) and g.uuid not in releasing, -_free(g, releasing)))
        out[need.uuid] = best.uuid
        taken[best.uuid] = "is promised to another GPU of the same job"
    return out


def _free(g: Gpu, releasing: Mapping[str, int]) -> int:
    return g.memory_free + releasing.get(g.uuid, 0)


def _why_none(
    need: GpuNeed,
    inv: Inventory,
    same_chip: list[Gpu],
    taken: Mapping[str, str],
    releasing: Mapping[str, int],
) -> str:
    want = f"a free {need.name} with {gib(need.memory_bytes)} for GPU {need.uuid}"
    if not same_chip:
        chips = sorted({g.name + (" (MIG)" if g.mig else "") for g in inv.gpus}) or ["none"]
        return f"no {need.name} here (restore needs the same chip); this node has {', '.join(chips)}"
    seen = "; ".join(
        f"{g.uuid} {taken[g.uuid]}" if g.uuid in taken else f"{g.uuid} has {gib(_free(g, releasing))} free"
        for g in same_chip
    )
    return f"needs {want}: {seen}"


def gib(n: int) -> str:
    """Bytes as GiB with one decimal, as refusals and progress lines show them."""
    return f"{n / (1 << 30):.1f} GiB"
