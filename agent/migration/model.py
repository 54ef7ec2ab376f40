"""What a move is asked to do, what it reports while it runs, and what it reports at the end."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from agent.migration.pagestream import PageCall
from agent.rpc import pb


@dataclass(frozen=True)
class Progress:
    phase: str  # prepare | dump | transfer | restore | commit | abort | done
    message: str
    bytes_done: int = 0
    bytes_total: int = 0


@dataclass(frozen=True)
class MigrationSpec:
    job: str
    target: str
    migration_id: str
    staged: bool = False  # dump into staging here, then copy: no page stream
    lazy: bool = False  # post-copy: resume on the target first, its memory follows on demand
    reason: str = ""  # why it moves ("" by hand); the target's record says it
    lock_timeout_s: float | None = None  # the CUDA lock's bound; None: the agent's default


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


def unresolved_note(job: str, target: str) -> str:
    return (
        f"UNRESOLVED: target {target} stopped answering while restoring, so whether it runs the job is "
        "unknown; this copy is kept frozen so that two never run. The agent keeps asking the target and "
        f"settles it when it answers. To settle it now: `ferry resolve {job} --resume` if the job does "
        f"not run on {target}, `ferry resolve {job} --finish` if it does"
    )
