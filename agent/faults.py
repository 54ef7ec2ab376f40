"""Fault injection for tests. Never set in production; each point costs a dict lookup.

FERRY_FAULTS=point[,point...] makes those points fail. Points: prepare, dump,
transfer, commit (source side); checkpoint, checkpoint-dumped (the image written, its
manifest not yet), checkpoint-saved (the image complete; a `ferry checkpoint` without
--leave-running or a suspend about to end the job); target-prepare, target-transfer, target-restore,
target-restored, target-pages (target side; it breaks a post-copy transfer
after 16 MiB have arrived), target-lazy-gone (a post-copy target's lazy-pages daemon
dies after the restored tasks handed it their memory, before CRIU's restore ends).
Two more corrupt the stream the source sends:
corrupt-chunk (one byte of the first data chunk flipped after its digest) and
truncate-image (the stream ends before the manifest).

FERRY_PAUSE=point=SECONDS[,...] sleeps at a point instead, which gives a test a
window to kill an agent or cut a link at a known step. Pause-only points:
source-dumped (tree frozen, image on disk), source-transferring,
target-receiving (after the first chunk), target-stop-stream (a dropped
migration's page server or lazy-pages daemon about to be killed: slow to die) and
rollback-ended (a rollback's coordinator, every old copy ended and none restored yet),
snapshot-held (a round's HOLD: every member on the node frozen and dumped, the answer
not yet sent) and snapshot-shipping (a round's SHIP: the members went on, an image
about to be sent to its buddy).
"""

from __future__ import annotations

import logging
import os
import time

from agent.errors import FerryError

log = logging.getLogger(__name__)


class InjectedFault(FerryError):
    kind = "internal"


def active() -> set[str]:
    return {p.strip() for p in os.environ.get("FERRY_FAULTS", "").split(",") if p.strip()}


def pauses() -> dict[str, float]:
    out = {}
    for item in os.environ.get("FERRY_PAUSE", "").split(","):
        point, sep, seconds = item.partition("=")
        if sep:
            out[point.strip()] = float(seconds)
    return out


def check(point: str, node: str = "") -> None:
    if seconds := pauses().get(point):
        log.warning("FERRY_PAUSE: pausing %.1f s at %r", seconds, point)
        time.sleep(seconds)
    if point in active():
        raise InjectedFault(f"injected fault at {point!r} (FERRY_FAULTS)", step=point, node=node)
