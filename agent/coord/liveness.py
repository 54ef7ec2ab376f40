"""This node's life in etcd: a lease kept alive, its group members published, and fencing when
the lease can no longer be trusted (docs/recovery.md has the timings and their order).

    CONNECTING → LIVE        a lease is granted, the node's key put, fenced members settled
    LIVE → FENCED            no renewal landed and the fencing deadline came: members fenced
    FENCED → LIVE            a renewal landed: the lease never expired, so no one can have
                             started a member elsewhere; the fenced members run again
    FENCED → CONNECTING      etcd says the lease is gone: a new one, then each fenced member is
                             settled by its key (still ours: claimed back and unfenced; another
                             node's: that copy ends without running)
    LIVE → CONNECTING        the lease is gone without the deadline passing (fenced first)
    any → STOPPED            the agent stops

The deadline is the last renewal's *send* time plus the TTL etcd granted, less the margin:
etcd restarts the TTL when the renewal arrives, later, so the lease cannot expire before it.

Keys (under the configured prefix, "/ferry/"):
    nodes/<node>                    {"agent": HOST:PORT, "agent_id": ...}, on the lease
    groups/<group>/members/<job>    {"node", "agent", "address", "rank"}, no lease: it must
                                    outlive its node to say where the member was
A recovery (elsewhere) takes a member over by swapping its key to its own node before it
restores anything; a fenced copy whose key names another node therefore never runs again.

Why one module: the lease, the fencing it drives and the judging of other nodes share one
state (is this node's own lease to be trusted?) and one etcd client; split, each part would
read that state from another's object, and the order the timings need would span files.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agent.compat import StrEnum
from agent.coord.config import CoordConfig
from agent.coord.etcd import EtcdClient, Lease
from agent.coord.pings import Pings
from agent.errors import FerryError, InvalidArgumentError, NotFoundError
from agent.health.events import EventLog
from agent.jobs import fence
from agent.jobs.record import JobRecord, JobState, env_of
from agent.jobs.registry import JobRegistry
from agent.statemachine import Transitions
from agent.tls import Identity

if TYPE_CHECKING:
    from agent.rpc import pb

log = logging.getLogger(__name__)


class Liveness(StrEnum):
    CONNECTING = "connecting"
    LIVE = "live"
    FENCED = "fenced"
    STOPPED = "stopped"


_L = Liveness
LIVENESS: Transitions[Liveness] = Transitions(
    "liveness",
    {
        _L.CONNECTING: frozenset({_L.LIVE, _L.STOPPED}),
        _L.LIVE: frozenset({_L.FENCED, _L.CONNECTING, _L.STOPPED}),
        _L.FENCED: frozenset({_L.LIVE, _L.CONNECTING, _L.STOPPED}),
        _L.STOPPED: frozenset(),
    },
)


@dataclass(frozen=True)
class Member:
    """A group member as etcd holds it."""

    group: str
    job: str
    node: str
    agent: str
    address: str
    rank: str

    def value(self) -> str:
        return json.dumps({k: getattr(self, k) for k in ("node", "agent", "address", "rank")}, sort_keys=True)

    @classmethod
    def parse(cls, group: str, job: str, raw: bytes) -> Member:
        d = json.loads(raw)
        rest = (str(d.get(k, "")) for k in ("agent", "address", "rank"))
        return cls(group, job, str(d["node"]), *rest)


@dataclass(frozen=True)
class LostMember:
    """A member of a group with a member here, on a node that is dead: its lease expired and its
    agent does not answer. Shown by `ferry ps --group` until it is back or recovered."""

    member: Member
    since: float  # wall time it was found lost
    why: str  # what its agent's address answered


def rank_of(rec: JobRecord) -> str:
    return env_of(rec).get("RANK", "")


def for_agent(
    config: CoordConfig,
    node: str,
    registry: JobRegistry,
    identity: Identity | None,
    events: EventLog,
    probe: Callable[[str], str],
) -> NodeLiveness | None:
    """The agent's NodeLiveness (None without `[coordination]`); etcd needs its certificate."""
    if not config.enabled:
        return None
    if identity is None:
        raise InvalidArgumentError(
            "[coordination] needs the agent's TLS identity: etcd admits the cluster CA's certificates",
            hint="start the agent with --tls-dir, or remove [coordination] from its config",
        )
    return NodeLiveness(config, node, registry, identity, lambda k, m, j: events.record(k, m, job=j), probe)


class NodeLiveness:
    """Owns this node's lease and its members' keys; runs on one thread of its own."""

    def __init__(
        self,
        config: CoordConfig,
        node: str,
        registry: JobRegistry,
        identity: Identity,
        record: Callable[[str, str, str], None],  # (kind, message, job): the node's event log
        probe: Callable[[str], str] = lambda agent: "not asked",  # an agent's HOST:PORT -> "" if it answers
    ) -> None:
        self.config, self.node, self.registry, self.record = config, node, registry, record
        self.probe = probe
        #: The other members' agents, asked all along: the answer is there when a lease expires.
        self.pings = Pings(probe, config.renew_every_s)
        #: (group, when its member was found lost) at every check while one is: the recovery
        #: (agent.snapshots.recover), which etcd lets one agent run at a time.
        self.on_lost: Callable[[str, float], None] = lambda group, since: None
        self.lost: dict[str, LostMember] = {}  # by job name
        #: Members fenced under the current lease: a renewal of that lease may unfence them (no
        #: other node could act while it lived). Any other fenced member is settled by its key.
        self._fenced_under_lease: set[str] = set()
        self._cut_off: set[str] = set()  # nodes without a lease whose agent answers (said once)
        self.client = EtcdClient.with_identity(config.endpoints, identity, timeout_s=config.renew_every_s)
        self.state = Liveness.CONNECTING
        self.agent = ""  # this agent's HOST:PORT, once it listens
        self.lease: Lease | None = None
        self.valid_until = 0.0  # monotonic: etcd cannot expire the lease before this
        self.fenced_at = 0.0  # monotonic, of the last fencing (for the tests and the log)
        self._stop = threading.Event()
        self._node_gone = threading.Event()  # a node's key went (its lease expired): check now
        registry.may_go_on = self.may_go_on
        registry.on_post_copy_lost = self.hand_back
        self._thread = threading.Thread(target=self._run, name="coordination", daemon=True)
        # Its own thread: asking a dead node's agent takes seconds, which must never delay a renewal.
        self._watcher = threading.Thread(target=self._watch, name="group-watch", daemon=True)

    def key(self, *parts: str) -> str:
        return self.config.prefix + "/".join(parts)

    def start(self, agent: str) -> None:
        self.agent = agent
        self._thread.start()
        self._watcher.start()

    def stop(self) -> None:
        """The agent stops, its jobs do not: with no one to renew the lease they are fenced first
        (its next start settles them), then the lease is revoked."""
        self._stop.set()
        self._node_gone.set()
        self.pings.stop()
        for t in (self._thread, self._watcher):
            if t.is_alive():
                t.join(self.config.lease_ttl_s + 2)
        if self.state is Liveness.LIVE:
            self._fence_all("the agent stopped: no one renews this node's lease")
        if self.lease is not None:
            try:
                self.client.revoke(self.lease.id)
            except FerryError as e:
                log.info("coordination: lease not revoked (%s); it expires by itself", e)
        self.client.close()
        self._to(Liveness.STOPPED, "the agent stopped")

    def _to(self, new: Liveness, why: str) -> None:
        old, self.state = self.state, LIVENESS.check(self.state, new, f"of node {self.node}")
        log.info("coordination: %s → %s (%s)", old.value, new.value, why)

    # -- the loop ---------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                wait = self._connect() if self.state is Liveness.CONNECTING else self._tick()
            except Exception:  # the loop is the node's liveness: it must not end on a bug
                log.exception("coordination: unexpected failure; trying again")
                wait = 0.5
            self._stop.wait(wait)

    def _connect(self) -> float:
        # A member that went on (past the gate, may_go_on) just before the lease was found gone.
        self._fence_members("this node's lease in etcd is gone", then="; etcd settles them")
        try:
            lease = self.client.grant(self.config.lease_ttl_s)
            value = json.dumps({"agent": self.agent, "node": self.node})
            self.client.put(self.key("nodes", self.node), value, lease=lease.id)
        except FerryError as e:
            log.warning("coordination: no lease yet (%s); fenced members stay fenced", e)
            return 0.5
        self.lease, self.valid_until = lease, lease.granted_at + lease.ttl
        self._to(Liveness.LIVE, f"lease {lease.id:x}, {lease.ttl} s")
        self._settle_fenced()
        return 0.0

    def _tick(self) -> float:
        assert self.lease is not None
        deadline = self.valid_until - self.config.fence_margin_s
        sent = time.monotonic()
        if sent >= deadline and self.state is Liveness.LIVE:
            self._fence_all(f"no lease renewal landed for {sent - (self.valid_until - self.lease.ttl):.1f} s")
        elif self.state is Liveness.FENCED:  # one that went on under this lease, just before the deadline
            self._fenced_under_lease |= self._fence_members("this node's lease is past its fencing deadline")
        try:
            # Never past the deadline: a renewal that hangs must not delay fencing.
            budget = max(deadline - sent, 0.1) if self.state is Liveness.LIVE else self.config.renew_every_s
            ttl = self.client.refresh(self.lease.id, min(budget, self.config.renew_every_s))
        except FerryError as e:
            log.warning("coordination: lease renewal failed: %s", e)
            if self.state is Liveness.FENCED:
                return 0.2
            return max(min(0.2, deadline - time.monotonic()), 0.0)
        if ttl <= 0:
            if self.state is Liveness.LIVE:  # expired though its deadline had not come: fence now
                self._fence_all("etcd says this node's lease expired")
            self._fenced_under_lease.clear()  # the lease is gone: each is settled by its key
            self._to(Liveness.CONNECTING, "etcd says the lease is gone")
            return 0.0
        self.valid_until = sent + ttl
        self._words()
        if self.state is Liveness.FENCED:
            self._to(Liveness.LIVE, "a renewal landed: the lease never expired")
            self._unfence_all("etcd answered again and this node's lease never expired")
        if self.state is Liveness.LIVE and self._unsettled():
            self._settle_fenced()  # a settling that failed (its key unreadable) is tried again
        self._publish()
        to_deadline = self.valid_until - self.config.fence_margin_s - time.monotonic()
        return min(self.config.renew_every_s, max(to_deadline, 0.0))

    # -- fencing ----------------------------------------------------------------------------

    def fence_at_start(self) -> None:
        """Before the agent serves: whether its last lease expired while it was down is unknown, so
        its running members are fenced like the ones it left fenced, until etcd settles them."""
        assert self.state is Liveness.CONNECTING
        self._fence_members("the agent started: etcd must first say that no other copy was started meanwhile")

    def _fence_all(self, why: str) -> None:
        self.fenced_at = time.monotonic()
        self._to(Liveness.FENCED, why)
        self._fenced_under_lease |= self._fence_members(why, then="; they wait for etcd")

    def _fence_members(self, why: str, then: str = "") -> set[str]:
        fenced = [
            r.name
            for r in self.registry.list()
            if r.group and r.state is JobState.RUNNING and fence.fence(self.registry, r.name, why)
        ]
        if fenced:
            self.record("alert", f"fenced {', '.join(fenced)}: {why}{then}", "")
        return set(fenced)

    def _unfence_all(self, why: str) -> None:
        """The lease never expired: what was fenced under it runs again. A member fenced under an
        earlier lease (one whose settling failed) is not among them: only its key may say
        (tests/unit/test_recovery_model.py finds two copies otherwise)."""
        for rec in self.registry.list():
            if rec.state is JobState.FENCED and rec.name in self._fenced_under_lease:
                self._unfence(rec.name, why)
        self._fenced_under_lease.clear()

    def may_go_on(self, rec: JobRecord, since: float) -> str:
        """registry.may_go_on: a frozen member (a move's, a snapshot's) goes on only if this node
        held one lease, live, from `since` (at or before its freeze) to now, so that no recovery
        can have started it elsewhere meanwhile; else why not. Fencing stops running members
        only: without this, one frozen across a lost lease would run beside its recovered copy
        (tests/unit/test_recovery_model.py finds two copies)."""
        lease = self.lease
        if self.state is not Liveness.LIVE or lease is None or self.word_ms() <= 0:
            return f"node {self.node} has no live lease in etcd now ({self.state.value})"
        if lease.granted_at > since:
            return f"node {self.node}'s lease in etcd was lost and granted again since job {rec.name} froze"
        return ""

    def word_ms(self) -> int:
        """What a member's PID 1 may run for without a newer word: to this node's own fencing
        deadline (0 when it is not live: a member arriving then stops at once)."""
        if self.state is not Liveness.LIVE:
            return 0
        return max(int((self.valid_until - self.config.fence_margin_s - time.monotonic()) * 1000), 0)

    def _words(self) -> None:
        """Each running member's PID 1 hears the new deadline (its watchdog, in ferry-init)."""
        ms = self.word_ms()
        for rec in self.registry.list():
            if rec.group and rec.state is JobState.RUNNING:
                fence.word(rec, ms)

    def _unfence(self, name: str, why: str) -> None:
        with contextlib.suppress(NotFoundError):  # before SIGCONT: its watchdog must not stop it again
            fence.word(self.registry.get(name), self.word_ms())
        try:
            if fence.unfence(self.registry, name, why):
                self.record("info", f"unfenced: {why}", name)
        except FerryError as e:
            log.error("coordination: job %s stays fenced: %s", name, e)

    def _unsettled(self) -> bool:
        return any(self._settles(r) and r.name not in self._fenced_under_lease for r in self.registry.list())

    @staticmethod
    def _settles(rec: JobRecord) -> bool:
        """A member this node's liveness fenced; one a rollback fenced is the rollback's to end
        (settled by its key, it would run again beside the copy the rollback restores)."""
        return bool(rec.group) and rec.state is JobState.FENCED and not rec.rolled_back_to

    def _settle_fenced(self) -> None:
        """After a lost lease: each fenced member's key decides (fail closed: any doubt, it waits)."""
        for rec in self.registry.list():
            if not self._settles(rec):
                continue
            key = self.key("groups", rec.group, "members", rec.name)
            try:
                kv = self.client.get(key)
                other = Member.parse(rec.group, rec.name, kv.value).node if kv is not None else self.node
                if other != self.node:
                    self.registry.end_fenced(rec.name, f"its group recovered it on node {other}")
                    self.record("alert", f"ended without running again: node {other} runs it now", rec.name)
                    continue
                mine = self._member(rec).value()
                ok = (
                    self.client.compare_and_swap(key, mine, kv.mod_revision)
                    if kv is not None
                    else self.client.create_if_absent(key, mine)
                )
            except (FerryError, ValueError, KeyError) as e:
                log.warning("coordination: job %s stays fenced until its key can be read: %s", rec.name, e)
                continue
            if ok:  # claimed back before anyone else: no copy can start elsewhere now
                self._unfence(rec.name, "its key in etcd still names this node")

    # -- the other nodes of our groups --------------------------------------------------------

    def _watch(self) -> None:
        """Check the groups' members every renewal interval, and at once when a node's lease goes
        (a watch on nodes/): a dead node is found as soon as etcd expires it."""
        threading.Thread(target=self._watch_nodes, name="nodes-watch", daemon=True).start()
        while not self._stop.is_set():
            self._node_gone.wait(self.config.renew_every_s)
            self._node_gone.clear()
            if self._stop.is_set():
                return
            if self.state is not Liveness.LIVE:
                continue  # a node that cannot trust its own lease judges no other
            try:
                self.check_peers()
            except FerryError as e:
                log.warning("coordination: cannot read the groups' members: %s", e)
            except Exception:
                log.exception("coordination: checking the groups' members failed")

    def _watch_nodes(self) -> None:
        while not self._stop.is_set():
            try:
                watch = self.client.watch_prefix(self.key("nodes", ""))
            except FerryError as e:  # the periodic check goes on meanwhile
                log.info("coordination: no watch on the nodes' leases yet: %s", e)
                self._stop.wait(self.config.renew_every_s)
                continue
            try:
                for ev in watch:
                    if ev.kind == "delete":
                        self._node_gone.set()
                    if self._stop.is_set():
                        break
            except FerryError as e:
                log.info("coordination: the watch on the nodes' leases broke: %s", e)
            finally:
                watch.cancel()
            self._stop.wait(self.config.renew_every_s)

    def members(self, group: str) -> list[Member]:
        """The group's members as etcd holds them (where each runs, by its last move or start)."""
        out = []
        for kv in self.client.get_prefix(self.key("groups", group, "members", "")):
            try:
                out.append(Member.parse(group, kv.key.decode().rsplit("/", 1)[-1], kv.value))
            except (ValueError, KeyError):
                log.warning("coordination: unreadable member key %s", kv.key.decode())
        return out

    def round_blocked(self, group: str) -> str:
        """Why no snapshot round of the group may start now ("" if one may): a recovery holds it,
        or a member's node has no lease (a round would wait on its dead agent while the others
        stay frozen)."""
        if self.client.get(self.key("groups", group, "recovery")) is not None:
            return "it is being recovered"
        if self.client.get(self.key("groups", group, "pending")) is not None:
            return "a recovery of it is to be finished"
        live = self.live_nodes()
        if gone := sorted({m.node for m in self.members(group)} - live - {self.node}):
            return f"node {gone[0]}, where a member runs, has no lease in etcd"
        return ""

    def snapshot_stale(self, group: str, snap: pb.SnapshotSet) -> str:
        """Why `snap` no longer covers the group as etcd holds it ("" if it does): a member runs
        on another node than the set says (a move; its old node is likely to die next), or the
        node that keeps a member's copy has no lease (a second failure would find no copy)."""
        where = {m.job: m.node for m in self.members(group)}
        for c in snap.members:
            if (now := where.get(c.job)) and now != c.node:
                return f"member {c.job} runs on node {now}, not on node {c.node} where it was taken"
        live = self.live_nodes() | {self.node}
        for c in snap.members:
            if c.buddy_node and c.buddy_node not in live:
                return f"node {c.buddy_node}, which keeps member {c.job}'s copy, has no lease in etcd"
        return ""

    def keepers(self, spares: list[str], agents: list[str]) -> list[str]:
        """Of `spares` (agents' HOST:PORT), in order, those whose node holds a lease, that run
        none of `agents`' members and that no recovery claimed (a claimed spare is a group's
        node now, which a warned failure may empty and kill next): where a round's images may
        be kept. If none of them is, this agent's own node, on the same terms: the agent that
        runs a group's rounds may be a spare itself (it took them over from a member's node that
        died), which its own configuration does not list, and a member whose images its peers'
        nodes keep (the ring, rounds.take) can move nowhere as an increment over them."""
        live = self._live_agents()
        claims = self.client.get_prefix(self.key("spares", ""))
        free = live - {kv.key.decode().rsplit("/", 1)[-1] for kv in claims} - set(agents)
        return [a for a in dict.fromkeys(spares) if a in free] or [a for a in (self.agent,) if a in free]

    def agents_without_lease(self, agents: list[str]) -> set[str]:
        """Of `agents` (HOST:PORT), those whose node etcd holds no lease for (this one never)."""
        live = self._live_agents() | {self.agent}
        return {a for a in agents if a not in live}

    def _live_agents(self) -> set[str]:
        """The agents (HOST:PORT) that `nodes/<node>` keys name: their nodes hold a lease."""
        live = set()
        for kv in self.client.get_prefix(self.key("nodes", "")):
            with contextlib.suppress(ValueError, KeyError, TypeError):
                live.add(str(json.loads(kv.value)["agent"]))
        return live

    def live_nodes(self) -> set[str]:
        """The nodes etcd holds a lease for (`nodes/<node>` goes with its lease)."""
        return {kv.key.decode().rsplit("/", 1)[-1] for kv in self.client.get_prefix(self.key("nodes", ""))}

    def without_lease(self, nodes: set[str]) -> set[str]:
        """Of `nodes`, those etcd holds no lease for (none when etcd cannot say)."""
        try:
            live = self.live_nodes()
        except FerryError as e:
            log.info("coordination: cannot tell which nodes have a lease: %s", e)
            return set()
        return nodes - live - {self.node}

    def check_peers(self) -> None:
        """A member of a group with a member here is lost when its node has no lease and its agent
        does not answer: the group is degraded, and `ferry events` says so once."""
        records = [r for r in self.registry.list() if r.group]
        here = {r.group for r in records if r.state.active}
        live = self.live_nodes()
        members = []
        marks: dict[str, set[str]] = {}  # group -> its `pending` and `recovery` keys
        for kv in self.client.get_prefix(self.key("groups", "")):
            parts = kv.key.decode()[len(self.config.prefix) :].split("/")  # groups/<g>/members/<job>
            if len(parts) == 3 and parts[2] in ("pending", "recovery"):
                marks.setdefault(parts[1], set()).add(parts[2])
            if len(parts) == 4 and parts[1] in here:
                try:
                    members.append(Member.parse(parts[1], parts[3], kv.value))
                except (ValueError, KeyError):
                    log.warning("coordination: unreadable member key %s", kv.key.decode())
        self.pings.watch({m.agent for m in members if m.node != self.node and m.agent})
        seen = set()
        for m in members:
            seen.add(m.job)
            if m.node == self.node or m.node in live:
                self._cut_off.discard(m.node)
                if "pending" in marks.get(m.group, ()):
                    continue  # its key may name a spare that runs nothing yet: not back until done
                if (gone := self.lost.pop(m.job, None)) is not None:
                    self.record("info", f"group {m.group}: member {m.job} runs on node {m.node} again", m.job)
                    log.info("coordination: %s no longer lost (was on %s)", m.job, gone.member.node)
                continue
            if m.job in self.lost:
                continue
            # A ping already unanswered is the answer; one answered is asked again now.
            why = self.pings.silent(m.agent) or self.probe(m.agent)
            if not why:
                if m.node not in self._cut_off:
                    self._cut_off.add(m.node)
                    self.record(
                        "warning",
                        f"node {m.node} has no lease in etcd but its agent answers: "
                        f"its members are fenced there until it reaches etcd again",
                        "",
                    )
                continue
            self.lost[m.job] = LostMember(m, time.time(), why)
            rank = f" (rank {m.rank})" if m.rank else ""
            self.record(
                "alert",
                f"group {m.group} is degraded: member {m.job}{rank} on node {m.node} is lost: its "
                f"lease in etcd expired and its agent at {m.agent or '?'} does not answer ({why})",
                m.job,
            )
        for job in set(self.lost) - seen:  # its key went: ended, or taken by a recovery elsewhere
            del self.lost[job]
        for g, since in {x.member.group: x.since for x in self.lost.values()}.items():
            self.on_lost(g, since)  # every check while lost: a recovery that died is taken over
        # A recovery that died half-way (its claim went with its lease; its mark stays) may have
        # ended every member that was running: any agent with a record of the group takes it over.
        for g in {r.group for r in records} & {g for g, m in marks.items() if m == {"pending"}}:
            self.on_lost(g, time.time())

    # -- members ----------------------------------------------------------------------------

    def hand_back(self, rec: JobRecord, source_node: str) -> None:
        """A member killed here because its post-copy failed: its key names the source's node
        again. A source that lives resumes its frozen copy there (the move's own rule) and keeps
        the key; one that died (the likeliest cause: a warned node that died mid-move) leaves a
        member on a node without a lease, found lost and recovered from the last snapshot like
        any other. Left naming this node, the key would say the member runs where nothing runs,
        and the group would wait on it with no one recovering it."""
        if not rec.group:
            return
        key = self.key("groups", rec.group, "members", rec.name)
        try:
            kv = self.client.get(key)
            if kv is not None and Member.parse(rec.group, rec.name, kv.value).node != self.node:
                return  # another node's already: the source resumed, or a recovery took it
            source = self.client.get(self.key("nodes", source_node))
            agent = str(json.loads(source.value).get("agent", "")) if source is not None else ""
            back = Member(rec.group, rec.name, source_node, agent, rec.address, rank_of(rec))
            # No key: the copy here crashed on a missing page first, and its end, taken for an
            # exit, removed the key this node had published. It is put back the same way.
            if kv is None:
                put = self.client.create_if_absent(key, back.value())
            else:
                put = self.client.compare_and_swap(key, back.value(), kv.mod_revision)
            if put:
                self.record(
                    "warning",
                    f"member {rec.name} of group {rec.group} was killed here when its post-copy from "
                    f"node {source_node} failed: its key names node {source_node} again (it resumes "
                    "there if that node lives; else the group recovers it)",
                    rec.name,
                )
        except (FerryError, ValueError, KeyError) as e:
            log.error(
                "coordination: member %s's key still names this node, where it no longer runs: %s",
                rec.name,
                e,
            )

    def _member(self, rec: JobRecord) -> Member:
        return Member(rec.group, rec.name, self.node, self.agent, rec.address, rank_of(rec))

    def _publish(self) -> None:
        """Every running member here has its key naming this node (a move's target rewrites it);
        one that ended here (exited, stopped) has none, unless another node's copy took it. One
        a rollback ended keeps its key: the rollback restores it (here, or a recovery swaps the
        key to a spare), and a round begun meanwhile must not find the group short of it."""
        for rec in self.registry.list():
            ended = rec.state in (JobState.EXITED, JobState.STOPPED) and not rec.rolled_back_to
            if not rec.group or not (rec.state is JobState.RUNNING or ended):
                continue
            key, want = self.key("groups", rec.group, "members", rec.name), self._member(rec).value()
            try:
                kv = self.client.get(key)
                if ended:
                    if kv is not None and Member.parse(rec.group, rec.name, kv.value).node == self.node:
                        self.client.delete_if(key, kv.mod_revision)
                elif kv is None or kv.value.decode() != want:
                    self.client.put(key, want)
            except (FerryError, ValueError, KeyError) as e:
                log.warning("coordination: member %s not published: %s", rec.name, e)
                return
