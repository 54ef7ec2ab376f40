"""Bringing every member of a group back to its last complete snapshot: `ferry rollback`, and
the part of a recovery after a spare was claimed (agent.snapshots.protect runs both).

    1. FETCH, on the agent where each member will run (its snapshot's node, or the node `place`
       gives a lost one): its image from its buddy, verified. The job runs on meanwhile.
    2. END, on every agent that may run a copy of a member: each copy there ends (link first,
       then SIGKILL). Every old copy is gone before any restore: a member restored next to a
       copy that still runs would take its connections' resets, or its bytes.
    3. RESTORE on each member's agent: restored (journaled RUNNING at its commit point) and held.
    4. RESUME on all: they go on together, from one consistent cut.

A failure before END changes nothing: every copy runs on. A failure after it (an END or a
RESTORE that failed) leaves members with no copy anywhere, so the steps are tried again from the
same snapshot, FETCH included (ATTEMPTS in all): the next END ends the members restored and held
by the failed try, so none goes on without the rest. After the last try, whatever was restored
goes on and the error says which did not: `ferry rollback` finishes the work from the same
snapshot.
"""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from agent import faults
from agent.errors import FerryError, as_ferry_error
from agent.rpc import pb
from agent.snapshots.rounds import RELEASE_CALL_S, Call

log = logging.getLogger(__name__)

#: Bounds of the steps' calls: an image crossing the network; a restore of a large member.
FETCH_CALL_S = 1800.0
END_CALL_S = 60.0
RESTORE_CALL_S = 600.0
#: Tries of FETCH, END, RESTORE once a first END went out: a failure then leaves members with no
#: copy anywhere, and only another try (from the same snapshot) brings them back.
ATTEMPTS = 3
RETRY_PAUSE_S = 2.0


@dataclass
class RollbackTimes:
    fetch_s: float = 0.0
    end_s: float = 0.0
    restore_s: float = 0.0
    paused_s: float = 0.0  # from the first END asked to every member resumed
    placed: dict[str, str] = field(default_factory=dict)  # job -> the agent it runs on now


def roll_back(
    group: str,
    snap: pb.SnapshotSet,
    call: Call,
    others: list[str],
    hold_s: float,
    place: dict[str, str] | None = None,
    dead: set[str] | None = None,
) -> RollbackTimes:
    """Every member of `snap` back to it; `others`: more agents that may run a copy of a member
    (where members moved since). `place`: job -> the agent to restore it on instead of its
    snapshot's (a member whose node is dead, or one that runs on another node now). `dead`: the
    agents known dead, never asked (default: the snapshot's agents of the placed members)."""
    if not snap.epoch:
        raise FerryError(f"group {group} has no complete snapshot to roll back to", step="rollback")
    place = place or {}
    where = {m.job: place.get(m.job, m.agent) for m in snap.members}
    t = RollbackTimes(placed=where)

    def req(action: int, job: str = "", buddy: str = "", local: str = "") -> pb.SnapshotMemberRequest:
        return pb.SnapshotMemberRequest(
            group=group, epoch=snap.epoch, action=action, job=job, buddy=buddy, hold_s=hold_s, local_dir=local
        )

    def fetch(m: pb.MemberCopy) -> pb.SnapshotMemberRequest:
        """A member restored on its own node reads its copy there, one placed on its buddy (a
        spare that kept it) the buddy's copy there; one placed elsewhere, or whose copy there is
        gone, fetches its buddy's."""
        local = {m.agent: m.local_dir, m.buddy_agent: m.dir}.get(where[m.job], "")
        buddy = "" if m.buddy_agent in gone else m.buddy_agent
        return req(pb.SNAPSHOT_ACTION_FETCH, m.job, buddy, local)

    def all_of(calls: list[tuple[str, pb.SnapshotMemberRequest, float]], step: str) -> None:
        with ThreadPoolExecutor(max(1, len(calls))) as pool:
            futures = [pool.submit(call, a, r, timeout) for a, r, timeout in calls]
        errors = []
        for (agent, _, _), f in zip(calls, futures, strict=True):
            try:
                f.result()
            except Exception as e:
                err = as_ferry_error(e, step, "")
                errors.append(f"agent {agent}: {err}")
        if errors:
            raise FerryError("; ".join(errors), step=step)

    # Never asked: the given dead, or by default each placed member's snapshot node.
    gone = dead if dead is not None else {m.agent for m in snap.members if m.job in place}
    enders = [
        a
        for a in dict.fromkeys([*where.values(), *(m.agent for m in snap.members), *others])
        if a not in gone
    ]
    _every_copy_found(group, snap, call, enders, set(place))
    ended = False  # from the first END on, a failure leaves members with no copy: try again
    for attempt in range(1, ATTEMPTS + 1):
        try:
            t0 = time.monotonic()
            fetches = [(where[m.job], fetch(m), FETCH_CALL_S) for m in snap.members]
            all_of(fetches, "rollback fetch")
            t.fetch_s = time.monotonic() - t0
            t1 = time.monotonic()
            ended = True
            all_of([(a, req(pb.SNAPSHOT_ACTION_END), END_CALL_S) for a in enders], "rollback end")
            faults.check("rollback-ended")  # a test's window: every copy ended, none restored
            t.end_s = time.monotonic() - t1
            t2 = time.monotonic()
            restores = [
                (where[m.job], req(pb.SNAPSHOT_ACTION_RESTORE, m.job), RESTORE_CALL_S + hold_s)
                for m in snap.members
            ]
            all_of(restores, "rollback restore")
            t.restore_s = time.monotonic() - t2
        except FerryError as e:
            if not ended or attempt == ATTEMPTS:
                if ended:  # whatever was restored goes on now, not after hold_s
                    _resume_all(call, where, req(pb.SNAPSHOT_ACTION_RESUME))
                raise
            # Members restored and held are ended by the next END: none goes on without the rest.
            log.warning(
                "rollback of group %s to round %d: try %d of %d failed after its members ended (%s); "
                "again from the same snapshot",
                group,
                snap.epoch,
                attempt,
                ATTEMPTS,
                e,
            )
            time.sleep(RETRY_PAUSE_S)
            continue
        _resume_all(call, where, req(pb.SNAPSHOT_ACTION_RESUME))
        t.paused_s = time.monotonic() - t1
        break
    return t


def _every_copy_found(
    group: str, snap: pb.SnapshotSet, call: Call, agents: list[str], lost: set[str]
) -> None:
    """Refuse, before anything ends, when a member runs on no agent that END would reach: its
    copy would run on beside the restored one. A member that an earlier try of a rollback to
    this same round ended (a failed try, or a recovery that died half-way) is found too: no
    round completed since, so no copy of it has run anywhere but where that rollback restored."""
    running, ended = members_on(group, snap.epoch, call, agents)
    if missing := sorted({m.job for m in snap.members} - running - ended - lost):
        raise FerryError(
            f"member(s) {', '.join(missing)} of group {group} run on none of {', '.join(agents)}",
            step="rollback",
            hint="nothing was changed: find where they run (`ferry ps --group`) and name that agent "
            "with `ferry protect --members-on`",
        )


def members_on(group: str, epoch: int, call: Call, agents: list[str]) -> tuple[set[str], set[str]]:
    """LIST on each of `agents`: the group's members they run, and those whose copy there a
    rollback to round `epoch` ended (nothing of them runs there). Raises naming the agent that
    could not say."""
    req = pb.SnapshotMemberRequest(group=group, epoch=epoch, action=pb.SNAPSHOT_ACTION_LIST)
    running: set[str] = set()
    ended: set[str] = set()
    for a in agents:
        try:
            said = call(a, req, END_CALL_S)
        except FerryError as e:
            raise FerryError(
                f"agent {a} could not say which members of group {group} it runs: {e}",
                step="rollback",
                hint="nothing was changed; try again once it answers",
            ) from e
        running.update(m.job for m in said.members)
        ended.update(said.ended)
    return running, ended


def _resume_all(call: Call, where: dict[str, str], resume: pb.SnapshotMemberRequest) -> None:
    _quietly_all(call, [(a, resume, RELEASE_CALL_S) for a in dict.fromkeys(where.values())])


def _quietly_all(call: Call, calls: list[tuple[str, pb.SnapshotMemberRequest, float]]) -> None:
    def one(a: str, r: pb.SnapshotMemberRequest, timeout: float) -> None:
        with contextlib.suppress(FerryError):  # its members go on by themselves after hold_s
            call(a, r, timeout)

    with ThreadPoolExecutor(max(1, len(calls))) as pool:
        for a, r, timeout in calls:
            pool.submit(one, a, r, timeout)
