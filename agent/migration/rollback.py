"""The two ways a frozen copy of a job ends: it resumes here, or it goes because another copy runs.

Every move that freezes a job ends in one of these, and only here: a source's abort, a
local checkpoint that failed (or was asked to leave the job running), and recovery after a
crash or a silent target (agent.migration.recovery). Resuming undoes the freeze in the
reverse order it was applied: TCP sockets out of repair mode, the job's link back on its
bridge, SIGCONT (the CUDA driver's restore thread must run), then the one CUDA undo
(agent.cuda.driver.undo) for as far as the freeze got.

A group member goes on only if its node's lease lasted from its freeze to now
(`registry.may_go_on`): fencing stops running members only, so a member frozen while its node
lost etcd would otherwise run beside the copy a recovery started elsewhere. Refused, it stays
stopped and cut off, FENCED, and etcd settles it like any fenced member (docs/recovery.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from agent.criu import tcp_repair
from agent.cuda import driver as cuda
from agent.errors import FerryError
from agent.jobs import procs
from agent.jobs.network import LinkLock
from agent.jobs.record import JobRecord, JobState
from agent.jobs.registry import JobRegistry
from agent.jobs.threadhold import held
from agent.migration.states import CudaLeft

log = logging.getLogger(__name__)


@dataclass
class FrozenCopy:
    """A job's copy as a move left it here."""

    rec: JobRecord  # the job's record when the move began
    pids: list[int]  # its dumped (stopped) tree; [] if no dump stopped it
    link: LinkLock  # its link, cut for the move (or a no-op for a job on the node's network)
    cuda_pids: list[int] = field(default_factory=list)
    cuda_left: CudaLeft = CudaLeft.NONE  # how far its CUDA freeze got (and was not undone)
    #: Monotonic, at or before its freeze (0.0: unknown, as after a restart): a group member
    #: goes on only if its node's lease was granted no later (agent.coord.liveness).
    since: float = 0.0


#: What a frozen copy that stayed fenced waits for (the error's hint).
FENCED_HINT = (
    "etcd settles it once this node has a lease again: it runs on here if its key in etcd still "
    "names this node, and ends without running if a recovery started it elsewhere (`ferry ps`)"
)


@dataclass(frozen=True)
class Resumed:
    running: bool  # the job's process is alive after the resume
    undone: cuda.UndoReport  # what of the CUDA freeze could not be undone (falsy: all of it was)
    problems: tuple[str, ...] = ()  # what else could not be put back (its link, say)
    fenced: str = ""  # why it stays frozen, fenced, instead of going on ("": it went on)
    continued_at: float = 0.0  # monotonic: when it went on, CUDA unlocked (0: it did not)

    def summary(self) -> str:
        """ "" when all went back; else what did not, for the job's note and the error."""
        parts = [f"it stays frozen, fenced: {self.fenced}"] if self.fenced else []
        parts += list(self.problems) + ([self.undone.summary()] if self.undone else [])
        return "; ".join(parts)


def undo_cuda(driver: cuda.CudaDriver, pids: list[int], left: CudaLeft) -> cuda.UndoReport:
    """The CUDA part of a resume, from what the journal says the freeze did. Where that undo
    fails (an earlier resume got part-way: a process already restored, say), each process's
    state is read from the driver and the undo tried once more from there."""
    if left is CudaLeft.NONE or not pids:
        return cuda.UndoReport()
    if left is CudaLeft.PARTLY:  # a call was under way: only get-state knows each process's state
        return cuda.undo(driver, pids)
    state = cuda.ProcessState.LOCKED if left is CudaLeft.LOCKED else cuda.ProcessState.CHECKPOINTED
    report = cuda.undo(driver, pids, dict.fromkeys(pids, state))
    return cuda.undo(driver, pids) if report else report


def resume(
    registry: JobRegistry,
    driver: cuda.CudaDriver,
    copy: FrozenCopy,
    note: Callable[[Resumed], str],
    *,
    gone: JobState = JobState.EXITED,
    cuda_back: Callable[[], None] = lambda: None,
) -> Resumed:
    """Let the frozen copy go on here; its record becomes RUNNING (or `gone` if its process
    ended meanwhile) with the note `note(outcome)`. `cuda_back` runs once its CUDA state is
    wholly back (the GPUs its freeze kept are then its own again). Never raises for what it
    could not put back: that is in the outcome and the note."""
    if copy.rec.group and copy.pids and (why := registry.may_go_on(copy.rec, copy.since)):
        return _stay_fenced(registry, driver, copy, note, why, cuda_back)
    problems: list[str] = []
    tcp_repair.release(copy.pids)
    try:
        copy.link.release()
    except FerryError as e:
        problems.append(f"its link could not be put back on the bridge ({e.cause})")
        log.error("job %s: cannot put its link back: %s", copy.rec.name, e)
    procs.resume(copy.pids)  # before the CUDA undo: the driver's restore thread must run
    undone = undo_cuda(driver, copy.cuda_pids, copy.cuda_left)
    continued_at = time.monotonic()  # a CUDA job's kernels wait for the undo's unlock
    if not problems and copy.rec.address and registry.network is not None:
        # A target keeps its restored copy off its bridge (restore_tree), but one of an older
        # ferry put it there with the job's MAC, and the segment may have learnt that port:
        # without a word from here, the peers' frames would go there until the switch forgets
        # it (minutes), if this copy only waits to receive. Said once the job runs: its two
        # requests, 50 ms apart, are no part of its pause.
        registry.network.announce(copy.rec.pid, copy.rec.address)
    if not undone:
        cuda_back()
    out = Resumed(
        procs.alive(copy.rec.pid, copy.rec.pid_started), undone, tuple(problems), continued_at=continued_at
    )
    current = registry.get(copy.rec.name).state
    # Its process gone, a record that already says how the job ended keeps that.
    state = JobState.RUNNING if out.running else gone if current.active else current
    registry.update(copy.rec.name, state=state, migration_id="", note=note(out))
    return out


def _stay_fenced(
    registry: JobRegistry,
    driver: cuda.CudaDriver,
    copy: FrozenCopy,
    note: Callable[[Resumed], str],
    why: str,
    cuda_back: Callable[[], None],
) -> Resumed:
    """The frozen member stays stopped and off its bridge, recorded FENCED (as `fence.hold` would
    leave it), so that etcd's word alone lets it run (`fence.unfence`: reconnect, SIGCONT). Its
    CUDA state comes back now, with every thread but the driver's restore thread held: an
    unfenced job must find its GPUs as it left them, and not one job instruction runs here."""
    tcp_repair.release(copy.pids)  # nothing leaves: its link stays off the bridge
    copy.link.keep_cut()
    undone = cuda.UndoReport()
    if copy.cuda_left is not CudaLeft.NONE and copy.cuda_pids:
        try:
            with held(copy.cuda_pids, {driver.restore_thread(pid) for pid in copy.cuda_pids}):
                undone = undo_cuda(driver, copy.cuda_pids, copy.cuda_left)
        except (FerryError, OSError) as e:  # it stays frozen either way; the note says what is left
            log.error("job %s: fenced, but its CUDA state could not be brought back: %s", copy.rec.name, e)
            undone = cuda.UndoReport(failures=(f"the CUDA undo under a thread hold failed: {e}",))
        if not undone:
            cuda_back()
    out = Resumed(procs.alive(copy.rec.pid, copy.rec.pid_started), undone, fenced=why)
    current = registry.get(copy.rec.name).state
    state = JobState.FENCED if out.running else JobState.EXITED if current.active else current
    registry.update(copy.rec.name, state=state, migration_id="", note=note(out))
    log.warning("job %s: stays frozen, fenced: %s", copy.rec.name, why)
    return out


def finish(
    registry: JobRegistry,
    copy: FrozenCopy,
    state: JobState,
    note: str,
    *,
    cuda_gone: Callable[[], None] = lambda: None,
    **changes: object,
) -> None:
    """Another copy runs (MOVED) or the image holds the job (CHECKPOINTED): the frozen tree
    is killed, its link deleted, and the GPUs its freeze kept are nobody's any more."""
    if copy.pids:  # the stopped tree as dumped; a launched job's PID 1 takes its namespace along
        registry.kill_tree(copy.rec, copy.pids)
    copy.link.drop()
    cuda_gone()
    registry.update(copy.rec.name, state=state, migration_id="", note=note, **changes)
