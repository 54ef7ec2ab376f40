"""The target's intake of a pushed image: written into its lease's staging through
`transfer.Intake` (names, caps, digests), then checked against the lease. A move granted as an
increment over a kept chain (agent.migration.chainmove) has that chain lent into staging first,
and its image written beside it with its `parent` link."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

from agent import faults
from agent.errors import ImageError, TransferError
from agent.image import Manifest
from agent.migration import chainmove
from agent.migration.target_table import Incoming
from agent.migration.transfer import Intake
from agent.rpc import pb


def open_intake(inc: Incoming, node: str) -> Intake:
    """The intake the pushed image is written through; a chain move's kept chain lent into
    staging first (linked now: the store may drop its copy once the move runs)."""
    if inc.chain is not None:
        inc.image = chainmove.lend(inc.chain, inc.job, inc.staging)
    streamed = inc.pages.bytes if inc.pages else 0
    return Intake(inc.image_dir, inc.max_bytes - streamed, node)


def receive(
    inc: Incoming, intake: Intake, first: pb.ImageChunk, chunks: Iterator[pb.ImageChunk], node: str
) -> Manifest:
    """Take the whole image through `intake`; its verified manifest. Raises what the intake met,
    the migration (and the intake) left to its caller to drop."""
    intake.feed(first)
    listed = sum((intake.expected or {}).values())
    if listed > (free := shutil.disk_usage(inc.staging).free) + intake.bytes:
        raise TransferError(
            f"the image lists {listed >> 20} MiB but staging {inc.staging.parent} has {free >> 20} MiB free",
            step="transfer intake",
            node=node,
            hint="free space or point --staging-dir at a larger tmpfs",
        )
    faults.check("target-receiving", node)
    for chunk in chunks:
        intake.feed(chunk)
    faults.check("target-transfer", node)
    manifest = intake.finish()
    if manifest.job.name != inc.job:
        raise ImageError(f"image is of job {manifest.job.name!r}, the lease is for {inc.job!r}")
    if manifest.page_stream != inc.pages:
        raise ImageError(
            f"the manifest names a page stream of {manifest.page_stream}, but {inc.pages or 'none'} arrived"
        )
    if inc.chain is not None:
        chainmove.attach(inc.image_dir, manifest, inc.chain, inc.job)
    elif manifest.parent:
        raise ImageError(f"the image is an increment over image {manifest.parent}, which no lease lent here")
    return manifest
