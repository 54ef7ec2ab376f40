"""The agent's composition root: one object that builds every part once and owns the threads.

The servicer (agent.service.servicer) calls it and only converts; serve (agent.service.serve)
starts and stops it.

Why one module: it is the wiring; split, each part would be built in one place and handed its
collaborators in another.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from agent import __version__, client
from agent.agent_config import AgentConfig
from agent.coord.liveness import for_agent
from agent.criu.runner import Criu
from agent.cuda.jobs import CudaJobs, host_cuda_jobs
from agent.errors import FerryError, InvalidArgumentError, JobBusyError, NotFoundError, RefusedError
from agent.gpus.inventory import Inventory, nvml_module
from agent.gpus.ledger import GpuLedger
from agent.gpus.quarantine import Entry, Quarantine
from agent.gpus.verify import GpuVerifier, Runner
from agent.health.events import EventLog
from agent.health.healing import Hooks, SelfHealing
from agent.health.monitor import GpuHealth, HealthMonitor
from agent.health.straggler_watch import StragglerWatch, gpu_pace
from agent.jobs import fence
from agent.jobs.network import JobNetwork
from agent.jobs.record import JobRecord, JobState, OnDegraded, Priority, check_job_name
from agent.jobs.registry import JobRegistry
from agent.migration.datatls import sweep_keys
from agent.migration.journal import SOURCE, Journal
from agent.migration.local import Dumped, checkpoint
from agent.migration.local_restore import restore_image, resume_preempted
from agent.migration.model import Emit, Method, MigrationResult, MigrationSpec, Progress, Resolution
from agent.migration.probe import PathCheck
from agent.migration.recovery import SourceRecovery
from agent.migration.source import SourceMigration
from agent.migration.target import TargetMigrations
from agent.migration.target_table import Incoming
from agent.rpc import pb
from agent.service.metrics import AgentMetrics, Sources
from agent.snapshots.member import MemberSnapshots
from agent.snapshots.protect import Protections
from agent.snapshots.protector import ProtectorClaims
from agent.snapshots.recover import GroupRecovery
from agent.snapshots.restores import MemberRestores
from agent.snapshots.store import SnapshotStore

log = logging.getLogger(__name__)

#: How often an agent expires leases and asks about unresolved migrations.
HOUSEKEEPING_S = float(os.environ.get("FERRY_HOUSEKEEPING_S", "5"))
#: How long a dead node's agent is given to answer before its member counts as lost. Its lease
#: has expired already, so its members are fenced: an agent slower than this costs a needless
#: recovery, never a second copy.
PROBE_S = 1.5


@dataclass(frozen=True)
class NodeInfo:
    node: str
    version: str
    criu_version: str
    staging_dir: str
    staging_free_bytes: int
    agent_id: str
    peers: tuple[str, ...] = ()  # its config's peer agents, so a client can find a group's members
    post_copy: bool = False  # its CRIU can restore lazily (non-cooperative userfaultfd)


class AgentNode:
    """Everything one agent is, wired once: the job registry, both sides of migrations, recovery,
    self-healing and its GPU health monitor. It owns the agent's threads: housekeeping, the
    health monitor, and one thread per move (counted, so a graceful stop can wait for them, as
    it waits for the calls that restore or suspend a job: Commit, Restore, Preempt)."""

    def __init__(
        self,
        state_dir: Path,
        node: str,
        staging_root: Path,
        criu: Criu | None = None,
        make_cuda: Callable[[GpuLedger], CudaJobs] | None = None,
        dial: client.Dial | None = None,
        config: AgentConfig | None = None,
        selftest: Runner | None = None,
    ) -> None:
        self.node = node
        #: How this agent reaches peers: its node certificate, or plaintext on loopback (--insecure).
        self.dial = dial or client.Dial(insecure=True)
        self.peers = client.PeerClients(self.dial)  # the small calls' kept channels
        #: Plaintext loopback callers are trusted only when the agent was started with --insecure.
        self.insecure = self.dial.identity is None
        self.agent_id = uuid.uuid4().hex
        self.staging_root = staging_root
        self.criu = criu or Criu(node=node)
        #: Kernel features CRIU confirmed or denied (`criu check --feature`), asked once each.
        self._criu_features: dict[str, bool] = {}
        self.config = config or AgentConfig()
        self.registry = JobRegistry(state_dir, node, network=JobNetwork(self.config.network, node))
        self.journal = Journal(state_dir)
        #: The one owner of every claim on this node's GPUs; the CUDA side keeps frozen jobs there.
        self.gpus = GpuLedger(self.registry, Quarantine(state_dir), health=lambda: self.monitor.snapshot())
        #: Read-only here (`ferry health` shows it); changed only through the ledger.
        self.quarantine = self.gpus.quarantine
        #: Built around the ledger, which only this builds (tests give fakes through make_cuda).
        build = make_cuda or (lambda ledger: host_cuda_jobs(node, self.config.cuda, ledger, state_dir))
        self.cuda = build(self.gpus)
        self.targets = TargetMigrations(
            self.registry, self.criu, staging_root, node, self.cuda, self.journal, self.gpus
        )
        self.recovery = SourceRecovery(
            self.registry,
            self.journal,
            self.cuda.driver,
            node,
            lambda a: client.PeerClient(a, self.dial),
            ledger=self.gpus,
        )
        self._moves = 0
        self._moves_lock = threading.Condition()
        self.stopping = threading.Event()
        self.events = EventLog(state_dir, node)
        for bad in self.registry.unreadable.values():  # on record where `ferry events` shows it
            self.events.record("alert", f"{bad.refusal()}; {bad.hint}", job=bad.name)
        for cut in self.cuda.driver.calls.in_flight.left_over:  # driver calls the last run's end cut short
            self.events.record("alert", f"{cut.describe()}; its CUDA state is what that call left")
        self.healing = SelfHealing(
            node=node,
            registry=self.registry,
            events=self.events,
            ledger=self.gpus,
            config=self.config,
            hooks=Hooks(
                inventory=self.cuda.nvml.inventory,
                peer=lambda address: client.PeerClient(address, self.dial),
                migrate=self._auto_migrate,
                spawn=self._spawn,
                suspend=lambda job, out: self._checkpoint(job, out, False, lambda p: None, suspend=True),
                resume=self._resume,
                agent_id=self.agent_id,
                keeper=lambda rec: self.snapshot_members.keeper_of(rec),  # built below
            ),
            state_dir=state_dir,
            health=lambda: self.monitor.snapshot(),
        )
        self.monitor = HealthMonitor(
            nvml_module(), self.config.health, node=node, on_poll=self.healing.on_poll
        )
        reads = Sources(self.registry.list, self.monitor.snapshot, self.quarantine.all, staging_root)
        self.metrics = AgentMetrics(node, self.criu_version(), reads)  # what it reads, not the node
        self.stragglers = StragglerWatch(
            node=node,
            registry=self.registry,
            config=self.config,
            healing=self.healing,
            events=self.events,
            ask=lambda address, group, timeout_s: self.peers.get(address).pace(group, timeout_s),
            observe=self.metrics.pace,
            arriving=self.targets.arriving,
            gpus=lambda: gpu_pace(
                {u: [h.job.name for h in hs] for u, hs in self.healing.jobs_by_gpu().items()},
                self.monitor.snapshot(),
                self.monitor.brakes,
            ),
        )
        self.targets.on_end = self.metrics.target_ended
        #: Verify before trust: a lease's GPUs self-test first; idle ones on a schedule.
        self.verifier = GpuVerifier(
            self.config.verify,
            quarantine=self.gpus.quarantine_gpu,
            record=lambda kind, message, gpu: self.events.record(kind, message, gpu=gpu),
            observe=self.metrics.selftest,
            runner=selftest,  # tests with a fake CUDA driver give its self-test; None: the real one
        )
        self.targets.verify = self.verifier.require
        #: A large move's path, probed before its Prepare.
        self.path_check = PathCheck(
            self.config.verify,
            lambda address: client.PeerClient(address, self.dial).probe_path,
            lambda kind, message, job: self.events.record(kind, message, job=job),
        )
        #: This node's lease in etcd (`[coordination]`), fencing its members when it cannot renew.
        coord = self.config.coordination
        self.liveness = for_agent(coord, node, self.registry, self.dial.identity, self.events, self._answers)
        self.registry.on_restored = self._word_to_restored
        # Group snapshots: this node's members' part in a round, the images it keeps as a
        # buddy, and the groups it protects (their rounds' coordinator).
        snap = self.config.snapshots
        self.snapshot_store = SnapshotStore(Path(snap.dir), node)
        # A move's increment over a chain this node keeps, and the member's next dump over that.
        self.targets.admission.kept = self.snapshot_store.kept
        self.targets.restorer.tracks = self._tracks_dirty
        self.targets.restorer.chain_log_level = snap.criu_log_level
        self.targets.restorer.adopt = self._adopt_moved
        self.snapshot_members = MemberSnapshots(
            node,
            Path(snap.dir) / ".taken",
            self._group_members,
            self._snapshot_save,
            self._push_snapshot,
            tracks=self._tracks_dirty,
            full_every=snap.full_every,
        )
        self.snapshot_restores = MemberRestores(
            node,
            Path(snap.dir) / ".restore",
            self.registry,
            self._fetch_snapshot,
            self._restore_snapshot,
            adopt=self.snapshot_members.adopt,
        )
        live = self.liveness
        self.protections = Protections(
            state_dir,
            node,
            snap,
            self._snapshot_call,
            members=(lambda g: list(dict.fromkeys(m.agent for m in live.members(g)))) if live else None,
            claims=ProtectorClaims(live) if live else None,
            blocked=live.round_blocked if live else lambda group: "",
            stale=live.snapshot_stale if live else lambda group, snap: "",
            # With etcd, live spares keep the images (a recovery onto one then fetches nothing);
            # without it no one can say which spare lives, and the members' ring keeps them.
            keepers=(lambda agents: live.keepers(self._spares(), agents)) if live else lambda agents: [],
            dead=live.agents_without_lease if live else lambda agents: set(),
            record=lambda kind, message: self.events.record(kind, message),
            observe=self.metrics.snapshot_round,
        )
        #: With [coordination]: the recoveries of groups whose member's node died (etcd says who).
        self.recoveries = None
        if live is not None:
            self.recoveries = GroupRecovery(
                live,
                spares=self._spares,
                node_of=self._node_of,
                call=self._snapshot_call,
                hold_s=snap.hold_s,
                record=lambda kind, message: self.events.record(kind, message),
                observe=self.metrics.recovered,
            )
            live.on_lost = self.recoveries.start

    def _word_to_restored(self, rec: JobRecord) -> None:
        """A restored copy's watchdog counts what its source told it: this node's word replaces
        it before the copy runs. Only a group member on a node with [coordination] is watched."""
        live = self.liveness
        fence.word(rec, live.word_ms() if live is not None and rec.group else fence.DISARM)

    # -- group snapshots ---------------------------------------------------------------

    def _group_members(self, group: str) -> list[JobRecord]:
        """The group's members that run here, for a snapshot round's hold; refused while one's
        memory is still arriving (a post-copy move: its round is tried again in a second)."""
        recs = [r for r in self.registry.list() if r.group == group and r.state is JobState.RUNNING]
        for r in recs:
            if why := self.targets.arriving(r.name):
                raise JobBusyError(
                    f"member {r.name} of group {group} cannot be saved yet: {why}",
                    step="snapshot hold",
                    node=self.node,
                    hint="the next round, a second later, saves it once its memory is all here",
                )
        return recs

    def _snapshot_save(
        self,
        job: str,
        out: Path,
        hold: Callable[[Dumped], None],
        went_on: Callable[[float], None],
        track_mem: bool,
        parent: Path | None,
        warm: bool,
    ) -> MigrationResult:
        with self.counted():  # a graceful stop waits for a held member to go on
            args = (self.registry, self.criu, job, out, self.node, True)
            return checkpoint(
                *args,
                journal=self.journal,
                cuda_jobs=self.cuda,
                hold=hold,
                went_on=went_on,
                track_mem=track_mem,
                parent=parent,
                warm=warm,
                log_level=self.config.snapshots.criu_log_level,
            )

    def _adopt_moved(self, inc: Incoming, rec: JobRecord) -> None:
        """A member moved here as an increment over the chain this node kept: that image becomes its
        last dump (MemberSnapshots.adopt), under a number etcd gives it (no round uses it), so that
        its next round dumps only what it wrote since. Without etcd, or should that fail, the next
        round dumps it whole, as after any move."""
        claims = self.protections.claims
        if claims is None or not rec.group or inc.chain is None:
            return
        try:
            epoch = claims.number(rec.group, inc.chain.epoch)
            self.snapshot_members.adopt(rec.group, epoch, rec.name, inc.image_dir, rec)
        except FerryError as e:
            log.info("job %s: its next snapshot is whole: %s", rec.name, e)

    def _tracks_dirty(self) -> bool:
        """Snapshot dumps track dirty memory here: [snapshots] incremental, and the kernel can."""
        return self.config.snapshots.incremental and self._criu_feature("mem_dirty_track")

    def _criu_feature(self, name: str) -> bool:
        """A kernel feature, asked of CRIU once."""
        if name not in self._criu_features:
            try:
                self._criu_features[name] = self.criu.feature(name)
            except FerryError:
                return False  # no usable CRIU now: asked again next time
        return self._criu_features[name]

    def _push_snapshot(self, buddy: str, chunks: Iterator[pb.ImageChunk]) -> pb.StoredSnapshot:
        return client.PeerClient(buddy, self.dial).store_snapshot(chunks)

    def _fetch_snapshot(self, buddy: str, key: pb.SnapshotKey) -> Iterator[pb.ImageChunk]:
        return client.PeerClient(buddy, self.dial).fetch_snapshot(key)

    def _restore_snapshot(
        self, image: Path, job: str, hold: Callable[[JobRecord], None], keep_logs: bool
    ) -> JobRecord:
        with self.counted():  # a graceful stop waits for a held member to go on
            args = (self.registry, self.criu, image, job, self.node, self.cuda, self.journal)
            # MemberRestores checked the image as it fetched it, into memory only it writes.
            # Tracked from the restore on, the member's next dump may be an increment over it.
            track, level = self._tracks_dirty(), self.config.snapshots.criu_log_level
            return restore_image(
                *args, hold=hold, keep_logs=keep_logs, verified=True, track_mem=track, log_level=level
            )

    def _snapshot_call(
        self, agent: str, req: pb.SnapshotMemberRequest, timeout_s: float
    ) -> pb.SnapshotMemberResponse:
        return self.peers.get(agent).snapshot_member(req, timeout_s)

    def snapshot_member(self, req: pb.SnapshotMemberRequest) -> pb.SnapshotMemberResponse:
        """One step of a round on this node (agent.snapshots.member); DROP also drops, as a
        buddy, every stored copy of the group but the round `req.epoch`'s."""
        m, group, epoch = self.snapshot_members, req.group, req.epoch
        if req.action == pb.SNAPSHOT_ACTION_WARM:
            m.warm(group)
            helds = []
        elif req.action == pb.SNAPSHOT_ACTION_HOLD:
            helds = m.hold(group, epoch, req.hold_s or self.config.snapshots.hold_s)
        elif req.action == pb.SNAPSHOT_ACTION_RELEASE:
            helds = m.release(group, epoch)
        elif req.action == pb.SNAPSHOT_ACTION_SHIP:
            if not req.buddy:
                raise InvalidArgumentError("SHIP needs the buddy's agent address")
            helds = m.ship(group, epoch, req.buddy)
        elif req.action == pb.SNAPSHOT_ACTION_DROP:
            m.drop(group, epoch)
            self.snapshot_store.keep_only(group, epoch)
            helds = []
        else:
            return self._rollback_step(req)
        return pb.SnapshotMemberResponse(node_name=self.node, members=[h.pb() for h in helds])

    def _rollback_step(self, req: pb.SnapshotMemberRequest) -> pb.SnapshotMemberResponse:
        r, group, epoch, job = self.snapshot_restores, req.group, req.epoch, req.job
        out = pb.SnapshotMemberResponse(node_name=self.node)
        if req.action in (pb.SNAPSHOT_ACTION_FETCH, pb.SNAPSHOT_ACTION_RESTORE):
            check_job_name(job)
        if req.action == pb.SNAPSHOT_ACTION_FETCH:
            if not req.buddy and not req.local_dir:
                raise InvalidArgumentError("FETCH needs the buddy's agent address or a copy here")
            out.members.add(job=job, bytes=r.fetch(group, epoch, job, req.buddy, req.local_dir))
        elif req.action == pb.SNAPSHOT_ACTION_END:
            for ended in r.end(group, epoch):
                out.members.add(job=ended)
        elif req.action == pb.SNAPSHOT_ACTION_RESTORE:
            r.restore(group, epoch, job, req.hold_s or self.config.snapshots.hold_s)
            out.members.add(job=job)
        elif req.action == pb.SNAPSHOT_ACTION_LIST:
            # A round that holds members here would keep them frozen (and not endable) until its
            # hold_s: the rollback or recovery that asks comes first.
            if abandoned := self.snapshot_members.abandon(group):
                log.warning(
                    "snapshot of %s abandoned for a rollback of group %s", ", ".join(abandoned), group
                )
            for job in r.running(group):
                out.members.add(job=job)
            out.ended.extend(r.ended(group, epoch))
        elif req.action == pb.SNAPSHOT_ACTION_RESUME:
            for resumed in r.resume(group, epoch):
                out.members.add(job=resumed)
        else:
            raise InvalidArgumentError(f"unknown snapshot action {req.action}")
        return out

    def _node_of(self, address: str) -> str:
        """The node name of the agent at address, if it answers within PROBE_S ("" if not)."""
        try:
            return self.peers.get(address).info(timeout_s=PROBE_S).node_name
        except FerryError:
            return ""

    def _spares(self) -> list[str]:
        return [p.address for p in self.config.peers if p.spare]

    def _answers(self, address: str) -> str:
        """ "" if the agent at address answers within PROBE_S; else why not, in words."""
        try:
            self.peers.get(address).info(timeout_s=PROBE_S)
            return ""
        except FerryError as e:
            return e.cause

    # -- start and housekeeping ----------------------------------------------------------

    def recover(self) -> None:
        """Before serving: unwind incoming migrations the last run left; then, in the background
        (it asks peers), settle outgoing ones, and keep expiring leases and asking about
        unresolved migrations."""
        # Every record must be readable before anything is served: one that is not may stand for
        # a frozen copy here (source) or a held restore (target, which recover() reads strictly).
        self.journal.load(SOURCE, strict=True)
        fence.hold_all(self.registry)  # fenced by the last run: held until etcd settles them
        if self.liveness is not None:
            self.liveness.fence_at_start()
        for line in self.targets.recover():
            log.warning("recovered incoming migration %s", line)
        if n := sweep_keys(self.staging_root):
            log.info("removed %d one-time data key(s) that the last run left", n)

        def loop() -> None:
            for line in self.recovery.recover():
                log.warning("recovered outgoing migration %s", line)
            while not self.stopping.wait(HOUSEKEEPING_S):
                try:
                    self.targets.expire(self.liveness.without_lease if self.liveness else None)
                    self.recovery.poll()
                    self.healing.resume_preempted()
                except Exception:
                    log.exception("housekeeping failed; trying again in %.0f s", HOUSEKEEPING_S)

        threading.Thread(target=loop, name="housekeeping", daemon=True).start()
        threading.Thread(target=self.monitor.run, args=(self.stopping,), name="health", daemon=True).start()
        watch = self.stragglers.run
        threading.Thread(target=watch, args=(self.stopping,), name="stragglers", daemon=True).start()
        threading.Thread(target=self._check_spares, args=(self.stopping,), name="spares", daemon=True).start()

    def _check_spares(self, stopping: threading.Event) -> None:
        """Idle GPUs self-test on a schedule (`[verify] every_s`), so that a spare's verdict is
        ready before a move needs it and a spare that went bad is quarantined before it is chosen."""
        cfg = self.config.verify
        if not cfg.every_s or cfg.selftest == "off":
            return
        tick = min(60.0, cfg.every_s / 4)
        wait = min(tick, 2.0)  # the first round soon after the start, once the monitor has polled
        while not stopping.wait(wait):
            wait = tick
            try:
                held = self.gpus.unavailable("")  # jobs, claims, holds, quarantine, ill health
                busy = self.healing.jobs_by_gpu()
                idle = [g.uuid for g in self.monitor.snapshot() if g.uuid not in held and g.uuid not in busy]
                self.verifier.idle_round(idle)
            except Exception:
                log.exception("the idle GPUs' self-test failed; trying again in %.0f s", tick)

    def stop_housekeeping(self) -> None:
        self.stopping.set()
        self.peers.close()

    # -- bookkeeping for graceful stop -------------------------------------------------

    def _in_flight(self, delta: int) -> None:
        with self._moves_lock:
            self._moves += delta
            self._moves_lock.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        with self._moves_lock:
            return self._moves_lock.wait_for(lambda: self._moves == 0, timeout=timeout_s)

    @contextlib.contextmanager
    def counted(self) -> Iterator[None]:
        """Work a graceful stop waits for, as for a move: a restore, a preemption's suspend."""
        self._in_flight(+1)
        try:
            yield
        finally:
            self._in_flight(-1)

    def _spawn(self, work: Callable[[], None]) -> None:
        """Self-healing's work on its own thread, counted as a move in flight."""

        def run() -> None:
            try:
                work()
            finally:
                self._in_flight(-1)

        self._in_flight(+1)
        try:
            threading.Thread(target=run, name="healing", daemon=True).start()
        except BaseException:
            self._in_flight(-1)
            raise

    def _resume(self, rec: JobRecord) -> JobRecord:
        with self.counted():
            return resume_preempted(self.registry, self.criu, rec, self.node, self.cuda, self.journal)

    def _source_migration(
        self, spec: MigrationSpec, emit: Callable[[Progress], None] = lambda p: None
    ) -> SourceMigration:
        peer = client.PeerClient(spec.target, self.dial)
        return SourceMigration(
            spec,
            self.registry,
            self.criu,
            peer,
            self.staging_root,
            self.node,
            self.agent_id,
            emit,
            cuda_jobs=self.cuda,
            journal=self.journal,
            path_check=self.path_check,
            chains=self.snapshot_members,
        )

    def _auto_migrate(self, job: str, target: str, reason: str, lock_timeout_s: float | None) -> object:
        spec = MigrationSpec.by(
            Method.DEFAULT, job, target, uuid.uuid4().hex[:16], reason=reason, lock_timeout_s=lock_timeout_s
        )
        return self._send(spec)

    def _checkpoint(
        self, job: str, out: Path, leave: bool, emit: Emit, suspend: bool = False
    ) -> MigrationResult:
        """`ferry checkpoint` and a preemption's suspend, journaled like a move."""
        args = (self.registry, self.criu, job, out, self.node, leave, emit)
        return checkpoint(*args, journal=self.journal, cuda_jobs=self.cuda, suspend=suspend)

    def run_move(
        self, work: Callable[[Callable[[Progress], None]], MigrationResult]
    ) -> Iterator[Progress | MigrationResult]:
        """Run a move on its own thread so a client that goes away cannot cut it in half."""
        events: queue.Queue[object] = queue.Queue()

        def run() -> None:
            try:
                events.put(work(events.put))
            except BaseException as e:
                events.put(e)
            finally:
                self._in_flight(-1)

        self._in_flight(+1)
        threading.Thread(target=run, name="move", daemon=True).start()
        while True:
            item = events.get()
            if isinstance(item, BaseException):
                raise item
            assert isinstance(item, Progress | MigrationResult)
            yield item
            if isinstance(item, MigrationResult):
                return

    # -- operations the servicer calls ---------------------------------------------------

    def criu_version(self) -> str:
        """CRIU's version, or why it cannot be used (GetInfo and the metrics' build info)."""
        try:
            return self.criu.require_usable()
        except FerryError as e:
            return f"unusable: {e.cause}"

    def info(self) -> NodeInfo:
        criu_version = self.criu_version()
        self.staging_root.mkdir(mode=0o700, parents=True, exist_ok=True)
        free = shutil.disk_usage(self.staging_root).free
        peers = tuple(p.address for p in self.config.peers)
        return NodeInfo(
            self.node,
            __version__,
            criu_version,
            str(self.staging_root),
            free,
            self.agent_id,
            peers,
            self._post_copy(),
        )

    def _post_copy(self) -> bool:
        """Whether this node can restore a post-copy move (a kernel feature)."""
        return self._criu_feature("uffd-noncoop")

    def run_job(
        self,
        name: str,
        command: list[str],
        cwd: str,
        env: list[str],
        priority: Priority,
        on_degraded: OnDegraded,
        gpus: list[str],
        group: str = "",
        max_pause_s: float = 0.0,
        protect_every_s: float = 0.0,
    ) -> JobRecord:
        """`ferry run`: the job's GPUs (if it names any) claimed before it starts. The servicer has
        turned the request's enums into these (agent.service.convert), defaults included. With
        protect_every_s this agent protects the job's group too (checked before the job starts)."""
        check_job_name(name)
        if protect_every_s:
            self._check_protect(group, protect_every_s)
        if len(set(gpus)) != len(gpus):
            raise InvalidArgumentError(f"--gpu lists a GPU twice: {', '.join(gpus)}")
        owner = f"the start of job {name}"
        chip = ""
        if gpus:
            inv = self.cuda.nvml.inventory()  # before the ledger's lock: NVML may hang
            chip = self.gpus.decide(
                owner, name, lambda taken, _frozen: (self._check_gpus(inv, gpus, taken), gpus)
            )
        try:
            rec = self.registry.launch(
                name,
                command,
                cwd or "/",
                env,
                priority=priority.value,
                on_degraded=on_degraded.value,
                gpus=gpus,
                gpu_chip=chip,
                group=group,
                max_pause_s=max_pause_s,
            )
        finally:
            self.gpus.release(owner)
        if protect_every_s:  # the job runs: a refusal here could only be a bug, and it would say so
            self.protections.protect(group, protect_every_s, [], check=False)
        return rec

    def _check_protect(self, group: str, every_s: float) -> None:
        """`ferry run --protect`: refused before the job starts when it could not be kept."""
        if not group:
            raise InvalidArgumentError("--protect needs --group: the group whose snapshots it keeps")
        if self.liveness is None:
            raise RefusedError(
                "--protect finds the group's members through etcd, and this agent has no [coordination]",
                step="run",
                node=self.node,
                hint="configure [coordination], or run the job without --protect and name every member's "
                "agent with `ferry protect GROUP --members-on HOST:PORT`",
            )
        self.protections.check_every(every_s)

    def _check_gpus(self, inv: Inventory, gpus: list[str], unavailable: dict[str, str]) -> str:
        """GPUs for `ferry run --gpu`: present, one chip, and free; returns the chip."""
        if not inv.available:
            raise RefusedError(f"--gpu needs this node's GPUs, but {inv.detail}", step="run", node=self.node)
        chips = set()
        for u in gpus:
            g = inv.by_uuid(u)
            if g is None:
                known = ", ".join(f"{x.uuid} (index {x.index})" for x in inv.gpus) or "none"
                raise InvalidArgumentError(
                    f"no GPU {u} on {self.node}; its GPUs: {known}", hint="see `ferry gpus`"
                )
            if why := unavailable.get(u):
                raise RefusedError(f"GPU {u} {why}", step="run", node=self.node, hint="see `ferry health`")
            chips.add(g.name)
        if len(chips) > 1:
            raise InvalidArgumentError(
                f"--gpu mixes chips ({', '.join(sorted(chips))}); a job runs on one kind"
            )
        return chips.pop()

    def migrate(self, name: str, target: str, method: Method) -> Iterator[Progress | MigrationResult]:
        client.split_address(target)
        self.registry.get(name)  # NOT_FOUND before anything starts
        spec = MigrationSpec.by(method, name, target, uuid.uuid4().hex[:16])
        return self.run_move(lambda emit: self._send(spec, emit))

    def _send(
        self, spec: MigrationSpec, emit: Callable[[Progress], None] = lambda p: None
    ) -> MigrationResult:
        """One move away from here, counted in the metrics however it ends."""
        try:
            result = self._source_migration(spec, emit).run()
        except BaseException:
            self.metrics.source_ended(None)
            raise
        self.metrics.source_ended(result)
        return result

    def checkpoint(
        self, name: str, out_dir: str, leave_running: bool
    ) -> Iterator[Progress | MigrationResult]:
        if not out_dir or not os.path.isabs(out_dir) or "\0" in out_dir:
            raise InvalidArgumentError(f"--out must be an absolute directory path, got {out_dir!r}")
        if os.path.exists(out_dir) and not os.path.isdir(out_dir):
            raise InvalidArgumentError(f"--out {out_dir} exists and is not a directory")
        self.registry.get(name)
        out = Path(out_dir)
        return self.run_move(lambda emit: self._checkpoint(name, out, leave_running, emit))

    def restore(self, image: str, name: str, as_copy: bool = False) -> JobRecord:
        if not os.path.isabs(image):
            raise InvalidArgumentError(f"image directory must be an absolute path, got {image!r}")
        if name:
            check_job_name(name)
        with self.counted():
            args = (self.registry, self.criu, Path(image), name, self.node, self.cuda, self.journal)
            return restore_image(*args, as_copy=as_copy)  # as_copy: a second copy, named `name`

    def resolve(self, name: str, action: Resolution) -> JobRecord:
        check_job_name(name)
        self.recovery.resolve(name, action)
        return self.registry.get(name)

    def clear_gpu(self, gpu: str) -> tuple[GpuHealth | None, Entry | None]:
        """`ferry gpus --clear`: the GPU as read after the clear, and the quarantine it left."""
        g = self.monitor.get(gpu)
        entry = self.gpus.clear_quarantine(gpu)
        if g is None and entry is None:
            known = ", ".join(x.uuid for x in self.monitor.snapshot()) or "none"
            raise NotFoundError(f"no GPU {gpu!r} here; its GPUs: {known}", hint="see `ferry health`")
        self.monitor.clear(gpu)
        self.healing.cleared(gpu)
        self.verifier.forget(gpu)  # fixed, says the operator: tested again before its next job
        self.monitor.poll()
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(entry.since)) if entry else ""
        was = f"quarantined since {since}" if entry else "not quarantined"
        self.events.record("quarantine", f"GPU {gpu} cleared by an operator ({was})", gpu=gpu)
        return self.monitor.get(gpu) or g, entry
