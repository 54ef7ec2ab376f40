"""A small, typed etcd v3 client over mutual TLS: keys, transactions, leases, watches.

Why generated stubs, not a PyPI client: `etcd3` 0.12.0 (last release 2020-03) fails to import
with our protobuf 7.36.2 ("Descriptors cannot be created directly"). Its republished forks
(python3-etcd3 0.13.0, 2025-07, and cslab-etcd3 0.12.1, 2026-03, single releases each) and
etcd-sdk-python 0.0.7 (2025-08) import, but ship stubs from protobuf 5.27/5.29, two majors
behind our runtime. `etcd3gw` 2.7.0 (2026-06, OpenStack) is maintained but speaks the HTTP/JSON
gateway to one host and adds requests, futurist and pbr. So scripts/gen-etcd-proto.sh builds
stubs from the installed server's own protos (Debian's etcd 3.4.23) with our pinned
grpcio-tools into the git-ignored ferry/etcdpb. Every failure leaves this module as a
FerryError naming the endpoint, the operation, the cause and what to do.

Why one module: the client, its lease keep-alive and its watch share the channels, the endpoint
hand-over and the one mapping of gRPC failures to ferry's errors.
"""

from __future__ import annotations

import queue
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc

from agent.errors import (
    FerryError,
    InvalidArgumentError,
    NotFoundError,
    RefusedError,
    StepTimeoutError,
    UnauthenticatedError,
    UnavailableError,
)
from agent.tls import Identity
from ferry.etcdpb import kv_pb2, rpc_pb2, rpc_pb2_grpc

T = TypeVar("T")
Bytes = bytes | str
# A restarted etcd must be reachable again within a second, not after gRPC's 1-120 s backoff.
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
]
# gRPC reports a refused or unverifiable TLS handshake as UNAVAILABLE; these mark it.
SERVER_CERT_BAD = re.compile(r"CERTIFICATE_VERIFY_FAILED|certificate verify failed", re.I)
CLIENT_CERT_REFUSED = re.compile(
    r"TSI_DATA_CORRUPTED|BAD_CERTIFICATE|CERTIFICATE_REQUIRED|UNKNOWN_CA|handshake failed", re.I
)
NOT_SENT = "failed to connect"  # the request never left: safe to retry, even a write
ERROR_BY_CODE: dict[grpc.StatusCode, type[FerryError]] = {
    grpc.StatusCode.NOT_FOUND: NotFoundError,  # a lease etcd does not know
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgumentError,  # a compacted revision
    grpc.StatusCode.FAILED_PRECONDITION: RefusedError,
    grpc.StatusCode.PERMISSION_DENIED: RefusedError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
}


def _b(v: Bytes) -> bytes:
    return v.encode() if isinstance(v, str) else v


def prefix_end(prefix: bytes) -> bytes:
    """The range_end that makes [prefix, end) every key starting with prefix."""
    stripped = prefix.rstrip(b"\xff")
    return stripped[:-1] + bytes([stripped[-1] + 1]) if stripped else b"\0"


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def of(cls, kv: kv_pb2.KeyValue) -> KeyValue:
        return cls(kv.key, kv.value, kv.create_revision, kv.mod_revision, kv.version, kv.lease)


@dataclass(frozen=True)
class WatchEvent:
    kind: str  # "put" or "delete"
    kv: KeyValue


@dataclass(frozen=True)
class Lease:
    id: int
    ttl: int  # seconds, as granted
    # time.monotonic() before the grant: a holder counting from here gives up before etcd does.
    granted_at: float


class EtcdClient:
    """Calls go to one endpoint; when it cannot be reached they move to the next."""

    def __init__(
        self,
        endpoints: Sequence[str],
        ca: bytes,
        cert: bytes | None = None,
        key: bytes | None = None,
        *,
        timeout_s: float = 5.0,
    ) -> None:
        if not endpoints:
            raise InvalidArgumentError("no etcd endpoints given", step="etcd", hint="pass host:port")
        self.endpoints = [e.removeprefix("https://") for e in endpoints]
        self.timeout_s = timeout_s
        self._has_cert = cert is not None
        creds = grpc.ssl_channel_credentials(ca, key, cert)
        self._channels = [grpc.secure_channel(e, creds, CHANNEL_OPTIONS) for e in self.endpoints]
        self._current = 0
        self._lock = threading.Lock()
        self._stops: list[Callable[[], None]] = []  # keep-alives and watches, ended by close()

    @classmethod
    def with_identity(cls, endpoints: Sequence[str], identity: Identity, **kw: float) -> EtcdClient:
        """A client holding a ferry certificate (agent.tls.load): the cluster CA and a node's."""
        return cls(endpoints, identity.ca, identity.cert, identity.key, **kw)

    def close(self) -> None:
        for stop in self._stops:
            stop()
        for ch in self._channels:
            ch.close()

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, op: str, fn: Callable[[grpc.Channel, float], T], timeout_s: float | None = None) -> T:
        """fn on the current endpoint; one that cannot be connected to hands over to the next,
        round and round until timeout_s, since a restarting etcd comes back within it."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while True:
            with self._lock:
                index = self._current
            left = deadline - time.monotonic()
            try:
                return fn(self._channels[index], max(left, 0.1))
            except grpc.RpcError as e:
                err = self.error(op, self.endpoints[index], e)
                retry = isinstance(err, UnavailableError) and NOT_SENT in (e.details() or "")
                if not retry or time.monotonic() + 0.1 >= deadline:
                    raise err from e
            with self._lock:
                self._current = (index + 1) % len(self.endpoints)
            if self._current == 0:  # each tried once: give a restarting etcd a moment
                time.sleep(0.1)

    def error(self, op: str, endpoint: str, e: grpc.RpcError) -> FerryError:
        """Ferry's error for a failed call: which endpoint, which operation, why, what to do."""
        code = e.code()
        details = e.details() or code.name
        at = {"step": f"etcd {op}", "node": endpoint}
        if SERVER_CERT_BAD.search(details):
            return UnauthenticatedError(
                f"etcd presented a certificate our CA does not accept ({details})",
                hint="etcd's certificate must be signed by the cluster CA and name the host dialled",
                **at,
            )
        if code is grpc.StatusCode.UNAVAILABLE and CLIENT_CERT_REFUSED.search(details):
            mine = "a client certificate" if self._has_cert else "no client certificate"
            return UnauthenticatedError(
                f"etcd refused the TLS handshake: we sent {mine} it accepts ({details})",
                hint="use a certificate issued by the CA in etcd's --trusted-ca-file (`ferry certs node`)",
                **at,
            )
        if code is grpc.StatusCode.UNAVAILABLE or "Stream removed" in details:  # a stream cut short
            return UnavailableError(
                f"etcd cannot be reached: {details}",
                hint=f"check that etcd runs and listens on {', '.join(self.endpoints)}",
                **at,
            )
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            return StepTimeoutError(
                f"no answer within {self.timeout_s:g} s: {details}",
                hint="etcd may have lost its quorum; check `etcdctl endpoint status`",
                **at,
            )
        if kind := ERROR_BY_CODE.get(code):
            return kind(details, **at)
        return FerryError(f"{code.name}: {details}", **at)

    # -- keys ---------------------------------------------------------------------------------

    def _range(self, op: str, req: rpc_pb2.RangeRequest) -> list[KeyValue]:
        resp = self._call(op, lambda ch, t: rpc_pb2_grpc.KVStub(ch).Range(req, timeout=t))
        return [KeyValue.of(kv) for kv in resp.kvs]

    def get(self, key: Bytes) -> KeyValue | None:
        kvs = self._range("get", rpc_pb2.RangeRequest(key=_b(key)))
        return kvs[0] if kvs else None

    def get_prefix(self, prefix: Bytes) -> list[KeyValue]:
        p = _b(prefix)
        asc, by_key = rpc_pb2.RangeRequest.ASCEND, rpc_pb2.RangeRequest.KEY
        req = rpc_pb2.RangeRequest(key=p, range_end=prefix_end(p), sort_order=asc, sort_target=by_key)
        return self._range("get prefix", req)

    def put(self, key: Bytes, value: Bytes, lease: int = 0) -> int:
        """The store's revision after the put."""
        req = rpc_pb2.PutRequest(key=_b(key), value=_b(value), lease=lease)
        return self._call("put", lambda ch, t: rpc_pb2_grpc.KVStub(ch).Put(req, timeout=t)).header.revision

    def delete(self, key: Bytes, *, prefix: bool = False) -> int:
        """How many keys went."""
        k = _b(key)
        req = rpc_pb2.DeleteRangeRequest(key=k, range_end=prefix_end(k) if prefix else b"")
        return self._call("delete", lambda ch, t: rpc_pb2_grpc.KVStub(ch).DeleteRange(req, timeout=t)).deleted

    def _txn(self, op: str, compares: list[rpc_pb2.Compare], put: rpc_pb2.PutRequest) -> bool:
        req = rpc_pb2.TxnRequest(compare=compares, success=[rpc_pb2.RequestOp(request_put=put)])
        return self._call(op, lambda ch, t: rpc_pb2_grpc.KVStub(ch).Txn(req, timeout=t)).succeeded

    def put_if_held(self, guard: Bytes, value: Bytes, lease: int, key: Bytes, new: Bytes) -> bool:
        """Put key only while `guard` holds `value` on `lease` (a claim that is still ours);
        True if it was put."""
        g = _b(guard)
        eq = rpc_pb2.Compare.EQUAL
        cmps = [
            rpc_pb2.Compare(key=g, target=rpc_pb2.Compare.VALUE, result=eq, value=_b(value)),
            rpc_pb2.Compare(key=g, target=rpc_pb2.Compare.LEASE, result=eq, lease=lease),
        ]
        return self._txn("put if held", cmps, rpc_pb2.PutRequest(key=_b(key), value=_b(new)))

    def create_if_absent(self, key: Bytes, value: Bytes, lease: int = 0) -> bool:
        """Put only if no one has the key (its create_revision is 0); True if this call made it."""
        k = _b(key)
        cmp = rpc_pb2.Compare(
            key=k, target=rpc_pb2.Compare.CREATE, result=rpc_pb2.Compare.EQUAL, create_revision=0
        )
        return self._txn("create", [cmp], rpc_pb2.PutRequest(key=k, value=_b(value), lease=lease))

    def compare_and_swap(self, key: Bytes, value: Bytes, mod_revision: int, lease: int = 0) -> bool:
        """Put only if the key was last changed at mod_revision (as read); True if it was swapped."""
        k = _b(key)
        cmp = rpc_pb2.Compare(
            key=k, target=rpc_pb2.Compare.MOD, result=rpc_pb2.Compare.EQUAL, mod_revision=mod_revision
        )
        return self._txn("swap", [cmp], rpc_pb2.PutRequest(key=k, value=_b(value), lease=lease))

    def delete_if(self, key: Bytes, mod_revision: int) -> bool:
        """Delete only if the key was last changed at mod_revision (as read); True if it went."""
        k = _b(key)
        cmp = rpc_pb2.Compare(
            key=k, target=rpc_pb2.Compare.MOD, result=rpc_pb2.Compare.EQUAL, mod_revision=mod_revision
        )
        op = rpc_pb2.RequestOp(request_delete_range=rpc_pb2.DeleteRangeRequest(key=k))
        req = rpc_pb2.TxnRequest(compare=[cmp], success=[op])
        return self._call("delete if", lambda ch, t: rpc_pb2_grpc.KVStub(ch).Txn(req, timeout=t)).succeeded

    # -- leases -------------------------------------------------------------------------------

    def grant(self, ttl_s: int) -> Lease:
        req, asked = rpc_pb2.LeaseGrantRequest(TTL=ttl_s), time.monotonic()
        resp = self._call("lease grant", lambda ch, t: rpc_pb2_grpc.LeaseStub(ch).LeaseGrant(req, timeout=t))
        if resp.error:
            raise RefusedError(resp.error, step="etcd lease grant", node=self.endpoints[self._current])
        return Lease(resp.ID, resp.TTL, asked)

    def revoke(self, lease_id: int) -> None:
        """Ends the lease now; its keys go with it."""
        req = rpc_pb2.LeaseRevokeRequest(ID=lease_id)
        self._call("lease revoke", lambda ch, t: rpc_pb2_grpc.LeaseStub(ch).LeaseRevoke(req, timeout=t))

    def time_to_live(self, lease_id: int) -> int:
        """Seconds left; -1 once it has expired or was revoked."""
        req = rpc_pb2.LeaseTimeToLiveRequest(ID=lease_id)
        resp = self._call(
            "lease ttl", lambda ch, t: rpc_pb2_grpc.LeaseStub(ch).LeaseTimeToLive(req, timeout=t)
        )
        return resp.TTL

    def refresh(self, lease_id: int, timeout_s: float | None = None) -> int:
        """One keep-alive; the TTL it restarted, or 0 or less when the lease is gone."""
        req = rpc_pb2.LeaseKeepAliveRequest(ID=lease_id)
        return self._call(
            "lease keep-alive",
            lambda ch, t: next(rpc_pb2_grpc.LeaseStub(ch).LeaseKeepAlive(iter([req]), timeout=t)).TTL,
            timeout_s,
        )

    def keep_alive(
        self, lease: Lease, on_lost: Callable[[FerryError], None], interval_s: float | None = None
    ) -> KeepAlive:
        """Renew lease every interval_s (ttl/3) in a daemon thread until stopped. When it cannot
        be renewed any more, on_lost runs once (in that thread): a node fences itself there."""
        keeper = KeepAlive(self, lease, on_lost, interval_s or max(lease.ttl / 3, 0.2))
        self._stops.append(keeper.stop)
        return keeper.start()

    def watch_prefix(self, prefix: Bytes, start_revision: int = 0) -> Watch:
        """Every change under prefix from now (or from start_revision), until cancel(). It stays on
        one endpoint: when that breaks, get() raises; watch again from watch.revision + 1."""
        p = _b(prefix)
        create = rpc_pb2.WatchCreateRequest(key=p, range_end=prefix_end(p), start_revision=start_revision)
        with self._lock:
            index = self._current
        watch = Watch(self, index, rpc_pb2.WatchRequest(create_request=create))
        self._stops.append(watch.cancel)
        return watch.start()


class KeepAlive:
    """A lease kept alive by a thread; lost once no renewal lands within one TTL of the last."""

    def __init__(
        self, client: EtcdClient, lease: Lease, on_lost: Callable[[FerryError], None], interval_s: float
    ) -> None:
        self.client, self.lease, self.on_lost, self.interval_s = client, lease, on_lost, interval_s
        self._stop = threading.Event()
        self.lost: FerryError | None = None
        self._thread = threading.Thread(target=self._run, name=f"etcd-lease-{lease.id:x}", daemon=True)

    def start(self) -> KeepAlive:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop renewing (the lease then expires after its TTL unless revoked); on_lost does not run."""
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=self.client.timeout_s + 1)

    def _run(self) -> None:
        # Counted from before the grant, then each request (etcd restarts the TTL on receipt,
        # later): a node fences itself before etcd lets another take over.
        valid_until = self.lease.granted_at + self.lease.ttl
        last_error: FerryError | None = None
        while not self._stop.wait(self.interval_s if last_error is None else 0.2):
            sent = time.monotonic()
            if sent >= valid_until:
                why = f"lease {self.lease.id:x} not renewed for {self.lease.ttl} s: {last_error}"
                return self._lose(UnavailableError(why, step="etcd lease keep-alive"))
            try:
                # No longer than the lease has left: a lost lease is reported on time.
                ttl = self.client.refresh(self.lease.id, max(valid_until - sent, 0.1))
            except FerryError as e:
                last_error = e
                continue
            if ttl <= 0:
                why = f"etcd says lease {self.lease.id:x} has expired or was revoked"
                return self._lose(NotFoundError(why, step="etcd lease keep-alive"))
            valid_until, last_error = sent + ttl, None

    def _lose(self, err: FerryError) -> None:
        if not self._stop.is_set():  # stopped on purpose is not lost
            self.lost = err
            self.on_lost(err)


class Watch:
    """The events of one watch stream, read by a thread into a queue; iterate or get()."""

    _END = object()

    def __init__(self, client: EtcdClient, index: int, create: rpc_pb2.WatchRequest) -> None:
        self.client, self.endpoint = client, client.endpoints[index]
        self._channel = client._channels[index]
        self._create = create
        self._cancelled = threading.Event()
        self._created = threading.Event()  # set on etcd's answer to the create, or the stream's end
        self.confirmed = False
        self._events: queue.Queue[object] = queue.Queue()
        # The last revision seen (at first, the one it starts after): resume from revision + 1.
        self.revision = max(create.create_request.start_revision - 1, 0)
        self._stream: grpc.Future | None = None

    def _requests(self) -> Iterator[rpc_pb2.WatchRequest]:
        yield self._create
        self._cancelled.wait()  # keep our side open: a closed request stream ends the watch

    def start(self) -> Watch:
        self._stream = rpc_pb2_grpc.WatchStub(self._channel).Watch(self._requests())
        threading.Thread(target=self._pump, name="etcd-watch", daemon=True).start()
        if not self._created.wait(self.client.timeout_s) or not self.confirmed:
            self.cancel()
            first = self._events.queue[0] if self._events.queue else None
            if not isinstance(first, FerryError):
                late = f"etcd did not confirm the watch within {self.client.timeout_s:g} s"
                first = StepTimeoutError(late, step="etcd watch", node=self.endpoint)
            raise first
        return self

    def _pump(self) -> None:
        at = {"step": "etcd watch", "node": self.endpoint}
        broke: FerryError = UnavailableError("etcd closed the watch stream", **at)
        try:
            for resp in self._stream:  # type: ignore[union-attr]
                if resp.created:
                    self.confirmed = True
                    if not self._create.create_request.start_revision:  # from now
                        self.revision = resp.header.revision
                    self._created.set()
                for ev in resp.events:
                    kind = "delete" if ev.type == kv_pb2.Event.DELETE else "put"
                    self.revision = ev.kv.mod_revision
                    self._events.put(WatchEvent(kind, KeyValue.of(ev.kv)))
                if resp.canceled:
                    broke = RefusedError(resp.cancel_reason or "etcd cancelled the watch", **at)
                    break
        except grpc.RpcError as e:
            broke = self.client.error("watch", self.endpoint, e)
        if not self._cancelled.is_set():  # ended by etcd or the network, not by cancel()
            self._events.put(broke)
        self._created.set()
        self._events.put(self._END)

    def get(self, timeout_s: float | None = None) -> WatchEvent | None:
        """The next event; None on timeout or once the watch has ended; a FerryError if it broke."""
        try:
            item = self._events.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if item is self._END:
            self._events.put(item)  # later calls see the end too
            return None
        if isinstance(item, FerryError):
            raise item
        return item  # type: ignore[return-value]

    def __iter__(self) -> Iterator[WatchEvent]:
        while (ev := self.get()) is not None:
            yield ev

    def cancel(self) -> None:
        self._cancelled.set()
        if self._stream is not None:
            self._stream.cancel()
