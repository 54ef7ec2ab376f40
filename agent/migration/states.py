"""The two migration state machines, written down: each state, and the table every change goes through.

A change not in its table raises agent.statemachine.IllegalTransitionError. The
tables are what the recovery rules (agent.migration.recovery, TargetMigrations.recover) are
written against, and tests/unit/test_states.py walks them.
"""

from __future__ import annotations

from agent.compat import StrEnum
from agent.rpc import pb
from agent.statemachine import Transitions


class MigrationState(StrEnum):
    """The source side of one migration, journaled before each step acts.

    PREPARING → [LOCKING → LOCKED → CHECKPOINTING → CHECKPOINTED] → DUMPING → TRANSFERRING
    → RESTORING → [PAGING] → COMMITTED. The bracketed CUDA states come only for a job with
    CUDA processes; PAGING only for post-copy (the job runs on the target, its memory still
    comes from the frozen tree here).

    PREPARING → ABORTED: refused before anything froze. LOCKING … RESTORING, PAGING →
    ABORTING → ABORTED: the frozen copy resumed (agent.migration.rollback). RESTORING,
    PAGING → UNRESOLVED: the target stopped answering after commit was sent, so whether it
    runs the job is unknown; the copy here stays frozen. UNRESOLVED → COMMITTED | ABORTED
    once the target answers or an operator settles it (`ferry resolve`).

    Recovery after a crash reads the last journaled state: everything before RESTORING
    means commit was never sent (→ ABORTED, the copy resumed), RESTORING and later means
    ask the target; the CUDA states say how far the freeze got.
    """

    PREPARING = "preparing"
    LOCKING = "cuda-locking"  # lock calls under way: each process RUNNING or LOCKED
    LOCKED = "cuda-locked"  # every CUDA process LOCKED
    CHECKPOINTING = "cuda-checkpointing"  # checkpoint calls under way: only get-state knows
    CHECKPOINTED = "cuda-checkpointed"  # every CUDA process CHECKPOINTED (device memory on host)
    DUMPING = "dumping"  # CRIU dumping; the tree stopped, its link cut
    TRANSFERRING = "transferring"
    RESTORING = "restoring"  # commit sent (or about to be): the target may run the job
    PAGING = "paging"  # post-copy: the target runs the job on memory served from here
    COMMITTED = "committed"
    ABORTING = "aborting"
    ABORTED = "aborted"
    UNRESOLVED = "unresolved"


_M = MigrationState
_FROZEN = (_M.LOCKING, _M.LOCKED, _M.CHECKPOINTING, _M.CHECKPOINTED, _M.DUMPING, _M.TRANSFERRING)
SOURCE_TRANSITIONS: Transitions[MigrationState] = Transitions(
    "source migration",
    {
        _M.PREPARING: frozenset({_M.LOCKING, _M.DUMPING, _M.ABORTING, _M.ABORTED}),
        _M.LOCKING: frozenset({_M.LOCKED, _M.ABORTING, _M.ABORTED}),
        _M.LOCKED: frozenset({_M.CHECKPOINTING, _M.ABORTING, _M.ABORTED}),
        _M.CHECKPOINTING: frozenset({_M.CHECKPOINTED, _M.ABORTING, _M.ABORTED}),
        _M.CHECKPOINTED: frozenset({_M.DUMPING, _M.ABORTING, _M.ABORTED}),
        _M.DUMPING: frozenset({_M.TRANSFERRING, _M.ABORTING, _M.ABORTED}),
        _M.TRANSFERRING: frozenset({_M.RESTORING, _M.ABORTING, _M.ABORTED}),
        _M.RESTORING: frozenset({_M.PAGING, _M.COMMITTED, _M.ABORTING, _M.UNRESOLVED, _M.ABORTED}),
        _M.PAGING: frozenset({_M.COMMITTED, _M.ABORTING, _M.UNRESOLVED, _M.ABORTED}),
        _M.ABORTING: frozenset({_M.ABORTED}),
        _M.UNRESOLVED: frozenset({_M.COMMITTED, _M.ABORTED}),
        _M.COMMITTED: frozenset(),
        _M.ABORTED: frozenset(),
    },
)
#: Commit was never sent from these: the target cannot run the job (→ ABORTED straight from
#: any of them is recovery resuming the copy after a crash).
NOT_SENT = frozenset({_M.PREPARING, *_FROZEN, _M.ABORTING})
#: Commit may have reached the target: only its answer (or an operator) settles these.
MAYBE_SENT = frozenset({_M.RESTORING, _M.PAGING, _M.UNRESOLVED})


class CudaLeft(StrEnum):
    """How far a source's CUDA freeze got, as its journaled state says."""

    NONE = "none"  # never started, or the job has no CUDA processes
    PARTLY = "partly"  # a lock or checkpoint call was under way: read each process's state
    LOCKED = "locked"
    CHECKPOINTED = "checkpointed"


def cuda_left(state: MigrationState, has_cuda: bool) -> CudaLeft:
    """What a crash in `state` left of the CUDA freeze. In process, the freeze undoes its own
    failures, so only CHECKPOINTED is left to undo there (SourceMigration._abort)."""
    if not has_cuda or state is _M.PREPARING:
        return CudaLeft.NONE
    if state in (_M.LOCKING, _M.CHECKPOINTING, _M.ABORTING):
        return CudaLeft.PARTLY  # aborting: an undo may have run part-way
    if state is _M.LOCKED:
        return CudaLeft.LOCKED
    return CudaLeft.CHECKPOINTED


class TargetState(StrEnum):
    """The target side of one migration, journaled before each step acts.

    PREPARED (lease granted, staging reserved) → [STREAMING → STREAMED] → RECEIVING →
    VERIFIED → RESTORING → RUNNING. STREAMING/STREAMED: the job's memory came over the page
    stream while the source dumped; the rest of the image (RECEIVING) follows. Post-copy:
    the page stream stays open from PREPARED on (no STREAMING), and RESTORING → POSTCOPY
    (the job runs, its pages still coming) → RUNNING once all are in.

    Every state before RESTORING → DROPPING → ABORTED (the source aborted, the lease expired,
    a transfer failed): DROPPING is journaled first, so nothing restores it from then on, and
    ABORTED once its page server is dead and its staging gone. RESTORING, POSTCOPY → UNWINDING
    → ABORTED: the restore failed or the pages stopped coming; the copy here is killed (its
    link first) before ABORTED, which lets the source resume. A restarted agent goes straight
    to ABORTED from any of them, having done the same first (agent.migration.target_recovery).
    RUNNING is final: it tells a source, however late it asks, that the job runs here.
    """

    PREPARED = "prepared"
    STREAMING = "streaming"
    STREAMED = "streamed"
    RECEIVING = "receiving"
    VERIFIED = "verified"
    RESTORING = "restoring"
    POSTCOPY = "postcopy"
    RUNNING = "running"
    DROPPING = "dropping"  # never restored from here on; its page server and staging going
    UNWINDING = "unwinding"  # its copy here (restored, maybe running) being killed
    ABORTED = "aborted"

    @property
    def wire(self) -> int:
        """What GetMigration answers: STREAMING reads as RECEIVING, STREAMED and DROPPING as
        PREPARED (all mean "not restoring; fence it and it stays so"); UNWINDING as RESTORING
        (a copy may still live here: not yet)."""
        return _WIRE[self]

    @property
    def in_flight(self) -> bool:
        return self not in (TargetState.RUNNING, TargetState.ABORTED)


_T = TargetState
TARGET_TRANSITIONS: Transitions[TargetState] = Transitions(
    "target migration",
    {
        _T.PREPARED: frozenset({_T.STREAMING, _T.RECEIVING, _T.DROPPING, _T.ABORTED}),
        _T.STREAMING: frozenset({_T.STREAMED, _T.DROPPING, _T.ABORTED}),
        _T.STREAMED: frozenset({_T.RECEIVING, _T.DROPPING, _T.ABORTED}),
        _T.RECEIVING: frozenset({_T.VERIFIED, _T.DROPPING, _T.ABORTED}),
        _T.VERIFIED: frozenset({_T.RESTORING, _T.DROPPING, _T.ABORTED}),
        _T.RESTORING: frozenset({_T.RUNNING, _T.POSTCOPY, _T.UNWINDING, _T.ABORTED}),
        _T.POSTCOPY: frozenset({_T.RUNNING, _T.UNWINDING, _T.ABORTED}),
        _T.DROPPING: frozenset({_T.ABORTED}),
        _T.UNWINDING: frozenset({_T.ABORTED}),
        _T.RUNNING: frozenset(),
        _T.ABORTED: frozenset(),
    },
)
_WIRE = {
    _T.PREPARED: pb.TARGET_STATE_PREPARED,
    _T.STREAMING: pb.TARGET_STATE_RECEIVING,
    _T.STREAMED: pb.TARGET_STATE_PREPARED,
    _T.RECEIVING: pb.TARGET_STATE_RECEIVING,
    _T.VERIFIED: pb.TARGET_STATE_VERIFIED,
    _T.RESTORING: pb.TARGET_STATE_RESTORING,
    _T.POSTCOPY: pb.TARGET_STATE_POSTCOPY,
    _T.RUNNING: pb.TARGET_STATE_RUNNING,
    _T.DROPPING: pb.TARGET_STATE_PREPARED,
    _T.UNWINDING: pb.TARGET_STATE_RESTORING,
    _T.ABORTED: pb.TARGET_STATE_ABORTED,
}
