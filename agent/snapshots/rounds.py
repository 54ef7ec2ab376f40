"""One snapshot round of a group, run by the agent that protects it (agent.snapshots.protect).

    0. WARM on every agent with members, at once (best effort: a failure only leaves each HOLD
       to warm by itself): the memory the dumps will write is touched while the members run,
       so that the freezes of step 1 begin together.
    1. HOLD on every agent with members, at once: each member frozen, cut off and dumped.
    2. RELEASE on all, only once every one answered the hold: no member goes on before every
       member is cut off, so no byte crosses between a member's dump and another's (a
       consistent cut: a byte one member sent is either in the receiver's image or still
       unacknowledged in the sender's).
    3. SHIP on all: each agent sends its members' images to its buddy and answers once the
       buddy has verified them. The buddy is a keeper where there are any (live spares, which
       run no member: a recovery that places the lost member on the spare holding its copy
       restores it from memory there, with nothing to fetch), else the next agent in the ring
       (a node other than its own).

Any failure ends the round: whatever was held is released, and the caller keeps the previous
snapshot. The round's result is the snapshot set; it counts once it is returned.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

from agent.errors import FerryError, NotFoundError, RefusedError, as_ferry_error
from agent.rpc import pb

#: call(agent's HOST:PORT, request, timeout_s) → its answer; raises FerryError.
Call = Callable[[str, pb.SnapshotMemberRequest, float], pb.SnapshotMemberResponse]

log = logging.getLogger(__name__)

#: Bounds of each step's call, beyond the hold itself: a dump of a large member, a ship of it.
WARM_CALL_S = 60.0
HOLD_CALL_S = 600.0
SHIP_CALL_S = 1800.0
RELEASE_CALL_S = 150.0
#: How long a failed round waits for its best-effort releases (agent.snapshots.rounds._release_all).
RELEASE_WAIT_S = 5.0
#: How often a round's coordinator asks whether it may go on while it waits for the agents.
GO_ON_EVERY_S = 0.5


@dataclass
class RoundTimes:
    warm_s: float = 0.0  # the WARM step, before the pause
    hold_s: float = 0.0  # from the first hold asked to the last member held
    release_s: float = 0.0
    ship_s: float = 0.0


class GivenUp(FerryError):
    """The round stopped waiting: its coordinator may no longer run it (`go_on` said why)."""


def take(
    group: str,
    epoch: int,
    agents: list[str],
    call: Call,
    hold_s: float,
    go_on: Callable[[], str] = lambda: "",
    keepers: list[str] | None = None,
) -> tuple[pb.SnapshotSet, RoundTimes]:
    """Run round `epoch` over `agents` (every agent with a member of the group); raise a
    FerryError naming the agent and the step that failed. `go_on` is asked while the calls run
    ("" to go on): a coordinator cut off from etcd gives up at once, not after the calls'
    bounds, and the agents release what they hold by themselves after hold_s. `keepers`: agents
    that run no member and keep the images, the members' agents spread over them in turn."""
    keepers = [k for k in keepers or [] if k not in agents]
    if len(agents) < 2 and not keepers:
        raise RefusedError(
            f"group {group}'s members run on {len(agents)} node(s): a snapshot needs a buddy on another node",
            step="snapshot",
            hint="give `ferry protect` the agent of every node with a member (--members-on)",
        )
    times = RoundTimes()

    def buddy_of(i: int) -> str:
        return keepers[i % len(keepers)] if keepers else agents[(i + 1) % len(agents)]

    def each(
        action: int, timeout: float, buddy: Callable[[int], str] = lambda i: ""
    ) -> list[pb.SnapshotMemberResponse]:
        def one(i: int) -> pb.SnapshotMemberResponse:
            req = pb.SnapshotMemberRequest(
                group=group, epoch=epoch, action=action, buddy=buddy(i), hold_s=hold_s
            )
            return call(agents[i], req, timeout)

        pool = ThreadPoolExecutor(len(agents))
        futures = [pool.submit(one, i) for i in range(len(agents))]
        pool.shutdown(wait=False)  # its threads end with their calls, each bounded
        while wait(futures, timeout=GO_ON_EVERY_S).not_done:
            if why := go_on():
                raise GivenUp(f"round {epoch} of group {group} given up: {why}", step=_STEP[action])
        answers, errors = [], []
        for i, f in enumerate(futures):
            try:
                answers.append(f.result())
            except Exception as e:
                errors.append(_named(e, agents[i], action))
        if errors:
            raise errors[0]
        return answers

    warm_from = time.monotonic()
    try:
        each(pb.SNAPSHOT_ACTION_WARM, WARM_CALL_S)
    except (GivenUp, NotFoundError, RefusedError):
        # An agent with no member of the group now (it moved away) or one it cannot save yet (a
        # post-copy move still bringing its memory) would refuse the HOLD too: the round fails
        # before it freezes anyone (it froze the others and dropped their dumps, so that their
        # next round was whole as well).
        raise
    except FerryError as e:
        log.info(
            "round %d of group %s: no warm-up before the hold (each member warms its own): %s",
            epoch,
            group,
            e,
        )
    t0 = time.monotonic()  # the pause: the members run on through the warm-up
    times.warm_s = t0 - warm_from
    try:
        held = each(pb.SNAPSHOT_ACTION_HOLD, HOLD_CALL_S + hold_s)
    except FerryError:  # given up too: a hold its release misses ends by itself at hold_s
        _release_all(agents, group, epoch, call)
        raise
    times.hold_s = time.monotonic() - t0
    try:
        _whole(group, held)
    except FerryError:
        _release_all(agents, group, epoch, call)
        raise
    released = each(pb.SNAPSHOT_ACTION_RELEASE, RELEASE_CALL_S)
    pause = time.monotonic() - t0
    times.release_s = pause - times.hold_s
    taken_at = time.time()
    t1 = time.monotonic()
    shipped = each(pb.SNAPSHOT_ACTION_SHIP, SHIP_CALL_S, buddy=buddy_of)
    times.ship_s = time.monotonic() - t1
    frozen = {m.job: m for a in released for m in a.members}  # the pause and its parts
    out = pb.SnapshotSet(epoch=epoch, taken_at=taken_at, group_pause_s=pause)
    for i, (h, s) in enumerate(zip(held, shipped, strict=True)):
        for m in s.members:
            out.members.append(
                pb.MemberCopy(
                    job=m.job,
                    rank=m.rank,
                    node=h.node_name,
                    agent=agents[i],
                    buddy_node=m.buddy_node,
                    buddy_agent=buddy_of(i),
                    dir=m.dir,
                    bytes=m.bytes,
                    frozen_s=frozen[m.job].frozen_s if m.job in frozen else 0.0,
                    local_dir=m.local_dir,
                    gpu_bytes=frozen[m.job].gpu_bytes if m.job in frozen else 0,
                    cuda_checkpoint_s=frozen[m.job].cuda_checkpoint_s if m.job in frozen else 0.0,
                    resume_s=frozen[m.job].resume_s if m.job in frozen else 0.0,
                    parent_epoch=m.parent_epoch,
                )
            )
    return out, times


def _whole(group: str, held: list[pb.SnapshotMemberResponse]) -> None:
    """Every rank the members' WORLD_SIZE names was held: a snapshot without one of them would
    be no snapshot of the job (a member on an agent nobody named)."""
    members = [m for a in held for m in a.members]
    worlds = {m.world for m in members if m.world}
    if not worlds:
        return
    ranks = {int(m.rank) for m in members if m.rank.isdigit()}
    if len(worlds) > 1 or (missing := sorted(set(range(max(worlds))) - ranks)):
        said = (
            f"their WORLD_SIZE differs ({sorted(worlds)})"
            if len(worlds) > 1
            else f"rank(s) {missing} were not"
        )
        raise RefusedError(
            f"group {group}'s members held do not make a whole job: {said}",
            step="snapshot hold",
            hint="name the agent of every node with a member (`ferry protect --members-on`), or wait "
            "until every member's key is in etcd",
        )


def _release_all(agents: list[str], group: str, epoch: int, call: Call) -> None:
    """Best effort after a failed hold: an agent that this misses releases by itself at hold_s.
    Waited for only RELEASE_WAIT_S: a live agent answers at once (the next round must find its
    members running again), a dead one's call would hold the round's coordinator (and the next
    round, or a recovery) for its connect timeout. A late RELEASE is harmless: epochs are never
    reused."""
    req = pb.SnapshotMemberRequest(group=group, epoch=epoch, action=pb.SNAPSHOT_ACTION_RELEASE)
    calls = [
        threading.Thread(target=_quietly, args=(call, a, req), name="snapshot-release", daemon=True)
        for a in agents
    ]
    for t in calls:
        t.start()
    deadline = time.monotonic() + RELEASE_WAIT_S
    for t in calls:
        t.join(max(0.0, deadline - time.monotonic()))


def _quietly(call: Call, agent: str, req: pb.SnapshotMemberRequest) -> None:
    with contextlib.suppress(Exception):  # nothing held there, or it releases by itself
        call(agent, req, RELEASE_CALL_S)


_STEP = {
    pb.SNAPSHOT_ACTION_WARM: "snapshot warm",
    pb.SNAPSHOT_ACTION_HOLD: "snapshot hold",
    pb.SNAPSHOT_ACTION_RELEASE: "snapshot release",
    pb.SNAPSHOT_ACTION_SHIP: "snapshot ship",
}


def _named(e: Exception, agent: str, action: int) -> FerryError:
    err = as_ferry_error(e, _STEP[action], "")
    if agent not in err.cause:
        err.cause = f"agent {agent}: {err.cause}"
    return err
