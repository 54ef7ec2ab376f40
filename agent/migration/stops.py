"""A stop asked for while a job was moving, carried out where the move left it.

`ferry stop` (a scheduler's cancel) during a move is remembered on the job's record
(`JobRecord.stop_grace_s`) instead of being refused. If the move leaves the job here (an
abort, a refusal, a checkpoint that left it running, a preemption's suspend), the registry
stops it as its record leaves MIGRATING. If the job now runs on the target, the source passes
the stop on (`StopMoved`, which only the node that moved the job may send); this module does
that, from the live source and from recovery alike.
"""

from __future__ import annotations

import logging
import time

from agent.errors import FerryError, StepTimeoutError, UnavailableError
from agent.jobs.record import JobState
from agent.jobs.registry import JobRegistry
from agent.migration.model import Peer

log = logging.getLogger(__name__)

#: Waits between tries of a target that does not answer (None: the last try).
RETRY_S = (1.0, 2.0, None)


def pass_on(registry: JobRegistry, peer: Peer, job: str, migration_id: str) -> None:
    """If a stop was asked for during the move, ask the target that now runs the job to stop it.
    Never raises: what happened is in the source's record of the job (`ferry ps` shows it)."""
    rec = registry.get(job)
    if not rec.stop_grace_s or rec.state is not JobState.MOVED:
        return
    where = rec.moved_to_node or rec.moved_to
    try:
        for wait_s in RETRY_S:  # a target that just took the job may be busy for a moment
            try:
                peer.stop_moved(migration_id, rec.stop_grace_s)
                break
            except (UnavailableError, StepTimeoutError):
                if wait_s is None:
                    raise
                time.sleep(wait_s)
    except Exception as e:  # the move is done whatever happens here: never fail it
        cause = e.cause if isinstance(e, FerryError) else repr(e)
        log.error("job %s: the stop asked for during its move did not reach %s: %s", job, where, cause)
        registry.update(
            job,
            note=f"{rec.note}; the stop asked for during the move did not reach {where} ({cause}): "
            f"stop it there (`ferry stop --agent {rec.moved_to} {job}`)",
        )
        return
    log.info("job %s: the stop asked for during its move was passed on to %s", job, where)
    registry.update(job, note=f"{rec.note}; the stop asked for during the move was passed on to {where}")
