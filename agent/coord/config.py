"""`[coordination]` in the agent's config: the etcd cluster agents agree through, and the
timings that order fencing before recovery (docs/recovery.md has the why of each).

    [coordination]
    endpoints = ["10.0.0.9:2379"]   # etcd's client URLs, host:port (mutual TLS, the cluster CA)
    lease_ttl_s = 5                 # this node is alive while its lease is
    fence_margin_s = 1.5            # members are fenced this long before the lease can expire

Without endpoints nothing is coordinated: planned moves work, automatic recovery does not.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.errors import InvalidArgumentError
from agent.jobs.fence import STOP_WAIT_S

#: etcd refuses a TTL under its minimum (1.5 times the election timeout: 2 s at its defaults).
MIN_TTL_S = 2
#: What fencing may take beyond stopping the threads: the record's fsync and `ip` cutting a link.
FENCE_WORK_S = 0.5
#: The least fence margin: stopping a member's threads and the rest of the fencing.
MIN_FENCE_MARGIN_S = STOP_WAIT_S + FENCE_WORK_S
#: The span from a renewal to the fencing deadline holds this many renewal periods.
RENEWALS_BEFORE_FENCING = 2.5
#: Renewals no more often than this: each is a call to etcd, and a slower one would fence.
MIN_RENEW_S = 0.25


@dataclass(frozen=True)
class CoordConfig:
    endpoints: tuple[str, ...] = ()
    prefix: str = "/ferry/"
    lease_ttl_s: int = 5
    fence_margin_s: float = 1.5

    @property
    def enabled(self) -> bool:
        return bool(self.endpoints)

    @property
    def renew_every_s(self) -> float:
        """At most three tries per TTL, and often enough that one lost renewal never fences:
        two fit between one that landed and the fencing deadline, with a fifth of that span
        left for the second one's round trip."""
        return min(self.lease_ttl_s / 3, (self.lease_ttl_s - self.fence_margin_s) / RENEWALS_BEFORE_FENCING)

    def check(self) -> CoordConfig:
        """Refuse timings in the wrong order, naming the key: fencing must end before the lease
        can expire, and must not start while a renewal is merely late."""
        if not self.enabled:
            return self
        if self.lease_ttl_s < MIN_TTL_S:
            raise InvalidArgumentError(
                f"[coordination] lease_ttl_s = {self.lease_ttl_s} is below etcd's minimum, {MIN_TTL_S} s"
            )
        need = MIN_FENCE_MARGIN_S
        if self.fence_margin_s < need:
            raise InvalidArgumentError(
                f"[coordination] fence_margin_s = {self.fence_margin_s:g} does not cover fencing "
                f"({need:g} s)",
                hint=f"set it to at least {need:g}",
            )
        if self.renew_every_s < MIN_RENEW_S:
            raise InvalidArgumentError(
                f"[coordination] fence_margin_s = {self.fence_margin_s:g} leaves "
                f"{max(self.lease_ttl_s - self.fence_margin_s, 0):g} s of a {self.lease_ttl_s} s lease "
                f"before fencing: less than two renewals {MIN_RENEW_S:g} s apart",
                hint="raise lease_ttl_s or lower fence_margin_s",
            )
        from agent.client import split_address

        for e in self.endpoints:
            try:
                split_address(e)
            except InvalidArgumentError:
                raise InvalidArgumentError(f"[coordination] endpoint {e!r} is not HOST:PORT") from None
        if not self.prefix.startswith("/") or not self.prefix.endswith("/"):
            raise InvalidArgumentError(f"[coordination] prefix {self.prefix!r} must start and end with '/'")
        return self
