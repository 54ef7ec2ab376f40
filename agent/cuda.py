"""The CUDA checkpoint driver API for a job's processes, via `cuda.bindings.driver`.

Per process the driver walks RUNNING → LOCKED → CHECKPOINTED (device memory
copied into the process's host memory, GPU released) → restore → LOCKED →
unlock → RUNNING; FAILED is terminal. Every call acts on another process by
PID, and that process's own restore thread does the work: it must be able to
run, so nothing here may be called while the job is SIGSTOPped or frozen.

`freeze` and `thaw` act on all CUDA processes of a job and undo what they did
when one process fails, so a failure leaves the job as it was.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.compat import StrEnum
from agent.errors import CudaCheckpointError, RefusedError

log = logging.getLogger(__name__)

#: CUresult values that mean "this driver has no checkpoint support".
NOT_FOUND = 500
NOT_SUPPORTED = 801
SUCCESS = 0
#: What get-state answers for a process without a CUDA context of its own.
NO_CONTEXT = (1, 3)  # INVALID_VALUE, NOT_INITIALIZED
TIMEOUT = 909
#: The driver API version (cuDriverGetVersion) of the first driver with the checkpoint API (r570).
MIN_CUDA_VERSION = 12080
DEFAULT_LOCK_TIMEOUT_S = 30.0


class ProcessState(StrEnum):
    RUNNING = "running"
    LOCKED = "locked"
    CHECKPOINTED = "checkpointed"
    FAILED = "failed"
    CHECKPOINTING = "checkpointing"
    RESTORING = "restoring"


_STATES = {
    0: ProcessState.RUNNING,
    1: ProcessState.LOCKED,
    2: ProcessState.CHECKPOINTED,
    3: ProcessState.FAILED,
    4: ProcessState.CHECKPOINTING,
    5: ProcessState.RESTORING,
}


@dataclass(frozen=True)
class DriverInfo:
    """What the installed driver can do, for `ferry doctor` and for prepare."""

    loaded: bool
    cuda_version: int = 0  # cuDriverGetVersion, e.g. 13000
    checkpoint: bool = False  # cuCheckpointProcess* present
    custom_storage: bool = False  # cuCheckpointOperationComplete present (no staging in host RAM)
    detail: str = ""


def uuid_bytes(uuid: str) -> bytes:
    """NVML's 'GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx' as the driver's 16 raw bytes."""
    text = uuid.removeprefix("GPU-").replace("-", "")
    raw = bytes.fromhex(text)
    if len(raw) != 16:
        raise ValueError(f"not a GPU UUID: {uuid!r}")
    return raw


def uuid_text(raw: bytes) -> str:
    h = bytes(raw).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


class CudaDriver:
    """One method per driver action; `driver` defaults to `cuda.bindings.driver` (tests pass a fake)."""

    def __init__(self, driver: Any = None, node: str = "") -> None:
        self._driver = driver
        self.node = node
        self._init_lock = threading.Lock()
        self._ready = False
        self._info: DriverInfo | None = None

    # -- setup -----------------------------------------------------------------

    def _drv(self) -> Any:
        """The driver module after cuInit(0), which must run in this process before any restore."""
        with self._init_lock:
            if self._ready:
                return self._driver
            if self._driver is None:
                try:
                    from cuda.bindings import driver
                except ImportError as e:
                    raise self._unavailable(f"cuda-bindings is not installed ({e})") from e
                self._driver = driver
            try:
                (err,) = self._driver.cuInit(0)
            except Exception as e:  # no libcuda.so: cuda-pathfinder raises its own error type
                raise self._unavailable(f"the NVIDIA driver library cannot be loaded ({e})") from e
            if int(err) != SUCCESS:
                raise self._unavailable(f"cuInit failed: {self._name(err)} ({int(err)})")
            self._ready = True
            return self._driver

    def _unavailable(self, cause: str) -> RefusedError:
        return RefusedError(
            cause, step="cuda", node=self.node, hint="install NVIDIA driver r570 or newer on this node"
        )

    def probe(self) -> DriverInfo:
        """Whether the driver loads and has the checkpoint API; never raises."""
        if self._info is not None:
            return self._info
        try:
            drv = self._drv()
        except RefusedError as e:
            return DriverInfo(loaded=False, detail=e.cause)
        err, version = drv.cuDriverGetVersion()
        version = int(version) if int(err) == SUCCESS else 0
        checkpoint = self._has_symbol(drv, "cuCheckpointProcessLock", version)
        custom = self._has_symbol(drv, "cuCheckpointOperationComplete", version)
        if not checkpoint:
            detail = f"driver API {_ver(version)} has no CUDA checkpoint support (needs r570+)"
        else:
            detail = f"driver API {_ver(version)} with CUDA checkpoint" + (
                ", custom storage" if custom else ""
            )
        self._info = DriverInfo(True, version, checkpoint, custom, detail)
        return self._info

    @staticmethod
    def _has_symbol(drv: Any, name: str, version: int) -> bool:
        if not hasattr(drv, name):
            return False  # cuda-bindings older than the feature
        try:
            err, pfn, _status = drv.cuGetProcAddress(name.encode(), max(version, 12000), 0)
        except Exception:
            return False
        return int(err) == SUCCESS and bool(int(pfn or 0))

    def require_checkpoint(self) -> DriverInfo:
        """Refuse precisely unless this node's driver can checkpoint CUDA processes."""
        info = self.probe()
        if not info.loaded:
            raise RefusedError(
                f"the job uses CUDA but {info.detail}",
                step="cuda",
                node=self.node,
                hint="install NVIDIA driver r570 or newer",
            )
        if not info.checkpoint:
            raise RefusedError(info.detail, step="cuda", node=self.node, hint="upgrade the NVIDIA driver")
        return info

    # -- one process -----------------------------------------------------------

    def state(self, pid: int) -> ProcessState | None:
        """The process's checkpoint state, or None when it is not a CUDA process."""
        drv = self._drv()
        err, state = self._call(drv, "cuCheckpointProcessGetState", pid, "get-state", pid)
        if int(err) in NO_CONTEXT:
            return None
        self._check(err, pid, "get-state")
        return _STATES.get(int(state), ProcessState.FAILED)

    def restore_thread(self, pid: int) -> int:
        drv = self._drv()
        err, tid = self._call(drv, "cuCheckpointProcessGetRestoreThreadId", pid, "restore-thread", pid)
        self._check(err, pid, "restore-thread")
        return int(tid)

    def lock(self, pid: int, timeout_s: float = DEFAULT_LOCK_TIMEOUT_S) -> None:
        """Block the process's CUDA calls; gives up after timeout_s and leaves it RUNNING."""
        drv = self._drv()
        args = drv.CUcheckpointLockArgs()
        args.timeoutMs = max(1, int(timeout_s * 1000))
        (err,) = self._call(drv, "cuCheckpointProcessLock", pid, "lock", pid, args)
        hint = ""
        if int(err) == TIMEOUT:
            hint = f"the job did not reach a point where CUDA can be locked within {timeout_s:g} s; retry"
        self._check(err, pid, "lock", hint=hint)

    def checkpoint(self, pid: int) -> None:
        drv = self._drv()
        (err,) = self._call(drv, "cuCheckpointProcessCheckpoint", pid, "checkpoint", pid, None)
        self._check(err, pid, "checkpoint")

    def restore(self, pid: int, gpu_map: Mapping[str, str] | None = None) -> None:
        """Device memory back from host memory; onto other GPUs when gpu_map (old → new UUID) says so."""
        drv = self._drv()
        args = None
        keep: list[Any] = []  # the UUID buffers must outlive the call
        if gpu_map and any(old != new for old, new in gpu_map.items()):  # same GPUs: no pairs (r570 ok)
            pairs = []
            for old, new in sorted(gpu_map.items()):
                pair = drv.CUcheckpointGpuPair()
                pair.oldUuid = _cu_uuid(drv, old, keep)
                pair.newUuid = _cu_uuid(drv, new, keep)
                pairs.append(pair)
            args = drv.CUcheckpointRestoreArgs()
            args.gpuPairs = pairs
            args.gpuPairsCount = len(pairs)
        (err,) = self._call(drv, "cuCheckpointProcessRestore", pid, "restore", pid, args)
        self._check(err, pid, "restore")

    def unlock(self, pid: int) -> None:
        drv = self._drv()
        (err,) = self._call(drv, "cuCheckpointProcessUnlock", pid, "unlock", pid, None)
        self._check(err, pid, "unlock")

    # -- plumbing --------------------------------------------------------------

    def _call(self, drv: Any, fn: str, pid: int, action: str, *args: Any) -> Any:
        try:
            return getattr(drv, fn)(*args)
        except AttributeError as e:
            raise CudaCheckpointError(pid, action, NOT_FOUND, "CUDA_ERROR_NOT_FOUND", node=self.node) from e
        except RuntimeError as e:  # cuda-bindings: the driver lacks the symbol ("Function ... not found")
            raise CudaCheckpointError(
                pid, action, NOT_FOUND, f"CUDA_ERROR_NOT_FOUND: {e}", node=self.node
            ) from e

    def _check(self, err: Any, pid: int, action: str, hint: str = "") -> None:
        code = int(err)
        if code == SUCCESS:
            return
        if code == NOT_FOUND or (code == NOT_SUPPORTED and not self.probe().checkpoint):
            hint = "this NVIDIA driver cannot checkpoint CUDA processes; upgrade to r570 or newer"
        elif code == NOT_SUPPORTED:
            # The driver has the API, so this process uses something it cannot capture.
            hint = (
                "the driver cannot checkpoint this process: it may use CUDA managed (UVM) memory, "
                "MPS or CUDA IPC, which CUDA checkpoint does not support"
            )
        raise CudaCheckpointError(pid, action, code, self._name(err), node=self.node, hint=hint)

    def _name(self, err: Any) -> str:
        name = getattr(err, "name", "")
        return name or f"CUresult {int(err)}"


def _cu_uuid(drv: Any, uuid: str, keep: list[Any]) -> Any:
    """A driver CUuuid holding `uuid` (its bytes field is read-only, so build it over our buffer)."""
    buf = ctypes.create_string_buffer(uuid_bytes(uuid), 16)
    keep.append(buf)
    return drv.CUuuid(_ptr=ctypes.addressof(buf))


def _ver(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}" if v else "unknown"


# -- a whole job ---------------------------------------------------------------


def freeze(driver: CudaDriver, pids: Iterable[int], lock_timeout_s: float, times: dict[str, float]) -> None:
    """Lock every CUDA process of a job, then checkpoint each (device → host).

    On any failure (of any kind) the processes are put back as they were
    (restored onto their own GPUs and unlocked) before the error propagates.
    """
    pids = list(pids)
    locked: list[int] = []
    saved: list[int] = []
    try:
        t = time.monotonic()
        for pid in pids:
            driver.lock(pid, lock_timeout_s)
            locked.append(pid)
        times["cuda lock"] = time.monotonic() - t
        t = time.monotonic()
        for pid in pids:
            driver.checkpoint(pid)
            saved.append(pid)
        times["cuda checkpoint"] = time.monotonic() - t
    except BaseException as e:
        problems = _undo(driver, saved, locked)
        if problems and isinstance(e, CudaCheckpointError):
            e.cause += f"; putting CUDA back failed too: {'; '.join(problems)}"
        raise


def thaw(
    driver: CudaDriver,
    plan: list[tuple[int, Mapping[str, str] | None]],
    times: dict[str, float],
    unlock: bool = True,
) -> None:
    """Restore every checkpointed process (host → device, each onto its own map's GPUs), then
    unlock all (or leave them locked, their CUDA calls blocked, for unlock_all later)."""
    t = time.monotonic()
    for pid, gpu_map in plan:
        driver.restore(pid, gpu_map)
    times["cuda restore"] = time.monotonic() - t
    if unlock:
        unlock_all(driver, [pid for pid, _ in plan], times)


def unlock_all(driver: CudaDriver, pids: list[int], times: dict[str, float]) -> None:
    t = time.monotonic()
    for pid in pids:
        driver.unlock(pid)
    times["cuda unlock"] = time.monotonic() - t


def unfreeze(driver: CudaDriver, pids: Iterable[int]) -> list[str]:
    """After an abort: the job's checkpointed processes run again on their own GPUs.

    Returns what could not be undone (empty when all is well); never raises.
    """
    pids = list(pids)
    return _undo(driver, pids, pids)


def _undo(driver: CudaDriver, saved: list[int], locked: list[int]) -> list[str]:
    problems = []
    for pid in saved:
        try:
            driver.restore(pid, None)
        except Exception as e:
            problems.append(str(e))
            locked = [p for p in locked if p != pid]  # cannot unlock what is not restored
    for pid in locked:
        try:
            driver.unlock(pid)
        except Exception as e:
            problems.append(str(e))
    for p in problems:
        log.error("cuda: %s", p)
    return problems
