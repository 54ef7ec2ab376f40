"""Whether the agents of this node's groups' other members answer, asked every renewal interval
ahead of need.

A member is lost when its node's lease expired **and** its agent does not answer
(agent.coord.liveness). Asked only once the lease is gone, the second half costs a probe's
whole bound on a dead node (its address silent until the timeout) after the expiry, every time.
Asked all along, the answer is there when the lease goes: a node that died ~1 s before its
expiry has failed a ping by then. A ping that failed is evidence of the same kind as that probe
(no answer within its bound) and is used only together with an expired lease, which is what
makes acting safe (the node fenced itself first); a failure that is only slowness costs a
needless recovery, as a slow probe would, never a second copy.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Pings:
    """One thread per agent asked about, pinging it every `every_s`; `watch` sets the agents."""

    def __init__(self, probe: Callable[[str], str], every_s: float) -> None:
        self.probe, self.every_s = probe, every_s
        self._last: dict[str, str] = {}  # agent -> its last completed ping's failure ("": answered)
        self._stops: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def watch(self, agents: set[str]) -> None:
        """Ping exactly these agents from now on (their threads start and end here)."""
        with self._lock:
            for gone in set(self._stops) - agents:
                self._stops.pop(gone).set()
                self._last.pop(gone, None)
            for new in agents - set(self._stops):
                stop = self._stops[new] = threading.Event()
                threading.Thread(target=self._loop, args=(new, stop), name=f"ping-{new}", daemon=True).start()

    def stop(self) -> None:
        self.watch(set())

    def silent(self, agent: str) -> str:
        """Why `agent` did not answer its last completed ping ("" if it did, or was never asked)."""
        with self._lock:
            return self._last.get(agent, "")

    def _loop(self, agent: str, stop: threading.Event) -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                why = self.probe(agent)
            except Exception as e:  # a ping never ends the thread: the next one asks again
                log.exception("coordination: pinging agent %s failed", agent)
                why = str(e) or type(e).__name__
            with self._lock:
                if not stop.is_set():
                    self._last[agent] = why
            stop.wait(max(0.0, self.every_s - (time.monotonic() - t0)))
