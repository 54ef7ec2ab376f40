"""The health monitor (agent.health.monitor, reading through agent.health.signals, judging by
agent.health.judging) against scripted NVML telemetry (agent.testing.nvml_replay): no GPU, no sleep.

Each test scripts a Timeline, advances a FakeClock and polls, as the agent's loop
would every interval_s; the monitor makes the same pynvml calls it makes on a
real node.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pynvml
import pytest
from fakes import wait_for

from agent.errors import InvalidArgumentError
from agent.gpus.inventory import Nvml
from agent.health.monitor import HealthMonitor
from agent.health.thresholds import HealthConfig
from agent.health.verdicts import Change, GpuHealth, State
from agent.testing.nvml_replay import FakeClock, ReplayNvml, Step, Timeline, ramp

GPU = "GPU-a0"
GPU2 = "GPU-b1"
HW_SLOWDOWN = pynvml.nvmlClocksEventReasonHwSlowdown
HW_THERMAL = pynvml.nvmlClocksEventReasonHwThermalSlowdown
SW_POWER_CAP = pynvml.nvmlClocksEventReasonSwPowerCap
#: Every per-signal call the monitor makes; a GPU that lacks them all must still poll cleanly.
SIGNAL_CALLS = [
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetRemappedRows",
    "nvmlDeviceGetRetiredPages",
    "nvmlDeviceGetRetiredPagesPendingStatus",
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetCurrentClocksThrottleReasons",
    "nvmlDeviceGetPcieReplayCounter",
    "nvmlDeviceGetCurrPcieLinkWidth",
    "nvmlDeviceGetMaxPcieLinkWidth",
    "nvmlDeviceGetCurrPcieLinkGeneration",
    "nvmlDeviceGetMaxPcieLinkGeneration",
    "nvmlDeviceGetRowRemapperHistogram",
    "nvmlDeviceGetClockInfo",
    "nvmlDeviceGetMaxClockInfo",
    "nvmlDeviceGetNvLinkState",
]


def gpu(uuid: str = GPU, **keys: Any) -> dict[str, Any]:
    return {"uuid": uuid, "name": "NVIDIA H200", **keys}


def world(*gpus: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {"driver_version": "580.65.06", "gpus": list(gpus) or [gpu()], **top}


class Rig:
    """A monitor over a scripted timeline; `at(t)` moves the clock to t and polls."""

    def __init__(
        self,
        steps: Iterable[Step] = (),
        *,
        w: dict[str, Any] | None = None,
        config: HealthConfig | None = None,
    ) -> None:
        self.clock = FakeClock()
        self.nv = ReplayNvml.from_timeline(Timeline(w or world(), steps), self.clock)
        self.polls: list[tuple[list[GpuHealth], list[Change]]] = []
        self.monitor = HealthMonitor(
            self.nv,
            config or HealthConfig(),
            node="nodea",
            clock=self.clock,
            on_poll=lambda snap, changes: self.polls.append((snap, changes)),
        )

    def at(self, t: float, uuid: str = GPU) -> GpuHealth:
        self.clock.now = t
        self.monitor.poll()
        h = self.monitor.get(uuid)
        assert h is not None, f"{uuid} missing from the snapshot at t={t}"
        return h

    def over(self, t0: float, t1: float, every: float = 5.0) -> dict[float, GpuHealth]:
        """Poll every `every` seconds from t0 to t1 inclusive."""
        n = round((t1 - t0) / every)
        return {t0 + k * every: self.at(t0 + k * every) for k in range(n + 1)}

    @property
    def changes(self) -> list[Change]:
        return [c for _, changes in self.polls for c in changes]


def states(seen: dict[float, GpuHealth], lo: float = -math.inf, hi: float = math.inf) -> set[State]:
    return {h.state for t, h in seen.items() if lo <= t <= hi}


def links(*entries: dict[str, Any]) -> dict[str, Any]:
    """NVLink counters for a timeline step (the list replaces the GPU's links)."""
    return {"nvlink": [{"replay": 0, "recovery": 0, "crc_flit": 0, "crc_data": 0, **e} for e in entries]}


# --- temperature ------------------------------------------------------------------------------


def test_slow_temperature_climb_degrades_only_after_the_sustain_and_recovers_below_hysteresis(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # 40 → 90 °C over 100 s: 85 °C is reached at t=90, so the 60 s sustain ends at t=150.
    steps = [
        *ramp(GPU, "temperature", 40, 90, 0, 100, 5),
        (200, GPU, {"temperature": 84}),
        (230, GPU, {"temperature": 79}),
    ]
    rig = Rig(steps)
    with caplog.at_level(logging.INFO, logger="agent.health.monitor"):
        seen = rig.over(0, 260)

    assert seen[145].readings["temperature_c"] == 90
    assert states(seen, hi=145) == {State.HEALTHY}  # below warn, then within the sustain window
    assert states(seen, 150, 225) == {State.DEGRADED}  # 84 °C is within the hysteresis band: holds
    assert states(seen, 230) == {State.HEALTHY}
    (ev,) = seen[150].evidence
    assert (ev.signal, ev.severity, ev.since) == ("temperature", State.DEGRADED, 150)
    assert ev.detail == "temperature 90 °C ≥ 85 °C for 60 s"
    assert seen[200].since == 150 and "clears below 80 °C" in seen[200].evidence[0].detail

    assert [(c.previous, c.gpu.state, c.gpu.sampled_at) for c in rig.changes] == [
        (State.HEALTHY, State.DEGRADED, 150),
        (State.DEGRADED, State.HEALTHY, 230),
    ]
    logged = [r.getMessage() for r in caplog.records if "→" in r.getMessage()]
    assert len(logged) == 2 and "healthy → degraded" in logged[0] and "for 60 s" in logged[0]
    assert "on nodea" in logged[0]


def test_a_climb_that_peaks_below_warn_or_stays_above_it_briefly_changes_nothing() -> None:
    steps = [
        *ramp(GPU, "temperature", 40, 84, 0, 100, 5),
        (150, GPU, {"temperature": 88}),  # 30 s above warn: shorter than the 60 s sustain
        (180, GPU, {"temperature": 70}),
        (200, GPU, {"temperature": 87}),  # and again: the count starts afresh
        (250, GPU, {"temperature": 70}),
    ]
    rig = Rig(steps)
    seen = rig.over(0, 300)
    assert states(seen) == {State.HEALTHY}
    assert rig.changes == []


def test_a_jump_to_critical_degrades_at_once_and_holds_until_below_hysteresis() -> None:
    steps = [(10, GPU, {"temperature": 96}), (20, GPU, {"temperature": 88}), (30, GPU, {"temperature": 79})]
    rig = Rig(steps)
    assert rig.at(5).state is State.HEALTHY
    hot = rig.at(10)
    assert hot.state is State.DEGRADED
    assert hot.evidence[0].detail == "temperature 96 °C ≥ 95 °C (critical)"
    assert rig.at(20).state is State.DEGRADED
    assert rig.at(30).state is State.HEALTHY


# --- ECC --------------------------------------------------------------------------------------


def test_a_burst_of_corrected_ecc_errors_degrades_until_the_window_passes() -> None:
    rig = Rig([(20, GPU, {"ecc_corrected": 12})])
    seen = rig.over(0, 120)
    assert states(seen, hi=15) == {State.HEALTHY}
    assert states(seen, 20, 75) == {State.DEGRADED}
    assert states(seen, 85) == {State.HEALTHY}  # 60 s without a new error
    assert seen[20].evidence[0].detail == "12 corrected ECC errors in 60 s (threshold 10)"
    assert seen[75].evidence[0].since == 20


def test_a_counter_reset_restarts_the_window_instead_of_hiding_a_burst() -> None:
    # 50 → 0 is a reset (driver reload); the 55 counted after it are all new.
    rig = Rig(
        [(10, GPU, {"ecc_corrected": 0}), (20, GPU, {"ecc_corrected": 55})], w=world(gpu(ecc_corrected=50))
    )
    seen = rig.over(0, 20)
    assert states(seen, hi=15) == {State.HEALTHY}
    assert seen[20].evidence[0].detail == "55 corrected ECC errors in 60 s (threshold 10)"


def test_clear_restarts_the_rate_windows_from_the_current_counters() -> None:
    rig = Rig([(20, GPU, {"ecc_corrected": 12}), (40, GPU, {"ecc_corrected": 13})])
    rig.over(0, 30)
    assert rig.at(30).state is State.DEGRADED
    assert rig.monitor.clear(GPU)
    assert rig.at(35).state is State.HEALTHY  # the 12 before the clear no longer count
    assert rig.at(40).state is State.HEALTHY  # one more is no burst


def test_a_slow_trickle_of_corrected_ecc_errors_stays_healthy() -> None:
    rig = Rig(ramp(GPU, "ecc_corrected", 0, 30, 0, 300, 10))  # 6 a minute, under the burst of 10
    seen = rig.over(0, 300)
    assert states(seen) == {State.HEALTHY}
    assert seen[300].readings["ecc_corrected"] == 30


def test_an_uncorrected_ecc_increase_fails_the_gpu_until_cleared() -> None:
    # Events off, so only the counter can tell; 2 errors at start are old news.
    w = world(gpu(ecc_uncorrected=2, unsupported=["nvmlDeviceRegisterEvents"]))
    rig = Rig([(10, GPU, {"ecc_uncorrected": 3}), (20, GPU, {"ecc_uncorrected": 0})], w=w)
    assert rig.at(0).state is State.HEALTHY
    bad = rig.at(10)
    assert bad.state is State.FAILING
    assert bad.evidence[0].signal == "ecc_uncorrected"
    assert bad.evidence[0].detail == "1 uncorrected ECC error(s) (volatile count 3, was 2)"
    assert rig.at(20).state is State.FAILING  # a counter reset does not forgive it
    assert rig.at(100).state is State.FAILING
    assert rig.monitor.clear(GPU)
    assert rig.at(105).state is State.HEALTHY


def test_a_double_bit_ecc_event_alone_fails_the_gpu() -> None:
    w = world(gpu(unsupported=["nvmlDeviceGetTotalEccErrors"]))  # the counter cannot tell: only the event
    rig = Rig([(10, GPU, {"ecc_uncorrected": 1})], w=w)
    assert rig.at(0).state is State.HEALTHY
    bad = rig.at(10)
    assert bad.state is State.FAILING
    assert "event" in bad.evidence[0].detail
    assert "ecc_uncorrected" not in bad.readings and "ecc_corrected" not in bad.readings


# --- row remapping and retired pages ----------------------------------------------------------


def test_remap_pending_degrades_and_remap_failure_fails_while_nvml_says_so() -> None:
    steps = [
        (10, GPU, {"remapped": {"corrected": 2, "pending": True}}),
        (20, GPU, {"remapped": {"pending": False, "failure": True}}),
        (30, GPU, {"remapped": {"failure": False}}),
    ]
    rig = Rig(steps)
    assert rig.at(0).state is State.HEALTHY
    pending = rig.at(10)
    assert pending.state is State.DEGRADED
    assert pending.evidence[0].signal == "remap_pending" and "2 corrected" in pending.evidence[0].detail
    failed = rig.at(20)
    assert failed.state is State.FAILING and failed.evidence[0].signal == "remap_failure"
    assert rig.at(30).state is State.HEALTHY  # a level signal: it holds only while NVML reports it


def test_a_gpu_with_a_bank_out_of_spare_rows_or_a_link_trained_down_is_degraded() -> None:
    """What a spare must not have before it takes a job: no row left to remap in a bank (the next
    failing row is an uncorrectable error), a PCIe link at half its width. A link's generation
    drops at idle (power saving) and is not judged."""
    steps = [
        (10, GPU, {"remap_banks": {"max": 60, "low": 3, "none": 1}}),
        (20, GPU, {"remap_banks": {"none": 0}, "pcie": {"width": 8}}),
        (30, GPU, {"pcie": {"width": 16, "gen": 1}}),
    ]
    rig = Rig(steps)
    assert rig.at(0).state is State.HEALTHY
    rows = rig.at(10)
    assert rows.state is State.DEGRADED and rows.evidence[0].signal == "remap_headroom"
    assert rows.evidence[0].detail.startswith("1 memory bank(s) have no spare rows left")
    link = rig.at(20)
    assert link.state is State.DEGRADED and [e.signal for e in link.evidence] == ["pcie_link"]
    assert "x8 of x16" in link.evidence[0].detail
    idle = rig.at(30)
    assert (
        idle.state is State.HEALTHY and idle.readings["pcie_gen"] == 1 and idle.readings["pcie_gen_max"] == 5
    )


def test_retired_pages_soft_and_hard_limits_and_pending_retirement() -> None:
    steps = [
        (10, GPU, {"retired_pages": {"single_bit": 14}}),
        (20, GPU, {"retired_pages": {"double_bit": 1}}),
        (30, GPU, {"retired_pages": {"double_bit": 49}}),
    ]
    rig = Rig(steps)
    assert rig.at(10).state is State.HEALTHY  # 14 < 15
    soft = rig.at(20)
    assert soft.state is State.DEGRADED and soft.evidence[0].detail == "15 retired pages (threshold 15)"
    hard = rig.at(30)
    assert hard.state is State.FAILING and hard.evidence[0].detail == "63 retired pages (limit 63)"
    assert hard.readings["retired_pages"] == 63

    pending = Rig([(10, GPU, {"retired_pages": {"pending": True}})]).at(10)
    assert pending.state is State.DEGRADED and "pending" in pending.evidence[0].detail


# --- XIDs -------------------------------------------------------------------------------------


def test_xid_79_fails_the_gpu_and_latches_until_cleared() -> None:
    w = world(gpu(), gpu(GPU2))
    rig = Rig([(10, GPU2, {"xid": 79})], w=w)
    rig.at(0)
    bad = rig.at(10, GPU2)
    assert bad.state is State.FAILING
    (ev,) = bad.evidence
    assert (ev.signal, ev.detail, ev.since) == ("xid", "XID 79 (GPU has fallen off the bus)", 10)
    assert rig.monitor.get(GPU).state is State.HEALTHY  # the other GPU is untouched
    assert [h.uuid for h in rig.monitor.snapshot()] == [GPU, GPU2]
    for t in (20, 100, 500):
        assert rig.at(t, GPU2).state is State.FAILING
    assert [(c.gpu.uuid, c.gpu.state) for c in rig.changes] == [(GPU2, State.FAILING)]

    assert rig.monitor.clear(GPU2) is True
    assert rig.monitor.clear("GPU-nope") is False
    assert rig.at(505, GPU2).state is State.HEALTHY
    assert rig.changes[-1].previous is State.FAILING


@pytest.mark.parametrize("xid", [13, 31, 43, 45, 68, 109])
def test_application_xids_are_ignored(xid: int) -> None:
    rig = Rig([(10, GPU, {"xid": xid}), (30, GPU, {"xid": 74})])
    seen = rig.over(0, 25)
    assert states(seen) == {State.HEALTHY}
    assert rig.changes == []
    # The events do flow: a later XID 74 is seen, and it alone is the evidence.
    after = rig.at(30)
    assert after.state is State.DEGRADED
    assert [e.detail for e in after.evidence] == ["XID 74 (NVLink error)"]


def test_other_xids_degrade_and_repeats_are_counted() -> None:
    rig = Rig([(10, GPU, {"xid": 74}), (20, GPU, {"xid": [74, 150]})])
    assert rig.at(10).state is State.DEGRADED
    h = rig.at(20)
    assert h.state is State.DEGRADED
    assert sorted(e.detail for e in h.evidence) == ["XID 150", "XID 74 (NVLink error), 2 times"]
    assert next(e for e in h.evidence if "74" in e.detail).since == 10


def test_without_event_support_xids_go_unseen_and_detail_says_so() -> None:
    rig = Rig([(10, GPU, {"xid": 79})], w=world(gpu(unsupported=["nvmlDeviceRegisterEvents"])))
    assert rig.at(10).state is State.HEALTHY
    assert rig.monitor.available
    assert rig.monitor.detail == f"no XID events on {GPU} (not supported)"
    fresh = Rig().monitor
    assert not fresh.available and fresh.detail == "not polled yet"


# --- clocks, PCIe, NVLink ---------------------------------------------------------------------


def test_sustained_hw_slowdown_degrades_but_a_short_blip_does_not() -> None:
    steps = [
        (10, GPU, {"clocks_event_reasons": HW_SLOWDOWN}),
        (20, GPU, {"clocks_event_reasons": 0}),  # a 10 s blip
        (40, GPU, {"clocks_event_reasons": HW_SLOWDOWN | HW_THERMAL}),
        (120, GPU, {"clocks_event_reasons": 0}),
    ]
    seen = Rig(steps).over(0, 130)
    assert states(seen, hi=65) == {State.HEALTHY}
    assert states(seen, 70, 115) == {State.DEGRADED}
    assert states(seen, 120) == {State.HEALTHY}
    assert (
        seen[70].evidence[0].detail
        == "clocks slowed by HW slowdown, HW thermal slowdown for 30 s (threshold 30 s)"
    )


def test_a_power_cap_is_not_a_hardware_slowdown() -> None:
    seen = Rig([(0, GPU, {"clocks_event_reasons": SW_POWER_CAP})]).over(0, 120)
    assert states(seen) == {State.HEALTHY}


def test_clock_reasons_fall_back_to_the_throttle_call_on_an_older_driver() -> None:
    missing = world(gpu(missing=["nvmlDeviceGetCurrentClocksEventReasons"], clocks_event_reasons=HW_SLOWDOWN))
    seen = Rig(w=missing).over(0, 30)
    assert seen[30].state is State.DEGRADED
    assert seen[30].readings["clocks_event_reasons"] == HW_SLOWDOWN

    neither = gpu(
        missing=["nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"]
    )
    rig = Rig(w=world(neither))
    assert rig.at(0).state is State.HEALTHY
    assert rig.monitor.detail == f"{GPU}: clocks not supported"


def test_pcie_replays_above_the_per_minute_rate_degrade() -> None:
    steps = [(10, GPU, {"pcie_replay": 1005}), (20, GPU, {"pcie_replay": 1012})]
    seen = Rig(steps, w=world(gpu(pcie_replay=1000))).over(0, 20)
    assert states(seen, hi=15) == {State.HEALTHY}  # 1000 at start is history; 5 is under 8
    assert seen[20].state is State.DEGRADED
    assert seen[20].evidence[0].detail == "12 PCIe replays in 20 s (threshold 8 per minute)"


def test_pcie_replays_below_the_rate_stay_healthy() -> None:
    seen = Rig(ramp(GPU, "pcie_replay", 0, 70, 0, 600, 60)).over(0, 600)  # 7 a minute
    assert states(seen) == {State.HEALTHY}


def test_nvlink_crc_rate_and_replay_errors_degrade_naming_the_link() -> None:
    w = world(gpu(**links({}, {}, {"active": False})))
    steps = [
        # link 1: 500 CRC errors a second; link 2 is disabled, so its counters are not read
        (5, GPU, links({}, {"crc_flit": 2000, "crc_data": 500}, {"active": False, "crc_flit": 10**9})),
        (10, GPU, links({}, {"crc_flit": 2000, "crc_data": 500}, {"active": False})),
        (100, GPU, links({"replay": 1}, {"crc_flit": 2000, "crc_data": 500}, {"active": False})),
    ]
    rig = Rig(steps, w=w)
    assert rig.at(0).state is State.HEALTHY
    crc = rig.at(5)
    assert crc.state is State.DEGRADED
    assert [e.detail for e in crc.evidence] == ["NVLink CRC errors link 1 500/s (threshold 100/s)"]
    assert crc.readings["nvlink_links"] == 2 and crc.readings["nvlink_crc"] == 2500
    assert rig.at(70).state is State.HEALTHY  # the window holds no CRC errors any more
    replay = rig.at(100)
    assert replay.state is State.DEGRADED
    assert [e.detail for e in replay.evidence] == [
        "NVLink replay/recovery errors in 60 s: link 0 +1 (threshold 0)"
    ]


def test_a_low_nvlink_crc_rate_stays_healthy() -> None:
    steps = [(t, GPU, links({"crc_data": 50 * t})) for t in range(0, 121, 5)]  # 50 a second
    seen = Rig(steps, w=world(gpu(**links({})))).over(0, 120)
    assert states(seen) == {State.HEALTHY}


# --- lost GPUs, missing signals, no NVML ------------------------------------------------------


def test_a_lost_gpu_fails_and_latches_until_cleared() -> None:
    rig = Rig([(10, GPU, {"lost": True, "xid": 79}), (20, GPU, {"lost": False})])
    assert rig.at(0).state is State.HEALTHY
    lost = rig.at(10)
    assert lost.state is State.FAILING
    assert {e.signal for e in lost.evidence} == {"gpu_lost", "xid"}  # the XID is matched by handle
    assert lost.readings == {}
    still = rig.at(15)
    assert [(e.signal, e.since) for e in still.evidence] == [("gpu_lost", 10), ("xid", 10)]
    assert still.since == 10
    assert rig.at(20).state is State.FAILING  # answers again, but was lost: latched
    assert rig.monitor.clear(GPU)
    assert rig.at(25).state is State.HEALTHY


def test_a_gpu_lost_before_it_could_be_named_shows_by_index() -> None:
    rig = Rig(w=world(gpu(lost=True)))
    rig.clock.now = 0
    (h,) = rig.monitor.poll()
    assert (h.uuid, h.index, h.state) == ("index:0", 0, State.FAILING)
    assert h.evidence[0].detail == "GPU is lost (NVML said so to nvmlDeviceGetHandleByIndex)"


def test_signals_nvml_does_not_support_are_skipped_not_read() -> None:
    hot = gpu(temperature=99, pcie_replay=0, unsupported=SIGNAL_CALLS, **links({}))
    rig = Rig([(10, GPU, {"pcie_replay": 500, "remapped": {"failure": True}})], w=world(hot))
    seen = rig.over(0, 20)
    assert states(seen) == {State.HEALTHY}  # 99 °C, a failed remap, replays: none of it was readable
    assert seen[20].readings == {}
    assert seen[20].memory_total == int(150e9)
    assert (
        rig.monitor.detail
        == f"{GPU}: clocks, ecc_corrected, ecc_uncorrected, pcie_link, pcie_replay, sm_clock, "
        "temperature not supported"
    )


def test_a_read_that_fails_once_keeps_the_last_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig([(0, GPU, {"temperature": 97})])
    assert rig.at(0).state is State.DEGRADED

    def flaky(handle: Any, sensor: int) -> int:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    monkeypatch.setattr(rig.nv, "nvmlDeviceGetTemperature", flaky)
    h = rig.at(5)
    assert h.state is State.DEGRADED and "temperature_c" not in h.readings
    monkeypatch.undo()
    assert rig.at(10).state is State.DEGRADED


def test_nvml_that_cannot_init_is_unavailable_until_it_can() -> None:
    steps = [
        (30, "", {"unavailable": None}),
        (60, "", {"unavailable": "libnvidia-ml.so.1 gone"}),
        (90, "", {"unavailable": None}),
    ]
    rig = Rig(steps, w=world(unavailable="driver not loaded"))
    rig.clock.now = 0
    assert rig.monitor.poll() == []
    assert rig.monitor.available is False
    assert rig.monitor.detail == "NVML unavailable: Driver Not Loaded"
    assert rig.polls == [([], [])]

    assert rig.at(30).state is State.HEALTHY
    assert rig.monitor.available and rig.monitor.detail == ""

    rig.clock.now = 60
    assert rig.monitor.poll() == []
    assert not rig.monitor.available
    assert rig.monitor.detail == "NVML stopped answering: NVML Shared Library Not Found"
    assert rig.at(90).state is State.HEALTHY and rig.monitor.available


# --- configuration ----------------------------------------------------------------------------


def test_health_config_from_dict_takes_overrides() -> None:
    cfg = HealthConfig.from_dict(
        {"temperature_warn_c": 70, "temperature_sustain_s": 0, "hard_xids": [79, 48]}
    )
    assert cfg.temperature_warn_c == 70.0 and isinstance(cfg.temperature_warn_c, float)
    assert cfg.hard_xids == (79, 48)
    assert cfg.interval_s == HealthConfig().interval_s
    assert HealthConfig.from_dict(cfg.as_dict()) == cfg
    assert cfg.as_dict()["hard_xids"] == [79, 48]
    # and the monitor uses them
    assert Rig([(0, GPU, {"temperature": 75})], config=cfg).at(0).state is State.DEGRADED
    assert Rig([(0, GPU, {"temperature": 75})]).at(0).state is State.HEALTHY


def test_health_config_from_dict_rejects_unknown_keys() -> None:
    with pytest.raises(InvalidArgumentError) as e:
        HealthConfig.from_dict({"temperature_warn": 80})
    assert "'temperature_warn'" in str(e.value)
    assert "temperature_warn_c" in e.value.hint and "ignored_xids" in e.value.hint


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("interval_s", 0),
        ("temperature_warn_c", -1),
        ("ecc_window_s", float("nan")),
        ("nvlink_crc_per_s", float("inf")),
        ("pcie_replay_per_min", "8"),
        ("ecc_corrected_burst", 2.5),
        ("retired_pages_soft", True),
        ("hard_xids", [79, "48"]),
        ("ignored_xids", 13),
    ],
)
def test_health_config_from_dict_rejects_bad_values(key: str, value: object) -> None:
    with pytest.raises(InvalidArgumentError) as e:
        HealthConfig.from_dict({key: value})
    assert f"{key} = {value!r}" in str(e.value)


# --- the background loop ----------------------------------------------------------------------


def test_run_polls_every_interval_and_survives_a_failing_pass() -> None:
    calls: list[int] = []

    def on_poll(snapshot: list[GpuHealth], changes: list[Change]) -> None:
        calls.append(len(snapshot))
        if len(calls) == 1:
            raise RuntimeError("a consumer bug")

    clock = FakeClock()
    nv = ReplayNvml.from_timeline(Timeline(world()), clock)
    monitor = HealthMonitor(nv, HealthConfig(interval_s=0.01), clock=clock, on_poll=on_poll)
    stop = threading.Event()
    t = threading.Thread(target=monitor.run, args=(stop,), daemon=True)
    t.start()
    wait_for(lambda: len(calls) >= 3, what="three passes")
    stop.set()
    t.join(2)
    assert not t.is_alive()
    assert calls[:3] == [1, 1, 1]
    monitor.close()


def test_run_polls_at_once_on_an_xid_and_honours_stop(tmp_path: Path) -> None:
    path = tmp_path / "world.json"
    write(path, world())
    changes: list[Change] = []
    monitor = HealthMonitor(
        ReplayNvml.from_file(path), HealthConfig(interval_s=60), on_poll=lambda s, c: changes.extend(c)
    )
    stop = threading.Event()
    t = threading.Thread(target=monitor.run, args=(stop,), daemon=True)
    t.start()
    wait_for(lambda: monitor.get(GPU) is not None, what="the first pass")
    write(path, world(gpu(xids=[79])))
    wait_for(lambda: bool(changes), timeout_s=3, what="a pass woken by the XID")  # not 60 s later
    assert changes[0].gpu.state is State.FAILING
    started = time.monotonic()
    stop.set()
    t.join(3)
    assert not t.is_alive() and time.monotonic() - started < 2
    monitor.close()


# --- ReplayNvml itself ------------------------------------------------------------------------


def write(path: Path, w: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(w))
    os.replace(tmp, path)


def test_replay_from_file_picks_up_rewrites_and_delivers_each_xid_once(tmp_path: Path) -> None:
    path = tmp_path / "world.json"
    write(path, world(gpu(temperature=40)))
    nv = ReplayNvml.from_file(path)
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    es = nv.nvmlEventSetCreate()
    nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, es)
    assert nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU) == 40

    write(path, world(gpu(temperature=77, xids=[79])))
    assert nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU) == 77
    ev = nv.nvmlEventSetWait_v2(es, 1000)
    assert (ev.device, ev.eventType, ev.eventData) == (h, nv.nvmlEventTypeXidCriticalError, 79)
    with pytest.raises(nv.NVMLError) as e:
        nv.nvmlEventSetWait_v2(es, 0)
    assert e.value.value == nv.NVML_ERROR_TIMEOUT

    path.write_text('{"gpus": [')  # half-written: the last good world stays
    assert nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU) == 77
    write(path, world(gpu(xids=[79, 48])))
    assert nv.nvmlEventSetWait(es, 1000).eventData == 48
    started = time.monotonic()
    with pytest.raises(pynvml.NVMLError_Timeout):
        nv.nvmlEventSetWait_v2(es, 120)  # really waits in file mode
    assert time.monotonic() - started >= 0.1
    nv.nvmlEventSetFree(es)
    nv.nvmlShutdown()


def test_replay_answers_like_nvml() -> None:
    w = world(gpu(memory_used=1 << 30, processes=[{"pid": 123, "used_bytes": 1 << 30}], **links({})))
    nv = ReplayNvml.from_timeline(Timeline(w), FakeClock())
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nv.nvmlDeviceGetCount()
    inv = Nvml(nv).inventory()  # the inventory code, unchanged, reads it
    assert inv.available and inv.driver_version == "580.65.06"
    (g,) = inv.gpus
    assert (g.uuid, g.name, g.memory_free, g.mig) == (GPU, "NVIDIA H200", int(150e9) - (1 << 30), False)
    assert [(p.pid, p.used_bytes) for p in g.processes] == [(123, 1 << 30)]

    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByUUID(GPU)
    assert h is nv.nvmlDeviceGetHandleByIndex(0) and nv.nvmlDeviceGetIndex(h) == 0
    assert nv.nvmlDeviceGetRemappedRows(h) == (0, 0, 0, 0)
    assert nv.nvmlDeviceGetNvLinkState(h, 0) == nv.NVML_FEATURE_ENABLED
    for link, code in (
        (1, nv.NVML_ERROR_NOT_SUPPORTED),
        (nv.NVML_NVLINK_MAX_LINKS, nv.NVML_ERROR_INVALID_ARGUMENT),
    ):
        with pytest.raises(nv.NVMLError) as e:
            nv.nvmlDeviceGetNvLinkState(h, link)
        assert e.value.value == code
    nv.nvmlShutdown()
    with pytest.raises(nv.NVMLError) as e:
        nv.nvmlShutdown()
    assert e.value.value == nv.NVML_ERROR_UNINITIALIZED


def test_replay_events_come_only_for_registered_types() -> None:
    clock = FakeClock()
    steps = [(10, GPU, {"xid": 79, "ecc_uncorrected": 1}), (20, GPU, {"retired_pages": {"double_bit": 2}})]
    nv = ReplayNvml.from_timeline(Timeline(world(), steps), clock)
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    es = nv.nvmlEventSetCreate()
    nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeDoubleBitEccError, es)
    clock.advance(20)
    assert nv.nvmlEventSetWait_v2(es, 0).eventType == nv.nvmlEventTypeDoubleBitEccError  # the XID is not
    with pytest.raises(pynvml.NVMLError_Timeout):
        nv.nvmlEventSetWait_v2(es, 0)
    assert nv.nvmlDeviceGetRetiredPages(h, nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR) == [
        0x2000_0000,
        0x2000_1000,
    ]
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeAll, es)  # as NVML: a mask with unsupported types


#: The calls ReplayNvml must answer: what agent.gpus.inventory and agent.health (signals, monitor) use.
REPLAYED_CALLS = {
    "nvmlInit",
    "nvmlShutdown",
    "nvmlSystemGetDriverVersion",
    "nvmlDeviceGetCount",
    "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetHandleByUUID",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetName",
    "nvmlDeviceGetIndex",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetMigMode",
    "nvmlDeviceGetPersistenceMode",
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetMPSComputeRunningProcesses",
    *SIGNAL_CALLS,
    "nvmlDeviceGetNvLinkErrorCounter",
    "nvmlDeviceGetSupportedEventTypes",
    "nvmlEventSetCreate",
    "nvmlDeviceRegisterEvents",
    "nvmlEventSetWait_v2",
    "nvmlEventSetWait",
    "nvmlEventSetFree",
}


def test_replay_call_signatures_match_pynvml() -> None:
    names = {
        n for n in dir(ReplayNvml) if n.startswith("nvml") and inspect.isfunction(getattr(ReplayNvml, n))
    }
    assert names >= REPLAYED_CALLS
    replay = ReplayNvml(dict)
    for name in names:
        ours = [(p.name, p.default) for p in inspect.signature(getattr(replay, name)).parameters.values()]
        theirs = [(p.name, p.default) for p in inspect.signature(getattr(pynvml, name)).parameters.values()]
        assert ours == theirs, name
    assert ReplayNvml.NVMLError is pynvml.NVMLError
    assert replay.NVML_ERROR_GPU_IS_LOST == pynvml.NVML_ERROR_GPU_IS_LOST
    assert replay.nvmlClocksThrottleReasonHwSlowdown == pynvml.nvmlClocksThrottleReasonHwSlowdown


def test_timeline_refuses_a_step_for_an_unknown_gpu() -> None:
    with pytest.raises(ValueError, match="GPU-zz"):
        Timeline(world(), [(1, "GPU-zz", {"temperature": 50})])
