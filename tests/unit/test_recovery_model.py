"""An exhaustive model of a member's recovery: every interleaving of a node that is cut off, dies,
fences, heals, and two agents that recover it (each may crash anywhere and be taken over).

One member, first on node X; a spare S. The model's steps are the protocol's, as
docs/recovery.md states it and agent.coord.liveness and agent.snapshots.recover implement it:

- X cut off from etcd fences its copy before its lease can expire (the timings' order, which
  agent.coord.config enforces): the lease may expire only once X's copy is not running.
- A recoverer may claim the recovery only while X is lost (its lease expired, its agent silent)
  and no claim exists (etcd's create-if-absent); its claim lives on its own lease, so a crashed
  recoverer's claim goes when that lease does, and another takes over.
- It reads the member's key (node and revision), marks the recovery pending (a key with no
  lease), and swaps the key to S by compare-and-swap on that revision before it restores
  anything; then the rollback ends any copy on S, restores the spare's copy held, and it goes
  on (RESUME, or by itself after hold_s if the recoverer crashed); then the mark goes.
- A recovery that crashed half-way is taken over: a pending mark with no claim lets another
  recoverer claim it, whatever the key says; with the key X's and X live again there is
  nothing to do (the mark goes), else it goes on from the swap (done already if the key is S's).
- X when it heals: with its lease intact it unfences what it fenced under that lease; a copy
  fenced under a lease that expired is settled by its key, at the new lease and at every
  renewal until it is: still X's, X claims it back by compare-and-swap and only then runs it;
  another node's, the copy ends without running.

- X's copy may be frozen at any moment (a snapshot's hold, a move) and goes on later by itself:
  fencing passes a frozen copy by, so it goes on only if X held one lease, still valid, from its
  freeze on (registry.may_go_on); else it stays frozen as a fenced copy that its key settles.
  Past the fencing deadline the gate refuses too: while X is cut off with its lease valid,
  either may happen.

- A second member, on node Y (which stays up), is rolled back in place: END fences its copy,
  then ends it (two steps: a fenced copy first), and the restore brings a new copy, held. Y's
  liveness settles only the copies it fenced itself, never one a rollback fenced: its key names
  Y, so settling it would run it again beside the restored copy.

Checked: at no moment do two copies of a member run; every world where nothing more can happen has exactly
one running copy (none only while X is cut off or dead with no spare copy yet: never final).
Each broken rule must be caught (two copies found), or the model would prove nothing.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator

import pytest


@dataclasses.dataclass(frozen=True)
class W:
    x: str = "up"  # up | cut | dead
    x_copy: str = "running"  # running | frozen | fenced | dead
    lease: str = "valid"  # X's lease: valid | expired
    era: int = 0  # which of X's leases is current (a new one after each expiry)
    fenced_era: int = 0  # the lease under which X's copy was fenced (-1: settled by its key)
    frozen_era: int = 0  # the lease under which X's copy froze
    freezes: int = 1  # how often X's copy may be frozen
    key: tuple[str, int] = ("X", 1)  # the member's key: node, revision
    claim: int = 0  # the recoverer holding groups/<g>/recovery (0: none)
    pending: bool = False  # groups/<g>/pending: a recovery is under way, or died half-way
    spare: str = "none"  # none | held | running
    r: tuple[str, ...] = ("idle", "idle")  # each recoverer's pc
    seen: tuple[int, ...] = (0, 0)  # the key revision each read
    crashes: int = 1
    cuts: int = 2  # how often X may be cut off (each heal may bump the key's revision)
    y_old: str = "running"  # Y's member's copy: running | fenced (by a rollback's END) | dead
    y_new: str = "none"  # its copy a rollback restored: none | held | running | fenced


Rules = dict[str, bool]
SOUND: Rules = {
    "settle_by_cas": True,
    "swap_by_cas": True,
    "unfence_only_this_leases": True,
    "go_on_only_under_the_freezes_lease": True,
    "take_over_pending": True,
    "settle_only_own_fences": True,
}
#: The rules whose loss strands the member (no copy in a final world) rather than running two.
LIVENESS_RULES = {"take_over_pending"}


def steps(w: W, rules: Rules) -> Iterator[tuple[str, W]]:
    lost = w.lease == "expired" and w.x in ("cut", "dead")
    # -- node X ------------------------------------------------------------------------------
    if w.x == "up" and w.cuts > 0:
        yield "x cut off", dataclasses.replace(w, x="cut", cuts=w.cuts - 1)
    if w.x != "dead":
        yield "x dies", dataclasses.replace(w, x="dead", x_copy="dead")
    if w.x == "cut" and w.x_copy == "running":
        yield "x fences", dataclasses.replace(w, x_copy="fenced", fenced_era=w.era)
    if w.x != "dead" and w.x_copy == "running" and w.freezes > 0:
        frozen = dataclasses.replace(w, x_copy="frozen", frozen_era=w.era, freezes=w.freezes - 1)
        yield "x freezes its copy", frozen
    if w.x_copy == "frozen":
        same_lease = w.lease == "valid" and w.era == w.frozen_era
        if same_lease or not rules["go_on_only_under_the_freezes_lease"]:
            yield "x's frozen copy goes on", dataclasses.replace(w, x_copy="running")
        if not same_lease or w.x == "cut":  # refused (cut off: past its deadline, say)
            yield "x's frozen copy stays, fenced", dataclasses.replace(w, x_copy="fenced", fenced_era=-1)
    if w.lease != "expired" and w.x in ("cut", "dead") and w.x_copy != "running":
        yield "lease expires", dataclasses.replace(w, lease="expired")
    if w.x == "cut":
        if w.lease != "expired":
            # A renewal unfences what was fenced under this same lease: no one could act on it.
            ours = w.fenced_era == w.era or not rules["unfence_only_this_leases"]
            back = "running" if w.x_copy == "fenced" and ours else w.x_copy
            yield "x heals, lease intact", dataclasses.replace(w, x="up", x_copy=back)
        else:
            yield "x heals, new lease", dataclasses.replace(w, x="up", lease="valid", era=w.era + 1)
    if w.x == "up" and w.x_copy == "fenced" and w.fenced_era != w.era:  # settled at any renewal
        node, rev = w.key
        if node == "X":
            bumped = (node, rev + 1) if rules["settle_by_cas"] else w.key
            yield "x settles: key is X's", dataclasses.replace(w, x_copy="running", key=bumped)
        else:
            yield "x settles: key is S's", dataclasses.replace(w, x_copy="dead")
    # -- the recoverers ------------------------------------------------------------------------
    for i in (0, 1):
        pc, me = w.r[i], i + 1

        def at(new: str, i: int = i, **kw: object) -> W:
            r = list(w.r)
            r[i] = new
            return dataclasses.replace(w, r=tuple(r), **kw)

        taken_over = w.pending and rules["take_over_pending"]
        if pc == "idle" and w.claim == 0 and ((lost and w.key[0] == "X") or taken_over):
            yield f"r{me} claims", at("claimed", claim=me)
        elif pc == "claimed":
            node, rev = w.key
            live_x = w.lease != "expired"  # nodes/X has a lease again: X is not lost
            if node == "S" and w.pending:
                yield f"r{me} takes over a swapped key", at("swapped")
            elif node != "X" or live_x:
                yield f"r{me} finds nothing to do", at("idle", claim=0, pending=False)
            else:
                seen = list(w.seen)
                seen[i] = rev
                yield f"r{me} reads the key", at("read", seen=tuple(seen))
        elif pc == "read":
            yield f"r{me} marks it pending", at("marked", pending=True)
        elif pc == "marked":
            if not rules["swap_by_cas"] or w.key == ("X", w.seen[i]):
                yield f"r{me} swaps the key", at("swapped", key=("S", w.key[1] + 1))
            else:
                yield f"r{me} loses the swap", at("idle", claim=0)
        elif pc == "swapped":  # END fences the running copies on Y first (a restored one too)
            fenced = {"running": "fenced"}
            y_old, y_new = fenced.get(w.y_old, w.y_old), fenced.get(w.y_new, w.y_new)
            yield f"r{me} fences Y's copies", at("fencing", y_old=y_old, y_new=y_new)
        elif pc == "fencing":  # then ends what is fenced, and every held copy: S's included
            gone = {"fenced": "dead"}
            y_new = "none" if w.y_new in ("held", "fenced") else w.y_new
            yield (
                f"r{me} ends the copies",
                at("ended", spare="none", y_old=gone.get(w.y_old, w.y_old), y_new=y_new),
            )
        elif pc == "ended":
            yield f"r{me} restores", at("restored", spare="held", y_new="held")
        elif pc == "restored":
            yield f"r{me} resumes", at("done", spare="running")
        elif pc == "done":
            yield f"r{me} releases", at("idle", claim=0, pending=False)
        if pc not in ("idle", "crashed") and w.crashes > 0:
            yield f"r{me} crashes", dataclasses.replace(at("crashed"), crashes=w.crashes - 1)
        if pc == "crashed" and w.claim == me:
            yield f"r{me}'s lease expires", at("crashed", claim=0)
    if w.spare == "held" and all(pc != "restored" for pc in w.r):
        yield "the spare's hold runs out", dataclasses.replace(w, spare="running")
    if w.y_new == "held" and all(pc != "restored" for pc in w.r):
        yield "Y's hold runs out", dataclasses.replace(w, y_new="running")
    # -- node Y: its liveness settles a fenced copy by its key, which names Y ----------------------
    if not rules["settle_only_own_fences"]:
        if w.y_old == "fenced":
            yield "y settles its old copy", dataclasses.replace(w, y_old="running")
        if w.y_new == "fenced":
            yield "y settles its restored copy", dataclasses.replace(w, y_new="running")


def x_copies(w: W) -> int:
    return (w.x_copy == "running") + (w.spare == "running")


def y_copies(w: W) -> int:
    return (w.y_old == "running") + (w.y_new == "running")


def running(w: W) -> int:
    """The most copies of one member that run: X's member's, or Y's."""
    return max(x_copies(w), y_copies(w))


def explore(rules: Rules) -> tuple[list[str] | None, int, list[W]]:
    """Breadth-first over every reachable world; (a path to two running copies or None, worlds
    seen, the worlds where nothing more can happen)."""
    start = W()
    parent: dict[W, tuple[W, str] | None] = {start: None}
    todo = collections.deque([start])
    ends = []
    while todo:
        w = todo.popleft()
        if running(w) > 1:
            path = []
            cur: W | None = w
            while cur is not None and parent[cur] is not None:
                prev, step = parent[cur]  # type: ignore[misc]
                path.append(step)
                cur = prev
            return list(reversed(path)), len(parent), ends
        nexts = list(steps(w, rules))
        if not nexts:
            ends.append(w)
        for _, n in nexts:
            if n not in parent:
                parent[n] = (w, _)
                todo.append(n)
    return None, len(parent), ends


def test_no_interleaving_or_crash_runs_two_copies_and_every_end_runs_one() -> None:
    two, seen, ends = explore(SOUND)
    assert two is None, f"two copies run after: {two}"
    assert seen > 200, seen  # the model is not trivially small
    assert ends, "no world ends: the model never settles"
    for w in ends:  # a recoverer that crashed half-way is taken over: never stranded
        assert x_copies(w) == 1 and y_copies(w) == 1 and not w.pending, w


@pytest.mark.parametrize("broken", sorted(set(SOUND) - LIVENESS_RULES))
def test_the_model_finds_two_copies_when_a_rule_is_broken(broken: str) -> None:
    two, _, _ = explore({**SOUND, broken: False})
    assert two is not None, f"without {broken} the model should find two running copies"


def test_without_the_takeover_a_recovery_that_crashed_half_way_strands_the_member() -> None:
    two, _, ends = explore({**SOUND, "take_over_pending": False})
    assert two is None
    stranded = [w for w in ends if x_copies(w) == 0]
    assert stranded and all(w.key[0] == "S" and w.pending for w in stranded), stranded[:3]
