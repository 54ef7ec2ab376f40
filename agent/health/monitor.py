"""GPU health from NVML: is each GPU of this node fit to keep (or receive) a training job?

The monitor reads every health counter NVML has (temperature, ECC, row
remapping, retired pages, clock slowdowns, PCIe replays, NVLink errors) and
listens for XID and ECC events, and turns them into one state per GPU:

- HEALTHY: nothing to report;
- DEGRADED: still works but should be drained when convenient (a hot GPU, a
  burst of corrected ECC errors, a pending row remap, a flaky link);
- FAILING: a job on it is at risk now (uncorrected ECC, a failed remap, a hard
  XID, a GPU that fell off the bus): move it off.

This module holds the loop: the NVML session and its event set, one pass over
every GPU, the snapshot it publishes, and the wait between passes that an
urgent event cuts short. What a pass reads is agent.health.signals, how it is
judged agent.health.judging (under agent.health.thresholds.HealthConfig), and
what it publishes agent.health.verdicts; the public names of those are
importable from here too. `nvml` is the pynvml module or anything shaped like
it (agent.testing.nvml_replay.ReplayNvml in tests).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from agent.health.judging import XID_TEXT, Judge, Track, brakes
from agent.health.signals import Pass, error_code, read, text
from agent.health.thresholds import HealthConfig
from agent.health.verdicts import Change, Evidence, GpuHealth, State

__all__ = ["XID_TEXT", "Change", "Evidence", "GpuHealth", "HealthConfig", "HealthMonitor", "State"]

log = logging.getLogger(__name__)

#: Signals whose absence is normal for a GPU generation, so `detail` does not call them out.
_EXPECTED_MISSING = {"retired_pages", "remap", "nvlink"}
_MAX_DRAIN = 1000  # events taken per pass: a storm must not stall the poll
_DEFAULTS = HealthConfig()  # frozen: one instance serves every monitor built without a config


class HealthMonitor:
    """Polls NVML, judges each GPU and reports state changes (see the module docstring)."""

    def __init__(
        self,
        nvml: Any,
        config: HealthConfig = _DEFAULTS,
        *,
        node: str = "",
        on_poll: Callable[[list[GpuHealth], list[Change]], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._judge = Judge(config, nvml)
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
        self._tracks: dict[str, Track] = {}
        self._snapshot: list[GpuHealth] = []
        self._queued: list[tuple[Any, float]] = []  # events run() took while waiting, with when

    # --- public --------------------------------------------------------------------------------

    @property
    def config(self) -> HealthConfig:
        return self._judge.config

    @config.setter
    def config(self, config: HealthConfig) -> None:
        self._judge.config = config  # the judge reads it on every pass

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

    def brakes(self, reasons: int) -> list[str]:
        """The clock-event reasons that mean a GPU slows itself, in words (judging.brakes)."""
        return brakes(self._nv, reasons)

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
            tr.clear()
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

    def _gpu_at_or_none(self, i: int, now: float) -> tuple[Track, str] | None:
        try:
            return self._gpu_at(i, now)
        except self._nv.NVMLError as e:
            log.debug("GPU %d%s: no handle this pass: %s", i, _on(self._node), e)
            return None

    def _gpu_at(self, i: int, now: float) -> tuple[Track, str]:
        """GPU i's track (and, if NVML says it is lost before giving a handle, the call that said so)."""
        nv = self._nv
        h = self._handles.get(i)
        if h is not None:
            return self._tracks[self._uuid_at[i]], ""
        try:
            h = nv.nvmlDeviceGetHandleByIndex(i)
            uuid, name = text(nv.nvmlDeviceGetUUID(h)), text(nv.nvmlDeviceGetName(h))
        except nv.NVMLError as e:
            if error_code(e) != nv.NVML_ERROR_GPU_IS_LOST:
                raise
            uuid = self._uuid_at.get(i, f"index:{i}")  # never seen: all NVML tells is its index
            return self._track(uuid, i, now), "nvmlDeviceGetHandleByIndex"
        tr = self._track(uuid, i, now)
        tr.name, tr.handle = name, h
        self._handles[i], self._uuid_at[i] = h, uuid
        self._register(tr)
        return tr, ""

    def _track(self, uuid: str, index: int, now: float) -> Track:
        tr = self._tracks.setdefault(uuid, Track(uuid, index, since=now))
        tr.index = index
        return tr

    def _register(self, tr: Track) -> None:
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
            why = "not supported" if error_code(e) == nv.NVML_ERROR_NOT_SUPPORTED else str(e)
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

    def _assess(self, tr: Track, now: float, lost: str) -> tuple[GpuHealth, State]:
        p = Pass(now, lost=lost) if lost else read(self._nv, tr.handle, tr.uuid, now)
        if p.memory is not None:
            tr.memory = p.memory
        if p.lost:
            tr.latch("gpu_lost", State.FAILING, f"GPU is lost (NVML said so to {p.lost})", now)
        else:
            tr.readings = p.readings
        tr.unsupported = p.unsupported
        evidence = self._judge.evidence(tr, p)
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
            if error_code(e) != nv.NVML_ERROR_TIMEOUT:
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
            self._judge.xid(tr, int(ev.eventData), at)
        if kind & nv.nvmlEventTypeDoubleBitEccError:
            tr.latch("ecc_uncorrected", State.FAILING, "uncorrected (double-bit) ECC error event", at)

    def _track_of(self, device: Any) -> Track | None:
        nv = self._nv
        with contextlib.suppress(nv.NVMLError):
            return self._tracks.get(text(nv.nvmlDeviceGetUUID(device)))
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
