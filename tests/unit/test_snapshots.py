"""Group snapshots without agents: the buddy's store, a member's hold/release/ship, a round's
order and failures, and a protection's record (agent.snapshots). The bed's test
(tests/integration/test_snapshots.py) runs them with real agents, CRIU and a gloo job."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.cli.parser import Usage, build_parser, duration
from agent.errors import FerryError, JobBusyError, NotFoundError, RefusedError, TransferError
from agent.image import JobSpec, Manifest, build_manifest, read_manifest, verify
from agent.jobs import procs
from agent.jobs.record import JobKind, JobRecord, JobState
from agent.jobs.registry import JobRegistry
from agent.migration.model import MigrationResult
from agent.rpc import pb
from agent.snapshots import member, protect, rounds
from agent.snapshots.config import SnapshotConfig
from agent.snapshots.member import HeldState, MemberSnapshots
from agent.snapshots.protect import Protections, StandingBy
from agent.snapshots.protector import Claim
from agent.snapshots.restores import MemberRestores, RestoreState, image_chunks
from agent.snapshots.rollback import roll_back
from agent.snapshots.store import SnapshotStore


def image(d: Path, job: str = "r0", parent: Path | None = None, increment: int = 1024) -> Manifest:
    """An image as a snapshot's dump writes it; over `parent`, an increment of `increment` bytes of
    pages (CRIU links it)."""
    d.mkdir(parents=True)
    (d / "pages-1.img").write_bytes(b"p" * (increment if parent else 8192))
    (d / "core-1.img").write_bytes(b"c" * 10)
    if parent is not None:
        os.symlink(os.path.relpath(parent, d), d / "parent")
    spec = JobSpec(job, "launched", ["python", "train.py"], "/", [], "/o", "/e", 1)
    over = read_manifest(parent).image_id if parent else ""
    return build_manifest(d, spec, "node-a", image_id=f"snapshot-{os.urandom(6).hex()}", parent=over)


#: No process's nor thread's id (above the kernel's PID_MAX_LIMIT): what a member record's
#: memory reads (procs.tree_private) is then nothing, wherever the suite runs.
NO_PID = (1 << 22) + 1


def member_rec(name: str, rank: str) -> JobRecord:
    return JobRecord(
        name, JobKind.LAUNCHED, JobState.RUNNING, NO_PID, ["x"], "/", env=[f"RANK={rank}"], group="g"
    )


class FakeSave:
    """`ferry checkpoint --leave-running` with a hold, as agent.migration.local.checkpoint does it:
    the image written, the hold called while frozen, the job resumed after it returns."""

    def __init__(self, fail: set[str] | None = None) -> None:
        self.fail = fail or set()
        self.resumed: list[str] = []
        self.dumps: list[tuple[str, bool, Path | None]] = []  # job, track_mem, parent
        self.warms: list[bool] = []  # whether each dump was to warm its memory itself
        self.increment = 1024  # the pages an increment carries (a whole image's: 8192)

    def __call__(
        self,
        job: str,
        out: Path,
        hold: Callable[[Manifest], None],
        went_on: Callable[[float], None],
        track_mem: bool = False,
        parent: Path | None = None,
        warm: bool = True,
    ) -> MigrationResult:
        self.dumps.append((job, track_mem, parent))
        self.warms.append(warm)
        if job in self.fail:
            raise FerryError("injected fault at 'checkpoint'", step="checkpoint", node="node-a")
        t0 = time.monotonic()
        hold(image(out, job, parent, self.increment))
        self.resumed.append(job)
        went_on(time.monotonic() - t0)
        return MigrationResult("", job, "node-a", frozen_s=time.monotonic() - t0)


def members_here(store: SnapshotStore, save: FakeSave, root: Path, names=("r0",)) -> MemberSnapshots:
    def push(buddy: str, chunks: Iterator[pb.ImageChunk]) -> pb.StoredSnapshot:
        assert buddy == "10.0.0.2:7070"
        return store.receive(chunks)

    recs = [member_rec(n, str(i)) for i, n in enumerate(names)]
    return MemberSnapshots("node-a", root, lambda g: recs if g == "g" else [], save, push)


# -- the buddy's store ----------------------------------------------------------------


def test_the_store_keeps_a_verified_image_and_drops_every_other_round(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "store", "node-b")
    save = FakeSave()
    m = members_here(store, save, tmp_path / "taken")
    for epoch in (1, 2):
        m.hold("g", epoch, 5)
        m.release("g", epoch)
        (h,) = m.ship("g", epoch, "10.0.0.2:7070")
        assert h.state is HeldState.SHIPPED and h.buddy_node == "node-b"
        assert verify(Path(h.dir)).job.name == "r0"
        assert verify(h.out_dir).job.name == "r0", "the member's own copy stays: its rollback reads it"
    assert store.held("g") == {1: ["r0"], 2: ["r0"]}
    assert store.keep_only("g", 2) == [1]
    assert store.held("g") == {2: ["r0"]}
    assert store.keep_only("g", 0) == [2] and store.held("g") == {}


def test_a_corrupted_stream_leaves_nothing_in_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = SnapshotStore(tmp_path / "store", "node-b")
    m = members_here(store, FakeSave(), tmp_path / "taken")
    m.hold("g", 1, 5)
    m.release("g", 1)
    monkeypatch.setenv("FERRY_FAULTS", "corrupt-chunk")
    with pytest.raises(TransferError, match="corrupted in transit"):
        m.ship("g", 1, "10.0.0.2:7070")
    assert store.held("g") == {1: []}, "no image, not even a partial one, counts"
    assert not any(p.name.endswith(".part") for p in (tmp_path / "store" / "g" / "1").iterdir())


def test_a_stream_without_its_snapshot_key_is_refused(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "store", "node-b")
    with pytest.raises(FerryError, match="must start with its snapshot key"):
        store.receive(iter([pb.ImageChunk(file="x", data=b"1")]))


# -- a member's part ------------------------------------------------------------------


def test_a_held_member_stays_frozen_until_the_release(tmp_path: Path) -> None:
    save = FakeSave()
    m = members_here(SnapshotStore(tmp_path / "s", "b"), save, tmp_path / "taken", names=("r0", "r1"))
    helds = m.hold("g", 1, 5)
    assert [h.state for h in helds] == [HeldState.HELD, HeldState.HELD]
    time.sleep(0.2)
    assert save.resumed == [], "nothing goes on before the release"
    m.release("g", 1)
    assert sorted(save.resumed) == ["r0", "r1"]
    assert all(h.frozen_s >= 0.2 for h in helds)
    assert read_manifest(helds[0].out_dir).job.name == "r0"


def test_a_member_no_release_reaches_goes_on_by_itself_and_never_ships(tmp_path: Path) -> None:
    save = FakeSave()
    m = members_here(SnapshotStore(tmp_path / "s", "b"), save, tmp_path / "taken")
    (h,) = m.hold("g", 1, 0.3)
    h.done.wait(5)
    assert save.resumed == ["r0"] and h.state is HeldState.EXPIRED
    with pytest.raises(RefusedError, match=r"not a consistent cut.*went on by itself"):
        m.release("g", 1)
    with pytest.raises(RefusedError, match="expired, not released"):
        m.ship("g", 1, "10.0.0.2:7070")


def test_a_member_a_dropped_round_holds_goes_on_at_once_and_never_ships(tmp_path: Path) -> None:
    """A round given up keeps the last complete one: its DROP reaches a member the round holds.
    Forgotten but still held, it stayed frozen until hold_s, and a recovery's LIST, which
    abandons the rounds it finds, found none and was refused ("being moved or saved")."""
    save = FakeSave()
    m = members_here(SnapshotStore(tmp_path / "s", "b"), save, tmp_path / "taken")
    m.hold("g", 1, 30)
    m.release("g", 1)
    (h,) = m.hold("g", 2, 30)
    m.drop("g", 1)
    assert h.done.wait(5) and save.resumed == ["r0", "r0"]
    assert h.state is HeldState.EXPIRED and wait_for(lambda: not h.out_dir.exists())
    assert m.abandon("g") == []
    with pytest.raises(NotFoundError, match="no round 2 of group g"):
        m.ship("g", 2, "10.0.0.2:7070")


def test_a_member_that_cannot_be_saved_fails_the_hold_and_the_others_go_on(tmp_path: Path) -> None:
    save = FakeSave(fail={"r1"})
    m = members_here(SnapshotStore(tmp_path / "s", "b"), save, tmp_path / "taken", names=("r0", "r1"))
    with pytest.raises(FerryError, match="job r1 could not be saved: injected fault"):
        m.hold("g", 1, 5)
    assert save.resumed == ["r0"]
    m.drop("g", 0)
    assert not (tmp_path / "taken" / "g" / "1").exists()
    save.fail.clear()
    m.hold("g", 2, 5)  # a new round may hold again
    m.release("g", 2)


def test_a_second_hold_of_a_group_is_refused_while_one_holds(tmp_path: Path) -> None:
    m = members_here(SnapshotStore(tmp_path / "s", "b"), FakeSave(), tmp_path / "taken")
    m.hold("g", 1, 5)
    with pytest.raises(RefusedError, match="round 1 of group g still holds members here"):
        m.hold("g", 2, 5)
    m.release("g", 1)
    with pytest.raises(NotFoundError, match="no member of group other runs on this node"):
        m.hold("other", 1, 5)


# -- a round --------------------------------------------------------------------------


class Cluster:
    """Three agents with one member each, answering SnapshotMember as agent.service.node does."""

    def __init__(self, tmp_path: Path, fail: dict[str, str] | None = None) -> None:
        self.fail = fail or {}  # agent -> the action it fails
        self.log: list[tuple[str, str]] = []
        self.stores = {
            f"10.0.0.{i}:7070": SnapshotStore(tmp_path / f"store{i}", f"node-{i}") for i in (1, 2, 3)
        }
        self.members: dict[str, MemberSnapshots] = {}
        self.saves: dict[str, FakeSave] = {}
        self._lock = threading.Lock()
        for i, agent in enumerate(self.stores, 1):
            rec = member_rec(f"r{i - 1}", str(i - 1))
            self.saves[agent] = FakeSave()
            self.members[agent] = MemberSnapshots(
                f"node-{i}",
                tmp_path / f"taken{i}",
                lambda g, rec=rec: [rec],
                self.saves[agent],
                lambda buddy, chunks: self.stores[buddy].receive(chunks),
            )

    def call(self, agent: str, req: pb.SnapshotMemberRequest, timeout_s: float) -> pb.SnapshotMemberResponse:
        action = pb.SnapshotAction.Name(req.action).removeprefix("SNAPSHOT_ACTION_").lower()
        with self._lock:
            self.log.append((agent, action))
        if self.fail.get(agent) == action:
            raise FerryError("it broke", step=f"snapshot {action}", node=agent)
        m = self.members[agent]
        if action == "warm":
            m.warm(req.group)
            helds = []
        elif action == "hold":
            helds = m.hold(req.group, req.epoch, req.hold_s)
        elif action == "release":
            helds = m.release(req.group, req.epoch)
        elif action == "ship":
            helds = m.ship(req.group, req.epoch, req.buddy)
        else:
            m.drop(req.group, req.epoch)
            self.stores[agent].keep_only(req.group, req.epoch)
            helds = []
        return pb.SnapshotMemberResponse(node_name=m.node, members=[h.pb() for h in helds])


def test_a_round_releases_no_member_before_every_member_is_held(tmp_path: Path) -> None:
    cl = Cluster(tmp_path)
    agents = list(cl.stores)
    snap, times = rounds.take("g", 1, agents, cl.call, 5)
    steps = [action for _, action in cl.log]
    assert steps[:3] == ["warm"] * 3 and steps[3:6] == ["hold"] * 3
    assert steps[6:9] == ["release"] * 3 and steps[9:] == ["ship"] * 3
    # A member's first dump warms itself too: its size is known only once it was dumped.
    assert all(s.warms == [True] for s in cl.saves.values())
    ring = {m.node: m.buddy_node for m in snap.members}
    assert ring == {"node-1": "node-2", "node-2": "node-3", "node-3": "node-1"}
    assert snap.epoch == 1 and snap.group_pause_s >= times.hold_s > 0
    assert all(verify(Path(m.dir)).job.name == m.job for m in snap.members)


def test_a_warm_touches_what_the_next_dump_writes_and_only_the_hold_just_after_it_skips_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    warmed: list[int] = []
    save = FakeSave()
    rec = member_rec("r0", "0")
    m = MemberSnapshots(
        "node-a",
        tmp_path / "taken",
        lambda g: [rec] if g == "g" else [],
        save,
        lambda buddy, chunks: pb.StoredSnapshot(),
        tracks=lambda: True,
        full_every=2,
        warm=lambda where, size: warmed.append(size) or 0.01,
    )
    monkeypatch.setattr(member.procs, "tree_rss", lambda pid: 4096 if pid == rec.pid else 0)
    private = {rec.pid: 1 << 20}
    monkeypatch.setattr(member.procs, "tree_private", lambda pid: private.get(pid, 0))
    m.warm("g")  # no dump yet: as much as the job holds, and the dump warms again (GPU memory)
    (h1,) = m.hold("g", 1, 5)
    m.release("g", 1)
    private[rec.pid] = 3 << 20  # the job allocates its state after its first dump
    # Its chain goes on: as much as its last dump wrote and its memory grew by since, standing
    # for the dump's warm-up.
    m.warm("g")
    (h2,) = m.hold("g", 2, 5)
    m.release("g", 2)
    assert save.dumps[-1][2] is not None and h2.bytes < h1.bytes, "an increment"
    # Its chain ends there (full_every): the next dump is whole, as large as its own memory,
    # not as its last increment.
    m.warm("g")
    m.hold("g", 3, 5)
    m.release("g", 3)
    assert save.dumps[-1][2] is None, "whole"
    m.hold("g", 4, 5)  # no WARM before it: the dump warms by itself
    m.release("g", 4)
    assert warmed == [4096, h1.bytes + (2 << 20), 3 << 20] and h1.bytes > 4096
    assert save.warms == [True, False, False, True]
    monkeypatch.setattr(member, "WARM_FRESH_S", 0.0)
    m.warm("g")
    time.sleep(0.01)
    m.hold("g", 5, 5)  # a WARM too long ago stands for nothing: the memory went cold since
    m.release("g", 5)
    assert save.warms[-1] is True
    with pytest.raises(NotFoundError, match="no member of group other"):
        m.warm("other")


def test_with_spares_to_keep_them_the_images_go_to_the_spares_in_turn_not_round_the_ring(
    tmp_path: Path,
) -> None:
    cl = Cluster(tmp_path)
    agents = list(cl.stores)
    for i in (8, 9):  # two spares: agents that run no member
        cl.stores[f"10.0.0.{i}:7070"] = SnapshotStore(tmp_path / f"spare{i}", f"spare-{i}")
    snap, _ = rounds.take("g", 1, agents, cl.call, 5, keepers=["10.0.0.8:7070", agents[0], "10.0.0.9:7070"])
    kept = {m.node: (m.buddy_node, m.buddy_agent) for m in snap.members}
    assert kept == {
        "node-1": ("spare-8", "10.0.0.8:7070"),
        "node-2": ("spare-9", "10.0.0.9:7070"),
        "node-3": ("spare-8", "10.0.0.8:7070"),
    }, "a member's own agent never keeps images as a spare"
    assert sorted(cl.stores["10.0.0.8:7070"].held("g")[1]) == ["r0", "r2"]
    one, _ = rounds.take("g", 2, agents[:1], cl.call, 5, keepers=["10.0.0.9:7070"])
    assert [m.buddy_node for m in one.members] == ["spare-9"], "a group on one node is kept by a spare"


def test_a_hold_that_fails_releases_every_member_held(tmp_path: Path) -> None:
    cl = Cluster(tmp_path, fail={"10.0.0.3:7070": "hold"})
    with pytest.raises(FerryError, match="it broke"):
        rounds.take("g", 1, list(cl.stores), cl.call, 30)
    assert sorted(s.resumed[0] for s in cl.saves.values() if s.resumed) == ["r0", "r1"]
    assert "ship" not in {a for _, a in cl.log}


def test_a_failed_holds_releases_wait_for_the_live_agents_and_not_long_for_a_dead_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next round must find the live agents' members running again; a dead agent's call
    would wait out its connect timeout."""
    monkeypatch.setattr(rounds, "RELEASE_WAIT_S", 0.5)
    cl = Cluster(tmp_path, fail={"10.0.0.3:7070": "hold"})
    gone = threading.Event()
    real = cl.call

    def call(agent: str, req: pb.SnapshotMemberRequest, timeout_s: float) -> pb.SnapshotMemberResponse:
        if req.action == pb.SNAPSHOT_ACTION_RELEASE and agent == "10.0.0.3:7070":
            gone.wait(10)  # its link is cut
        return real(agent, req, timeout_s)

    t0 = time.monotonic()
    with pytest.raises(FerryError, match="it broke"):
        rounds.take("g", 1, list(cl.stores), call, 30)
    assert time.monotonic() - t0 < 3.0
    assert sorted(s.resumed[0] for s in cl.saves.values() if s.resumed) == ["r0", "r1"]
    gone.set()


def test_a_group_on_one_node_has_no_buddy(tmp_path: Path) -> None:
    with pytest.raises(RefusedError, match="needs a buddy on another node"):
        rounds.take("g", 1, ["10.0.0.1:7070"], lambda *a: pb.SnapshotMemberResponse(), 5)


# -- a protection ---------------------------------------------------------------------


def test_a_failed_round_keeps_the_last_complete_snapshot_and_never_reuses_its_epoch(tmp_path: Path) -> None:
    cl = Cluster(tmp_path)
    agents = list(cl.stores)
    seen: list[tuple[str, int]] = []
    claims = Claims("", None, 0)
    p = Protections(
        tmp_path / "state",
        "node-1",
        SnapshotConfig(every_s=3600),
        cl.call,
        claims=claims,  # type: ignore[arg-type]
        observe=lambda g, s, e: seen.append((g, s.epoch if s else -1)),
    )
    (tmp_path / "state").mkdir()
    p.stop()  # no round thread: the rounds below are the only ones
    p.protect("g", 3600, agents)
    p.take("g")
    first = p.get("g").last
    assert first.epoch == 1 and claims.published == [1]
    cl.fail = {agents[1]: "ship"}
    with pytest.raises(FerryError, match="it broke"):
        p.take("g")
    assert p.get("g").last == first and p.get("g").failed == 1
    assert all(s.held("g") == {1: [m]} for s, m in zip(cl.stores.values(), ["r2", "r0", "r1"], strict=True))
    cl.fail = {}
    p.take("g")
    assert p.get("g").last.epoch == 3, "round 2 failed; its epoch is never used again"
    assert seen == [("g", 1), ("g", -1), ("g", 3)]
    again = Protections(tmp_path / "state", "node-1", SnapshotConfig(), cl.call)
    assert again.get("g").last.epoch == 3 and again.get("g").tried == 3 and again.get("g").every_s == 3600


class Claims:
    """etcd's word on who runs a group's rounds (agent.snapshots.protector), as a test sets it."""

    def __init__(self, holder: str, last: pb.SnapshotSet | None, tried: int) -> None:
        self.holder, self.last, self.tried_at = holder, last, tried
        self.put: list[int] = []
        self.released: list[str] = []
        self.published: list[int] = []
        self.lost = ""  # why this node's lease (and its claim) went, once it has

    def claim(self, group: str) -> Claim:
        return Claim(self.holder, self.last, self.tried_at)

    def number(self, group: str, floor: int) -> int:
        self.tried_at = max(self.tried_at, floor) + 1
        self.put.append(self.tried_at)
        return self.tried_at

    def release(self, group: str) -> None:
        self.released.append(group)

    def holding(self) -> Callable[[], str]:
        return lambda: self.lost

    def publish(self, group: str, value: str) -> bool:
        if self.holder or self.lost:
            return False
        self.published.append(int(json.loads(value)["epoch"]))
        return True

    def ours(self, group: str) -> bool:
        return not (self.holder or self.lost)


def test_with_etcd_one_agent_runs_the_rounds_and_a_standby_takes_over_from_the_last_snapshot(
    tmp_path: Path,
) -> None:
    cl = Cluster(tmp_path)
    claims = Claims("agent 10.0.0.9:7070 on node node-9", pb.SnapshotSet(epoch=7, taken_at=1.0), 8)
    said: list[str] = []
    p = Protections(
        tmp_path / "state",
        "node-1",
        SnapshotConfig(every_s=3600),
        cl.call,
        claims=claims,  # type: ignore[arg-type]
        record=lambda kind, message: said.append(message),
    )
    (tmp_path / "state").mkdir()
    p.stop()
    p.protect("g", 3600, list(cl.stores))
    for _ in range(2):
        with pytest.raises(StandingBy, match=r"run by agent 10\.0\.0\.9:7070 on node node-9"):
            p.take("g")
    assert cl.log == [] and claims.put == []  # no member was asked anything
    assert p.get("g").last.epoch == 7 and p.get("g").rounds_by  # `ferry snapshot --last` answers
    assert sum("stands by" in m for m in said) == 1  # said once, not every interval
    claims.holder = ""  # its holder's lease ended: this agent's claim took
    p.take("g")
    assert p.get("g").last.epoch == 9 and claims.put == [9], "round 8 was tried by the other agent"
    assert not p.get("g").rounds_by and any("runs its snapshot rounds now" in m for m in said)
    p.protect("g", -1, [])  # `--off`: the claim goes now, for a standby to take
    assert claims.released == ["g"]


def test_a_protector_that_loses_its_lease_mid_round_gives_up_at_once_and_drops_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its calls may hang on a cut link for their bounds (minutes): the round is given up within
    a poll of the lease going, no image of another protector's rounds is dropped, and a round
    that completes after the claim ended is not published (etcd's transaction refuses it)."""
    monkeypatch.setattr(rounds, "GO_ON_EVERY_S", 0.05)
    cl = Cluster(tmp_path)
    claims = Claims("", None, 0)
    p = Protections(
        tmp_path / "state",
        "node-1",
        SnapshotConfig(every_s=3600),
        cl.call,
        claims=claims,  # type: ignore[arg-type]
    )
    (tmp_path / "state").mkdir()
    p.stop()
    p.protect("g", 3600, list(cl.stores))
    p.take("g")
    hung = threading.Event()
    real = cl.call

    def call(agent: str, req: pb.SnapshotMemberRequest, timeout_s: float) -> pb.SnapshotMemberResponse:
        if req.action == pb.SNAPSHOT_ACTION_HOLD and agent.startswith("10.0.0.2"):
            hung.wait(10)  # the link to it is cut
        return real(agent, req, timeout_s)

    p.call = call
    start = len(cl.log)
    threading.Timer(0.3, lambda: setattr(claims, "lost", "node node-1 lost its lease in etcd")).start()
    t0 = time.monotonic()
    with pytest.raises(FerryError, match="given up: node node-1 lost its lease"):
        p.take("g")
    assert time.monotonic() - t0 < 2.0
    hung.set()
    assert "drop" not in {a for _, a in cl.log[start:]} and p.get("g").last.epoch == 1
    two = "10.0.0.2:7070"
    deadline = time.monotonic() + 5
    while (two, "hold") not in cl.log[start:] and time.monotonic() < deadline:
        time.sleep(0.01)  # the hung call goes through once its link is back: that member is held
    for a in cl.stores:  # round 2's members go on (by themselves after hold_s; here at once)
        real(a, pb.SnapshotMemberRequest(group="g", epoch=2, action=pb.SNAPSHOT_ACTION_RELEASE), 5)
    # A round that completes although the claim went meanwhile does not count.
    claims.lost, p.call = "", real
    claims.holder = "agent 10.0.0.9:7070 on node node-9"
    before = len(cl.log)
    orig = claims.claim
    claims.claim = lambda g: Claim("", None, 0)  # type: ignore[method-assign]  # it held at the start
    with pytest.raises(StandingBy, match="completed after this agent's claim"):
        p.take("g")
    claims.claim = orig  # type: ignore[method-assign]
    assert claims.published == [1] and p.get("g").last.epoch == 1
    assert "drop" not in {a for _, a in cl.log[before:]}


def test_a_failed_round_is_tried_again_within_seconds_and_less_often_while_it_keeps_failing() -> None:
    assert [protect.retry_in(n, 10) for n in (1, 2, 3, 4, 5, 40)] == [1, 2, 4, 8, 10, 10]


def wait_for(ok: Callable[[], bool], within_s: float = 15.0) -> bool:
    deadline = time.monotonic() + within_s
    while not ok() and time.monotonic() < deadline:
        time.sleep(0.05)
    return ok()


def test_a_round_thread_tries_a_failed_round_again_soon_not_an_interval_later(tmp_path: Path) -> None:
    """A round that met a move (its member no longer where the round looked) must not leave the
    group a whole interval (here an hour) on its last snapshot."""
    cl = Cluster(tmp_path, fail={"10.0.0.2:7070": "hold"})
    (tmp_path / "state").mkdir()
    p = Protections(tmp_path / "state", "node-1", SnapshotConfig(every_s=3600), cl.call)
    try:
        p.protect("g", 3600, list(cl.stores))  # its first round now: it fails
        assert wait_for(lambda: p.get("g").failed >= 1)
        cl.fail = {}
        assert wait_for(lambda: p.get("g").last.epoch == 2), "round 1 failed; round 2 came seconds later"
    finally:
        p.stop()


def test_a_round_in_progress_is_reported_until_it_ends_even_after_protection_is_off(tmp_path: Path) -> None:
    """`--off` starts no round; the one shipping ends by itself, and its DROP then takes the
    previous set away: whoever reads the last set waits until no round is in progress."""
    cl = Cluster(tmp_path)
    shipping, go = threading.Event(), threading.Event()

    def call(agent: str, req: pb.SnapshotMemberRequest, timeout_s: float) -> pb.SnapshotMemberResponse:
        if req.action == pb.SNAPSHOT_ACTION_SHIP:
            shipping.set()
            go.wait(10)
        return cl.call(agent, req, timeout_s)

    (tmp_path / "state").mkdir()
    p = Protections(tmp_path / "state", "node-1", SnapshotConfig(every_s=3600), call)
    try:
        p.protect("g", 3600, list(cl.stores))
        assert shipping.wait(10)
        p.protect("g", -1, [])
        assert p.get("g").pb().in_progress == 1 and not p.get("g").active
        go.set()
        assert wait_for(lambda: p.get("g").pb().in_progress == 0)
        assert p.get("g").last.epoch == 1
    finally:
        go.set()
        p.stop()


def test_rounds_start_every_interval_counted_from_the_last_start_not_from_its_ship(tmp_path: Path) -> None:
    """A ship as long as the interval: counted from its end, the snapshot a recovery reads would be
    up to two intervals old; counted from the start, rounds come every interval."""
    cl = Cluster(tmp_path)
    starts: list[float] = []

    def call(agent: str, req: pb.SnapshotMemberRequest, timeout_s: float) -> pb.SnapshotMemberResponse:
        if req.action == pb.SNAPSHOT_ACTION_HOLD and agent == "10.0.0.1:7070":
            starts.append(time.monotonic())
        if req.action == pb.SNAPSHOT_ACTION_SHIP:
            time.sleep(2.0)
        return cl.call(agent, req, timeout_s)

    (tmp_path / "state").mkdir()
    p = Protections(tmp_path / "state", "node-1", SnapshotConfig(every_s=2.0), call)
    try:
        p.protect("g", 2.0, list(cl.stores))
        assert wait_for(lambda: len(starts) >= 3, within_s=30)
    finally:
        p.stop()
    spacing = [b - a for a, b in itertools.pairwise(starts[1:])]
    assert spacing and max(spacing) < 3.5, f"rounds began {spacing} s apart: counted from their ship's end"


def test_a_round_thread_takes_a_round_at_once_when_its_last_snapshot_no_longer_covers_the_group(
    tmp_path: Path,
) -> None:
    cl = Cluster(tmp_path)
    (tmp_path / "state").mkdir()
    stale = {"why": ""}
    said: list[str] = []
    p = Protections(
        tmp_path / "state",
        "node-1",
        SnapshotConfig(every_s=3600),
        cl.call,
        stale=lambda g, snap: stale["why"] if snap.epoch == 1 else "",
        record=lambda kind, message: said.append(message),
    )
    try:
        p.protect("g", 3600, list(cl.stores))
        assert wait_for(lambda: p.get("g").last.epoch == 1)
        time.sleep(2 * protect.CHECK_EVERY_S)
        assert p.get("g").rounds == 1, "a snapshot that covers the group waits for the interval"
        stale["why"] = "node node-2, which keeps member r0's copy, has no lease in etcd"
        assert wait_for(lambda: p.get("g").last.epoch == 2)
        assert any("a snapshot round now, not at the interval: node node-2" in m for m in said)
    finally:
        p.stop()


def test_a_round_whose_spare_dies_while_it_ships_is_given_up_when_its_lease_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call to a dead node waits out a connect timeout; the round stops within a poll of the
    spare's lease going, and the next round keeps its images elsewhere."""
    monkeypatch.setattr(rounds, "GO_ON_EVERY_S", 0.05)
    cl = Cluster(tmp_path)
    spare = "10.0.0.8:7070"
    cl.stores[spare] = SnapshotStore(tmp_path / "spare", "spare-8")
    alive = {spare: True}
    hung = threading.Event()

    def call(agent: str, req: pb.SnapshotMemberRequest, timeout_s: float) -> pb.SnapshotMemberResponse:
        if req.action == pb.SNAPSHOT_ACTION_SHIP and not alive[spare]:
            hung.wait(10)  # its buddy, the spare, is gone
        return cl.call(agent, req, timeout_s)

    (tmp_path / "state").mkdir()
    p = Protections(
        tmp_path / "state",
        "node-1",
        SnapshotConfig(every_s=3600),
        call,
        keepers=lambda agents: [a for a, up in alive.items() if up],
    )
    p.stop()
    p.protect("g", 3600, list(cl.stores)[:3])
    assert {m.buddy_agent for m in p.take("g").last.members} == {spare}
    alive[spare] = False
    orig = p.keepers
    p.keepers = lambda agents: [spare]  # type: ignore[method-assign]  # at the round's start it lived
    threading.Timer(0.3, lambda: setattr(p, "keepers", orig)).start()
    t0 = time.monotonic()
    with pytest.raises(FerryError, match=r"agent 10\.0\.0\.8:7070, which keeps images of this round"):
        p.take("g")
    assert time.monotonic() - t0 < 5.0
    hung.set()
    assert p.get("g").last.epoch == 1
    assert {m.buddy_node for m in p.take("g").last.members} == {"node-1", "node-2", "node-3"}


def test_protect_needs_the_members_agents_without_etcd(tmp_path: Path) -> None:
    p = Protections(tmp_path, "node-1", SnapshotConfig(), lambda *a: pb.SnapshotMemberResponse())
    with pytest.raises(FerryError, match="--members-on"):
        p.protect("g", 60, [])
    with pytest.raises(NotFoundError, match="not protected"):
        p.take("g")


def test_durations_take_units_and_refuse_nonsense() -> None:
    assert [duration(t) for t in ("90", "90s", "1.5m", "1h")] == [90, 90, 90, 3600]
    with pytest.raises(Usage, match="not a duration"):
        build_parser().parse_args(["protect", "g", "--every", "soon"])
    with pytest.raises(Usage, match="above zero"):
        build_parser().parse_args(["protect", "g", "--every", "0"])


# -- a rollback -------------------------------------------------------------------------


def copy_of(job: str, agent: str, buddy: str) -> pb.MemberCopy:
    return pb.MemberCopy(job=job, agent=agent, node=agent.lower(), buddy_agent=buddy)


class Members:
    """Agents answering a rollback's steps; `running` says which members each runs."""

    def __init__(self, running: dict[str, list[str]], fail: tuple[str, str] = ("", "")) -> None:
        self.running, self.fail = running, fail
        self.log: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()

    def __call__(
        self, agent: str, req: pb.SnapshotMemberRequest, timeout_s: float
    ) -> pb.SnapshotMemberResponse:
        action = pb.SnapshotAction.Name(req.action).removeprefix("SNAPSHOT_ACTION_").lower()
        with self._lock:
            self.log.append((agent, action, req.job or req.buddy))
        if (agent, action) == self.fail:
            raise FerryError("it broke", step=f"rollback {action}", node=agent)
        out = pb.SnapshotMemberResponse(node_name=agent.lower())
        if action == "list":
            for job in self.running.get(agent, []):
                out.members.add(job=job)
        return out

    def steps(self) -> list[str]:
        return [a for _, a, _ in self.log]


SNAP = pb.SnapshotSet(
    epoch=4, members=[copy_of("r0", "A", "B"), copy_of("r1", "B", "C"), copy_of("r2", "C", "A")]
)


def test_a_rollback_ends_every_copy_before_it_restores_any() -> None:
    agents = Members({"A": ["r0"], "B": ["r1"], "C": ["r2"]})
    t = roll_back("g", SNAP, agents, others=[], hold_s=5)
    assert agents.steps() == ["list"] * 3 + ["fetch"] * 3 + ["end"] * 3 + ["restore"] * 3 + ["resume"] * 3
    fetched = sorted((a, j) for a, s, j in agents.log if s == "fetch")
    assert fetched == [("A", "r0"), ("B", "r1"), ("C", "r2")]
    assert t.placed == {"r0": "A", "r1": "B", "r2": "C"} and t.paused_s >= 0


def test_a_member_that_runs_where_no_end_reaches_refuses_the_rollback_before_anything_ends() -> None:
    agents = Members({"A": ["r0"], "B": [], "C": ["r2"]})  # r1 moved to a node nobody named
    with pytest.raises(FerryError, match=r"member\(s\) r1 of group g run on none of A, B, C"):
        roll_back("g", SNAP, agents, others=[], hold_s=5)
    assert set(agents.steps()) == {"list"}


def test_a_failed_fetch_leaves_every_copy_running() -> None:
    agents = Members({"A": ["r0"], "B": ["r1"], "C": ["r2"]}, fail=("C", "fetch"))
    with pytest.raises(FerryError, match=r"agent C: .*it broke"):
        roll_back("g", SNAP, agents, others=[], hold_s=5)
    assert "end" not in agents.steps() and "restore" not in agents.steps()


def test_a_lost_member_is_restored_where_it_is_placed_and_its_dead_node_is_not_asked() -> None:
    agents = Members({"A": ["r0"], "C": ["r2"]})
    t = roll_back("g", SNAP, agents, others=[], hold_s=5, place={"r1": "S"})
    assert "B" not in {a for a, _, _ in agents.log}
    assert ("S", "fetch", "r1") in agents.log and ("S", "restore", "r1") in agents.log
    assert t.placed["r1"] == "S"


def test_a_member_placed_on_the_spare_that_keeps_its_copy_reads_it_there_and_survivors_their_own() -> None:
    snap = pb.SnapshotSet(
        epoch=4,
        members=[
            pb.MemberCopy(job=j, agent=a, buddy_agent="S", dir=f"/keep/{j}", local_dir=f"/taken/{j}")
            for j, a in (("r0", "A"), ("r1", "B"))
        ],
    )
    agents = Members({"A": ["r0"]})
    fetched: dict[str, tuple[str, str, str]] = {}

    def call(agent: str, req: pb.SnapshotMemberRequest, timeout_s: float) -> pb.SnapshotMemberResponse:
        if req.action == pb.SNAPSHOT_ACTION_FETCH:
            fetched[req.job] = (agent, req.local_dir, req.buddy)
        return agents(agent, req, timeout_s)

    roll_back("g", snap, call, others=[], hold_s=5, place={"r1": "S"})
    assert fetched == {"r0": ("A", "/taken/r0", "S"), "r1": ("S", "/keep/r1", "S")}


def restores_on_s(
    tmp_path: Path, restore: Callable[..., JobRecord], adopt: Callable[..., None] = lambda *a: None
) -> MemberRestores:
    """node-s's part of a rollback, fetching from a buddy store that keeps r1's image of round 4."""
    store = SnapshotStore(tmp_path / "store", "node-b")
    image(store.image_dir("g", 4, "r1"), "r1")
    return MemberRestores(
        "node-s",
        tmp_path / "restore",
        JobRegistry(tmp_path / "state", "node-s"),
        lambda buddy, key: image_chunks(store.image_dir(key.group, key.epoch, key.job), key),
        restore,
        adopt,
    )


def test_a_restored_member_is_held_until_resumed_or_goes_on_by_itself(tmp_path: Path) -> None:
    went_on: list[str] = []

    def restore(d: Path, job: str, hold: Callable[[JobRecord], None], keep_logs: bool) -> JobRecord:
        assert verify(d).job.name == job
        rec = member_rec(job, "1")
        hold(rec)
        went_on.append(job)
        return rec

    adopted: list[tuple[str, int, str, bool, JobRecord]] = []

    def adopt(group: str, epoch: int, job: str, d: Path, rec: JobRecord) -> None:
        adopted.append((group, epoch, job, (d / "manifest.json").is_file(), rec))

    r = restores_on_s(tmp_path, restore, adopt)
    assert r.fetch("g", 4, "r1", "10.0.0.2:7070") > 0
    held = r.restore("g", 4, "r1", hold_s=5)
    time.sleep(0.2)
    assert held.state is RestoreState.HELD and went_on == []
    # While held, its image is the snapshot member's to keep as the restored job's last dump.
    assert [a[:4] for a in adopted] == [("g", 4, "r1", True)] and adopted[0][4].name == "r1"
    assert r.resume("g", 4) == ["r1"]
    deadline = time.monotonic() + 5
    while not went_on and time.monotonic() < deadline:
        time.sleep(0.01)
    assert went_on == ["r1"] and held.state is RestoreState.RUNNING
    r.fetch("g", 4, "r1", "10.0.0.2:7070")
    again = r.restore("g", 4, "r1", hold_s=0.2)  # no RESUME comes: it goes on by itself
    deadline = time.monotonic() + 5
    while len(went_on) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert went_on == ["r1", "r1"] and again.state is RestoreState.RUNNING
    with pytest.raises(NotFoundError, match="no image of job r9"):
        r.restore("g", 4, "r9", hold_s=1)
    # A rollback's next try: its END ends a copy the failed try restored and holds; it never goes on.
    r.fetch("g", 4, "r1", "10.0.0.2:7070")
    ended = r.restore("g", 4, "r1", hold_s=5)
    r.end("g", 4)
    time.sleep(0.2)
    assert ended.state is RestoreState.ENDED and went_on == ["r1", "r1"]
    assert r.resume("g", 4) == []


@pytest.mark.parametrize("why", ["moved away", "arriving"])
def test_a_round_whose_warm_up_finds_a_member_it_cannot_save_freezes_no_one(tmp_path: Path, why: str) -> None:
    """A member that moved away (its old node has none now) or whose post-copy move still brings
    its memory would refuse the HOLD: the WARM before it says so, and the round fails before any
    member is frozen (in the fault bench it froze the others, and their next dumps were whole)."""
    cl = Cluster(tmp_path)
    third = list(cl.members)[2]

    def members(group: str) -> list[JobRecord]:
        if why == "moved away":
            return []
        raise JobBusyError("member r2 of group g cannot be saved yet: its move here is postcopy")

    cl.members[third].members = members
    err = NotFoundError if why == "moved away" else RefusedError
    with pytest.raises(err, match=f"agent {third}") as e:
        rounds.take("g", 1, list(cl.stores), cl.call, 30)
    assert e.value.step == "snapshot warm"
    assert "hold" not in {a for _, a in cl.log}
    assert all(s.dumps == [] for s in cl.saves.values())


def test_a_round_that_misses_a_rank_of_the_job_is_no_snapshot(tmp_path: Path) -> None:
    """Members say their WORLD_SIZE: a round that held ranks 0 and 2 of 3 (the agent of rank 1's
    node not asked, or its key not yet in etcd) fails, and releases what it held."""
    cl = Cluster(tmp_path)
    for i, m in enumerate(cl.members.values()):
        (rec,) = m.members("g")
        rec.env = [f"RANK={2 * i}", "WORLD_SIZE=3"]  # ranks 0, 2 and 4 of 3
    with pytest.raises(RefusedError, match=r"rank\(s\) \[1\] were not"):
        rounds.take("g", 1, list(cl.stores), cl.call, 30)
    assert "ship" not in {a for _, a in cl.log}
    assert all(s.resumed for s in cl.saves.values())


def test_a_rollback_abandons_a_round_that_holds_members(tmp_path: Path) -> None:
    save = FakeSave()
    m = members_here(SnapshotStore(tmp_path / "s", "b"), save, tmp_path / "taken")
    (h,) = m.hold("g", 1, 30)
    assert m.abandon("g") == ["r0"] and save.resumed == ["r0"]
    assert h.state is HeldState.EXPIRED
    with pytest.raises(RefusedError, match="expired, not released"):
        m.ship("g", 1, "10.0.0.2:7070")


def test_a_rounds_background_work_yields_to_the_job_and_the_thread_gets_its_priority_back() -> None:
    from agent.snapshots.background import BACKGROUND_NICE, in_background

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    seen: list[int] = []

    def work() -> None:
        before = nice()
        with in_background():
            seen.append(nice() - before)
        seen.append(nice() - before)

    mine = nice()
    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen == [min(BACKGROUND_NICE, 19), 0]
    assert nice() == mine  # only that thread's priority changed


def test_a_restore_that_fails_after_the_end_is_tried_again_and_no_member_goes_on_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past END a failure leaves members with no copy: the steps run again from the same
    snapshot, and no RESUME goes out until every member is restored."""
    monkeypatch.setattr("agent.snapshots.rollback.RETRY_PAUSE_S", 0.0)
    agents = Members({"A": ["r0"], "B": ["r1"], "C": ["r2"]}, fail=("C", "restore"))
    real = agents.__call__
    tries = []

    def once(agent: str, req: pb.SnapshotMemberRequest, timeout_s: float) -> pb.SnapshotMemberResponse:
        if (agent, req.action) == ("C", pb.SNAPSHOT_ACTION_RESTORE):
            tries.append(agent)
            if len(tries) > 1:  # the second try's restore works
                agents.fail = ("", "")
        return real(agent, req, timeout_s)

    t = roll_back("g", SNAP, once, others=[], hold_s=5)
    steps = agents.steps()
    assert steps.count("end") == 6 and steps.count("fetch") == 6 and steps.count("restore") == 6
    assert steps.index("resume") > max(i for i, s in enumerate(steps) if s == "restore")
    assert steps.count("resume") == 3 and t.placed == {"r0": "A", "r1": "B", "r2": "C"}


def test_a_rollback_that_fails_every_try_resumes_what_was_restored_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("agent.snapshots.rollback.RETRY_PAUSE_S", 0.0)
    agents = Members({"A": ["r0"], "B": ["r1"], "C": ["r2"]}, fail=("C", "restore"))
    with pytest.raises(FerryError, match=r"agent C: .*it broke"):
        roll_back("g", SNAP, agents, others=[], hold_s=5)
    steps = agents.steps()
    assert steps.count("end") == 3 * 3 and steps[-3:] == ["resume"] * 3


def test_a_copy_a_rollback_ended_is_said_ended_for_that_round_until_one_is_restored(tmp_path: Path) -> None:
    """END kills the copy (a real process) and its record says which round it was ended for: a
    later try of that rollback, or a recovery taking it over, finds that nothing of it runs here."""
    registry = JobRegistry(tmp_path / "state", "node-c")
    job = subprocess.Popen(["sleep", "60"])
    try:
        rec = member_rec("r2", "2")
        rec.pid, rec.pid_started = job.pid, procs.create_time(job.pid)
        registry.save(rec)
        r = MemberRestores("node-c", tmp_path / "restore", registry, lambda b, k: iter(()), lambda *a: rec)
        assert r.running("g") == ["r2"] and r.ended("g", 4) == []
        assert r.end("g", 4) == ["r2"]
        assert job.wait(5) == -9
        assert r.running("g") == [] and r.ended("g", 4) == ["r2"]
        assert r.ended("g", 5) == [] and r.ended("other", 4) == []
        assert "rolled back to snapshot round 4 of group g" in registry.get("r2").note
        registry.save(member_rec("r2", "2"))  # restored here since: its record is a new one
        assert r.ended("g", 4) == []
    finally:
        job.kill()
        job.wait()


def test_a_tries_fetch_gets_its_own_directory_and_its_end_ends_and_waits_for_the_earlier_held_copy(
    tmp_path: Path,
) -> None:
    """A rollback's next try fetches again while the failed try's restored copy is held: END
    ends that copy and answers only once its restore has unwound (the next RESTORE must not find
    it still recorded here). Each fetch restores from a path of its own: a second rollback to the
    same round is not refused as a second restore of the first one's image."""
    dirs: list[Path] = []
    unwound: list[str] = []

    def restore(d: Path, job: str, hold: Callable[[JobRecord], None], keep_logs: bool) -> JobRecord:
        dirs.append(d)
        try:
            hold(member_rec(job, "1"))
        except RefusedError:
            time.sleep(0.3)  # killing the held copy and settling its record take a while
            unwound.append(job)
            raise
        return member_rec(job, "1")

    r = restores_on_s(tmp_path, restore)
    r.fetch("g", 4, "r1", "10.0.0.2:7070")
    first = r.restore("g", 4, "r1", hold_s=30)
    r.fetch("g", 4, "r1", "10.0.0.2:7070")  # the next try, while the first's copy is held
    r.end("g", 4)
    assert first.state is RestoreState.ENDED and unwound == ["r1"]  # END waited for it
    second = r.restore("g", 4, "r1", hold_s=30)
    assert r.resume("g", 4) == ["r1"]
    assert wait_for(lambda: second.state is RestoreState.RUNNING)
    assert len(set(dirs)) == 2 and not any(d.exists() for d in dirs)  # each its own, removed after
    assert wait_for(lambda: list((tmp_path / "restore").iterdir()) == [])


def test_a_failed_rounds_drop_asks_no_agent_that_etcd_says_is_dead(tmp_path: Path) -> None:
    """Its call would wait out its bound on a dead node's cut link, holding the next round back
    while a recovered member's only copy lies beside it on one node (seen on the fault bench)."""
    cl = Cluster(tmp_path)
    p = Protections(
        tmp_path / "state",
        "node-1",
        SnapshotConfig(every_s=3600),
        cl.call,
        dead=lambda agents: {a for a in agents if a.startswith("10.0.0.3")},
    )
    (tmp_path / "state").mkdir()
    p.stop()
    p.protect("g", 3600, list(cl.stores))
    p.take("g")
    cl.fail = {"10.0.0.3:7070": "hold"}
    start = len(cl.log)
    with pytest.raises(FerryError, match="it broke"):
        p.take("g")
    dropped = sorted(a for a, x in cl.log[start:] if x == "drop")
    assert dropped == ["10.0.0.1:7070", "10.0.0.2:7070"], cl.log[start:]
