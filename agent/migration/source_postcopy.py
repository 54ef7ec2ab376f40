"""Post-copy on the source: the lazy dump that writes all but the job's memory, then serves that
memory from the frozen tree once the target runs the job (`paging`), and what a broken transfer
settles to by the target's word (agent.migration.fencing).

`PostCopyStep` is a part of `SourceMigration` (agent.migration.source), whose `run()` keeps the
order of the steps: `_start_lazy_dump` is its dump, `_post_copy` what comes after the commit.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from agent.client import split_address
from agent.criu.lazy import LazyDump
from agent.criu.logs import CriuLogs
from agent.criu.runner import Criu, DumpResult
from agent.errors import FerryError, as_ferry_error
from agent.image import StreamDigest
from agent.jobs import procs
from agent.jobs.network import LinkLock
from agent.jobs.record import JobRecord
from agent.migration.capture import Phases
from agent.migration.datapath import SourceDataPath
from agent.migration.fencing import TargetAnswer, Verdict, decide
from agent.migration.model import Emit, MigrationResult, MigrationSpec, Progress
from agent.migration.pagestream import lazy_bytes, staged_page_bytes
from agent.migration.source_abort import _TargetAborted, _Unresolved
from agent.migration.states import MigrationState

log = logging.getLogger(__name__)

#: How long a lazy dump may take to write all but the memory (and to end once its stream is cut).
LAZY_READY_S = 300.0
#: The slowest post-copy ferry waits for before it gives up on the target (bytes per second).
POSTCOPY_MIN_BPS = 20e6
#: After a broken post-copy: how long the target may take to kill its copy and say so.
POSTCOPY_SETTLE_S = 30.0
#: A lazy dump's image beyond this in pages files: CRIU left memory eager (a warning, logs kept).
EAGER_WARN_BYTES = 64 << 20


class PostCopyStep:
    """Post-copy of a `SourceMigration`; the attributes are the migration's own. It owns the
    lazy dump (`lazy_dump`), which the abort path ends through `_end_lazy_dump`."""

    spec: MigrationSpec
    criu: Criu
    criu_logs: CriuLogs
    node: str
    emit: Emit
    staging: Path
    link: LinkLock
    data: SourceDataPath
    lazy_dump: LazyDump | None
    keep_criu_logs: bool
    estimated_bytes: int
    phases: Phases
    result: MigrationResult

    if TYPE_CHECKING:  # SourceMigration's and its abort path's, which this is part of

        def _externals(self) -> list[str]: ...
        def _criu_started(self, pid: int) -> None: ...
        def _journal(self, **changes: object) -> None: ...
        def _ask_target(self, fence: str = "") -> TargetAnswer: ...
        def _abort(self, rec: JobRecord, pids: list[int], err: FerryError) -> None: ...

    def _start_lazy_dump(self, root: int, pids: list[int], shell_job: bool) -> DumpResult:
        """Dump all but the memory, which the target pulls after its restore (post-copy)."""
        assert self.data.pages is not None and self.data.tls is not None
        # Stopped first: when a lazy transfer breaks, CRIU lets the tree go, and it must then
        # stay stopped until the target is known not to run it.
        procs.stop(pids)
        self.link.engage()
        self.lazy_dump = LazyDump(
            self.criu,
            root,
            self.staging,
            self.data.listen(split_address(self.spec.target)[0]),
            self.data.tls.files,
            shell_job=shell_job,
            log_dir=self.criu_logs.dir_for(self.spec.migration_id),
            external=self._externals(),
        )
        self._criu_started(self.lazy_dump.pid)
        try:
            self.lazy_dump.ready(LAZY_READY_S)
        except FerryError:
            if (err := self.data.pages.error) is not None:
                raise err from None
            raise
        self._journal(criu_serving=True)  # the tree is dumped; what is left only serves pages
        self.data.pages.announce(self.data.host, self.data.port)
        self._check_lazy(staged_page_bytes(self.staging))
        return DumpResult()  # CRIU's stats come once the last page is out

    def _check_lazy(self, eager: int) -> None:
        """A lazy dump should leave the memory behind; CRIU has been seen to write it all into the
        image instead (the move then crosses the gRPC relay as a staged pre-copy). Said in the
        result and the log, and CRIU's logs are kept to find out why."""
        if eager < EAGER_WARN_BYTES:
            return
        self.keep_criu_logs = True
        note = f"CRIU dumped {eager / 1e9:.2f} GB of the memory eagerly instead of leaving it lazy"
        self.result.method = f"{self.result.method} ({note})"
        log.warning(
            "migration %s: %s; its CRIU logs are kept in %s",
            self.spec.migration_id,
            note,
            self.criu_logs.dir_for(self.spec.migration_id),
        )

    def _post_copy(self, rec: JobRecord, pids: list[int]) -> StreamDigest:
        """The job runs on the target; serve its memory from the frozen tree until all is there."""
        assert self.lazy_dump is not None and self.data.pages is not None
        pages = self.data.pages
        self.emit(Progress("pages", f"the job runs on {self.result.target_node}; its memory follows"))
        timeout = LAZY_READY_S + self.estimated_bytes / POSTCOPY_MIN_BPS
        try:
            done = self.phases.run("pages", lambda: self.lazy_dump.wait(timeout))  # type: ignore[union-attr]
            return pages.finish(lazy_bytes(done.stats))
        except Exception as exc:
            err = as_ferry_error(exc, "pages", self.node)
        # The transfer broke after the target resumed the job. The tree here is stopped: it runs
        # nowhere until the target says whether its copy (missing pages, so it kills it) is gone.
        verdict = decide(MigrationState.PAGING, self._target_settled())
        if verdict is Verdict.FINISH:
            log.warning(
                "migration %s: post-copy reported %s, but the target has every page",
                self.spec.migration_id,
                err,
            )
            return StreamDigest(0, "")
        if verdict is Verdict.RESUME:
            err = _TargetAborted(
                f"post-copy to {self.result.target_node} failed ({err}); the target killed its copy, so "
                "the job goes on here from where it froze",
                step="pages",
                node=self.node,
            )
        else:
            err = _Unresolved(f"post-copy failed ({err.cause}) and the target has not settled its copy")
        self._abort(rec, pids, err)
        raise AssertionError("unreachable")

    def _target_settled(self) -> TargetAnswer:
        """The target's word once it has left POSTCOPY (UNKNOWN: none in time)."""
        deadline = time.monotonic() + POSTCOPY_SETTLE_S
        while True:
            answer = self._ask_target()
            if answer is not TargetAnswer.UNKNOWN or time.monotonic() >= deadline:
                return answer
            time.sleep(0.5)

    def _end_lazy_dump(self) -> None:
        """Its page stream is closed, so CRIU fails and lets the (stopped) tree go: wait for that,
        or a SIGCONT sent meanwhile is undone when CRIU puts the tree back the way it found it."""
        assert self.lazy_dump is not None
        try:
            self.lazy_dump.wait(LAZY_READY_S)
        except FerryError as e:
            log.info("migration %s: lazy dump ended: %s", self.spec.migration_id, e)
