"""GPU health from NVML: is each GPU of this node fit to keep (or receive) a training job?

The monitor reads every health counter NVML has (temperature, ECC, row
remapping, retired pages, clock slowdowns, PCIe replays, NVLink errors) and
listens for XID and ECC events, and turns them into one state per GPU:

- HEALTHY: nothing to report;
- DEGRADED: still works but should be drained when convenient (a hot GPU, a
  burst of corrected ECC errors, a pending row remap, a flaky link);
- FAILING: a job on it is at risk now (uncorrected ECC, a failed remap, a hard
  XID, a GPU that fell off the bus): move it off.

Each verdict carries its evidence with the numbers and the threshold. Rates come
from counter samples kept in a window per GPU (a counter that goes down was
reset, so its window restarts); events and uncorrected errors latch until an
operator clears the GPU. `nvml` is the pynvml module or anything shaped like it
(agent.testing.nvml_replay.ReplayNvml in tests).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

from agent.compat import StrEnum
from agent.settings import from_table

log = logging.getLogger(__name__)


class State(StrEnum):
    HEALTHY = "healthy"
    DEGRADED = "degraded"
    FAILING = "failing"

    @property
    def rank(self) -> int:
        """0, 1, 2: worse states compare higher."""
        return list(State).index(self)


#: What the well-known XIDs mean (NVIDIA's XID catalogue), for evidence a person reads.
XID_TEXT: dict[int, str] = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup",
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remap recorded",
    64: "ECC page retirement or row remap failed",
    68: "video processor exception",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    109: "context switch timeout",
    119: "GSP RPC timeout",
    120: "GSP error",
}

#: Clock-event reasons that mean the hardware is protecting itself (pynvml's nvmlClocksEventReason* names).
_BRAKES = (
    ("HwSlowdown", "HW slowdown"),
    ("HwThermalSlowdown", "HW thermal slowdown"),
    ("SwThermalSlowdown", "SW thermal slowdown"),
    ("HwPowerBrakeSlowdown", "HW power brake"),
)
#: Signals whose absence is normal for a GPU generation, so `detail` does not call them out.
_EXPECTED_MISSING = {"retired_pages", "remap", "nvlink"}
_PCIE_WINDOW_S = 60.0  # PCIe replays are judged per minute, as DCGM does
_MAX_DRAIN = 1000  # events taken per pass: a storm must not stall the poll


@dataclass(frozen=True)
class Evidence:
    signal: str  # "temperature", "ecc_corrected", "xid", "gpu_lost", ... (see the module's rules)
    severity: State  # DEGRADED or FAILING
    detail: str  # one line with the numbers and the threshold
    since: float  # unix time this evidence was first seen


@dataclass(frozen=True)
class GpuHealth:
    uuid: str
    index: int
    name: str
    state: State
    evidence: tuple[Evidence, ...]  # empty when healthy
    since: float  # when it entered this state
    sampled_at: float
    readings: dict[str, float]  # latest raw values NVML answered this pass, for display
    memory_total: int
    memory_used: int
    memory_free: int


@dataclass(frozen=True)
class Change:
    gpu: GpuHealth
    previous: State  # HEALTHY for a GPU seen the first time


@dataclass(frozen=True)
class HealthConfig:
    """Thresholds and windows; the agent's config file overrides them in its [health] table."""

    interval_s: float = 5.0
    temperature_warn_c: float = 85.0
    temperature_sustain_s: float = 60.0
    temperature_critical_c: float = 95.0
    temperature_hysteresis_c: float = 5.0
    ecc_corrected_burst: int = 10  # corrected errors within ecc_window_s → degraded
    ecc_window_s: float = 60.0
    pcie_replay_per_min: float = 8.0  # DCGM's threshold
    nvlink_crc_per_s: float = 100.0
    nvlink_errors_max: int = 0  # replay + recovery errors within the window above this → degraded
    retired_pages_soft: int = 15
    retired_pages_hard: int = 63
    throttle_sustain_s: float = 30.0  # HW slowdown / thermal / power brake active this long → degraded
    ignored_xids: tuple[int, ...] = (13, 31, 43, 45, 68, 109)  # application XIDs
    hard_xids: tuple[int, ...] = (48, 61, 62, 64, 79, 94, 95, 119, 120)  # → failing; other XIDs → degraded

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> HealthConfig:
        """Overrides from the agent's [health] table; anything unknown or out of range is refused."""
        return from_table(cls, d, "health", positive=frozenset({"interval_s"}))

    def as_dict(self) -> dict[str, object]:
        """Every setting, XID lists as lists (as a TOML/JSON file writes them)."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}


def _plain(v: object) -> object:
    return list(v) if isinstance(v, tuple) else v


class _Finding(NamedTuple):
    """One condition that holds in this pass; `key` tells it apart from others of its signal."""

    key: str
    signal: str
    severity: State
    detail: str


@dataclass
class _Series:
    """Samples of one counter within a time window."""

    window_s: float
    points: deque[tuple[float, float]] = field(default_factory=deque)

    def add(self, t: float, v: float) -> None:
        if self.points and v < self.points[-1][1]:
            self.points.clear()  # the counter went down: reset (driver reload, GPU reset)
        self.points.append((t, v))
        while self.points[0][0] < t - self.window_s:
            self.points.popleft()

    def increase(self) -> float:
        return self.points[-1][1] - self.points[0][1] if self.points else 0.0

    def span(self) -> float:
        return self.points[-1][0] - self.points[0][0] if self.points else 0.0

    def restart(self) -> None:
        """Count from the latest sample on."""
        if self.points:
            self.points = deque([self.points[-1]])


@dataclass
class _Pass:
    """What one pass read from one GPU."""

    now: float
    readings: dict[str, float] = field(default_factory=dict)
    links: dict[int, dict[str, int]] = field(default_factory=dict)  # active NVLink → its error counters
    unsupported: set[str] = field(default_factory=set)  # signals NVML says this GPU lacks
    failed: set[str] = field(default_factory=set)  # signals that failed to read this pass
    lost: str = ""  # the call that answered GPU_IS_LOST


@dataclass
class _Track:
    """Everything the monitor remembers about one GPU between passes."""

    uuid: str
    index: int
    since: float
    name: str = ""
    handle: Any = None  # valid for the current NVML session only
    state: State = State.HEALTHY
    memory: tuple[int, int, int] = (0, 0, 0)
    readings: dict[str, float] = field(default_factory=dict)
    unsupported: set[str] = field(default_factory=set)
    events_note: str = ""
    series: dict[str, _Series] = field(default_factory=dict)
    findings: dict[str, list[_Finding]] = field(default_factory=dict)  # by signal group, last pass read
    latched: dict[str, Evidence] = field(default_factory=dict)  # XIDs, uncorrected ECC, lost
    xid_counts: dict[int, int] = field(default_factory=dict)
    seen: dict[str, float] = field(default_factory=dict)  # finding key → first seen
    ecc_base: float | None = None  # uncorrected count that is not news
    hot: bool = False
    hot_since: float | None = None
    throttle_since: float | None = None

    def sample(self, key: str, window_s: float, t: float, v: float) -> _Series:
        """Record a counter reading in its window; the window then answers increase and span."""
        s = self.series.setdefault(key, _Series(window_s))
        s.add(t, v)
        return s


class _GpuLost(Exception):
    def __init__(self, call: str) -> None:
        super().__init__(call)
        self.call = call


class HealthMonitor:
    """Polls NVML, judges each GPU and reports state changes (see the module docstring)."""

    def __init__(
        self,
        nvml: Any,
        config: HealthConfig = HealthConfig(),
        *,
        node: str = "",
        on_poll: Callable[[list[GpuHealth], list[Change]], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self._nv = nvml
        self._node = node
        self._on_poll = on_poll
        self._clock = clock
        # A pass can hang in NVML on a GPU that falls off the bus: it runs under its own lock, and
        # readers (GetHealth, Prepare) only wait for the short one that guards what it publishes.
        self._pass_lock = threading.RLock()
        self._lock = threading.RLock()
        self._published_detail = ""
        self._connected = False
        self._available = False
        self._why = "not polled yet"
        self._events: Any = None  # the NVML event set, when there is one
        self._events_note = ""
        self._handles: dict[int, Any] = {}  # index → handle, this NVML session
        self._uuid_at: dict[int, str] = {}  # index → uuid, across sessions
        self._tracks: dict[str, _Track] = {}
        self._snapshot: list[GpuHealth] = []
        self._queued: list[tuple[Any, float]] = []  # events run() took while waiting, with when

    # --- public --------------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        return self._available

    @property
    def detail(self) -> str:
        """Empty when every signal is watched; else why NVML is unusable, or what cannot be watched here."""
        if not self._available:
            return self._why
        with self._lock:
            return self._published_detail

    def _detail_now(self) -> str:
        parts = [self._events_note] if self._events_note else []
        for h in self._snapshot:
            tr = self._tracks[h.uuid]
            if tr.events_note:
                parts.append(tr.events_note)
            unread = sorted(tr.unsupported - _EXPECTED_MISSING)
            if unread:
                parts.append(f"{tr.uuid}: {', '.join(unread)} not supported")
        return "; ".join(parts)

    def snapshot(self) -> list[GpuHealth]:
        with self._lock:
            return list(self._snapshot)

    def get(self, uuid: str) -> GpuHealth | None:
        with self._lock:
            return next((h for h in self._snapshot if h.uuid == uuid), None)

    def poll(self) -> list[GpuHealth]:
        """One pass over every GPU; calls on_poll with the snapshot and the GPUs whose state changed."""
        with self._pass_lock:
            snapshot, changes = self._pass(self._clock())
            with self._lock:
                self._snapshot = snapshot
                self._published_detail = self._detail_now()
        for c in changes:
            _log_change(c, self._node)
        if self._on_poll is not None:
            self._on_poll(list(snapshot), changes)
        return snapshot

    def clear(self, uuid: str) -> bool:
        """An operator says the GPU is fixed: forget what latched and count afresh from now."""
        with self._pass_lock:
            tr = self._tracks.get(uuid)
            if tr is None:
                return False
            tr.latched.clear()
            tr.xid_counts.clear()
            tr.findings.clear()
            tr.seen.clear()
            tr.hot, tr.hot_since, tr.throttle_since = False, None, None
            tr.ecc_base = tr.readings.get("ecc_uncorrected")
            for s in tr.series.values():
                s.restart()
        log.info("GPU %s%s cleared by an operator; the next pass judges it afresh", uuid, _on(self._node))
        return True

    def run(self, stop: threading.Event) -> None:
        """Poll every interval_s until stop is set; an XID or ECC event between polls polls at once."""
        while not stop.is_set():
            try:
                self.poll()
            except Exception:
                log.exception(
                    "GPU health pass failed%s; trying again in %g s", _on(self._node), self.config.interval_s
                )
            self._wait(stop, self.config.interval_s)

    def close(self) -> None:
        with self._pass_lock:
            self._disconnect(self._why if not self._available else "the health monitor is closed")

    # --- NVML session --------------------------------------------------------------------------

    def _connect(self) -> bool:
        if self._connected:
            return True
        nv = self._nv
        try:
            nv.nvmlInit()
        except Exception as e:  # pynvml raises NVMLError; a broken library may raise anything
            self._available, self._why = False, f"NVML unavailable: {e}"
            return False
        self._connected, self._available, self._why = True, True, ""
        self._handles = {}
        self._events, self._events_note = None, ""
        try:
            self._events = nv.nvmlEventSetCreate()
        except nv.NVMLError as e:
            self._events_note = f"no NVML events ({e}): XIDs are not seen"
        return True

    def _disconnect(self, why: str) -> None:
        nv = self._nv
        if self._events is not None:
            with contextlib.suppress(Exception):
                nv.nvmlEventSetFree(self._events)
            self._events = None
        if self._connected:
            with contextlib.suppress(Exception):
                nv.nvmlShutdown()
        self._connected, self._available, self._why = False, False, why
        self._handles = {}

    def _gpu_at_or_none(self, i: int, now: float) -> tuple[_Track, str] | None:
        try:
            return self._gpu_at(i, now)
        except self._nv.NVMLError as e:
            log.debug("GPU %d%s: no handle this pass: %s", i, _on(self._node), e)
            return None

    def _gpu_at(self, i: int, now: float) -> tuple[_Track, str]:
        """GPU i's track (and, if NVML says it is lost before giving a handle, the call that said so)."""
        nv = self._nv
        h = self._handles.get(i)
        if h is not None:
            return self._tracks[self._uuid_at[i]], ""
        try:
            h = nv.nvmlDeviceGetHandleByIndex(i)
            uuid, name = _text(nv.nvmlDeviceGetUUID(h)), _text(nv.nvmlDeviceGetName(h))
        except nv.NVMLError as e:
            if _code(e) != nv.NVML_ERROR_GPU_IS_LOST:
                raise
            uuid = self._uuid_at.get(i, f"index:{i}")  # never seen: all NVML tells is its index
            return self._track(uuid, i, now), "nvmlDeviceGetHandleByIndex"
        tr = self._track(uuid, i, now)
        tr.name, tr.handle = name, h
        self._handles[i], self._uuid_at[i] = h, uuid
        self._register(tr)
        return tr, ""

    def _track(self, uuid: str, index: int, now: float) -> _Track:
        tr = self._tracks.setdefault(uuid, _Track(uuid, index, since=now))
        tr.index = index
        return tr

    def _register(self, tr: _Track) -> None:
        """Ask for XID and ECC events on this GPU, as far as it supports them."""
        nv = self._nv
        tr.events_note = ""
        if self._events is None:
            return
        want = (
            nv.nvmlEventTypeXidCriticalError
            | nv.nvmlEventTypeDoubleBitEccError
            | nv.nvmlEventTypeSingleBitEccError
        )
        why = "not supported"
        try:
            mask = want & int(nv.nvmlDeviceGetSupportedEventTypes(tr.handle))
            if mask:
                nv.nvmlDeviceRegisterEvents(tr.handle, mask, self._events)
        except nv.NVMLError as e:
            mask = 0
            why = "not supported" if _code(e) == nv.NVML_ERROR_NOT_SUPPORTED else str(e)
        if not mask & nv.nvmlEventTypeXidCriticalError:
            tr.events_note = f"no XID events on {tr.uuid} ({why})"

    # --- one pass ------------------------------------------------------------------------------

    def _pass(self, now: float) -> tuple[list[GpuHealth], list[Change]]:
        nv = self._nv
        if not self._connect():
            return [], []
        try:
            count = int(nv.nvmlDeviceGetCount())
        except nv.NVMLError as e:
            self._disconnect(f"NVML stopped answering: {e}")
            return [], []
        gpus = [g for g in (self._gpu_at_or_none(i, now) for i in range(count)) if g is not None]
        self._drain(now)  # after registering: a GPU seen the first time may already have events
        snapshot: list[GpuHealth] = []
        changes: list[Change] = []
        for tr, lost in gpus:
            health, previous = self._assess(tr, now, lost)
            snapshot.append(health)
            if health.state != previous:
                changes.append(Change(health, previous))
        return snapshot, changes

    def _assess(self, tr: _Track, now: float, lost: str) -> tuple[GpuHealth, State]:
        p = _Pass(now, lost=lost) if lost else self._read(tr, now)
        if p.lost:
            self._latch(tr, "gpu_lost", State.FAILING, f"GPU is lost (NVML said so to {p.lost})", now)
        else:
            tr.readings = p.readings
        tr.unsupported = p.unsupported
        evidence = self._evidence(tr, p)
        state = max((e.severity for e in evidence), key=lambda s: s.rank, default=State.HEALTHY)
        previous = tr.state
        if state != previous:
            tr.state, tr.since = state, now
        total, used, free = tr.memory
        health = GpuHealth(
            uuid=tr.uuid,
            index=tr.index,
            name=tr.name,
            state=state,
            evidence=evidence,
            since=tr.since,
            sampled_at=now,
            readings=dict(p.readings),
            memory_total=total,
            memory_used=used,
            memory_free=free,
        )
        return health, previous

    def _evidence(self, tr: _Track, p: _Pass) -> tuple[Evidence, ...]:
        if not p.lost:  # a lost GPU answers nothing: only what latched speaks for it
            for group, judge in self._judges().items():
                if group not in p.failed:  # a read that failed keeps the last verdict rather than clear it
                    tr.findings[group] = judge(tr, p)
        current = [f for fs in tr.findings.values() for f in fs] if not p.lost else []
        tr.seen = {f.key: tr.seen.get(f.key, p.now) for f in current}
        out = [Evidence(f.signal, f.severity, f.detail, tr.seen[f.key]) for f in current]
        out += tr.latched.values()
        return tuple(sorted(out, key=lambda e: (-e.severity.rank, e.since, e.signal)))

    def _judges(self) -> dict[str, Callable[[_Track, _Pass], list[_Finding]]]:
        return {
            "temperature": self._temperature,
            "ecc_corrected": self._ecc_corrected,
            "ecc_uncorrected": self._ecc_uncorrected,
            "remap": self._remap,
            "retired_pages": self._retired_pages,
            "clocks": self._clocks,
            "pcie_replay": self._pcie,
            "nvlink": self._nvlink,
        }

    # --- reading -------------------------------------------------------------------------------

    def _read(self, tr: _Track, now: float) -> _Pass:
        p = _Pass(now)
        try:
            self._read_counters(tr, p)
            self._read_nvlink(tr, p)
        except _GpuLost as e:
            p.lost = e.call
        return p

    def _ask(self, tr: _Track, p: _Pass, group: str, names: str | tuple[str, ...], *args: Any) -> Any:
        """One NVML call for one signal group; None (and why, in p) when it gave no value.

        With several names, the next is tried when a call is missing from pynvml or the driver."""
        nv = self._nv
        for name in (names,) if isinstance(names, str) else names:
            fn = getattr(nv, name, None)
            if fn is None:
                continue
            try:
                return fn(tr.handle, *args)
            except nv.NVMLError as e:
                code = _code(e)
                if code == nv.NVML_ERROR_FUNCTION_NOT_FOUND:
                    continue
                if code == nv.NVML_ERROR_GPU_IS_LOST:
                    raise _GpuLost(name) from e
                if code == nv.NVML_ERROR_NOT_SUPPORTED:
                    p.unsupported.add(group)
                else:
                    log.debug("GPU %s: %s failed: %s; %s skipped this pass", tr.uuid, name, e, group)
                    p.failed.add(group)
                return None
        p.unsupported.add(group)
        return None

    def _read_counters(self, tr: _Track, p: _Pass) -> None:
        nv, r = self._nv, p.readings
        mem = self._ask(tr, p, "memory", "nvmlDeviceGetMemoryInfo")
        if mem is not None:
            tr.memory = (int(mem.total), int(mem.used), int(mem.free))
        temp = self._ask(tr, p, "temperature", "nvmlDeviceGetTemperature", nv.NVML_TEMPERATURE_GPU)
        _put(r, "temperature_c", temp)
        for key, kind in (
            ("ecc_corrected", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED),
            ("ecc_uncorrected", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
        ):
            _put(r, key, self._ask(tr, p, key, "nvmlDeviceGetTotalEccErrors", kind, nv.NVML_VOLATILE_ECC))
        self._read_retirement(tr, p)
        clocks = ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons")
        _put(r, "clocks_event_reasons", self._ask(tr, p, "clocks", clocks))
        _put(r, "pcie_replay", self._ask(tr, p, "pcie_replay", "nvmlDeviceGetPcieReplayCounter"))

    def _read_retirement(self, tr: _Track, p: _Pass) -> None:
        """Row remapping (A100 and newer) and page retirement (older GPUs): each GPU has one of the two."""
        nv, r = self._nv, p.readings
        remap = self._ask(tr, p, "remap", "nvmlDeviceGetRemappedRows")
        if remap is not None:
            corrected, uncorrected, pending, failure = remap
            r["remapped_corrected"], r["remapped_uncorrected"] = float(corrected), float(uncorrected)
            r["remap_pending"], r["remap_failure"] = float(bool(pending)), float(bool(failure))
        causes = (
            nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
            nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
        )
        pages = [self._ask(tr, p, "retired_pages", "nvmlDeviceGetRetiredPages", c) for c in causes]
        if all(x is not None for x in pages):
            r["retired_pages"] = float(sum(len(x) for x in pages))
        retiring = self._ask(tr, p, "retired_pages", "nvmlDeviceGetRetiredPagesPendingStatus")
        _put(r, "retired_pages_pending", None if retiring is None else bool(retiring))

    def _read_nvlink(self, tr: _Track, p: _Pass) -> None:
        nv = self._nv
        counters = {
            "replay": nv.NVML_NVLINK_ERROR_DL_REPLAY,
            "recovery": nv.NVML_NVLINK_ERROR_DL_RECOVERY,
            "crc_flit": nv.NVML_NVLINK_ERROR_DL_CRC_FLIT,
            "crc_data": nv.NVML_NVLINK_ERROR_DL_CRC_DATA,
        }
        for link in range(nv.NVML_NVLINK_MAX_LINKS):
            try:
                state = nv.nvmlDeviceGetNvLinkState(tr.handle, link)
            except nv.NVMLError as e:
                if _code(e) == nv.NVML_ERROR_GPU_IS_LOST:
                    raise _GpuLost("nvmlDeviceGetNvLinkState") from e
                if _code(e) not in (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_INVALID_ARGUMENT):
                    log.debug("GPU %s: NVLink %d state failed: %s", tr.uuid, link, e)
                    p.failed.add("nvlink")
                break  # past the last link, or no NVLink at all
            if state != nv.NVML_FEATURE_ENABLED:
                continue
            counts = {
                name: self._ask(tr, p, "nvlink", "nvmlDeviceGetNvLinkErrorCounter", link, c)
                for name, c in counters.items()
            }
            p.links[link] = {k: int(v) for k, v in counts.items() if v is not None}
        if p.links:
            r = p.readings
            r["nvlink_links"] = float(len(p.links))
            r["nvlink_errors"] = float(
                sum(c.get("replay", 0) + c.get("recovery", 0) for c in p.links.values())
            )
            r["nvlink_crc"] = float(
                sum(c.get("crc_flit", 0) + c.get("crc_data", 0) for c in p.links.values())
            )

    # --- judging -------------------------------------------------------------------------------

    def _temperature(self, tr: _Track, p: _Pass) -> list[_Finding]:
        t = p.readings.get("temperature_c")
        if t is None:
            return []
        c = self.config
        tr.hot_since = (
            (p.now if tr.hot_since is None else tr.hot_since) if t >= c.temperature_warn_c else None
        )
        held = p.now - tr.hot_since if tr.hot_since is not None else 0.0
        if t >= c.temperature_critical_c or (tr.hot_since is not None and held >= c.temperature_sustain_s):
            tr.hot = True
        elif t < c.temperature_warn_c - c.temperature_hysteresis_c:
            tr.hot = False  # hysteresis: a GPU hovering at the threshold does not flap
        if not tr.hot:
            return []
        if t >= c.temperature_critical_c:
            detail = f"temperature {t:g} °C ≥ {c.temperature_critical_c:g} °C (critical)"
        elif tr.hot_since is not None:
            detail = f"temperature {t:g} °C ≥ {c.temperature_warn_c:g} °C for {held:.0f} s"
        else:
            cool = c.temperature_warn_c - c.temperature_hysteresis_c
            detail = f"temperature {t:g} °C, was ≥ {c.temperature_warn_c:g} °C (clears below {cool:g} °C)"
        return [_Finding("temperature", "temperature", State.DEGRADED, detail)]

    def _ecc_corrected(self, tr: _Track, p: _Pass) -> list[_Finding]:
        v = p.readings.get("ecc_corrected")
        if v is None:
            return []
        c = self.config
        n = tr.sample("ecc_corrected", c.ecc_window_s, p.now, v).increase()
        if n <= 0 or n < c.ecc_corrected_burst:
            return []
        detail = f"{n:g} corrected ECC errors in {c.ecc_window_s:g} s (threshold {c.ecc_corrected_burst})"
        return [_Finding("ecc_corrected", "ecc_corrected", State.DEGRADED, detail)]

    def _ecc_uncorrected(self, tr: _Track, p: _Pass) -> list[_Finding]:
        v = p.readings.get("ecc_uncorrected")
        if v is None:
            return []
        if tr.ecc_base is None or v < tr.ecc_base:
            tr.ecc_base = v  # the first reading (or one after a counter reset) is old news
        elif v > tr.ecc_base:
            detail = (
                f"{v - tr.ecc_base:g} uncorrected ECC error(s) (volatile count {v:g}, was {tr.ecc_base:g})"
            )
            self._latch(tr, "ecc_uncorrected", State.FAILING, detail, p.now)
        return []  # it latches: see tr.latched

    def _remap(self, tr: _Track, p: _Pass) -> list[_Finding]:
        r = p.readings
        if "remap_pending" not in r:
            return []
        rows = (
            f"{r['remapped_corrected']:g} corrected, {r['remapped_uncorrected']:g} uncorrected rows remapped"
        )
        out = []
        if r["remap_failure"]:
            out.append(
                _Finding("remap_failure", "remap_failure", State.FAILING, f"row remapping failed ({rows})")
            )
        if r["remap_pending"]:
            detail = f"row remapping pending: a GPU reset applies it ({rows})"
            out.append(_Finding("remap_pending", "remap_pending", State.DEGRADED, detail))
        return out

    def _retired_pages(self, tr: _Track, p: _Pass) -> list[_Finding]:
        c, out = self.config, []
        n = p.readings.get("retired_pages")
        if n is not None and n >= c.retired_pages_hard:
            detail = f"{n:g} retired pages (limit {c.retired_pages_hard})"
            out.append(_Finding("retired_pages", "retired_pages", State.FAILING, detail))
        elif n is not None and n >= c.retired_pages_soft:
            detail = f"{n:g} retired pages (threshold {c.retired_pages_soft})"
            out.append(_Finding("retired_pages", "retired_pages", State.DEGRADED, detail))
        if p.readings.get("retired_pages_pending"):
            detail = "page retirement pending: a GPU reset applies it"
            out.append(_Finding("retired_pages_pending", "retired_pages", State.DEGRADED, detail))
        return out

    def _clocks(self, tr: _Track, p: _Pass) -> list[_Finding]:
        v = p.readings.get("clocks_event_reasons")
        if v is None:
            return []
        active = [
            text for name, text in _BRAKES if int(v) & getattr(self._nv, "nvmlClocksEventReason" + name)
        ]
        if not active:
            tr.throttle_since = None
            return []
        tr.throttle_since = p.now if tr.throttle_since is None else tr.throttle_since
        held, need = p.now - tr.throttle_since, self.config.throttle_sustain_s
        if held < need:
            return []
        detail = f"clocks slowed by {', '.join(active)} for {held:.0f} s (threshold {need:g} s)"
        return [_Finding("clocks", "clocks", State.DEGRADED, detail)]

    def _pcie(self, tr: _Track, p: _Pass) -> list[_Finding]:
        v = p.readings.get("pcie_replay")
        if v is None:
            return []
        s = tr.sample("pcie_replay", _PCIE_WINDOW_S, p.now, v)
        # Counted over the last minute, not extrapolated: one replay early on is not "12 a minute".
        n, limit = s.increase(), self.config.pcie_replay_per_min
        if n <= limit:
            return []
        detail = f"{n:g} PCIe replays in {s.span():.0f} s (threshold {limit:g} per minute)"
        return [_Finding("pcie_replay", "pcie_replay", State.DEGRADED, detail)]

    def _nvlink(self, tr: _Track, p: _Pass) -> list[_Finding]:
        c = self.config
        errors, crc = [], []
        for link, n in sorted(p.links.items()):
            e = tr.sample(
                f"nvlink{link}_errors", c.ecc_window_s, p.now, n.get("replay", 0) + n.get("recovery", 0)
            )
            if e.increase() > c.nvlink_errors_max:
                errors.append(f"link {link} +{e.increase():g}")
            k = tr.sample(
                f"nvlink{link}_crc", c.ecc_window_s, p.now, n.get("crc_flit", 0) + n.get("crc_data", 0)
            )
            rate = k.increase() / max(k.span(), 1.0)  # a floor: two passes a moment apart are no rate
            if rate > c.nvlink_crc_per_s:
                crc.append(f"link {link} {rate:.0f}/s")
        out = []
        if errors:
            detail = (
                f"NVLink replay/recovery errors in {c.ecc_window_s:g} s: {', '.join(errors)}"
                f" (threshold {c.nvlink_errors_max})"
            )
            out.append(_Finding("nvlink_errors", "nvlink", State.DEGRADED, detail))
        if crc:
            detail = f"NVLink CRC errors {', '.join(crc)} (threshold {c.nvlink_crc_per_s:g}/s)"
            out.append(_Finding("nvlink_crc", "nvlink", State.DEGRADED, detail))
        return out

    def _latch(self, tr: _Track, signal: str, severity: State, detail: str, at: float) -> None:
        """Evidence that holds until clear(); the first sighting's words and time stay."""
        tr.latched.setdefault(signal, Evidence(signal, severity, detail, at))

    # --- events --------------------------------------------------------------------------------

    def _drain(self, now: float) -> None:
        """Take the events run() queued and those pending now, without blocking."""
        with self._lock:
            queued, self._queued = self._queued, []
        for ev, at in queued:
            self._on_event(ev, at)
        for _ in range(_MAX_DRAIN):
            ev = self._wait_event(0)
            if ev is None:
                break
            self._on_event(ev, now)

    def _wait_event(self, timeout_ms: int) -> Any:
        """One event, or None on timeout (or when there is no event set, or it fails)."""
        nv, es = self._nv, self._events
        if es is None:
            return None
        try:
            return nv.nvmlEventSetWait_v2(es, timeout_ms)
        except Exception as e:  # the loop must outlive a broken event set; polls still read the counters
            if _code(e) != nv.NVML_ERROR_TIMEOUT:
                log.debug("NVML event wait failed: %s", e)
            return None

    def _on_event(self, ev: Any, at: float) -> None:
        nv = self._nv
        tr = self._track_of(ev.device)
        if tr is None:
            log.debug("NVML event %#x for a GPU not tracked; dropped", int(ev.eventType))
            return
        kind = int(ev.eventType)
        if kind & nv.nvmlEventTypeXidCriticalError:
            self._on_xid(tr, int(ev.eventData), at)
        if kind & nv.nvmlEventTypeDoubleBitEccError:
            self._latch(tr, "ecc_uncorrected", State.FAILING, "uncorrected (double-bit) ECC error event", at)

    def _on_xid(self, tr: _Track, xid: int, at: float) -> None:
        c = self.config
        text = f"XID {xid}" + (f" ({XID_TEXT[xid]})" if xid in XID_TEXT else "")
        if xid in c.ignored_xids:
            log.debug("GPU %s: %s is an application error; ignored", tr.uuid, text)
            return
        n = tr.xid_counts[xid] = tr.xid_counts.get(xid, 0) + 1
        key = f"xid:{xid}"
        first = tr.latched.get(key)
        severity = State.FAILING if xid in c.hard_xids else State.DEGRADED
        tr.latched[key] = Evidence(
            "xid", severity, text + (f", {n} times" if n > 1 else ""), first.since if first else at
        )

    def _track_of(self, device: Any) -> _Track | None:
        nv = self._nv
        with contextlib.suppress(nv.NVMLError):
            return self._tracks.get(_text(nv.nvmlDeviceGetUUID(device)))
        # A lost GPU cannot name itself (XID 79): match the handle instead.
        return next((t for t in self._tracks.values() if _same_handle(t.handle, device)), None)

    def _wait(self, stop: threading.Event, seconds: float) -> None:
        """Sleep until the next pass, in slices of ≤ 1 s so stop is honoured; an urgent event ends it."""
        deadline = time.monotonic() + seconds
        while not stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            slice_s = min(left, 1.0)
            started = time.monotonic()
            ev = self._wait_event(int(slice_s * 1000))
            if ev is not None:
                with self._lock:
                    self._queued.append((ev, self._clock()))
                if self._urgent(ev):
                    return
                continue
            rest = slice_s - (time.monotonic() - started)
            if rest > 0.001:  # no event set, or a wait that returned early: do not spin
                stop.wait(rest)

    def _urgent(self, ev: Any) -> bool:
        nv, kind = self._nv, int(ev.eventType)
        if kind & nv.nvmlEventTypeDoubleBitEccError:
            return True
        return (
            bool(kind & nv.nvmlEventTypeXidCriticalError)
            and int(ev.eventData) not in self.config.ignored_xids
        )


def _put(r: dict[str, float], key: str, v: Any) -> None:
    if v is not None:
        r[key] = float(v)


def _code(e: BaseException) -> Any:
    return getattr(e, "value", None)


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _on(node: str) -> str:
    return f" on {node}" if node else ""


def _same_handle(a: Any, b: Any) -> bool:
    """Whether two device handles are the same GPU: the same object, or pynvml pointers to one device."""
    if a is None or b is None:
        return False
    if a is b:
        return True
    with contextlib.suppress(Exception):
        return bool(ctypes.cast(a, ctypes.c_void_p).value == ctypes.cast(b, ctypes.c_void_p).value)
    return False


def _log_change(c: Change, node: str) -> None:
    h = c.gpu
    why = "; ".join(e.detail for e in h.evidence) or "no evidence left"
    level = logging.INFO if h.state is State.HEALTHY else logging.WARNING
    log.log(level, "GPU %s (index %d)%s %s → %s: %s", h.uuid, h.index, _on(node), c.previous, h.state, why)
