"""A job's CUDA side: which of its processes hold GPUs, what the driver cannot checkpoint, and
the whole-job sequence (freeze before the CRIU dump, thaw after the CRIU restore).

Candidates are the processes with NVIDIA device files open or mapped
(`/proc/<pid>/fd`, `/proc/<pid>/maps`) or listed by NVML on a GPU; the
driver's checkpoint state then decides. A forked DataLoader worker inherits
its parent's device files but has no CUDA context: the driver says so and
the worker is treated as a plain process. A process NVML lists on a GPU
while the driver denies it a context is refused, never skipped.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from agent.cuda import driver as cuda
from agent.cuda import pidprobe
from agent.cuda.calls import BoundedCalls, Bounds, InFlight
from agent.cuda.driver import CudaDriver, ProcessState
from agent.errors import FerryError, RefusedError
from agent.gpus.inventory import GpuNeed, Inventory, Nvml, choose
from agent.gpus.ledger import GpuLedger
from agent.image import CudaProcessEntry, CudaSection

_DEVICE = re.compile(r"^/dev/nvidia(\d+|ctl)$")
#: CUDA IPC between processes can be checkpointed from this driver branch on.
IPC_BRANCH = 610
#: Restoring onto a GPU other than the one checkpointed needs this branch.
REMAP_BRANCH = 580
#: Under the agent's state directory: the driver calls in flight (agent.cuda.calls.InFlight).
IN_FLIGHT_DIR = "cuda-calls"


class ProcView:
    """What /proc says about a process (tests substitute their own view)."""

    def __init__(self, root: str = "/proc") -> None:
        self.root = Path(root)

    def device_files(self, pid: int) -> list[str]:
        out = []
        with contextlib.suppress(OSError):
            for fd in (self.root / str(pid) / "fd").iterdir():
                with contextlib.suppress(OSError):
                    out.append(os.readlink(fd))
        return out

    def maps(self, pid: int) -> list[str]:
        try:
            return (self.root / str(pid) / "maps").read_text(errors="replace").splitlines()
        except OSError:
            return []

    def thread_names(self, pid: int) -> list[str]:
        names = []
        with contextlib.suppress(OSError):
            for task in (self.root / str(pid) / "task").iterdir():
                with contextlib.suppress(OSError):
                    names.append((task / "comm").read_text().strip())
        return names

    def ns_pid(self, pid: int) -> int:
        """The PID as the job itself sees it (innermost namespace)."""
        try:
            for line in (self.root / str(pid) / "status").read_text().splitlines():
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
        except (OSError, ValueError):
            pass
        return pid


@dataclass(frozen=True)
class CudaConfig:
    """`[cuda]` in the agent's config file."""

    #: How long a CUDA lock may wait for the job's kernels before the move is refused (retry).
    lock_timeout_s: float = cuda.DEFAULT_LOCK_TIMEOUT_S
    #: Give the driver the GPU pairs on every restore, identity pairs included, not only when
    #: the job lands on other GPUs (a one-GPU node never remaps; this exercises the pair path).
    explicit_gpu_pairs: bool = False
    #: How long a checkpoint or restore call may take (it copies a process's device memory)
    #: before the move gives up on it and the process counts as stuck (agent.cuda.calls).
    copy_timeout_s: float = Bounds.copy_s
    #: The same for every other driver call (a lock: on top of lock_timeout_s).
    call_timeout_s: float = Bounds.call_s


@dataclass(frozen=True)
class CudaProcess:
    pid: int  # host PID on this node
    ns_pid: int
    gpus: tuple[str, ...]
    memory_bytes: int


@dataclass(frozen=True)
class Footprint:
    """The CUDA processes of one job on this node (empty for a CPU-only job)."""

    processes: tuple[CudaProcess, ...] = ()
    gpus: tuple[GpuNeed, ...] = ()
    driver_version: str = ""

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    @property
    def gpu_bytes(self) -> int:
        return sum(g.memory_bytes for g in self.gpus)

    def section(self) -> CudaSection | None:
        if not self.processes:
            return None
        procs = [CudaProcessEntry(p.ns_pid, list(p.gpus), p.memory_bytes) for p in self.processes]
        return CudaSection(self.driver_version, procs, list(self.gpus))


@dataclass
class CudaJobs:
    """The CUDA half of moving a job on one node: inspect, freeze, thaw, choose GPUs.

    One per agent. The GPU memory of its frozen jobs is held in the node's GPU ledger
    (agent.gpus.ledger; the agent builds both and gives it): NVML shows it free once checkpointed,
    but the job needs it back if its move aborts, so no incoming job or local restore may take it.
    """

    driver: CudaDriver
    nvml: Nvml
    node: str = ""
    view: ProcView = field(default_factory=ProcView)
    lock_timeout_s: float = cuda.DEFAULT_LOCK_TIMEOUT_S
    #: How `nvml_pids` probes (tests give one that needs no GPU).
    pid_probe: Callable[[Nvml], pidprobe.PidProbe] = pidprobe.probe
    _pid_probe: pidprobe.PidProbe | None = field(default=None, repr=False)
    ledger: GpuLedger = field(kw_only=True)  # required: the node's one ledger, never one of its own
    _probe_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def inspect(self, pids: Iterable[int]) -> Footprint:
        """The job's CUDA processes and GPUs; refuses, before anything is frozen, what cannot move."""
        pids = list(pids)
        with_devices = [p for p in pids if self._uses_devices(p)]
        inv = self.nvml.inventory() if with_devices else Inventory(False)
        usage = inv.usage_by_pid()
        candidates = sorted(set(with_devices) | (set(pids) & set(usage)))
        if not candidates:
            return Footprint()
        self.driver.require_checkpoint()
        if not inv.available:
            raise self._refuse(f"the job uses the GPU but NVML cannot list this node's GPUs: {inv.detail}")
        found: list[CudaProcess] = []
        for pid in candidates:
            reading = self.driver.read_state(pid)
            state = reading.state
            if state is None and pid in usage:
                raise self._refuse(
                    f"NVML lists pid {pid} on GPU {usage[pid][0][0].uuid} but the driver reports no "
                    f"CUDA context for it (get-state: {reading.detail})",
                    "check that the agent and the job see the same NVIDIA driver",
                )
            if state is None:
                continue  # device files inherited across fork, no CUDA context of its own
            if state is not ProcessState.RUNNING:
                raise self._refuse(
                    f"pid {pid} is already in CUDA state {state.value} (another checkpoint in progress?)",
                    "wait for it to finish, then retry",
                )
            held = usage.get(pid, [])
            if not held:
                raise self._unlisted(pid, state)
            found.append(
                CudaProcess(
                    pid, self.view.ns_pid(pid), tuple(g.uuid for g, _ in held), sum(b for _, b in held)
                )
            )
        if not found:
            return Footprint()
        self._refuse_unsupported(found, inv)
        needs: dict[str, GpuNeed] = {}
        for p in found:
            for g, used in usage[p.pid]:
                prev = needs.get(g.uuid)
                needs[g.uuid] = GpuNeed(g.uuid, g.name, used + (prev.memory_bytes if prev else 0))
        return Footprint(tuple(found), tuple(needs.values()), inv.driver_version)

    def _refuse_unsupported(self, found: list[CudaProcess], inv: Inventory) -> None:
        """Everything the driver cannot checkpoint, named at once (locking them would hang or corrupt)."""
        why: list[str] = []
        for uuid in sorted({u for p in found for u in p.gpus}):
            g = inv.by_uuid(uuid)
            if g is not None and g.mig:
                why.append(f"GPU {uuid} runs in MIG mode")
        mps = {q.pid for g in inv.gpus for q in g.mps_processes}
        for p in found:
            maps = self.view.maps(p.pid)
            if p.pid in mps or any("nvidia-mps" in f for f in self.view.device_files(p.pid)):
                why.append(f"pid {p.pid} is an MPS client")
            nccl = any(n.startswith("NCCL") for n in self.view.thread_names(p.pid))
            if nccl or any("/dev/shm/nccl-" in ln for ln in maps):
                transports = ", ".join(nccl_transports(maps, self.view.device_files(p.pid)))
                why.append(
                    f"pid {p.pid} has NCCL communicators ({transports}): one rank cannot be locked while its "
                    "peers run (docs/distributed.md)"
                )
        if len(found) > 1 and inv.driver_branch < IPC_BRANCH:
            why.append(
                f"{len(found)} processes hold CUDA contexts (pids {', '.join(str(p.pid) for p in found)}) "
                f"and driver {inv.driver_version or 'here'} cannot checkpoint CUDA IPC between processes "
                f"(needs r{IPC_BRANCH})"
            )
        if why:
            raise self._refuse(
                "the CUDA checkpoint driver cannot capture this job: " + "; ".join(why),
                "nothing was frozen; the job keeps running here",
            )

    def check_restorable(self, inv: Inventory, driver_version: str, cuda_state: bool) -> None:
        """Refuses unless this node's driver can restore a job checkpointed under `driver_version`.
        cuda_state=False: the job holds GPUs (`ferry run --gpu`) but no CUDA context to restore,
        so any driver will do."""
        if not cuda_state:
            return
        self.driver.require_checkpoint()
        if driver_version and inv.available and inv.driver_version != driver_version:
            # The restored process keeps the source's user-mode driver mapped: it must match ours.
            raise self._refuse(
                f"the job was checkpointed under NVIDIA driver {driver_version}, this node runs "
                f"{inv.driver_version}",
                "move it to a node with the same driver version",
            )

    def pick_gpus(
        self,
        needs: list[GpuNeed],
        inv: Inventory,
        *,
        reserved: Mapping[str, str] | Iterable[str] = (),
        releasing: Mapping[str, int] | None = None,
        frozen: Mapping[str, int] | None = None,
        cuda_state: bool = True,
    ) -> dict[str, str]:
        """The choice alone, from an inventory read before (no NVML, no driver call: it runs under
        the GPU ledger's lock). `releasing`: memory the job itself frees here (two agents, one
        host); `frozen`: memory frozen jobs keep, which counts as used."""
        if not needs:
            return {}
        if not cuda_state:
            return choose(needs, inv, reserved=reserved, node=self.node)
        free = dict(releasing or {})
        for uuid, n in (frozen or {}).items():
            free[uuid] = free.get(uuid, 0) - n
        gpu_map = choose(needs, inv, reserved=reserved, releasing=free, node=self.node)
        moved = {o: n for o, n in gpu_map.items() if o != n}
        if moved and inv.driver_branch < REMAP_BRANCH:
            raise self._refuse(
                f"restoring onto other GPUs needs driver r{REMAP_BRANCH}, this node has {inv.driver_version}",
                "upgrade the NVIDIA driver",
            )
        return gpu_map

    def freeze(
        self,
        fp: Footprint,
        times: dict[str, float],
        lock_timeout_s: float | None = None,
        on_step: Callable[[str], None] = lambda step: None,
    ) -> None:
        """Lock and checkpoint the job; its GPU memory stays promised to it until release()."""
        if not fp.processes:
            return
        cuda.freeze(self.driver, fp.pids, lock_timeout_s or self.lock_timeout_s, times, on_step)
        self.ledger.hold_frozen(fp.pids, {g.uuid: g.memory_bytes for g in fp.gpus})

    def release(self, fp: Footprint) -> None:
        """The frozen job's GPUs are its own again (resumed) or nobody's (moved or ended)."""
        self.ledger.release_frozen(fp.pids)

    def thaw(
        self, plan: list[tuple[int, Mapping[str, str] | None]], times: dict[str, float], unlock: bool = True
    ) -> None:
        if plan:
            cuda.thaw(self.driver, plan, times, unlock)

    def unlock(self, pids: list[int], times: dict[str, float]) -> None:
        if pids:
            cuda.unlock_all(self.driver, pids, times)

    def nvml_pids(self) -> pidprobe.PidProbe:
        """Whether NVML reports PIDs as this agent sees them (probed once, then remembered)."""
        with self._probe_lock:
            if self._pid_probe is not None:
                return self._pid_probe
        result = self.pid_probe(self.nvml)
        with self._probe_lock:
            if result.verdict is not pidprobe.PidVerdict.UNKNOWN:
                self._pid_probe = result
        return result

    def _unlisted(self, pid: int, state: ProcessState) -> RefusedError:
        why = f"pid {pid} has a CUDA context (driver state {state.value}) but NVML lists it on no GPU"
        probe = self.nvml_pids()
        if probe.mismatch:
            return self._refuse(f"{why}: {probe.detail}", pidprobe.MISMATCH_HINT)
        return self._refuse(f"{why} (PID probe: {probe.verdict.value}, {probe.detail})")

    def _uses_devices(self, pid: int) -> bool:
        if any(_DEVICE.match(f) for f in self.view.device_files(pid)):
            return True
        return any("/dev/nvidia" in ln for ln in self.view.maps(pid))

    def _refuse(self, cause: str, hint: str = "") -> RefusedError:
        return RefusedError(cause, step="cuda check", node=self.node, hint=hint)


def host_cuda_jobs(node: str, config: CudaConfig, ledger: GpuLedger, state_dir: Path) -> CudaJobs:
    """This host's CUDA side (the real driver and NVML) around the node's ledger: what the agent
    builds, once (agent.service.node). Driver calls in flight are journaled in the state directory."""
    bounds = Bounds(copy_s=config.copy_timeout_s, call_s=config.call_timeout_s)
    calls = BoundedCalls(bounds, InFlight(state_dir / IN_FLIGHT_DIR, node), node)
    driver = CudaDriver(node=node, explicit_gpu_pairs=config.explicit_gpu_pairs, calls=calls)
    return CudaJobs(driver, Nvml(node=node), node, ProcView(), config.lock_timeout_s, ledger=ledger)


def restore_plan(
    view: ProcView, tree: Iterable[int], section: CudaSection, gpu_map: Mapping[str, str], node: str = ""
) -> list[tuple[int, Mapping[str, str] | None]]:
    """Each CUDA process of a restored tree (host PID) with the map of the GPUs it held itself."""
    pids = host_pids(view, tree, section, node)
    return [
        (pid, {old: gpu_map.get(old, old) for old in e.gpus} or None)
        for pid, e in zip(pids, section.processes, strict=True)
    ]


def host_pids(view: ProcView, tree: Iterable[int], section: CudaSection, node: str = "") -> list[int]:
    """The host PIDs, in a restored tree, of the processes the image lists as CUDA processes."""
    by_ns = {view.ns_pid(p): p for p in tree}
    missing = [e.ns_pid for e in section.processes if e.ns_pid not in by_ns]
    if missing:
        raise FerryError(
            f"restored tree lacks the CUDA processes with job PIDs {missing}", step="cuda", node=node
        )
    return [by_ns[e.ns_pid] for e in section.processes]


def nccl_transports(maps: list[str], device_files: list[str]) -> list[str]:
    """The NCCL transports a process shows from outside: its /dev/shm segments (SHM), its
    InfiniBand verbs devices (NET/IB); otherwise it talks over sockets or CUDA IPC (P2P), which
    /proc does not tell apart."""
    found = []
    if any("/dev/shm/nccl-" in ln for ln in maps):
        found.append("transport SHM: /dev/shm/nccl-* segments")
    if any(f.startswith("/dev/infiniband/") for f in device_files):
        found.append("transport NET/IB: InfiniBand verbs devices open")
    return found or ["transport NET/Socket or P2P: NCCL threads, no SHM segment or verbs device"]
