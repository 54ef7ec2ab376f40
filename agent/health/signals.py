"""Reading one GPU's health signals from NVML in one pass: which calls answer each signal
(temperature, ECC, row remapping and its spare rows left, retired pages, clock event reasons,
PCIe replays and the link's width, NVLink errors), what they answered (`Pass`), and which
signals the GPU lacks or failed to give.

Nothing here judges: agent.health.judging turns a `Pass` into evidence. `nv` is the pynvml
module or anything shaped like it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class Pass:
    """What one pass read from one GPU."""

    now: float
    readings: dict[str, float] = field(default_factory=dict)
    links: dict[int, dict[str, int]] = field(default_factory=dict)  # active NVLink → its error counters
    unsupported: set[str] = field(default_factory=set)  # signals NVML says this GPU lacks
    failed: set[str] = field(default_factory=set)  # signals that failed to read this pass
    lost: str = ""  # the call that answered GPU_IS_LOST
    memory: tuple[int, int, int] | None = None  # total, used, free; None when it did not answer


class GpuLost(Exception):
    """An NVML call answered GPU_IS_LOST: nothing more can be read from this GPU this pass."""

    def __init__(self, call: str) -> None:
        super().__init__(call)
        self.call = call


def read(nv: Any, handle: Any, uuid: str, now: float) -> Pass:
    """Every health signal of the GPU behind `handle`; a lost GPU ends the pass (`Pass.lost`)."""
    r = _Reader(nv, handle, uuid, Pass(now))
    try:
        r.counters()
        r.nvlink()
    except GpuLost as e:
        r.p.lost = e.call
    return r.p


def error_code(e: BaseException) -> Any:
    """An NVMLError's code (None for anything else)."""
    return getattr(e, "value", None)


def text(v: Any) -> str:
    """pynvml answers bytes or str depending on its version."""
    return v.decode() if isinstance(v, bytes) else str(v)


class _Reader:
    """One pass over one GPU: each call records its value in `p`, or why it gave none."""

    def __init__(self, nv: Any, handle: Any, uuid: str, p: Pass) -> None:
        self.nv, self.handle, self.uuid, self.p = nv, handle, uuid, p

    def ask(self, group: str, names: str | tuple[str, ...], *args: Any) -> Any:
        """One NVML call for one signal group; None (and why, in p) when it gave no value.

        With several names, the next is tried when a call is missing from pynvml or the driver."""
        nv, p = self.nv, self.p
        for name in (names,) if isinstance(names, str) else names:
            fn = getattr(nv, name, None)
            if fn is None:
                continue
            try:
                return fn(self.handle, *args)
            except nv.NVMLError as e:
                code = error_code(e)
                if code == nv.NVML_ERROR_FUNCTION_NOT_FOUND:
                    continue
                if code == nv.NVML_ERROR_GPU_IS_LOST:
                    raise GpuLost(name) from e
                if code == nv.NVML_ERROR_NOT_SUPPORTED:
                    p.unsupported.add(group)
                else:
                    log.debug("GPU %s: %s failed: %s; %s skipped this pass", self.uuid, name, e, group)
                    p.failed.add(group)
                return None
        p.unsupported.add(group)
        return None

    def counters(self) -> None:
        nv, r = self.nv, self.p.readings
        mem = self.ask("memory", "nvmlDeviceGetMemoryInfo")
        if mem is not None:
            self.p.memory = (int(mem.total), int(mem.used), int(mem.free))
        _put(r, "temperature_c", self.ask("temperature", "nvmlDeviceGetTemperature", nv.NVML_TEMPERATURE_GPU))
        for key, kind in (
            ("ecc_corrected", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED),
            ("ecc_uncorrected", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
        ):
            _put(r, key, self.ask(key, "nvmlDeviceGetTotalEccErrors", kind, nv.NVML_VOLATILE_ECC))
        self.retirement()
        clocks = ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons")
        _put(r, "clocks_event_reasons", self.ask("clocks", clocks))
        # The SM clock against its maximum: how fast the GPU computes now (a straggler's pace).
        _put(r, "sm_clock_mhz", self.ask("sm_clock", "nvmlDeviceGetClockInfo", nv.NVML_CLOCK_SM))
        _put(r, "sm_clock_max_mhz", self.ask("sm_clock", "nvmlDeviceGetMaxClockInfo", nv.NVML_CLOCK_SM))
        _put(r, "pcie_replay", self.ask("pcie_replay", "nvmlDeviceGetPcieReplayCounter"))
        # The width a link trained to stays; its generation drops when the GPU idles (power
        # saving), so it is read for the record and only the width is judged.
        for key, call in (
            ("pcie_width", "nvmlDeviceGetCurrPcieLinkWidth"),
            ("pcie_width_max", "nvmlDeviceGetMaxPcieLinkWidth"),
            ("pcie_gen", "nvmlDeviceGetCurrPcieLinkGeneration"),
            ("pcie_gen_max", "nvmlDeviceGetMaxPcieLinkGeneration"),
        ):
            _put(r, key, self.ask("pcie_link", call))

    def retirement(self) -> None:
        """Row remapping (A100 and newer) and page retirement (older GPUs): each GPU has one of the two."""
        nv, r = self.nv, self.p.readings
        remap = self.ask("remap", "nvmlDeviceGetRemappedRows")
        if remap is not None:
            corrected, uncorrected, pending, failure = remap
            r["remapped_corrected"], r["remapped_uncorrected"] = float(corrected), float(uncorrected)
            r["remap_pending"], r["remap_failure"] = float(bool(pending)), float(bool(failure))
        # Spare rows left per memory bank: a bank with none cannot remap its next failing row.
        left = self.ask("remap", "nvmlDeviceGetRowRemapperHistogram")
        if left is not None:
            r["remap_banks_none"], r["remap_banks_low"] = float(left.none), float(left.low)
        causes = (
            nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
            nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
        )
        pages = [self.ask("retired_pages", "nvmlDeviceGetRetiredPages", c) for c in causes]
        if all(x is not None for x in pages):
            r["retired_pages"] = float(sum(len(x) for x in pages))
        retiring = self.ask("retired_pages", "nvmlDeviceGetRetiredPagesPendingStatus")
        _put(r, "retired_pages_pending", None if retiring is None else bool(retiring))

    def nvlink(self) -> None:
        nv, p = self.nv, self.p
        counters = {
            "replay": nv.NVML_NVLINK_ERROR_DL_REPLAY,
            "recovery": nv.NVML_NVLINK_ERROR_DL_RECOVERY,
            "crc_flit": nv.NVML_NVLINK_ERROR_DL_CRC_FLIT,
            "crc_data": nv.NVML_NVLINK_ERROR_DL_CRC_DATA,
        }
        for link in range(nv.NVML_NVLINK_MAX_LINKS):
            try:
                state = nv.nvmlDeviceGetNvLinkState(self.handle, link)
            except nv.NVMLError as e:
                if error_code(e) == nv.NVML_ERROR_GPU_IS_LOST:
                    raise GpuLost("nvmlDeviceGetNvLinkState") from e
                if error_code(e) not in (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_INVALID_ARGUMENT):
                    log.debug("GPU %s: NVLink %d state failed: %s", self.uuid, link, e)
                    p.failed.add("nvlink")
                break  # past the last link, or no NVLink at all
            if state != nv.NVML_FEATURE_ENABLED:
                continue
            counts = {
                name: self.ask("nvlink", "nvmlDeviceGetNvLinkErrorCounter", link, c)
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


def _put(r: dict[str, float], key: str, v: Any) -> None:
    if v is not None:
        r[key] = float(v)
