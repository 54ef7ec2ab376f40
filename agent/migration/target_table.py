"""The target's protocol state: incoming migrations in one table under one lock, whose transitions
return effects instead of acting.

Every change goes through TARGET_TRANSITIONS and is journaled here, under the lock, before anyone
acts on it. What a change makes necessary (kill a page server or the job, remove staging, close
the one-time keys, count the end) comes back as `Effect`s, which the caller runs once it has let
go of the lock (agent.migration.target_effects). So GetMigration, which takes the lock only to
read an entry, never waits on a process that is slow to die.

Finished migrations (RUNNING, ABORTED) leave the table; the journal answers for them.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from agent.errors import RefusedError
from agent.gpus.ledger import GpuLedger
from agent.image import Manifest, StreamDigest
from agent.migration.chainmove import ChainLoan
from agent.migration.datatls import DataTls
from agent.migration.journal import TARGET, Journal, MigrationRecord
from agent.migration.pagestream import LazyTargetPages, TargetPages
from agent.migration.states import TARGET_TRANSITIONS, TargetState
from agent.migration.target_recovery import journaled

PageStream = TargetPages | LazyTargetPages

#: Incoming states whose image is still only in staging: safe to drop at any time.
BEFORE_RESTORE = frozenset(
    {
        TargetState.PREPARED,
        TargetState.STREAMING,
        TargetState.STREAMED,
        TargetState.RECEIVING,
        TargetState.VERIFIED,
    }
)
#: A copy of the job may exist here (restored, held or running): only killing it ends these.
RESTORED = frozenset({TargetState.RESTORING, TargetState.POSTCOPY})
#: Being ended by whoever began it (DROPPING, UNWINDING): ABORTED follows once nothing is left.
ENDING = frozenset({TargetState.DROPPING, TargetState.UNWINDING})


@dataclass
class Incoming:
    """One incoming migration: the lease's terms, fixed at Prepare, and how far it got."""

    migration_id: str
    job: str
    source_node: str
    staging: Path
    max_bytes: int
    expires_at: float
    peer_name: str = ""  # the certificate that prepared it: the only one that may go on
    state: TargetState = TargetState.PREPARED
    manifest: Manifest | None = None
    gpu_map: dict[str, str] = field(default_factory=dict)  # the job's GPU → the GPU here
    pids: list[int] = field(default_factory=list)  # an adopted job's host PIDs
    reserved_bytes: int = 0
    criu_pid: int = 0
    criu_started: float = 0.0
    job_pid: int = 0  # the restored job here, from the commit point on
    job_started: float = 0.0
    pages: StreamDigest | None = None  # what the page stream delivered
    lazy: bool = False  # post-copy: the memory comes after the restore, on demand
    reason: str = ""  # why the source moves it (automatic moves say which GPU and what it showed)
    lease_owner: str = ""  # its GPUs' claim in the ledger ("" when it holds none)
    note: str = ""  # why it is ending (DROPPING, UNWINDING, ABORTED)
    #: Granted as an increment over a chain this node keeps (agent.migration.chainmove).
    chain: ChainLoan | None = None
    #: Where its image is written in staging: staging itself, or a chain move's increment there.
    image: Path | None = None

    @property
    def image_dir(self) -> Path:
        return self.image or self.staging

    @property
    def subject(self) -> str:
        return f"{self.migration_id} (job {self.job})"

    def record(self) -> MigrationRecord:
        return MigrationRecord(
            migration_id=self.migration_id,
            role=TARGET,
            job=self.job,
            state=self.state.value,
            peer=self.source_node,
            peer_name=self.peer_name,
            staging=str(self.staging),
            pids=list(self.pids),
            criu_pid=self.criu_pid,
            criu_started=self.criu_started,
            job_pid=self.job_pid,
            job_started=self.job_started,
            expires_at=self.expires_at,
            max_bytes=self.max_bytes,
            reserved_bytes=self.reserved_bytes,
            gpu_map=dict(self.gpu_map),
            note=self.note,
        )


def lease_expired(inc: Incoming, node: str) -> RefusedError:
    return RefusedError(f"the lease of migration {inc.migration_id} expired", node=node)


def from_journal(rec: MigrationRecord) -> Incoming:
    """A migration this run of the agent does not hold (finished, or unwound by recovery)."""
    return Incoming(
        rec.migration_id,
        rec.job,
        rec.peer,
        Path(rec.staging),
        rec.max_bytes,
        rec.expires_at,
        peer_name=rec.peer_name,
        state=journaled(rec),
        job_pid=rec.job_pid,
        job_started=rec.job_started,
        note=rec.note,
    )


# -- effects: what a transition leaves to do once the lock is let go -----------------------------
# Each is safe to run twice, and after another drop of the same migration.


@dataclass(frozen=True)
class StopStream:
    stream: PageStream  # a page server or lazy-pages daemon, possibly still writing into staging


@dataclass(frozen=True)
class CloseKeys:
    keys: DataTls  # the data connection's one-time key is of no more use


@dataclass(frozen=True)
class RemoveStaging:
    path: Path


@dataclass(frozen=True)
class DropLogs:
    migration_id: str  # it succeeded: CRIU's logs are not needed


@dataclass(frozen=True)
class EndJob:
    """The job's copy here must not run on: record it lost, cut its link, kill it."""

    job: str
    source_node: str
    why: str


@dataclass(frozen=True)
class Ended:
    result: str  # "committed" or "aborted" (TargetMigrations.on_end)


Effect = StopStream | CloseKeys | RemoveStaging | DropLogs | EndJob | Ended


class IncomingTable:
    """The migrations in flight here and what each holds (its page stream, its keys).

    Methods named `*_locked` must be called with `lock` held; they journal, never block on
    anything but that fsync, and return the effects for the caller to run after the lock.
    """

    def __init__(self, journal: Journal, ledger: GpuLedger) -> None:
        self.journal = journal
        self.ledger = ledger
        self.lock = threading.Lock()
        #: Notified on every change: a StreamPages answer waits here for an unwinding to end.
        self.changed = threading.Condition(self.lock)
        self.entries: dict[str, Incoming] = {}
        self.streams: dict[str, PageStream] = {}
        self.keys: dict[str, DataTls] = {}

    def busy_locked(self) -> list[Incoming]:
        return [i for i in self.entries.values() if i.state.in_flight]

    def add_locked(self, inc: Incoming, keys: DataTls | None) -> None:
        self.journal.save(inc.record())
        self.entries[inc.migration_id] = inc
        if keys is not None:
            self.keys[inc.migration_id] = keys

    def save_locked(self, inc: Incoming) -> None:
        """A fact that is no state change (CRIU's pid): durable too."""
        self.journal.save(inc.record())

    def set_locked(self, inc: Incoming, state: TargetState) -> list[Effect]:
        """A step forward. RUNNING ends the migration: the job's record holds its GPUs now, and
        its staging, keys and logs go."""
        if state is TargetState.ABORTED or state in ENDING:
            raise ValueError(f"{state.value} is reached through drop or unwind, not set")
        inc.state = TARGET_TRANSITIONS.check(inc.state, state, inc.subject)
        if state is not TargetState.RUNNING:
            self._save_locked(inc)
            return []
        self.ledger.release(inc.lease_owner)
        self._save_locked(inc)
        return [*self._let_go(inc), DropLogs(inc.migration_id), Ended("committed")]

    def drop_locked(self, inc: Incoming, why: str) -> list[Effect] | None:
        """Begin to drop a migration whose image is only in staging (DROPPING: it is never
        restored from now on). None if it is already ending or ended: its ender finishes."""
        if inc.state in ENDING or inc.state is TargetState.ABORTED:
            return None
        self._end_locked(inc, TargetState.DROPPING, why)
        return self._let_go(inc)

    def unwind_locked(self, inc: Incoming, why: str) -> list[Effect]:
        """Begin to end a migration whose restore began (UNWINDING: its copy here is killed
        before ABORTED). The caller owns the unwinding: it is the commit (RESTORING, or
        UNWINDING after `doom_locked`), or the failed post-copy transfer (POSTCOPY)."""
        ran = inc.state is TargetState.POSTCOPY
        if inc.state is not TargetState.UNWINDING:
            self._end_locked(inc, TargetState.UNWINDING, why)
        end = [EndJob(inc.job, inc.source_node, why)] if ran else []
        return [*end, *self._let_go(inc)]

    def doom_locked(self, inc: Incoming, why: str) -> None:
        """A restore under way must not be released (its post-copy transfer broke): UNWINDING,
        and the commit, which owns the restore, refuses at its commit point and unwinds."""
        self._end_locked(inc, TargetState.UNWINDING, why)

    def aborted_locked(self, inc: Incoming) -> list[Effect]:
        """The end of a drop or an unwinding: nothing of it is left here."""
        inc.state = TARGET_TRANSITIONS.check(inc.state, TargetState.ABORTED, inc.subject)
        self.ledger.release(inc.lease_owner)
        self._save_locked(inc)
        return [Ended("aborted")]

    def lapsed_locked(
        self, inc: Incoming, states: tuple[TargetState, ...], what: str, node: str
    ) -> list[Effect] | None:
        """Under the lock: the migration waits in one of `states` for `what` (else a refusal).
        Its lease lapsed: it begins to drop, and the caller, once it has run these effects and
        journaled ABORTED, refuses with `lease_expired`. None: it holds."""
        if inc.state not in states:
            raise RefusedError(
                f"migration {inc.migration_id} is {inc.state.value}, not waiting for {what}",
                step="transfer",
                node=node,
            )
        if time.time() <= inc.expires_at:
            return None
        return self.drop_locked(inc, f"its lease expired before {what} came") or []

    def waiting_locked(self) -> list[Incoming]:
        """Migrations waiting for their source (its image, its commit): it still owns the job."""
        waiting = (TargetState.PREPARED, TargetState.STREAMED, TargetState.VERIFIED)
        return [i for i in self.entries.values() if i.state in waiting]

    def expired_locked(self, now: float | None = None) -> list[Incoming]:
        """Leases whose source went silent while the migration waited for it."""
        now = time.time() if now is None else now
        return [i for i in self.waiting_locked() if now > i.expires_at]

    def _end_locked(self, inc: Incoming, state: TargetState, why: str) -> None:
        inc.state = TARGET_TRANSITIONS.check(inc.state, state, inc.subject)
        inc.note = why
        self._save_locked(inc)

    def _save_locked(self, inc: Incoming) -> None:
        self.journal.save(inc.record())
        if not inc.state.in_flight:  # the journal answers for it from now on
            self.entries.pop(inc.migration_id, None)
        self.changed.notify_all()

    def _let_go(self, inc: Incoming) -> list[Effect]:
        """What the migration holds, handed out once: its page stream first (it may still write
        into staging), its keys, its staging."""
        held: list[Effect] = []
        if (stream := self.streams.pop(inc.migration_id, None)) is not None:
            held.append(StopStream(stream))
        if (keys := self.keys.pop(inc.migration_id, None)) is not None:
            held.append(CloseKeys(keys))
        return [*held, RemoveStaging(inc.staging)]
