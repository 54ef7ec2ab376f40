"""Judging a GPU from what NVML answered: the rules that turn a pass's readings and NVML's XID and
ECC events into evidence (DEGRADED or FAILING, with the numbers and the threshold), and what is
remembered per GPU between passes to judge rates, sustains and latches (`Track`).

Rates come from counter samples kept in a window per GPU (a counter that goes down was reset, so
its window restarts); events and uncorrected errors latch until an operator clears the GPU. The
thresholds are agent.health.thresholds.HealthConfig.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from agent.health.signals import Pass
from agent.health.thresholds import HealthConfig
from agent.health.verdicts import Evidence, State

log = logging.getLogger(__name__)

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
_PCIE_WINDOW_S = 60.0  # PCIe replays are judged per minute, as DCGM does


def brakes(nv: Any, reasons: int) -> list[str]:
    """The clock-event reasons in `reasons` that mean the hardware is slowing itself, in words."""
    return [text for name, text in _BRAKES if reasons & getattr(nv, "nvmlClocksEventReason" + name, 0)]


class Finding(NamedTuple):
    """One condition that holds in this pass; `key` tells it apart from others of its signal."""

    key: str
    signal: str
    severity: State
    detail: str


@dataclass
class Series:
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
class Track:
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
    series: dict[str, Series] = field(default_factory=dict)
    findings: dict[str, list[Finding]] = field(default_factory=dict)  # by signal group, last pass read
    latched: dict[str, Evidence] = field(default_factory=dict)  # XIDs, uncorrected ECC, lost
    xid_counts: dict[int, int] = field(default_factory=dict)
    seen: dict[str, float] = field(default_factory=dict)  # finding key → first seen
    ecc_base: float | None = None  # uncorrected count that is not news
    hot: bool = False
    hot_since: float | None = None
    throttle_since: float | None = None

    def sample(self, key: str, window_s: float, t: float, v: float) -> Series:
        """Record a counter reading in its window; the window then answers increase and span."""
        s = self.series.setdefault(key, Series(window_s))
        s.add(t, v)
        return s

    def latch(self, signal: str, severity: State, detail: str, at: float) -> None:
        """Evidence that holds until clear(); the first sighting's words and time stay."""
        self.latched.setdefault(signal, Evidence(signal, severity, detail, at))

    def clear(self) -> None:
        """Forget what latched and count afresh from the latest readings on (an operator's word)."""
        self.latched.clear()
        self.xid_counts.clear()
        self.findings.clear()
        self.seen.clear()
        self.hot, self.hot_since, self.throttle_since = False, None, None
        self.ecc_base = self.readings.get("ecc_uncorrected")
        for s in self.series.values():
            s.restart()


class Judge:
    """The rules, one per signal group, under one HealthConfig; `nv` names the clock-reason bits."""

    def __init__(self, config: HealthConfig, nv: Any) -> None:
        self.config = config
        self._nv = nv

    def evidence(self, tr: Track, p: Pass) -> tuple[Evidence, ...]:
        """This pass's findings and everything latched, worst and oldest first."""
        if not p.lost:  # a lost GPU answers nothing: only what latched speaks for it
            for group, judge in self._judges().items():
                if group not in p.failed:  # a read that failed keeps the last verdict rather than clear it
                    tr.findings[group] = judge(tr, p)
        current = [f for fs in tr.findings.values() for f in fs] if not p.lost else []
        tr.seen = {f.key: tr.seen.get(f.key, p.now) for f in current}
        out = [Evidence(f.signal, f.severity, f.detail, tr.seen[f.key]) for f in current]
        out += tr.latched.values()
        return tuple(sorted(out, key=lambda e: (-e.severity.rank, e.since, e.signal)))

    def xid(self, tr: Track, xid: int, at: float) -> None:
        """An XID event: latched (counted when it repeats) unless it is an application's error."""
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

    def _judges(self) -> dict[str, Callable[[Track, Pass], list[Finding]]]:
        return {
            "temperature": self._temperature,
            "ecc_corrected": self._ecc_corrected,
            "ecc_uncorrected": self._ecc_uncorrected,
            "remap": self._remap,
            "retired_pages": self._retired_pages,
            "clocks": self._clocks,
            "pcie_replay": self._pcie,
            "pcie_link": self._pcie_link,
            "nvlink": self._nvlink,
        }

    def _temperature(self, tr: Track, p: Pass) -> list[Finding]:
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
        return [Finding("temperature", "temperature", State.DEGRADED, detail)]

    def _ecc_corrected(self, tr: Track, p: Pass) -> list[Finding]:
        v = p.readings.get("ecc_corrected")
        if v is None:
            return []
        c = self.config
        n = tr.sample("ecc_corrected", c.ecc_window_s, p.now, v).increase()
        if n <= 0 or n < c.ecc_corrected_burst:
            return []
        detail = f"{n:g} corrected ECC errors in {c.ecc_window_s:g} s (threshold {c.ecc_corrected_burst})"
        return [Finding("ecc_corrected", "ecc_corrected", State.DEGRADED, detail)]

    def _ecc_uncorrected(self, tr: Track, p: Pass) -> list[Finding]:
        v = p.readings.get("ecc_uncorrected")
        if v is None:
            return []
        if tr.ecc_base is None or v < tr.ecc_base:
            tr.ecc_base = v  # the first reading (or one after a counter reset) is old news
        elif v > tr.ecc_base:
            detail = (
                f"{v - tr.ecc_base:g} uncorrected ECC error(s) (volatile count {v:g}, was {tr.ecc_base:g})"
            )
            tr.latch("ecc_uncorrected", State.FAILING, detail, p.now)
        return []  # it latches: see tr.latched

    def _remap(self, tr: Track, p: Pass) -> list[Finding]:
        r = p.readings
        if "remap_pending" not in r:
            return []
        rows = (
            f"{r['remapped_corrected']:g} corrected, {r['remapped_uncorrected']:g} uncorrected rows remapped"
        )
        out = []
        if r["remap_failure"]:
            out.append(
                Finding("remap_failure", "remap_failure", State.FAILING, f"row remapping failed ({rows})")
            )
        if r["remap_pending"]:
            detail = f"row remapping pending: a GPU reset applies it ({rows})"
            out.append(Finding("remap_pending", "remap_pending", State.DEGRADED, detail))
        if (none := r.get("remap_banks_none", 0.0)) > 0:
            detail = (
                f"{none:g} memory bank(s) have no spare rows left: their next failing row cannot be remapped"
            )
            out.append(Finding("remap_headroom", "remap_headroom", State.DEGRADED, detail))
        return out

    def _pcie_link(self, tr: Track, p: Pass) -> list[Finding]:
        r = p.readings
        width, best = r.get("pcie_width"), r.get("pcie_width_max")
        if width is None or best is None or width >= best:
            return []
        detail = f"PCIe link trained down to x{width:g} of x{best:g} (a reseat, a riser or the slot)"
        return [Finding("pcie_link", "pcie_link", State.DEGRADED, detail)]

    def _retired_pages(self, tr: Track, p: Pass) -> list[Finding]:
        c, out = self.config, []
        n = p.readings.get("retired_pages")
        if n is not None and n >= c.retired_pages_hard:
            detail = f"{n:g} retired pages (limit {c.retired_pages_hard})"
            out.append(Finding("retired_pages", "retired_pages", State.FAILING, detail))
        elif n is not None and n >= c.retired_pages_soft:
            detail = f"{n:g} retired pages (threshold {c.retired_pages_soft})"
            out.append(Finding("retired_pages", "retired_pages", State.DEGRADED, detail))
        if p.readings.get("retired_pages_pending"):
            detail = "page retirement pending: a GPU reset applies it"
            out.append(Finding("retired_pages_pending", "retired_pages", State.DEGRADED, detail))
        return out

    def _clocks(self, tr: Track, p: Pass) -> list[Finding]:
        v = p.readings.get("clocks_event_reasons")
        if v is None:
            return []
        active = brakes(self._nv, int(v))
        if not active:
            tr.throttle_since = None
            return []
        tr.throttle_since = p.now if tr.throttle_since is None else tr.throttle_since
        held, need = p.now - tr.throttle_since, self.config.throttle_sustain_s
        if held < need:
            return []
        detail = f"clocks slowed by {', '.join(active)} for {held:.0f} s (threshold {need:g} s)"
        return [Finding("clocks", "clocks", State.DEGRADED, detail)]

    def _pcie(self, tr: Track, p: Pass) -> list[Finding]:
        v = p.readings.get("pcie_replay")
        if v is None:
            return []
        s = tr.sample("pcie_replay", _PCIE_WINDOW_S, p.now, v)
        # Counted over the last minute, not extrapolated: one replay early on is not "12 a minute".
        n, limit = s.increase(), self.config.pcie_replay_per_min
        if n <= limit:
            return []
        detail = f"{n:g} PCIe replays in {s.span():.0f} s (threshold {limit:g} per minute)"
        return [Finding("pcie_replay", "pcie_replay", State.DEGRADED, detail)]

    def _nvlink(self, tr: Track, p: Pass) -> list[Finding]:
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
            out.append(Finding("nvlink_errors", "nvlink", State.DEGRADED, detail))
        if crc:
            detail = f"NVLink CRC errors {', '.join(crc)} (threshold {c.nvlink_crc_per_s:g}/s)"
            out.append(Finding("nvlink_crc", "nvlink", State.DEGRADED, detail))
        return out
