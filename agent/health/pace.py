"""How hard each of this node's jobs is working, from the kernel's scheduler statistics.

A synchronous job runs at its slowest member's pace: the slow member computes all the time
while its peers finish their share and then wait for it in their collective, asleep. So the
share of wall time a member's busiest thread wants a CPU (it ran, or it was runnable and
waited for one: a throttled cgroup's quota, a noisy neighbour) tells the member that holds
the group back from those waiting for it, without touching the job's code. Both halves come
from `/proc/PID/task/TID/schedstat` (nanoseconds on a CPU, nanoseconds runnable but waiting;
the time a CFS quota throttles a task counts as waiting), sampled for every thread of the
job's process tree.

The busiest thread, not the sum: a step's critical path is one thread (the one that computes
and then blocks in the collective); helper threads that wake now and then must not hide it,
and a job with more threads than its peers is not slower for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from agent.jobs import procs

#: Two samples closer than this say nothing (a thread's counters move in scheduler ticks).
MIN_SPAN_S = 0.2


@dataclass(frozen=True)
class Sample:
    """One member's pace between two readings (wall-clock times, comparable across nodes)."""

    t0: float
    t1: float
    busy: float  # the busiest thread's share of the span it wanted a CPU: ran + waited
    ran: float  # of which on a CPU
    waited: float  # of which runnable but waiting for one (throttled, or the CPU was taken)
    gpu_clock: float = -1.0  # its slowest GPU's SM clock against its maximum at t1 (-1: no GPU)
    gpu_brakes: str = ""  # why that GPU slows itself, if it does (HW slowdown, power brake, ...)


def read_threads(root: int) -> dict[int, tuple[int, int]]:
    """Every thread of the process tree under `root` → (ns on a CPU, ns runnable and waiting).
    A thread that ends between the listing and the read is left out."""
    out: dict[int, tuple[int, int]] = {}
    for pid in procs.tree_pids(root):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    ran, waited = f.read().split()[:2]
                out[int(tid)] = (int(ran), int(waited))
    return out


Threads = dict[int, tuple[int, int]]  # thread id → (ns on a CPU, ns runnable and waiting)


def between(before: Threads, after: Threads, t0: float, t1: float) -> Sample:
    """The busiest thread's shares between two readings (threads in both only)."""
    span_ns = max(1.0, (t1 - t0) * 1e9)
    best = (0.0, 0.0)
    for tid, (ran1, waited1) in after.items():
        if tid not in before:
            continue
        ran0, waited0 = before[tid]
        d = (max(0, ran1 - ran0) / span_ns, max(0, waited1 - waited0) / span_ns)
        if sum(d) > sum(best):
            best = d
    ran, waited = min(1.0, best[0]), min(1.0, best[1])
    return Sample(t0, t1, min(1.0, ran + waited), ran, waited)


@dataclass
class _Meter:
    pid: int
    last: dict[int, tuple[int, int]]
    at: float
    samples: deque[Sample] = field(default_factory=deque)


class PaceMeter:
    """Samples the named jobs' pace and keeps each one's samples over `keep_s`. A job whose
    process changed (restored after a move or a rollback) starts over: its old samples were
    another process's, perhaps on another node."""

    def __init__(self, keep_s: float, clock: Callable[[], float] = time.time,
                 read: Callable[[int], dict[int, tuple[int, int]]] = read_threads) -> None:  # fmt: skip
        self.keep_s, self.clock, self.read = keep_s, clock, read
        self._meters: dict[str, _Meter] = {}
        self._lock = threading.Lock()

    def sample(self, jobs: dict[str, int], gpus: dict[str, tuple[float, str]] | None = None) -> None:
        """One reading of each job (name → its root pid); jobs not named are forgotten. `gpus`:
        a GPU job's slowest GPU now (its SM clock's share of its maximum, and the brakes on)."""
        now = self.clock()
        readings = {name: self.read(pid) for name, pid in jobs.items() if pid > 0}
        with self._lock:
            self._meters = {n: m for n, m in self._meters.items() if n in jobs and m.pid == jobs[n]}
            for name, threads in readings.items():
                m = self._meters.get(name)
                if m is None:
                    self._meters[name] = _Meter(jobs[name], threads, now)
                    continue
                if now - m.at < MIN_SPAN_S:
                    continue
                s = between(m.last, threads, m.at, now)
                if gpus and name in gpus:
                    s = dataclasses.replace(s, gpu_clock=gpus[name][0], gpu_brakes=gpus[name][1])
                m.samples.append(s)
                m.last, m.at = threads, now
                while m.samples and m.samples[0].t1 < now - self.keep_s:
                    m.samples.popleft()

    def samples(self, job: str) -> list[Sample]:
        with self._lock:
            m = self._meters.get(job)
            return list(m.samples) if m is not None else []
