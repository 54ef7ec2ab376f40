"""The abort path of an outgoing migration: a failure after the freeze, decided by the one
decision (agent.migration.fencing) and then acted on: hold the frozen copy (`unresolved`), or
resume it here (`aborting` → `aborted`, agent.migration.rollback).

`AbortPath` is a part of `SourceMigration` (agent.migration.source): every step of `run()`
after Prepare ends here when it fails, and post-copy when its transfer breaks. The two errors
below carry the target's word to it when a step has already taken it, so it is not asked twice.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from agent.criu.lazy import LazyDump
from agent.cuda import driver as cuda
from agent.cuda.jobs import CudaJobs, Footprint
from agent.errors import FerryError, MigrationAbortedError, TransferError
from agent.jobs.network import LinkLock
from agent.jobs.record import JobRecord
from agent.jobs.registry import JobRegistry
from agent.migration import rollback
from agent.migration.datapath import SourceDataPath
from agent.migration.fencing import TargetAnswer, Verdict, decide
from agent.migration.model import MigrationSpec, Peer, unresolved_note
from agent.migration.states import NOT_SENT, CudaLeft, MigrationState, cuda_left

log = logging.getLogger(__name__)


class AbortPath:
    """The abort of a `SourceMigration`; the attributes are the migration's own."""

    spec: MigrationSpec
    state: MigrationState
    registry: JobRegistry
    peer: Peer
    cuda: CudaJobs
    node: str
    footprint: Footprint
    link: LinkLock
    data: SourceDataPath
    lazy_dump: LazyDump | None
    staging: Path
    started: float

    if TYPE_CHECKING:  # SourceMigration's and its post-copy's, which this is part of

        def _to(self, state: MigrationState, **changes: object) -> None: ...
        def _set(self, state: MigrationState, phase: str, message: str, **changes: object) -> None: ...
        def _ask_target(self, fence: str = "") -> TargetAnswer: ...
        def _end_lazy_dump(self) -> None: ...

    def _verdict(self, phase: MigrationState, err: FerryError) -> Verdict:
        """The decision (agent.migration.fencing) for a failure while `phase`: decided already
        where the target's word was taken, else asked now if commit may have been sent."""
        if isinstance(err, _Unresolved):
            return Verdict.HOLD
        if isinstance(err, _TargetAborted):
            return Verdict.RESUME  # the target confirmed it: ask_target's answer, taken already
        if phase in NOT_SENT:
            return decide(phase, TargetAnswer.UNKNOWN)  # commit never sent: its answer is moot
        answer = self._ask_target(fence=f"source {self.node} failed while {phase.value}: {err.cause}")
        return decide(phase, answer)

    def _abort(self, rec: JobRecord, pids: list[int], err: FerryError) -> None:
        phase = self.state
        if self._verdict(phase, err) is not Verdict.RESUME:
            # HOLD, or a late RUNNING met on an error path: frozen, and recovery settles it.
            note = unresolved_note(rec.name, self.spec.target)
            self.registry.update(rec.name, note=note)
            self._to(MigrationState.UNRESOLVED, note=note)
            raise _Unresolved(f"{note} ({err.cause})", step=err.step or "commit", node=self.node) from err
        self._set(MigrationState.ABORTING, "abort", f"aborting: {err}")
        self.data.cut()
        self.data.close()
        if self.lazy_dump is not None:
            self._end_lazy_dump()
        try:
            if phase in NOT_SENT:  # the target frees its lease now; after commit, ask_target fenced it
                self.peer.abort(self.spec.migration_id, str(err))
        except FerryError as e:  # commit was never sent: its lease runs out on its own
            log.warning("migration %s: target abort failed: %s", self.spec.migration_id, e)
        # A freeze that failed undid itself (agent.cuda.driver.freeze); a finished one is undone here.
        left = cuda_left(phase, bool(self.footprint.processes))
        left = left if left is CudaLeft.CHECKPOINTED else CudaLeft.NONE
        copy = rollback.FrozenCopy(rec, pids, self.link, self.footprint.pids, left, since=self.started)
        note = f"migration to {self.spec.target} aborted while {phase.value}: {err.cause}"
        outcome = f"the job keeps running on {self.node}"
        hint = err.hint

        def say(r: rollback.Resumed) -> str:
            nonlocal outcome, hint
            if not r.summary():
                return note
            if r.fenced:
                outcome = f"the job stays frozen on {self.node}, fenced: {r.fenced}"
                hint = rollback.FENCED_HINT
                return f"{note}; {outcome}"
            outcome = f"the job's processes run on {self.node}, but {r.summary()}"
            hint = cuda.UNDO_HINT if r.undone else "see the agent's log"
            return f"{note}; {outcome}; {hint}"

        done = rollback.resume(
            self.registry, self.cuda.driver, copy, say, cuda_back=lambda: self.cuda.release(self.footprint)
        )
        shutil.rmtree(self.staging, ignore_errors=True)
        self._to(MigrationState.ABORTED, note=say(done))
        raise MigrationAbortedError(
            f"{err.cause}; migration aborted, {outcome}",
            step=err.step or phase.value,
            node=err.node or self.node,
            hint=hint,
        ) from err


class _TargetAborted(TransferError):
    """The target has said it aborted (or was fenced just now): nothing more to tell it."""


class _Unresolved(FerryError):
    # Not "unavailable": a client would read that as this agent being unreachable.
    kind = "aborted"
