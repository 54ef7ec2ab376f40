"""The target's end of StreamPages: hosting the page server (pre-copy) or the lazy-pages side
(post-copy) of one incoming migration, and what its failure does to the migration.

The stream is held in the table (IncomingTable.streams) while it runs, so a drop finds it and
stops it, outside the lock (agent.migration.target_effects).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import NoReturn

from agent.criu.logs import CriuLogs
from agent.criu.runner import Criu
from agent.errors import FerryError, RefusedError, TransferError
from agent.migration.pagestream import LazyTargetPages, TargetPages
from agent.migration.states import TargetState
from agent.migration.target_effects import TargetEffects
from agent.migration.target_table import (
    BEFORE_RESTORE,
    ENDING,
    Effect,
    Incoming,
    IncomingTable,
    PageStream,
    lease_expired,
)
from agent.rpc import pb

log = logging.getLogger(__name__)

#: How long a failed StreamPages answer waits for another thread to end the migration here (a
#: post-copy's copy unwound, its staging gone), so that the source, asking next, reads ABORTED.
SETTLE_S = 30.0


class StreamHost:
    """Page streams of incoming migrations."""

    def __init__(
        self, table: IncomingTable, effects: TargetEffects, criu: Criu, criu_logs: CriuLogs, node: str
    ) -> None:
        self.table = table
        self.effects = effects
        self.criu = criu
        self.criu_logs = criu_logs
        self.node = node

    def serve(self, inc: Incoming, requests: Iterator[pb.PageData], host: str) -> Iterator[pb.PageData]:
        """The control of the job's memory, which the source's CRIU sends to a page server here
        (pre-copy, while it dumps) or which a lazy-pages daemon here fetches (post-copy).

        The last message says what arrived; push must then bring a manifest that names the same.
        """
        mid = inc.migration_id
        # Before the lock: it may prune old log directories.
        log_dir = None if inc.lazy else self.criu_logs.dir_for(mid)
        stream: PageStream
        with self.table.lock:
            if inc.pages is not None or mid in self.table.streams:
                raise RefusedError(
                    f"migration {mid} already has its page stream", step="transfer", node=self.node
                )
            lapsed = self.table.lapsed_locked(inc, (TargetState.PREPARED,), "a page stream", self.node)
            if lapsed is None:
                if (keys := self.table.keys.get(mid)) is None:
                    raise RefusedError(
                        f"migration {mid} leased no data connection", step="transfer", node=self.node
                    )
                if inc.lazy:
                    stream = LazyTargetPages(
                        self.node, keys.files, lambda why: self.post_copy_failed(inc, why)
                    )
                else:
                    self.table.set_locked(inc, TargetState.STREAMING)
                    stream = TargetPages(
                        self.criu, inc.staging, inc.max_bytes, self.node, keys.files, host, log_dir
                    )
                self.table.streams[mid] = stream
        if lapsed is not None:
            self.effects.finish(inc, lapsed)
            raise lease_expired(inc, self.node)
        if isinstance(stream, LazyTargetPages):
            yield from self._post_copy(inc, stream, requests)
            return
        try:
            digest = yield from stream.run(requests)
        except BaseException as e:
            stream.kill()
            self.effects.drop(inc, f"page stream failed: {e}")
            self._settled(inc)
            self._failed(e, "transfer", "the page stream")
        with self.table.lock:
            self.table.streams.pop(mid, None)
            if inc.state is not TargetState.STREAMING:  # aborted while the last bytes came in
                raise RefusedError(f"migration {mid} was aborted", node=self.node)
            inc.pages = digest
            # Waiting, under the lease's expiry, for the rest of the image.
            self.table.set_locked(inc, TargetState.STREAMED)
        log.info("migration %s: %d bytes of memory streamed in", mid, digest.bytes)
        yield pb.PageData(end=pb.PageStreamEnd(bytes=digest.bytes, check=digest.check))

    def _post_copy(
        self, inc: Incoming, stream: LazyTargetPages, requests: Iterator[pb.PageData]
    ) -> Iterator[pb.PageData]:
        """Post-copy: the stream stays open across push and commit and ends once the restored
        job has all its memory. Until then the job here needs the source's frozen copy."""
        try:
            digest = yield from stream.run(requests)
        except BaseException as e:
            stream.kill()
            self.post_copy_failed(inc, str(e) if isinstance(e, FerryError) else repr(e))
            self._settled(inc)
            self._failed(e, "pages", "the post-copy transfer")
        effects: list[Effect] = []
        with self.table.lock:
            self.table.streams.pop(inc.migration_id, None)
            inc.pages = digest
            # Still RESTORING (the daemon was quicker than the release): the commit point sees
            # the pages in and goes straight to RUNNING.
            if inc.state is TargetState.POSTCOPY:
                effects = self.table.set_locked(inc, TargetState.RUNNING)
        self.effects.run(effects)
        log.info("migration %s: post-copy done, %d bytes of memory pulled in", inc.migration_id, digest.bytes)
        yield pb.PageData(end=pb.PageStreamEnd(bytes=digest.bytes, check=digest.check))

    def post_copy_failed(self, inc: Incoming, why: str) -> None:
        """The job's missing pages will never come: its copy here must not run on (they would
        read as zeros), and the source may resume its own once we say ABORTED. Called from the
        stream's threads too; whoever comes first does it."""
        with self.table.lock:
            if inc.state is TargetState.POSTCOPY:
                effects = self.table.unwind_locked(inc, f"post-copy failed: {why}")
            elif inc.state is TargetState.RESTORING:  # the commit point refuses; the commit unwinds
                self.table.doom_locked(inc, why)
                return
            elif inc.state in BEFORE_RESTORE:
                effects = self.table.drop_locked(inc, f"page stream failed: {why}")
            else:  # ending or ended already
                return
        self.effects.finish(inc, effects)

    def _settled(self, inc: Incoming) -> None:
        """Wait (bounded) while another thread drops or unwinds the migration: the source, told
        of the failure, asks next, and should read ABORTED."""
        with self.table.changed:
            self.table.changed.wait_for(lambda: inc.state not in ENDING, SETTLE_S)

    def _failed(self, e: BaseException, step: str, what: str) -> NoReturn:
        """Re-raise a StreamPages failure as the error the source sees (with step and node)."""
        if isinstance(e, GeneratorExit):  # the call was cancelled: nobody to tell
            raise e
        if isinstance(e, FerryError):
            raise e.at(step=step, node=self.node) from None
        raise TransferError(f"{what} failed: {e!r}", step=step, node=self.node) from e
