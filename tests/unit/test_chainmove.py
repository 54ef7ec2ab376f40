"""A protected member's move as an increment over the chain its target keeps
(agent.migration.chainmove), without CRIU: the member's side (which image a move may go over),
the keeper's store, the target's lease and intake, and self-healing's choice of the keeper.
The images are test_snapshot_chains' (a fake save that writes increments with CRIU's `parent`
link); tests/integration/test_chainmove.py moves a real job this way on the bed."""

from __future__ import annotations

import os
import shutil
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_migrate_target import prepare_req
from test_snapshot_chains import B1, B2, Node

from agent.agent_config import PeerSpec
from agent.errors import FerryError, ImageError, NotFoundError
from agent.health.placement import choose_target
from agent.image import (
    MANIFEST,
    STDERR_LOG,
    STDOUT_LOG,
    JobSpec,
    Manifest,
    build_manifest,
    read_manifest,
    verify,
)
from agent.migration import chainmove
from agent.migration.target import TargetMigrations
from agent.migration.transfer import SendStats, send_image
from agent.rpc import pb
from agent.snapshots.protector import ProtectorClaims

MID = "feedfacecafe0002"


def rounds(n: Node, shipped: int, held: int = 0) -> None:
    """Rounds 1..shipped shipped to B1; then rounds up to `held` dumped and released, not shipped."""
    for e in range(1, shipped + 1):
        n.round(e)
    for e in range(shipped + 1, held + 1):
        n.m.hold("g", e, 5)
        n.m.release("g", e)


# -- the member's side ---------------------------------------------------------------------


def test_a_move_may_go_over_the_last_dump_its_keeper_verified(tmp_path: Path) -> None:
    n = Node(tmp_path)
    rounds(n, shipped=2)
    tip = n.m.move_tip(n.rec)
    image = n.root / "g" / "2" / "r0"
    assert tip == chainmove.ChainTip("g", "r0", 2, read_manifest(image).image_id, image, B1)
    assert tip.base() == pb.ChainBase(group="g", epoch=2, image_id=tip.image_id)
    assert n.m.keeper_of(n.rec) == B1


def test_no_tip_where_the_keeper_lacks_the_last_dump_or_the_process_is_another(tmp_path: Path) -> None:
    n = Node(tmp_path)
    n.m.ship_wait_s = 0.2
    rounds(n, shipped=1, held=2)  # round 2 dumped, its ship still to come
    began = time.monotonic()
    assert n.m.move_tip(n.rec) is None and n.m.keeper_of(n.rec) == ""
    assert time.monotonic() - began >= 0.2, "the first waited out the ship that did not come"
    n.m.ship("g", 2, B1)
    assert n.m.move_tip(n.rec) is not None
    assert n.m.move_tip(replace(n.rec, pid=101)) is None, "restarted: its memory is not tracked since"
    shutil.rmtree(n.root / "g" / "2" / "r0")
    assert n.m.move_tip(n.rec) is None, "its own copy is gone: nothing to dump over"


def test_a_move_asked_while_the_last_dump_ships_waits_for_its_keeper_to_verify_it(tmp_path: Path) -> None:
    """The dump cleared the member's dirty bits: a move asked between its release and its ship
    goes over it once its keeper verified it, not whole over nothing the keeper has."""
    n = Node(tmp_path)
    rounds(n, shipped=1, held=2)
    shipper = threading.Timer(0.3, n.m.ship, ("g", 2, B1))
    shipper.start()
    try:
        tip = n.m.move_tip(n.rec)
    finally:
        shipper.join()
    assert tip is not None and tip.epoch == 2 and tip.keeper == B1


def test_a_round_released_long_ago_and_never_shipped_is_not_waited_for(tmp_path: Path) -> None:
    n = Node(tmp_path)
    rounds(n, shipped=1, held=2)  # its coordinator went before the ship
    n.m.ship_wait_s = 0.2
    time.sleep(0.3)
    began = time.monotonic()
    assert n.m.move_tip(n.rec) is None
    assert time.monotonic() - began < 0.1


def test_no_tip_without_tracking(tmp_path: Path) -> None:
    n = Node(tmp_path, tracks=False)
    rounds(n, shipped=2)
    assert n.m.move_tip(n.rec) is None


def test_a_move_takes_the_chain_and_the_next_round_dumps_whole(tmp_path: Path) -> None:
    n = Node(tmp_path)
    rounds(n, shipped=2)
    tip = n.m.move_tip(n.rec)
    assert tip is not None and n.m.take_move_tip(tip)
    assert not n.m.take_move_tip(tip), "taken once: a second dump over it would find it cleared"
    assert n.m.move_tip(n.rec) is None
    assert n.round(3) == 0, "the move's dump cleared its dirty bits against an image now gone"


# -- the keeper's store ----------------------------------------------------------------------


def test_the_store_lends_only_the_very_image_named_with_its_whole_chain(tmp_path: Path) -> None:
    n = Node(tmp_path)
    rounds(n, shipped=3)
    store = n.stores[B1]
    tip = n.m.move_tip(n.rec)
    assert tip is not None
    assert store.kept("g", 3, "r0", tip.image_id, "node-a") == store.image_dir("g", 3, "r0")
    with pytest.raises(NotFoundError, match=r"keeps image \S+ of round 3 of job r0, not other"):
        store.kept("g", 3, "r0", "other", "node-a")
    with pytest.raises(NotFoundError, match="keeps no image of round 4"):
        store.kept("g", 4, "r0", tip.image_id, "node-a")
    with pytest.raises(NotFoundError, match="dumped on node node-a, not on node-x"):
        store.kept("g", 3, "r0", tip.image_id, "node-x")
    shutil.rmtree(store.image_dir("g", 1, "r0"))  # a link of its chain
    with pytest.raises(FerryError):
        store.kept("g", 3, "r0", tip.image_id, "node-a")


# -- the target ------------------------------------------------------------------------------


@pytest.fixture
def keeper(tmp_path: Path, target: TargetMigrations) -> Node:
    """Rounds 1-2 of member r0 kept on B1's store, which the target answers from; round 3
    dumped on the member's node (the move's increment stands in for it: over round 2)."""
    n = Node(tmp_path)
    rounds(n, shipped=2, held=3)
    target.admission.kept = n.stores[B1].kept
    return n


def increment_chunks(image: Path, mid: str = MID) -> list[pb.ImageChunk]:
    m = read_manifest(image)

    def manifest(entries: list) -> Manifest:
        return m

    return list(send_image(mid, image, manifest, SendStats(), digests={f.name: f.sha256 for f in m.files}))


def chain_req(n: Node, **kw: object) -> pb.PrepareRequest:
    """A default move's Prepare (post-copy asked for), offering round 2's image as the base."""
    base = pb.ChainBase(group="g", epoch=2, image_id=read_manifest(n.root / "g" / "2" / "r0").image_id)
    return prepare_req(MID, "r0", chain=base, lazy=True, **{"source_node": "node-a", **kw})


def test_a_granted_increment_is_received_over_the_kept_chain_and_verified_whole(
    keeper: Node, target: TargetMigrations
) -> None:
    lease = target.prepare(chain_req(keeper))
    assert lease.chain and not lease.lazy and not lease.page_stream and not lease.data_cert
    target.push(iter(increment_chunks(keeper.root / "g" / "3" / "r0")))
    assert target.status(MID) == pb.TARGET_STATE_VERIFIED
    staging = target.staging_root / f"in-{MID}"
    image = staging / "3" / "r0"
    assert target._incoming[MID].image_dir == image  # what the commit restores
    m = verify(image)  # its files and, through its parent link, the lent chain's
    assert m.parent == read_manifest(staging / "2" / "r0").image_id
    assert sorted(int(d.name) for d in staging.iterdir() if d.name.isdigit()) == [1, 2, 3]
    # Hard links: the store may drop its copy, the move's stays whole.
    keeper.stores[B1].keep_only("g", 0)
    verify(image)


def test_an_image_the_store_does_not_keep_comes_whole(keeper: Node, target: TargetMigrations) -> None:
    req = chain_req(keeper)
    req.chain.image_id = "another"
    lease = target.prepare(req)
    assert not lease.chain and lease.lazy, "post-copy, as the source asked"


def test_an_image_dumped_on_another_node_than_the_source_comes_whole(
    keeper: Node, target: TargetMigrations
) -> None:
    lease = target.prepare(chain_req(keeper, source_node="node-x"))  # r0's image is node-a's
    assert not lease.chain


def test_a_chain_gone_between_the_lease_and_the_image_fails_the_intake(
    keeper: Node, target: TargetMigrations
) -> None:
    assert target.prepare(chain_req(keeper)).chain
    shutil.rmtree(keeper.stores[B1].image_dir("g", 2, "r0"))
    with pytest.raises(NotFoundError, match="that this node kept is gone"):
        target.push(iter(increment_chunks(keeper.root / "g" / "3" / "r0")))
    assert target.status(MID) == pb.TARGET_STATE_ABORTED


def test_an_increment_over_another_image_is_refused(keeper: Node, target: TargetMigrations) -> None:
    assert target.prepare(chain_req(keeper)).chain
    with pytest.raises(ImageError, match="its parent is image"):
        target.push(iter(increment_chunks(keeper.root / "g" / "2" / "r0")))  # over round 1's


def test_an_increment_no_lease_lent_a_chain_for_is_refused(keeper: Node, target: TargetMigrations) -> None:
    target.prepare(prepare_req(MID, "r0"))
    with pytest.raises(ImageError, match="which no lease lent"):
        target.push(iter(increment_chunks(keeper.root / "g" / "3" / "r0")))


def test_the_manifest_of_a_granted_increment_must_name_its_parent(keeper: Node, tmp_path: Path) -> None:
    image = tmp_path / "in" / "3" / "r0"
    image.mkdir(parents=True)
    whole = read_manifest(keeper.root / "g" / "1" / "r0")
    loan = chainmove.ChainLoan(2, keeper.stores[B1].image_dir("g", 2, "r0"))
    with pytest.raises(ImageError, match="names no parent"):
        chainmove.attach(image, whole, loan, "r0")


def move_image(keeper: Node, tmp_path: Path) -> Path:
    """What a move's dump over round 2 writes on the member's node: an increment with its logs."""
    over = keeper.root / "g" / "2" / "r0"
    d = tmp_path / "out" / "r0"
    d.mkdir(parents=True)
    (d / "pages-1.img").write_bytes(b"m" * 512)
    (d / "core-1.img").write_bytes(b"c" * 10)
    (d / STDOUT_LOG).write_bytes(b"step 1 loss 0.9\n")
    (d / STDERR_LOG).write_bytes(b"")
    os.symlink(os.path.relpath(over, d), d / "parent")  # CRIU's, which the image's files leave out
    spec = JobSpec("r0", "launched", ["python", "train.py"], "/", [], "/o", "/e", 1, group="g")
    build_manifest(d, spec, "node-a", image_id=MID, parent=read_manifest(over).image_id)
    return d


def test_a_committed_increment_is_restored_tracked_and_adopted_before_its_staging_goes(
    keeper: Node, target: TargetMigrations, fake_criu, tmp_path: Path
) -> None:
    adopted: list[tuple[Path, str, bool]] = []
    target.restorer.tracks = lambda: True
    target.restorer.chain_log_level = 2  # [snapshots] criu_log_level: it reads a snapshot's chain
    target.restorer.adopt = lambda inc, rec: adopted.append(
        (inc.image_dir, rec.name, verify(inc.image_dir).parent != "")
    )
    target.prepare(chain_req(keeper))
    target.push(iter(increment_chunks(move_image(keeper, tmp_path))))
    image = target.staging_root / f"in-{MID}" / "3" / "r0"
    target.commit(pb.CommitRequest(migration_id=MID))
    (restore,) = fake_criu.restores
    assert restore["images_dir"] == image and restore["track_mem"] is True and restore["log_level"] == 2
    assert adopted == [(image, "r0", True)], "adopted while its chain was still in staging"
    assert not (target.staging_root / f"in-{MID}").exists()


def adopted_here(keeper: Node, target: TargetMigrations, tmp_path: Path) -> Node:
    """The move's node, its member adopted as the target's agent adopts it: the move's image under
    a number etcd gave it (9 here)."""
    target.prepare(chain_req(keeper))
    target.push(iter(increment_chunks(move_image(keeper, tmp_path))))
    here = Node(tmp_path / "target")
    here.m.adopt("g", 9, "r0", target._incoming[MID].image_dir, here.rec)
    return here


def test_the_node_that_took_the_move_dumps_the_member_next_as_an_increment_over_its_image(
    keeper: Node, target: TargetMigrations, tmp_path: Path
) -> None:
    """MemberSnapshots.adopt as the target's agent calls it: the image and the chain it lies over
    linked among the node's own images."""
    here = adopted_here(keeper, target, tmp_path)
    assert here.round(10) == 9
    assert [p for _, _, p in here.save.dumps] == [here.root / "g" / "9" / "r0"]
    assert verify(here.root / "g" / "9" / "r0").parent == read_manifest(here.root / "g" / "2" / "r0").image_id


def test_a_round_dropped_after_the_move_keeps_the_adopted_image_the_next_round_goes_over(
    keeper: Node, target: TargetMigrations, tmp_path: Path
) -> None:
    """A round that fails after the move (its coordinator still named the move's source) drops
    every image here but the last complete round's: the moved member's adopted image and its
    chain stay, so the round after is an increment, not the member's whole memory again."""
    here = adopted_here(keeper, target, tmp_path)
    here.m.drop("g", 1)  # round 10 failed before it held anyone; round 1 the last complete
    assert (here.root / "g" / "9" / "r0" / MANIFEST).is_file()
    assert here.round(11) == 9


# -- numbering a moved member's image -----------------------------------------------------------


class Etcd:
    """etcd's get and compare-and-swap on one key, as documented: a swap succeeds only if the key
    was last changed at the revision given (0: it does not exist). `race` changes the key once
    between a taker's read and its swap, as a protector numbering a round meanwhile would."""

    def __init__(self) -> None:
        self.value: bytes | None = None
        self.rev = 0
        self.race: int | None = None

    def get(self, key: str) -> SimpleNamespace | None:
        return None if self.value is None else SimpleNamespace(value=self.value, mod_revision=self.rev)

    def compare_and_swap(self, key: str, value: str, mod_revision: int) -> bool:
        if self.race is not None:
            self._put(str(self.race).encode())
            self.race = None
        if mod_revision != self.rev:
            return False
        self._put(value.encode())
        return True

    def _put(self, value: bytes) -> None:
        self.value, self.rev = value, self.rev + 1


def test_image_numbers_are_taken_in_etcd_above_every_one_taken_and_never_twice() -> None:
    etcd = Etcd()
    live = SimpleNamespace(client=etcd, node="node-b", key=lambda *parts: "/".join(parts))
    claims = ProtectorClaims(live)  # type: ignore[arg-type]
    assert claims.number("g", 4) == 5, "above the move's base round"
    assert claims.number("g", 2) == 6, "above every number taken, whatever the floor"
    etcd.race = 7  # a protector took 7 between this read and its swap
    assert claims.number("g", 0) == 8 and etcd.value == b"8"


# -- self-healing's choice ---------------------------------------------------------------------


def report(node: str) -> pb.HealthReport:
    return pb.HealthReport(node_name=node, nvml_available=True)


def test_self_healing_prefers_the_spare_that_keeps_the_jobs_image() -> None:
    peers = [PeerSpec("10.0.0.4:7070", spare=True), PeerSpec(B2, spare=True), PeerSpec(B1, spare=False)]
    views = [(p, report(f"n{i}")) for i, p in enumerate(peers)]
    assert choose_target([], "normal", views).peer.address == "10.0.0.4:7070", "the config's order"
    assert choose_target([], "normal", views, keeper=B2).peer.address == B2
    # A keeper that is no spare does not beat a spare (a spare runs nothing the move would share).
    assert choose_target([], "normal", views, keeper=B1).peer.address == "10.0.0.4:7070"
