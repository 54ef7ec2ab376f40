"""A stand-in for `pynvml` that replays scripted GPU telemetry, for machines without a GPU.

`ReplayNvml` answers the same calls as pynvml, with the same argument lists,
return shapes, constants and `NVMLError` codes, so the code under test is the
code that runs against real NVML. Its "world" is a dict (format below) that it
asks a callable for on every call:

- `ReplayNvml.from_file(path)`: a JSON file, re-read when it changes (tests
  rewrite it with os.replace to inject telemetry into a running agent);
- `ReplayNvml.from_timeline(timeline, clock)`: a scripted `Timeline` on a
  `FakeClock`, for unit tests that never sleep.

World format (per-GPU keys other than uuid and name are optional)::

    {"driver_version": "580.65.06",
     "unavailable": "why",            # nvmlInit fails (DRIVER_NOT_LOADED if "driver" is in why,
                                      # else LIBRARY_NOT_FOUND); calls made after init fail alike
     "gpus": [{"uuid": "GPU-a0", "name": "NVIDIA H200",
               "memory_total": 150e9, "memory_used": 0, "persistence": 1, "temperature": 40,
               "ecc_corrected": 0, "ecc_uncorrected": 0,      # volatile counts
               "remapped": {"corrected": 0, "uncorrected": 0, "pending": false, "failure": false},
               "retired_pages": {"single_bit": 0, "double_bit": 0, "pending": false},
               "clocks_event_reasons": 0, "pcie_replay": 0,
               "nvlink": [{"replay": 0, "recovery": 0, "crc_flit": 0, "crc_data": 0, "active": true}],
               "xids": [],                # append-only; each entry is one XID event, delivered once
               "lost": false,             # every call on this GPU raises GPU_IS_LOST
               "unsupported": [],         # call names that raise NOT_SUPPORTED
               "missing": [],             # call names that raise FUNCTION_NOT_FOUND (an older driver)
               "processes": [{"pid": 123, "used_bytes": 0}], "mps_processes": [],
               "selftest": {"stuck": 12, "tflops": 20.0, "hang": false}}]}  # agent.testing.fake_selftest

Events: XIDs already in the list when a handle registers are delivered too (a
replay file may start with a GPU that has already failed); ECC events fire on
an increase of the count after registration.

Why one module: it answers every pynvml call ferry makes, in one place, so that its
signatures can be held against pynvml's (tests/unit/test_health.py).
"""

from __future__ import annotations

import copy
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
from pynvml import (
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_LIBRARY_NOT_FOUND,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_TIMEOUT,
    NVML_ERROR_UNINITIALIZED,
    NVML_FEATURE_DISABLED,
    NVML_FEATURE_ENABLED,
    NVML_MEMORY_ERROR_TYPE_CORRECTED,
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
    NVML_NVLINK_ERROR_DL_CRC_DATA,
    NVML_NVLINK_ERROR_DL_CRC_FLIT,
    NVML_NVLINK_ERROR_DL_ECC_DATA,
    NVML_NVLINK_ERROR_DL_RECOVERY,
    NVML_NVLINK_ERROR_DL_REPLAY,
    NVML_NVLINK_MAX_LINKS,
    NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
    NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
    NVML_TEMPERATURE_GPU,
    NVMLError,
    nvmlEventTypeClock,
    nvmlEventTypeDoubleBitEccError,
    nvmlEventTypePState,
    nvmlEventTypeSingleBitEccError,
    nvmlEventTypeXidCriticalError,
)

__all__ = ["FakeClock", "NVMLError", "ReplayNvml", "Step", "Timeline", "ramp"]

#: What an absent per-GPU key reads as.
GPU_DEFAULTS: dict[str, Any] = {
    "memory_total": int(150e9),
    "memory_used": 0,
    "persistence": NVML_FEATURE_ENABLED,
    "temperature": 40,
    "ecc_corrected": 0,
    "ecc_uncorrected": 0,
    "remapped": {"corrected": 0, "uncorrected": 0, "pending": False, "failure": False},
    # Memory banks by spare rows left (an H100/H200 reports every bank at "max" when new).
    "remap_banks": {"max": 64, "high": 0, "partial": 0, "low": 0, "none": 0},
    "pcie": {"width": 16, "width_max": 16, "gen": 5, "gen_max": 5},
    "sm_clock": {"now": 1980, "max": 1980},  # MHz, an H200's boost clock
    "retired_pages": {"single_bit": 0, "double_bit": 0, "pending": False},
    "clocks_event_reasons": 0,
    "pcie_replay": 0,
    "nvlink": [],
    "xids": [],
    "lost": False,
    "unsupported": [],
    "missing": [],
    "processes": [],
    "mps_processes": [],
}

#: The events a replayed GPU supports, as a data-centre GPU reports them.
SUPPORTED_EVENTS = (
    nvmlEventTypeSingleBitEccError
    | nvmlEventTypeDoubleBitEccError
    | nvmlEventTypePState
    | nvmlEventTypeXidCriticalError
    | nvmlEventTypeClock
)

_NVLINK_COUNTERS = {
    NVML_NVLINK_ERROR_DL_REPLAY: "replay",
    NVML_NVLINK_ERROR_DL_RECOVERY: "recovery",
    NVML_NVLINK_ERROR_DL_CRC_FLIT: "crc_flit",
    NVML_NVLINK_ERROR_DL_CRC_DATA: "crc_data",
    NVML_NVLINK_ERROR_DL_ECC_DATA: "ecc_data",
}
_NO_INSTANCE = 0xFFFFFFFF  # gpuInstanceId / computeInstanceId of an event on a GPU without MIG
_POLL_S = 0.05  # how often a file-mode event wait re-reads the file
_PYNVML_PREFIXES = ("NVMLError", "nvmlEventType", "nvmlClocksEventReason", "nvmlClocksThrottleReason")


def _pynvml_constants() -> dict[str, Any]:
    """pynvml's constants and error classes, so `nv.NVML_...` and `except nv.NVMLError` work unchanged."""
    return {
        k: v
        for k, v in vars(pynvml).items()
        if not k.startswith("_") and (k.isupper() or k.startswith(_PYNVML_PREFIXES))
    }


class FakeClock:
    """A clock that moves only when told: `clock()` is now, `clock.advance(s)` moves it."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, s: float) -> float:
        self.now += s
        return self.now


Step = tuple[float, str, dict[str, Any]]


class Timeline:
    """Scripted telemetry: `steps` are (t, uuid, changes) applied to `world` once the clock reaches t.

    Plain keys set values, nested dicts (e.g. "remapped") merge, `"xid": N` (or a
    list) appends to the GPU's xids. A uuid of "" changes top-level keys (e.g.
    `{"unavailable": None}` makes NVML usable again).
    """

    def __init__(self, world: dict[str, Any], steps: Iterable[Step] = ()) -> None:
        self.world = copy.deepcopy(world)
        self.steps = sorted(steps, key=lambda s: s[0])  # stable: same-time steps keep their order
        known = {g["uuid"] for g in self.world.get("gpus", [])}
        for t, uuid, _ in self.steps:
            if uuid and uuid not in known:
                raise ValueError(f"timeline step at t={t} names unknown GPU {uuid!r}; known: {sorted(known)}")
        self._cached: tuple[float, dict[str, Any]] | None = None

    def world_at(self, t: float) -> dict[str, Any]:
        """The world as it is at time t (a copy the caller may change)."""
        return copy.deepcopy(self._at(t))

    def _at(self, t: float) -> dict[str, Any]:
        # Every NVML call asks for the world; rebuild it only when the clock has moved.
        if self._cached is None or self._cached[0] != t:
            w = copy.deepcopy(self.world)
            gpus = {g["uuid"]: g for g in w.get("gpus", [])}
            for st, uuid, changes in self.steps:
                if st > t:
                    break
                _apply(gpus[uuid] if uuid else w, changes)
            self._cached = (t, w)
        return self._cached[1]


def _apply(target: dict[str, Any], changes: Mapping[str, Any]) -> None:
    for k, v in changes.items():
        if k == "xid":
            target.setdefault("xids", []).extend(v if isinstance(v, list) else [v])
        elif isinstance(v, Mapping) and isinstance(target.get(k), dict):
            _apply(target[k], v)
        else:
            target[k] = copy.deepcopy(v)


def ramp(uuid: str, key: str, start: float, stop: float, t0: float, t1: float, step_s: float) -> list[Step]:
    """Steps that move `key` linearly from start (at t0) to stop (at t1), one every step_s.

    Integer ends give integer values (counters, °C)."""
    n = max(1, round((t1 - t0) / step_s))
    whole = isinstance(start, int) and isinstance(stop, int)
    out: list[Step] = []
    for k in range(n + 1):
        v = start + (stop - start) * k / n
        out.append((t0 + k * step_s, uuid, {key: round(v) if whole else v}))
    return out


def one_gpu(uuid: str, name: str = "NVIDIA H200", **gpu: object) -> dict[str, Any]:
    """A node's world with one GPU, its other keys as given (the world format above)."""
    return {"driver_version": "580.65.06", "gpus": [{"uuid": uuid, "name": name, **gpu}]}


def write_world(path: Path, world: Mapping[str, Any]) -> None:
    """Replace a replay file whole (os.replace), as a running agent's ReplayNvml.from_file
    expects: it never reads half a world."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(world))
    os.replace(tmp, path)


class _FileWorld:
    """The world in a JSON file, re-read when the file changes; a bad read keeps the last good world."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._stamp: tuple[int, int, int] | None = None
        self._world: dict[str, Any] = {"unavailable": f"replay file {self.path} not read yet", "gpus": []}

    def __call__(self) -> dict[str, Any]:
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)  # os.replace gives a new inode
            if stamp != self._stamp:
                world = json.loads(self.path.read_text())
                if not isinstance(world, dict):
                    raise ValueError("not a JSON object")
                self._world, self._stamp = world, stamp
        except (OSError, ValueError):
            pass  # half-written or missing: keep the last good world, read again next call
        return self._world


class _Handle:
    """An opaque device handle, like pynvml's c_nvmlDevice_t."""

    __slots__ = ("uuid",)

    def __init__(self, uuid: str) -> None:
        self.uuid = uuid

    def __repr__(self) -> str:
        return f"<replay nvmlDevice {self.uuid}>"


@dataclass
class _EventSet:
    registered: dict[str, tuple[_Handle, int]] = field(default_factory=dict)  # uuid → (handle, mask)
    queue: list[Any] = field(default_factory=list)
    freed: bool = False


class ReplayNvml:
    """pynvml, answered from a scripted world (see the module docstring)."""

    def __init__(self, world: Callable[[], dict[str, Any]], *, realtime: bool = False) -> None:
        self._world = world
        self._realtime = realtime  # event waits really wait (file mode) or return at once (timeline mode)
        self._lock = threading.RLock()
        self._refs = 0
        self._handles: dict[str, _Handle] = {}
        self._xids_sent: dict[str, int] = {}  # uuid → how many of its xids were delivered
        self._ecc_seen: dict[tuple[str, str], int] = {}  # (uuid, counter) → count at the last event check

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> ReplayNvml:
        return cls(_FileWorld(path), realtime=True)

    @classmethod
    def from_timeline(cls, timeline: Timeline, clock: Callable[[], float]) -> ReplayNvml:
        return cls(lambda: timeline._at(clock()))

    # --- the world -----------------------------------------------------------------------------

    def _now(self) -> dict[str, Any]:
        return self._world()

    def _ready(self) -> dict[str, Any]:
        """The world, after checking NVML is initialised and the driver still answers."""
        if self._refs <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        w = self._now()
        _check_available(w)
        return w

    def _gpus(self) -> list[dict[str, Any]]:
        return list(self._ready().get("gpus", []))

    def _dev(self, handle: Any, call: str) -> dict[str, Any]:
        """The GPU behind a handle with defaults filled in; raises as real NVML would for this call."""
        if not isinstance(handle, _Handle):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        g = next((g for g in self._gpus() if g["uuid"] == handle.uuid), None)
        if g is None:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)  # gone from the world: fallen off the bus
        g = {**GPU_DEFAULTS, **g}
        if g["lost"]:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        if call in g["missing"]:
            raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
        if call in g["unsupported"]:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return g

    def _handle(self, g: dict[str, Any]) -> _Handle:
        # One handle object per GPU, as NVML hands out one pointer per device.
        if g.get("lost"):
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        with self._lock:
            return self._handles.setdefault(g["uuid"], _Handle(g["uuid"]))

    # --- init ----------------------------------------------------------------------------------

    def nvmlInitWithFlags(self, flags: int) -> None:
        _check_available(self._now())
        with self._lock:
            self._refs += 1

    def nvmlInit(self) -> None:
        self.nvmlInitWithFlags(0)

    def nvmlShutdown(self) -> None:
        with self._lock:
            if self._refs <= 0:
                raise NVMLError(NVML_ERROR_UNINITIALIZED)
            self._refs -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return str(self._ready().get("driver_version", "580.65.06"))

    # --- devices -------------------------------------------------------------------------------

    def nvmlDeviceGetCount(self) -> int:
        return len(self._gpus())

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        gpus = self._gpus()
        if not 0 <= index < len(gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self._handle(gpus[index])

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> _Handle:
        want = uuid.decode() if isinstance(uuid, bytes) else uuid
        g = next((g for g in self._gpus() if g["uuid"] == want), None)
        if g is None:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return self._handle(g)

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return str(self._dev(handle, "nvmlDeviceGetUUID")["uuid"])

    def nvmlDeviceGetName(self, handle: Any) -> str:
        return str(self._dev(handle, "nvmlDeviceGetName")["name"])

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        self._dev(handle, "nvmlDeviceGetIndex")
        return next(i for i, g in enumerate(self._gpus()) if g["uuid"] == handle.uuid)

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: Any = None) -> Any:
        g = self._dev(handle, "nvmlDeviceGetMemoryInfo")
        total, used = int(g["memory_total"]), int(g["memory_used"])
        return SimpleNamespace(total=total, used=used, free=max(0, total - used))

    def nvmlDeviceGetMigMode(self, device: Any) -> list[int]:
        self._dev(device, "nvmlDeviceGetMigMode")
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)  # replayed GPUs have no MIG

    def nvmlDeviceGetPersistenceMode(self, handle: Any) -> int:
        return int(self._dev(handle, "nvmlDeviceGetPersistenceMode")["persistence"])

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        return _procs(self._dev(handle, "nvmlDeviceGetComputeRunningProcesses")["processes"])

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: Any) -> list[Any]:
        return _procs(self._dev(handle, "nvmlDeviceGetMPSComputeRunningProcesses")["mps_processes"])

    # --- health counters -----------------------------------------------------------------------

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        g = self._dev(handle, "nvmlDeviceGetTemperature")
        if sensor != NVML_TEMPERATURE_GPU:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return int(g["temperature"])

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> int:
        g = self._dev(handle, "nvmlDeviceGetTotalEccErrors")
        key = {
            NVML_MEMORY_ERROR_TYPE_CORRECTED: "ecc_corrected",
            NVML_MEMORY_ERROR_TYPE_UNCORRECTED: "ecc_uncorrected",
        }
        if errorType not in key or counterType not in (pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return int(g[key[errorType]])  # the world keeps one count; aggregate reads the same

    def nvmlDeviceGetRemappedRows(self, device: Any) -> tuple[int, int, int, int]:
        r = {**GPU_DEFAULTS["remapped"], **self._dev(device, "nvmlDeviceGetRemappedRows")["remapped"]}
        return (int(r["corrected"]), int(r["uncorrected"]), int(bool(r["pending"])), int(bool(r["failure"])))

    def nvmlDeviceGetRowRemapperHistogram(self, device: Any) -> Any:
        b = {
            **GPU_DEFAULTS["remap_banks"],
            **self._dev(device, "nvmlDeviceGetRowRemapperHistogram")["remap_banks"],
        }
        return pynvml.c_nvmlRowRemapperHistogramValues(
            *(int(b[k]) for k in ("max", "high", "partial", "low", "none"))
        )

    def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> int:
        return self._clock(handle, "nvmlDeviceGetClockInfo", type, "now")

    def nvmlDeviceGetMaxClockInfo(self, handle: Any, type: int) -> int:
        return self._clock(handle, "nvmlDeviceGetMaxClockInfo", type, "max")

    def _clock(self, handle: Any, call: str, type: int, key: str) -> int:
        if type != pynvml.NVML_CLOCK_SM:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)  # only the SM clock is replayed
        return int({**GPU_DEFAULTS["sm_clock"], **self._dev(handle, call)["sm_clock"]}[key])

    def _pcie(self, handle: Any, call: str, key: str) -> int:
        return int({**GPU_DEFAULTS["pcie"], **self._dev(handle, call)["pcie"]}[key])

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: Any) -> int:
        return self._pcie(handle, "nvmlDeviceGetCurrPcieLinkWidth", "width")

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: Any) -> int:
        return self._pcie(handle, "nvmlDeviceGetMaxPcieLinkWidth", "width_max")

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: Any) -> int:
        return self._pcie(handle, "nvmlDeviceGetCurrPcieLinkGeneration", "gen")

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: Any) -> int:
        return self._pcie(handle, "nvmlDeviceGetMaxPcieLinkGeneration", "gen_max")

    def nvmlDeviceGetRetiredPages(self, device: Any, sourceFilter: int) -> list[int]:
        r = {
            **GPU_DEFAULTS["retired_pages"],
            **self._dev(device, "nvmlDeviceGetRetiredPages")["retired_pages"],
        }
        causes = {
            NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS: ("single_bit", 0x1000_0000),
            NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR: ("double_bit", 0x2000_0000),
        }
        if sourceFilter not in causes:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        key, base = causes[sourceFilter]
        return [base + i * 0x1000 for i in range(int(r[key]))]  # page addresses; only the count matters

    def nvmlDeviceGetRetiredPagesPendingStatus(self, device: Any) -> int:
        g = self._dev(device, "nvmlDeviceGetRetiredPagesPendingStatus")
        return int(bool({**GPU_DEFAULTS["retired_pages"], **g["retired_pages"]}["pending"]))

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        return int(self._dev(handle, "nvmlDeviceGetCurrentClocksEventReasons")["clocks_event_reasons"])

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any) -> int:
        return int(self._dev(handle, "nvmlDeviceGetCurrentClocksThrottleReasons")["clocks_event_reasons"])

    def nvmlDeviceGetPcieReplayCounter(self, handle: Any) -> int:
        return int(self._dev(handle, "nvmlDeviceGetPcieReplayCounter")["pcie_replay"])

    def nvmlDeviceGetNvLinkState(self, device: Any, link: int) -> int:
        entry = _link(self._dev(device, "nvmlDeviceGetNvLinkState"), link)
        return NVML_FEATURE_ENABLED if entry.get("active", True) else NVML_FEATURE_DISABLED

    def nvmlDeviceGetNvLinkErrorCounter(self, device: Any, link: int, counter: int) -> int:
        entry = _link(self._dev(device, "nvmlDeviceGetNvLinkErrorCounter"), link)
        if counter not in _NVLINK_COUNTERS:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return int(entry.get(_NVLINK_COUNTERS[counter], 0))

    # --- events --------------------------------------------------------------------------------

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        self._dev(handle, "nvmlDeviceGetSupportedEventTypes")
        return SUPPORTED_EVENTS

    def nvmlEventSetCreate(self) -> _EventSet:
        self._ready()
        return _EventSet()

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: _EventSet) -> None:
        g = self._dev(handle, "nvmlDeviceRegisterEvents")
        _live(eventSet)
        if eventTypes & ~SUPPORTED_EVENTS:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)  # NVML refuses a mask with any unsupported type
        with self._lock:
            _, old = eventSet.registered.get(handle.uuid, (handle, 0))
            eventSet.registered[handle.uuid] = (handle, old | eventTypes)
            # ECC events fire on an increase after registration
            for counter in ("ecc_corrected", "ecc_uncorrected"):
                self._ecc_seen.setdefault((handle.uuid, counter), int(g[counter]))

    def nvmlEventSetWait_v2(self, eventSet: _EventSet, timeoutms: int) -> Any:
        deadline = time.monotonic() + max(0, timeoutms) / 1000
        while True:
            self._ready()
            _live(eventSet)
            with self._lock:
                self._collect(eventSet)
                if eventSet.queue:
                    return eventSet.queue.pop(0)
            left = deadline - time.monotonic()
            if not self._realtime or left <= 0:
                raise NVMLError(NVML_ERROR_TIMEOUT)
            time.sleep(min(_POLL_S, left))

    def nvmlEventSetWait(self, eventSet: _EventSet, timeoutms: int) -> Any:
        return self.nvmlEventSetWait_v2(eventSet, timeoutms)

    def nvmlEventSetFree(self, eventSet: _EventSet) -> None:
        _live(eventSet)
        eventSet.freed = True

    def _collect(self, es: _EventSet) -> None:
        """Queue what happened on the registered GPUs since the last look."""
        gpus = {g["uuid"]: {**GPU_DEFAULTS, **g} for g in self._now().get("gpus", [])}
        for uuid, (handle, mask) in es.registered.items():
            g = gpus.get(uuid)
            if g is None:
                continue
            if mask & nvmlEventTypeXidCriticalError:
                xids = list(g["xids"])
                sent = min(self._xids_sent.get(uuid, 0), len(xids))
                es.queue.extend(_event(handle, nvmlEventTypeXidCriticalError, int(x)) for x in xids[sent:])
                self._xids_sent[uuid] = len(xids)
            for counter, kind in (
                ("ecc_uncorrected", nvmlEventTypeDoubleBitEccError),
                ("ecc_corrected", nvmlEventTypeSingleBitEccError),
            ):
                if mask & kind:
                    now, seen = int(g[counter]), self._ecc_seen.get((uuid, counter), 0)
                    if now > seen:
                        es.queue.append(_event(handle, kind, 0))
                    self._ecc_seen[(uuid, counter)] = now  # a drop is a counter reset


for _name, _value in _pynvml_constants().items():
    setattr(ReplayNvml, _name, _value)


def _check_available(w: Mapping[str, Any]) -> None:
    why = w.get("unavailable")
    if why:
        raise NVMLError(
            NVML_ERROR_DRIVER_NOT_LOADED if "driver" in str(why).lower() else NVML_ERROR_LIBRARY_NOT_FOUND
        )


def _link(g: Mapping[str, Any], link: int) -> dict[str, Any]:
    """One NVLink of a GPU; errors as NVML gives them for a GPU without NVLink or a link past its last."""
    links = g["nvlink"]
    if not 0 <= link < NVML_NVLINK_MAX_LINKS:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    if link >= len(links):
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return dict(links[link])


def _live(es: Any) -> None:
    if not isinstance(es, _EventSet) or es.freed:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)


def _procs(items: Iterable[Mapping[str, Any]]) -> list[Any]:
    return [
        SimpleNamespace(
            pid=int(p["pid"]),
            usedGpuMemory=int(p.get("used_bytes", 0)),
            gpuInstanceId=_NO_INSTANCE,
            computeInstanceId=_NO_INSTANCE,
        )
        for p in items
    ]


def _event(handle: _Handle, kind: int, data: int) -> Any:
    """What nvmlEventSetWait_v2 returns: c_nvmlEventData_t's fields."""
    return SimpleNamespace(
        device=handle,
        eventType=kind,
        eventData=data,
        gpuInstanceId=_NO_INSTANCE,
        computeInstanceId=_NO_INSTANCE,
    )
