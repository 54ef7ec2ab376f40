"""Incremental snapshots without CRIU (agent.snapshots.member, .store, .restores; agent.image's
chain checks). The save is a fake that writes an increment where asked, with CRIU's `parent`
link, as `criu dump --track-mem --prev-images-dir` is documented to (tests/unit/fakes.FakeCriu
tracks only where told the kernel can). The bed's test_snapshots.py and
tests/integration/test_dirty_tracking.py run the real path where `criu check --feature
mem_dirty_track` passes: on this VM, through ferry's CRIU's userfaultfd write-protect.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from test_snapshots import FakeSave, image, member_rec

from agent.errors import FerryError, ImageError, NotFoundError
from agent.image import PAGES_PREFIX, link_parent, read_manifest, verify
from agent.jobs import procs
from agent.jobs.record import JobRecord
from agent.rpc import pb
from agent.snapshots.member import MemberSnapshots
from agent.snapshots.restores import MemberRestores, image_chunks
from agent.snapshots.store import SnapshotStore

B1, B2 = "10.0.0.2:7070", "10.0.0.3:7070"


class Node:
    """One member (r0) on its node, its dumps tracked, shipping to the buddies' stores."""

    def __init__(self, tmp_path: Path, tracks: bool = True, full_every: int = 8) -> None:
        self.stores = {b: SnapshotStore(tmp_path / f"store-{i}", f"node-{i}") for i, b in enumerate((B1, B2))}
        self.pushed: list[tuple[str, int, int]] = []  # buddy, epoch, parent epoch
        self.save = FakeSave()
        self.rec: JobRecord = member_rec("r0", "0")
        self.root = tmp_path / "taken"
        self.m = MemberSnapshots(
            "node-a",
            self.root,
            lambda g: [self.rec],
            self.save,
            self.push,
            tracks=lambda: tracks,
            full_every=full_every,
        )

    def push(self, buddy: str, chunks: Iterator[pb.ImageChunk]) -> pb.StoredSnapshot:
        first = next(chunks)
        self.pushed.append((buddy, first.snapshot.epoch, first.snapshot.parent_epoch))
        return self.stores[buddy].receive(iter([first, *chunks]))

    def round(self, epoch: int, buddy: str = B1) -> int:
        """Hold, release and ship one round; the round its image is an increment over."""
        self.m.hold("g", epoch, 5)
        self.m.release("g", epoch)
        (h,) = self.m.ship("g", epoch, buddy)
        return h.parent


def test_each_dump_after_the_first_is_an_increment_shipped_alone_and_kept_with_its_chain(
    tmp_path: Path,
) -> None:
    n = Node(tmp_path)
    assert [n.round(e) for e in (1, 2, 3)] == [0, 1, 2]
    assert [(t, p) for _, t, p in n.save.dumps] == [
        (True, None),
        (True, n.root / "g" / "1" / "r0"),
        (True, n.root / "g" / "2" / "r0"),
    ]
    assert n.pushed == [(B1, 1, 0), (B1, 2, 1), (B1, 3, 2)], "the buddy gets only what it lacks"
    store = n.stores[B1]
    assert verify(store.image_dir("g", 3, "r0")).parent == read_manifest(n.root / "g" / "2" / "r0").image_id
    assert store.keep_only("g", 3) == [] and sorted(store.held("g")) == [1, 2, 3], "the chain stays"
    n.m.drop("g", 3)
    assert sorted(int(d.name) for d in (n.root / "g").iterdir()) == [1, 2, 3]


def test_a_chain_holding_its_memory_more_than_twice_over_ends(tmp_path: Path) -> None:
    """Tracking that lapsed (or a job that rewrites all its memory) makes increments as large as
    a whole image: the chain ends once its images hold more than CHAIN_MAX times its largest, so
    its node and its buddy keep a bounded multiple of the member's memory; a job whose memory
    grew once (an increment larger than the first image) keeps its chain."""
    n = Node(tmp_path)
    assert [n.round(e) for e in (1, 2)] == [0, 1]  # 8192, then 1024 bytes of pages
    n.save.increment = 7000  # images of 8202, 1034, then 7010 bytes: within twice the largest
    assert [n.round(e) for e in (3, 4, 5)] == [2, 3, 0]  # a second 7010 is past it: whole next
    n.save.increment = 1024
    assert [n.round(e) for e in (6, 7)] == [5, 6]
    grew = Node(tmp_path / "grew")
    grew.round(1)
    grew.save.increment = 12000  # its memory grew after the first round: one large increment
    assert grew.round(2) == 1
    grew.save.increment = 1024
    assert [grew.round(e) for e in (3, 4)] == [2, 3]


def test_a_chain_within_twice_the_members_own_memory_goes_on(tmp_path: Path) -> None:
    """The bound is the member's memory when that is more than its largest image: a job whose
    first dumps came before it allocated most of its memory (its first steps) keeps its chain,
    where a whole dump would freeze it for as long as all of its memory takes to write."""
    n = Node(tmp_path)
    n.rec = replace(n.rec, pid=os.getpid())  # this test's process: megabytes of its own memory
    assert procs.tree_private(os.getpid()) > 1 << 20
    n.round(1)
    n.save.increment = 7000  # each as large as the whole image: past twice it by the third
    assert [n.round(e) for e in (2, 3, 4, 5)] == [1, 2, 3, 4]


def test_a_chain_ends_at_full_every_and_the_rounds_it_no_longer_needs_go(tmp_path: Path) -> None:
    n = Node(tmp_path, full_every=2)
    assert [n.round(e) for e in (1, 2, 3, 4)] == [0, 1, 0, 3]
    assert n.stores[B1].keep_only("g", 4) == [1, 2]
    n.m.drop("g", 4)
    assert sorted(int(d.name) for d in (n.root / "g").iterdir()) == [3, 4]


def test_a_dump_of_another_process_a_failed_dump_or_no_tracking_starts_whole(tmp_path: Path) -> None:
    n = Node(tmp_path)
    assert [n.round(e) for e in (1, 2)] == [0, 1]
    n.rec.pid_started += 1  # restored or moved since: its dirty bits say nothing of round 2
    assert n.round(3) == 0
    n.save.fail.add("r0")
    with pytest.raises(FerryError, match="could not be saved"):
        n.m.hold("g", 4, 5)
    n.save.fail.clear()
    assert n.round(5) == 0, "the failed dump may have cleared the bits: the next is whole"
    untracked = Node(tmp_path / "untracked", tracks=False)
    assert [untracked.round(e) for e in (1, 2)] == [0, 0]
    assert [(t, p) for _, t, p in untracked.save.dumps] == [(False, None), (False, None)]


def test_a_new_buddy_gets_the_whole_chain_oldest_first(tmp_path: Path) -> None:
    n = Node(tmp_path)
    n.round(1)
    n.round(2)
    n.round(3, buddy=B2)
    assert n.pushed[2:] == [(B2, 1, 0), (B2, 2, 1), (B2, 3, 2)]
    verify(n.stores[B2].image_dir("g", 3, "r0"))


def test_a_buddy_that_lost_a_link_gets_the_chain_again(tmp_path: Path) -> None:
    n = Node(tmp_path)
    n.round(1)
    n.round(2)
    shutil.rmtree(n.stores[B1].image_dir("g", 2, "r0"))  # say, its tmpfs went with a reboot
    assert n.round(3) == 2
    assert n.pushed[2:] == [(B1, 3, 2), (B1, 1, 0), (B1, 2, 1), (B1, 3, 2)], "refused, then the chain"
    verify(n.stores[B1].image_dir("g", 3, "r0"))


def test_the_store_refuses_an_increment_over_an_image_it_lacks_or_another_one(tmp_path: Path) -> None:
    n = Node(tmp_path)
    n.round(1)
    n.round(2)
    mine = n.root / "g" / "2" / "r0"
    store = SnapshotStore(tmp_path / "elsewhere", "node-c")
    with pytest.raises(NotFoundError, match="holds no image of round 1 of job r0"):
        store.receive(image_chunks(mine, pb.SnapshotKey(group="g", epoch=2, job="r0")))
    image(store.image_dir("g", 1, "r0"))  # an image of round 1, but not the one round 2 was dumped over
    with pytest.raises(ImageError, match="its parent is image"):
        store.receive(image_chunks(mine, pb.SnapshotKey(group="g", epoch=2, job="r0")))
    assert store.held("g") == {1: ["r0"], 2: []}


def test_an_increment_is_verified_with_its_chain(tmp_path: Path) -> None:
    n = Node(tmp_path)
    n.round(1)
    n.round(2)
    two = n.root / "g" / "2" / "r0"
    (two / "parent").unlink()
    with pytest.raises(ImageError, match="not linked beside it"):
        verify(two)
    os.symlink("/etc", two / "parent")
    with pytest.raises(ImageError, match="not to an image of its job beside it"):
        verify(two)
    (two / "parent").unlink()
    link_parent(two, 1)
    (n.root / "g" / "1" / "r0" / "pages-1.img").write_bytes(b"altered")
    with pytest.raises(ImageError, match=r"pages-1\.img"):
        verify(two)


@pytest.mark.parametrize("from_local", [True, False])
def test_a_rollback_brings_an_increment_with_its_chain(tmp_path: Path, registry, from_local: bool) -> None:
    n = Node(tmp_path)
    for e in (1, 2, 3):
        n.round(e)
    store = n.stores[B1]

    def fetch(buddy: str, key: pb.SnapshotKey) -> Iterator[pb.ImageChunk]:
        assert buddy == B1
        return image_chunks(store.image_dir(key.group, key.epoch, key.job), key)

    r = MemberRestores("node-d", tmp_path / "restore", registry, fetch, lambda *a: None)  # type: ignore[arg-type]
    local = str(n.root / "g" / "3" / "r0") if from_local else ""
    n_bytes = r.fetch("g", 3, "r0", B1, local)
    (here,) = (tmp_path / "restore").glob("*/g/3/r0")  # under the fetch's own directory
    assert verify(here).parent and (here / "parent").is_symlink()
    # The chain's bytes (a fetch counts its manifests too): round 1 alone holds most of them.
    assert n_bytes >= sum(read_manifest(store.image_dir("g", e, "r0")).image_bytes for e in (1, 2, 3))
    if from_local:  # the same memory as the node's own copy: links, no copy
        assert os.path.samefile(
            here.parent.parent / "1" / "r0" / "pages-1.img", n.root / "g" / "1" / "r0" / "pages-1.img"
        )


def test_a_restored_member_takes_the_image_it_was_restored_from_as_its_last_dump(tmp_path: Path) -> None:
    """A rollback restores a member with its written memory tracked from the restore on (ferry's
    CRIU): its next dump is an increment over that image, on its own node (the chain is its own,
    and only the increment ships) and on the spare that kept it (the chain linked from the kept
    copy, the same memory; the spare's own buddy gets all of it)."""
    n = Node(tmp_path)
    for e in (1, 2, 3):
        n.round(e)
    n.rec.pid_started += 1  # the restored process
    n.m.adopt("g", 3, "r0", n.root / "g" / "3" / "r0", n.rec)
    assert n.round(4) == 3 and n.pushed[-1] == (B1, 4, 3)
    spare = Node(tmp_path / "spare")
    spare.rec = n.rec
    kept = n.stores[B1].image_dir("g", 3, "r0")
    spare.m.adopt("g", 3, "r0", kept, spare.rec)
    assert os.path.samefile(
        spare.root / "g" / "1" / "r0" / "pages-1.img", kept.parent.parent / "1" / "r0" / "pages-1.img"
    )
    assert spare.round(4, B2) == 3 and spare.pushed == [(B2, 1, 0), (B2, 2, 1), (B2, 3, 2), (B2, 4, 3)]
    untracked = Node(tmp_path / "untracked", tracks=False)
    untracked.m.adopt("g", 3, "r0", kept, untracked.rec)
    assert untracked.round(4) == 0 and not (untracked.root / "g" / "3").exists()


def test_ps_group_says_which_copies_are_increments() -> None:
    from agent.cli.snapshots import snapshot_lines

    copies = [
        pb.MemberCopy(job="r0", rank="0", node="node-a", buddy_node="node-b", bytes=1 << 20, parent_epoch=6),
        pb.MemberCopy(job="r1", rank="1", node="node-b", buddy_node="node-a", bytes=300 << 20),
    ]
    p = pb.Protection(group="g", active=True, last=pb.SnapshotSet(epoch=7, taken_at=100.0, members=copies))
    lines = snapshot_lines(p, now=110.0)
    assert lines[1].endswith("kept on node-b (an increment over round 6)"), lines
    assert lines[2].endswith("kept on node-a"), lines


def test_a_drop_while_a_dump_reads_its_parent_keeps_the_chain(tmp_path: Path) -> None:
    import threading

    n = Node(tmp_path)
    n.round(1)
    reading, go = threading.Event(), threading.Event()
    plain = n.save

    def slow(job, out, hold, went_on, track_mem=False, parent=None, warm=True):
        reading.set()  # CRIU reads the parent's images while it dumps
        go.wait(10)
        return plain(job, out, hold, went_on, track_mem, parent, warm)

    n.m.save = slow
    holding = threading.Thread(target=n.m.hold, args=("g", 2, 5))
    holding.start()
    assert reading.wait(10)
    n.m.drop("g", 2)  # whatever DROP comes, what a dump in progress reads stays
    assert (n.root / "g" / "1" / "r0" / "pages-1.img").is_file()
    go.set()
    holding.join(10)
    n.m.release("g", 2)
    (h,) = n.m.ship("g", 2, B1)
    assert h.parent == 1 and verify(n.stores[B1].image_dir("g", 2, "r0")).parent


def test_without_tracking_a_whole_image_goes_as_what_changed_since_the_buddys_copy(tmp_path: Path) -> None:
    n = Node(tmp_path, tracks=False)
    sent: list[tuple[int, int, int]] = []  # epoch, base epoch, bytes of the pages files' data

    def push(buddy: str, chunks: Iterator[pb.ImageChunk]) -> pb.StoredSnapshot:
        got = list(chunks)
        data = sum(len(c.data) for c in got if c.file.startswith(PAGES_PREFIX))
        sent.append((got[0].snapshot.epoch, got[0].snapshot.base_epoch, data))
        return n.stores[buddy].receive(iter(got))

    n.m.push = push
    for e in (1, 2, 3):
        n.round(e)
    pages = os.path.getsize(n.root / "g" / "1" / "r0" / "pages-1.img")
    assert [(e, b) for e, b, _ in sent] == [(1, 0), (2, 1), (3, 2)]
    # Round 1 sends its pages; rounds 2 and 3 none, the buddy's copy holding them. (Counted per
    # file: the other files' sizes move by a byte with the timings their manifest records.)
    assert [d for _, _, d in sent] == [pages, 0, 0], "the pages the buddy's copy holds are not sent again"
    for e in (2, 3):  # each whole, rebuilt from the copy before it and verified
        assert verify(n.stores[B1].image_dir("g", e, "r0")).parent == ""
    shutil.rmtree(n.stores[B1].image_dir("g", 3, "r0"))  # the buddy lost its copy: refused, then whole
    n.round(4)
    assert [(e, b) for e, b, _ in sent[3:]] == [(4, 3), (4, 0)]
    verify(n.stores[B1].image_dir("g", 4, "r0"))
