"""gRPC channels to agents, and the peer view a source agent has of a target.

An agent is reached at `unix:PATH` (the local, root-only socket), over mutual
TLS at HOST:PORT, or in plaintext at a loopback HOST:PORT when both sides
say `--insecure`.
"""

from __future__ import annotations

import ipaddress
import re
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from agent import tls
from agent.errors import (
    AlreadyExistsError,
    BusyError,
    FerryError,
    ImageError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    RefusedError,
    StepTimeoutError,
    TransferError,
    UnauthenticatedError,
    UnavailableError,
)
from agent.rpc import pb, pb_grpc

#: Deadlines per call, in seconds. Commit covers a CRIU restore of a large image.
DEADLINES = {
    "info": 10.0,
    "prepare": 60.0,
    "push": 3600.0,
    "commit": 600.0,
    "abort": 30.0,
    "status": 10.0,
    "stop": 10.0,  # the target answers at once; the stop itself runs there on its own
    "health": 5.0,
    # Suspending a low-priority job writes its whole memory to storage.
    "preempt": 600.0,
    "snapshot": 600.0,  # each call gives its own bound (agent.snapshots.rounds)
    "path probe": 60.0,  # a few MiB: a path that takes longer is refused anyway
}
MAX_MESSAGE = 16 << 20
#: Keepalive pings find a peer that vanished without a FIN (a cut link) in about 20 s,
#: instead of a stream waiting out its deadline.
KEEPALIVE_MS = 10_000
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_MS),
]
SERVER_OPTIONS = [
    *CHANNEL_OPTIONS,
    # gRPC sets SO_REUSEPORT by default: a second agent on a served address would start without
    # complaint and take half of the connections. Without it, its bind fails.
    ("grpc.so_reuseport", 0),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
]

_ERROR_BY_CODE: dict[grpc.StatusCode, type[FerryError]] = {
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.FAILED_PRECONDITION: RefusedError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExistsError,
    grpc.StatusCode.DEADLINE_EXCEEDED: StepTimeoutError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.ABORTED: TransferError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: BusyError,
    grpc.StatusCode.DATA_LOSS: ImageError,
}


def split_address(address: str, listen: bool = False) -> tuple[str, int]:
    """HOST:PORT (or [V6]:PORT) → (host, port), with a one-line error for anything else.

    Port 0 ("any free port") is valid only for an address to listen on.
    """
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    lowest = 0 if listen else 1
    if not sep or not host or not (port.isascii() and port.isdigit()) or not lowest <= int(port) < 65536:
        raise InvalidArgumentError(f"invalid agent address {address!r}: expected HOST:PORT")
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Dial:
    """How this process reaches agents at HOST:PORT: with its certificate, or plaintext on loopback."""

    identity: tls.Identity | None = None
    insecure: bool = False


#: A channel kept for many calls (PeerClients): gRPC's documented wait between tries to reconnect
#: grows from 1 s to 120 s; bounded here to a second, so that a peer agent that was down a while
#: is tried again about as soon as a new channel per call would have.
KEPT_CHANNEL_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def channel(address: str, dial: Dial, options: list[tuple[str, int]] = CHANNEL_OPTIONS) -> grpc.Channel:
    if address.startswith("unix:"):
        return grpc.insecure_channel(address, options=options)
    host, _ = split_address(address)
    if dial.identity is not None:
        return grpc.secure_channel(address, dial.identity.channel_credentials(), options=options)
    if not dial.insecure:
        raise UnauthenticatedError(
            f"no client certificate to reach {address} over TLS",
            hint="pass --tls-dir/--tls-name (or FERRY_TLS_DIR/FERRY_TLS_NAME), or --insecure for a "
            "loopback agent that serves plaintext",
        )
    if not is_loopback(host):
        raise InvalidArgumentError(
            f"{address} is not a loopback address; plaintext (--insecure) is allowed only on loopback"
        )
    return grpc.insecure_channel(address, options=options)


def stub(address: str, dial: Dial) -> pb_grpc.AgentStub:
    return pb_grpc.AgentStub(channel(address, dial))


#: gRPC's words for why a channel could not connect, and ours (the first that occurs wins).
UNREACHABLE_WORDS = (
    ("Connection refused", "connection refused: no agent listens there"),
    ("Failed parsing HTTP/2", "something answers there, but not in gRPC: not an agent's --listen port"),
    ("Expected SETTINGS frame", "something answers there, but not in gRPC: not an agent's --listen port"),
    ("Socket closed", "it closed the connection: not an agent, or one that serves TLS"),
    ("Connection reset", "it reset the connection: not an agent, or one that serves TLS"),
    ("No route to host", "no route to its host"),
    ("Network is unreachable", "its network is unreachable"),
    ("DNS resolution failed", "its host name does not resolve"),
    ("No such file or directory", "no such socket"),
    ("Permission denied", "permission denied (the local socket is root's)"),
    ("handshake", "the TLS handshake failed"),
)
#: What gRPC puts before the cause in an unreachable channel's details.
_GRPC_PREFIX = r"^failed to connect to all addresses; last error: [A-Z_]+: (?:[a-z0-9]+:\S+: )?"


def unreachable_cause(detail: str) -> str:
    """Why a channel could not connect, in words (gRPC's own text, trimmed, where none fit)."""
    why = next((ours for theirs, ours in UNREACHABLE_WORDS if theirs in detail), "")
    return why or re.sub(_GRPC_PREFIX, "", detail) or "no cause given"


def from_rpc_error(e: grpc.RpcError, address: str, step: str, dial: Dial | None = None) -> FerryError:
    """A remote agent's error as ours: its message already names step, node and cause.

    A TLS connection that fails is checked once more by hand: gRPC shows a refused
    certificate as an unreachable agent, which would send a user looking in the wrong place.
    """
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    detail = (e.details() if hasattr(e, "details") else "") or str(code)
    tls_failed = code is grpc.StatusCode.UNAVAILABLE and dial and dial.identity and ":" in address
    if tls_failed and not address.startswith("unix:") and (refused := tls.diagnose(address, dial.identity)):
        return refused.at(step=step)
    if code is grpc.StatusCode.UNAVAILABLE:
        detail = f"agent {address} is unreachable: {unreachable_cause(detail)}"
    elif code is grpc.StatusCode.DEADLINE_EXCEEDED:
        detail = f"agent {address} did not answer in time"
    cls = _ERROR_BY_CODE.get(code, FerryError)
    return cls(
        detail, step=step if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) else ""
    )


class PeerClient:
    """The target agent, for a source agent's migration (agent.migration.source.Peer)."""

    def __init__(self, address: str, dial: Dial, over: grpc.Channel | None = None) -> None:
        self.address = address
        self.dial = dial
        self._stub = pb_grpc.AgentStub(over if over is not None else channel(address, dial))

    def _call(self, step: str, fn: object, req: object, timeout: float | None = None) -> object:
        try:
            return fn(req, timeout=timeout or DEADLINES[step])  # type: ignore[operator]
        except grpc.RpcError as e:
            raise from_rpc_error(e, self.address, step, self.dial) from e

    def info(self, timeout_s: float | None = None) -> pb.NodeInfo:
        return self._call("info", self._stub.GetInfo, pb.GetInfoRequest(), timeout_s)  # type: ignore[return-value]

    def prepare(self, req: pb.PrepareRequest) -> pb.Lease:
        return self._call("prepare", self._stub.Prepare, req)  # type: ignore[return-value]

    def stream_pages(self, requests: Iterable[pb.PageData]) -> _PageCall:
        return _PageCall(self._stub.StreamPages(requests, timeout=DEADLINES["push"]), self)

    def push(self, chunks: Iterator[pb.ImageChunk]) -> pb.PushImageResponse:
        return self._call("push", self._stub.PushImage, chunks)  # type: ignore[return-value]

    def commit(self, req: pb.CommitRequest) -> pb.CommitResponse:
        return self._call("commit", self._stub.Commit, req)  # type: ignore[return-value]

    def abort(self, migration_id: str, reason: str) -> None:
        self._call("abort", self._stub.Abort, pb.AbortRequest(migration_id=migration_id, reason=reason))

    def stop_moved(self, migration_id: str, timeout_s: float) -> pb.Job:
        req = pb.StopMovedRequest(migration_id=migration_id, timeout_s=timeout_s)
        return self._call("stop", self._stub.StopMoved, req)  # type: ignore[return-value]

    def status(self, migration_id: str) -> int:
        resp = self._call(
            "status", self._stub.GetMigration, pb.GetMigrationRequest(migration_id=migration_id)
        )
        return resp.state  # type: ignore[attr-defined]

    def peer_wait(self, migration_id: str, wait_s: float) -> pb.PeerWait | None:
        """The target's measure of a moved member's peers (agent.migration.peerwait), waiting up
        to wait_s for it; None if the target sent none."""
        req = pb.GetMigrationRequest(migration_id=migration_id, peer_wait_s=wait_s)
        resp = self._call("status", self._stub.GetMigration, req, wait_s + 5.0)
        return resp.peer_wait if resp.HasField("peer_wait") else None  # type: ignore[attr-defined]

    def health(self, timeout_s: float) -> pb.HealthReport:
        return self._call("health", self._stub.GetHealth, pb.GetHealthRequest(), timeout_s)  # type: ignore[return-value]

    def probe_path(self, chunks: Iterator[pb.ProbeChunk]) -> pb.ProbeResult | None:
        """None from an agent older than the probe (it cannot be probed; the move goes on)."""
        try:
            return self._stub.ProbePath(chunks, timeout=DEADLINES["path probe"])  # type: ignore[no-any-return]
        except grpc.RpcError as e:
            if hasattr(e, "code") and e.code() is grpc.StatusCode.UNIMPLEMENTED:
                return None
            raise from_rpc_error(e, self.address, "path probe", self.dial) from e

    def pace(self, group: str, timeout_s: float) -> pb.GroupPace:
        """This peer's members of `group` and their pace samples (the straggler watch)."""
        return self._call("pace", self._stub.GetPace, pb.GetPaceRequest(group=group), timeout_s)  # type: ignore[return-value]

    def preempt(self, req: pb.PreemptRequest) -> pb.PreemptResponse:
        return self._call("preempt", self._stub.Preempt, req)  # type: ignore[return-value]

    def snapshot_member(self, req: pb.SnapshotMemberRequest, timeout_s: float) -> pb.SnapshotMemberResponse:
        return self._call("snapshot", self._stub.SnapshotMember, req, timeout_s)  # type: ignore[return-value]

    def store_snapshot(self, chunks: Iterator[pb.ImageChunk]) -> pb.StoredSnapshot:
        return self._call("push", self._stub.StoreSnapshot, chunks)  # type: ignore[return-value]

    def fetch_snapshot(self, key: pb.SnapshotKey) -> Iterator[pb.ImageChunk]:
        try:
            yield from self._stub.FetchSnapshot(key, timeout=DEADLINES["push"])
        except grpc.RpcError as e:
            raise from_rpc_error(e, self.address, "rollback fetch", self.dial) from e


class _PageCall:
    """A StreamPages call as agent.migration.pagestream.PageCall: its errors are ours."""

    def __init__(self, call: Any, peer: PeerClient) -> None:
        self._call = call
        self._peer = peer

    def __iter__(self) -> Iterator[pb.PageData]:
        try:
            yield from self._call
        except grpc.RpcError as e:
            raise from_rpc_error(e, self._peer.address, "dump", self._peer.dial) from e

    def cancel(self) -> None:
        self._call.cancel()


class PeerClients:
    """One client per peer agent, its channel kept, for an agent's small calls that come again and
    again (pings, the straggler watch's pace, a snapshot round's steps). A channel per call paid a
    TCP and a TLS handshake each time: 3.3 ms of CPU between the two agents against 0.7 ms over a
    kept one, some ten times a second on a node of the multi-node bed. A kept channel reconnects
    by itself (within KEPT_CHANNEL_OPTIONS' second); a dead peer's calls run out their deadline,
    as a new channel's connect did. Moves and image transfers open their own."""

    def __init__(self, dial: Dial) -> None:
        self.dial = dial
        self._lock = threading.Lock()
        self._kept: dict[str, tuple[grpc.Channel, PeerClient]] = {}

    def get(self, address: str) -> PeerClient:
        with self._lock:
            if (kept := self._kept.get(address)) is None:
                ch = channel(address, self.dial, KEPT_CHANNEL_OPTIONS)
                kept = self._kept[address] = (ch, PeerClient(address, self.dial, over=ch))
            return kept[1]

    def close(self) -> None:
        with self._lock:
            kept, self._kept = list(self._kept.values()), {}
        for ch, _ in kept:
            ch.close()
