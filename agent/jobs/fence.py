"""Fencing: a group member whose node lost etcd is stopped and cut off before its lease can
expire, so that a copy restored elsewhere never runs beside it (docs/recovery.md).

The record says FENCED, durably, before anything is done to the process: an agent that dies
half-way finds the record at its next start and fences again (`hold`), never resumes on its
own. A fenced copy runs again only on etcd's definite word (`unfence`); when another copy was
started elsewhere it is ended without running (`JobRegistry.stop` on a FENCED job: its link
goes first, then SIGKILL, so it sends nothing, not even a FIN).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal

from agent.errors import FerryError
from agent.jobs import procs
from agent.jobs.record import JobKind, JobRecord, JobState
from agent.jobs.registry import JobRegistry

log = logging.getLogger(__name__)

#: How long stopping a member's threads may take: part of the fencing budget
#: (agent.coord.config checks the margin covers it).
STOP_WAIT_S = 0.5


def fence(registry: JobRegistry, name: str, why: str, rolled_back_to: int = 0) -> JobRecord | None:
    """Fence a running job (None if it is not running: a move or its end got there first).
    `rolled_back_to`: a rollback to that round fences it, to end it; only the rollback settles
    it (the node's liveness leaves it alone), 0: the node's liveness fences it."""
    with registry.lock:
        rec = registry.get(name)
        if rec.state is not JobState.RUNNING:
            return None
        note = f"fenced: {why}"
        rec = registry.update(name, state=JobState.FENCED, note=note, rolled_back_to=rolled_back_to)
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


#: What a launched job's PID 1 (ferry-init) takes as a word from its agent: its fencing watchdog.
FENCE_SIGNAL = signal.SIGRTMIN + 4
#: A word that disarms the watchdog (a node without [coordination] runs the job).
DISARM = -1


class _Sigval(ctypes.Union):
    _fields_ = [("sival_int", ctypes.c_int), ("sival_ptr", ctypes.c_void_p)]


def word(rec: JobRecord, ms: int) -> bool:
    """Tell a launched job's PID 1 how many milliseconds it may run without a newer word (DISARM:
    without limit). Only a launched job: its PID 1 is ferry-init, which has a handler (a process
    of an adopted job would be killed by the signal). False if it could not be sent."""
    if rec.kind is not JobKind.LAUNCHED or not procs.alive(rec.pid, rec.pid_started):
        return False
    if not _namespace_init(rec.pid):  # only a PID 1 ignores a signal it has no handler for
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    value = _Sigval(sival_int=max(min(ms, 2**31 - 1), DISARM))
    if libc.sigqueue(rec.pid, FENCE_SIGNAL, value) != 0:
        log.warning("job %s: no word to its watchdog: %s", rec.name, os.strerror(ctypes.get_errno()))
        return False
    return True


def _namespace_init(pid: int) -> bool:
    """Whether pid is PID 1 of its own PID namespace (the last NSpid of /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return line.split()[-1] == "1"
    except OSError:
        pass
    return False


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
