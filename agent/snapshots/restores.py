"""A rollback's (or a recovery's) part on one node: members brought back to a snapshot.

The coordinator (agent.snapshots.rollback) asks, in order:

- FETCH: `job`'s image of round `epoch` comes from its buddy's store into this node's memory
  and is verified; the job still runs meanwhile (the pause has not begun).
- END: every copy of the group's members here ends: its link is deleted first (a killed
  copy's kernel would close its connections from the job's own address, and a peer already
  restored would drop them), then SIGKILL, as a fenced copy ends (JobRegistry.end_fenced).
- RESTORE: the fetched image is restored as `ferry restore` restores (journaled; the job's
  record says RUNNING at the commit point), then held, stopped and off nothing but its own
  wait, until RESUME. A job rolled back on its own node appends to its logs here.
- RESUME: every held member goes on. One that no RESUME reaches within `hold_s` goes on by
  itself: every old copy ended before any restore, so no copy it could disagree with runs.

Each member's part is a Restoring, whose RestoreState only moves as RESTORE_TRANSITIONS allows:

    FETCHED → HELD        restored, recorded, and stopped until RESUME
    FETCHED → FAILED      the restore failed: nothing runs
    HELD → RUNNING        resumed (by the coordinator, or by itself after hold_s)
    HELD → ENDED          a later END (the rollback's next try) ended it: it never goes on
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from agent.compat import StrEnum
from agent.errors import FerryError, ImageError, NotFoundError, RefusedError, as_ferry_error
from agent.image import MAX_CHAIN, link_parent, parent_dir, parent_epoch, read_manifest, verify
from agent.jobs import fence, procs
from agent.jobs.record import JobRecord, JobState
from agent.jobs.registry import JobRegistry
from agent.migration.transfer import Intake
from agent.rpc import pb
from agent.snapshots.chain import link_chain
from agent.statemachine import Transitions

log = logging.getLogger(__name__)


class RestoreState(StrEnum):
    FETCHED = "fetched"
    HELD = "held"
    RUNNING = "running"
    FAILED = "failed"
    ENDED = "ended"


RESTORE_TRANSITIONS = Transitions(
    "snapshot restore",
    {
        RestoreState.FETCHED: frozenset({RestoreState.HELD, RestoreState.FAILED}),
        RestoreState.HELD: frozenset({RestoreState.RUNNING, RestoreState.ENDED}),
        RestoreState.RUNNING: frozenset(),
        RestoreState.FAILED: frozenset(),
        RestoreState.ENDED: frozenset(),
    },
)

#: How long an ended copy may take to be gone (its GPU memory freed) before a restore.
GONE_WAIT_S = 10.0
#: How long a held restore that END ended may take to unwind (its copy killed, its record
#: settled) before END answers: the next try's restore of the job must not find it.
UNWIND_S = 30.0
#: An image this node fetches may fill its memory up to this much less than all of it.
RESERVE_BYTES = 256 << 20

#: fetch(buddy's HOST:PORT, key) → the image's chunks, as the buddy's store sends them.
Fetch = Callable[[str, pb.SnapshotKey], Iterator[pb.ImageChunk]]
#: restore(image dir, job, hold, keep_logs) → the restored job's record (local_restore.restore_image).
Restore = Callable[[Path, str, Callable[[JobRecord], None], bool], JobRecord]
#: adopt(group, round, job, image dir, restored record): the snapshot member takes the image as
#: the last dump of the restored job (MemberSnapshots.adopt).
Adopt = Callable[[str, int, str, Path, JobRecord], None]


@dataclass
class Restoring:
    group: str
    epoch: int
    job: str
    base: Path  # this fetch's own directory: the image and the chain it reads, under root
    state: RestoreState = RestoreState.FETCHED
    error: str = ""
    held: threading.Event = field(default_factory=threading.Event)  # held, or failed
    go: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)  # its restore has returned

    @property
    def dir(self) -> Path:
        return self.base / self.group / str(self.epoch) / self.job


class MemberRestores:
    """Owns this node's part of every rollback: the fetched images (under `root`, memory) and
    the restored members it holds."""

    def __init__(
        self,
        node: str,
        root: Path,
        registry: JobRegistry,
        fetch: Fetch,
        restore: Restore,
        adopt: Adopt = lambda group, epoch, job, image, rec: None,
    ) -> None:
        self.node, self.root, self.registry = node, root, registry
        self.fetch_from, self.restore_image, self.adopt = fetch, restore, adopt
        self._lock = threading.Lock()
        self._restoring: dict[tuple[str, int, str], Restoring] = {}
        self._superseded: list[Restoring] = []  # held by an earlier try, fetched again since
        self._fetches = itertools.count(1)
        # An earlier agent's fetched images: a restore reads its image only until it returns.
        shutil.rmtree(root, ignore_errors=True)

    def _to(self, r: Restoring, state: RestoreState) -> None:
        r.state = RESTORE_TRANSITIONS.check(r.state, state, f"{r.job} (round {r.epoch} of group {r.group})")

    def fetch(self, group: str, epoch: int, job: str, buddy: str, local: str = "") -> int:
        """Bring the image here and verify it; its size in bytes (with the chain an increment
        reads). `local`: this node's own copy, linked (the same memory, no copy) when it is
        whole; else the buddy's."""
        # Each fetch has its own directory: a second rollback to the same round restores from
        # another path than the first's (whose journal record says it was restored, and runs).
        r = Restoring(group, epoch, job, self.root / f"{os.getpid()}-{next(self._fetches)}")
        try:
            n = self._bring(r.base, group, epoch, job, buddy, Path(local) if local else None)
        except BaseException:
            shutil.rmtree(r.base, ignore_errors=True)
            raise
        with self._lock:
            old = self._restoring.pop((group, epoch, job), None)
            if old is not None and old.state is RestoreState.HELD:  # an earlier try's: END ends it
                self._superseded.append(old)
            self._restoring[(group, epoch, job)] = r
        if old is not None and old.state is RestoreState.FETCHED:  # an earlier try's, never restored from
            shutil.rmtree(old.base, ignore_errors=True)
        return n

    def _bring(
        self, base: Path, group: str, epoch: int, job: str, buddy: str, local: Path | None, depth: int = 0
    ) -> int:
        """Round `epoch`'s image of `job` under `base`, after the images it is an increment over."""
        d = base / group / str(epoch) / job
        d.mkdir(parents=True, mode=0o700)
        if local is not None and (n := self._link(local, d)):
            return n
        if not buddy:
            raise NotFoundError(
                f"job {job}'s image of round {epoch} is neither here nor on a live buddy", node=self.node
            )
        if depth >= MAX_CHAIN:
            raise ImageError(
                f"job {job}'s image of round {epoch} ends a chain of over {MAX_CHAIN} increments"
            )
        room = shutil.disk_usage(self.root).free - RESERVE_BYTES
        intake = Intake(d, max(room, 0), node=self.node)
        over = 0
        try:
            for chunk in self.fetch_from(buddy, pb.SnapshotKey(group=group, epoch=epoch, job=job)):
                if chunk.HasField("snapshot"):
                    over = chunk.snapshot.parent_epoch
                intake.feed(chunk)
            m = intake.finish()
            n = intake.bytes
            if over:  # an increment: what it reads comes first
                n += self._bring(base, group, over, job, buddy, None, depth + 1)
                link_parent(d, over)
            parent_dir(d, m)
        except BaseException:
            intake.close()
            raise
        log.info("rollback: job %s's image of round %d is here (%d bytes)", job, epoch, intake.bytes)
        return n

    def running(self, group: str) -> list[str]:
        """The group's members that run (or are fenced) here."""
        mine = [r for r in self.registry.list() if r.group == group]
        if moving := [r.name for r in mine if r.state is JobState.MIGRATING]:
            raise RefusedError(
                f"member {moving[0]} of group {group} is being moved or saved here",
                step="rollback",
                node=self.node,
                hint="roll back once it has ended (`ferry ps`)",
            )
        return [r.name for r in mine if r.state in (JobState.RUNNING, JobState.FENCED)]

    def _link(self, src: Path, d: Path) -> int:
        """Hard links to the snapshot's own copy, and to the chain an increment reads (restore
        marks and logs land beside, never in it), checked whole; 0 if that copy is not. Its
        digests were checked as it came into this node's store (built from the dump here, or
        verified as its buddy's ship arrived): not hashed again, while the recovery waits."""
        try:
            n = link_chain(src, d)
            verify(d, digests=False)
        except (OSError, FerryError) as e:
            log.warning("rollback: this node's copy %s is not usable (%s); the buddy's is fetched", src, e)
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True, mode=0o700)
            return 0
        return n

    def ended(self, group: str, epoch: int) -> list[str]:
        """The group's members whose copy here a rollback to round `epoch` ended, with none
        restored here since: no copy of theirs runs here (a rollback's next try, or the recovery
        that takes a dead one over, finds them so)."""
        return [
            r.name
            for r in self.registry.list()
            if r.group == group and r.state is JobState.STOPPED and epoch and r.rolled_back_to == epoch
        ]

    def end(self, group: str, epoch: int) -> list[str]:
        """End every running or fenced copy of the group's members here, those a failed try of
        the rollback restored and holds included (they never go on); the jobs ended."""
        why = f"rolled back to snapshot round {epoch} of group {group}"
        with self._lock:
            held = [
                r
                for r in [*self._restoring.values(), *self._superseded]
                if r.group == group and r.state is RestoreState.HELD
            ]
            for r in held:
                self._to(r, RestoreState.ENDED)
                if self._restoring.get((r.group, r.epoch, r.job)) is r:
                    del self._restoring[(r.group, r.epoch, r.job)]
            self._superseded = [r for r in self._superseded if all(r is not h for h in held)]
        for r in held:
            r.go.set()  # its restore unwinds: its copy never went on
        ended = []
        for rec in self.registry.list():
            if rec.group != group or rec.state not in (JobState.RUNNING, JobState.FENCED):
                continue
            if rec.state is JobState.RUNNING:
                # Marked as this rollback's: the node's liveness settles only the fences it made.
                fence.fence(self.registry, rec.name, why, rolled_back_to=epoch)
            if self.registry.end_fenced(rec.name, why, rolled_back_to=epoch) is not None:
                ended.append(rec.name)
                _wait_gone(rec)
        deadline = time.monotonic() + UNWIND_S
        if still := [r.job for r in held if not r.done.wait(max(0.0, deadline - time.monotonic()))]:
            raise FerryError(
                f"the copy of {', '.join(still)} restored by an earlier try is still being ended",
                step="rollback end",
                node=self.node,
                hint="the rollback tries again; the agent's log says what holds it",
            )
        return ended

    def restore(self, group: str, epoch: int, job: str, hold_s: float) -> Restoring:
        """Restore the fetched image, held; answer once it is (or the restore failed)."""
        with self._lock:
            r = self._restoring.get((group, epoch, job))
        if r is None:
            raise NotFoundError(f"no image of job {job} (round {epoch}) was fetched here", node=self.node)
        keep_logs = self._had(job)
        deadline = time.monotonic() + hold_s

        def hold(rec: JobRecord) -> None:
            with self._lock:
                self._to(r, RestoreState.HELD)
            r.held.set()
            # Restored with its written memory tracked: its next snapshot may be an increment
            # over this image. Taken while it is held, before any round can ask for it.
            try:
                self.adopt(group, epoch, job, r.dir, rec)
            except Exception:  # its next dump is whole, as without it
                log.exception("rollback: job %s's restored image is not kept as its last dump", job)
            if not r.go.wait(max(0.0, deadline - time.monotonic())):
                log.warning("rollback: job %s goes on by itself: no RESUME came for round %d", job, epoch)
            with self._lock:
                if r.state is RestoreState.ENDED:
                    raise RefusedError(
                        f"job {job}'s copy restored from round {epoch} was ended by the rollback's next try",
                        step="rollback restore",
                        node=self.node,
                    )
                self._to(r, RestoreState.RUNNING)

        def run() -> None:
            try:
                self.restore_image(r.dir, job, hold, keep_logs)
            except Exception as e:
                r.error = as_ferry_error(e, "rollback restore", self.node).cause
                with self._lock:
                    if r.state is RestoreState.FETCHED:
                        self._to(r, RestoreState.FAILED)
                log.error("rollback: job %s could not be restored: %s", job, r.error)
            finally:
                r.held.set()
                shutil.rmtree(r.base, ignore_errors=True)  # restored or not, the image has served
                r.done.set()

        threading.Thread(target=run, name=f"rollback-{job}", daemon=True).start()
        r.held.wait()
        if r.state is RestoreState.FAILED:
            raise FerryError(
                f"job {job} could not be restored: {r.error}", step="rollback restore", node=self.node
            )
        return r

    def resume(self, group: str, epoch: int) -> list[str]:
        """Let every member held for this rollback go on; the jobs."""
        with self._lock:
            mine = [k for k in self._restoring if k[:2] == (group, epoch)]
            rs = [self._restoring.pop(k) for k in mine]
        for r in rs:
            r.go.set()
        return [r.job for r in rs]

    def _had(self, job: str) -> bool:
        """Whether the job ran here before (its logs are here to append to)."""
        try:
            rec = self.registry.get(job)
        except FerryError:
            return False
        return Path(rec.stdout_path).exists()


def _wait_gone(rec: JobRecord) -> None:
    deadline = time.monotonic() + GONE_WAIT_S
    while procs.alive(rec.pid, rec.pid_started) and time.monotonic() < deadline:
        time.sleep(0.02)


def image_chunks(image_dir: Path, key: pb.SnapshotKey) -> Iterator[pb.ImageChunk]:
    """A stored image as a stream, its manifest last (the buddy's side of FETCH); the key says
    which round's image it is an increment over."""
    from agent.migration.transfer import SendStats, send_image

    m = read_manifest(image_dir)
    key = pb.SnapshotKey(group=key.group, epoch=key.epoch, job=key.job, parent_epoch=parent_epoch(image_dir))
    first = True
    digests = {f.name: f.sha256 for f in m.files}
    for chunk in send_image("", image_dir, lambda entries: m, SendStats(), digests=digests):
        if first:
            chunk.snapshot.CopyFrom(key)
            first = False
        yield chunk
