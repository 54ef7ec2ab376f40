"""Which agent runs a group's snapshot rounds: one at a time, chosen through etcd.

Every agent asked to protect a group (`ferry protect`, `ferry run --protect`) may run its
rounds, but only one does: the one whose claim `groups/<g>/protector` holds. The claim is
created if absent (a transaction) on the claiming node's lease, so it goes when that node's
lease does (the node died, or was cut off and fenced its members), and the next agent that
protects the group takes it at its next interval. The others stand by; at every interval each
reads the group's last complete snapshot from etcd, so `ferry snapshot --last` answers on any
of them and a standby that takes over starts from it.

A round's epoch is never reused, not even across protectors: each round takes its epoch from
`groups/<g>/tried` before it begins (the next number, swapped in only if no one changed the key
since it was read), and a new protector numbers its rounds after the larger of that and the last
complete snapshot's. A moved member's image, adopted as its last dump, takes its number so too.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf import json_format

from agent.coord.liveness import Liveness, NodeLiveness
from agent.errors import FerryError
from agent.rpc import pb

#: How many times taking a new image number may lose its swap to another taker before it fails.
NUMBER_TRIES = 8


@dataclass(frozen=True)
class Claim:
    holder: str = ""  # who runs the group's rounds, if not this agent ("" : this agent does)
    last: pb.SnapshotSet | None = None  # the group's last complete snapshot, as etcd holds it
    tried: int = 0  # the last round's epoch any protector began


class ProtectorClaims:
    """The claims of this agent (on its node's lease) for the groups it protects."""

    def __init__(self, live: NodeLiveness) -> None:
        self.live = live

    def claim(self, group: str) -> Claim:
        """This agent's claim on `group`'s rounds, taken if no one holds it; raises FerryError
        when etcd cannot say (then no round runs here: fail closed)."""
        live, k = self.live, self.live.key
        lease = live.lease
        last, tried = self._progress(group)
        if live.state is not Liveness.LIVE or lease is None:
            return Claim(f"no agent here: node {live.node} has no live lease in etcd", last, tried)
        key = k("groups", group, "protector")
        mine = self._mine()
        if live.client.create_if_absent(key, mine, lease=lease.id):
            return Claim("", last, tried)
        kv = live.client.get(key)
        if kv is None:  # its holder's lease went just now: taken at the next interval
            return Claim("no agent yet (its last protector's claim just ended)", last, tried)
        if kv.value.decode() == mine and kv.lease == lease.id:
            return Claim("", last, tried)
        try:
            d = json.loads(kv.value)
            return Claim(f"agent {d['agent']} on node {d['node']}", last, tried)
        except (ValueError, KeyError):
            return Claim(f"the holder of {key} (unreadable: {kv.value[:80]!r})", last, tried)

    def holding(self) -> Callable[[], str]:
        """While a round runs: "" as long as this node keeps the lease it holds now (its claims
        live on it), else why the round must be given up. Asks nothing of etcd."""
        live, lease = self.live, self.live.lease

        def why() -> str:
            if live.state is not Liveness.LIVE or live.lease is None or lease is None:
                return f"node {live.node} lost its lease in etcd, and with it the claim on the rounds"
            if live.lease.id != lease.id:
                return f"node {live.node}'s lease in etcd changed, and the claim on the rounds went with it"
            return ""

        return why

    def publish(self, group: str, value: str) -> bool:
        """The group's last complete snapshot, written only while this agent's claim holds: a
        round that ended after another agent took the rounds over must not replace theirs."""
        live, lease = self.live, self.live.lease
        if lease is None:
            return False
        key = live.key("groups", group, "protector")
        mine = self._mine()
        return live.client.put_if_held(key, mine, lease.id, live.key("groups", group, "snapshot"), value)

    def ours(self, group: str) -> bool:
        """Whether this agent holds the group's claim on its current lease (etcd asked)."""
        live, lease = self.live, self.live.lease
        kv = live.client.get(live.key("groups", group, "protector"))
        mine = self._mine()
        return kv is not None and lease is not None and kv.value.decode() == mine and kv.lease == lease.id

    def release(self, group: str) -> None:
        """This agent stops protecting `group` (`ferry protect --off`): its claim, if it holds it,
        goes now, so that a standby takes the rounds over at its next interval."""
        live = self.live
        key = live.key("groups", group, "protector")
        kv = live.client.get(key)
        if kv is not None and kv.value.decode() == self._mine():
            live.client.delete_if(key, kv.mod_revision)

    def _mine(self) -> str:
        """The claim's value: this agent, on this node."""
        return json.dumps({"agent": self.live.agent, "node": self.live.node})

    def number(self, group: str, floor: int) -> int:
        """A new image number of `group`: above `floor` and every number taken before, taken in
        etcd (`tried`, swapped only if no one changed it since it was read). A round takes its
        number so before it begins, and so does a member's move that adopts its image as the
        member's last dump (agent.migration.chainmove): no two images are ever numbered alike."""
        live = self.live
        key = live.key("groups", group, "tried")
        for _ in range(NUMBER_TRIES):
            kv = live.client.get(key)
            tried = int(kv.value) if kv is not None and kv.value.isdigit() else 0
            epoch = max(tried, floor) + 1
            if live.client.compare_and_swap(key, str(epoch), kv.mod_revision if kv is not None else 0):
                return epoch
        raise FerryError(
            f"no new image number of group {group}: {NUMBER_TRIES} tries in etcd were each taken by another",
            step="snapshot",
            node=live.node,
        )

    def _progress(self, group: str) -> tuple[pb.SnapshotSet | None, int]:
        live, k = self.live, self.live.key
        last = None
        if (kv := live.client.get(k("groups", group, "snapshot"))) is not None:
            try:
                last = json_format.Parse(kv.value, pb.SnapshotSet())
            except json_format.ParseError as e:
                why = f"group {group}'s snapshot in etcd is unreadable: {e}"
                raise FerryError(why, step="snapshot") from e
        kv = live.client.get(k("groups", group, "tried"))
        tried = int(kv.value) if kv is not None and kv.value.isdigit() else 0
        return last, tried
