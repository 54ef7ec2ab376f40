"""Incremental snapshot images: a member's dump over its last one of the same process, and the
chain of images an increment's pages live in (docs/recovery.md, "Incremental dumps").

Each image of a chain lies at <root>/<group>/<round>/<job>, an increment linked to the one it
was dumped against by CRIU's `parent` link (agent.image.PARENT_LINK). The member's node, its
buddy and a rollback's node keep the same layout, so a chain reads the same everywhere.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from agent.errors import FerryError, ImageError
from agent.image import MAX_CHAIN, PARENT_LINK, link_parent, parent_epoch, read_manifest


@dataclass(frozen=True)
class Chain:
    """A member's last dump with its dirty bits cleared: what its next dump may be an increment over."""

    incarnation: tuple[int, float]
    epoch: int
    length: int  # images in its chain, itself included
    chain_bytes: int = 0  # what the images of its chain hold, itself included
    largest_bytes: int = 0  # its chain's largest image's
    private_bytes: int = 0  # the member's own memory at that dump (procs.tree_private)


def links(image: Path) -> list[Path]:
    """`image` and the images it is an increment over, oldest first."""
    out = [image]
    while (epoch := parent_epoch(out[0])) and len(out) <= MAX_CHAIN:
        out.insert(0, image.parent.parent / str(epoch) / image.name)
    return out


def unshipped(chain: list[Path], verified: int) -> list[Path]:
    """The links of `chain` newer than round `verified`, which a buddy holds; all of them if it
    holds none of the chain."""
    names = [d.parent.name for d in chain]
    return chain[names.index(str(verified)) + 1 :] if str(verified) in names else chain


def chain_epochs(group_dir: Path, epoch: int) -> set[int]:
    """Round `epoch` and every round an image of it is an increment over (their chains)."""
    out = {epoch}
    for job in (group_dir / str(epoch)).iterdir() if (group_dir / str(epoch)).is_dir() else []:
        d, seen = job, {epoch}
        with contextlib.suppress(FerryError, OSError):  # a broken link keeps nothing more
            while (e := parent_epoch(d)) and e not in seen:
                seen.add(e)
                d = group_dir / str(e) / job.name
        out |= seen
    return out


def link_chain(src: Path, d: Path, depth: int = 0) -> int:
    """Hard links in `d` (made, empty) to image `src`'s files, and beside it to the chain `src` is
    an increment over (the same memory, no copy); the bytes of the images linked."""
    for f in src.iterdir():
        if f.name != PARENT_LINK:
            os.link(f, d / f.name)
    n = read_manifest(d).image_bytes
    if over := parent_epoch(src):
        if depth >= MAX_CHAIN:
            raise ImageError(f"{src} ends a chain of over {MAX_CHAIN} increments")
        p = d.parent.parent / str(over) / d.name
        shutil.rmtree(p, ignore_errors=True)
        p.mkdir(parents=True, mode=0o700)
        n += link_chain(src.parent.parent / str(over) / src.name, p, depth + 1)
        link_parent(d, over)
    return n
