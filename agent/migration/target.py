"""The target side of a migration: leases, a checked intake into staging, restore on commit.

Every step is written to the migration journal before it acts, and only the
node that prepared a migration (by its certificate) may push, commit, abort or
ask about it. After a restart, `recover()` unwinds whatever was in flight: no
lease outlives the agent that granted it, and a restore the agent did not see
finish is killed, so the source may safely resume its frozen copy.

`TargetMigrations` is what the servicer calls. Its parts: the state table under the protocol
lock, whose transitions return effects (target_table), the executor that runs them outside it
(target_effects), admission (target_admission), the intake of a pushed image (target_intake),
the page streams (target_streams), the restore (target_restore) and recovery after a restart
(target_recovery).
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc

from agent.criu.logs import CriuLogs
from agent.criu.runner import Criu
from agent.cuda.jobs import CudaJobs
from agent.errors import (
    FerryError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    RefusedError,
    TransferError,
)
from agent.gpus.ledger import GpuLedger
from agent.jobs.registry import JobRegistry
from agent.migration.capture import warm_for_lease
from agent.migration.datatls import DataTls
from agent.migration.journal import TARGET, Journal, MigrationRecord
from agent.migration.peerwait import PeerWait, PeerWaits
from agent.migration.staging import no_space
from agent.migration.states import TargetState
from agent.migration.target_admission import LEASE_S, Admission, safe_id
from agent.migration.target_effects import TargetEffects
from agent.migration.target_intake import open_intake, receive
from agent.migration.target_recovery import recover_incoming
from agent.migration.target_restore import Restorer
from agent.migration.target_streams import StreamHost
from agent.migration.target_table import BEFORE_RESTORE, Incoming, IncomingTable, from_journal, lease_expired
from agent.migration.transfer import Intake
from agent.rpc import pb

log = logging.getLogger(__name__)

#: How long a target looks, after the job's release, for it to run (for the downtime figure):
#: a job runs within milliseconds of its release, so this bounds an answer that comes at once.
RESUME_LOOK_S = 0.5
#: How long an Abort waits for its drop before it answers anyway. A usual drop takes
#: milliseconds: then its slot is free and ABORTED journaled when the source hears back. A page
#: server slow to die (up to 40 s, past the source's 30 s deadline for the answer) is left to the
#: drop's own thread: DROPPING, journaled before this, is as good as fenced.
ABORT_WAIT_S = 0.5
#: How long a stopping agent waits for drops still running on their own threads: a page server's
#: longest death (agent.criu.child: 30 s to exit, 10 more after SIGKILL) and some. One still
#: running after that is left DROPPING on disk, and recovery ends it at the next start.
DROPS_WAIT_S = 45.0
#: A copy of the job may exist here: an Abort cannot take that back.
_REFUSE_ABORT = frozenset(
    {TargetState.RESTORING, TargetState.UNWINDING, TargetState.POSTCOPY, TargetState.RUNNING}
)


class TargetMigrations:
    """Incoming migrations on this node."""

    def __init__(
        self,
        registry: JobRegistry,
        criu: Criu,
        staging_root: Path,
        node: str,
        cuda_jobs: CudaJobs,
        journal: Journal,
        ledger: GpuLedger,
    ) -> None:
        self.registry = registry
        self.criu = criu
        self.cuda = cuda_jobs
        self.staging_root = staging_root
        self.node = node
        self.journal = journal
        #: CRIU's logs of each incoming migration: kept where the errors say when it fails.
        self.criu_logs = CriuLogs(registry.root.parent)
        #: Every GPU claim on this node (agent.gpus.ledger); a lease's GPUs are held there until
        #: its restore ends. The agent gives the node's one ledger (the CUDA side's too).
        self.ledger = ledger
        #: Told how each incoming migration ended: "committed" (the job runs here) or "aborted".
        self.on_end: Callable[[str], None] = lambda result: None
        #: Before a lease is granted, its GPUs pass their self-test or the lease is refused
        #: (agent.gpus.verify.GpuVerifier.require: (GPUs, for what)); the agent sets it.
        self.verify: Callable[[list[str], str], None] = lambda gpus, what: None
        #: How long an Abort waits for its drop before answering (ABORT_WAIT_S).
        self.abort_wait_s = ABORT_WAIT_S
        #: warm(staging, bytes) → seconds, before a granted lease answers (capture.warm_for_lease).
        self.warm: Callable[[Path, int], float] = warm_for_lease
        #: Where this node's page servers listen for a source's CRIU (the agent's own address).
        self.data_host = "0.0.0.0"
        self.table = IncomingTable(self.journal, self.ledger)
        self._incoming = self.table.entries  # the migrations in flight, by id
        self.effects = TargetEffects(self.table, registry, self.criu_logs, lambda result: self.on_end(result))
        self.admission = Admission(registry, criu, self.cuda, self.ledger, staging_root, node)
        self.streams = StreamHost(self.table, self.effects, criu, self.criu_logs, node)
        #: How long each moved member's peers went without it (agent.migration.peerwait).
        self.peer_waits = PeerWaits()
        self.restorer = Restorer(
            self.table, self.effects, registry, criu, self.cuda, self.criu_logs, node, self.peer_waits
        )

    # -- the protocol ------------------------------------------------------------

    def prepare(self, req: pb.PrepareRequest, caller: str = "") -> pb.Lease:
        self.expire()  # leases whose source went silent make room first
        inc = self.admission.lease(req, caller)
        keys: DataTls | None = None
        try:
            if inc.gpu_map:  # slow (a self-test per GPU, at once), so before the protocol lock
                try:
                    self.verify(list(inc.gpu_map.values()), f"job {req.job} from {req.source_node}")
                except FerryError as e:
                    raise e.at(node=self.node) from None
            keys, data_cert = self.admission.keys(req, inc)
            with self.table.lock:
                if req.migration_id in self._incoming or self.journal.get(TARGET, req.migration_id):
                    raise self.admission.refuse(
                        f"migration {req.migration_id} is already known here; ids are never reused"
                    )
                self.admission.admit_locked(req, self.table.busy_locked(), inc)
                self.table.add_locked(inc, keys)
        except BaseException:
            self.ledger.release(inc.lease_owner)
            if keys is not None:
                keys.close()
            raise
        warm_s = self.warm(self.staging_root, req.estimated_bytes)  # granted: the freeze comes next
        who, mib = f"certificate {caller}" if caller else "insecure loopback", req.estimated_bytes >> 20
        log.info(
            "migration %s: lease granted for job %s from %s (%s; up to %d MiB of memory touched in %.2f s)",
            *(req.migration_id, req.job, req.source_node, who, mib, warm_s),
        )
        return pb.Lease(
            migration_id=req.migration_id,
            node_name=self.node,
            max_bytes=inc.max_bytes,
            expires_at=inc.expires_at,
            gpu_map=[pb.GpuPair(old_uuid=o, new_uuid=n) for o, n in inc.gpu_map.items()],
            page_stream=bool(data_cert),
            lazy=inc.lazy,
            data_cert=data_cert,
            chain=inc.chain is not None,
        )

    def stream_pages(self, requests: Iterator[pb.PageData], caller: str = "") -> Iterator[pb.PageData]:
        """The control of the job's memory (agent.migration.target_streams)."""
        first = next(requests, None)
        if first is None or not first.migration_id:
            raise InvalidArgumentError("a page stream must start with its migration id", step="transfer")
        inc = self._get(first.migration_id, caller)
        yield from self.streams.serve(inc, requests, self.data_host)

    def push(self, chunks: Iterator[pb.ImageChunk], caller: str = "") -> pb.PushImageResponse:
        first = next(chunks, None)
        if first is None:
            raise InvalidArgumentError("empty image stream", step="transfer", node=self.node)
        inc = self._get(first.migration_id, caller)
        with self.table.lock:
            waiting = (TargetState.PREPARED, TargetState.STREAMED)
            lapsed = self.table.lapsed_locked(inc, waiting, "an image", self.node)
            if lapsed is None:
                self.table.set_locked(inc, TargetState.RECEIVING)
        if lapsed is not None:
            self.effects.finish(inc, lapsed)
            raise lease_expired(inc, self.node)
        intake: Intake | None = None
        try:
            intake = open_intake(inc, self.node)
            manifest = receive(inc, intake, first, chunks, self.node)
        except BaseException as e:
            if intake is not None:
                intake.close()
            if isinstance(e, grpc.RpcError):  # the request stream itself broke: the source went away
                e = TransferError(
                    "the source's stream broke off before the image was complete",
                    step="transfer",
                    node=self.node,
                )
                self.effects.drop(inc, e.cause)
                raise e from None
            self.effects.drop(inc, f"intake failed: {e}")  # a no-op if an Abort dropped it meanwhile
            if isinstance(e, OSError) and e.errno == errno.ENOSPC:
                raise no_space(inc.staging, self.node) from e
            if isinstance(e, OSError):  # a transfer failure, not a crash
                raise TransferError(
                    f"cannot write the image into {inc.image_dir}: {e.strerror}", node=self.node
                ) from e
            raise
        with self.table.lock:
            if inc.state is not TargetState.RECEIVING:  # aborted while the last bytes came in
                raise RefusedError(f"migration {inc.migration_id} was aborted", node=self.node)
            inc.manifest = manifest
            inc.expires_at = time.time() + LEASE_S  # the commit must come within a lease from now
            self.table.set_locked(inc, TargetState.VERIFIED)
        return pb.PushImageResponse(bytes=intake.bytes, files=len(intake.received))

    def commit(self, req: pb.CommitRequest, caller: str = "") -> pb.CommitResponse:
        """Restore held, journal RUNNING, release (agent.migration.target_restore)."""
        return self.restorer.commit(self._get(req.migration_id, caller), RESUME_LOOK_S)

    def abort(self, mid: str, reason: str, caller: str = "") -> None:
        safe_id(mid)
        with self.table.lock:
            inc = self._incoming.get(mid)
            if inc is None:
                rec = self.journal.get(TARGET, mid)
                if rec is None:
                    # Fencing: an id aborted before it arrived can never be prepared later.
                    tomb = MigrationRecord(mid, TARGET, "", "aborted", peer_name=caller, note=reason)
                    self.journal.save(tomb)
                    log.info("migration %s: aborted before it reached this node: %s", mid, reason)
                    return
                inc = from_journal(rec)
        self._check_caller(inc, caller)
        with self.table.lock:
            if inc.state in _REFUSE_ABORT:
                what = (
                    "already runs"
                    if inc.state in (TargetState.RUNNING, TargetState.POSTCOPY)
                    else "is restoring"
                )
                raise RefusedError(
                    f"migration {mid} {what} the job here; it cannot be aborted", node=self.node
                )
            # DROPPING: never restored from here on, as good as fenced; its dropper finishes.
            dropping = self.table.drop_locked(inc, f"aborted by the source: {reason}")
        # Answered once DROPPING is durable: the source resumes on that, and must not wait out a
        # page server's death (its deadline would turn the answer into UNKNOWN).
        if dropping is not None and not self.effects.finish_later(inc, dropping, self.abort_wait_s):
            log.info("migration %s: aborted; its drop goes on in the background", mid)

    def arriving(self, job: str) -> str:
        """Why `job`'s copy here is not whole yet ("" if it is, or came by no move): its restore
        is under way, or it runs while a post-copy move still brings its pages (a dump of it
        now would save pages that have not come: a snapshot that crashes when restored)."""
        with self.table.lock:
            for inc in self._incoming.values():
                if inc.job == job and inc.state in _REFUSE_ABORT - {TargetState.RUNNING}:
                    return f"its move here ({inc.migration_id} from {inc.source_node}) is {inc.state.value}"
        return ""

    def status(self, mid: str, caller: str = "") -> int:
        """GetMigration: takes the lock only to read the entry; finished ones are journaled."""
        safe_id(mid)
        with self.table.lock:
            inc = self._incoming.get(mid)
        if inc is None:
            rec = self.journal.get(TARGET, mid)
            if rec is None:
                return pb.TARGET_STATE_UNKNOWN
            inc = from_journal(rec)
        self._check_caller(inc, caller)
        return inc.state.wire

    def peer_wait(self, mid: str, wait_s: float, caller: str = "") -> PeerWait:
        """How long the peers of the member migration `mid` brought here went without it, waiting
        up to wait_s (bounded) for a measure still being taken. Asked by its source only."""
        self._get(mid, caller)
        found = self.peer_waits.get(mid, wait_s)
        if found is not None:
            return found
        why = "not a group member with a job address, or its agent restarted since"
        return PeerWait(not_measured=f"{self.node} has no measure of migration {mid} ({why})")

    def moved_here(self, mid: str, caller: str = "") -> str:
        """The job that migration `mid` runs here, asked by the node that moved it (StopMoved)."""
        safe_id(mid)
        rec = self.journal.get(TARGET, mid)
        if rec is None:
            raise NotFoundError(f"no migration {mid} came to this node", node=self.node)
        if rec.kind != "move":  # a local restore or resume: no node moved it here
            raise PermissionDeniedError(f"migration {mid} is a local {rec.kind} here", node=self.node)
        inc = from_journal(rec)
        self._check_caller(inc, caller)
        if inc.state not in (TargetState.RUNNING, TargetState.POSTCOPY):
            raise RefusedError(
                f"migration {mid} is {inc.state.value} here: job {inc.job} does not run here by it",
                node=self.node,
            )
        try:
            job = self.registry.get(inc.job)
        except NotFoundError:
            job = None
        if job is None or not inc.job_pid or (job.pid, job.pid_started) != (inc.job_pid, inc.job_started):
            # Its name may now be another job's: never stop that one.
            raise NotFoundError(
                f"job {inc.job}, which migration {mid} brought here, is no longer the job of that name",
                node=self.node,
            )
        return inc.job

    # -- housekeeping --------------------------------------------------------------

    def recover(self) -> list[str]:
        """After a restart (agent.migration.target_recovery); returns what was done."""
        return recover_incoming(self.journal, self.registry)

    def expire(self, dead: Callable[[set[str]], set[str]] | None = None) -> None:
        """Leases whose source went silent: free their slot and staging (run periodically, and by
        Prepare to make room). Synchronous: Prepare needs the room, and an expired lease holds no
        running CRIU (a pre-copy page server ends with STREAMED; a post-copy daemon starts at the
        commit), so what it waits for is only its staging's removal.

        `dead` (with [coordination]): of these source nodes, those etcd holds no lease for. A
        migration waiting on one (before its commit: the source still owns the job) is dropped at
        once, not after its lease: a recovery may restore that member here meanwhile, and a source
        that only lost etcd fences itself and finds the move aborted. A post-copy whose source
        has no lease fails at once too: its pages will not come (a dead source), and its page
        stream would take gRPC's keepalive (about 20 s) to say so, longer than a group member's
        peers wait in their collective. The copy here is killed and its member handed back to
        the source's node (agent.coord.liveness): a source that only lost etcd is fenced, and
        resumes its frozen copy once it has its lease again. Asked outside the lock."""
        gone: set[str] = set()
        if dead is not None:
            with self.table.lock:
                sources = {i.source_node for i in self.table.waiting_locked()}
                sources |= {i.source_node for i in self._post_copies_locked()}
            gone = dead(sources) if sources else set()
            with self.table.lock:
                orphans = [i for i in self._post_copies_locked() if i.source_node in gone]
            for inc in orphans:
                self.streams.post_copy_failed(inc, f"its source node {inc.source_node} has no lease in etcd")
        with self.table.lock:
            dropping = [(i, self.table.drop_locked(i, "lease expired")) for i in self.table.expired_locked()]
            dropping += [
                (i, self.table.drop_locked(i, f"its source node {i.source_node} has no lease in etcd"))
                for i in self.table.waiting_locked()
                if i.source_node in gone
            ]
        for inc, effects in dropping:
            log.warning("migration %s: %s; dropping its staged image", inc.migration_id, inc.note)
            self.effects.finish(inc, effects)

    def _post_copies_locked(self) -> list[Incoming]:
        return [i for i in self._incoming.values() if i.state is TargetState.POSTCOPY]

    def shutdown(self) -> int:
        """The agent stops, its server already closed: every incoming migration that has not
        begun its restore is dropped with its staging (its source, fencing, finds it aborted and
        resumes the job), and the drops that Aborts left running are waited for (bounded: one
        still running is ended by recovery at the next start). Returns how many were dropped."""
        why = f"the agent on {self.node} stopped"
        with self.table.lock:
            waiting = [i for i in self._incoming.values() if i.state in BEFORE_RESTORE]
            dropping = [(i, self.table.drop_locked(i, why)) for i in waiting]
        for inc, effects in dropping:
            self.effects.finish(inc, effects)
        if not self.effects.wait_background(DROPS_WAIT_S):
            log.warning(
                "drops still running after %.0f s (%s); the agent's next start finishes them",
                DROPS_WAIT_S,
                ", ".join(self.effects.background()),
            )
        return len(dropping)

    # -- internals -------------------------------------------------------------------

    def _get(self, mid: str, caller: str = "") -> Incoming:
        safe_id(mid)
        with self.table.lock:
            inc = self._incoming.get(mid)
        if inc is None:
            rec = self.journal.get(TARGET, mid)
            if rec is None:
                raise NotFoundError(f"no migration {mid!r} on this node", node=self.node)
            inc = from_journal(rec)
        self._check_caller(inc, caller)
        return inc

    def _check_caller(self, inc: Incoming, caller: str) -> None:
        if inc.peer_name and caller != inc.peer_name:
            log.warning(
                "migration %s: %r tried to act on %r's migration", inc.migration_id, caller, inc.peer_name
            )
            raise PermissionDeniedError(
                f"migration {inc.migration_id} belongs to node {inc.peer_name!r}, "
                f"not {caller or 'this caller'!r}",
                node=self.node,
            )
