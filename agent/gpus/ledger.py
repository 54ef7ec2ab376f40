"""The one owner of every claim on this node's GPUs.

A GPU may be unavailable to a job for any of these reasons, and each is recorded here and
nowhere else:

- **frozen**: a job frozen for a move or a checkpoint keeps its GPU memory (on a restore
  beside it on the same host, that memory counts as about to be free);
- **lease**: an incoming migration was promised the GPU, until its restore ends;
- **claim**: a start on this node (`ferry run --gpu`, `ferry restore`, a preempted job's
  resume) chose the GPU and holds it until its job record holds it;
- **preemption hold**: a low-priority job was suspended so that a job moving in gets the
  GPU, for at most `preempt_hold_s` or until that job has arrived;
- **quarantine**: the GPU made the agent move a job (agent.gpus.quarantine, on disk);
- **job**: an active job's record names it (`ferry run --gpu`), read from the registry; a record
  the registry could not read holds the GPUs it still names, or, if it names none legibly, every
  decision is refused until it is fixed;
- **health**: the monitor does not judge it healthy (read, not claimed).

Every decision (`decide`) runs its chooser under the ledger's one lock with every claim in
view, so two starts never take the same GPU. The chooser gets an inventory its caller read
before: NVML is never called under this lock (nor under any protocol lock that waits on it).
This lock is a leaf: nothing under it waits on anything but the quarantine's own leaf lock.
Job records and the health verdicts are read just before it (a record is current unless a
claim was released meanwhile, and then the decision reads again).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from agent.errors import AlreadyExistsError, RefusedError
from agent.gpus.quarantine import Entry, Quarantine

if TYPE_CHECKING:
    from agent.health.monitor import GpuHealth
    from agent.jobs.registry import JobRegistry

T = TypeVar("T")


@dataclass(frozen=True)
class _Hold:
    for_job: str
    since: float
    until: float


class GpuLedger:
    def __init__(
        self,
        registry: JobRegistry | None = None,
        quarantine: Quarantine | None = None,
        health: Callable[[], list[GpuHealth]] = list,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.registry = registry
        self.quarantine = quarantine
        self.health = health
        self.clock = clock
        self._lock = threading.Lock()
        self._frozen: dict[tuple[int, ...], dict[str, int]] = {}  # frozen pids → GPU → bytes kept
        self._claims: dict[str, tuple[str, ...]] = {}  # owner (a lease, a start) → its GPUs
        self._leases: set[str] = set()  # the owners that are incoming migrations
        self._holds: dict[str, _Hold] = {}  # GPU → the preemption hold on it
        #: Bumped by every release: a job record read before the lock is current if this did not move
        #: (a start's claim is released only after its record holds the GPUs).
        self._releases = 0

    # -- decisions ------------------------------------------------------------------------

    def decide(
        self,
        owner: str,
        for_job: str,
        pick: Callable[[dict[str, str], dict[str, int]], tuple[T, Iterable[str]]],
        *,
        lease: bool = False,
    ) -> T:
        """Choose GPUs and hold them for `owner` in one step. `pick(unavailable, frozen)` gets
        every GPU `for_job` may not take, with why, and the bytes frozen jobs keep per GPU;
        it returns its result and the GPUs it chose (or raises: then nothing is held)."""
        health = self.health()  # the monitor's last verdicts (a snapshot: no NVML call)
        while True:
            # Job records are read before the lock (a launch holds the registry's lock while its
            # init starts): valid unless a claim was released meanwhile, which may mean a new record.
            with self._lock:
                seen = self._releases
            jobs, arrived = self._jobs_holding(for_job), self._arrivals()
            with self._lock:
                if self._releases != seen:
                    continue
                if owner in self._claims:  # one claim per owner: a second would replace the first
                    raise AlreadyExistsError(
                        f"{owner} is already choosing or holding GPUs here", hint="wait for it to finish"
                    )
                taken = {**self._not_fit(health), **jobs, **self._taken_locked(owner, for_job, arrived)}
                result, gpus = pick(taken, self._frozen_bytes_locked())
                self._claims[owner] = tuple(gpus)
                if lease:
                    self._leases.add(owner)
                return result

    def release(self, owner: str) -> None:
        """The claim is over: its job holds its GPUs now (or it failed and holds none)."""
        with self._lock:
            self._leases.discard(owner)
            if self._claims.pop(owner, None) is not None:  # a no-op release invalidates no read
                self._releases += 1

    def unavailable(self, for_job: str) -> dict[str, str]:
        """Every GPU here that `for_job` may not be placed on, each with why (a snapshot)."""
        health, jobs, arrived = self.health(), self._jobs_holding(for_job), self._arrivals()
        with self._lock:
            return {**self._not_fit(health), **jobs, **self._taken_locked("", for_job, arrived)}

    def promised(self) -> set[str]:
        """GPUs that leases in flight or starts hold now."""
        with self._lock:
            return {u for gpus in self._claims.values() for u in gpus}

    # -- frozen jobs ----------------------------------------------------------------------

    def hold_frozen(self, pids: Iterable[int], gpus: Mapping[str, int]) -> None:
        with self._lock:
            self._frozen[tuple(pids)] = dict(gpus)

    def release_frozen(self, pids: Iterable[int]) -> None:
        with self._lock:
            self._frozen.pop(tuple(pids), None)

    def frozen_bytes(self) -> dict[str, int]:
        with self._lock:
            return self._frozen_bytes_locked()

    # -- quarantine -----------------------------------------------------------------------

    def quarantine_gpu(self, uuid: str, reason: str) -> bool:
        """Keep jobs off a GPU that made the agent move one; False if it already was (the first
        reason stays). On disk, so it survives restarts."""
        assert self.quarantine is not None
        return self.quarantine.add(uuid, reason)

    def clear_quarantine(self, uuid: str) -> Entry | None:
        """`ferry gpus --clear`: the GPU may take jobs again; returns what it was quarantined for."""
        assert self.quarantine is not None
        return self.quarantine.clear(uuid)

    # -- preemption holds -------------------------------------------------------------------

    def hold_for(self, gpus: Iterable[str], for_job: str, seconds: float) -> None:
        """Keep GPUs for `for_job` (moving in) for `seconds` from now; a hold renewed for the
        same job keeps when it began, which is what its arrival is judged against."""
        now = self.clock()
        with self._lock:
            for u in gpus:
                old = self._holds.get(u)
                since = old.since if old is not None and old.for_job == for_job else now
                self._holds[u] = _Hold(for_job, since, now + seconds)

    def held_for(self) -> dict[str, str]:
        """GPU → the job a live preemption hold keeps it for; a hold ends when it expires or that
        job has arrived (a record of it started after the hold began)."""
        arrived = self._arrivals()
        with self._lock:
            return self._live_holds_locked(arrived)

    # -- internals ---------------------------------------------------------------------------

    def _not_fit(self, health: list[GpuHealth]) -> dict[str, str]:
        out: dict[str, str] = {}
        for g in health:
            if g.state.value != "healthy":
                out[g.uuid] = f"is {g.state} ({'; '.join(e.detail for e in g.evidence)})"
        if self.quarantine is not None:
            for u, e in self.quarantine.all().items():
                out[u] = f"is quarantined ({e.reason}; `ferry gpus --clear {u}` once fixed)"
        return out

    def _taken_locked(self, owner: str, for_job: str, arrived: dict[str, float]) -> dict[str, str]:
        out: dict[str, str] = {}
        for u, for_other in self._live_holds_locked(arrived).items():
            if for_other != for_job:
                out[u] = f"is kept for job {for_other} (it suspended a low-priority job to get it)"
        for o, gpus in self._claims.items():
            if o == owner:
                continue
            why = "is promised to another incoming job" if o in self._leases else f"is being taken by {o}"
            for u in gpus:
                out.setdefault(u, why)
        return out

    def _jobs_holding(self, for_job: str) -> dict[str, str]:
        """GPUs given with `ferry run --gpu` are their job's alone; a GPU that NVML shows other CUDA
        jobs on may still be shared where its memory allows (gpus.choose prefers idle ones)."""
        out: dict[str, str] = {}
        if self.registry is not None:
            for rec in self.registry.list():
                if rec.state.active and rec.name != for_job:
                    for u in rec.gpus:
                        out[u] = f"is held by job {rec.name}"
            # Fail closed: a record that could not be read may stand for a job still on its GPUs.
            for bad in self.registry.unreadable.values():
                if bad.gpus is None:
                    raise RefusedError(
                        f"{bad.refusal()}: which GPUs it holds is unknown, so none is given out",
                        hint=bad.hint,
                    )
                for u in bad.gpus:
                    out.setdefault(u, f"may be held by job {bad.name}, whose record {bad.path} is unreadable")
        return out

    def _frozen_bytes_locked(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for held in self._frozen.values():
            for u, n in held.items():
                out[u] = out.get(u, 0) + n
        return out

    def _arrivals(self) -> dict[str, float]:
        """Job → when its record started, for the jobs not waiting preempted (read before the lock)."""
        if self.registry is None:
            return {}
        return {r.name: r.started_at for r in self.registry.list() if r.state.value != "preempted"}

    def _live_holds_locked(self, arrived: dict[str, float]) -> dict[str, str]:
        now = self.clock()
        self._holds = {
            u: h for u, h in self._holds.items() if h.until > now and arrived.get(h.for_job, 0.0) < h.since
        }
        return {u: h.for_job for u, h in self._holds.items()}
