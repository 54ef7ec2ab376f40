"""The job's memory on a data connection between the two nodes' CRIUs; StreamPages controls it.

No byte of the job's memory passes through an agent. Pre-copy: the target starts `criu
page-server` listening on its data address, the source's `criu dump` connects there and sends
the pages while it dumps, and the page server writes them into the target's staging; the source
never stages them. Post-copy (the default where both nodes can): the source's `criu dump
--lazy-pages` listens, and at the restore the target's `criu lazy-pages` connects and fetches
each page straight into the restored job's memory (userfaultfd) when the job touches it, and
the rest in the background.

The connection is CRIU's own TLS (GnuTLS), each side trusting only the other's one-time
certificate (agent.migration.datatls), which the agents exchanged in Prepare over their
mutual-TLS link. The StreamPages call carries the rest: where the listening CRIU is, what each
side's CRIU counted, and the end. The source's count (its dump's page statistics) travels in
its end; the target's is what its page server wrote, and it restores only if they match. TLS's
AEAD authenticates every record, so a checksum of ours would add nothing. The target holds the
lease's cap by watching its staging and cutting the connection past it.

When the call breaks (the other agent died, the link went), the agent cuts its CRIU's data
connection (shutdown of CRIU's socket, duplicated through pidfd_getfd): CRIU then fails as on a
broken pipe and lets the job go, instead of waiting out TCP's retransmissions for 15 minutes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable, Generator, Iterable, Iterator
from pathlib import Path
from typing import Protocol

from agent import faults
from agent.client import split_address
from agent.criu.lazy import LazyPagesDaemon, gone_before_restore_end
from agent.criu.options import TlsFiles
from agent.criu.runner import Criu, PageServer
from agent.errors import FerryError, StepTimeoutError, TransferError
from agent.image import PAGES_PREFIX, StreamDigest
from agent.jobs import procs
from agent.migration.staging import is_full, no_space
from agent.rpc import pb

log = logging.getLogger(__name__)

PAGE = os.sysconf("SC_PAGE_SIZE")
#: How the bytes were checked: TLS records (AEAD) on the wire, counted by both CRIUs.
CHECK = "tls"
#: After CRIU is done, how long the other side may take to report (a page server flushing).
DRAIN_S = 120.0
#: How long the target may take to say where its page server listens.
ANSWER_S = 60.0
#: How often the target looks at what its page server has written: against the lease's cap,
#: and for the source's progress display, which hears of every PROGRESS_BYTES more.
PROGRESS_S = 0.2
PROGRESS_BYTES = 64 << 20
#: Where the target's post-copy fault point fires (tests only): once this much of the restored
#: job is resident, the transfer is cut.
FAULT_AFTER = 16 << 20
#: A listening address that means "every address of this node": the peer uses the one it dialed.
WILDCARD = ("", "0.0.0.0", "::")


def sent_bytes(stats: dict[str, int]) -> int:
    """The page bytes a dump sent to its page server, from CRIU's dump statistics."""
    return (stats.get("pages_written", 0) + stats.get("shpages_written", 0)) * PAGE


def lazy_bytes(stats: dict[str, int]) -> int:
    """The page bytes a lazy dump left for the target to fetch."""
    return stats.get("pages_lazy", 0) * PAGE


def staged_page_bytes(staging: Path) -> int:
    """What a page server has written so far: the pages files in staging."""
    total = 0
    with contextlib.suppress(FileNotFoundError):
        for p in staging.iterdir():
            if p.name.startswith(PAGES_PREFIX):
                with contextlib.suppress(FileNotFoundError):
                    total += p.stat().st_size
    return total


class PageCall(Protocol):
    """The source's side of a StreamPages call: the target's messages, and a way to end it."""

    def __iter__(self) -> Iterator[pb.PageData]: ...
    def cancel(self) -> None: ...


class SourcePages:
    """The source's control of one page stream.

    Pre-copy: `target_address()` is where the target's page server listens (the dump connects
    there); `finish(sent)` after the dump returns checks that the target wrote what CRIU sent.
    Post-copy: `announce()` says where the lazy dump listens; `finish()` once it has ended.
    `on_break` runs if the call breaks before its end: it cuts CRIU's data connection.
    """

    def __init__(
        self,
        open_call: Callable[[Iterable[pb.PageData]], PageCall],
        migration_id: str,
        node: str,
        step: str = "dump",
        progress: Callable[[int], None] = lambda n: None,
        on_break: Callable[[], None] = lambda: None,
    ) -> None:
        self.migration_id = migration_id
        self.progress = progress
        self.node = node
        self.step = step
        self.on_break = on_break
        self.address: tuple[str, int] | None = None
        self.end: pb.PageStreamEnd | None = None
        self.error: FerryError | None = None
        self._closing = False
        self._out: queue.Queue[pb.PageData | None] = queue.Queue()
        self._out.put(pb.PageData(migration_id=migration_id))
        self._addressed = threading.Event()
        self._call = open_call(self._requests())
        self._answers = threading.Thread(target=self._read_answers, name="page-control", daemon=True)
        self._answers.start()

    def _requests(self) -> Iterator[pb.PageData]:
        while (msg := self._out.get()) is not None:
            yield msg

    def _read_answers(self) -> None:
        try:
            for msg in self._call:
                if msg.data_address:
                    self.address = split_address(msg.data_address)
                    self._addressed.set()
                if msg.written:
                    self.progress(msg.written)
                if msg.HasField("end"):
                    self.end = msg.end
        except FerryError as e:
            self.error = e
        except Exception as e:  # the call itself broke: the target or the link is gone
            self.error = TransferError(f"the page stream's control call broke: {e!r}", step=self.step)
        finally:
            self._addressed.set()
            if self.end is None and not self._closing:
                self.on_break()  # CRIU must not wait on a connection nobody will finish

    def target_address(self, dialed_host: str, timeout_s: float = ANSWER_S) -> tuple[str, int]:
        """Where the target's page server listens (its wildcard: the host we dialed)."""
        if not self._addressed.wait(timeout_s):
            raise StepTimeoutError(
                f"the target did not say where its page server listens within {timeout_s:g} s", step=self.step
            )
        if self.address is None:
            raise self.error or TransferError(
                "the target ended the page stream before its page server listened", step=self.step
            )
        host, port = self.address
        return (dialed_host if host in WILDCARD else host), port

    def announce(self, host: str, port: int) -> None:
        self._out.put(pb.PageData(data_address=f"{host}:{port}"))

    def settled_error(self, timeout_s: float = 1.0) -> FerryError | None:
        """The call's failure, waiting a little for it: a CRIU that failed on its data connection
        usually did so because the target refused the stream, and that reason is the one to say."""
        self._answers.join(timeout_s)
        return self.error

    def finish(self, sent: int, timeout_s: float = DRAIN_S) -> StreamDigest:
        self._out.put(pb.PageData(end=pb.PageStreamEnd(bytes=sent, check=CHECK)))
        self._out.put(None)
        self._answers.join(timeout_s)
        if self._answers.is_alive():
            raise StepTimeoutError(
                f"the target did not confirm the page stream within {timeout_s:.0f} s", step=self.step
            )
        if self.error is not None:
            raise self.error
        if self.end is None:
            raise TransferError("the target ended the page stream without confirming it", step=self.step)
        if (self.end.bytes, self.end.check) != (sent, CHECK):
            raise TransferError(
                f"the page stream arrived incomplete: this node's CRIU sent {sent} bytes, the target's "
                f"page server wrote {self.end.bytes}",
                step=self.step,
            )
        return StreamDigest(sent, CHECK)

    def close(self) -> None:
        """Give up (an aborted migration): end the call; the caller has cut or ended CRIU."""
        self._closing = True
        self.error = self.error or TransferError("the page stream was closed before it ended", step=self.step)
        self._out.put(None)
        self._call.cancel()
        self._answers.join(10)


def _source_end(requests: Iterator[pb.PageData], what: str) -> pb.PageStreamEnd:
    """The source's end: the one message left on its side of the call, before it half-closes."""
    end: pb.PageStreamEnd | None = None
    for msg in requests:
        if end is not None or not msg.HasField("end"):
            raise TransferError("a page stream message came out of order", step="transfer intake")
        end = msg.end
    if end is None:
        raise TransferError(f"the source ended the page stream before {what}", step="transfer")
    return end


class TargetPages:
    """Pre-copy on the target: a `criu page-server` listening for the source's dump, writing into
    staging, under the lease's cap. `run` is the StreamPages answer stream."""

    def __init__(
        self,
        criu: Criu,
        staging: Path,
        max_bytes: int,
        node: str,
        tls: TlsFiles,
        host: str = "0.0.0.0",
        log_dir: Path | None = None,
    ) -> None:
        self.criu = criu
        self.staging = staging
        self.max_bytes = max_bytes
        self.node = node
        self.tls = tls
        self.host = host
        self.log_dir = log_dir  # where the page server logs (kept if the migration fails)
        self.server: PageServer | None = None

    def run(self, requests: Iterator[pb.PageData]) -> Generator[pb.PageData, None, StreamDigest]:
        """Yield where the page server listens; return (via StopIteration) what it wrote."""
        self.server = self.criu.page_server(self.staging, self.log_dir, address=self.host, tls=self.tls)
        ends: queue.Queue[pb.PageStreamEnd | BaseException] = queue.Queue()

        def read_end() -> None:
            try:
                ends.put(_source_end(requests, "its dump ended"))
            except FerryError as e:  # handed to the generator, which raises it
                ends.put(e)
            except BaseException as e:  # the source's call broke off
                ends.put(TransferError(f"the page stream broke off: {e!r}", step="transfer"))

        try:
            yield pb.PageData(data_address=f"{self.host}:{self.server.port}")
            threading.Thread(target=read_end, name="page-control", daemon=True).start()
            shown = 0
            while True:  # what has arrived so far: within the cap, and for the source's progress
                try:
                    got = ends.get(timeout=PROGRESS_S)
                    break
                except queue.Empty:
                    # Said at once: the source's dump, failing as the page server goes, waits for it.
                    if is_full(self.staging):
                        raise no_space(self.staging, self.node) from None
                    n = self._within_cap()
                    if n - shown >= PROGRESS_BYTES:
                        shown = n
                        yield pb.PageData(written=n)
            if isinstance(got, BaseException):
                raise got
            end = got
            self.server.wait(DRAIN_S)  # the dump has closed the connection: the server ends
            wrote = self._within_cap()  # the last bytes may have come after the last look
            if wrote != end.bytes:
                raise TransferError(
                    f"the page stream arrived incomplete: the source's CRIU sent {end.bytes} bytes, "
                    f"the page server here wrote {wrote}",
                    step="transfer intake",
                )
            return StreamDigest(wrote, CHECK)
        except BaseException:
            self.kill()
            raise

    def _within_cap(self) -> int:
        """What the page server has written so far; past the lease's cap, a refusal."""
        if (n := staged_page_bytes(self.staging)) > self.max_bytes:
            raise TransferError(
                f"the page stream exceeds the lease's cap of {self.max_bytes} bytes ({n} written)",
                step="transfer intake",
            )
        return n

    def kill(self) -> None:
        if self.server is not None:
            self.server.kill()


class LazyTargetPages:
    """Post-copy on the target: the source says where its lazy dump listens, and `attach()` (at
    the commit) starts a `criu lazy-pages` daemon that connects there.

    The transfer is over when the daemon exits: 0 means every page of the restored tree arrived.
    Anything else means some did not, and those would read as zeros, so whoever runs this kills
    the job first (agent.migration.target).
    """

    def __init__(self, node: str, tls: TlsFiles, on_fail: Callable[[str], None] = lambda why: None) -> None:
        self.node = node
        self.tls = tls
        #: Runs before the daemon is stopped on a failure seen here: the job must be known lost
        #: before it dies of the pages it will never get.
        self.on_fail = on_fail
        self.source: tuple[str, int] | None = None
        self.daemon: LazyPagesDaemon | None = None
        self.refusal: FerryError | None = None
        self.error: FerryError | None = None
        self.end: pb.PageStreamEnd | None = None
        self._changed = threading.Condition()
        self._done = False

    def attach(self, criu: Criu, images_dir: Path, work_dir: Path, timeout_s: float) -> LazyPagesDaemon:
        """Start the daemon; a restore in work_dir then takes its pages from it."""
        with self._changed:
            if self.source is None:
                raise self.error or TransferError("the source never said where its lazy page server listens")
            host, port = self.source
        daemon = LazyPagesDaemon(criu, images_dir, work_dir, (host, port), self.tls, timeout_s)
        with self._changed:
            self.daemon = daemon
            self._changed.notify_all()
        return daemon

    def criu_started(self, criu_pid: int) -> None:
        """CRIU's restore runs as criu_pid. The fault point target-lazy-gone (tests only) kills
        the daemon once it has the restored tasks' userfaultfds and before CRIU says the restore
        is done; CRIU is held meanwhile, so that its end of the restore meets a daemon gone."""
        if "target-lazy-gone" in faults.active() and self.daemon is not None:
            args = (criu_pid, self.daemon)
            threading.Thread(target=gone_before_restore_end, args=args, name="lazy-gone", daemon=True).start()

    def watch(self, pid: int) -> None:
        """The restored job runs as pid: the fault point (tests only) cuts its transfer once
        FAULT_AFTER of it is resident."""
        if "target-pages" in faults.active():
            threading.Thread(target=self._fault, args=(pid,), name="lazy-fault", daemon=True).start()

    def _fault(self, pid: int) -> None:
        while not self._done and procs.tree_rss(pid) < FAULT_AFTER:
            threading.Event().wait(0.01)
        try:
            faults.check("target-pages", self.node)
        except FerryError as e:
            self.refusal = e
            self.on_fail(str(e))
            self.kill()

    def run(self, requests: Iterator[pb.PageData]) -> Generator[pb.PageData, None, StreamDigest]:
        """Wait for the daemon to end; yield nothing until then; return what the source counted."""
        reader = threading.Thread(target=self._read, args=(requests,), name="lazy-control", daemon=True)
        reader.start()
        try:
            with self._changed:
                while self.daemon is None and self.error is None and self.refusal is None:
                    self._changed.wait()
            if self.refusal is not None:
                raise self.refusal
            if self.daemon is None:
                raise self.error or TransferError("the page stream ended before the restore began")
            if code := self.daemon.wait():
                failed = self.daemon.error(f"the lazy-pages daemon failed (exit {code})")
                raise self.refusal or self.error or failed
            self._done = True
            reader.join(DRAIN_S)
            if self.end is None:
                raise self.error or StepTimeoutError("the source did not end the page stream", step="pages")
            sent = self.end.bytes
            yield pb.PageData(end=pb.PageStreamEnd(bytes=sent, check=CHECK))
            return StreamDigest(sent, CHECK)
        finally:
            self._done = True

    def _read(self, requests: Iterator[pb.PageData]) -> None:
        try:
            for msg in requests:
                with self._changed:
                    if msg.data_address and self.source is None:
                        self.source = split_address(msg.data_address)
                    elif msg.HasField("end") and self.end is None:
                        self.end = msg.end
                    else:
                        raise TransferError("a page stream message came out of order", step="transfer intake")
                    self._changed.notify_all()
            if self.end is None:
                raise TransferError("the source ended the page stream before the job had its memory")
        except FerryError as e:
            self._fail(e)
        except Exception as e:  # the source's call broke off: its CRIU serves no more pages
            self._fail(TransferError(f"the page stream broke off: {e!r}", step="pages"))

    def _fail(self, e: FerryError) -> None:
        with self._changed:
            self.error = self.error or e
            self._changed.notify_all()
        if not self._done:
            self.on_fail(str(e))
            self.kill()  # a daemon waiting for pages fails instead of waiting forever

    def kill(self) -> None:
        with self._changed:
            daemon = self.daemon
            self._changed.notify_all()
        if daemon is not None:
            daemon.kill()
