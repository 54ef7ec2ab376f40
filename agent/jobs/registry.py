"""The job registry: launch, adopt, track, stop; records persist in the state dir.

A job is a process tree. A launched job runs under ferry-init as PID 1 of its
own PID namespace; an adopted one keeps its host PIDs. Every record lives in
``<state>/jobs/<name>/job.json`` beside the job's stdout and stderr files, so
it survives an agent restart.

Why one module: the registry is one table of records under one lock, and launch, adopt,
the restored job's registration, stop and the watchers all change it there; what a launch
needs around ferry-init is in jobs/launch.py, the record itself in jobs/record.py.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from agent import config
from agent.durable import replace_file
from agent.errors import (
    AlreadyExistsError,
    FerryError,
    InvalidArgumentError,
    JobBusyError,
    NotFoundError,
    RefusedError,
)
from agent.image import JobSpec
from agent.jobs import procs
from agent.jobs.launch import (
    check_cwd,
    end_unstarted,
    exit_words,
    fd_path,
    find_command,
    refuse_hidden,
    tail,
    tmp_keeps,
    wait_for_child,
)
from agent.jobs.network import JobNetwork, veth_name
from agent.jobs.record import (
    JOB_TRANSITIONS,
    JobKind,
    JobRecord,
    JobState,
    OnDegraded,
    Priority,
    check_group_name,
    check_job_name,
)

log = logging.getLogger(__name__)

#: What a job MIGRATING under a local operation's id is doing, and when to ask again.
_BUSY = {
    "snapshot": (
        "held for a group snapshot round",
        "ask again in a few seconds: a round holds it at most [snapshots] hold_s",
    ),
    "checkpoint": ("being checkpointed", "wait for the checkpoint to finish"),
    "suspend": ("being suspended for a preemption", "wait for the suspend to finish"),
}

#: How long ferry-init may take to set up the job's namespaces.
START_TIMEOUT_S = 10.0
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: A torn record's GPU list, as JobRecord.to_json writes it.
_GPUS = re.compile(r'"gpus":\s*\[([^\]]*)\]')


@dataclass(frozen=True)
class UnreadableRecord:
    """A job record that could not be read at start. It may stand for a job that still runs, so
    it fails closed: its name stays taken, and so do its GPUs (`gpus` None: which ones cannot be
    told, and no GPU is given out until the record is repaired or removed)."""

    name: str
    path: Path
    cause: str
    gpus: tuple[str, ...] | None

    def refusal(self) -> str:
        return f"job {self.name!r} has an unreadable record here ({self.path}: {self.cause})"

    @property
    def hint(self) -> str:
        return (
            "its job may still run: check for its processes, then repair the file or move its "
            f"directory {self.path.parent} away, and restart the agent"
        )


def _gpus_of(raw: str) -> tuple[str, ...] | None:
    """The GPUs an unreadable record names, read as far as its text allows; None if it cannot say."""
    try:
        d = json.loads(raw)
    except ValueError:
        m = _GPUS.search(raw)
        if m is None:
            return None
        try:
            d = {"gpus": json.loads(f"[{m.group(1)}]")}
        except ValueError:
            return None
    if not isinstance(d, dict):
        return None
    gpus = d.get("gpus", [])  # a record from before `--gpu` existed holds none
    if not isinstance(gpus, list) or not all(isinstance(u, str) for u in gpus):
        return None
    return tuple(gpus)


def _forget_hint(rec: JobRecord) -> str:
    """What to do before `ferry forget` of a job that still holds its name."""
    if rec.state is JobState.MIGRATING:  # a stop now is remembered, and carried out when it settles
        return (
            f"wait until its move settles (`ferry ps`), or `ferry stop {rec.name}`, which takes effect "
            "then; forget it once it has ended"
        )
    return f"`ferry stop {rec.name}` first"


class JobRegistry:
    """All jobs of this node. Thread-safe; every change is written through to disk."""

    def __init__(
        self,
        state_dir: Path,
        node: str,
        init_binary: str | None = None,
        network: JobNetwork | None = None,
    ) -> None:
        self.root = state_dir / "jobs"
        self.root.mkdir(parents=True, exist_ok=True)
        self.node = node
        self._init_binary = init_binary
        #: The job network this node's jobs get their address on (None: they share the node's).
        self.network = network if network is not None and network.enabled else None
        self._lock = threading.RLock()
        #: Held across a read and its change by those who act on the record (agent.jobs.fence).
        self.lock = self._lock
        self._jobs: dict[str, JobRecord] = {}
        #: Records that could not be read at start, by job name: never "no job" (see _load).
        self.unreadable: dict[str, UnreadableRecord] = {}
        #: Called with a restored job's record while it is still held: its PID 1's fencing
        #: watchdog hears from this node first (agent.service.node), not the restored clock.
        self.on_restored: Callable[[JobRecord], None] = lambda rec: None
        #: (a frozen copy's record, a monotonic time at or before its freeze) → "" if it may go on
        #: here, else why not: a group member goes on only if this node's lease lasted from
        #: then to now (agent.coord.liveness installs it; without one, every copy may).
        self.may_go_on: Callable[[JobRecord, float], str] = lambda rec, since: ""
        #: (the record of a job killed here because its post-copy failed, the source's node):
        #: a group member's key goes back to the source (agent.coord.liveness installs it).
        self.on_post_copy_lost: Callable[[JobRecord, str], None] = lambda rec, source_node: None
        self._load()

    # -- queries ----------------------------------------------------------------

    def get(self, name: str) -> JobRecord:
        with self._lock:
            rec = self._jobs.get(name)
            if rec is None:
                raise NotFoundError(
                    f"no job named {name!r} on this node", node=self.node, hint="see `ferry ps`"
                )
            return rec

    def list(self) -> list[JobRecord]:
        with self._lock:
            return sorted(self._jobs.values(), key=lambda r: r.started_at)

    def job_dir(self, name: str) -> Path:
        return self.root / check_job_name(name)

    # -- changes ----------------------------------------------------------------

    def save(self, rec: JobRecord) -> None:
        with self._lock:
            rec.updated_at = time.time()
            self._jobs[rec.name] = rec
            d = self.job_dir(rec.name)
            d.mkdir(parents=True, exist_ok=True)
            replace_file(d / "job.json", rec.to_json().encode())

    def update(self, name: str, **changes: object) -> JobRecord:
        """Change a record; a new `state` must be a transition of JOB_TRANSITIONS. A job whose
        stop was asked for during a move is stopped as soon as the move leaves it here."""
        with self._lock:
            rec = self.get(name)
            was = rec.state
            if (new := changes.get("state")) is not None and new is not rec.state:
                assert isinstance(new, JobState)
                JOB_TRANSITIONS.check(rec.state, new, name)
            for k, v in changes.items():
                setattr(rec, k, v)
            self.save(rec)
        landed = rec.state in (JobState.RUNNING, JobState.PREEMPTED)
        if rec.stop_grace_s and was is JobState.MIGRATING and landed:
            try:
                self.stop_later(name, rec.stop_grace_s)
            except FerryError as e:  # it ended meanwhile: the change above stands, nothing to stop
                log.info("job %s: the stop asked for during its move was not needed: %s", name, e)
        return rec

    def reserve_name(self, name: str, resuming: bool = False) -> None:
        """Refuse a name an active or preempted job holds; a final job's name may be reused.

        resuming: the preempted job of that name itself is coming back.
        """
        check_job_name(name)
        with self._lock:
            if (bad := self.unreadable.get(name)) is not None:
                raise AlreadyExistsError(bad.refusal(), node=self.node, hint=bad.hint)
            rec = self._jobs.get(name)
            if (
                rec is not None
                and rec.state.holds_name
                and not (resuming and rec.state is JobState.PREEMPTED)
            ):
                raise AlreadyExistsError(
                    f"job {name!r} already exists here and is {rec.state.value}",
                    node=self.node,
                    hint="pick another --name, or stop it first",
                )

    def launch(
        self,
        name: str,
        command: list[str],
        cwd: str,
        env: list[str],
        *,
        priority: str = Priority.NORMAL.value,
        on_degraded: str = OnDegraded.MIGRATE.value,
        gpus: list[str] | None = None,
        gpu_chip: str = "",
        group: str = "",
        max_pause_s: float = 0.0,
    ) -> JobRecord:
        """Start a job. `gpus` (checked by the caller) become its CUDA_VISIBLE_DEVICES; `group`
        names the training job it is one member of."""
        check_group_name(group)
        if not 0 <= max_pause_s <= 86400:  # NaN fails this too
            raise InvalidArgumentError(f"invalid --max-pause {max_pause_s}: expected 0 to 86400 seconds")
        if not command:
            raise InvalidArgumentError(
                "no command given", hint="usage: ferry run --name NAME -- CMD [ARGS...]"
            )
        if not os.path.isabs(cwd):
            raise InvalidArgumentError(f"working directory {cwd!r} must be an absolute path")
        if any("\0" in s for s in [cwd, *command, *env]):
            raise InvalidArgumentError("command, environment and cwd may not contain null (NUL) bytes")
        check_cwd(cwd, self.node)
        # The agent's own settings (fault injection in tests, TLS paths) are not the job's business.
        job_env = {k: v for k, v in os.environ.items() if not k.startswith("FERRY_")}
        for item in env:
            key, sep, value = item.partition("=")
            if not sep or not _ENV_KEY.match(key):
                raise InvalidArgumentError(f"invalid --env {item!r}: expected KEY=VALUE")
            job_env[key] = value
        if gpus:
            job_env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        init = self._init_binary or config.init_binary()
        refuse_hidden(cwd, "working directory", self.node)
        program = find_command(command[0], cwd, job_env, self.node)
        with self._lock:
            self.reserve_name(name)
            d = self.job_dir(name)
            d.mkdir(parents=True, exist_ok=True)
            out_path, err_path = d / "stdout.log", d / "stderr.log"
            out_path.write_bytes(b"")
            err_path.write_bytes(b"")
            ours, theirs = socket.socketpair()
            keep = tmp_keeps([cwd, init, program, *command[1:]])
            args = [init, "--private", *(["--netns"] if self.network else [])]
            args += [a for k in keep for a in ("--keep", k)]
            args += ["--logs", str(d)]
            args += ["--sync-fd", str(theirs.fileno()), "--no-io-uring", "--", *command]
            with open(out_path, "ab") as out, open(err_path, "ab") as err:
                try:
                    outer = subprocess.Popen(
                        args,
                        cwd=cwd,
                        env=job_env,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=err,
                        start_new_session=True,
                        pass_fds=[theirs.fileno()],
                    )
                except OSError as e:
                    ours.close()
                    raise RefusedError(
                        f"cannot start {init}: {e.strerror}", step="run", node=self.node
                    ) from e
                finally:
                    theirs.close()
            try:
                pid1, address, veth = self._set_up(outer, ours, name, err_path)
            finally:
                ours.close()
            rec = JobRecord(
                name=name,
                kind=JobKind.LAUNCHED,
                state=JobState.RUNNING,
                pid=pid1,
                pid_started=procs.create_time(pid1),
                command=list(command),
                cwd=cwd,
                env=list(env),
                stdout_path=str(out_path),
                stderr_path=str(err_path),
                priority=priority,
                on_degraded=on_degraded,
                gpus=list(gpus or []),
                gpu_chip=gpu_chip,
                group=group,
                max_pause_s=max_pause_s,
                private=True,
                address=address,
                veth=veth,
            )
            self.save(rec)
        log.info("job %s: launched pid %d: %s", name, pid1, " ".join(command))
        self._watch(rec, lambda: outer.wait())
        return rec

    def _set_up(
        self, outer: subprocess.Popen[bytes], sync: socket.socket, name: str, err_path: Path
    ) -> tuple[int, str, str]:
        """ferry-init's handshake: once its namespaces exist, plumb the job's link (when this
        node has a job network), then let the job run. Any failure kills it."""
        sync.settimeout(START_TIMEOUT_S)
        try:
            said = sync.makefile("r").readline().strip()
        except OSError:
            said = ""
        pid1 = wait_for_child(outer) if said.startswith("ready") else None
        if pid1 is None:
            end_unstarted(outer)
            raise RefusedError(
                f"job {name!r} failed to start (exit {outer.returncode}): {tail(err_path)}",
                step="run",
                node=self.node,
            )
        address = veth = ""
        try:
            if self.network is not None:
                address = self.network.allocate(self._addresses())
                veth = veth_name(f"{self.node}/{name}/{time.time_ns()}")
                self.network.plumb(pid1, veth, address)
            sync.sendall(b"go\n")
        except FerryError as e:
            end_unstarted(outer)
            raise e.at(step="run", node=self.node) from None
        except OSError as e:
            end_unstarted(outer)
            raise RefusedError(f"job {name!r} could not be released: {e}", step="run", node=self.node) from e
        return pid1, address, veth

    def _addresses(self) -> set[str]:
        """Job-network addresses this node's records hold (a moved job may still use its own)."""
        with self._lock:
            return {r.address for r in self._jobs.values() if r.address and r.state is not JobState.EXITED}

    def adopt(self, name: str, pid: int) -> JobRecord:
        if pid <= 1:
            raise InvalidArgumentError(f"invalid --pid {pid}: must be a process other than init")
        if pid == os.getpid() or pid in {p.pid for p in psutil.Process().parents()}:
            raise InvalidArgumentError(f"--pid {pid} is this agent or one of its parents")
        try:
            proc = psutil.Process(pid)
            cmdline, cwd = proc.cmdline(), proc.cwd()
        except psutil.NoSuchProcess as e:
            raise NotFoundError(f"no process with pid {pid} on this node", node=self.node) from e
        except psutil.AccessDenied as e:
            raise RefusedError(f"cannot inspect pid {pid}: permission denied", node=self.node) from e
        with self._lock:
            self.reserve_name(name)
            for other in self._jobs.values():
                if other.state.active and pid in procs.tree_pids(other.pid):
                    raise AlreadyExistsError(
                        f"pid {pid} already belongs to job {other.name!r}", node=self.node
                    )
            rec = JobRecord(
                name=name,
                kind=JobKind.ADOPTED,
                state=JobState.RUNNING,
                pid=pid,
                pid_started=procs.create_time(pid),
                command=cmdline,
                cwd=cwd,
                stdout_path=fd_path(pid, 1),
                stderr_path=fd_path(pid, 2),
            )
            self.save(rec)
        log.info("job %s: adopted pid %d", name, pid)
        self._watch(rec, None)
        return rec

    def register_restored(
        self, spec: JobSpec, pid: int, stdout: str, stderr: str, *, resuming: bool = False, **extra: object
    ) -> JobRecord:
        """Record a tree CRIU just restored as our child (rst_sibling). The name was reserved
        before CRIU ran, but not held: a job that took it meanwhile keeps it, and this refuses
        (AlreadyExistsError), so the caller kills the restored tree. resuming: as reserve_name."""
        rec = JobRecord.from_spec(spec, pid, procs.create_time(pid), stdout, stderr)
        for k, v in extra.items():
            setattr(rec, k, v)
        with self._lock:
            self.reserve_name(rec.name, resuming=resuming)
            self.save(rec)
        self._watch(rec, lambda: os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        self.on_restored(rec)
        return rec

    def begin_move(self, name: str, migration_id: str, what: str) -> JobRecord:
        """Single flight: only a RUNNING job may start moving."""
        with self._lock:
            rec = self.get(name)
            if rec.state is JobState.MIGRATING:
                kind = rec.migration_id.partition("-")[0]  # a local operation's id names its kind
                doing, hint = _BUSY.get(kind, ("already being moved", "wait for it to finish"))
                raise JobBusyError(
                    f"job {name!r} is {doing} (migration {rec.migration_id})",
                    step=what,
                    node=self.node,
                    hint=hint,
                )
            if rec.state is not JobState.RUNNING:
                raise RefusedError(
                    f"job {name!r} is {rec.state.value}, not running", step=what, node=self.node
                )
            rec.state = JOB_TRANSITIONS.check(rec.state, JobState.MIGRATING, name)
            rec.migration_id, rec.note = migration_id, f"{what} in progress"
            self.save(rec)
            return rec

    def stop(self, name: str, timeout_s: float = 10.0) -> JobRecord:
        with self._lock:
            rec = self.get(name)
            if rec.state is JobState.PREEMPTED:
                rec.state = JOB_TRANSITIONS.check(rec.state, JobState.STOPPED, name)
                rec.note = f"stopped while preempted; its image stays in {rec.checkpoint_dir}"
                self.save(rec)
                return rec
            if rec.state is JobState.MIGRATING:
                # Remembered, not refused: a scheduler's cancel must not be lost to a move.
                rec.stop_grace_s = timeout_s
                rec.note = f"{rec.note}; stop requested: carried out where the move leaves the job"
                self.save(rec)
                log.info("job %s: stop requested during its move", name)
                return rec
            if rec.state is JobState.FENCED:
                return self._end_fenced(rec, "stopped by `ferry stop` while fenced")
            if rec.state is not JobState.RUNNING:
                raise RefusedError(f"job {name!r} is {rec.state.value}, not running", node=self.node)
            rec.state = JOB_TRANSITIONS.check(rec.state, JobState.STOPPED, name)
            rec.note = "stopped by `ferry stop`"
            rec.stop_grace_s = timeout_s  # a restart during the grace finishes it (_load)
            self.save(rec)
        pids = procs.tree_pids(rec.pid)
        # A launched job's PID 1 forwards SIGTERM to the command; an adopted tree gets it everywhere.
        procs.signal_all(pids[:1] if rec.kind is JobKind.LAUNCHED else pids, signal.SIGTERM)
        _kill_after_grace(rec, timeout_s)
        log.info("job %s: stopped", name)
        return rec

    def _end_fenced(self, rec: JobRecord, why: str, rolled_back_to: int = 0) -> JobRecord:
        """A fenced copy never runs again, not even its SIGTERM handler: its link goes first (a
        killed copy's kernel would close its TCP connections from the job's own address), then
        SIGKILL."""
        rec.state = JOB_TRANSITIONS.check(rec.state, JobState.STOPPED, rec.name)
        rec.note = f"{why}: killed without running again (a fenced copy must not run)"
        rec.rolled_back_to = rolled_back_to
        self.save(rec)
        if self.network is not None and rec.veth:
            self.network.delete(rec.veth)
        procs.signal_all(procs.tree_pids(rec.pid), signal.SIGKILL)
        log.info("job %s: %s", rec.name, rec.note)
        return rec

    def end_fenced(self, name: str, why: str, rolled_back_to: int = 0) -> JobRecord | None:
        """End a fenced copy because another runs, or will: a rollback to snapshot round
        `rolled_back_to` restores it (None if it is not fenced any more)."""
        with self._lock:
            rec = self.get(name)
            return self._end_fenced(rec, why, rolled_back_to) if rec.state is JobState.FENCED else None

    def stop_later(self, name: str, timeout_s: float) -> JobRecord:
        """`stop` on a thread of its own (its grace can be long); returns the record as it is now."""
        rec = self.get(name)
        if not rec.state.active and rec.state is not JobState.PREEMPTED:
            raise RefusedError(f"job {name!r} is {rec.state.value}, not running", node=self.node)

        def run() -> None:
            try:
                self.stop(name, timeout_s)
            except FerryError as e:  # it ended meanwhile, say
                log.info("job %s: the stop asked for during its move was not needed: %s", name, e)

        threading.Thread(target=run, name=f"stop {name}", daemon=True).start()
        return rec

    def forget(self, name: str) -> JobRecord:
        """Drop a final job's record and its directory (its logs): `ferry ps` no longer lists it."""
        with self._lock:
            rec = self.get(name)
            if rec.state.holds_name:
                raise RefusedError(
                    f"job {name!r} is {rec.state.value}; only an ended job's record can be forgotten",
                    node=self.node,
                    hint=_forget_hint(rec),
                )
            del self._jobs[name]
            shutil.rmtree(self.job_dir(name), ignore_errors=True)
        log.info("job %s: record forgotten (it was %s)", name, rec.state.value)
        return rec

    def forget_final(self, name: str) -> None:
        """A job of this name is arriving: an older, final record of it must not answer for it
        (`ferry ps`, `ferry logs`) while it does."""
        with self._lock:
            rec = self._jobs.get(name)
            if rec is not None and not rec.state.holds_name:
                self.forget(name)

    def _finish_stop(self, rec: JobRecord) -> None:
        """SIGKILL what still runs once the stop's grace (from when it was recorded) is over, and
        record the job's end."""
        left = rec.updated_at + (rec.stop_grace_s or 10.0) - time.time()  # the stop began at its save

        def run() -> None:
            killed = _kill_after_grace(rec, left)
            while procs.alive(rec.pid, rec.pid_started):
                time.sleep(0.1)
            # A PID 1 killed with its job writes no status: the SIGKILL is the end, as a shell says.
            code = exit_status(rec)
            self._ended(rec.name, rec.pid, 128 + signal.SIGKILL if code is None and killed else code)

        threading.Thread(target=run, name=f"stop {rec.name}", daemon=True).start()

    def kill_tree(self, rec: JobRecord, pids: list[int]) -> None:
        """SIGKILL a (frozen) tree: PID 1 takes a launched job's namespace with it."""
        procs.signal_all(pids[:1] if rec.kind is JobKind.LAUNCHED else pids, signal.SIGKILL)

    # -- internals --------------------------------------------------------------

    def _load(self) -> None:
        for path in sorted(self.root.glob("*/job.json")):
            raw = ""
            try:
                raw = path.read_text()
                rec = JobRecord.from_json(raw)
            except (OSError, ValueError, TypeError, KeyError) as e:
                # Never "no job": it may still run, on GPUs that no other record names.
                bad = UnreadableRecord(path.parent.name, path, str(e) or type(e).__name__, _gpus_of(raw))
                self.unreadable[bad.name] = bad
                if bad.gpus is None:
                    held = "which GPUs it holds is unknown, so no GPU is given out until it is fixed"
                else:
                    held = f"its GPUs stay taken ({', '.join(bad.gpus) or 'none'})"
                log.error("unreadable job record %s (%s): its name stays taken; %s", path, bad.cause, held)
                continue
            self._jobs[rec.name] = rec
            alive = procs.alive(rec.pid, rec.pid_started)
            if rec.state.active:
                if alive:
                    log.info("job %s: pid %d still runs; watching it again", rec.name, rec.pid)
                    self._watch(rec, None)
                elif rec.state is JobState.RUNNING and (code := exit_status(rec)) is not None:
                    rec.state = JOB_TRANSITIONS.check(rec.state, JobState.EXITED, rec.name)
                    rec.exit_code, rec.note = code, f"{exit_words(code)} while the agent was down"
                    self.save(rec)
                else:
                    rec.state = JOB_TRANSITIONS.check(rec.state, JobState.LOST, rec.name)
                    rec.note = "its process ended while the agent was down"
                    self.save(rec)
            elif rec.state is JobState.STOPPED and alive and rec.exit_code is None:
                # A stop the last run did not live to finish: its grace runs on, then SIGKILL.
                log.info("job %s: its stop was cut short by the agent's restart; finishing it", rec.name)
                self._finish_stop(rec)

    def _watch(self, rec: JobRecord, wait: object) -> None:
        """Record the job's end: by waiting on our child, or by polling a process we did not start
        (then its status is what its PID 1 wrote: `exit_status`)."""
        name, pid, started = rec.name, rec.pid, rec.pid_started
        if callable(wait) and (old := status_file(rec)) is not None:
            old.unlink(missing_ok=True)  # our child: its status comes from waitpid

        def run() -> None:
            code: int | None = None
            if callable(wait):
                try:
                    code = wait()
                except ChildProcessError:  # reaped by another waiter: what its PID 1 wrote, if it did
                    code = exit_status(rec)
            else:
                while procs.alive(pid, started):
                    time.sleep(0.5)
                code = exit_status(rec)
            self._ended(name, pid, code)

        threading.Thread(target=run, name=f"watch-{name}", daemon=True).start()

    def _ended(self, name: str, pid: int, code: int | None) -> None:
        with self._lock:
            rec = self._jobs.get(name)
            if rec is None or rec.pid != pid:
                return  # the name now belongs to a newer job
            rec.exit_code = code
            if rec.state in (JobState.RUNNING, JobState.FENCED):
                rec.state = JOB_TRANSITIONS.check(rec.state, JobState.EXITED, name)
                if code is not None:  # unknown for a process we did not start: keep what the note says
                    rec.note = exit_words(code)
                log.info("job %s: exited (%s)", name, code)
            self.save(rec)


def _kill_after_grace(rec: JobRecord, grace_s: float) -> bool:
    """Wait up to grace_s for the job (SIGTERMed) to end; SIGKILL its tree if it has not. True if
    it had to."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and procs.alive(rec.pid, rec.pid_started):
        time.sleep(0.05)
    if not procs.alive(rec.pid, rec.pid_started):
        return False
    procs.signal_all(procs.tree_pids(rec.pid), signal.SIGKILL)
    return True


#: What a launched job's PID 1 (ferry-init) writes in its log directory when the command ends.
STATUS_FILE = "exit-status"


def status_file(rec: JobRecord) -> Path | None:
    """Where a launched job's PID 1 records its status: its own log directory, the agent's. An
    adopted job has none (its logs sit in the user's directory, which holds the user's files)."""
    if rec.kind is not JobKind.LAUNCHED or not rec.private or not rec.stdout_path:
        return None
    return Path(rec.stdout_path).parent / STATUS_FILE


def exit_status(rec: JobRecord) -> int | None:
    """The status a job's PID 1 recorded (None: none, as for an adopted job or an older init)."""
    if (path := status_file(rec)) is None:
        return None
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None
