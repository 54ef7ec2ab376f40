"""Fault injection for tests: FERRY_FAULTS=point[,point...] makes those points fail.

Points: prepare, dump, transfer, commit (source side); target-prepare,
target-transfer, target-restore (target side).
"""

from __future__ import annotations

import os

from agent.errors import FerryError


class InjectedFault(FerryError):
    kind = "internal"


def active() -> set[str]:
    return {p.strip() for p in os.environ.get("FERRY_FAULTS", "").split(",") if p.strip()}


def check(point: str, node: str = "") -> None:
    if point in active():
        raise InjectedFault(f"injected fault at {point!r} (FERRY_FAULTS)", step=point, node=node)
