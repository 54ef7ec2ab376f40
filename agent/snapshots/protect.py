"""`ferry protect`: the groups this agent keeps snapshots of, one round every interval.

This agent coordinates each protected group's rounds (agent.snapshots.rounds), one at a time,
and keeps the last complete snapshot set: on disk (`<state>/protections.json`, so an agent
that restarts goes on protecting) and, with `[coordination]`, in etcd under
`groups/<group>/snapshot`, where a recovery reads it. A round that fails leaves the previous
set as it was, every buddy's copy of it included: there is always one complete snapshot once
the first round succeeded. Only after a set is recorded are the older copies dropped.

With `[coordination]` any number of agents may protect a group, and one at a time runs its
rounds: the one whose claim etcd holds (agent.snapshots.protector). The others stand by, each
interval reading the group's last snapshot from etcd, and one takes over when the claim goes
with its holder's lease.

Why one module: a group's record (its last set, its epochs, its failures in a row, when its
next round is due) has one owner, changed under one lock by the round thread, a round asked by
hand, a rollback and a takeover from another protector; split, each would change another
module's record and the order of "recorded, then dropped" would span files.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from google.protobuf import json_format

from agent.durable import replace_file
from agent.errors import FerryError, InvalidArgumentError, NotFoundError, RefusedError, as_ferry_error
from agent.jobs.record import check_group_name
from agent.rpc import pb
from agent.snapshots import rollback, rounds
from agent.snapshots.config import MIN_EVERY_S, SnapshotConfig

if TYPE_CHECKING:
    from agent.snapshots.protector import ProtectorClaims

log = logging.getLogger(__name__)

FILE = "protections.json"
#: A DROP removes directories: an agent that does not answer within this keeps them a round longer.
DROP_CALL_S = 10.0
#: How often a round thread asks whether its group's last snapshot still covers it (etcd).
CHECK_EVERY_S = 1.0
#: A failed round is tried again this soon, then twice as late each time, up to the interval: a
#: round that met a move or a node's death must not leave the group a whole interval without one.
RETRY_FIRST_S = 1.0


@dataclass
class Protected:
    group: str
    every_s: float
    agents: list[str]
    active: bool = True
    last: pb.SnapshotSet = field(default_factory=pb.SnapshotSet)
    tried: int = 0  # the last round's epoch, complete or not: a round's epoch is never reused
    rounds: int = 0
    failed: int = 0
    last_error: str = ""
    times: rounds.RoundTimes | None = None  # the last complete round's steps (this agent's run only)
    rounds_by: str = ""  # with etcd: who runs the rounds while this agent stands by ("": this one)
    due_at: float = 0.0  # (monotonic) when the next round is due; 0: now
    failing: int = 0  # rounds failed in a row since the last complete one
    in_progress: int = 0  # the epoch of the round running now (0: none)
    lock: threading.Lock = field(default_factory=threading.Lock)  # one round at a time
    wake: threading.Event = field(default_factory=threading.Event)

    def pb(self) -> pb.Protection:
        return pb.Protection(
            group=self.group,
            every_s=self.every_s,
            agents=self.agents,
            last=self.last,
            rounds=self.rounds,
            failed=self.failed,
            last_error=self.last_error,
            active=self.active,
            rounds_by=self.rounds_by,
            in_progress=self.in_progress,
        )

    def to_json(self) -> dict[str, object]:
        return {
            "every_s": self.every_s,
            "agents": self.agents,
            "active": self.active,
            "tried": self.tried,
            "last": json_format.MessageToDict(self.last),
        }


class StandingBy(RefusedError):
    """Another agent runs the group's rounds (or etcd cannot say which does)."""


class Protections:
    """Owns the protected groups' records and their round threads."""

    def __init__(
        self,
        state_dir: Path,
        node: str,
        config: SnapshotConfig,
        call: rounds.Call,
        *,
        members: Callable[[str], list[str]] | None = None,  # group → its members' agents (etcd)
        claims: ProtectorClaims | None = None,  # with etcd: which protecting agent runs the rounds
        blocked: Callable[[str], str] = lambda group: "",  # why no round may start now (etcd)
        stale: Callable[[str, pb.SnapshotSet], str] = lambda g, s: "",  # why a set no longer covers g
        keepers: Callable[[list[str]], list[str]] = lambda agents: [],  # live spares (etcd), to keep images
        dead: Callable[[list[str]], set[str]] = lambda agents: set(),  # of agents, those without a lease
        record: Callable[[str, str], None] = lambda kind, message: None,  # the node's events
        observe: Callable[[str, pb.SnapshotSet | None, str], None] = lambda g, s, e: None,  # metrics
    ) -> None:
        self.path = state_dir / FILE
        self.node, self.config, self.call = node, config, call
        self.members, self.record, self.observe = members, record, observe
        self.blocked, self.claims, self.stale, self.keepers = blocked, claims, stale, keepers
        self.dead = dead
        self._groups: dict[str, Protected] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._load()

    def _load(self) -> None:
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            log.error(
                "snapshots: %s is unreadable (%s): no group is protected until `ferry protect`", self.path, e
            )
            return
        for group, d in raw.items():
            p = Protected(
                group, float(d["every_s"]), list(d["agents"]), bool(d["active"]), tried=int(d["tried"])
            )
            json_format.ParseDict(d.get("last", {}), p.last)
            self._groups[group] = p

    def _save(self) -> None:
        with self._lock:
            data = {g: p.to_json() for g, p in self._groups.items()}
        replace_file(self.path, json.dumps(data, indent=1, sort_keys=True).encode())

    def start(self) -> None:
        for p in list(self._groups.values()):
            if p.active:
                self._spawn(p)

    def stop(self) -> None:
        self._stop.set()
        for p in list(self._groups.values()):
            p.wake.set()

    def check_every(self, every_s: float) -> float:
        """The interval `every_s` asks for (0: the configured one), refused below the minimum."""
        every = every_s or self.config.every_s
        if every < MIN_EVERY_S:
            raise InvalidArgumentError(f"--every {every:g} s is below the minimum, {MIN_EVERY_S:g} s")
        return every

    def protect(self, group: str, every_s: float, agents: list[str], check: bool = True) -> Protected:
        """Start (or change, or with every_s < 0 stop) protecting `group`. `check`: refuse now if
        etcd knows no member yet (`ferry run --protect` does not: its member's key comes at the
        next renewal)."""
        check_group_name(group)
        if every_s < 0:
            p = self.get(group)
            p.active = False
            p.wake.set()
            self._save()
            if self.claims is not None:
                try:
                    self.claims.release(group)
                except FerryError as e:  # it goes with this node's lease; a standby waits until then
                    log.warning("snapshots: group %s's protector claim stays with the lease: %s", group, e)
            self.record("info", f"group {group} is no longer protected (its last snapshot is kept)")
            return p
        every = self.check_every(every_s)
        agents = list(dict.fromkeys(agents))
        if not agents and check:
            self._agents_of(group)  # refused now, not at the first round, if no one can say
        with self._lock:
            p = self._groups.get(group)
            was_active = p is not None and p.active
            if p is None:
                p = self._groups[group] = Protected(group, every, agents)
            p.every_s, p.agents, p.active = every, agents, True
        self._save()
        if not was_active:
            self._spawn(p)
        p.wake.set()  # the first round now, not an interval from now
        over = ", ".join(agents) or "the agents etcd names for its members at each round"
        self.record("info", f"group {group} is protected: a snapshot every {every:g} s over {over}")
        return p

    def _agents_of(self, group: str) -> list[str]:
        if self.members is None:
            raise InvalidArgumentError(
                f"which agents run group {group}'s members? name each with --members-on HOST:PORT",
                hint="with [coordination], the members' keys in etcd say it",
            )
        agents = self.members(group)
        if not agents:
            raise NotFoundError(f"etcd knows no member of group {group}")
        return agents

    def get(self, group: str) -> Protected:
        with self._lock:
            p = self._groups.get(group)
        if p is None:
            raise NotFoundError(f"group {group} is not protected by this agent", node=self.node)
        return p

    def list(self, group: str = "") -> list[Protected]:
        with self._lock:
            return [p for g, p in sorted(self._groups.items()) if not group or g == group]

    def _spawn(self, p: Protected) -> None:
        threading.Thread(target=self._loop, args=(p,), name=f"protect-{p.group}", daemon=True).start()

    def _loop(self, p: Protected) -> None:
        p.due_at = time.monotonic() + p.every_s
        while not self._stop.is_set() and p.active:
            asked = p.wake.wait(max(0.0, min(p.due_at - time.monotonic(), CHECK_EVERY_S)))
            p.wake.clear()
            if self._stop.is_set() or not p.active:
                return
            if not asked and time.monotonic() < p.due_at and not self._uncovered(p):
                continue
            began = time.monotonic()
            try:
                self.take(p.group)
                # From the round's start: "every 10 s" is a snapshot every 10 s, not 10 s after
                # the last one's ship (which would age the snapshot a recovery reads by that much).
                p.failing, p.due_at = 0, began + p.every_s
            except StandingBy:
                p.failing, p.due_at = 0, began + p.every_s  # read etcd's last again then
            except Exception as e:
                if not isinstance(e, FerryError):
                    log.exception("snapshots: a round of group %s failed", p.group)
                p.failing += 1  # recorded by take(); tried again soon, then less and less often
                p.due_at = time.monotonic() + retry_in(p.failing, p.every_s)

    def _uncovered(self, p: Protected) -> bool:
        """Whether the group's last snapshot no longer covers it (a member moved, a buddy's node
        died), so that a round is due now, not at the interval. Only while this agent runs the
        rounds and the last one succeeded: a failed round's retries keep their own pace."""
        if p.rounds_by or p.failing or not p.last.epoch:
            return False
        try:
            why = self.stale(p.group, p.last)
        except FerryError as e:  # etcd cannot say: the interval stands
            log.info("snapshots: cannot tell whether group %s's last snapshot covers it: %s", p.group, e)
            return False
        if why:
            self.record("info", f"group {p.group}: a snapshot round now, not at the interval: {why}")
        return bool(why)

    def take(self, group: str) -> Protected:
        """One round now (after the one in progress, if any); raise if it fails."""
        p = self.get(group)
        with p.lock:
            self._claim(p)
            if why := self.blocked(group):
                raise RefusedError(f"no snapshot of group {group} now: {why}", step="snapshot")
            agents = p.agents or self._agents_of(group)  # with etcd: where the members run now
            floor = max(p.tried, p.last.epoch)
            # Taken before the round: no later protector, nor a move's adopted image, reuses it.
            epoch = p.tried = self.claims.number(group, floor) if self.claims is not None else floor + 1
            p.rounds += 1
            self._save()
            holding = self.claims.holding() if self.claims is not None else lambda: ""
            keep = self._keepers(group, agents)
            kept_by = [m.buddy_agent for m in p.last.members]  # the last set's keepers

            def go_on() -> str:
                """ "" while the round may go on: this agent still runs the rounds, and every node
                it waits on still lives (a call to a dead one waits out a connect timeout)."""
                if why := holding():
                    return why
                try:
                    if why := self.blocked(group):
                        return why
                    if gone := [k for k in keep if k not in self.keepers(agents)]:
                        return f"agent {gone[0]}, which keeps images of this round, lost its lease in etcd"
                except FerryError as e:  # etcd cannot say: the calls' own bounds stand
                    log.info("snapshots: cannot tell whether round %d of %s may go on: %s", epoch, group, e)
                return ""

            p.in_progress = epoch
            try:
                snap, times = rounds.take(group, epoch, agents, self.call, self.config.hold_s, go_on, keep)
                self._count(group, snap)
            except Exception as e:
                err = as_ferry_error(e, "snapshot", self.node)
                p.failed += 1
                p.last_error = str(err)
                if self._still_ours(group):  # else the rounds are another agent's, its images too
                    self._drop(p, p.last.epoch, [*agents, *keep])
                p.in_progress = 0  # its images are gone too
                self.observe(group, None, p.last_error)
                self.record(
                    "warning",
                    f"group {group}: snapshot round {epoch} failed, the last complete one is kept: {err}",
                )
                raise err from e
            p.last, p.last_error = snap, ""
            self._save()  # from here this set is the one that counts
            self._drop(p, epoch, [*agents, *keep, *kept_by])
            p.in_progress = 0
            self.observe(group, snap, "")
            p.times = times
            log.info(
                "snapshots: group %s round %d complete: paused %.2f s, %d bytes (warm-up before it "
                "%.2f s; hold %.2f s, release %.2f s, ship %.2f s)",
                group,
                epoch,
                snap.group_pause_s,
                sum(m.bytes for m in snap.members),
                times.warm_s,
                times.hold_s,
                times.release_s,
                times.ship_s,
            )
            return p

    def _keepers(self, group: str, agents: list[str]) -> list[str]:
        """The spares that keep this round's images ([] if etcd cannot say: the ring keeps them)."""
        try:
            return self.keepers(agents)
        except FerryError as e:
            log.info("snapshots: no spare keeps group %s's images this round: %s", group, e)
            return []

    def rollback(self, group: str) -> pb.RollbackResult:
        """Every member of `group` back to its last complete snapshot, in place (ferry rollback)."""
        p = self.get(group)
        with p.lock:  # no round while the members are being replaced
            self._claim(p)  # nor one by another agent
            snap = p.last
            others = list(p.agents)
            if self.members is not None:
                try:
                    others += self.members(group)  # where members moved since, by etcd
                except FerryError as e:
                    log.warning("snapshots: etcd could not say where group %s's members run: %s", group, e)
            self.record("info", f"group {group}: rolling back to snapshot round {snap.epoch}")
            try:
                t = rollback.roll_back(group, snap, self.call, others, self.config.hold_s)
            except FerryError as e:
                self.record("alert", f"group {group}: the rollback to round {snap.epoch} failed: {e}")
                raise
        self.record(
            "info",
            f"group {group}: every member is back at snapshot round {snap.epoch} "
            f"(images fetched in {t.fetch_s:.2f} s while the job ran, then paused {t.paused_s:.2f} s)",
        )
        out = pb.RollbackResult(group=group, epoch=snap.epoch, fetch_s=t.fetch_s, paused_s=t.paused_s)
        for m in snap.members:
            here = pb.MemberCopy()
            here.CopyFrom(m)
            here.agent = t.placed[m.job]
            out.members.append(here)
        return out

    def _claim(self, p: Protected) -> None:
        """With etcd: go on only as the agent that runs the group's rounds (taking them if no one
        does), from the group's last snapshot as etcd holds it; raise StandingBy otherwise."""
        if self.claims is None:
            return
        try:
            c = self.claims.claim(p.group)
        except FerryError as e:  # in doubt, no round: two coordinators would refuse each other's holds
            raise StandingBy(
                f"etcd cannot say which agent runs group {p.group}'s rounds: {e.cause}", step="snapshot"
            ) from e
        if c.last is not None and c.last.epoch > p.last.epoch:
            p.last = c.last  # a round another protector completed
        p.tried = max(p.tried, c.tried)
        was, p.rounds_by = p.rounds_by, c.holder
        if c.holder:
            if c.holder != was:
                said = f"group {p.group}: {c.holder} runs its snapshot rounds; this agent stands by"
                self.record("info", said)
            raise StandingBy(
                f"group {p.group}'s snapshot rounds are run by {c.holder}",
                step="snapshot",
                node=self.node,
                hint="ask that agent; this one takes over if its node's lease ends",
            )
        if was:
            self.record("info", f"group {p.group}: this agent runs its snapshot rounds now (after {was})")
            self._save()

    def _count(self, group: str, snap: pb.SnapshotSet) -> None:
        """With etcd: make a complete round the group's last snapshot there, only while this
        agent's claim holds (etcd checks, in the same transaction): a round that ended after
        another agent took the rounds over never replaces theirs, and drops none of their images.
        A failed write (etcd unreachable) fails the round: in doubt, it does not count."""
        if self.claims is not None and not self.claims.publish(
            group, json_format.MessageToJson(snap, indent=None)
        ):
            raise StandingBy(
                f"round {snap.epoch} of group {group} completed after this agent's claim on its rounds "
                "ended: it does not count",
                step="snapshot",
                node=self.node,
            )

    def _still_ours(self, group: str) -> bool:
        """Whether this agent may drop the group's images of other rounds (without etcd: yes)."""
        if self.claims is None:
            return True
        try:
            return self.claims.ours(group)
        except FerryError:
            return False  # in doubt, keep every image: the next round's drop removes them

    def _drop(self, p: Protected, keep: int, agents: list[str]) -> None:
        """Every node of the round, its keepers and the kept set's nodes and keepers drop every
        other round's images."""
        req = pb.SnapshotMemberRequest(group=p.group, epoch=keep, action=pb.SNAPSHOT_ACTION_DROP)

        def one(agent: str) -> None:
            try:
                self.call(agent, req, DROP_CALL_S)
            except FerryError as e:  # its older copies stay until the next round's drop
                log.warning("snapshots: agent %s did not drop group %s's older images: %s", agent, p.group, e)

        # At once, and briefly: a dead node in the last set must not hold the next round back.
        # One etcd says has no lease is not asked at all: its memory went with it, and the call
        # would wait out its bound while a recovered member's only copy lies beside it.
        kept = [a for m in p.last.members for a in (m.agent, m.buddy_agent) if a]
        targets = list(dict.fromkeys([*agents, *kept]))
        try:
            gone = self.dead(targets)
        except FerryError as e:  # etcd cannot say: every one is asked, within the bound
            log.info("snapshots: cannot tell which of group %s's agents live: %s", p.group, e)
            gone = set()
        targets = [a for a in targets if a not in gone]
        with ThreadPoolExecutor(max(1, len(targets))) as pool:
            pool.map(one, targets)


def retry_in(failing: int, every_s: float) -> float:
    """When the round after `failing` failed ones in a row is due: 1 s, 2 s, 4 s ... the interval."""
    return min(every_s, RETRY_FIRST_S * 2 ** (min(failing, 32) - 1))


def age(snap: pb.SnapshotSet, now: float | None = None) -> float:
    return (now or time.time()) - snap.taken_at
