"""A member's part in a group snapshot, on its own node: held, released, shipped.

A round's coordinator (agent.snapshots.rounds) asks each member's agent, in order:

- HOLD: every running member of the group here is saved as `ferry checkpoint --leave-running`
  saves a job (stopped, its sent bytes acknowledged, its link cut, CUDA checkpointed, dumped with
  its TCP state; journaled), into this node's memory, and then *stays* frozen and cut off. The
  answer comes once each is dumped.
- RELEASE: once every member of the group is held, all go on. A member that no release reaches
  within `hold_s` goes on by itself: a job never stays frozen for a snapshot whose coordinator
  is gone. Its image is then no part of a consistent cut (another member may have been released
  earlier, or never held) and never ships.
- SHIP: each released member's image goes to its buddy (agent.snapshots.store). The copy here
  stays: a node's death takes its member and the copy it kept for another member, and that
  other member's rollback then reads its own node's copy.
- DROP: the images of every round but the committed one are forgotten (and those it is an
  increment over).

One module: HOLD, RELEASE, SHIP, DROP and a rollback's abandon all change the same Helds under
one lock, and their races (a DROP that reaches a round still holding a member) are read here.

Where dirty memory is tracked (soft-dirty, or userfaultfd write-protect through ferry's CRIU:
agent.criu.tracking; `criu check --feature mem_dirty_track`) and
`[snapshots] incremental` is on, every dump clears the bits, and a member's next dump is an
increment over its last one: only the pages written since (CRIU's --prev-images-dir). It is
whole when that dump is gone, was of another process (the job was restored or moved since), or
ended a chain of `full_every` images. A buddy keeps each image's chain; SHIP sends the links it
lacks, oldest first.

Each member's part is a Held, whose HeldState only moves as HELD_TRANSITIONS allows:

    FREEZING → HELD       dumped; frozen and cut off until released
    FREEZING → FAILED     the save failed; the job went on
    HELD → RELEASED       the coordinator's release (every member was held)
    HELD → EXPIRED        no release within hold_s: it went on by itself; its image never ships
    RELEASED → SHIPPED    verified on its buddy, and gone from here
    RELEASED → FAILED     shipping it failed
"""

from __future__ import annotations

import logging
import math
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from agent import faults
from agent.compat import StrEnum
from agent.coord.liveness import rank_of
from agent.errors import FerryError, NotFoundError, RefusedError, as_ferry_error
from agent.image import MANIFEST, Manifest, parent_epoch, read_manifest
from agent.jobs import procs
from agent.jobs.record import JobRecord, env_of
from agent.migration.capture import warm_memory
from agent.migration.chainmove import ChainTip
from agent.migration.local import Dumped
from agent.migration.model import MigrationResult
from agent.migration.transfer import SendStats, send_image
from agent.rpc import pb
from agent.snapshots.background import in_background, lower_priority, restore_priority
from agent.snapshots.chain import Chain, chain_epochs, link_chain, links, unshipped
from agent.statemachine import Transitions

log = logging.getLogger(__name__)


class HeldState(StrEnum):
    FREEZING = "freezing"
    HELD = "held"
    RELEASED = "released"
    EXPIRED = "expired"
    SHIPPED = "shipped"
    FAILED = "failed"


HELD_TRANSITIONS = Transitions(
    "snapshot member",
    {
        HeldState.FREEZING: frozenset({HeldState.HELD, HeldState.FAILED}),
        HeldState.HELD: frozenset({HeldState.RELEASED, HeldState.EXPIRED}),
        HeldState.RELEASED: frozenset({HeldState.SHIPPED, HeldState.FAILED}),
        HeldState.EXPIRED: frozenset(),
        HeldState.SHIPPED: frozenset(),
        HeldState.FAILED: frozenset(),
    },
)

#: How long a release waits for a held member to be going again (CUDA restore included).
RESUME_WAIT_S = 120.0
#: How long a WARM stands for the HOLD after it: on a VM that reports freed memory to its host
#: (after about 2 s), memory touched longer ago is slow to touch again.
WARM_FRESH_S = 1.0
#: A chain whose images hold more than this many times the member's memory ends (the next dump
#: is whole): increments that carry most of the memory (tracking that lapsed, a job that rewrites
#: it all) would keep it many times over on its node and on its buddy. The member's memory is
#: its private resident memory now, or its chain's largest image if that is larger: a job whose
#: memory grew since its whole dump (its first steps allocate most of it) keeps its chain.
CHAIN_MAX = 2.0
#: How long a move waits for the member's last dump, released and not yet verified by its
#: keeper, to be: the dump cleared its dirty bits, so a move asked meanwhile could go as an
#: increment over nothing the keeper has, and would carry the member's whole memory.
SHIP_WAIT_S = 15.0
#: save(job, out_dir, hold, went_on, track_mem, parent, warm) → the checkpoint's result: `ferry
#: checkpoint --leave-running` with a hold, and word of the job going on; an increment over
#: `parent` (agent.migration.local.checkpoint); warm: touch the dump's memory first (no WARM
#: came just before).
Save = Callable[
    [str, Path, Callable[[Dumped], None], Callable[[float], None], bool, "Path | None", bool],
    MigrationResult,
]
#: push(buddy's HOST:PORT, chunks) → what the buddy stored.
Push = Callable[[str, Iterator[pb.ImageChunk]], pb.StoredSnapshot]


@dataclass
class Held:
    group: str
    epoch: int
    job: str
    rank: str
    out_dir: Path
    world: int = 0  # its WORLD_SIZE (0: its environment does not say)
    incarnation: tuple[int, float] = (0, 0.0)  # its process (pid, start): an increment's must match
    parent: int = 0  # the round its dump is an increment over (0: whole)
    state: HeldState = HeldState.FREEZING
    bytes: int = 0
    frozen_s: float = 0.0
    gpu_bytes: int = 0
    cuda_checkpoint_s: float = 0.0
    resume_s: float = 0.0  # from the release to the save's return: the CUDA restore and unlock
    dropped: bool = False  # its round was dropped before its digests were done: removed then
    released_at: float = 0.0  # monotonic
    error: str = ""
    buddy_node: str = ""
    dir: str = ""
    dumped: threading.Event = field(default_factory=threading.Event)  # held, or failed
    go: threading.Event = field(default_factory=threading.Event)
    going: threading.Event = field(default_factory=threading.Event)  # it went on (or never froze)
    done: threading.Event = field(default_factory=threading.Event)  # the save returned (digests too)

    def pb(self) -> pb.HeldMember:
        return pb.HeldMember(
            job=self.job,
            rank=self.rank,
            frozen_s=self.frozen_s,
            bytes=self.bytes,
            buddy_node=self.buddy_node,
            dir=self.dir,
            world=self.world,
            gpu_bytes=self.gpu_bytes,
            cuda_checkpoint_s=self.cuda_checkpoint_s,
            resume_s=self.resume_s,
            local_dir=str(self.out_dir) if self.state is HeldState.SHIPPED else "",
            parent_epoch=self.parent,
        )


def _warm_for(rec: JobRecord, last: int, chain: Chain | None) -> int:
    """About what `rec`'s next dump writes: its resident memory if it was never dumped here; for a
    whole dump its private memory, or its last dump if more (a CUDA member's holds its device
    memory); for an increment, its last one's size and what its memory grew by since the chain's
    last dump (a job that allocates its state after the first round). Warmed for as the last
    increment's size, such dumps wrote 0.5-1 GB into cold memory with the group held 1.5-2.1 s;
    warmed for as they are, 0.46-0.86 s."""
    if not last:
        return procs.tree_rss(rec.pid)
    private = procs.tree_private(rec.pid)
    if chain is None:
        return max(last, private)
    return last + max(0, private - chain.private_bytes)


class MemberSnapshots:
    """Owns this node's part of every round: the held members and their local images (under
    `root`, memory: a tmpfs)."""

    def __init__(
        self,
        node: str,
        root: Path,
        members: Callable[[str], list[JobRecord]],
        save: Save,
        push: Push,
        tracks: Callable[[], bool] = lambda: False,
        full_every: int = 32,
        warm: Callable[[Path, int], float] = warm_memory,
        ship_wait_s: float = SHIP_WAIT_S,
    ) -> None:
        self.node, self.root = node, root
        self.ship_wait_s = ship_wait_s
        self.members, self.save, self.push = members, save, push
        self.warm_memory = warm
        #: Whether dumps track dirty memory here (the kernel can, and [snapshots] incremental).
        self.tracks, self.full_every = tracks, full_every
        self._lock = threading.Lock()
        #: Told of every member's change of state (under the lock): a move waits on its ship.
        self._changed = threading.Condition(self._lock)
        self._held: dict[tuple[str, int], list[Held]] = {}
        #: (group, job) → its last tracked dump; gone while a dump runs, and after one that failed.
        self._chains: dict[tuple[str, str], Chain] = {}
        #: (group, job) → (buddy, round): the newest image of its chain that buddy verified.
        self._shipped: dict[tuple[str, str], tuple[str, int]] = {}
        #: (group, job) → the bytes of its last dump here: what the next one will write.
        self._sizes: dict[tuple[str, str], int] = {}
        #: group → when its last WARM ended (monotonic); taken by the HOLD after it.
        self._warmed: dict[str, float] = {}

    def _to(self, h: Held, state: HeldState) -> None:
        h.state = HELD_TRANSITIONS.check(h.state, state, f"{h.job} (round {h.epoch} of group {h.group})")
        self._changed.notify_all()

    def warm(self, group: str) -> float:
        """Touch as much memory as the dumps of `group`'s members here will write (`_next_dump`),
        now, while they run; the seconds it took. The round's coordinator asks every agent at
        once, then HOLDs: the freezes then begin together instead of each after its own warm-up,
        and no member is cut while a peer still sends to it (its drain would run out). A member
        not dumped here before (its device memory is not in its resident memory) still warms in
        its HOLD: the WARM then does not stand for it."""
        try:
            recs = self.members(group)
        except FerryError as e:  # the HOLD asks the same (a member still arriving): named as this step
            e.step = "snapshot warm"
            raise
        if not recs:
            raise NotFoundError(
                f"no member of group {group} runs on this node", step="snapshot warm", node=self.node
            )
        with self._lock:
            ahead = {r.name: self._next_dump(group, r) for r in recs}
        size = sum(_warm_for(r, *ahead[r.name]) for r in recs)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        took = self.warm_memory(self.root, size) if size else 0.0
        with self._lock:
            if all(last for last, _ in ahead.values()):
                self._warmed[group] = time.monotonic()
        return took

    def _next_dump(self, group: str, rec: JobRecord) -> tuple[int, Chain | None]:
        """The bytes of `rec`'s last dump here (0: none), and the chain its next dump goes on (None:
        whole: its chain ended at full_every or CHAIN_MAX, a dump failed, it is another process
        now, or dumps are not tracked here). Under the lock."""
        c = self._chains.get((group, rec.name))
        return self._sizes.get((group, rec.name), 0), c if self._goes_on(
            c, (rec.pid, rec.pid_started)
        ) else None

    def _goes_on(self, c: Chain | None, incarnation: tuple[int, float]) -> bool:
        """Whether a dump of process `incarnation` may be an increment over chain `c`: the same
        process, and the chain shorter than full_every."""
        return c is not None and c.incarnation == incarnation and c.length < self.full_every

    def hold(self, group: str, epoch: int, hold_s: float) -> list[Held]:
        """Save and hold every running member of `group` here; answer once each is dumped."""
        track = self.tracks()  # asked of CRIU the first time: not under the lock
        with self._lock:
            warmed = time.monotonic() - self._warmed.pop(group, -math.inf) <= WARM_FRESH_S
            # Still frozen (its digests may come after it went on: they hold nothing).
            busy = [
                k for k, hs in self._held.items() if k[0] == group and not all(h.going.is_set() for h in hs)
            ]
            if busy:
                raise RefusedError(
                    f"round {busy[0][1]} of group {group} still holds members here",
                    step="snapshot hold",
                    node=self.node,
                    hint="wait for it to end (its members go on by themselves after [snapshots] hold_s)",
                )
            recs = self.members(group)
            if not recs:
                raise NotFoundError(
                    f"no member of group {group} runs on this node", step="snapshot hold", node=self.node
                )
            out = self.root / group / str(epoch)
            helds = [
                Held(group, epoch, r.name, rank_of(r), out / r.name, world_of(r), (r.pid, r.pid_started))
                for r in recs
            ]
            # Chosen with the round registered, so that a DROP meanwhile keeps what it reads.
            chains = {h.job: self._parent(h) if track else None for h in helds}
            for h in helds:
                h.parent = c.epoch if (c := chains[h.job]) is not None else 0
            self._held[(group, epoch)] = helds
        for h in helds:
            threading.Thread(
                target=self._save,
                args=(h, hold_s, track, chains[h.job], not warmed),
                name=f"snapshot-{h.job}",
                daemon=True,
            ).start()
        for h in helds:
            h.dumped.wait()
        faults.check("snapshot-held", self.node)  # a test's window: every member here frozen
        if failed := [h for h in helds if h.state is HeldState.FAILED]:
            self._release(helds)
            raise FerryError(
                f"job {failed[0].job} could not be saved: {failed[0].error}",
                step="snapshot hold",
                node=self.node,
            )
        return helds

    def _save(
        self,
        h: Held,
        hold_s: float,
        track: bool,
        prior: Chain | None,
        warm: bool,
    ) -> None:
        """h's dump: an increment over the image `prior` (its chain so far) ends with, if any."""
        over = self._image(h, prior.epoch) if prior is not None else None

        def hold(m: Dumped) -> None:
            h.bytes, h.gpu_bytes = m.image_bytes, m.gpu_bytes
            with self._lock:
                self._to(h, HeldState.HELD)
                self._sizes[(h.group, h.job)] = m.image_bytes
            h.dumped.set()
            if h.go.wait(hold_s):  # from the dump's end: a large member's dump takes long
                return
            with self._lock:
                if h.state is HeldState.HELD:  # a release landing now has already moved it on
                    self._to(h, HeldState.EXPIRED)
                    log.warning(
                        "snapshot: job %s went on by itself: no release came for round %d of group %s",
                        h.job,
                        h.epoch,
                        h.group,
                    )

        try:
            h.out_dir.parent.mkdir(parents=True, exist_ok=True, mode=0o700)

            old: list[int | None] = []

            def went_on(frozen_s: float) -> None:
                h.frozen_s = frozen_s
                h.resume_s = time.monotonic() - h.released_at if h.released_at else 0.0
                h.going.set()
                old.append(lower_priority())  # the digests that follow yield to the job

            try:
                res = self.save(h.job, h.out_dir, hold, went_on, track, over, warm)
            finally:
                for o in old:
                    restore_priority(o)
            h.cuda_checkpoint_s = res.phases.get("cuda checkpoint", 0.0)
            log.info(
                "snapshot of job %s (round %d of group %s): frozen %.2f s (%s)",
                h.job,
                h.epoch,
                h.group,
                h.frozen_s,
                ", ".join(f"{k} {v:.3f} s" for k, v in res.phases.items()),
            )
            total, largest = h.bytes, h.bytes
            if prior is not None:
                total, largest = prior.chain_bytes + total, max(prior.largest_bytes, largest)
            private = procs.tree_private(h.incarnation[0]) if track else 0
            memory = max(largest, private)
            if track and total > CHAIN_MAX * memory:
                log.info(
                    "snapshot of job %s (round %d of group %s): its chain holds %d bytes, more than %g "
                    "times its memory (%d bytes); the next dump is whole",
                    h.job,
                    h.epoch,
                    h.group,
                    total,
                    CHAIN_MAX,
                    memory,
                )
            elif track:  # its dirty bits are clear from this dump on: the next may be an increment
                with self._lock:
                    length = prior.length + 1 if prior is not None else 1
                    self._chains[(h.group, h.job)] = Chain(
                        h.incarnation, h.epoch, length, total, largest, private
                    )
        except Exception as e:  # the save resumed the job; the error says what it met
            err = as_ferry_error(e, "snapshot", self.node)
            h.error = err.cause
            with self._lock:
                if h.state is HeldState.FREEZING:
                    self._to(h, HeldState.FAILED)
            if h.state is HeldState.FAILED:
                shutil.rmtree(h.out_dir, ignore_errors=True)
            log.error("snapshot of job %s (round %d of group %s): %s", h.job, h.epoch, h.group, err)
        finally:
            h.dumped.set()
            h.going.set()
            h.done.set()
            with self._lock:
                if h.dropped:
                    shutil.rmtree(h.out_dir, ignore_errors=True)

    def adopt(self, group: str, epoch: int, job: str, image: Path, rec: JobRecord) -> None:
        """A rollback restored `job` here, as `rec`, from round `epoch`'s image (`image`, its
        chain beside it), or a move restored it over a chain this node kept (agent.migration.
        chainmove: `epoch` then a number etcd gave the move's image), its written memory tracked
        from the restore on (ferry's CRIU): its next dump may be an increment over that image, as
        over a dump of its own. The image and its chain are linked among this node's own images
        where they are not (the spare that kept them, or that fetched them: hard links, the same
        memory); a survivor's are its own."""
        if not self.tracks():
            return
        own = self._image_of(group, epoch, job)
        try:
            if not (own / MANIFEST).is_file() or read_manifest(own).image_id != read_manifest(image).image_id:
                shutil.rmtree(own, ignore_errors=True)
                own.mkdir(parents=True, mode=0o700)
                link_chain(image, own)
            sizes = [read_manifest(d).image_bytes for d in links(own)]
            private = procs.tree_private(rec.pid)
        except (OSError, FerryError) as e:
            log.warning("job %s: its next snapshot is whole: its restored image is not here: %s", job, e)
            return
        with self._lock:
            self._chains[(group, job)] = Chain(
                (rec.pid, rec.pid_started), epoch, len(sizes), sum(sizes), max(sizes), private
            )
            self._sizes[(group, job)] = sizes[-1]

    def move_tip(self, rec: JobRecord) -> ChainTip | None:
        """The image a move of member `rec` may be an increment over (agent.migration.chainmove):
        its last tracked dump, when its keeper verified that very image; None: it moves whole.
        A dump of it being taken, or released and still shipping, is waited for (at most
        ship_wait_s)."""
        key = (rec.group, rec.name)
        deadline = time.monotonic() + self.ship_wait_s
        said = False
        with self._lock:
            while (shipping := self._shipping(key)) and (left := deadline - time.monotonic()) > 0:
                if not said:
                    log.info(
                        "job %s: its move waits for its image of round %d to reach its keeper",
                        rec.name,
                        shipping,
                    )
                    said = True
                self._changed.wait(left)
            c, shipped = self._chains.get(key), self._shipped.get(key)
        if (
            c is None
            or c.incarnation != (rec.pid, rec.pid_started)
            or shipped is None
            or shipped[1] != c.epoch
        ):
            return None
        image = self._image_of(rec.group, c.epoch, rec.name)
        try:
            image_id = read_manifest(image).image_id
        except FerryError:
            return None
        return ChainTip(rec.group, rec.name, c.epoch, image_id, image, shipped[0])

    def _shipping(self, key: tuple[str, str]) -> int:
        """The round of member `key` being dumped, or released within ship_wait_s and not yet
        shipped or failed (0: none; one released before is a round whose ship never came). Under
        the lock."""
        since = time.monotonic() - self.ship_wait_s
        rounds = [
            h.epoch
            for hs in self._held.values()
            for h in hs
            if (h.group, h.job) == key
            and (
                h.state in (HeldState.FREEZING, HeldState.HELD)
                or (h.state is HeldState.RELEASED and h.released_at > since)
            )
        ]
        return max(rounds, default=0)

    def keeper_of(self, rec: JobRecord) -> str:
        """The agent (HOST:PORT) keeping the image a move of `rec` may be an increment over ("" none)."""
        tip = self.move_tip(rec)
        return tip.keeper if tip is not None else ""

    def take_move_tip(self, tip: ChainTip) -> bool:
        """A move's dump over `tip` begins: the member's chain is taken, as a round's dump takes it
        (that dump clears its dirty bits: whatever the move's outcome, its next dump here is
        whole). False: the chain is no longer `tip` (the dump must not go over it)."""
        with self._lock:
            c = self._chains.pop((tip.group, tip.job), None)
        return c is not None and c.epoch == tip.epoch

    def _parent(self, h: Held) -> Chain | None:
        """The chain h's dump may be an increment over (its last image, `_image`); None: whole.
        Taken, not read: should this dump fail, the next is whole. Called under the lock."""
        c = self._chains.pop((h.group, h.job), None)
        if c is None or not self._goes_on(c, h.incarnation):
            return None
        return c if (self._image(h, c.epoch) / MANIFEST).is_file() else None

    def _image(self, h: Held, epoch: int) -> Path:
        return self._image_of(h.group, epoch, h.job)

    def _image_of(self, group: str, epoch: int, job: str) -> Path:
        return self.root / group / str(epoch) / job

    def release(self, group: str, epoch: int) -> list[Held]:
        """Let the round's members go on; answer once they do (their digests come after).
        Refused (after releasing) if any already went on by itself or could not be put back,
        since then the round is no consistent cut."""
        helds = self._round(group, epoch)
        self._release(helds, wait=lambda h: h.going)
        if bad := [h for h in helds if h.state is HeldState.EXPIRED or h.error]:
            why = bad[0].error or "it went on by itself after [snapshots] hold_s, before the release"
            raise RefusedError(
                f"round {epoch} of group {group} is not a consistent cut: job {bad[0].job}: {why}",
                step="snapshot release",
                node=self.node,
            )
        return helds

    def _release(self, helds: list[Held], wait: Callable[[Held], threading.Event] = lambda h: h.done) -> None:
        with self._lock:
            for h in helds:
                if h.state is HeldState.HELD:
                    self._to(h, HeldState.RELEASED)
                h.released_at = time.monotonic()
                h.go.set()
        for h in helds:
            if not wait(h).wait(RESUME_WAIT_S):
                h.error = h.error or f"it was not going again {RESUME_WAIT_S:g} s after its release"

    def ship(self, group: str, epoch: int, buddy: str) -> list[Held]:
        """Send each released member's image to `buddy`; done once the buddy has verified it."""
        helds = self._round(group, epoch)
        for h in helds:
            h.done.wait(RESUME_WAIT_S)  # its digests, computed once it went on
            if h.error:
                raise RefusedError(
                    f"job {h.job}'s image of round {epoch} is incomplete: {h.error}",
                    step="snapshot ship",
                    node=self.node,
                )
            if h.state is not HeldState.RELEASED:
                raise RefusedError(
                    f"job {h.job}'s image of round {epoch} is {h.state.value}, not released: it cannot ship",
                    step="snapshot ship",
                    node=self.node,
                )
            faults.check("snapshot-shipping", self.node)  # a test's window: released, not yet shipped
            try:
                with in_background():
                    try:
                        stored = self._push_chain(h, buddy, self._unshipped(h, buddy), self._base(h, buddy))
                    except NotFoundError:  # the buddy lacks a link or the base it had: the whole chain
                        stored = self._push_chain(h, buddy, links(h.out_dir), None)
            except Exception as e:
                with self._lock:
                    self._to(h, HeldState.FAILED)
                    self._shipped.pop((h.group, h.job), None)
                raise as_ferry_error(e, "snapshot ship", self.node) from e
            with self._lock:
                self._shipped[(h.group, h.job)] = (buddy, h.epoch)
            h.buddy_node, h.dir = stored.node_name, stored.dir
            with self._lock:
                self._to(h, HeldState.SHIPPED)
        return helds

    def _unshipped(self, h: Held, buddy: str) -> list[Path]:
        """The links of h's chain that `buddy` has not verified yet, oldest first."""
        with self._lock:
            to, epoch = self._shipped.get((h.group, h.job), ("", 0))
        return unshipped(links(h.out_dir), epoch if to == buddy else 0)

    def _base(self, h: Held, buddy: str) -> Path | None:
        """h's image of the last round `buddy` verified, when both are whole and it is still here:
        the new one then goes as what changed since (agent.migration.delta)."""
        with self._lock:
            to, epoch = self._shipped.get((h.group, h.job), ("", 0))
        base = self.root / h.group / str(epoch) / h.job
        whole = parent_epoch(h.out_dir) == 0
        if to != buddy or epoch == h.epoch or not whole or not (base / MANIFEST).is_file():
            return None
        return base if parent_epoch(base) == 0 else None

    def _push_chain(self, h: Held, buddy: str, chain: list[Path], base: Path | None) -> pb.StoredSnapshot:
        stored = pb.StoredSnapshot()
        for d in chain:
            stored = self.push(buddy, self._chunks(h, d, base if d == h.out_dir else None))
        return stored

    def _chunks(self, h: Held, image: Path, base: Path | None = None) -> Iterator[pb.ImageChunk]:
        m = read_manifest(image)
        digests = {f.name: f.sha256 for f in m.files}

        def same(entries: list) -> Manifest:
            if {e.name: e.sha256 for e in entries} != digests:
                raise FerryError(
                    f"job {h.job}'s image {image} changed on this node after its dump", step="snapshot ship"
                )
            return m

        key = pb.SnapshotKey(
            group=h.group,
            epoch=int(image.parent.name),
            job=h.job,
            parent_epoch=parent_epoch(image),
            base_epoch=int(base.parent.name) if base is not None else 0,
        )
        first = True
        for chunk in send_image("", image, same, SendStats(), digests=digests, base_dir=base):
            if first:
                chunk.snapshot.CopyFrom(key)
                first = False
            yield chunk

    def drop(self, group: str, keep: int) -> None:
        """Forget every round of `group` but round `keep`, and their images here (those a restarted
        agent left too); a round whose digests are still being computed goes once they are. A
        member a dropped round holds goes on now (EXPIRED): forgotten, no RELEASE or rollback
        could find it, and it stayed frozen until hold_s (a recovery refused for 8 s)."""
        with self._lock:
            pending = set()
            gdir = self.root / group
            kept = chain_epochs(gdir, keep)  # the round kept, and those its increments read
            for (g, _), hs in self._held.items():  # and those a dump in progress reads
                kept.update(*(chain_epochs(gdir, h.parent) for h in hs if g == group and not h.done.is_set()))
            # And an image adopted as a member's last dump (a move's, a restore's: no round of
            # this node's dumped it), which its next dump goes over: a round that failed after
            # the move dropped it, and the next was whole.
            for (g, _), c in self._chains.items():
                if g == group and (group, c.epoch) not in self._held:
                    kept.update(chain_epochs(gdir, c.epoch))
            for key in [k for k in self._held if k[0] == group and k[1] not in kept]:
                for h in self._held.pop(key):
                    h.dropped = True
                    if h.done.is_set():
                        shutil.rmtree(h.out_dir, ignore_errors=True)
                        continue
                    pending.add(h.epoch)
                    if h.state is HeldState.HELD:
                        self._to(h, HeldState.EXPIRED)
                        log.warning("snapshot: job %s goes on: its round %d was dropped", h.job, h.epoch)
                    h.go.set()
            busy = pending | {k[1] for k in self._held if k[0] == group}
            busy |= kept
            for d in gdir.iterdir() if gdir.is_dir() else []:
                if d.name.isdigit() and int(d.name) not in busy:
                    shutil.rmtree(d, ignore_errors=True)

    def abandon(self, group: str) -> list[str]:
        """A rollback or a recovery begins: every member held for a round of `group` goes on now,
        its image no part of any snapshot (EXPIRED: it never ships); the jobs."""
        with self._lock:
            helds = [h for (g, _), hs in self._held.items() if g == group for h in hs if not h.done.is_set()]
            for h in helds:
                if h.state is HeldState.HELD:
                    self._to(h, HeldState.EXPIRED)
                h.go.set()
        for h in helds:
            h.done.wait(RESUME_WAIT_S)
        return [h.job for h in helds]

    def _round(self, group: str, epoch: int) -> list[Held]:
        with self._lock:
            helds = self._held.get((group, epoch))
        if helds is None:
            raise NotFoundError(f"no round {epoch} of group {group} on this node", node=self.node)
        return helds


def world_of(rec: JobRecord) -> int:
    world = env_of(rec).get("WORLD_SIZE", "")
    return int(world) if world.isdigit() else 0
