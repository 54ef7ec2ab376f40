"""The executor of the target's effects: what a transition of the table (agent.migration.
target_table) leaves to do, run after its lock is let go.

Killing a page server (up to 40 s), removing staging, `ip link del`, the registry and SIGKILL
all happen here, never under the table's lock, so GetMigration answers while they run. A drop
or an unwinding is three steps: journal DROPPING or UNWINDING under the lock (from then on no
one restores or releases it), run the effects outside, journal ABORTED under the lock (the
source may resume its copy on that, so it comes only once nothing of the migration is left).

An Abort does not wait for the second step (`finish_later`): DROPPING, durable before it
answers, is as good as fenced, and a page server may take longer to die than the source waits
for its answer. Such an end runs on a thread named after its migration, counted here until it
is over, so a stopping agent waits for it; one the agent did not live to finish stays DROPPING
on disk, and recovery at the next start removes its staging and journals ABORTED.
"""

from __future__ import annotations

import logging
import shutil
import signal
import threading
from collections.abc import Callable, Iterable

from agent import faults
from agent.criu.logs import CriuLogs
from agent.errors import NotFoundError
from agent.jobs import procs
from agent.jobs.record import JobState
from agent.jobs.registry import JobRegistry
from agent.migration.target_table import (
    CloseKeys,
    DropLogs,
    Effect,
    Ended,
    EndJob,
    Incoming,
    IncomingTable,
    RemoveStaging,
    StopStream,
)

log = logging.getLogger(__name__)


class TargetEffects:
    """Runs effects in order; one that fails is logged and the rest still run (each is only
    cleanup that a restart redoes, except EndJob: while the copy here may still run, the
    migration is not said ABORTED, on which the source would resume its own)."""

    def __init__(
        self,
        table: IncomingTable,
        registry: JobRegistry,
        criu_logs: CriuLogs,
        on_end: Callable[[str], None],
    ) -> None:
        self.table = table
        self.registry = registry
        self.criu_logs = criu_logs
        self.on_end = on_end
        #: Ends running on their own threads (finish_later), by migration id.
        self._background: dict[str, threading.Thread] = {}
        self._background_changed = threading.Condition()

    def run(self, effects: Iterable[Effect]) -> list[Effect]:
        """Every effect, in order; returns those that failed."""
        failed = []
        for effect in effects:
            try:
                self._run(effect)
            except Exception:
                log.exception("could not %s", effect)
                failed.append(effect)
        return failed

    def drop(self, inc: Incoming, why: str) -> bool:
        """Drop a migration that has not begun its restore; False if it was already ending."""
        with self.table.lock:
            effects = self.table.drop_locked(inc, why)
        return self.finish(inc, effects)

    def unwind(self, inc: Incoming, why: str) -> None:
        """End a migration whose restore began, as the owner of its unwinding (table.unwind_locked)."""
        with self.table.lock:
            effects = self.table.unwind_locked(inc, why)
        self.finish(inc, effects)

    def finish(self, inc: Incoming, effects: list[Effect] | None) -> bool:
        """Run a drop's or an unwinding's effects, then journal ABORTED."""
        if effects is None:
            log.info("migration %s: already ending (%s)", inc.migration_id, inc.note)
            return False
        if any(isinstance(e, EndJob) for e in self.run(effects)):
            # Fail closed: it stays UNWINDING (read as RESTORING), so its source holds its copy;
            # the agent's restart kills what is left, or an operator settles it.
            log.error(
                "migration %s: its copy here could not be ended; it stays %s until the agent restarts",
                inc.migration_id,
                inc.state.value,
            )
            return True
        with self.table.lock:
            last = self.table.aborted_locked(inc)
        log.info("migration %s: dropped (%s)", inc.migration_id, inc.note)
        self.run(last)
        return True

    def finish_later(self, inc: Incoming, effects: list[Effect] | None, wait_s: float = 0.0) -> bool:
        """`finish` on a thread of its own, for a caller that answers once the DROPPING (or
        UNWINDING) it journaled is durable. Waits up to `wait_s` for it (a usual end takes
        milliseconds, and is then over when the caller answers); True if it ended meanwhile."""
        if effects is None:
            return self.finish(inc, None)
        mid = inc.migration_id

        def run() -> None:
            try:
                self.finish(inc, effects)
            except Exception:  # a journal write failed: it stays as journaled; recovery ends it
                log.exception("migration %s: its end failed; the agent's next start finishes it", mid)
            finally:
                with self._background_changed:
                    self._background.pop(mid, None)
                    self._background_changed.notify_all()

        thread = threading.Thread(target=run, name=f"end {mid}", daemon=True)
        with self._background_changed:
            self._background[mid] = thread  # one per migration: only its first end has effects
        try:
            thread.start()
        except RuntimeError:  # no thread to be had: end it here, as before
            with self._background_changed:
                self._background.pop(mid, None)
            return self.finish(inc, effects)
        thread.join(wait_s)
        return not thread.is_alive()

    def background(self) -> list[str]:
        """The migrations whose end still runs on its own thread."""
        with self._background_changed:
            return sorted(self._background)

    def wait_background(self, timeout_s: float | None) -> bool:
        """Wait for every end running on its own thread; False if some still run."""
        with self._background_changed:
            return self._background_changed.wait_for(lambda: not self._background, timeout_s)

    def _run(self, effect: Effect) -> None:
        if isinstance(effect, StopStream):
            faults.check("target-stop-stream")  # tests: a page server slow to die
            effect.stream.kill()
        elif isinstance(effect, CloseKeys):
            effect.keys.close()
        elif isinstance(effect, RemoveStaging):
            shutil.rmtree(effect.path, ignore_errors=True)
        elif isinstance(effect, DropLogs):
            self.criu_logs.done(effect.migration_id)
        elif isinstance(effect, EndJob):
            self._end_job(effect)
        elif isinstance(effect, Ended):
            self.on_end(effect.result)
        else:
            raise TypeError(f"not an effect: {effect!r}")

    def _end_job(self, e: EndJob) -> None:
        """The job's missing pages will never come: it must not run on (they would read as
        zeros), and the source resumes its own copy once this is done."""
        try:
            job = self.registry.get(e.job)
        except NotFoundError:
            return
        if not job.state.active:  # it ended here already: read a page that never came, and crashed
            if job.state is not JobState.EXITED or job.exit_code == 0:
                return  # stopped by hand, or it finished: every page it read had come
            job = self.registry.update(  # not the job's own end: the move's failure
                e.job,
                state=JobState.LOST,
                note=f"post-copy from {e.source_node} failed ({e.why}); its copy here had crashed on "
                f"a page that never came (exit status {job.exit_code})",
            )
            self.registry.on_post_copy_lost(job, e.source_node)
            return
        # Recorded first, so the job's end reads as this loss, not as an exit.
        self.registry.update(
            e.job,
            state=JobState.LOST,
            note=f"post-copy from {e.source_node} failed ({e.why}); killed here, "
            "the source resumes its frozen copy",
        )
        if job.veth and self.registry.network is not None:
            # Its link first: killed, it would close the job's TCP connections (FIN/RST from the
            # job's address) under the source's copy.
            self.registry.network.delete(job.veth)
        if procs.alive(job.pid, job.pid_started):
            procs.signal_all(procs.tree_pids(job.pid), signal.SIGKILL)
        self.registry.on_post_copy_lost(self.registry.get(e.job), e.source_node)
