"""Waiting on a condition, for the demo and the integration tests that drive real agents."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(what: str, probe: Callable[[], object], timeout_s: float = 120.0) -> object:
    """Poll until probe() returns something truthy (returned); fail naming `what` otherwise."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if got := probe():
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
