"""Self-healing: what the agent does by itself when one of its GPUs degrades or fails.

After every health poll (agent.health.monitor) the agent looks at each GPU that is not healthy
and at the jobs that hold it (given by `ferry run --gpu`, or seen on it by NVML):

- a job whose policy is ``alert`` is only reported (`ferry events`), once per episode;
- a job whose policy is ``migrate`` is moved to the best target the peers offer
  (agent.health.placement), suspending low-priority jobs there when that is the only room.
  It is a planned migration with all its invariants. On a *failing* GPU the move is
  tried once with a short CUDA lock timeout; if the GPU cannot copy out any more, the
  job is left to the operator, and the events say so.

Each job is moved by the agent at most once per cooldown, at most `max_moves` moves
start per window on this node, and a job being moved is never moved again at the same
time. A GPU that made the agent move a job is quarantined: no job is placed on it until
`ferry gpus --clear UUID`. A target that refuses the move before anything freezes (a spare
whose GPU fails its self-test, a path too slow, a lease refused) is passed over for the next
best, at most MAX_TARGETS in all.

The other side, suspending a low-priority job here when a peer asks and resuming it later,
is agent.health.preemption's (`self.preemptions`). The rest is one module: the episodes,
cooldowns, storm guard and the jobs being acted on are one lock's state, which the decisions
and the moves they start both change.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from agent.agent_config import AgentConfig, PeerSpec
from agent.errors import FerryError, JobBusyError, RefusedError
from agent.gpus.inventory import GpuNeed, Inventory
from agent.gpus.ledger import GpuLedger
from agent.health.events import EventLog
from agent.health.monitor import Change, GpuHealth, State
from agent.health.placement import Placement, choose_target
from agent.health.preemption import Preemptions
from agent.jobs import procs
from agent.jobs.record import JobRecord, JobState, OnDegraded
from agent.jobs.registry import JobRegistry
from agent.rpc import pb

log = logging.getLogger(__name__)

#: The episode key of a straggler verdict (one per job, no GPU).
STRAGGLER = "straggler"
#: An automatic move tries at most this many targets that refuse it before anything freezes.
MAX_TARGETS = 3


class HealingPeer(Protocol):
    """A peer agent as the policy sees it (agent.client.PeerClient)."""

    def health(self, timeout_s: float) -> pb.HealthReport: ...
    def preempt(self, req: pb.PreemptRequest) -> pb.PreemptResponse: ...


@dataclass
class Holder:
    job: JobRecord
    used_bytes: int = 0


@dataclass
class Hooks:
    """What the policy needs from the agent, as plain callables (so tests can give fakes)."""

    inventory: Callable[[], Inventory]
    peer: Callable[[str], HealingPeer]
    #: Run a migration to completion (raises FerryError when it did not move the job).
    migrate: Callable[[str, str, str, float | None], object]
    #: Run work on its own thread, counted as a move in flight (the agent waits for it on stop).
    spawn: Callable[[Callable[[], None]], None]
    #: Suspend a job to a directory (checkpoint semantics: the job ends here, nothing lost).
    suspend: Callable[[str, Path], None]
    #: Resume a suspended job here (its GPUs claimed in the ledger); NoFreeGpuError while none can.
    resume: Callable[[JobRecord], JobRecord]
    agent_id: str = ""
    #: The agent keeping the snapshot image a move of this job may be an increment over ("" none):
    #: among equal targets, the one to prefer (agent.migration.chainmove).
    keeper: Callable[[JobRecord], str] = lambda rec: ""


@dataclass
class _Episode:
    """What the policy already said about one job on one GPU in one state (so it says it once)."""

    said: set[str] = field(default_factory=set)


class SelfHealing:
    def __init__(
        self,
        *,
        node: str,
        registry: JobRegistry,
        events: EventLog,
        ledger: GpuLedger,
        config: AgentConfig,
        hooks: Hooks,
        state_dir: Path,
        health: Callable[[], list[GpuHealth]] = list,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.node = node
        self.registry = registry
        self.events = events
        self.ledger = ledger  # the preemption holds are kept there, with every other GPU claim
        self.config = config
        self.hooks = hooks
        self.state_dir = state_dir
        self.health = health
        self.clock = clock
        self._lock = threading.Lock()
        self._acting: set[str] = set()  # jobs being moved by the policy now
        self._last_move: dict[str, float] = {}  # job → when the policy last started moving it
        self._starts: list[float] = []  # when automatic moves started (storm guard)
        self._given_up: set[tuple[str, str]] = set()  # (job, gpu): failing, one try made
        self._episodes: dict[tuple[str, str, str], _Episode] = {}
        #: Set when the agent stops: no new automatic move or resume starts.
        self.draining = threading.Event()
        self.preemptions = Preemptions(
            node,
            registry,
            events,
            ledger,
            config,
            hooks.suspend,
            hooks.resume,
            state_dir,
            lambda job: [u for u, hs in self.jobs_by_gpu().items() if any(h.job.name == job for h in hs)],
            self.draining,
            clock,
        )
        self.preempt, self.resume_preempted = self.preemptions.preempt, self.preemptions.resume_preempted

    # -- the health monitor's callback ------------------------------------------------

    def on_poll(self, snapshot: list[GpuHealth], changes: list[Change]) -> None:
        for c in changes:
            self._report_change(c)
        bad = [g for g in snapshot if g.state is not State.HEALTHY]
        live = {(g.uuid, g.state.value) for g in bad}
        failing = {g.uuid for g in bad if g.state is State.FAILING}
        with self._lock:  # an episode ends when its GPU leaves that state
            self._episodes = {k: v for k, v in self._episodes.items() if (k[1], k[2]) in live}
            self._given_up = {k for k in self._given_up if k[1] in failing}
        if bad and not self.draining.is_set():
            holders = self.jobs_by_gpu()
            for g in bad:
                for h in holders.get(g.uuid, []):
                    self._consider(h.job, g)

    def _report_change(self, c: Change) -> None:
        g = c.gpu
        why = "; ".join(e.detail for e in g.evidence) or "no evidence left"
        self.events.record(
            "health", f"GPU {g.uuid} (index {g.index}) {c.previous} → {g.state}: {why}", gpu=g.uuid
        )

    # -- who holds which GPU --------------------------------------------------------

    def jobs_by_gpu(self, inv: Inventory | None = None) -> dict[str, list[Holder]]:
        """Every GPU of this node → the active jobs holding it (assigned, or seen on it by NVML)."""
        inv = inv or self.hooks.inventory()
        usage = inv.usage_by_pid() if inv.available else {}
        out: dict[str, dict[str, Holder]] = {}
        for rec in self.registry.list():
            if not rec.state.active:
                continue
            for u in rec.gpus:
                out.setdefault(u, {}).setdefault(rec.name, Holder(rec))
            if usage:
                for pid in procs.tree_pids(rec.pid):
                    for g, used in usage.get(pid, []):
                        out.setdefault(g.uuid, {}).setdefault(rec.name, Holder(rec)).used_bytes += used
        return {u: list(by_job.values()) for u, by_job in out.items()}

    def cleared(self, uuid: str) -> None:
        """An operator cleared the GPU: a job ferry gave up on there may be tried again."""
        with self._lock:
            self._given_up = {k for k in self._given_up if k[1] != uuid}

    # -- the policy -------------------------------------------------------------------

    def _say_once(self, rec: JobRecord, g: GpuHealth | None, what: str, kind: str, message: str) -> None:
        """Once per episode: a GPU in one state, or (g None) a straggler verdict until it ends."""
        key = (rec.name, g.uuid, g.state.value) if g is not None else (rec.name, STRAGGLER, STRAGGLER)
        with self._lock:
            ep = self._episodes.setdefault(key, _Episode())
            if what in ep.said:
                return
            ep.said.add(what)
        self.events.record(kind, message, gpu=g.uuid if g is not None else "", job=rec.name)

    def _consider(self, rec: JobRecord, g: GpuHealth) -> None:
        why = f"GPU {g.uuid} is {g.state}: {'; '.join(e.detail for e in g.evidence)}"
        if rec.on_degraded == OnDegraded.ALERT.value:
            self._say_once(rec, g, "alert", "alert", f"job {rec.name} stays on it (policy alert): {why}")
            return
        if (started := self._admit(rec, g, why)) is None:
            return
        self._start(rec, g, why, started, f"moving job {rec.name} off GPU {g.uuid}: {why}")

    def straggler(self, rec: JobRecord, why: str, migrate: bool) -> None:
        """A member that holds its group back (agent.health.stragglers): said once while the
        verdict stands; with `migrate`, moved to a peer that runs no member of its group, under
        the same cooldown and storm guard as a GPU's move."""
        if not migrate:
            said = f"job {rec.name} stays (policy on_straggler alert): {why}"
            self._say_once(rec, None, "alert", "alert", said)
            return
        if (started := self._admit(rec, None, why)) is None:
            return
        self._start(rec, None, why, started, f"moving job {rec.name} off node {self.node}: {why}")

    def straggler_ended(self, job: str) -> None:
        """The verdict no longer stands: a later one is a new episode, said again."""
        with self._lock:
            self._episodes.pop((job, STRAGGLER, STRAGGLER), None)

    def _admit(self, rec: JobRecord, g: GpuHealth | None, why: str) -> tuple[float | None, float] | None:
        """Whether the policy may move `rec` now (marked as being moved if so): when it started
        (to undo if nothing is tried), or None with the reason said once."""
        if rec.state is not JobState.RUNNING:
            return None  # being moved already (single flight), by hand or by us
        now = self.clock()
        pol = self.config.policy
        with self._lock:
            if rec.name in self._acting:
                return None
            if g is not None and (rec.name, g.uuid) in self._given_up:
                return None
            last = self._last_move.get(rec.name)
            cooling = last is not None and now - last < pol.cooldown_s
            started = (last, now)  # undone if the move finds the job busy (nothing was tried)
            self._starts = [t for t in self._starts if now - t < pol.window_s]
            storm = len(self._starts) >= pol.max_moves
            if not cooling and not storm:
                self._acting.add(rec.name)
                self._last_move[rec.name] = now
                self._starts.append(now)
        if cooling:
            assert last is not None
            left = pol.cooldown_s - (now - last)
            self._say_once(
                rec, g, "cooldown", "decision",
                f"not moving job {rec.name} again yet: the agent moved it {now - last:.0f} s ago "
                f"(cooldown {pol.cooldown_s:.0f} s, {left:.0f} s left); {why}",
            )  # fmt: skip
            return None
        if storm:
            self._say_once(
                rec, g, "storm", "decision",
                f"not moving job {rec.name}: {pol.max_moves} automatic moves already started on this node "
                f"in the last {pol.window_s:.0f} s (policy max_moves); {why}",
            )  # fmt: skip
            return None
        return started

    def _start(
        self, rec: JobRecord, g: GpuHealth | None, why: str, started: tuple[float | None, float], said: str
    ) -> None:
        try:
            self.events.record("decision", said, gpu=g.uuid if g is not None else "", job=rec.name)
            self.hooks.spawn(lambda: self._move(rec.name, g, why, started))
        except Exception:  # no thread, no move: the job must not stay marked as being moved
            log.exception("could not start moving job %s", rec.name)
            with self._lock:
                self._acting.discard(rec.name)

    def _move(self, name: str, g: GpuHealth | None, why: str, started: tuple[float | None, float]) -> None:
        """Move job `name` off GPU g, or (g None) off this node: a straggler, placed on a peer
        that runs no member of its group (it would share that node's CPUs with it)."""
        failing = g is not None and g.state is State.FAILING
        gpu = g.uuid if g is not None else ""
        tried = False  # a migration was started: on a failing GPU, that was the one try
        refused: list[str] = []  # targets that refused this move before anything froze
        try:
            rec = self.registry.get(name)
            while True:
                placement = self._place(rec, apart=g is None, skip=refused)
                target = f"target for job {name}: {placement.describe()}"
                self.events.record("decision", target, gpu=gpu, job=name)
                # Quarantined once a move off it is on its way; a GPU nobody could take a job off stays open.
                if g is not None and self.ledger.quarantine_gpu(g.uuid, why):
                    self.events.record("quarantine", f"GPU {g.uuid} quarantined: {why}", gpu=g.uuid, job=name)
                self._preempt(name, placement, why)
                tried = True
                if self._try(name, placement, why, failing, last=len(refused) + 1 >= MAX_TARGETS):
                    break
                refused.append(placement.peer.address)
            self.registry.update(
                name, note=f"moved to {placement.node} ({placement.peer.address}) by ferry: {why}"
            )
            self.events.record(
                "migration",
                f"moved job {name} to node {placement.node} ({placement.peer.address})",
                gpu=gpu,
                job=name,
            )
        except JobBusyError as exc:
            # A snapshot round (or a checkpoint) holds the job: no move was tried, so no cooldown
            # and, on a failing GPU, not its one try. The next poll after it ends moves it.
            self._not_started(name, started)
            off = f"GPU {gpu}" if g is not None else f"node {self.node}"
            with contextlib.suppress(FerryError):  # the job may have ended meanwhile
                self._say_once(
                    self.registry.get(name), g, "busy", "decision",
                    f"job {name} is busy ({exc.cause}): moving it off {off} as soon as that ends",
                )  # fmt: skip
        except Exception as exc:
            err = (
                exc
                if isinstance(exc, FerryError)
                else FerryError(
                    f"{type(exc).__name__}: {exc}; see the agent's log", step="policy", node=self.node
                )
            )
            if not isinstance(exc, FerryError):
                log.exception("automatic move of job %s failed", name)
            self.events.record("migration", f"automatic move of job {name} failed: {err}", gpu=gpu, job=name)
            if g is not None and failing and tried:
                with self._lock:
                    self._given_up.add((name, g.uuid))
                msg = (
                    f"GPU {g.uuid} is failing and job {name} could not be moved off it ({err}); ferry tried "
                    "once and leaves it to you: restart it from its last checkpoint elsewhere, or "
                    f"`ferry migrate {name} --to HOST:PORT` if the GPU recovers"
                )
                self.events.record("alert", msg, gpu=g.uuid, job=name)
                self._note(name, msg)
        finally:
            with self._lock:
                self._acting.discard(name)

    def _preempt(self, name: str, placement: Placement, why: str) -> None:
        peer = self.hooks.peer(placement.peer.address)
        rec = self.registry.get(name)
        if rec.state is JobState.MIGRATING:  # a snapshot round holds it: nothing tried, try again
            doing = f"job {name} is being saved or moved (migration {rec.migration_id})"
            raise JobBusyError(doing, step="policy", node=self.node)
        if rec.state is not JobState.RUNNING:
            raise RefusedError(f"job {name} is no longer running here", step="policy", node=self.node)
        for victim in placement.preempt:
            req = pb.PreemptRequest(job=victim, for_job=name, source_node=self.node, reason=why)
            req.for_group = self.registry.get(name).group
            peer.preempt(req)
            self.events.record(
                "preempt",
                f"node {placement.node} suspended low-priority job {victim} for job {name}",
                job=name,
            )

    def _try(self, name: str, placement: Placement, why: str, failing: bool, last: bool) -> bool:
        """One target: True once the job moved there; False when it refused before anything froze
        (a spare that failed its self-test, a path too slow, a lease refused) and another may take
        it (unless this was the `last` of MAX_TARGETS); anything else raises."""
        lock = self.config.policy.failing_lock_timeout_s if failing else None
        try:
            self.hooks.migrate(name, placement.peer.address, f"automatic: {why}", lock)
            return True
        except JobBusyError:
            raise
        except FerryError as e:
            # Prepare's refusal leaves the job running here, untouched: another target may do.
            before_freeze = e.step.startswith("prepare") and self.registry.get(name).state is JobState.RUNNING
            if not before_freeze or last:
                raise
            self.events.record(
                "decision",
                f"node {placement.node} did not take job {name} ({e}); choosing another target",
                job=name,
            )
            return False

    def _not_started(self, name: str, started: tuple[float | None, float]) -> None:
        last, now = started
        with self._lock:
            if last is None:
                self._last_move.pop(name, None)
            else:
                self._last_move[name] = last
            if now in self._starts:
                self._starts.remove(now)

    def _note(self, name: str, note: str) -> None:
        try:
            rec = self.registry.get(name)
            if rec.state is JobState.RUNNING:
                self.registry.update(name, note=note)
        except FerryError:
            pass

    def _place(self, rec: JobRecord, apart: bool = False, skip: Sequence[str] = ()) -> Placement:
        """The best peer for `rec`; `apart`: never one that runs a member of its group; never
        one in `skip` (it refused this move already)."""
        needs = self.needs(rec)

        def ask(spec: PeerSpec) -> pb.HealthReport | FerryError:
            try:
                return self.hooks.peer(spec.address).health(self.config.policy.peer_timeout_s)
            except FerryError as e:
                return e

        # All at once: a dead peer costs its timeout once, not before every peer after it (a
        # warned node has seconds left, and a spare may have died in an earlier failure).
        with ThreadPoolExecutor(max(1, len(self.config.peers))) as pool:
            answers = list(pool.map(ask, self.config.peers))
        me = self.hooks.agent_id

        def mine(r: pb.HealthReport | FerryError) -> bool:  # this agent is in its own peer list
            return not isinstance(r, FerryError) and bool(r.agent_id) and r.agent_id == me

        views = [
            (spec, r)
            for spec, r in zip(self.config.peers, answers, strict=True)
            if not mine(r) and spec.address not in skip
        ]
        keeper = self.hooks.keeper(rec)
        return choose_target(needs, rec.priority, views, self.node, rec.group, apart=apart, keeper=keeper)

    def needs(self, rec: JobRecord) -> list[GpuNeed]:
        """The job's GPUs as a target must match them: chip and memory used."""
        inv = self.hooks.inventory()
        out: dict[str, GpuNeed] = {}
        for u, holders in self.jobs_by_gpu(inv).items():
            for h in holders:
                if h.job.name == rec.name:
                    g = inv.by_uuid(u)
                    out[u] = GpuNeed(u, g.name if g else rec.gpu_chip, h.used_bytes)
        return list(out.values())
