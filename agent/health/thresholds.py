"""The thresholds and windows the health monitor judges by (`HealthConfig`), which the agent's
config file overrides in its [health] table (docs/health.md lists them with their meaning)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from agent.settings import from_table


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
