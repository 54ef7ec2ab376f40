"""A job's memory, streamed while it is dumped: CRIU's page-server protocol relayed between agents.

The source's CRIU dumps with its page server on a local socket whose other end is
the source agent's. The agent carries those bytes to the target agent over the
authenticated gRPC link (StreamPages) and the page server's answers back; the
target agent feeds them to a `criu page-server` that writes the pages into its
staging directory. So the memory is never staged on the source, and it crosses
while CRIU is still reading it.

Both agents checksum the bytes they relay (CRC-32). The manifest carries the
source's count and checksum, and the target restores only if its own match. A
cryptographic digest would add nothing here: the source computes the check over what
it sends, and TLS already authenticates every byte on the link. The check is there
for the relay itself: a lost, repeated or reordered chunk. CRC-32 runs at twice the
speed of SHA-256 on the data path.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Protocol

from agent import faults
from agent.criu.lazy import LazyPagesDaemon
from agent.criu.runner import Criu, PageServer
from agent.errors import FerryError, StepTimeoutError, TransferError
from agent.image import StreamDigest
from agent.rpc import pb

log = logging.getLogger(__name__)

#: What one relay message carries at most; a recv() returns what the socket holds.
CHUNK = 1 << 20
#: Deep socket buffers let CRIU run ahead of the relay instead of waiting on every chunk.
SOCKET_BUFFER = 8 << 20
#: After CRIU is done, how long the far side may take to report (the page server flushing).
DRAIN_S = 120.0
#: Where a relay's fault point fires (tests only: target-pages breaks a post-copy transfer).
FAULT_AFTER = 16 << 20


class _Counter:
    def __init__(self) -> None:
        self.bytes = 0
        self.messages = 0
        self._crc = 0

    def update(self, data: bytes) -> None:
        self.bytes += len(data)
        self.messages += 1
        self._crc = zlib.crc32(data, self._crc)  # releases the GIL for large buffers

    def digest(self) -> StreamDigest:
        return StreamDigest(self.bytes, f"crc32:{self._crc:08x}")


# Linux's SO_SNDBUFFORCE and SO_RCVBUFFORCE, which Python does not name.
_BUFFER_OPTS = ((32, socket.SO_SNDBUF), (33, socket.SO_RCVBUF))


def _socketpair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for s in (a, b):
        for force, plain in _BUFFER_OPTS:
            try:  # past the system's cap, which root may do
                s.setsockopt(socket.SOL_SOCKET, force, SOCKET_BUFFER)
            except OSError:
                s.setsockopt(socket.SOL_SOCKET, plain, SOCKET_BUFFER)
    return a, b


class PageCall(Protocol):
    """The source's side of a StreamPages call: the target's messages, and a way to end it."""

    def __iter__(self) -> Iterator[pb.PageData]: ...
    def cancel(self) -> None: ...


class SourceRelay:
    """Carries the page-server protocol between a dumping CRIU here and the target agent.

    `criu_fd` goes to `Criu.dump(page_server_fd=...)`; `finish()` after the dump returns
    checks that the target received exactly what CRIU sent.
    """

    def __init__(
        self,
        open_call: Callable[[Iterable[pb.PageData]], PageCall],
        migration_id: str,
        node: str,
        progress: Callable[[int], None] = lambda n: None,
    ) -> None:
        self.migration_id = migration_id
        self.node = node
        self.progress = progress
        self.local, self._criu_end = _socketpair()
        self.sent = _Counter()
        self.end: pb.PageStreamEnd | None = None
        self.error: FerryError | None = None
        self._call = open_call(self._requests())
        self._answers = threading.Thread(target=self._relay_answers, name="page-answers", daemon=True)
        self._answers.start()

    @property
    def criu_fd(self) -> int:
        return self._criu_end.fileno()

    def _requests(self) -> Iterator[pb.PageData]:
        yield pb.PageData(migration_id=self.migration_id)
        buf = bytearray(CHUNK)
        step = 64 << 20
        while True:
            try:
                n = self.local.recv_into(buf)
            except OSError:
                return
            if not n:
                return  # CRIU is done and our copy of its end is closed
            data = bytes(buf[:n])
            before = self.sent.bytes
            self.sent.update(data)
            if before // step != self.sent.bytes // step:
                self.progress(self.sent.bytes)
            yield pb.PageData(data=data)

    def _relay_answers(self) -> None:
        try:
            for msg in self._call:
                if msg.data:
                    self.local.sendall(msg.data)
                if msg.HasField("end"):
                    self.end = msg.end
        except FerryError as e:
            self.error = e
        except Exception as e:  # a broken local socket: CRIU died
            self.error = TransferError(f"the page stream broke: {e!r}", step="dump", node=self.node)
        finally:
            if self.end is None:
                # CRIU must not wait forever for an answer that will not come.
                _shutdown(self.local)

    def dumped(self) -> None:
        """CRIU has returned: closing our copy of its socket lets the stream end."""
        self._criu_end.close()

    def finish(self, timeout_s: float = DRAIN_S) -> StreamDigest:
        self.dumped()
        self._answers.join(timeout_s)
        if self._answers.is_alive():
            raise StepTimeoutError(
                f"the target did not confirm the page stream within {timeout_s:.0f} s", step="dump"
            )
        if self.error is not None:
            raise self.error
        sent = self.sent.digest()
        if self.end is None:
            raise TransferError("the target ended the page stream without confirming it", step="dump")
        if (self.end.bytes, self.end.check) != (sent.bytes, sent.check):
            raise TransferError(
                f"the page stream arrived damaged: sent {sent.bytes} bytes, the target received "
                f"{self.end.bytes} with another checksum",
                step="dump",
            )
        return sent

    def close(self) -> None:
        """Give up (an aborted migration): end the call and both sockets."""
        self.error = self.error or TransferError("the page stream was closed before it ended", step="dump")
        self._call.cancel()
        self._criu_end.close()
        _shutdown(self.local)
        self._answers.join(10)
        self.local.close()


def _drained(writer: threading.Thread, relay: TargetRelay | LazyTargetRelay) -> StreamDigest:
    """What a target relay received, once the source has ended its stream (it does when its dump
    returns)."""
    writer.join(DRAIN_S)
    if writer.is_alive():
        raise StepTimeoutError(f"the source did not end the page stream within {DRAIN_S:.0f} s")
    if relay.error is not None:
        raise relay.error
    return relay.received.digest()


class TargetRelay:
    """Feeds a StreamPages call into a `criu page-server` writing into staging.

    The swrk that started the page server keeps its socket open until asked for the
    server's exit status, so the end of the stream is not an EOF here: a waiter thread
    learns that the server exited and shuts our end down, which ends the read loop and
    unblocks a writer stuck on a server that died.
    """

    def __init__(
        self, criu: Criu, staging: Path, max_bytes: int, node: str, log_dir: Path | None = None
    ) -> None:
        self.criu = criu
        self.staging = staging
        self.log_dir = log_dir  # where the page server logs (kept if the migration fails)
        self.max_bytes = max_bytes
        self.node = node
        self.received = _Counter()
        self.refusal: FerryError | None = None  # the stream broke our rules
        self.error: FerryError | None = None  # the stream broke
        self.server_error: FerryError | None = None
        self.server: PageServer | None = None
        self._local: socket.socket | None = None

    def run(self, requests: Iterator[pb.PageData]) -> Iterator[pb.PageData]:
        """Yield the page server's answers; return (via StopIteration) what was received."""
        local, theirs = _socketpair()
        self._local = local
        try:
            self.server = self.criu.page_server(self.staging, theirs.fileno(), self.log_dir)
        finally:
            theirs.close()
        waiter = threading.Thread(target=self._wait_server, args=(local,), name="page-server", daemon=True)
        writer = threading.Thread(target=self._write, args=(requests, local), name="page-writer", daemon=True)
        waiter.start()
        writer.start()
        try:
            buf = bytearray(1 << 16)
            while n := local.recv_into(buf):  # a few bytes per process, and the final status
                yield pb.PageData(data=bytes(buf[:n]))
            waiter.join(DRAIN_S)
            # Our own refusal (the cap, say) is the cause; the page server's failure would be its echo.
            if self.refusal is not None:
                raise self.refusal
            if self.server_error is not None:
                raise self.server_error
            if waiter.is_alive():
                raise self.error or StepTimeoutError(f"the page server did not end within {DRAIN_S:.0f} s")
            return _drained(writer, self)
        finally:
            local.close()

    def _wait_server(self, local: socket.socket) -> None:
        assert self.server is not None
        try:
            self.server.wait(None)
        except FerryError as e:
            self.server_error = e
        _shutdown(local)  # whatever the server wrote before it exited is still read

    def _write(self, requests: Iterator[pb.PageData], local: socket.socket) -> None:
        try:
            _feed(requests, local, self.received, self.max_bytes)
        except FerryError as e:
            self.refusal = e
        except Exception as e:  # the source's stream broke off, or the page server died
            self.error = TransferError(f"the page stream broke off: {e!r}", step="transfer")
        # Ended early or not: a page server still reading gets EOF, and fails if incomplete.
        with contextlib.suppress(OSError):
            local.shutdown(socket.SHUT_WR)

    def kill(self) -> None:
        if self.server is not None:
            self.server.kill()
        if self._local is not None:
            _shutdown(self._local)


class LazyTargetRelay:
    """Post-copy on the target: a StreamPages call between the source's lazy page server and
    a `criu lazy-pages` daemon that `attach()` starts at commit.

    Here the daemon asks and the source's CRIU answers, so until the daemon runs the
    stream idles. The transfer is over when the daemon exits: 0 means every page of the
    restored tree arrived. Anything else means some did not, and those would read as
    zeros, so whoever runs this kills the job first (incoming.py).
    """

    def __init__(self, max_bytes: int, node: str) -> None:
        self.max_bytes = max_bytes
        self.node = node
        self.received = _Counter()
        self.daemon: LazyPagesDaemon | None = None
        self.refusal: FerryError | None = None
        self.error: FerryError | None = None
        self._local, self._daemon_end = _socketpair()

    def attach(self, criu: Criu, images_dir: Path, work_dir: Path, timeout_s: float) -> LazyPagesDaemon:
        """Start the daemon on our socket; a restore in work_dir then takes its pages from it."""
        self.daemon = LazyPagesDaemon(criu, images_dir, work_dir, self._daemon_end.fileno(), timeout_s)
        self._daemon_end.close()
        return self.daemon

    def run(self, requests: Iterator[pb.PageData]) -> Iterator[pb.PageData]:
        """Yield the daemon's requests; return (via StopIteration) what the source sent."""
        local = self._local
        writer = threading.Thread(target=self._write, args=(requests,), name="lazy-writer", daemon=True)
        writer.start()
        try:
            buf = bytearray(1 << 16)
            while n := local.recv_into(buf):
                yield pb.PageData(data=bytes(buf[:n]))
            # EOF: the daemon exited (closing its end), or kill() shut ours.
            if self.refusal is not None:
                raise self.refusal
            if self.daemon is None:
                raise self.error or TransferError("the page stream ended before the restore began")
            if code := self.daemon.wait():
                raise self.daemon.error(f"the lazy-pages daemon failed (exit {code})")
            return _drained(writer, self)
        finally:
            local.close()
            self._daemon_end.close()

    def _write(self, requests: Iterator[pb.PageData]) -> None:
        try:
            # The fault point breaks a transfer mid-way, after the restore (tests only).
            _feed(requests, self._local, self.received, self.max_bytes, ("target-pages", self.node))
        except FerryError as e:
            self.refusal = e
            _shutdown(self._local)
        except Exception as e:  # the source's stream broke off, or the daemon died
            self.error = TransferError(f"the page stream broke off: {e!r}", step="pages")
            _shutdown(self._local)  # a daemon waiting for pages fails instead of waiting forever

    def kill(self) -> None:
        if self.daemon is not None:
            self.daemon.kill()
        _shutdown(self._local)


def _feed(
    requests: Iterator[pb.PageData],
    sock: socket.socket,
    received: _Counter,
    max_bytes: int,
    fault: tuple[str, str] | None = None,
) -> None:
    """The source's bytes into `sock`, in order and under the lease's cap, counted as they go.
    `fault` (point, node) fires once FAULT_AFTER bytes have arrived."""
    for msg in requests:
        if msg.migration_id or msg.HasField("end"):
            raise TransferError("a page stream message came out of order", step="transfer intake")
        if received.bytes + len(msg.data) > max_bytes:
            raise TransferError(
                f"the page stream exceeds the lease's cap of {max_bytes} bytes", step="transfer intake"
            )
        before = received.bytes
        received.update(msg.data)
        if fault is not None and before < FAULT_AFTER <= received.bytes:
            faults.check(*fault)
        sock.sendall(msg.data)


def _shutdown(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
