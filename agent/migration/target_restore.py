"""The target's Commit: restore the verified image held, journal RUNNING (the commit point),
then release the job.

After the release a member of a distributed job has its connections watched, on a thread of
their own, for how long its peers went without it (agent.migration.peerwait): the commit answer
never waits for that, since the source holds its frozen copy until it hears.

A crash before the commit point leaves the job held, and recovery kills it; after, recovery
answers RUNNING. A restore that fails before it is unwound here (UNWINDING, then ABORTED once
nothing of it is left), so the source may resume its copy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from agent import faults
from agent.criu.logs import CriuLogs
from agent.criu.options import LOG_LEVEL
from agent.criu.runner import START_TIMEOUT_S, Criu
from agent.cuda.jobs import CudaJobs
from agent.errors import RefusedError, TransferError
from agent.jobs import procs
from agent.jobs.record import JobRecord
from agent.jobs.registry import JobRegistry
from agent.migration.pagestream import LazyTargetPages
from agent.migration.peerwait import PeerWaits, watched
from agent.migration.restore import cpu_ns, restore_tree, resumed_after
from agent.migration.states import TargetState
from agent.migration.target_effects import TargetEffects
from agent.migration.target_table import Effect, Incoming, IncomingTable
from agent.rpc import pb

log = logging.getLogger(__name__)


class Restorer:
    """Restores incoming migrations on Commit."""

    def __init__(
        self,
        table: IncomingTable,
        effects: TargetEffects,
        registry: JobRegistry,
        criu: Criu,
        cuda: CudaJobs,
        criu_logs: CriuLogs,
        node: str,
        peer_waits: PeerWaits,
    ) -> None:
        self.table = table
        self.effects = effects
        self.registry = registry
        self.criu = criu
        self.cuda = cuda
        self.criu_logs = criu_logs
        self.node = node
        #: The peers' wait after each member's release, by migration id (kept in memory).
        self.peer_waits = peer_waits
        #: Whether this node's CRIU tracks a restored tree's written memory (the agent sets it).
        self.tracks: Callable[[], bool] = lambda: False
        #: CRIU's -v for a chain move's restore, which reads a snapshot's chain as a rollback does
        #: (the agent sets it to [snapshots] criu_log_level); any other restore logs at LOG_LEVEL.
        self.chain_log_level = LOG_LEVEL
        #: adopt(migration, restored job): a chain move's image becomes the member's last dump
        #: here (its next round's dump an increment over it); runs before staging goes, never raises.
        self.adopt: Callable[[Incoming, JobRecord], None] = lambda inc, rec: None

    def commit(self, inc: Incoming, look_s: float) -> pb.CommitResponse:
        """Restore it; look_s: how long to look, after the release, for the job to run."""
        mid = inc.migration_id
        with self.table.lock:
            if inc.manifest is None or inc.state is not TargetState.VERIFIED:
                raise RefusedError(f"migration {mid} has no verified image to restore", node=self.node)
            stream = self.table.streams.get(mid)
            if inc.lazy and not isinstance(stream, LazyTargetPages):
                raise RefusedError(
                    f"post-copy migration {mid} has no page stream to take memory from", node=self.node
                )
            self.table.set_locked(inc, TargetState.RESTORING)
        manifest = inc.manifest
        times: dict[str, float] = {}
        held_ns = [0]  # the job's CPU time while it is still held, just before its release
        after: list[Effect] = []  # what RUNNING leaves to do, once the job runs
        passed = [False]  # the commit point: from there on the job is this node's one copy

        def commit_point(rec: JobRecord) -> None:
            inc.job_pid, inc.job_started = rec.pid, rec.pid_started  # journaled with RUNNING
            after.extend(self._commit_point(inc))
            passed[0] = True
            held_ns[0] = cpu_ns(procs.tree_pids(rec.pid))

        def criu_started(pid: int) -> None:
            with self.table.lock:
                inc.criu_pid, inc.criu_started = pid, procs.create_time(pid)
                self.table.save_locked(inc)
            if isinstance(stream, LazyTargetPages):
                stream.criu_started(pid)

        try:
            faults.check("target-restore", self.node)
            work_dir = self.criu_logs.dir_for(mid)  # CRIU's logs; a lazy daemon listens there
            if isinstance(stream, LazyTargetPages):
                stream.attach(self.criu, inc.staging, work_dir, START_TIMEOUT_S)
            # The job commits here: no ended record of its name answers for it from now on (an
            # aborted lease, before this, left such a record and its logs alone).
            self.registry.forget_final(inc.job)
            rec = restore_tree(
                self.registry,
                self.criu,
                inc.image_dir,
                manifest,
                inc.job,
                note=f"moved here from {inc.source_node}" + (f" ({inc.reason})" if inc.reason else ""),
                cuda_jobs=self.cuda,
                gpu_map=inc.gpu_map,
                times=times,
                on_criu_start=criu_started,
                before_release=commit_point,
                lazy_pages=inc.lazy,
                log_dir=work_dir,
                # Over a kept chain: tracked from here, so that its next round is an increment.
                track_mem=inc.chain is not None and self.tracks(),
                log_level=self.chain_log_level if inc.chain is not None else LOG_LEVEL,
            )
        except BaseException as e:
            if not passed[0]:  # restore_tree killed whatever it restored
                self.effects.unwind(inc, f"restore failed: {e}")
                raise
            # Past the commit point the job is this node's one copy: the commit succeeded,
            # whatever failed after it, or the source would resume a second copy.
            log.error("migration %s: the job runs here, but after its release: %s", mid, e)
            rec = self.registry.get(inc.job)
        released = time.monotonic()
        if watched(rec):
            self.peer_waits.start(mid, rec.pid, rec.address, released)
        resumed = resumed_after(rec, held_ns[0], look_s)
        if isinstance(stream, LazyTargetPages):
            stream.watch(rec.pid)
        if inc.chain is not None and passed[0]:
            self.adopt(inc, rec)  # before its staging goes: the image is linked from there
        self.effects.run(after)  # pre-copy: its staging, keys and logs go now
        took = ", ".join(f"{k} {v:.2f} s" for k, v in times.items())
        log.info("migration %s: job %s runs here as pid %d (%s)", mid, inc.job, rec.pid, took)
        return pb.CommitResponse(
            node_name=self.node,
            pid=rec.pid,
            phases=[pb.PhaseTiming(phase=k, seconds=v) for k, v in times.items()],
            resumed_after_s=resumed,
            answered_after_s=time.monotonic() - released,
        )

    def _commit_point(self, inc: Incoming) -> list[Effect]:
        """The restored job is registered and still held (stopped or CUDA-locked): once RUNNING
        (or POSTCOPY) is on disk it is the job's one copy."""
        faults.check("target-restored", self.node)
        with self.table.lock:
            if inc.state is TargetState.UNWINDING:  # the job would run on memory that is not there
                raise TransferError(f"the post-copy transfer failed: {inc.note}", step="restore")
            # Post-copy whose pages are all in already: nothing is left to wait for.
            done = not inc.lazy or inc.pages is not None
            return self.table.set_locked(inc, TargetState.RUNNING if done else TargetState.POSTCOPY)
