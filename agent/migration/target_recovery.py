"""A target's recovery after a restart: unwind every incoming migration the last run left in flight.

A lease or an image waiting for commit is dropped (its source's stream or commit died with
the agent, and the source resumes its copy on ABORTED). A restore the agent did not see
finish is killed, for the same reason: no copy runs that its node has not recorded. A
migration that ended while the agent stopped (ABORTED or RUNNING is journaled before its
staging goes) leaves no staging behind.
"""

from __future__ import annotations

import logging
import shutil
import signal
from pathlib import Path

from agent.errors import NotFoundError
from agent.jobs import procs
from agent.jobs.record import JobState
from agent.jobs.registry import JobRegistry
from agent.migration.journal import TARGET, Journal, MigrationRecord, state_of
from agent.migration.states import TARGET_TRANSITIONS, TargetState

log = logging.getLogger(__name__)

#: How long recovery waits for a CRIU restore that outlived its agent.
CRIU_WAIT_S = 60.0


def recover_incoming(journal: Journal, registry: JobRegistry) -> list[str]:
    """After a restart: unwind every migration the last run of this agent left in flight.

    A lease or an image waiting for commit is dropped (its source's stream or
    commit died with us, and the source resumes its copy on ABORTED). A restore
    we did not see finish is killed, for the same reason. Returns what was done.
    """
    done = []
    for rec in journal.load(TARGET, strict=True):
        state = journaled(rec)
        if not state.in_flight:
            if rec.staging and Path(rec.staging).exists():  # the agent stopped before it went
                shutil.rmtree(rec.staging, ignore_errors=True)
                done.append(f"{rec.migration_id}: removed the staging its {rec.state} migration left")
            continue
        if state in (TargetState.RESTORING, TargetState.POSTCOPY, TargetState.UNWINDING):
            # Post-copy: the pages still missing went with the daemon; the source has them all.
            killed = _kill_unfinished_restore(registry, rec)
            what = f"killed its half-finished restore ({len(killed)} processes)" if killed else "nothing ran"
        else:
            what = f"dropped its {rec.state} image"
        shutil.rmtree(rec.staging, ignore_errors=True)
        TARGET_TRANSITIONS.check(state, TargetState.ABORTED, f"{rec.migration_id} (job {rec.job})")
        rec.state, rec.note = TargetState.ABORTED.value, f"agent restarted while {rec.state}: {what}"
        journal.save(rec)
        log.warning("migration %s (job %s): %s", rec.migration_id, rec.job, rec.note)
        done.append(f"{rec.migration_id}: {rec.note}")
    return done


def _kill_unfinished_restore(registry: JobRegistry, rec: MigrationRecord) -> list[int]:
    if rec.criu_pid and procs.alive(rec.criu_pid, rec.criu_started):
        log.warning(
            "migration %s: waiting for its CRIU restore (pid %d) to end", rec.migration_id, rec.criu_pid
        )
        procs.end_within(rec.criu_pid, rec.criu_started, CRIU_WAIT_S)
    victims = restored_processes(registry.job_dir(rec.job), rec.pids, rec.criu_started)
    try:
        job = registry.get(rec.job)
    except NotFoundError:
        job = None
    if job is not None and job.veth and job.pid in victims and registry.network is not None:
        # Its link first: killed, it would close the job's TCP connections under the source's copy.
        # (A restore that crashed before its record was written leaves a link this cannot name.)
        registry.network.delete(job.veth)
    procs.signal_all(victims, signal.SIGKILL)
    if job is None:
        return victims
    if job.state.active and job.pid in victims and rec.kind == "resume" and rec.image:
        # A preempted job's resume: its image is still there, so it waits for a GPU again.
        note = f"preempted; its resume was cut short by an agent restart; waits again (image {rec.image})"
        registry.update(rec.job, state=JobState.PREEMPTED, checkpoint_dir=rec.image, note=note)
    elif job.state.active and job.pid in victims:
        registry.update(
            rec.job,
            state=JobState.LOST,
            note="its restore was cut short by an agent restart; killed here",
        )
    return victims


def restored_processes(job_dir: Path, adopted_pids: list[int], criu_started: float) -> list[int]:
    """A restore's processes, found without CRIU's answer: a launched job's hold its log here
    open (no other process does: the job directory is this agent's); an adopted job's are its
    own PIDs, created after the restore's CRIU (seconds since boot, procs.create_time; 0 when
    it never started, and then nothing was restored)."""
    found = set(procs.holders([job_dir / "stdout.log", job_dir / "stderr.log"]))
    for pid in adopted_pids if criu_started else []:
        if procs.create_time(pid) >= criu_started:
            found.add(pid)
    return sorted(found)


def journaled(rec: MigrationRecord) -> TargetState:
    """A target record's state (journal.state_of): one this agent cannot read may be a restore
    that must be killed (Journal.load reports such files)."""
    return state_of(rec, TargetState)
