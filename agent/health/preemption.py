"""The target side of self-healing: a low-priority job suspended here when a peer needs its
GPUs for a job moving off a bad GPU (Preempt), the freed GPUs kept for that job, and the
suspended job resumed here, oldest first, once a GPU is free again."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from agent.agent_config import AgentConfig
from agent.errors import FerryError, NoFreeGpuError, RefusedError
from agent.gpus.ledger import GpuLedger
from agent.health.events import EventLog
from agent.jobs.record import JobRecord, JobState, Priority
from agent.jobs.registry import JobRegistry
from agent.rpc import pb

log = logging.getLogger(__name__)

#: A preempted job whose resume failed (not merely waited for a GPU) is tried again after this.
RESUME_RETRY_S = 60.0


class Preemptions:
    def __init__(
        self,
        node: str,
        registry: JobRegistry,
        events: EventLog,
        ledger: GpuLedger,
        config: AgentConfig,
        suspend: Callable[[str, Path], None],  # checkpoint semantics: the job ends here, nothing lost
        resume: Callable[[JobRecord], JobRecord],  # its GPUs claimed; NoFreeGpuError while none can
        state_dir: Path,
        gpus_of: Callable[[str], list[str]],  # a job → the GPUs it holds here
        draining: threading.Event,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.node, self.registry, self.events, self.ledger = node, registry, events, ledger
        self.config, self.suspend, self.resume, self.state_dir = config, suspend, resume, state_dir
        self.gpus_of, self.draining, self.clock = gpus_of, draining, clock
        self._resume_failed: dict[str, float] = {}  # job → when its last resume failed

    def preempt(self, req: pb.PreemptRequest) -> pb.PreemptResponse:
        rec = self.registry.get(req.job)
        if rec.priority != Priority.LOW.value:
            raise RefusedError(
                f"job {req.job!r} is {rec.priority} priority; only low-priority jobs are preempted",
                step="preempt",
                node=self.node,
            )
        if rec.state is not JobState.RUNNING:
            raise RefusedError(
                f"job {req.job!r} is {rec.state.value}, not running", step="preempt", node=self.node
            )
        if rec.group and rec.group == req.for_group:
            raise RefusedError(
                f"job {req.job!r} is a member of group {rec.group!r}, as is job {req.for_job!r}: suspending "
                "it would stall the job it is made room for",
                step="preempt",
                node=self.node,
            )
        gpus = self.gpus_of(rec.name)
        out = self.state_dir / "preempted" / f"{rec.name}-{uuid.uuid4().hex[:8]}"
        out.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        hold_s = self.config.policy.preempt_hold_s
        self.ledger.hold_for(gpus, req.for_job, hold_s)  # kept already while the suspend runs ...
        self.suspend(rec.name, out)
        self.ledger.hold_for(gpus, req.for_job, hold_s)  # ... and preempt_hold_s from its end
        note = (
            f"preempted for job {req.for_job} from {req.source_node} ({req.reason}); resumes here by itself "
            f"once a GPU is free (image {out})"
        )
        self.registry.update(rec.name, state=JobState.PREEMPTED, checkpoint_dir=str(out), note=note)
        self.events.record("preempt", f"suspended low-priority job {rec.name} to {out} for job {req.for_job} "
                           f"from {req.source_node}", job=rec.name)  # fmt: skip
        return pb.PreemptResponse(image_dir=str(out), gpus=gpus)

    def resume_preempted(self) -> list[str]:
        """Resume suspended jobs, oldest first, while GPUs can take them; returns those resumed."""
        done: list[str] = []
        if self.draining.is_set():
            return done
        now = self.clock()
        waiting = [r for r in self.registry.list() if r.state is JobState.PREEMPTED]
        for rec in sorted(waiting, key=lambda r: r.updated_at):
            if now - self._resume_failed.get(rec.name, -RESUME_RETRY_S) < RESUME_RETRY_S:
                continue
            try:
                new = self.resume(rec)
            except NoFreeGpuError as e:
                log.debug("job %s stays preempted: %s", rec.name, e)
                continue
            except FerryError as e:
                self._resume_failed[rec.name] = now
                self.events.record(
                    "resume",
                    f"could not resume preempted job {rec.name} (next try in {RESUME_RETRY_S:.0f} s): {e}",
                    job=rec.name,
                )
                continue
            done.append(rec.name)
            where = f" on {', '.join(new.gpus)}" if new.gpus else ""
            self.events.record("resume", f"resumed preempted job {rec.name}{where}", job=rec.name)
        return done
