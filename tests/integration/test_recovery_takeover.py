"""A recovery that died half-way is taken over (agent.snapshots.recover, agent.coord.liveness),
against a real etcd over mutual TLS; the agents a recovery calls are doubles at the gRPC boundary
(the bed's tests, tests/integration/test_recovery.py, kill a recovering node for real).

The group: r0 on node A, r1 on B, r2 on C, every image kept on C; spares S and T. B died; A's
agent began the recovery (its pending mark written, r1's key swapped to S, every copy ended)
and then died too: its claim went with its lease. Nobody's key names a dead node but A's.
"""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from google.protobuf import json_format

from agent import certs, tls
from agent.coord.config import CoordConfig
from agent.coord.etcd import EtcdClient
from agent.coord.liveness import Member, NodeLiveness
from agent.errors import FerryError
from agent.jobs import fence, procs
from agent.jobs.record import JobKind, JobRecord, JobState
from agent.jobs.registry import JobRegistry
from agent.rpc import pb
from agent.snapshots.recover import GroupRecovery
from agent.testing.etcd import EtcdServer, have_etcd

pytestmark = pytest.mark.skipif(
    not have_etcd(), reason="no etcd binary: `make etcd` installs Debian's etcd-server"
)

PREFIX = "/ferry/"
SNAP = pb.SnapshotSet(
    epoch=7,
    members=[
        pb.MemberCopy(job=f"r{i}", agent=a, node=a.lower(), buddy_agent="C", buddy_node="c")
        for i, a in enumerate("ABC")
    ],
)


@pytest.fixture(scope="session", autouse=True)
def _criu_present() -> None:
    """Overrides the integration suite's CRIU check: these tests need etcd, not CRIU."""


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    d = tmp_path / "pki"
    certs.create_ca(d)
    certs.issue(d, "node-c", certs.Role.NODE, ["127.0.0.1"])
    return d


@pytest.fixture
def etcd(pki: Path, tmp_path: Path) -> Iterator[EtcdServer]:
    with EtcdServer(pki, data_dir=tmp_path / "etcd") as s:
        yield s


class Agents:
    """The agents a recovery calls, as their RPCs answer: LIST says which members run (and
    which a rollback to `epoch` ended) there; END ends them; RESTORE starts one."""

    def __init__(self, running: dict[str, list[str]], ended: dict[str, list[str]]) -> None:
        self.running, self.ended = running, ended
        self.log: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()

    def __call__(
        self, agent: str, req: pb.SnapshotMemberRequest, timeout_s: float
    ) -> pb.SnapshotMemberResponse:
        action = pb.SnapshotAction.Name(req.action).removeprefix("SNAPSHOT_ACTION_").lower()
        out = pb.SnapshotMemberResponse(node_name=agent.lower())
        with self._lock:
            self.log.append((agent, action, req.job))
            if agent in ("A", "B"):
                raise FerryError("it does not answer", step=f"rollback {action}", node=agent)
            here = self.running.setdefault(agent, [])
            if action == "list":
                out.members.extend(pb.HeldMember(job=j) for j in here)
                out.ended.extend(self.ended.get(agent, []) if req.epoch else [])
            elif action == "end":
                self.ended.setdefault(agent, []).extend(here)
                here.clear()
            elif action == "restore":
                here.append(req.job)
        return out

    def did(self, action: str) -> list[tuple[str, str]]:
        return sorted((a, j) for a, x, j in self.log if x == action)


def half_way(client: EtcdClient) -> None:
    """What A's recovery left: the snapshot, live leases for C, S and T, the keys (r0's naming A,
    dead; r1's swapped to S), the pending mark, S claimed for r1; no recovery claim."""
    client.put(PREFIX + "groups/g/snapshot", json_format.MessageToJson(SNAP))
    lease = client.grant(30)
    for node in ("c", "s", "t"):
        client.put(PREFIX + f"nodes/{node}", "{}", lease=lease.id)
    for job, node, agent in (("r0", "a", "A"), ("r1", "s", "S"), ("r2", "c", "C")):
        client.put(PREFIX + f"groups/g/members/{job}", Member("g", job, node, agent, "", "").value())
    mark = {"epoch": 7, "by": "a", "place": {"r1": ["S", "s"]}}
    client.put(PREFIX + "groups/g/pending", json.dumps(mark))
    client.put(PREFIX + "spares/S", json.dumps({"group": "g", "job": "r1", "by": "a"}))


def liveness(etcd: EtcdServer, pki: Path, tmp_path: Path) -> tuple[NodeLiveness, JobRegistry]:
    """Node C's liveness, its threads not started: the test drives its checks."""
    config = CoordConfig(endpoints=(etcd.endpoint,), prefix=PREFIX, lease_ttl_s=30, fence_margin_s=1.5)
    registry = JobRegistry(tmp_path / "state", "c")
    live = NodeLiveness(config, "c", registry, tls.load(pki, "node-c"), lambda k, m, j: None)
    live.agent = "C"
    live.lease = live.client.grant(30)
    return live, registry


def test_a_recovery_that_died_after_ending_every_copy_is_taken_over_from_its_pending_mark(
    etcd: EtcdServer, pki: Path, tmp_path: Path
) -> None:
    live, registry = liveness(etcd, pki, tmp_path)
    half_way(live.client)
    # C's copy of r2 was ended by A's rollback to round 7: C has its record, stopped.
    rec = JobRecord("r2", JobKind.LAUNCHED, JobState.STOPPED, 1, ["x"], "/", group="g", rolled_back_to=7)
    registry.save(rec)
    agents = Agents(running={}, ended={"C": ["r2"]})
    said: list[str] = []
    rec_ = GroupRecovery(
        live, lambda: ["S", "T"], lambda a: a.lower(), agents, 5, lambda k, m: said.append(m)
    )
    asked: list[str] = []
    live.on_lost = lambda g, since: asked.append(g)
    live.check_peers()
    assert asked == ["g"]  # the mark without a claim: C's agent takes the recovery over

    done = rec_.recover("g")
    assert done is not None and done.placed == {"r0": "t", "r1": "s"}  # r1 on the spare A chose
    assert agents.did("fetch") == [("C", "r2"), ("S", "r1"), ("T", "r0")]
    assert agents.did("restore") == [("C", "r2"), ("S", "r1"), ("T", "r0")]
    assert not {a for a, _, _ in agents.log} & {"A", "B"}  # dead nodes are not asked
    assert live.client.get(PREFIX + "groups/g/pending") is None
    assert live.client.get(PREFIX + "groups/g/recovery") is None
    key = live.client.get(PREFIX + "groups/g/members/r0")
    assert key is not None and Member.parse("g", "r0", key.value).node == "t"
    assert json.loads(live.client.get(PREFIX + "spares/T").value)["job"] == "r0"  # type: ignore[union-attr]
    assert "recovering from snapshot round 7: r1 onto node s, r0 onto node t" in said[0], said
    asked.clear()
    live.check_peers()
    assert asked == []  # nothing half-way any more


def test_without_the_ended_records_the_takeover_refuses_before_anything_ends(
    etcd: EtcdServer, pki: Path, tmp_path: Path
) -> None:
    """r2 runs on no agent and none says a rollback ended it: it may run where no END reaches."""
    live, _ = liveness(etcd, pki, tmp_path)
    half_way(live.client)
    agents = Agents(running={}, ended={})
    rec = GroupRecovery(live, lambda: ["S", "T"], lambda a: a.lower(), agents, 5, lambda k, m: None)
    with pytest.raises(FerryError, match=r"member\(s\) r2 of group g run on none of"):
        rec.recover("g")
    assert agents.did("end") == [] and agents.did("restore") == []
    assert live.client.get(PREFIX + "groups/g/pending") is not None  # tried again at the next check


def test_a_pending_mark_left_by_a_recovery_that_finished_goes_without_a_rollback(
    etcd: EtcdServer, pki: Path, tmp_path: Path
) -> None:
    live, _ = liveness(etcd, pki, tmp_path)
    half_way(live.client)
    live.client.put(PREFIX + "groups/g/members/r0", Member("g", "r0", "t", "T", "", "").value())
    agents = Agents(running={"C": ["r2"], "S": ["r1"], "T": ["r0"]}, ended={})
    rec = GroupRecovery(live, lambda: ["S", "T"], lambda a: a.lower(), agents, 5, lambda k, m: None)
    assert rec.recover("g") is None
    assert {x for _, x, _ in agents.log} == {"list"}
    assert live.client.get(PREFIX + "groups/g/pending") is None


def test_an_unreadable_pending_mark_stops_the_recovery_and_says_what_to_do(
    etcd: EtcdServer, pki: Path, tmp_path: Path
) -> None:
    live, _ = liveness(etcd, pki, tmp_path)
    half_way(live.client)
    live.client.put(PREFIX + "groups/g/pending", "{not json")
    agents = Agents(running={}, ended={"C": ["r2"]})
    rec = GroupRecovery(live, lambda: ["S", "T"], lambda a: a.lower(), agents, 5, lambda k, m: None)
    with pytest.raises(FerryError, match="is unreadable") as e:
        rec.recover("g")
    assert "ferry rollback" in (e.value.hint or "")
    assert agents.log == []


def test_a_snapshot_stops_covering_its_group_when_a_member_moves_or_a_copys_node_loses_its_lease(
    etcd: EtcdServer, pki: Path, tmp_path: Path
) -> None:
    live, _ = liveness(etcd, pki, tmp_path)
    ring = {"a": "b", "b": "c", "c": "a"}
    snap = pb.SnapshotSet(
        epoch=3,
        members=[
            pb.MemberCopy(
                job=f"r{i}", node=n, agent=n.upper(), buddy_node=ring[n], buddy_agent=ring[n].upper()
            )
            for i, n in enumerate("abc")
        ],
    )
    lease = live.client.grant(30)
    for node in "abc":
        live.client.put(PREFIX + f"nodes/{node}", "{}", lease=lease.id)

    def member_on(job: str, node: str) -> None:
        live.client.put(
            PREFIX + f"groups/g/members/{job}", Member("g", job, node, node.upper(), "", "").value()
        )

    for i, node in enumerate("abc"):
        member_on(f"r{i}", node)
    assert live.snapshot_stale("g", snap) == ""
    member_on("r1", "s")  # a move took r1 to spare s
    assert live.snapshot_stale("g", snap) == "member r1 runs on node s, not on node b where it was taken"
    member_on("r1", "b")
    live.client.delete(PREFIX + "nodes/a")  # node a, which keeps r2's copy, died
    assert live.snapshot_stale("g", snap) == "node a, which keeps member r2's copy, has no lease in etcd"


def round_five(
    live: NodeLiveness, copies: list[tuple[str, str]], alive: list[str], keys: list[str]
) -> tuple[Agents, dict[str, tuple[str, str]], GroupRecovery]:
    """Round 5 in etcd: member r<i> ran on copies[i][0], its image kept on copies[i][1] (and on
    its own node); the nodes `alive` hold a lease; r<i>'s key names node keys[i]. The agents (no
    member running yet), what each FETCH asked for (job → agent, local copy), and a recovery."""
    snap = pb.SnapshotSet(
        epoch=5,
        taken_at=1.0,
        members=[
            pb.MemberCopy(
                job=f"r{i}",
                node=n,
                agent=n.upper(),
                buddy_node=k,
                buddy_agent=k.upper(),
                dir=f"/keep/g/5/r{i}",
                local_dir=f"/taken/g/5/r{i}",
            )
            for i, (n, k) in enumerate(copies)
        ],
    )
    live.client.put(PREFIX + "groups/g/snapshot", json_format.MessageToJson(snap))
    lease = live.client.grant(30)
    for node in alive:
        live.client.put(PREFIX + f"nodes/{node}", "{}", lease=lease.id)
    for i, node in enumerate(keys):
        live.client.put(
            PREFIX + f"groups/g/members/r{i}", Member("g", f"r{i}", node, node.upper(), "", "").value()
        )
    agents = Agents(running={}, ended={})
    fetched: dict[str, tuple[str, str]] = {}

    def call(agent: str, req: pb.SnapshotMemberRequest, timeout_s: float) -> pb.SnapshotMemberResponse:
        if req.action == pb.SNAPSHOT_ACTION_FETCH:
            fetched[req.job] = (agent, req.local_dir)
        return agents(agent, req, timeout_s)

    return (
        agents,
        fetched,
        GroupRecovery(live, lambda: ["S", "T"], lambda a: a.lower(), call, 5, lambda k, m: None),
    )


def test_a_lost_member_goes_to_the_spare_that_keeps_its_copy_and_reads_it_there(
    etcd: EtcdServer, pki: Path, tmp_path: Path
) -> None:
    live, _ = liveness(etcd, pki, tmp_path)
    # node a died; r1's copy is kept on s, r0's on t
    agents, fetched, rec = round_five(live, [("a", "t"), ("c", "s")], ["c", "s", "t"], ["a", "c"])
    agents.running = {"C": ["r1"]}
    done = rec.recover("g")
    assert done is not None and done.placed == {"r0": "t"}, "T keeps r0's copy: S comes first otherwise"
    assert fetched == {"r0": ("T", "/keep/g/5/r0"), "r1": ("C", "/taken/g/5/r1")}


def test_the_spares_that_keep_a_rounds_images_are_those_with_a_lease_that_run_no_member(
    etcd: EtcdServer, pki: Path, tmp_path: Path
) -> None:
    live, _ = liveness(etcd, pki, tmp_path)
    lease = live.client.grant(30)
    for node in ("c", "s", "u"):  # spare t has no lease: dead, or not started
        live.client.put(
            PREFIX + f"nodes/{node}", json.dumps({"agent": node.upper(), "node": node}), lease=lease.id
        )
    live.client.put(PREFIX + "nodes/x", "not json", lease=lease.id)  # unreadable: never a keeper
    assert live.keepers(["U", "T", "S", "C", "U"], agents=["C"]) == ["U", "S"]
    live.client.put(PREFIX + "spares/U", json.dumps({"group": "g", "job": "r1", "by": "c"}))
    assert live.keepers(["U", "T", "S", "C"], agents=["C"]) == ["S"], "a recovery took U for a member"
    # No spare free: this agent's own node (C, whose own configuration never lists it), if it
    # runs no member; else none, and the members' ring keeps the images.
    assert live.keepers(["U", "T"], agents=["S"]) == ["C"]
    assert live.keepers(["U", "T"], agents=["C"]) == []
    assert live.keepers(["S"], agents=["X"]) == ["S"], "a free spare comes before this node"


def test_a_member_killed_here_by_a_failed_post_copy_is_handed_back_to_its_dead_source_and_found_lost(
    etcd: EtcdServer, pki: Path, tmp_path: Path
) -> None:
    """node-f, warned, moved r2 here (c) post-copy and died before every page came: the copy here
    was killed. Its key must not go on naming c, where nothing runs (the group would wait on it
    and nobody would recover it)."""
    live, registry = liveness(etcd, pki, tmp_path)
    said: list[str] = []
    live.record = lambda kind, message, job: said.append(message)
    lease = live.client.grant(30)
    live.client.put(PREFIX + "nodes/c", json.dumps({"agent": "C", "node": "c"}), lease=lease.id)
    for job, node in (("r1", "c"), ("r2", "c")):
        live.client.put(
            PREFIX + f"groups/g/members/{job}", Member("g", job, node, node.upper(), "", "").value()
        )
    rec = JobRecord("r2", JobKind.LAUNCHED, JobState.LOST, 1, ["x"], "/", group="g", address="10.99.0.3")
    registry.save(rec)
    registry.save(JobRecord("r1", JobKind.LAUNCHED, JobState.RUNNING, 2, ["x"], "/", group="g"))
    registry.on_post_copy_lost(rec, "f")  # as agent.migration.target_effects calls it
    kv = live.client.get(PREFIX + "groups/g/members/r2")
    assert kv is not None and Member.parse("g", "r2", kv.value) == Member("g", "r2", "f", "", "10.99.0.3", "")
    assert "its key names node f again" in said[0]
    asked: list[str] = []
    live.on_lost = lambda g, since: asked.append(g)
    live.check_peers()
    assert "r2" in live.lost and asked == ["g"], "node f has no lease and no agent answers: lost"

    # A source that lives keeps its agent in the key; a key another node took stays as it is.
    live.client.put(PREFIX + "nodes/f", json.dumps({"agent": "F", "node": "f"}), lease=lease.id)
    live.client.put(PREFIX + "groups/g/members/r2", Member("g", "r2", "c", "C", "", "").value())
    registry.on_post_copy_lost(rec, "f")
    assert Member.parse("g", "r2", live.client.get(PREFIX + "groups/g/members/r2").value).agent == "F"  # type: ignore[union-attr]
    live.client.put(PREFIX + "groups/g/members/r2", Member("g", "r2", "t", "T", "", "").value())
    registry.on_post_copy_lost(rec, "f")
    assert Member.parse("g", "r2", live.client.get(PREFIX + "groups/g/members/r2").value).node == "t"  # type: ignore[union-attr]
    # The copy crashed first and its end, taken for an exit, removed the key: it comes back.
    live.client.delete(PREFIX + "groups/g/members/r2")
    registry.on_post_copy_lost(rec, "f")
    assert Member.parse("g", "r2", live.client.get(PREFIX + "groups/g/members/r2").value).node == "f"  # type: ignore[union-attr]


def test_a_second_failure_rolls_the_member_an_earlier_recovery_moved_back_where_it_runs_now(
    etcd: EtcdServer, pki: Path, tmp_path: Path
) -> None:
    """Seen on the fault bench: node b died and its member r1 was recovered onto spare s (which
    keeps its copy); no round completed after that, so when node a dies the last snapshot still
    names b for r1. The recovery rolls r1 back on s, where it runs, and never asks b (dead): it
    used to ask b which members it ran, and failed on every try."""
    live, _ = liveness(etcd, pki, tmp_path)
    # nodes a and b died; r1 was recovered onto s before, which keeps its copy
    copies = [("a", "t"), ("b", "s"), ("c", "s")]
    agents, fetched, rec = round_five(live, copies, ["c", "s", "t"], ["a", "s", "c"])
    agents.running = {"C": ["r2"], "S": ["r1"]}
    done = rec.recover("g")
    assert done is not None and done.placed == {"r0": "t"}
    assert fetched == {"r0": ("T", "/keep/g/5/r0"), "r1": ("S", "/keep/g/5/r1"), "r2": ("C", "/taken/g/5/r2")}
    assert agents.did("restore") == [("C", "r2"), ("S", "r1"), ("T", "r0")]
    assert not [a for a, _, _ in agents.log if a in ("A", "B")]  # the dead are never asked
    assert agents.running == {"C": ["r2"], "S": ["r1"], "T": ["r0"]}


def test_a_member_a_rollback_fenced_is_left_to_the_rollback_not_settled_by_its_key(
    etcd: EtcdServer, pki: Path, tmp_path: Path
) -> None:
    """A rollback's END fences a member here, then ends it. Its key names this node: had the
    node's liveness settled it meanwhile (as it settles a member it fenced under a lost lease),
    the member would have run again beside the copy the rollback restores."""
    live, registry = liveness(etcd, pki, tmp_path)
    jobs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        for name, p in zip(("r1", "r2"), jobs, strict=True):
            rec = JobRecord(name, JobKind.LAUNCHED, JobState.RUNNING, p.pid, ["sleep"], "/", group="g")
            rec.pid_started = procs.create_time(p.pid)
            registry.save(rec)
            live.client.put(PREFIX + f"groups/g/members/{name}", Member("g", name, "c", "C", "", "").value())
        fence.fence(registry, "r1", "this node's lease in etcd is gone")  # as the liveness fences
        fence.fence(registry, "r2", "rolled back to snapshot round 7 of group g", rolled_back_to=7)
        live._settle_fenced()  # as a renewal does while a member it did not fence is fenced
        assert registry.get("r1").state is JobState.RUNNING  # its key names this node: it runs again
        assert registry.get("r2").state is JobState.FENCED  # the rollback's: it ends it next
        assert not live._unsettled()
        assert registry.end_fenced("r2", "rolled back", rolled_back_to=7) is not None
        assert jobs[1].wait(5) == -9
    finally:
        for p in jobs:
            p.kill()
            p.wait()


def test_a_member_a_rollback_ended_keeps_its_key_and_one_that_stopped_loses_it(
    etcd: EtcdServer, pki: Path, tmp_path: Path
) -> None:
    """Between a rollback's END and its restore the member has no running copy here; without its
    key a round begun then left its node out and failed after freezing the others (the fault
    bench saw it right after a recovery)."""
    live, registry = liveness(etcd, pki, tmp_path)
    for name, rolled_back_to in (("r1", 7), ("r2", 0)):
        rec = JobRecord(name, JobKind.LAUNCHED, JobState.STOPPED, 1, ["x"], "/", group="g")
        rec.rolled_back_to = rolled_back_to
        registry.save(rec)
        live.client.put(PREFIX + f"groups/g/members/{name}", Member("g", name, "c", "C", "", "").value())
    live._publish()
    assert live.client.get(PREFIX + "groups/g/members/r1") is not None  # the rollback's to restore
    assert live.client.get(PREFIX + "groups/g/members/r2") is None  # stopped by hand: gone


def test_the_agents_without_a_lease_are_those_no_node_key_names(
    etcd: EtcdServer, pki: Path, tmp_path: Path
) -> None:
    live, _ = liveness(etcd, pki, tmp_path)
    lease = live.client.grant(30)
    live.client.put(PREFIX + "nodes/s", json.dumps({"agent": "S", "node": "s"}), lease=lease.id)
    live.client.put(PREFIX + "nodes/t", "{not json", lease=lease.id)  # unreadable: no agent named
    assert live.agents_without_lease(["C", "S", "T", "A"]) == {"T", "A"}  # C is this node's
    live.client.revoke(lease.id)
    assert live.agents_without_lease(["C", "S"]) == {"S"}
