"""Fencing: a group member whose node lost etcd is stopped and cut off before its lease can
expire, so that a copy restored elsewhere never runs beside it (docs/recovery.md).

The record says FENCED, durably, before anything is done to the process: an agent that dies
half-way finds the record at its next start and fences again (`hold`), never resumes on its
own. A fenced copy runs again only on etcd's definite word (`unfence`); when another copy was
started elsewhere it is ended without running (`JobRegistry.stop` on a FENCED job: its link
goes first, then SIGKILL, so it sends nothing, not even a FIN).
"""

from __future__ import annotations

import logging

from agent.errors import FerryError
from agent.jobs import procs
from agent.jobs.record import JobRecord, JobState
from agent.jobs.registry import JobRegistry

log = logging.getLogger(__name__)

#: How long stopping a member's threads may take: part of the fencing budget
#: (agent.coord.config checks the margin covers it).
STOP_WAIT_S = 0.5


def fence(registry: JobRegistry, name: str, why: str) -> JobRecord | None:
    """Fence a running job (None if it is not running: a move or its end got there first)."""
    with registry.lock:
        rec = registry.get(name)
        if rec.state is not JobState.RUNNING:
            return None
        rec = registry.update(name, state=JobState.FENCED, note=f"fenced: {why}")
    hold(registry, rec)
    log.warning("job %s: fenced (%s)", name, why)
    return rec


def hold(registry: JobRegistry, rec: JobRecord) -> None:
    """Stop the job's tree, then cut its link (a stop is a signal; the cut runs `ip`). Idempotent:
    a restarted agent calls it for every FENCED record it finds alive."""
    procs.stop(procs.tree_pids(rec.pid), timeout_s=STOP_WAIT_S)
    if registry.network is not None and rec.veth:
        try:
            registry.network.cut(rec.veth)
        except FerryError as e:  # stopped, it cannot send; only the kernel's ACKs still leave
            log.error("job %s: fenced, but its link could not be cut: %s", rec.name, e)


def hold_all(registry: JobRegistry) -> None:
    """At the agent's start: every fenced job still alive is held again (stopped, cut off)."""
    for rec in registry.list():
        if rec.state is JobState.FENCED and procs.alive(rec.pid, rec.pid_started):
            hold(registry, rec)
            log.warning("job %s stays fenced until etcd settles it", rec.name)


def unfence(registry: JobRegistry, name: str, why: str) -> JobRecord | None:
    """Let a fenced job run again: its link back on the bridge, then SIGCONT (None if it is not
    fenced any more)."""
    with registry.lock:
        rec = registry.get(name)
        if rec.state is not JobState.FENCED:
            return None
        if registry.network is not None and rec.veth:
            registry.network.reconnect(rec.veth)  # raises: the job then stays fenced, and says why
        procs.resume(procs.tree_pids(rec.pid))
        rec = registry.update(name, state=JobState.RUNNING, note=f"unfenced: {why}")
    log.info("job %s: unfenced (%s)", name, why)
    return rec
