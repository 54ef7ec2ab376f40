"""What the health monitor says about a GPU: its state (HEALTHY, DEGRADED, FAILING), the evidence
behind it, the published per-GPU verdict (`GpuHealth`) and a change of state (`Change`).

These are what the rest of the agent reads (the self-healing policy, the RPCs, `ferry health`);
how the monitor reaches them lives in agent.health.signals, agent.health.judging and
agent.health.monitor.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.compat import StrEnum


class State(StrEnum):
    HEALTHY = "healthy"
    DEGRADED = "degraded"
    FAILING = "failing"

    @property
    def rank(self) -> int:
        """0, 1, 2: worse states compare higher."""
        return list(State).index(self)


@dataclass(frozen=True)
class Evidence:
    signal: str  # "temperature", "ecc_corrected", "xid", "gpu_lost", ... (see agent.health.judging)
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
