"""A fake NVIDIA stack for the unit tests: the CUDA checkpoint driver, NVML and /proc, one host's worth.

No GPU exists here, so these stand in at the one boundary we cannot reach.
They are faithful where ferry depends on them:

- FakeDriver has the call signatures of `cuda.bindings.driver` and returns
  the real CUresult values. It keeps the driver's per-process state machine:
  RUNNING → lock → LOCKED → checkpoint → CHECKPOINTED → restore → LOCKED →
  unlock → RUNNING, with FAILED terminal and every other call ILLEGAL_STATE.
  A lock that times out answers CUDA_ERROR_NOT_READY (600), as the binding's
  docstring documents, and leaves the process RUNNING. Restore needs pairs
  that cover every checkpointed GPU, each onto an existing GPU of the same
  chip with room; an old driver has no checkpoint API (NOT_SUPPORTED). After
  a restore that failed past its argument checks (out of memory, or a failure
  a test injects) every later restore answers CUDA_ERROR_OPERATING_SYSTEM
  (304) and unlock ILLEGAL_STATE: the process stays CHECKPOINTED for good, as
  cuda-checkpoint issue #44 reports for driver 580. get-state for a process
  without a CUDA context answers `no_context` (INVALID_VALUE by default;
  NOT_SUPPORTED, which the docstring also lists, or "undecodable": raise the
  ValueError that older bindings raise for the undefined state, cuda-python
  #561). A process with managed memory fails its checkpoint with
  NOT_SUPPORTED and is left in `managed_leaves` (LOCKED by default; FAILED
  models a driver that "does not attempt to keep the process in a good
  state", NVIDIA's README). What the real driver does there is recorded by
  the GPU suite's --managed test in the device report. A call can be made
  to wait until a test lets it go (`hang`), as one into a wedged driver does.
- FakeNvml has the `pynvml` calls ferry uses. Its process lists follow the
  driver state: a checkpointed process holds no GPU memory.
- FakeProcView answers what /proc would: device files, maps, thread names,
  the PID inside the job's namespace.

A CudaWorld is one host: all three read it. FakeCriu carries a process's
CUDA state in the image (a checkpointed process's device memory is in its
host memory, which is what CRIU saves), so a restored process comes back
CHECKPOINTED, as on real hardware.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from cuda.bindings import driver as real

from agent.jobs.threadhold import threads

R = real.CUresult
GIB = 1 << 30
H200 = "NVIDIA H200"
GPU0 = "GPU-00000000-1111-2222-3333-000000000000"
GPU1 = "GPU-00000000-1111-2222-3333-000000000001"
A100 = "GPU-aaaaaaaa-1111-2222-3333-000000000000"
#: What FakeCriu.dump writes for the CUDA processes it dumps (travels like any image file).
IMAGE_FILE = "fake-cuda.json"

RUNNING, LOCKED, CHECKPOINTED, FAILED = 0, 1, 2, 3


@dataclass
class FakeGpu:
    uuid: str
    name: str = H200
    total: int = 141 * GIB
    mig: bool = False
    #: Memory held by processes outside the test (other jobs), pid → bytes.
    others: dict[int, int] = field(default_factory=dict)


@dataclass
class CudaProc:
    ns_pid: int
    gpus: list[str]  # where its contexts live (or lived, when checkpointed)
    bytes_per_gpu: int
    state: int = RUNNING


class CudaWorld:
    """One host's GPUs and the CUDA state of its processes."""

    def __init__(self, gpus: list[FakeGpu] | None = None, driver_version: str = "580.65.06") -> None:
        self.gpus = {g.uuid: g for g in (gpus if gpus is not None else [FakeGpu(GPU0)])}
        self.driver_version = driver_version
        self.procs: dict[int, CudaProc] = {}
        #: Per pid: extra /proc facts (device files, maps lines, thread names) for detection tests.
        self.device_files: dict[int, list[str]] = {}
        self.maps: dict[int, list[str]] = {}
        self.threads: dict[int, list[str]] = {}
        self.ns_pids: dict[int, int] = {}
        self.mps_clients: set[int] = set()
        #: Processes with CUDA managed (UVM) memory: their checkpoint is NOT_SUPPORTED. (Where the
        #: real driver refuses, lock or checkpoint, is what the GPU suite's --managed test shows.)
        self.managed: set[int] = set()

    def add_cuda_process(
        self, pid: int, gpus: list[str], bytes_per_gpu: int = 2 * GIB, ns_pid: int = 1
    ) -> None:
        self.procs[pid] = CudaProc(ns_pid, list(gpus), bytes_per_gpu)
        self.device_files[pid] = [
            "/dev/nvidiactl",
            "/dev/nvidia-uvm",
            *(f"/dev/nvidia{i}" for i in range(len(gpus))),
        ]
        self.ns_pids[pid] = ns_pid

    def state(self, pid: int) -> int:
        return self.procs[pid].state

    def used(self, uuid: str) -> int:
        held = sum(p.bytes_per_gpu for p in self.procs.values() if p.state != CHECKPOINTED and uuid in p.gpus)
        return held + sum(self.gpus[uuid].others.values())

    # -- what CRIU carries --------------------------------------------------------------

    def save_image(self, pids: list[int], image_dir: Path) -> None:
        entries = [
            {"ns_pid": p.ns_pid, "gpus": p.gpus, "bytes": p.bytes_per_gpu, "state": p.state}
            for pid in pids
            if (p := self.procs.get(pid)) is not None
        ]
        if entries:
            (image_dir / IMAGE_FILE).write_text(json.dumps(entries))

    def load_image(self, image_dir: Path, pid: int) -> None:
        """The restored process (one, in FakeCriu) takes over the dumped CUDA state."""
        path = image_dir / IMAGE_FILE
        if not path.exists():
            return
        for e in json.loads(path.read_text()):
            self.procs[pid] = CudaProc(e["ns_pid"], e["gpus"], e["bytes"], e["state"])
            self.ns_pids[pid] = e["ns_pid"]
            self.device_files[pid] = []  # a checkpointed process holds no device files


class FakeDriver:
    """`cuda.bindings.driver` as far as ferry uses it."""

    CUcheckpointLockArgs = real.CUcheckpointLockArgs
    CUcheckpointRestoreArgs = real.CUcheckpointRestoreArgs
    CUcheckpointGpuPair = real.CUcheckpointGpuPair
    CUuuid = real.CUuuid

    def __init__(
        self,
        world: CudaWorld,
        *,
        checkpoint_api: bool = True,
        custom_storage: bool = False,
        library: bool = True,
        cuda_version: int = 13000,
    ) -> None:
        self.world = world
        self.checkpoint_api = checkpoint_api
        self.custom_storage = custom_storage
        self.library = library
        self.cuda_version = cuda_version
        self.calls: list[tuple[str, int]] = []
        #: (action, pid) → CUresult to return instead of acting; action alone matches any pid.
        self.fail: dict[Any, R] = {}
        #: action → CUresult for the next such call only.
        self.fail_once: dict[str, R] = {}
        #: Actions after which a failing process is left FAILED (else unchanged).
        self.fail_terminal: set[str] = set()
        #: Processes stuck in a long kernel: lock times out.
        self.busy: set[int] = set()
        self.restore_args: list[dict[str, str] | None] = []
        #: What get-state answers for a pid without a CUDA context (see the module docstring).
        self.no_context: R | str = R.CUDA_ERROR_INVALID_VALUE
        #: Where a managed-memory process is left by its refused checkpoint.
        self.managed_leaves = LOCKED
        #: Processes whose restore failed once: the driver refuses them from then on (#44).
        self.broken: set[int] = set()
        #: action → an Event the call waits for before it acts (a wedged driver or GPU).
        self.hang: dict[str, threading.Event] = {}

    def cuInit(self, flags: int) -> tuple[R]:
        if not self.library:
            raise RuntimeError('"cuda" is an NVIDIA driver library and can only be found via system search')
        return (R.CUDA_SUCCESS,)

    def cuDriverGetVersion(self) -> tuple[R, int]:
        return R.CUDA_SUCCESS, self.cuda_version

    def cuGetProcAddress(self, symbol: bytes, version: int, flags: int) -> tuple[R, int, Any]:
        name = symbol.decode()
        has = (name.startswith("cuCheckpointProcess") and self.checkpoint_api) or (
            name == "cuCheckpointOperationComplete" and self.custom_storage
        )
        if has:
            return R.CUDA_SUCCESS, 0x1000, real.CUdriverProcAddressQueryResult.CU_GET_PROC_ADDRESS_SUCCESS
        return (
            R.CUDA_ERROR_NOT_FOUND,
            0,
            real.CUdriverProcAddressQueryResult.CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND,
        )

    def cuCheckpointOperationComplete(self, *args: Any) -> tuple[R]:
        return (R.CUDA_SUCCESS,)  # present in the bindings; whether the driver has it is cuGetProcAddress's

    # -- the checkpoint API ---------------------------------------------------------------

    def _enter(self, action: str, pid: int) -> tuple[CudaProc | None, R | None]:
        self.calls.append((action, pid))
        if (gate := self.hang.get(action)) is not None:
            gate.wait()
        # The driver's restore thread inside the job does the work: a stopped job would hang it.
        # Get-state and the restore thread's id are answered without it (CRIU's CUDA plugin asks
        # for the id while it holds the tree stopped; the device check verifies it on a GPU).
        assert action in ("get-state", "restore-thread") or not _stopped(pid), (
            f"cuda {action} on pid {pid} while it is SIGSTOPped"
        )
        if not self.checkpoint_api:
            return None, R.CUDA_ERROR_NOT_SUPPORTED
        proc = self.world.procs.get(pid)
        if proc is None:
            if self.no_context == "undecodable":
                raise ValueError("32718 is not a valid CUprocessState")  # as cuda-python #561 shows
            assert isinstance(self.no_context, R)
            return None, self.no_context  # not a CUDA process
        injected = self.fail_once.pop(action, None) or self.fail.get((action, pid), self.fail.get(action))
        if injected is not None:
            if action in self.fail_terminal:
                proc.state = FAILED
            return proc, injected
        return proc, None

    def cuCheckpointProcessGetState(self, pid: int) -> tuple[R, Any]:
        proc, err = self._enter("get-state", pid)
        if err is not None or proc is None:
            return err or R.CUDA_ERROR_INVALID_VALUE, real.CUprocessState.CU_PROCESS_STATE_RUNNING
        return R.CUDA_SUCCESS, real.CUprocessState(proc.state)

    def cuCheckpointProcessGetRestoreThreadId(self, pid: int) -> tuple[R, int]:
        _proc, err = self._enter("restore-thread", pid)
        return (err, 0) if err is not None else (R.CUDA_SUCCESS, restore_thread_of(pid))

    def cuCheckpointProcessLock(self, pid: int, args: Any) -> tuple[R]:
        proc, err = self._enter("lock", pid)
        if err is not None or proc is None:
            return (err,)
        if proc.state != RUNNING:
            return (R.CUDA_ERROR_ILLEGAL_STATE,)
        if pid in self.busy:
            assert args is not None and args.timeoutMs > 0, "ferry always bounds the lock"
            return (R.CUDA_ERROR_NOT_READY,)  # the documented timeout code; the process stays RUNNING
        proc.state = LOCKED
        return (R.CUDA_SUCCESS,)

    def cuCheckpointProcessCheckpoint(self, pid: int, args: Any) -> tuple[R]:
        proc, err = self._enter("checkpoint", pid)
        if err is not None or proc is None:
            return (err,)
        if proc.state != LOCKED:
            return (R.CUDA_ERROR_ILLEGAL_STATE,)
        if pid in self.world.managed:
            proc.state = self.managed_leaves
            return (R.CUDA_ERROR_NOT_SUPPORTED,)
        proc.state = CHECKPOINTED  # device memory now in host memory, GPUs released
        return (R.CUDA_SUCCESS,)

    def cuCheckpointProcessRestore(self, pid: int, args: Any) -> tuple[R]:
        if pid in self.broken:
            self.calls.append(("restore", pid))
            return (R.CUDA_ERROR_OPERATING_SYSTEM,)  # every restore after a failed one (#44)
        (err,) = self._restore(pid, args)
        # Arguments are checked first (bad pairs, wrong chip); a restore that got further and failed
        # (out of memory, or a failure a test injects) leaves the driver unable to try again.
        checked_first = (R.CUDA_SUCCESS, R.CUDA_ERROR_INVALID_VALUE, R.CUDA_ERROR_INVALID_DEVICE)
        if err not in checked_first and self.world.procs.get(pid, CudaProc(0, [], 0)).state == CHECKPOINTED:
            self.broken.add(pid)
        return (err,)

    def _restore(self, pid: int, args: Any) -> tuple[R]:
        proc, err = self._enter("restore", pid)
        if err is not None or proc is None:
            return (err,)
        if proc.state != CHECKPOINTED:
            return (R.CUDA_ERROR_ILLEGAL_STATE,)
        pairs = None
        if args is not None:
            pairs = {
                _uuid(args.gpuPairs[i].oldUuid.bytes): _uuid(args.gpuPairs[i].newUuid.bytes)
                for i in range(args.gpuPairsCount)
            }
        self.restore_args.append(pairs)
        mapping = pairs if pairs is not None else {u: u for u in proc.gpus}
        if set(proc.gpus) - set(mapping):
            return (R.CUDA_ERROR_INVALID_VALUE,)  # the map must cover every checkpointed GPU
        old_gpus = list(proc.gpus)
        for old in old_gpus:
            new = self.world.gpus.get(mapping[old])
            if new is None:
                return (R.CUDA_ERROR_INVALID_DEVICE,)
            if old in self.world.gpus and self.world.gpus[old].name != new.name:
                return (R.CUDA_ERROR_INVALID_DEVICE,)  # restore needs the same chip
            if new.total - self.world.used(new.uuid) < proc.bytes_per_gpu:
                return (R.CUDA_ERROR_OUT_OF_MEMORY,)
        proc.gpus = [mapping[g] for g in old_gpus]
        proc.state = LOCKED
        return (R.CUDA_SUCCESS,)

    def cuCheckpointProcessUnlock(self, pid: int, args: Any) -> tuple[R]:
        proc, err = self._enter("unlock", pid)
        if err is not None or proc is None:
            return (err,)
        if proc.state != LOCKED:
            return (R.CUDA_ERROR_ILLEGAL_STATE,)
        proc.state = RUNNING
        return (R.CUDA_SUCCESS,)

    def actions(self) -> list[str]:
        return [a for a, _ in self.calls if a != "get-state"]


def _stopped(pid: int) -> bool:
    """Whether the driver's restore thread in `pid` (restore_thread_of) cannot run: stopped, or
    held in a ptrace stop (agent.jobs.threadhold lets that one thread go)."""
    tid = restore_thread_of(pid)
    try:
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False  # a made-up PID of a pure driver test
    return state in ("T", "t")


def restore_thread_of(pid: int) -> int:
    """The driver's thread inside a process: here its last thread (a sleeper's only one)."""
    return max(threads(pid), default=pid)


def _uuid(raw: bytes) -> str:
    h = bytes(raw).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


class NVMLError(Exception):
    pass


class FakeNvml:
    """`pynvml` as far as ferry uses it, reading the world."""

    NVMLError = NVMLError

    def __init__(self, world: CudaWorld, *, library: bool = True, host_pid_offset: int = 0) -> None:
        self.world = world
        self.library = library
        self.inits = 0
        #: Non-zero: the caller is in a PID namespace of its own, and NVML answers with host PIDs
        #: (the driver's PIDs), here the caller's PID plus this offset.
        self.host_pid_offset = host_pid_offset

    def nvmlInit(self) -> None:
        if not self.library:
            raise NVMLError("NVML Shared Library Not Found")
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.inits -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.world.driver_version

    def nvmlDeviceGetCount(self) -> int:
        return len(self.world.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> FakeGpu:
        return list(self.world.gpus.values())[i]

    def nvmlDeviceGetUUID(self, h: FakeGpu) -> str:
        return h.uuid

    def nvmlDeviceGetName(self, h: FakeGpu) -> str:
        return h.name

    def nvmlDeviceGetMemoryInfo(self, h: FakeGpu) -> Any:
        used = self.world.used(h.uuid)
        return SimpleNamespace(total=h.total, used=used, free=h.total - used)

    def nvmlDeviceGetPersistenceMode(self, h: FakeGpu) -> int:
        return 1

    def nvmlDeviceGetMigMode(self, h: FakeGpu) -> list[int]:
        if not h.mig:
            raise NVMLError("Not Supported")
        return [1, 1]

    def nvmlDeviceGetComputeRunningProcesses(self, h: FakeGpu) -> list[Any]:
        out = [
            SimpleNamespace(pid=pid + self.host_pid_offset, usedGpuMemory=p.bytes_per_gpu)
            for pid, p in self.world.procs.items()
            if h.uuid in p.gpus and p.state != CHECKPOINTED and pid not in self.world.mps_clients
        ]
        return out + [SimpleNamespace(pid=pid, usedGpuMemory=b) for pid, b in h.others.items()]

    def nvmlDeviceGetMPSComputeRunningProcesses(self, h: FakeGpu) -> list[Any]:
        return [
            SimpleNamespace(pid=pid, usedGpuMemory=p.bytes_per_gpu)
            for pid, p in self.world.procs.items()
            if h.uuid in p.gpus and pid in self.world.mps_clients
        ]


class FakeProcView:
    """agent.cuda.jobs.ProcView answered from the world."""

    def __init__(self, world: CudaWorld) -> None:
        self.world = world

    def device_files(self, pid: int) -> list[str]:
        return list(self.world.device_files.get(pid, []))

    def maps(self, pid: int) -> list[str]:
        return list(self.world.maps.get(pid, []))

    def thread_names(self, pid: int) -> list[str]:
        return list(self.world.threads.get(pid, ["python"]))

    def ns_pid(self, pid: int) -> int:
        return self.world.ns_pids.get(pid, pid)


def fake_cuda_jobs(
    world: CudaWorld,
    node: str = "nodea",
    host_pid_offset: int = 0,
    ledger: Any = None,
    calls: Any = None,
    **driver_kw: Any,
) -> tuple[Any, FakeDriver]:
    """agent.cuda.jobs.CudaJobs over this world, and its fake driver (to inspect calls, inject faults).

    Its PID probe is `probe_in(world)`: a real process that the world gives a CUDA context. Its
    GPU ledger is `ledger` (an agent's); without one, a bare ledger of its own."""
    from agent.cuda.driver import CudaDriver
    from agent.cuda.jobs import CudaJobs
    from agent.gpus.inventory import Nvml
    from agent.gpus.ledger import GpuLedger

    drv = FakeDriver(world, **driver_kw)
    nvml = Nvml(FakeNvml(world, host_pid_offset=host_pid_offset), node)
    jobs = CudaJobs(
        CudaDriver(drv, node, calls=calls),
        nvml,
        node,
        FakeProcView(world),
        0.5,
        pid_probe=probe_in(world),
        ledger=GpuLedger() if ledger is None else ledger,
    )
    return jobs, drv


def probe_in(world: CudaWorld, *, makes_context: bool = True) -> Any:
    """agent.cuda.pidprobe.probe with a probe process that needs no GPU: a real child that prints
    "ready PID" like the real probe, and that the world lists as a CUDA process on its first GPU."""
    import subprocess
    import sys

    from agent.cuda import pidprobe

    code = (
        "import os, sys; print('ready', os.getpid(), flush=True); sys.stdin.read()"
        if makes_context
        else "import sys; sys.exit('cuInit failed: CUDA_ERROR_NO_DEVICE')"
    )

    def spawn() -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        if makes_context and world.gpus:
            world.add_cuda_process(proc.pid, [next(iter(world.gpus))], bytes_per_gpu=1 << 20)
        return proc

    def run(nvml: Any) -> Any:
        return pidprobe.probe(nvml, spawn, ready_timeout_s=10, list_timeout_s=0.5)

    return run
