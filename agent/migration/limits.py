"""How long a member of a distributed job may stay frozen, and whether a move fits.

A frozen rank's peers wait in their collective; past some limit they give up on it and the
job fails, which is worse than not moving it. The limits (docs/distributed.md has where each
comes from in the installed torch, and what happens past it):

- the process group's collective timeout: 30 min for gloo by default (`init_process_group`'s
  `timeout`); the job states a smaller one with `ferry run --max-pause`;
- TCP retransmission: a peer whose bytes to the frozen rank go unacknowledged drops the
  connection after `net.ipv4.tcp_retries2` backed-off retransmissions (15: about 924.6 s);
- a torchrun agent's c10d rendezvous keep-alive, for a member that is a torchrun agent: other
  agents drop a node whose heartbeat is older than keep_alive_interval * keep_alive_max_attempt
  (5 s * 3). The drop is silent (the job goes on) but the node's membership is gone: the next
  rendezvous, after any worker failure, ends the job. And if the frozen node hosts the
  rendezvous store, the others' store reads fail after its read_timeout (60 s) and the job ends.

The expected frozen time is the image's estimated size over the slowest rate this agent has
seen its recent moves freeze at (a conservative default before it has seen any), plus a fixed
cost. A move is refused, before anything freezes, when that exceeds the tightest limit.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from agent.durable import replace_file
from agent.errors import RefusedError
from agent.jobs.record import JobRecord, env_of

log = logging.getLogger(__name__)

#: torch.distributed's default process-group timeout for gloo (datetime.timedelta(minutes=30)).
GLOO_TIMEOUT_S = 1800.0
#: What a move costs besides copying the image: the freeze, CRIU's own work, the restore.
FIXED_COST_S = 3.0
#: The freeze rate assumed before this agent has measured any (bytes a second; low on purpose).
DEFAULT_RATE_BPS = 50e6
#: How many recent moves the rate is judged from.
KEEP_RATES = 20
#: torchrun's c10d defaults (torch/distributed/elastic/rendezvous: dynamic_rendezvous.py, and
#: c10d_rendezvous_backend.py for read_timeout), overridden by its --rdzv-conf.
RDZV_DEFAULTS = {"keep_alive_interval": 5.0, "keep_alive_max_attempt": 3.0, "read_timeout": 60.0}
#: Linux's retransmission timer bounds (include/net/tcp.h): TCP_RTO_MIN 200 ms, TCP_RTO_MAX 120 s.
_RTO_MIN_S, _RTO_MAX_S = 0.2, 120.0


@dataclass(frozen=True)
class Limit:
    what: str
    seconds: float


def tcp_give_up_s(retries2: int) -> float:
    """How long an established connection with unacknowledged data survives: retries2
    retransmissions, the timer doubling from TCP_RTO_MIN up to TCP_RTO_MAX (15: 924.6 s)."""
    total, rto = 0.0, _RTO_MIN_S
    for _ in range(retries2 + 1):
        total += rto
        rto = min(rto * 2, _RTO_MAX_S)
    return total


def read_tcp_retries2(path: str = "/proc/sys/net/ipv4/tcp_retries2") -> int:
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return 15  # the kernel's default


def is_distributed(rec: JobRecord) -> bool:
    """A member of a multi-process training job: labelled with a group, started with
    WORLD_SIZE > 1, or a torchrun agent of a multi-node job."""
    if rec.group:
        return True
    env = env_of(rec)
    if env.get("WORLD_SIZE", "1").isdigit() and int(env.get("WORLD_SIZE", "1")) > 1:
        return True
    return torchrun_nnodes(rec.command) > 1


def torchrun_nnodes(command: list[str]) -> int:
    """The node count a torchrun command asks for (its maximum for a range), 0 if not torchrun."""
    if not any(a.endswith("torchrun") or a == "torch.distributed.run" for a in command):
        return 0
    for i, arg in enumerate(command):
        m = re.match(r"^--nnodes(?:=(.+))?$", arg)
        if m:
            value = m[1] if m[1] is not None else (command[i + 1] if i + 1 < len(command) else "")
            return int(value.split(":")[-1]) if value.split(":")[-1].isdigit() else 1
    return 1


def rdzv_conf(command: list[str]) -> dict[str, float]:
    """torchrun's --rdzv-conf / --rdzv_conf keys that bound a frozen agent, with their defaults."""
    out = dict(RDZV_DEFAULTS)
    for i, arg in enumerate(command):
        m = re.match(r"^--rdzv[-_]conf(?:=(.*))?$", arg)
        if not m:
            continue
        value = m[1] if m[1] is not None else (command[i + 1] if i + 1 < len(command) else "")
        for item in value.split(","):
            key, _, v = item.partition("=")
            try:
                if key.strip() in out:
                    out[key.strip()] = float(v)
            except ValueError:
                pass  # torchrun itself refuses it at start
    return out


def pause_limits(rec: JobRecord, tcp_retries2: int | None = None) -> list[Limit]:
    """What ends a frozen member's membership, tightest first ([] for a job that is no member)."""
    if not is_distributed(rec):
        return []
    retries = read_tcp_retries2() if tcp_retries2 is None else tcp_retries2
    out = [
        Limit("gloo's collective timeout (torch.distributed default)", GLOO_TIMEOUT_S),
        Limit(f"TCP retransmission (tcp_retries2 = {retries})", tcp_give_up_s(retries)),
    ]
    if torchrun_nnodes(rec.command) > 1:
        conf = rdzv_conf(rec.command)
        keep = conf["keep_alive_interval"] * conf["keep_alive_max_attempt"]
        out.append(Limit("torchrun's c10d keep-alive (keep_alive_interval * keep_alive_max_attempt)", keep))
        out.append(
            Limit(
                "torchrun's rendezvous store read_timeout (if this node hosts the store)",
                conf["read_timeout"],
            )
        )
    if rec.max_pause_s > 0:
        out.append(Limit("the job's --max-pause", rec.max_pause_s))
    return sorted(out, key=lambda lim: lim.seconds)


class RateLog:
    """The freeze rates (image bytes over frozen seconds) of this agent's recent moves, on disk."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "freeze-rates.json"
        self._lock = threading.Lock()

    def record(self, image_bytes: int, frozen_s: float) -> None:
        if image_bytes <= 0 or frozen_s <= 0:
            return
        with self._lock:
            rates = [*self._read(), image_bytes / frozen_s][-KEEP_RATES:]
            replace_file(self.path, json.dumps(rates).encode())

    def slowest(self) -> float:
        with self._lock:
            rates = self._read()
        return min(rates) if rates else DEFAULT_RATE_BPS

    def _read(self) -> list[float]:
        try:
            return [float(r) for r in json.loads(self.path.read_text()) if float(r) > 0]
        except FileNotFoundError:
            return []
        except (OSError, ValueError, TypeError) as e:
            log.warning("freeze rates %s unreadable (%s); assuming the default rate", self.path, e)
            return []


def expected_frozen_s(estimated_bytes: int, rate_bps: float) -> float:
    return FIXED_COST_S + estimated_bytes / rate_bps


def refuse_long_pause(rec: JobRecord, estimated_bytes: int, rates: RateLog, node: str) -> None:
    """Refuse, before anything freezes, a move of a distributed job's member whose expected
    frozen time exceeds the tightest limit on its peers' patience."""
    limits = pause_limits(rec)
    if not limits:
        return
    rate = rates.slowest()
    expected = expected_frozen_s(estimated_bytes, rate)
    tightest = limits[0]
    if expected > tightest.seconds:
        raise RefusedError(
            f"job {rec.name!r} would be frozen for about {expected:.0f} s ({estimated_bytes / 1e6:.0f} MB at "
            f"{rate / 1e6:.0f} MB/s, the slowest recent rate here, plus {FIXED_COST_S:g} s), longer than "
            f"{tightest.what}: {tightest.seconds:g} s; its peers would give up on it",
            step="prepare",
            node=node,
            hint="nothing was frozen; raise the limit (a longer --max-pause or process-group timeout), "
            "or free memory in the job first",
        )
