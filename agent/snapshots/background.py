"""A round's work after its members went on (digests, shipping, a buddy's intake) yields the
node's cores to the jobs: it runs BACKGROUND_NICE nicer than the agent, per thread."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

#: Once its members go on, a round's work (digests, shipping, a buddy's intake) runs this much
#: nicer than the agent: the job comes first on a node whose cores it uses.
BACKGROUND_NICE = 10


def lower_priority() -> int | None:
    """Run the calling thread BACKGROUND_NICE nicer (Linux keeps a nice value per thread); its
    old value, or None if it could not be changed."""
    tid = threading.get_native_id()
    try:
        old = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(old + BACKGROUND_NICE, 19))
    except OSError:
        return None
    return old


def restore_priority(old: int | None) -> None:
    if old is not None:
        with contextlib.suppress(OSError):  # raising it back needs CAP_SYS_NICE, which root has
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), old)


@contextlib.contextmanager
def in_background() -> Iterator[None]:
    """The calling thread runs at a lower CPU priority until the block ends."""
    old = lower_priority()
    try:
        yield
    finally:
        restore_priority(old)
