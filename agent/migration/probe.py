"""The path to a target, measured before a large move: a few MiB sent to its agent over the
authenticated connection between the two nodes (ProbePath), timed at the source.

A link that trained down, a congested or misrouted path, shows up here before anything freezes:
a move whose image is estimated above `[verify] probe_above_mib` is refused when the path
carries less than `path_min_mbps`, with the figure and what the move would have taken, and an
automatic move tries another target (agent.health.healing). The probe travels the node-to-node
route the job's memory takes; its rate is gRPC's over TLS, a lower bound of the data path's.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from agent.errors import InvalidArgumentError, RefusedError, TransferError
from agent.gpus.verify import VerifyConfig
from agent.rpc import pb

log = logging.getLogger(__name__)

CHUNK = 1 << 20
#: A probe is not a transfer: a target takes at most this much from one.
MAX_PROBE_BYTES = 256 << 20


@dataclass(frozen=True)
class PathRate:
    bytes: int
    seconds: float

    @property
    def mbps(self) -> float:
        return self.bytes / self.seconds / 1e6 if self.seconds > 0 else float("inf")


def receive_probe(chunks: Iterator[pb.ProbeChunk], node: str) -> pb.ProbeResult:
    """The target's end: count, drop, answer."""
    got, first, last = 0, 0.0, 0.0
    for c in chunks:
        now = time.monotonic()
        first = first or now
        last = now
        got += len(c.data)
        if got > MAX_PROBE_BYTES:
            raise InvalidArgumentError(
                f"a path probe may send at most {MAX_PROBE_BYTES >> 20} MiB", step="path probe", node=node
            )
    return pb.ProbeResult(bytes=got, seconds=last - first)


Send = Callable[[Iterator[pb.ProbeChunk]], "pb.ProbeResult | None"]


def probe(send: Send, n_bytes: int) -> PathRate | None:
    """Send `n_bytes` (incompressible) and time the call to the target's answer; None from a
    target whose agent predates the probe."""
    data = os.urandom(CHUNK)

    def chunks() -> Iterator[pb.ProbeChunk]:
        left = n_bytes
        while left > 0:
            yield pb.ProbeChunk(data=data[: min(left, CHUNK)])
            left -= CHUNK

    began = time.monotonic()
    answer = send(chunks())
    took = time.monotonic() - began
    if answer is None:
        return None
    if answer.bytes != n_bytes:
        raise TransferError(f"the path probe sent {n_bytes} bytes and the target counted {answer.bytes}")
    return PathRate(n_bytes, took)


class PathCheck:
    """A source's check of its path to the target, before a large move's Prepare."""

    def __init__(
        self,
        config: VerifyConfig,
        send: Callable[[str], Send],  # address → its ProbePath
        record: Callable[[str, str, str], None] = lambda kind, message, job: None,  # the event log
    ) -> None:
        self.config = config
        self.send = send
        self.record = record

    def __call__(self, address: str, target: str, job: str, estimated_bytes: int) -> PathRate | None:
        """The path's rate, or None when the move is too small to probe; RefusedError when slow."""
        cfg = self.config
        if estimated_bytes < cfg.probe_above_mib << 20:
            return None
        rate = probe(self.send(address), cfg.probe_mib << 20)
        if rate is None:
            log.warning("the path to %s is not probed: its agent predates the probe", target)
            return None
        if rate.mbps >= cfg.path_min_mbps:
            return rate
        would = estimated_bytes / (rate.mbps * 1e6)
        cause = (
            f"the path to {target} carries {rate.mbps:.1f} MB/s "
            f"({cfg.probe_mib} MiB in {rate.seconds:.2f} s), "
            f"below [verify] path_min_mbps {cfg.path_min_mbps:g}: job {job}'s "
            f"{estimated_bytes / 2**30:.2f} GiB would take {would:.0f} s to cross it"
        )
        self.record("verify", cause, job)
        raise RefusedError(
            cause,
            step="prepare path probe",
            hint="choose another target or fix the link; a lower [verify] path_min_mbps accepts it",
        )
