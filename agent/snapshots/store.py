"""A buddy's store: the member images this node keeps for other nodes, in memory.

    <dir>/<group>/<epoch>/<job>/        an image, complete and verified
    <dir>/<group>/<epoch>/.<job>.part/  one arriving (never restored from)
    <dir>/<group>/<epoch>/<job>/parent  an increment's link to the image of its job it was
                                        dumped against, ../../<round>/<job> (agent.image)

An image arrives over StoreSnapshot as a move's does (agent.migration.transfer.Intake: listed
files, each digest checked, the manifest last) and is renamed into place only once the manifest
matches every file (and an increment's link leads to the image its manifest names): a
directory without the `.part` is always whole. The coordinator of the group says which epoch is
committed; `keep_only` drops every other but those the committed one's increments read.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

from agent.errors import InvalidArgumentError, NotFoundError, TransferError
from agent.image import MANIFEST, link_parent, parent_dir, read_manifest, verify
from agent.jobs.record import check_group_name, check_job_name
from agent.migration.transfer import Intake
from agent.rpc import pb
from agent.snapshots.background import in_background
from agent.snapshots.chain import chain_epochs

log = logging.getLogger(__name__)

#: Room left free in the store's filesystem: a tmpfs that fills takes the node's memory with it.
RESERVE_BYTES = 256 << 20


class SnapshotStore:
    """Owns `root`: every image under it is this node's to keep or drop."""

    def __init__(self, root: Path, node: str) -> None:
        self.root = root
        self.node = node
        self._lock = threading.Lock()

    def image_dir(self, group: str, epoch: int, job: str) -> Path:
        return self.root / check_group_name(group) / str(epoch) / check_job_name(job)

    def receive(self, chunks: Iterator[pb.ImageChunk]) -> pb.StoredSnapshot:
        """Take one member's image; answer only once it is whole and verified."""
        first = next(chunks, None)
        if first is None or not first.HasField("snapshot"):
            raise InvalidArgumentError("a snapshot stream must start with its snapshot key", node=self.node)
        key = first.snapshot
        if key.epoch <= 0:
            raise InvalidArgumentError(f"snapshot epoch {key.epoch} is not a round", node=self.node)
        final = self.image_dir(key.group, key.epoch, key.job)
        part = final.parent / f".{key.job}.part"
        parent = self.image_dir(key.group, key.parent_epoch, key.job) if key.parent_epoch else None
        base = self.image_dir(key.group, key.base_epoch, key.job) if key.base_epoch else None
        with self._lock:
            if parent is not None and not (parent / MANIFEST).is_file():
                raise NotFoundError(
                    f"this node holds no image of round {key.parent_epoch} of job {key.job}, which "
                    f"its image of round {key.epoch} is an increment over",
                    step="snapshot store",
                    node=self.node,
                    hint="send the chain, oldest first",
                )
            if base is not None and (key.base_epoch == key.epoch or not (base / MANIFEST).is_file()):
                raise NotFoundError(
                    f"this node holds no image of round {key.base_epoch} of job {key.job} for its image "
                    f"of round {key.epoch} to copy from",
                    step="snapshot store",
                    node=self.node,
                    hint="send the image whole",
                )
            shutil.rmtree(part, ignore_errors=True)  # a stream cut before: never restored from
            part.mkdir(parents=True, mode=0o700)
        # A DROP keeps the last complete round, the base of the round after it, until that completes.
        intake = Intake(part, self._room(), node=self.node, base=base)
        try:
            with in_background():  # this node's own members come first
                intake.feed(first)
                for chunk in chunks:
                    intake.feed(chunk)
                m = intake.finish()
                if parent is not None:
                    link_parent(part, key.parent_epoch, key.job)
                parent_dir(part, m, job=key.job)  # its link leads to the image its manifest names
            with self._lock:
                if final.exists():  # a chain sent again: the same image is no error
                    if read_manifest(final).image_id != m.image_id:
                        raise InvalidArgumentError(
                            f"this node already holds another image of job {key.job} for round "
                            f"{key.epoch} of group {key.group}",
                            node=self.node,
                        )
                    shutil.rmtree(part, ignore_errors=True)
                else:
                    os.rename(part, final)
        except BaseException:
            intake.close()
            shutil.rmtree(part, ignore_errors=True)
            raise
        log.info(
            "snapshot store: job %s's image of round %d of group %s is here (%d bytes, %d sent%s)",
            key.job,
            key.epoch,
            key.group,
            intake.bytes,
            intake.sent,
            f", the rest from round {key.base_epoch}'s" if base is not None else "",
        )
        return pb.StoredSnapshot(node_name=self.node, dir=str(final), bytes=intake.bytes)

    def kept(self, group: str, epoch: int, job: str, image_id: str, dumped_on: str) -> Path:
        """The image of `job` for round `epoch` that this node keeps, whole with its chain, if it is
        image `image_id` and was dumped on node `dumped_on` (a move's increment is to go over it:
        agent.migration.chainmove; the member's own node alone may offer it, so that no other makes
        this one restore a copy of a member that node does not run); a NotFoundError says why not.
        Its digests were checked as it came in: not hashed again."""
        d = self.image_dir(group, epoch, job)
        with self._lock:
            if not (d / MANIFEST).is_file():
                raise NotFoundError(
                    f"this node keeps no image of round {epoch} of job {job}", step="prepare", node=self.node
                )
            m = read_manifest(d)
            if m.image_id != image_id:
                raise NotFoundError(
                    f"this node keeps image {m.image_id} of round {epoch} of job {job}, not {image_id}",
                    step="prepare",
                    node=self.node,
                )
            if m.source_node != dumped_on:
                raise NotFoundError(
                    f"the image of round {epoch} of job {job} kept here was dumped on node "
                    f"{m.source_node}, not on {dumped_on}",
                    step="prepare",
                    node=self.node,
                )
            verify(d, m, digests=False)
        return d

    def _room(self) -> int:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = os.statvfs(self.root)
        room = st.f_bavail * st.f_frsize - RESERVE_BYTES
        if room <= 0:
            raise TransferError(
                f"the snapshot store {self.root} has less than {RESERVE_BYTES >> 20} MiB free",
                step="snapshot store",
                node=self.node,
                hint="free memory on this node, or point [snapshots] dir at a local disk",
            )
        return room

    def keep_only(self, group: str, epoch: int) -> list[int]:
        """Drop every image of `group` but round `epoch`'s and those its increments read (0: drop
        them all); the rounds dropped."""
        gdir = self.root / check_group_name(group)
        dropped = []
        with self._lock:
            keep = chain_epochs(gdir, epoch) if epoch else set()
            for d in sorted(gdir.iterdir()) if gdir.is_dir() else []:
                if d.name.isdigit() and int(d.name) not in keep:
                    shutil.rmtree(d, ignore_errors=True)
                    dropped.append(int(d.name))
        return dropped

    def held(self, group: str) -> dict[int, list[str]]:
        """Round → the jobs whose complete image this node holds."""
        gdir = self.root / check_group_name(group)
        out: dict[int, list[str]] = {}
        for d in sorted(gdir.iterdir()) if gdir.is_dir() else []:
            if d.name.isdigit():
                out[int(d.name)] = sorted(j.name for j in d.iterdir() if not j.name.startswith("."))
        return out
