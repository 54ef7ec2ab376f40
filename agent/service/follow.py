"""Follow streams (`logs -f`, `events -f`, `health --watch`) on slots of their own.

A gRPC sync server runs each call on a thread of its one pool until the call ends, so a
follower holds a thread for as long as someone watches. The pool is sized as the control
calls' threads plus FOLLOW_SLOTS, and a follower must hold a slot: however many watch, the
control calls (Commit, GetMigration, the source's fencing query) keep their threads.
(`health --watch` follows the Events stream, so it is a follower too.)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from agent.errors import BusyError

#: Threads for everything but followers: moves, the peer protocol, listings.
CONTROL_WORKERS = 32
#: Followers at once; one more is refused with the limit, not queued behind the others.
FOLLOW_SLOTS = 8


class FollowSlots:
    def __init__(self, slots: int = FOLLOW_SLOTS) -> None:
        self.slots = slots
        self._free = threading.BoundedSemaphore(slots)

    @contextlib.contextmanager
    def slot(self, what: str, node: str) -> Iterator[None]:
        if not self._free.acquire(blocking=False):
            raise BusyError(
                f"{self.slots} follow streams are open on this agent already; {what} is refused",
                step="follow",
                node=node,
                hint="close a `ferry logs -f`, `events -f` or `health --watch`, or ask without following",
            )
        try:
            yield
        finally:
            self._free.release()
