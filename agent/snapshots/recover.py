"""Recovery: a member's node is dead; the group comes back from its last complete snapshot, the
lost member on a spare, every other member rolled back in place, by itself.

Any agent with a member of the group may find the member lost (agent.coord.liveness: its
node's lease expired and its agent does not answer), and each then asks this module to
recover the group. etcd decides who does (never a home-made consensus):

1. **One recovery at a time**: `groups/<g>/recovery` is created (a transaction that fails if
   the key exists) with the recovering agent's own lease. The others leave it alone; if the
   recovering agent dies half-way its lease expires, the key goes with it, and the next agent
   that finds the member still lost takes the recovery over, from the same snapshot.
2. **The snapshot**: `groups/<g>/snapshot`, which the protecting agent wrote once the round
   was complete on every buddy. A lost member whose buddy's node is dead too cannot come back:
   the group waits, and says so.
3. **A spare per lost member**: the first `[[peers]] spare = true` that answers, hosts no
   member of the group and is not claimed already, the one keeping the member's copy first
   (it restores it from its own memory): `spares/<agent>` is created for it (a transaction, no
   lease: it stays the group's until an operator frees it).
4. **The takeover**: `groups/<g>/pending` (no lease) names each lost member's spare before
   anything changes, then the member's key is swapped to the spare's node (compare-and-swap on
   the revision read) *before* anything is restored. A copy on a node that was only cut off
   has fenced itself, and once it reaches etcd again it finds its key naming another node
   and ends without running (docs/recovery.md, "Settling a fenced member").
5. **Rollback** (agent.snapshots.rollback) with the lost member placed on the spare, a member
   that runs on another live node than the snapshot says rolled back there, and no agent on a
   node without a lease asked; then
   `pending` goes. A recovery that died half-way (its claim gone with its lease, `pending`
   left) leaves members whose key names a live spare that may run nothing, and members a
   rollback ended: every agent with a record of the group sees `pending` without a claim
   (agent.coord.liveness) and the next recovery takes it over, the same members on the same
   spares, from the same snapshot. A failed recovery leaves `pending` too: it is tried again.

With no spare free, the group waits, bounded by nothing but an operator: each check says so
once in `ferry events` and tries again.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from google.protobuf import json_format

from agent.coord.etcd import KeyValue
from agent.coord.liveness import Member, NodeLiveness
from agent.errors import FerryError
from agent.rpc import pb
from agent.snapshots import rollback
from agent.snapshots.rounds import Call

log = logging.getLogger(__name__)


@dataclass
class Recovered:
    group: str
    epoch: int
    placed: dict[str, str] = field(default_factory=dict)  # lost job -> the spare's node
    times: dict[str, float] = field(default_factory=dict)  # step -> seconds


class GroupRecovery:
    """Runs the recoveries this agent wins; one per group at a time on this agent."""

    def __init__(
        self,
        live: NodeLiveness,
        spares: Callable[[], list[str]],  # the spares' agents, in order of preference
        node_of: Callable[[str], str],  # a spare agent's node name, if it answers ("" if not)
        call: Call,
        hold_s: float,
        record: Callable[[str, str], None],
        observe: Callable[[Recovered | None, str], None] = lambda r, e: None,
    ) -> None:
        self.live, self.spares, self.node_of, self.call = live, spares, node_of, call
        self.hold_s, self.record, self.observe = hold_s, record, observe
        self._busy: set[str] = set()
        self._said: set[tuple[str, str]] = set()  # (group, why): each wait said once
        self._lock = threading.Lock()

    def start(self, group: str, lost_since: float) -> None:
        """A member of `group` is lost: recover it on a thread, unless one already runs here."""
        with self._lock:
            if group in self._busy:
                return
            self._busy.add(group)
        threading.Thread(
            target=self._run, args=(group, lost_since), name=f"recover-{group}", daemon=True
        ).start()

    def _run(self, group: str, lost_since: float) -> None:
        try:
            self.recover(group, lost_since)
        except Exception as e:
            log.exception("recovery of group %s failed", group)
            self.observe(None, str(e))
            self.record(
                "alert", f"group {group}: the recovery failed and is tried again at the next check: {e}"
            )
        finally:
            with self._lock:
                self._busy.discard(group)

    def _wait(self, group: str, why: str) -> None:
        if (group, why) not in self._said:
            self._said.add((group, why))
            self.record("warning", f"group {group} waits to recover: {why}")
        log.info("recovery of group %s waits: %s", group, why)

    def recover(self, group: str, lost_since: float = 0.0) -> Recovered | None:
        live, k = self.live, self.live.key
        lease = live.lease
        if lease is None:
            return None  # this node's own lease is not live: it judges no other
        claim = k("groups", group, "recovery")
        mine = json.dumps({"node": live.node, "agent": live.agent, "since": time.time()})
        t0 = time.monotonic()
        if not live.client.create_if_absent(claim, mine, lease=lease.id):
            log.info("recovery of group %s: another agent holds it", group)
            return None
        try:
            return self._recover(group, lost_since, t0)
        finally:
            try:
                kv = live.client.get(claim)
                if kv is not None and kv.value.decode() == mine:
                    live.client.delete_if(claim, kv.mod_revision)
            except FerryError as e:  # it goes with this node's lease
                log.warning("recovery of group %s: its claim stays until the lease ends: %s", group, e)

    def _recover(self, group: str, lost_since: float, t0: float) -> Recovered | None:
        live, k = self.live, self.live.key
        kv = live.client.get(k("groups", group, "snapshot"))
        if kv is None:
            self._wait(group, "it has no complete snapshot (`ferry protect`)")
            return None
        snap = json_format.Parse(kv.value, pb.SnapshotSet())
        nodes = live.live_nodes()
        members = {m.job: m for m in live.members(group)}
        pending_kv = live.client.get(k("groups", group, "pending"))
        pending = placed_by(pending_kv)
        lost, place = [], {}
        for m in snap.members:
            cur = members.get(m.job)
            spare = pending.get(m.job)
            if cur is None:
                continue
            if spare is not None and spare[1] in nodes and (cur.node == spare[1] or cur.node not in nodes):
                lost.append(m)  # a recovery half-way placed it there: the same spare again
                place[m.job] = spare
            elif cur.node not in nodes:
                lost.append(m)
        if not lost:
            if pending_kv is not None:  # its members run where their keys say: nothing is half-way
                live.client.delete_if(k("groups", group, "pending"), pending_kv.mod_revision)
            return None  # recovered meanwhile, or not lost after all
        # A member that runs on another live node than the snapshot says (an earlier recovery, or a
        # move, put it there) is rolled back where it runs now: the snapshot's node may be dead.
        lost_jobs = {m.job for m in lost}
        moved = {
            m.job: cur.agent
            for m in snap.members
            if (cur := members.get(m.job)) is not None
            and m.job not in lost_jobs
            and cur.node in nodes
            and cur.agent != m.agent
        }
        # Every agent known dead: those the snapshot names on nodes without a lease, and the lost
        # members' (no rollback step asks them; the lost members' copies went with them).
        dead = {m.agent for m in snap.members if m.node not in nodes} | {members[m.job].agent for m in lost}

        def fetchable(m: pb.MemberCopy) -> bool:  # its buddy lives, or it runs on its buddy now
            return m.buddy_node in nodes or moved.get(m.job) == m.buddy_agent

        if gone := [m for m in snap.members if (m.job in lost_jobs or m.job in moved) and not fetchable(m)]:
            self._wait(
                group, f"member {gone[0].job}'s snapshot copy was on node {gone[0].buddy_node}, dead too"
            )
            return None
        others = list(dict.fromkeys(m.agent for m in members.values() if m.node in nodes))
        if len(place) == len(lost) and self._whole(group, snap, others):
            # The recovery that left `pending` ended after its RESUME (or its held members went
            # on by themselves, every one of them): nothing is half-way.
            live.client.delete_if(k("groups", group, "pending"), pending_kv.mod_revision)  # type: ignore[union-attr]
            return None
        out = Recovered(group, snap.epoch)
        t1 = time.monotonic()
        fresh = self._claim_spares(group, [m for m in lost if m.job not in place], members, nodes, place)
        if fresh is None:
            return None
        place.update(fresh)
        # Durable before the first key changes: whoever takes this recovery over finds it here.
        mark = json.dumps(
            {"epoch": snap.epoch, "by": live.node, "place": {j: list(an) for j, an in place.items()}}
        )
        marked = live.client.put(k("groups", group, "pending"), mark)
        self._take_over_keys(group, place, members)
        out.times["claim"] = time.monotonic() - t1
        self.record(
            "info",
            f"group {group}: recovering from snapshot round {snap.epoch}: "
            + ", ".join(f"{job} onto node {node}" for job, (_, node) in place.items()),
        )
        # A failure keeps `pending`: the next check (here or on any agent) tries again from it.
        t = rollback.roll_back(
            group,
            snap,
            self.call,
            others,
            self.hold_s,
            {**moved, **{j: a for j, (a, _) in place.items()}},
            dead=dead,
        )
        try:
            live.client.delete_if(k("groups", group, "pending"), marked)
        except FerryError as e:  # the next check finds the group whole and removes it
            log.warning("recovery of group %s: its pending mark stays until the next check: %s", group, e)
        out.placed = {job: node for job, (_, node) in place.items()}
        out.times.update(fetch=t.fetch_s, end=t.end_s, restore=t.restore_s, paused=t.paused_s)
        out.times["recovery"] = time.monotonic() - t0
        # The work since the snapshot runs again, and the job stood still while it was recovered.
        out.times["lost"] = max(time.time() - snap.taken_at, 0.0)
        if lost_since:
            out.times["since_lost"] = time.time() - lost_since
        self.record(
            "info",
            f"group {group} recovered from snapshot round {snap.epoch} in {out.times['recovery']:.1f} s "
            f"(spare claimed {out.times['claim']:.2f} s, images fetched {t.fetch_s:.2f} s, old copies "
            f"ended {t.end_s:.2f} s, restored {t.restore_s:.2f} s): "
            + ", ".join(f"{job} runs on node {node}" for job, node in out.placed.items()),
        )
        self._said = {s for s in self._said if s[0] != group}
        self.observe(out, "")
        return out

    def _whole(self, group: str, snap: pb.SnapshotSet, agents: list[str]) -> bool:
        """Every member of the snapshot runs on one of `agents` (each answers LIST)."""
        try:
            running, _ = rollback.members_on(group, snap.epoch, self.call, agents)
        except FerryError:
            return False
        return {m.job for m in snap.members} <= running

    def _take_over_keys(
        self, group: str, place: dict[str, tuple[str, str]], members: dict[str, Member]
    ) -> None:
        """Each lost member's key swapped to its spare's node (compare-and-swap on the revision
        read); one that names the spare already (a recovery half-way swapped it) stays."""
        live, k = self.live, self.live.key
        for job, (agent, node) in place.items():
            key = k("groups", group, "members", job)
            kv = live.client.get(key)
            old = members[job]
            now = None if kv is None else Member.parse(group, job, kv.value).node
            if now == node:
                continue
            if now != old.node:
                raise FerryError(f"member {job}'s key changed during the recovery", step="recovery takeover")
            new = Member(group, job, node, agent, old.address, old.rank)
            if not live.client.compare_and_swap(key, new.value(), kv.mod_revision):  # type: ignore[union-attr]
                raise FerryError(f"member {job}'s key changed during the recovery", step="recovery takeover")

    def _claim_spares(
        self,
        group: str,
        lost: list[pb.MemberCopy],
        members: dict[str, Member],
        nodes: set[str],
        taken: dict[str, tuple[str, str]],
    ) -> dict[str, tuple[str, str]] | None:
        """A spare for each lost member, claimed; None if there are not enough (the group waits).
        `taken`: spares a recovery half-way placed other members on."""
        live, k = self.live, self.live.key
        busy = {m.agent for m in members.values()} | {a for a, _ in taken.values()}
        place: dict[str, tuple[str, str]] = {}
        free = [a for a in self.spares() if a not in busy]
        for m in lost:
            # The spare that keeps its copy first: it restores from its own memory.
            for agent in sorted(free, key=lambda a, m=m: a != m.buddy_agent):
                node = self.node_of(agent)
                if not node or node not in nodes:
                    continue
                claim = json.dumps({"group": group, "job": m.job, "by": live.node, "at": time.time()})
                if live.client.create_if_absent(k("spares", agent), claim) or self._ours(agent, group, m.job):
                    place[m.job] = (agent, node)
                    free.remove(agent)
                    break
            else:
                self._wait(group, f"no spare is free for member {m.job} ([[peers]] spare = true)")
                return None
        return place

    def _ours(self, agent: str, group: str, job: str) -> bool:
        """The spare was claimed for this member already (by a recovery that failed)."""
        kv = self.live.client.get(self.live.key("spares", agent))
        if kv is None:
            return False
        d = json.loads(kv.value)
        return bool(d.get("group") == group and d.get("job") == job)


def placed_by(kv: KeyValue | None) -> dict[str, tuple[str, str]]:
    """A recovery's `pending` mark: lost job -> (its spare's agent, node); {} if none."""
    if kv is None:
        return {}
    try:
        return {j: (str(an[0]), str(an[1])) for j, an in json.loads(kv.value)["place"].items()}
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        # Not taken as none: members its recovery moved to a spare would count as running there.
        raise FerryError(
            f"the mark of a recovery half-way, {kv.key.decode()}, is unreadable ({e})",
            step="recovery",
            hint="read it with etcdctl and restore each member it names with `ferry rollback`",
        ) from e
