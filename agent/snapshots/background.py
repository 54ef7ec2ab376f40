"""A round's work after its members went on (digests, shipping, a buddy's intake) yields the
node's cores to the jobs: each of its threads runs under SCHED_IDLE while it works.

Nice 10 was not enough: the work is CPU-bound for seconds on every node at once, and a job's
thread woken by its network (a peer's all-reduce bytes) waited behind it, so steps next to a
round's ship took up to 0.19 s longer. A SCHED_IDLE thread is preempted at once by any other
that wakes, and still takes what the jobs leave (nearly everything, for a job waiting on its
GPU or its peers); on cores the jobs keep busy it gets a small share, so the ship takes longer
but still ends."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

#: What a thread's scheduling was before lower_priority(): its policy and priority.
Before = tuple[int, int]


def lower_priority() -> Before | None:
    """Run the calling thread under SCHED_IDLE (Linux schedules each thread by itself); its old
    policy, or None if it could not be changed."""
    tid = threading.get_native_id()
    try:
        old = (os.sched_getscheduler(tid), os.sched_getparam(tid).sched_priority)
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except OSError:
        return None
    return old


def restore_priority(old: Before | None) -> None:
    if old is not None:
        with contextlib.suppress(OSError):  # leaving SCHED_IDLE needs CAP_SYS_NICE, which root has
            os.sched_setscheduler(threading.get_native_id(), old[0], os.sched_param(old[1]))


@contextlib.contextmanager
def in_background() -> Iterator[None]:
    """The calling thread runs at the lowest CPU priority until the block ends."""
    old = lower_priority()
    try:
        yield
    finally:
        restore_priority(old)
