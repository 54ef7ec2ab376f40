"""A protected member's move as an increment over the snapshot chain its target keeps for it.

A member's last round left its image on its own node, its written memory tracked from that
dump on, and a copy on its keeper (a spare, agent.snapshots.store), verified there. A move to
that keeper need not carry the memory again: the source dumps only what the job wrote since
(CRIU's --prev-images-dir over its own copy of that image), and the target restores it over the
chain it keeps, hard-linked into the move's staging. A few MB cross instead of the job's memory,
and no page is left to follow the restore (a post-copy's faults slowed the job's first steps on
its new node by about a second on the bed: docs/performance.md).

Prepare names the image (ChainBase: group, round, image id). The target grants it (Lease.chain)
only where its store holds that very image with its whole chain, dumped on the source node (no
node makes it restore a member that node does not run), on its staging's filesystem; otherwise
the move goes as any other. The rest is a staged pre-copy move's protocol: the same
lease, journal, commit and abort. A move that ends in an abort leaves the member's next round
to dump it whole (the move's dump cleared its dirty bits against an image that is gone). One
that commits is restored tracked, and the target adopts its image as the member's last dump
under a number etcd gives it (agent.service.node, `_adopt_moved`): its next round is an
increment too. The restore copies the member's whole memory out of the kept chain while the
job is frozen (0.5-1.75 s for 500 MB on the bed); post-copy's freeze does not grow with memory,
but its pages come from the source, which a warned node may not outlive.

The target's staging:

    in-<id>/<round>/<job>/        the kept image (hard links), its chain beside it
    in-<id>/<round + 1>/<job>/    the increment, its `parent` link ../../<round>/<job>
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from agent.errors import FerryError, ImageError, NotFoundError
from agent.image import Manifest, link_parent, parent_dir
from agent.jobs.record import JobRecord
from agent.rpc import pb
from agent.snapshots.chain import link_chain


@dataclass(frozen=True)
class ChainTip:
    """The source's side: the member's last tracked image, which a move may be an increment over."""

    group: str
    job: str
    epoch: int
    image_id: str
    image: Path  # its copy on this node, which the dump reads the unwritten pages' places from
    keeper: str  # the agent (HOST:PORT) that verified its copy of it

    def base(self) -> pb.ChainBase:
        return pb.ChainBase(group=self.group, epoch=self.epoch, image_id=self.image_id)


class MoveChains(Protocol):
    """The source's member snapshots (agent.snapshots.member.MemberSnapshots), as a move asks them."""

    def move_tip(self, rec: JobRecord) -> ChainTip | None: ...
    def take_move_tip(self, tip: ChainTip) -> bool: ...


@dataclass(frozen=True)
class ChainLoan:
    """The target's side: the kept image a granted move's increment goes over."""

    epoch: int
    kept: Path  # in this node's snapshot store


def same_filesystem(a: Path, b: Path) -> bool:
    """Hard links need one filesystem: the store's and the staging's."""
    return os.stat(a).st_dev == os.stat(b).st_dev


def lend(loan: ChainLoan, job: str, staging: Path) -> Path:
    """Link the kept chain into `staging` (hard links: the store may drop its copy meanwhile);
    the directory, made empty, that the increment is to be written into."""
    kept = staging / str(loan.epoch) / job
    kept.mkdir(parents=True, mode=0o700)
    try:
        link_chain(loan.kept, kept)
    except (OSError, FerryError) as e:
        raise NotFoundError(
            f"the chain of job {job}'s image of round {loan.epoch} that this node kept is gone: {e}",
            step="transfer intake",
            hint="move the job again: its whole memory then moves",
        ) from e
    image = staging / str(loan.epoch + 1) / job
    image.mkdir(parents=True, mode=0o700)
    return image


def attach(image: Path, manifest: Manifest, loan: ChainLoan, job: str) -> None:
    """The increment received into `image` goes over the lent chain: its `parent` link, checked
    to lead to the image its manifest names."""
    if not manifest.parent:
        raise ImageError(f"{image}: the move was granted as an increment, but its manifest names no parent")
    link_parent(image, loan.epoch, job)
    parent_dir(image, manifest, job)
