"""What a move is asked to do, what it reports while it runs, and what it reports at the end."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from agent.compat import StrEnum
from agent.migration.pagestream import PageCall
from agent.rpc import pb


@dataclass(frozen=True)
class Progress:
    phase: str  # prepare | dump | transfer | restore | commit | abort | done
    message: str
    bytes_done: int = 0
    bytes_total: int = 0


class Method(StrEnum):
    """How a move carries the job's memory (MigrationMethod in the proto)."""

    DEFAULT = "default"  # post-copy where both nodes can serve it, else pre-copy
    PRE_COPY = "pre-copy"  # the memory streams into the target's staging during the dump
    POST_COPY = "post-copy"  # the job resumes on the target first, its memory follows on demand
    STAGED = "staged"  # the whole image into staging here, then copied


class Resolution(StrEnum):
    """How `ferry resolve` settles an unresolved migration (agent.migration.recovery; ResolveAction
    in the proto). Here, not in recovery, so the wire tables need not import the migration core."""

    ASK = "ask"  # ask the target again and act only on a definite answer
    RESUME = "resume"  # the operator's word: the target does not run the job
    FINISH = "finish"  # the operator's word: the target runs it


@dataclass(frozen=True)
class MigrationSpec:
    job: str
    target: str
    migration_id: str
    staged: bool = False  # dump into staging here, then copy: no page stream
    lazy: bool = False  # post-copy: resume on the target first, its memory follows on demand
    reason: str = ""  # why it moves ("" by hand); the target's record says it
    lock_timeout_s: float | None = None  # the CUDA lock's bound; None: the agent's default
    # Post-copy as the default, not asked for: pre-copy where either node cannot serve it.
    fallback: bool = False

    @classmethod
    def by(cls, method: Method, job: str, target: str, migration_id: str, **kw: Any) -> MigrationSpec:
        # The bench shows post-copy faster at every size (docs/performance.md): the default.
        lazy = method in (Method.POST_COPY, Method.DEFAULT)
        return cls(
            job,
            target,
            migration_id,
            staged=method is Method.STAGED,
            lazy=lazy,
            fallback=method is Method.DEFAULT,
            **kw,
        )

    @property
    def method(self) -> Method:
        return Method.STAGED if self.staged else Method.POST_COPY if self.lazy else Method.PRE_COPY


@dataclass
class MigrationResult:
    migration_id: str
    job: str
    source_node: str
    target_node: str = ""
    target: str = ""
    phases: dict[str, float] = field(default_factory=dict)
    host_bytes: int = 0
    image_bytes: int = 0
    gpu_bytes: int = 0
    frozen_s: float = 0.0
    downtime_s: float = -1.0
    downtime_by: str = ""  # how downtime_s was measured, in words
    total_s: float = 0.0
    transfer_gbps: float = 0.0
    image_dir: str = ""
    method: str = ""  # how the memory moved; when the default fell back to pre-copy, why
    #: A member of a distributed job: how long its peers were without it (frozen_s plus their
    #: wait after its release, agent.migration.peerwait); <0: not measured.
    group_pause_s: float = -1.0
    group_pause_by: str = ""  # how group_pause_s was measured, in words; "" for no member
    path_mbps: float = 0.0  # the path probe's rate, MB/s (0: a move too small to probe)


Emit = Callable[[Progress], None]


class Peer(Protocol):
    """The target agent as the source sees it. UnavailableError / StepTimeoutError
    mean "no answer"; any other FerryError is the target's definite answer."""

    address: str

    def info(self) -> pb.NodeInfo: ...
    def prepare(self, req: pb.PrepareRequest) -> pb.Lease: ...
    def stream_pages(self, requests: Iterable[pb.PageData]) -> PageCall: ...
    def push(self, chunks: Iterator[pb.ImageChunk]) -> pb.PushImageResponse: ...
    def commit(self, req: pb.CommitRequest) -> pb.CommitResponse: ...
    def abort(self, migration_id: str, reason: str) -> None: ...
    def status(self, migration_id: str) -> int: ...
    def stop_moved(self, migration_id: str, timeout_s: float) -> pb.Job: ...
    def peer_wait(self, migration_id: str, wait_s: float) -> pb.PeerWait | None: ...


def unresolved_note(job: str, target: str) -> str:
    return (
        f"UNRESOLVED: target {target} stopped answering while restoring, so whether it runs the job is "
        "unknown; this copy is kept frozen so that two never run. The agent keeps asking the target and "
        f"settles it when it answers. To settle it now: `ferry resolve {job} --resume` if the job does "
        f"not run on {target}, `ferry resolve {job} --finish` if it does"
    )
