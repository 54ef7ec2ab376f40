"""The one rule for "may this frozen copy run again?", used by every path that holds one.

A frozen copy here resumes only on a definite answer that no other copy runs or will; it ends
only on a definite answer that another copy runs. Everything else holds it frozen
(UNRESOLVED) until an answer comes or an operator settles it. The live source after its
Commit, post-copy after a broken transfer, the abort path and recovery after a restart all
ask the target through `ask_target` and act on `decide`; nothing else chooses.

The target's answer is a closed type: every transport error, every error the target itself
returns (an unreadable journal record, a refused caller), a refused Abort and every state it
has not settled yet are UNKNOWN. A target that has not begun restoring is fenced first (Abort:
its tombstone refuses a commit that is still on its way), and only a fence it confirmed is
FENCED.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from agent.compat import StrEnum
from agent.errors import FerryError, StepTimeoutError, UnavailableError
from agent.migration.model import Peer
from agent.migration.states import MAYBE_SENT, NOT_SENT, MigrationState
from agent.rpc import pb

log = logging.getLogger(__name__)

#: How often a question that got no answer at all (transport) is asked again at once.
ASK_TRIES = 5
ASK_PAUSE_S = 1.0


class TargetAnswer(StrEnum):
    """What the target's word on one migration means for the copy here."""

    RUNNING = "running"  # the target runs the job (post-copy: with all its memory)
    FENCED = "fenced"  # the target does not run it and never will (aborted, or no record of the id)
    UNKNOWN = "unknown"  # anything else: no answer, an error, a restore not settled yet


class Verdict(StrEnum):
    """What to do with the frozen copy here."""

    RESUME = "resume"  # it is the job's only copy: let it go on
    FINISH = "finish"  # another copy runs: end this one
    HOLD = "hold"  # unknown: keep it frozen (UNRESOLVED), ask again, settle later


#: GetMigration's states and what each means here. RESTORING and POSTCOPY are unsettled;
#: PREPARED, RECEIVING and VERIFIED are fenceable (see ask_target); the rest is UNKNOWN.
_DEFINITE = {
    pb.TARGET_STATE_RUNNING: TargetAnswer.RUNNING,
    pb.TARGET_STATE_ABORTED: TargetAnswer.FENCED,
    # No record of the id: it can never restore it (a Commit for it is NOT_FOUND, a late
    # Prepare is refused by the tombstone an Abort leaves); RUNNING records are never pruned.
    pb.TARGET_STATE_UNKNOWN: TargetAnswer.FENCED,
}
FENCEABLE = frozenset({pb.TARGET_STATE_PREPARED, pb.TARGET_STATE_RECEIVING, pb.TARGET_STATE_VERIFIED})


def answer_of(wire_state: int) -> TargetAnswer:
    """A GetMigration answer as it stands, before any fence (unexpected values are UNKNOWN)."""
    return _DEFINITE.get(wire_state, TargetAnswer.UNKNOWN)


def decide(state: MigrationState, answer: TargetAnswer) -> Verdict:
    """The decision. `state` is the source's journaled state, `answer` the target's.

    Commit never sent (states.NOT_SENT): the target cannot run the job, so the copy resumes
    whatever it says. ABORTING is in NOT_SENT because it is journaled only after a RESUME
    verdict. Commit maybe sent (states.MAYBE_SENT): only RUNNING ends the copy and only FENCED
    resumes it; UNKNOWN holds it.
    """
    if state in NOT_SENT:
        return Verdict.RESUME
    if state not in MAYBE_SENT:
        raise ValueError(f"migration state {state.value!r} is settled; there is no frozen copy to decide on")
    if answer is TargetAnswer.RUNNING:
        return Verdict.FINISH
    if answer is TargetAnswer.FENCED:
        return Verdict.RESUME
    return Verdict.HOLD


def ask_target(
    peer: Peer,
    migration_id: str,
    *,
    fence: str = "",
    tries: int = ASK_TRIES,
    sleep: Callable[[float], None] = time.sleep,
) -> TargetAnswer:
    """The target's definite word on `migration_id`, or UNKNOWN.

    Transport failures (unreachable, deadline) are asked again up to `tries` times; any other
    error is the target's deliberate answer that it cannot say (UNKNOWN at once). With `fence`
    (the reason given), a target that has not begun restoring is told to abort, and its
    acceptance is FENCED; its refusal or silence is UNKNOWN.
    """
    state = _status(peer, migration_id, tries, sleep)
    if state is None:
        return TargetAnswer.UNKNOWN
    if fence and state in FENCEABLE:
        try:
            peer.abort(migration_id, fence)
        except FerryError as e:
            # Refused (it began restoring meanwhile) or no answer: either way not a fence.
            log.info("migration %s: the target did not confirm the fence: %s", migration_id, e)
            return TargetAnswer.UNKNOWN
        return TargetAnswer.FENCED
    return answer_of(state)


def _status(peer: Peer, migration_id: str, tries: int, sleep: Callable[[float], None]) -> int | None:
    for attempt in range(tries):
        try:
            return peer.status(migration_id)
        except (UnavailableError, StepTimeoutError) as e:
            log.info(
                "migration %s: no answer from the target (%d/%d): %s", migration_id, attempt + 1, tries, e
            )
            if attempt + 1 < tries:
                sleep(ASK_PAUSE_S)
        except FerryError as e:
            log.warning("migration %s: the target could not say: %s", migration_id, e)
            return None
    return None
