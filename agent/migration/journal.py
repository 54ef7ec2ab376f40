"""Migration records on disk: what each side of a migration had done when it last wrote.

Each side writes its record before it acts on a phase (a source records
RESTORING before it sends commit; a target records RESTORING before CRIU
starts), so after a crash the record names the furthest the migration may
have got. An agent reads them at start (agent.migration.recovery) and finishes or
unwinds each one. Writes are atomic (rename) and durable (fsync).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Generic, TypeVar

from agent.durable import replace_file
from agent.errors import FerryError
from agent.statemachine import Transitions

log = logging.getLogger(__name__)

S = TypeVar("S", bound=Enum)

SOURCE, TARGET = "source", "target"
#: Aborted records (tombstones) are kept this long, so a late message with their id is refused.
KEEP_FINISHED_S = 7 * 24 * 3600


@dataclass
class MigrationRecord:
    migration_id: str
    role: str  # source | target
    job: str
    state: str  # source: MigrationState value; target: TargetState value
    peer: str = ""  # source: the target's address; target: the source's node name
    peer_name: str = ""  # target: the source's certificate name ("" on insecure loopback)
    staging: str = ""
    pids: list[int] = field(default_factory=list)  # source: the frozen tree; target: adopted PIDs
    cuda_pids: list[int] = field(default_factory=list)  # source: processes whose CUDA state is checkpointed
    keys: str = ""  # source: its one-time data key's directory, removed when the migration settles
    kind: str = "move"  # source: move | checkpoint | suspend (a local operation: no peer)
    image: str = ""  # a local operation's image directory (never removed by recovery)
    criu_pid: int = 0  # the CRIU process of the dump or restore in progress
    criu_started: float = 0.0
    #: source, post-copy: the lazy dump is done and its CRIU only serves pages (killing it harms nothing)
    criu_serving: bool = False
    job_pid: int = 0  # target: the job's PID 1 here once restored (StopMoved checks it is still that job)
    job_started: float = 0.0
    expires_at: float = 0.0
    max_bytes: int = 0
    reserved_bytes: int = 0
    gpu_map: dict[str, str] = field(default_factory=dict)
    note: str = ""
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)


FINISHED = {"committed", "aborted", "running"}
#: Only these are ever pruned: a target's "running" record is what tells a source, however
#: late it asks, that the job runs there; forgetting it would read as "never heard of it".
#: ("committed" is a source's end only: no target record has that state.)
PRUNABLE = {"aborted", "committed"}


class Journal:
    """One JSON file per migration and side, under STATE_DIR/migrations."""

    def __init__(self, state_dir: Path) -> None:
        self.root = state_dir / "migrations"
        self.root.mkdir(parents=True, exist_ok=True)
        #: The state each file had when last read, by its (inode, mtime, size): what `load(states=...)`
        #: need not read again. Housekeeping asks for the open records every few seconds.
        self._seen: dict[Path, tuple[tuple[int, int, int], str]] = {}
        self._seen_lock = threading.Lock()

    def _path(self, role: str, mid: str) -> Path:
        return self.root / f"{role}-{mid}.json"

    def save(self, rec: MigrationRecord) -> None:
        rec.updated_at = time.time()
        data = json.dumps(asdict(rec), indent=1, sort_keys=True).encode()
        replace_file(self._path(rec.role, rec.migration_id), data)

    def get(self, role: str, mid: str) -> MigrationRecord | None:
        path = self._path(role, mid)
        try:
            return MigrationRecord(**json.loads(path.read_bytes()))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError) as e:
            # Never "no record": that answer lets a source resume its copy.
            raise FerryError(
                f"migration record {path} is unreadable ({e})",
                step="journal",
                hint="restore the file from a backup or settle the migration by hand",
            ) from e

    def load(
        self, role: str, strict: bool = False, states: frozenset[str] | None = None
    ) -> list[MigrationRecord]:
        """Every record of one side (only those in `states`, if given), oldest first; finished
        ones past their keep time are removed. With `states`, a file read before in another
        state and unchanged since (its mtime and size) is not read again.

        An unreadable record could be a restore in flight that must be killed, so it is never
        taken as "no record": strict (recovery at start) raises, naming every such file; else
        each is logged as an error and left where it is for the operator.
        """
        out = []
        bad: list[str] = []
        now = time.time()
        for path in sorted(self.root.glob(f"{role}-*.json")):
            try:
                st = path.stat()
            except FileNotFoundError:  # pruned or replaced meanwhile
                continue
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
            with self._seen_lock:
                seen = self._seen.get(path)
            if states is not None and seen is not None and seen[0] == key and seen[1] not in states:
                continue
            try:
                rec = MigrationRecord(**json.loads(path.read_bytes()))
            except (OSError, ValueError, TypeError) as e:
                log.error("unreadable migration record %s: %s", path, e)
                bad.append(f"{path} ({e})")
                continue
            if rec.state in PRUNABLE and now - rec.updated_at > KEEP_FINISHED_S:
                with contextlib.suppress(OSError):
                    path.unlink()
                with self._seen_lock:
                    self._seen.pop(path, None)
                continue
            with self._seen_lock:
                self._seen[path] = (key, rec.state)
            if states is None or rec.state in states:
                out.append(rec)
        if bad and strict:
            raise FerryError(
                f"{len(bad)} {role} migration record(s) are unreadable: {'; '.join(bad)}",
                step="recovery",
                hint="each may stand for a frozen or half-restored copy of a job: check the job on both "
                "nodes (`ferry ps`), settle it by hand, then move the file out of the migrations directory",
            )
        return sorted(out, key=lambda r: r.created_at)


def state_of(rec: MigrationRecord, states: type[S]) -> S:
    """A record's state as `states` (the source's or the target's). One this agent cannot read is
    refused, never guessed: it may stand for a frozen copy or a restore that must be killed."""
    try:
        return states(rec.state)
    except ValueError as e:
        raise FerryError(
            f"migration record {rec.migration_id} has the unknown {rec.role} state {rec.state!r}",
            step="journal",
            hint="settle it by hand: see docs/architecture.md, recovery",
        ) from e


class JournaledRecord(Generic[S]):
    """One migration record driven step by step (a local checkpoint, suspend or restore): every
    state change checked against `transitions`, and durable before the step it names acts."""

    def __init__(
        self, journal: Journal, record: MigrationRecord, transitions: Transitions[S], states: type[S]
    ) -> None:
        self.journal, self.record = journal, record
        self.transitions, self.states = transitions, states

    def save(self, **changes: object) -> None:
        for k, v in changes.items():
            setattr(self.record, k, v)
        self.journal.save(self.record)

    def to(self, state: S, **changes: object) -> None:
        subject = f"{self.record.migration_id} (job {self.record.job})"
        self.transitions.check(state_of(self.record, self.states), state, subject)
        self.save(state=state.value, **changes)
