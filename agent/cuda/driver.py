"""The CUDA checkpoint driver API for a job's processes, via `cuda.bindings.driver`.

Per process the driver walks RUNNING → LOCKED → CHECKPOINTED (device memory
copied into the process's host memory, GPU released) → restore → LOCKED →
unlock → RUNNING; FAILED is terminal. Every call acts on another process by
PID, and that process's own restore thread does the work: it must be able to
run, so no lock, checkpoint, restore or unlock may be called while the job is
SIGSTOPped or frozen. get-state and the restore thread's id are answered
without it (a restore asks for the id while it holds the tree stopped; the
device report's driver facts record what the real driver does).

`freeze` and `thaw` act on all CUDA processes of a job and try to undo what
they did when one process fails. The driver does not promise that an undo
works: NVIDIA's README says it "does not attempt to keep the process in a good
state" when it meets what it cannot capture (managed memory), and after a
failed restore the driver may refuse every later restore (CUDA_ERROR_OPERATING_
SYSTEM, 304) and unlock (ILLEGAL_STATE, 401) (cuda-checkpoint issue #44). So an
undo reports what it tried and what state the driver reports afterwards
(`UndoReport`), and callers say exactly that instead of "left as it was".

Why one module: it is the whole adapter. Each driver action is one method, and the
freeze, thaw and the one undo share its mapping of CUresults to errors; split, the
driver's codes would be read in several places.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.compat import StrEnum
from agent.cuda.calls import BoundedCalls, Bounds, CallTimedOut, InFlight
from agent.errors import CudaCheckpointError, RefusedError

log = logging.getLogger(__name__)

# CUresult values (cuda.bindings.driver.CUresult), as documented for the checkpoint calls.
SUCCESS = 0
INVALID_VALUE = 1
OUT_OF_MEMORY = 2
NOT_INITIALIZED = 3
OPERATING_SYSTEM = 304
ILLEGAL_STATE = 401
#: With NOT_SUPPORTED (on a driver without the API): "this driver has no checkpoint support".
NOT_FOUND = 500
NOT_READY = 600
NOT_SUPPORTED = 801
TIMEOUT = 909
#: A lock that ran out of time. cuCheckpointProcessLock documents NOT_READY for it (and leaves the
#: process RUNNING); TIMEOUT is accepted too, in case a driver branch answers that.
LOCK_TIMED_OUT = (NOT_READY, TIMEOUT)
#: What get-state answers for a process without a CUDA context of its own.
NO_CONTEXT = (INVALID_VALUE, NOT_INITIALIZED)
#: Our code for "the bindings raised ValueError": older cuda-bindings turn the undefined state
#: that a failed get-state leaves behind into a CUprocessState and fail (cuda-python #561).
UNDECODABLE = -1
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


@dataclass(frozen=True)
class StateReading:
    """What get-state said about one process: its state, or None with the driver's reason."""

    state: ProcessState | None  # None: the driver knows no CUDA context of this process
    code: int  # the raw CUresult (UNDECODABLE when the bindings could not decode the answer)
    detail: str  # e.g. "CUDA_ERROR_INVALID_VALUE (1)"


@dataclass(frozen=True)
class UndoReport:
    """What an undo of a CUDA freeze tried and what the driver reports afterwards."""

    failures: tuple[str, ...] = ()  # "pid 12: cuda restore of pid 12 failed: ... (304)"
    states: tuple[tuple[int, str], ...] = ()  # (pid, state the driver reports after the undo)

    def __bool__(self) -> bool:
        return bool(self.failures)

    def summary(self) -> str:
        """One sentence: what failed, then what the driver says now (empty when all went back)."""
        if not self.failures:
            return ""
        now = ", ".join(f"pid {pid} {state}" for pid, state in self.states)
        return f"putting CUDA back failed ({'; '.join(self.failures)}); the driver now reports {now}"


#: What an operator can do after a failed undo: the driver keeps no good state to fall back on.
UNDO_HINT = (
    "the NVIDIA driver does not roll back a failed checkpoint or restore and may refuse every later "
    "restore, so the job's CUDA calls stay blocked: end it with `ferry stop` and restart it from its "
    "last checkpoint"
)


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
    """One method per driver action; `driver` defaults to `cuda.bindings.driver` (tests pass a fake).
    Every call goes through `calls` (agent.cuda.calls): bounded, and journaled while it changes
    a process's state; the default bounds them and journals nothing (a tool that moves no job)."""

    def __init__(
        self,
        driver: Any = None,
        node: str = "",
        *,
        explicit_gpu_pairs: bool = False,
        calls: BoundedCalls | None = None,
    ) -> None:
        self._driver = driver
        self.node = node
        self.calls = calls or BoundedCalls(Bounds(), InFlight(None, node), node)
        #: Pass the GPU pairs to every restore, identity pairs included (the driver then checks
        #: them), instead of none when the GPUs stay the same: `[cuda] explicit_gpu_pairs`.
        self.explicit_gpu_pairs = explicit_gpu_pairs
        self._init_lock = threading.Lock()
        self._ready = False
        self._info: DriverInfo | None = None

    # -- setup -----------------------------------------------------------------

    def _drv(self) -> Any:
        """The driver module after cuInit(0), which must run in this process before any restore.
        cuInit runs outside the lock (no driver call is made under one); it is idempotent and
        thread-safe, so two first callers may both make it."""
        with self._init_lock:
            if self._ready:
                return self._driver
            if self._driver is None:
                try:
                    from cuda.bindings import driver
                except ImportError as e:
                    raise self._unavailable(f"cuda-bindings is not installed ({e})") from e
                self._driver = driver
            drv = self._driver
        try:
            (err,) = self.calls.run(0, "init", lambda: drv.cuInit(0), self.calls.bounds.call_s)
        except CudaCheckpointError as e:  # it did not return in time
            raise self._unavailable(f"cuInit did not answer: {e.cause}") from e
        except Exception as e:  # no libcuda.so: cuda-pathfinder raises its own error type
            raise self._unavailable(f"the NVIDIA driver library cannot be loaded ({e})") from e
        if int(err) != SUCCESS:
            raise self._unavailable(f"cuInit failed: {self._name(err)} ({int(err)})")
        with self._init_lock:
            self._ready = True
        return drv

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
        try:
            err, version = self.calls.run(0, "version", drv.cuDriverGetVersion, self.calls.bounds.call_s)
        except CudaCheckpointError as e:
            return DriverInfo(loaded=False, detail=f"cuDriverGetVersion did not answer: {e.cause}")
        version = int(version) if int(err) == SUCCESS else 0
        try:
            checkpoint = self._has_symbol(drv, "cuCheckpointProcessLock", version)
            custom = self._has_symbol(drv, "cuCheckpointOperationComplete", version)
        except CallTimedOut as e:  # no answer is not "no API": asked again next time, not cached
            return DriverInfo(loaded=False, detail=f"the driver did not say what it can do: {e.cause}")
        if not checkpoint:
            detail = f"driver API {_ver(version)} has no CUDA checkpoint support (needs r570+)"
        else:
            detail = f"driver API {_ver(version)} with CUDA checkpoint" + (
                ", custom storage" if custom else ""
            )
        self._info = DriverInfo(True, version, checkpoint, custom, detail)
        return self._info

    def _has_symbol(self, drv: Any, name: str, version: int) -> bool:
        if not hasattr(drv, name):
            return False  # cuda-bindings older than the feature
        try:
            err, pfn, _status = self.calls.run(
                0,
                "symbol",
                lambda: drv.cuGetProcAddress(name.encode(), max(version, 12000), 0),
                self.calls.bounds.call_s,
            )
        except CallTimedOut:
            raise
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
        return self.read_state(pid).state

    def read_state(self, pid: int) -> StateReading:
        """get-state, classified: a state; None with the raw code when the driver knows no
        context (INVALID_VALUE, NOT_INITIALIZED, or NOT_SUPPORTED from a driver that has the
        API); raises CudaCheckpointError for anything else. Never lets a ValueError out."""
        drv = self._drv()
        try:
            err, state = self._call(drv, "cuCheckpointProcessGetState", pid, "get-state", pid)
        except ValueError as e:
            return StateReading(
                None,
                UNDECODABLE,
                f"cuda-bindings could not decode the driver's answer (ValueError: {e}); these bindings do so "
                "when get-state fails, as for a process without a CUDA context",
            )
        code = int(err)
        if code in NO_CONTEXT or (code == NOT_SUPPORTED and self.probe().checkpoint):
            return StateReading(None, code, f"{self._name(err)} ({code})")
        self._check(err, pid, "get-state")
        value = int(state)
        if value not in _STATES:
            raise CudaCheckpointError(
                pid, "get-state", code, f"unknown process state {value}", node=self.node
            )
        return StateReading(_STATES[value], code, f"{self._name(err)} ({code})")

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
        (err,) = self._call(drv, "cuCheckpointProcessLock", pid, "lock", pid, args, lock_timeout_s=timeout_s)
        hint = ""
        if int(err) in LOCK_TIMED_OUT:
            hint = (
                f"the job did not reach a point where CUDA can be locked within {timeout_s:g} s "
                "(it is left running); retry"
            )
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
        # Same GPUs: no pairs (r570 accepts that); explicit pairs must list every checkpointed GPU.
        if gpu_map and (self.explicit_gpu_pairs or any(old != new for old, new in gpu_map.items())):
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

    def _call(self, drv: Any, fn: str, pid: int, action: str, *args: Any, lock_timeout_s: float = 0.0) -> Any:
        """One driver call, bounded (agent.cuda.calls): a CallTimedOut past its bound."""
        bound = self.calls.bounds.of(action, lock_timeout_s)
        try:
            return self.calls.run(pid, action, lambda: getattr(drv, fn)(*args), bound)
        except AttributeError as e:
            raise CudaCheckpointError(pid, action, NOT_FOUND, "CUDA_ERROR_NOT_FOUND", node=self.node) from e
        except RuntimeError as e:  # cuda-bindings: the driver lacks the symbol ("Function ... not found")
            raise CudaCheckpointError(
                pid, action, NOT_FOUND, f"CUDA_ERROR_NOT_FOUND: {e}", node=self.node
            ) from e
        except ValueError as e:
            if action == "get-state":
                raise  # read_state classifies it
            raise CudaCheckpointError(
                pid, action, UNDECODABLE, f"cuda-bindings could not decode the answer: {e}", node=self.node
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


def freeze(
    driver: CudaDriver,
    pids: Iterable[int],
    lock_timeout_s: float,
    times: dict[str, float],
    on_step: Callable[[str], None] = lambda step: None,
) -> None:
    """Lock every CUDA process of a job, then checkpoint each (device → host). `on_step` hears
    "locked" once all are locked and "checkpointing" before the first checkpoint call (a
    source journals both: they say how far a freeze got).

    On any failure (of any kind) the processes are put back (restored onto their own GPUs and
    unlocked) before the error propagates; if that fails too, the error says what the driver
    reports now and what the operator can do.
    """
    pids = list(pids)
    known: dict[int, ProcessState] = {}  # what each call that succeeded left behind
    try:
        t = time.monotonic()
        for pid in pids:
            driver.lock(pid, lock_timeout_s)  # a failed lock changes nothing (a timeout: RUNNING)
            known[pid] = ProcessState.LOCKED
        times["cuda lock"] = time.monotonic() - t
        on_step("locked")
        on_step("checkpointing")
        t = time.monotonic()
        for pid in pids:
            del known[pid]  # a checkpoint that fails half-way leaves a state only get-state knows
            driver.checkpoint(pid)
            known[pid] = ProcessState.CHECKPOINTED
        times["cuda checkpoint"] = time.monotonic() - t
    except BaseException as e:
        touched = pids if "cuda lock" in times else list(known)  # checkpointing: the failed one too
        report = undo(driver, touched, known)
        if isinstance(e, CallTimedOut) and not e.refused:
            # The driver may still finish the call: undo that process then, whatever it left.
            late_undo(driver, e.pid)
            e.cause += "; that process is put back once the call returns"
        elif report and isinstance(e, CudaCheckpointError):
            e.cause += f"; {report.summary()}"
            e.hint = UNDO_HINT
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
    """Unlock each process; one that fails does not keep the others locked (the first error is
    raised once all were tried; a late unlock is retried when its call returns)."""
    t = time.monotonic()
    first: Exception | None = None
    for pid in pids:
        try:
            driver.unlock(pid)
        except Exception as e:
            if isinstance(e, CallTimedOut) and not e.refused:
                late_undo(driver, e.pid)
            first = first or e
    times["cuda unlock"] = time.monotonic() - t
    if first is not None:
        raise first


def late_undo(driver: CudaDriver, pid: int) -> None:
    """Once the call stuck on pid returns, put the process back from whatever state it left."""
    driver.calls.when_returned(pid, lambda: undo(driver, [pid]))


def undo(driver: CudaDriver, pids: list[int], known: Mapping[int, ProcessState] | None = None) -> UndoReport:
    """The one CUDA undo: each process is restored if CHECKPOINTED and unlocked if LOCKED. Its
    state comes from `known` where the caller knows it, else from get-state (slow: seconds a
    call on real drivers), so recovery needs no record of how far a freeze went. What failed, and
    the state the driver reports afterwards, are in the report (the driver may leave a process
    CHECKPOINTED or FAILED for good: cuda-checkpoint #44)."""
    failures: list[str] = []
    states: list[tuple[int, str]] = []
    for pid in pids:
        failure = ""
        try:
            state = known[pid] if known and pid in known else driver.state(pid)
            if state is ProcessState.CHECKPOINTED:
                driver.restore(pid, None)
                state = ProcessState.LOCKED
            if state is ProcessState.LOCKED:
                driver.unlock(pid)
            elif state not in (ProcessState.RUNNING, None):
                failure = f"pid {pid} is {state.value}, which the driver cannot undo"
        except Exception as e:
            failure = f"pid {pid}: {e}"
            if isinstance(e, CallTimedOut) and not e.refused:
                late_undo(driver, pid)  # this undo's own call ran late: try again once it returns
        if failure:
            failures.append(failure)
            states.append((pid, _state_now(driver, pid)))
    report = UndoReport(tuple(failures), tuple(states))
    if report:
        log.error("cuda: %s", report.summary())
    return report


def _state_now(driver: CudaDriver, pid: int) -> str:
    try:
        state = driver.state(pid)
    except Exception as e:
        return f"no state ({e})"
    return state.value if state is not None else "no CUDA context"
