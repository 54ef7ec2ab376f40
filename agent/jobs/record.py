"""A job's record on this node: its state machine (JobState and its table), kind, policies,
and what persists in ``<state>/jobs/<name>/job.json``."""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field, fields

from agent.compat import StrEnum
from agent.errors import InvalidArgumentError
from agent.image import JobSpec
from agent.statemachine import Transitions


class JobState(StrEnum):
    """One job's record on this node; every change goes through JOB_TRANSITIONS.

    RUNNING → MIGRATING (a move or a checkpoint began: single flight) → RUNNING (aborted,
    refused, or saved and left running) | MOVED (the target runs it) | CHECKPOINTED (saved,
    ended here) | EXITED (it ended during an aborted move) | LOST (a settlement found it gone).
    RUNNING → EXITED (it ended) | STOPPED (`ferry stop`) | LOST (its process vanished while
    the agent was down, or its restore here was cut short / its post-copy failed).
    MIGRATING → LOST: the agent restarted and the process was gone. LOST → MOVED: that copy was
    a migration's frozen source, and the target turned out to run the job. EXITED → LOST: a
    post-copy target's copy that crashed on a page that never came (its source died): the end
    was the move's failure, not the job's own.
    CHECKPOINTED → PREEMPTED: the checkpoint was a preemption's suspend; PREEMPTED →
    STOPPED (`ferry stop` discards it, keeping the image). A preempted job comes back as a
    new RUNNING record that replaces this one (as does any restore of a final job's name);
    RUNNING → PREEMPTED: that resume was cut short by a restart before its commit point (the
    restored copy killed, it waits again on its image).

    RUNNING → FENCED: its node lost etcd, so it is stopped and cut off before its lease can
    expire (agent.coord.liveness); FENCED → RUNNING (etcd answered: no other copy was started)
    | STOPPED (another copy was started elsewhere, or `ferry stop`: killed, never resumed) |
    EXITED | LOST (its process ended). MIGRATING → FENCED: a frozen member whose node's lease
    did not last from its freeze to its resume stays frozen, fenced (agent.migration.rollback).
    Every state but RUNNING, MIGRATING, FENCED and PREEMPTED is final for this node (LOST can
    still be corrected to MOVED, EXITED to LOST); a final job's name may be reused.
    """

    RUNNING = "running"
    MIGRATING = "migrating"
    EXITED = "exited"
    STOPPED = "stopped"
    MOVED = "moved"
    CHECKPOINTED = "checkpointed"
    LOST = "lost"
    PREEMPTED = "preempted"
    FENCED = "fenced"

    @property
    def active(self) -> bool:
        """A process of the job exists on this node."""
        return self in (JobState.RUNNING, JobState.MIGRATING, JobState.FENCED)

    @property
    def holds_name(self) -> bool:
        return self.active or self is JobState.PREEMPTED


_J = JobState

JOB_TRANSITIONS: Transitions[JobState] = Transitions(
    "job",
    {
        _J.RUNNING: frozenset({_J.MIGRATING, _J.EXITED, _J.STOPPED, _J.LOST, _J.PREEMPTED, _J.FENCED}),
        _J.FENCED: frozenset({_J.RUNNING, _J.STOPPED, _J.EXITED, _J.LOST}),
        _J.MIGRATING: frozenset({_J.RUNNING, _J.MOVED, _J.CHECKPOINTED, _J.EXITED, _J.LOST, _J.FENCED}),
        _J.CHECKPOINTED: frozenset({_J.PREEMPTED}),
        _J.PREEMPTED: frozenset({_J.STOPPED}),
        _J.EXITED: frozenset({_J.LOST}),
        _J.STOPPED: frozenset(),
        _J.MOVED: frozenset(),
        _J.LOST: frozenset({_J.MOVED}),
    },
)


class Priority(StrEnum):
    NORMAL = "normal"
    LOW = "low"  # preemptible: suspended to storage when a normal job needs its GPU


class OnDegraded(StrEnum):
    MIGRATE = "migrate"  # move the job off a degrading GPU by itself
    ALERT = "alert"  # only record it (`ferry events`) and leave the job where it is


class JobKind(StrEnum):
    LAUNCHED = "launched"
    ADOPTED = "adopted"


#: The spec's fields a record keeps as they are, both ways; the others say where and how the
#: job runs on one node (its kind as an enum, its pid, its log paths; shell_job is the dump's).
_CARRIED = tuple(
    f.name
    for f in fields(JobSpec)
    if f.name not in ("kind", "pid", "stdout_path", "stderr_path", "shell_job")
)


def _copied(value: object) -> object:
    return list(value) if isinstance(value, list) else value


@dataclass
class JobRecord:
    name: str
    kind: JobKind
    state: JobState
    pid: int
    command: list[str]
    cwd: str
    env: list[str] = field(default_factory=list)
    stdout_path: str = ""
    stderr_path: str = ""
    started_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    pid_started: float = 0.0  # pid's start, seconds since boot (procs.create_time): not a reused PID
    exit_code: int | None = None
    moved_to: str = ""
    moved_to_node: str = ""
    migration_id: str = ""
    checkpoint_dir: str = ""
    note: str = ""
    migrations: int = 0
    priority: str = Priority.NORMAL.value
    on_degraded: str = OnDegraded.MIGRATE.value
    gpus: list[str] = field(default_factory=list)  # given by `ferry run --gpu`: UUIDs on this node
    gpu_chip: str = ""  # their chip, which a target must match
    #: Launched into namespaces of its own (mount, and network with an address): see ferry-init.
    private: bool = False
    address: str = ""  # the job's address on the job network ("" without one)
    group: str = ""  # the training job it is one member of (`ferry run --group`), or ""
    max_pause_s: float = 0.0  # the longest its peers tolerate it frozen (`ferry run --max-pause`)
    veth: str = ""  # the node's end of the job's link, on this node
    #: A stop asked for while it was moving (the grace, seconds; 0: none), carried out where the
    #: move leaves it: here when it resumes (JobRegistry.update), on its target once it runs there
    #: (agent.migration.stops).
    stop_grace_s: float = 0.0
    #: The snapshot round a rollback ended this copy for (0: none): until a copy is restored here,
    #: the rollback's next try (or the recovery that takes it over) knows no copy of it runs here.
    rolled_back_to: int = 0

    def spec(self) -> JobSpec:
        """What the job is, independent of where it runs (it travels in the image)."""
        here = {
            "kind": self.kind.value,
            "pid": self.pid,
            "stdout_path": self.stdout_path,
            "stderr_path": self.stderr_path,
        }
        return JobSpec(**here, **{n: _copied(getattr(self, n)) for n in _CARRIED})

    @classmethod
    def from_spec(cls, spec: JobSpec, pid: int, pid_started: float, stdout: str, stderr: str) -> JobRecord:
        """A running record for a job restored here from `spec`: its process and logs are this node's."""
        return cls(
            kind=JobKind(spec.kind),
            state=JobState.RUNNING,
            pid=pid,
            pid_started=pid_started,
            stdout_path=stdout,
            stderr_path=stderr,
            **{n: _copied(getattr(spec, n)) for n in _CARRIED},
        )

    @property
    def rank(self) -> int | None:
        """Its rank in its training job, from how it was started: RANK in its environment (a plain
        `env://` launch), else a torchrun agent's --node-rank (its node's share of the job)."""
        return job_rank(self.env, self.command)

    def to_json(self) -> str:
        d = asdict(self)
        d["kind"], d["state"] = self.kind.value, self.state.value
        return json.dumps(d, indent=2)

    @classmethod
    def from_json(cls, raw: str) -> JobRecord:
        d = json.loads(raw)
        d["kind"], d["state"] = JobKind(d["kind"]), JobState(d["state"])
        return cls(**d)


_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def env_of(rec: JobRecord) -> dict[str, str]:
    """The job's `--env` settings, by name."""
    return dict(kv.partition("=")[::2] for kv in rec.env)


def check_job_name(name: str) -> str:
    if not _NAME.match(name or ""):
        raise InvalidArgumentError(
            f"invalid job name {name!r}: use 1-63 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


#: Where a private job sees its log directory: an external mount for CRIU, which each node binds
#: to its own copy of the job's logs (ferry-init --logs).
LOG_MOUNT = "/run/ferry-job"

LOG_MOUNT_KEY = "ferry-job"


_NODE_RANK = re.compile(r"^--node[-_]rank(?:=(\d+))?$")


def job_rank(env: list[str], command: list[str]) -> int | None:
    """RANK=N among `env`, else `--node-rank N` / `--node_rank=N` in a torchrun command; None if neither."""
    for kv in env:
        key, _, value = kv.partition("=")
        if key == "RANK" and value.isdigit():
            return int(value)
    for i, arg in enumerate(command):
        if m := _NODE_RANK.match(arg):
            value = m[1] if m[1] is not None else (command[i + 1] if i + 1 < len(command) else "")
            if value.isdigit():
                return int(value)
    return None


def check_group_name(group: str) -> str:
    """A group name is spelled like a job name ("" is no group)."""
    if group and not _NAME.match(group):
        raise InvalidArgumentError(
            f"invalid group name {group!r}: use 1-63 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return group
