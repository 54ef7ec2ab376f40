"""Settling outgoing migrations that a crash or a silent target left open.

The rule that keeps one copy of a job: the source resumes its frozen copy only
when the target is known not to run the job, and ends it only when the target
is known to run it. What the source's journal record says decides which is
possible:

- preparing, the CUDA freeze's states, dumping, transferring, aborting
  (states.NOT_SENT): commit was never sent, so the target cannot run the job.
  Tell it to abort (a tombstone fences the id there), wait for a CRIU dump that
  outlived us, and resume; the journaled state says how far the CUDA freeze got
  (states.cuda_left), so only a call cut off half-way needs the driver's word.
- restoring, paging, unresolved (states.MAYBE_SENT): commit may have reached the
  target. Ask it, fencing it if it has not begun restoring, and act on the one
  decision (agent.migration.fencing.decide): RUNNING ends the frozen copy, a
  confirmed FENCED resumes it, and anything else (no answer, an error, a restore
  not settled, a refused fence) keeps it frozen, marked UNRESOLVED with the
  reason and the command that settles it, and asked again every few seconds.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from agent.cuda import driver as cuda
from agent.errors import FerryError, InvalidArgumentError, NotFoundError, RefusedError
from agent.gpus.ledger import GpuLedger
from agent.image import verify
from agent.jobs import procs
from agent.jobs.network import LinkLock
from agent.jobs.record import JobState
from agent.jobs.registry import JobRegistry
from agent.migration import rollback, stops
from agent.migration.fencing import TargetAnswer, Verdict, ask_target, decide
from agent.migration.journal import SOURCE, Journal, MigrationRecord, state_of
from agent.migration.local import KIND_SUSPEND, end_saved
from agent.migration.model import Peer, Resolution, unresolved_note
from agent.migration.states import MAYBE_SENT, NOT_SENT, SOURCE_TRANSITIONS, MigrationState, cuda_left

log = logging.getLogger(__name__)

CRIU_WAIT_S = 120.0
_NOT_SENT = {s.value for s in NOT_SENT}
_MAYBE_SENT = {s.value for s in MAYBE_SENT}
_OPEN = frozenset(_NOT_SENT | _MAYBE_SENT)


class SourceRecovery:
    def __init__(
        self,
        registry: JobRegistry,
        journal: Journal,
        driver: cuda.CudaDriver,
        node: str,
        peer_for: Callable[[str], Peer],
        ledger: GpuLedger,
    ) -> None:
        self.registry = registry
        #: Where a frozen job's GPU memory is held (an in-process UNRESOLVED one); none after a restart.
        self.ledger = ledger
        self.journal = journal
        self.driver = driver
        self.node = node
        self.peer_for = peer_for
        #: One settlement at a time: the housekeeping loop and `ferry resolve` may race.
        self._lock = threading.Lock()
        #: Migrations whose settlement at start failed: housekeeping tries them again.
        self._retry: set[str] = set()

    def open_records(self) -> list[MigrationRecord]:
        return self.journal.load(SOURCE, states=_OPEN)

    def recover(self) -> list[str]:
        """At agent start: settle (or mark unresolved) every migration the last run left open."""
        done = []
        for rec in self.open_records():
            try:
                done.append(f"{rec.migration_id}: {self.settle(rec, restarted=True)}")
            except Exception as e:
                log.exception("migration %s (job %s): recovery failed", rec.migration_id, rec.job)
                done.append(f"{rec.migration_id}: recovery failed ({e}); tried again every few seconds")
                self._retry.add(rec.migration_id)
        return done

    def poll(self) -> None:
        """Ask again about unresolved migrations, and settle those whose recovery at start failed
        (never one this run of the agent is moving: those are neither)."""
        for rec in self.open_records():
            retry = rec.migration_id in self._retry
            if rec.state == MigrationState.UNRESOLVED.value or retry:
                try:
                    self.settle(rec, restarted=retry)
                    self._retry.discard(rec.migration_id)
                except Exception as e:  # asked again at the next pass
                    mid, job = rec.migration_id, rec.job
                    log.warning("migration %s (job %s): not settled yet: %s", mid, job, e)

    def resolve(self, job: str, action: Resolution) -> str:
        """`ferry resolve JOB [--resume|--finish]`: ask the target, or take the operator's word."""
        rec = next((r for r in self.open_records() if r.job == job), None)
        if rec is None:
            self.registry.get(job)  # NOT_FOUND for an unknown job
            raise RefusedError(f"job {job!r} has no unsettled migration on this node", node=self.node)
        if rec.state != MigrationState.UNRESOLVED.value:
            raise RefusedError(
                f"migration {rec.migration_id} of job {job!r} is {rec.state}, still in progress",
                node=self.node,
                hint="wait for it; only an unresolved migration can be settled by hand",
            )
        if action not in set(Resolution):  # a caller inside the agent passing a plain word
            raise InvalidArgumentError(f"unknown resolve action {action!r}: expected ask, resume or finish")
        if action == Resolution.ASK:
            return self.settle(rec)
        with self._lock:
            current = self.journal.get(SOURCE, rec.migration_id)
            if current is None or current.state != MigrationState.UNRESOLVED.value:
                return "already settled meanwhile"
            if action == Resolution.RESUME:
                return self._resume(
                    current, "the operator said the target does not run it (`ferry resolve --resume`)"
                )
            return self._finish(current, "the operator said the target runs it (`ferry resolve --finish`)")

    def settle(self, rec: MigrationRecord, restarted: bool = False) -> str:
        with self._lock:
            current = self.journal.get(SOURCE, rec.migration_id)
            if current is None or current.state not in _NOT_SENT | _MAYBE_SENT:
                return f"already settled ({current.state if current else 'no record'})"
            return self._settle(current, restarted)

    def _settle(self, rec: MigrationRecord, restarted: bool) -> str:
        why = "the agent restarted" if restarted else "asked again"
        state = state_of(rec, MigrationState)
        if state in NOT_SENT:
            if not rec.image:  # a local operation has no target to tell
                self._tell_target_abort(rec, f"source {self.node} restarted while {rec.state}")
            answer = TargetAnswer.UNKNOWN  # moot: commit was never sent
        else:
            answer = image_answer(rec) if rec.image else self._ask_target(rec)
        verdict = decide(state, answer)
        if verdict is not Verdict.HOLD:
            # A dump that outlived us, or a lazy one still serving, goes first.
            self._wait_for_criu(rec, pages_needed=verdict is Verdict.FINISH)
        if verdict is Verdict.RESUME:
            if rec.image:
                said = f"{why} while {rec.state}, before its image in {rec.image} was complete"
            elif state in NOT_SENT:
                said = f"{why} while {rec.state}; commit was never sent, so the target cannot run it"
            else:
                said = f"{why}: the target confirmed that it does not run the job"
            return self._resume(rec, said)
        if verdict is Verdict.FINISH and rec.image:
            return self._end_saved(rec, f"{why} while {rec.state}: its image in {rec.image} is complete")
        if verdict is Verdict.FINISH:
            return self._finish(rec, f"{why}: the target reports that it runs the job")
        if state is not MigrationState.UNRESOLVED:
            subject = f"{rec.migration_id} (job {rec.job})"
            SOURCE_TRANSITIONS.check(state, MigrationState.UNRESOLVED, subject)
            rec.state = MigrationState.UNRESOLVED.value
            rec.note = unresolved_note(rec.job, rec.peer)
            self.journal.save(rec)
            with contextlib.suppress(NotFoundError):
                self.registry.update(rec.job, note=rec.note)
            log.warning("migration %s (job %s): %s", rec.migration_id, rec.job, rec.note)
        return f"still unresolved: target {rec.peer} gave no definite answer"

    # -- outcomes ----------------------------------------------------------------------

    def _resume(self, rec: MigrationRecord, why: str) -> str:
        job = self.registry.get(rec.job)
        alive = procs.alive(job.pid, job.pid_started)
        state = MigrationState(rec.state)
        # After a restart nothing says whether the lock is still engaged: put the link back anyway.
        link = LinkLock(self.registry.network, job.veth, engaged=True)
        left = cuda_left(state, bool(rec.cuda_pids))
        copy = rollback.FrozenCopy(job, procs.tree_pids(job.pid) if alive else [], link, rec.cuda_pids, left)

        def say(r: rollback.Resumed) -> str:
            what = rec.kind if rec.image else f"migration to {rec.peer}"
            note = f"{what} settled: {why}; the job resumed here"
            return f"{note}, but {r.summary()}; {cuda.UNDO_HINT}" if r.summary() else note

        done = rollback.resume(
            self.registry,
            self.driver,
            copy,
            say,
            gone=JobState.LOST,
            cuda_back=lambda: self.ledger.release_frozen(rec.cuda_pids),
        )
        self._drop_files(rec)
        self._settled(rec, MigrationState.ABORTED, say(done))
        return say(done)

    def _finish(self, rec: MigrationRecord, why: str) -> str:
        note = f"moved to {rec.peer}: {why}"
        copy, gone = self._copy_to_end(rec)
        rollback.finish(self.registry, copy, JobState.MOVED, note, cuda_gone=gone, moved_to=rec.peer)
        self._drop_files(rec)
        # Before COMMITTED: a crash in between settles it again, and passes the stop on then.
        stops.pass_on(self.registry, self.peer_for(rec.peer), rec.job, rec.migration_id)
        self._settled(rec, MigrationState.COMMITTED, note)
        return note

    def _end_saved(self, rec: MigrationRecord, why: str) -> str:
        """A checkpoint or a preemption's suspend whose image is complete: the job ends here as
        it asked (CHECKPOINTED, or PREEMPTED to resume here by itself)."""
        copy, gone = self._copy_to_end(rec)
        end_saved(self.registry, copy, Path(rec.image), rec.kind == KIND_SUSPEND, cuda_gone=gone)
        note = f"{rec.kind} settled: {why}; the job's copy here ended"
        self._settled(rec, MigrationState.COMMITTED, note)
        return note

    def _copy_to_end(self, rec: MigrationRecord) -> tuple[rollback.FrozenCopy, Callable[[], None]]:
        """The frozen copy another copy (or an image) now stands for, and what frees its GPUs."""
        job = self.registry.get(rec.job)
        pids = procs.tree_pids(job.pid) if procs.alive(job.pid, job.pid_started) else []
        copy = rollback.FrozenCopy(job, pids, LinkLock(self.registry.network, job.veth))
        return copy, lambda: self.ledger.release_frozen(rec.cuda_pids)

    @staticmethod
    def _drop_files(rec: MigrationRecord) -> None:
        """Its staging and its one-time data key: of no use once it is settled."""
        for d in (rec.staging, rec.keys):
            if d:
                shutil.rmtree(d, ignore_errors=True)

    def _settled(self, rec: MigrationRecord, state: MigrationState, note: str) -> None:
        subject = f"{rec.migration_id} (job {rec.job})"
        rec.state = SOURCE_TRANSITIONS.check(MigrationState(rec.state), state, subject).value
        rec.note = note
        self.journal.save(rec)
        log.warning("migration %s (job %s): %s", rec.migration_id, rec.job, note)

    # -- helpers -------------------------------------------------------------------------

    def _ask_target(self, rec: MigrationRecord) -> TargetAnswer:
        """The target's word, fencing it if it has not begun restoring (agent.migration.fencing)."""
        try:
            peer = self.peer_for(rec.peer)
        except FerryError as e:  # no way to reach it (its TLS files, say): no answer
            log.warning("migration %s: cannot reach target %s: %s", rec.migration_id, rec.peer, e)
            return TargetAnswer.UNKNOWN
        return ask_target(peer, rec.migration_id, fence="source settles an interrupted commit", tries=1)

    def _tell_target_abort(self, rec: MigrationRecord, reason: str) -> None:
        try:
            self.peer_for(rec.peer).abort(rec.migration_id, reason)
        except FerryError as e:
            # Commit was never sent: the target cannot restore, and its lease runs out.
            log.info("migration %s: could not tell target %s to abort: %s", rec.migration_id, rec.peer, e)

    def _wait_for_criu(self, rec: MigrationRecord, pages_needed: bool) -> None:
        """A CRIU dump that outlived its agent finishes (leaving the tree stopped) before we resume.

        A lazy dump past its dump only serves pages: its parasite is gone and the tree stays
        stopped by SIGSTOP, so when no target will ever ask for a page it ends at once rather
        than waiting out CRIU_WAIT_S for a page server nobody connects to."""
        if not (rec.criu_pid and procs.alive(rec.criu_pid, rec.criu_started)):
            return
        if rec.criu_serving and not pages_needed:
            log.warning(
                "migration %s: ending its lazy page server (CRIU pid %d): no target will ask for a page",
                rec.migration_id,
                rec.criu_pid,
            )
            procs.end_within(rec.criu_pid, rec.criu_started, 0.0)
            return
        log.warning(
            "migration %s: waiting for CRIU (pid %d) to finish its dump", rec.migration_id, rec.criu_pid
        )
        procs.end_within(rec.criu_pid, rec.criu_started, CRIU_WAIT_S)


def image_answer(rec: MigrationRecord) -> TargetAnswer:
    """A local operation's "target" is its image: complete and verified, it holds the job
    (RUNNING: end the frozen copy); anything less can never run it (FENCED: resume)."""
    try:
        verify(Path(rec.image))
    except (FerryError, OSError) as e:
        log.warning("migration %s: image %s is not complete: %s", rec.migration_id, rec.image, e)
        return TargetAnswer.FENCED
    return TargetAnswer.RUNNING
