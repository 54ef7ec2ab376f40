"""Fakes and helpers for the unit tests: no root, no CRIU, no process is ever really dumped.

The processes the tests start are plain `sleep` children of the test process.
FakeCriu stands in for agent.criu.runner.Criu: its dump writes a few image files and
SIGSTOPs the tree (as CRIU's --leave-stopped would), its restore starts a new
`sleep` child (as CRIU's rst_sibling restore would). FakePeer stands in for the
target agent; its push feeds a real transfer.Intake, so digests are checked.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil
from fake_cuda import CudaWorld, fake_cuda_jobs

from agent.client import from_rpc_error
from agent.criu.options import LOG_LEVEL
from agent.criu.runner import DumpResult, InheritFd, RestoreResult
from agent.errors import CriuError, FerryError, RefusedError
from agent.image import StreamDigest
from agent.jobs import procs
from agent.jobs.record import JobKind, JobRecord, JobState
from agent.jobs.registry import JobRegistry
from agent.migration.datatls import DataIdentity, DataTls
from agent.migration.journal import Journal
from agent.migration.pagestream import CHECK, TargetPages
from agent.migration.target import TargetMigrations
from agent.migration.transfer import Intake
from agent.rpc import pb

SLEEP = "/bin/sleep"
SH = "/bin/sh"

#: The files FakeCriu.dump writes; pages-1.img is the "host memory".
PAGES_BYTES = 64 << 10


def node_parts(registry: JobRegistry, node: str) -> tuple[Any, Journal]:
    """What an agent hands a move's parts, for a node of a test whose jobs hold no GPUs: its CUDA
    side (a fake world without GPUs, with a ledger of its own) and its one journal."""
    cuda_jobs, _ = fake_cuda_jobs(CudaWorld([]), node)
    return cuda_jobs, Journal(registry.root.parent)


def target_migrations(
    registry: JobRegistry, criu: Any, staging_root: Path, node: str = "nodeb"
) -> TargetMigrations:
    """A target's migrations wired as the agent wires them (node_parts; the CUDA side's ledger)."""
    cuda_jobs, journal = node_parts(registry, node)
    return TargetMigrations(registry, criu, staging_root, node, cuda_jobs, journal, cuda_jobs.ledger)


def wait_for(pred: Callable[[], bool], timeout_s: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def proc_status(pid: int) -> str:
    try:
        return psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return "gone"


def is_stopped(pid: int) -> bool:
    return proc_status(pid) == psutil.STATUS_STOPPED


def wait_stopped(pid: int) -> None:
    wait_for(lambda: is_stopped(pid), what=f"pid {pid} to stop")


def wait_running(pid: int) -> None:
    wait_for(
        lambda: proc_status(pid) in (psutil.STATUS_SLEEPING, psutil.STATUS_RUNNING),
        what=f"pid {pid} to run",
    )


def is_dead(pid: int) -> bool:
    return proc_status(pid) in ("gone", psutil.STATUS_ZOMBIE)


def dies(pid: int, within_s: float = 5.0) -> bool:
    """Whether `pid` is dead within `within_s`: a SIGKILL is sent, not waited for, and a loaded
    machine may take a moment to deliver it."""
    deadline = time.monotonic() + within_s
    while not is_dead(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class FakePageServer:
    """agent.criu.runner.PageServer without CRIU (and without its TLS): a TCP listener on
    loopback whose one connection is copied into a pages file, as CRIU's would be."""

    def __init__(self, path: Path) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.path = path
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.listener.accept()
            with conn, open(self.path, "xb") as out:
                while data := conn.recv(1 << 16):
                    out.write(data)
        except OSError as e:
            self.error = e
        finally:
            self.listener.close()

    def wait(self, timeout_s: float | None) -> None:
        self._thread.join(timeout_s)
        if self.error is not None:
            raise CriuError("page-server", f"fake page server failed: {self.error}")

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()


class FakeCriu:
    """agent.criu.runner.Criu without CRIU: records calls, fails on request."""

    def __init__(self, node: str = "") -> None:
        self.node = node
        self.dumps: list[dict[str, Any]] = []
        self.restores: list[dict[str, Any]] = []
        self.dump_error: BaseException | None = None
        self.restore_error: BaseException | None = None
        self.usable = True
        #: What `criu check --feature` would say (uffd-noncoop: post-copy restores).
        self.features: set[str] = {"uffd-noncoop"}
        #: What lazy_dump_blocker would say: this fake runs no `criu dump --lazy-pages`.
        self.lazy_blocker = "the fake CRIU serves no post-copy dump"
        #: Called inside restore (before it returns), to act while the target is RESTORING.
        self.during_restore: Callable[[], None] | None = None
        #: Pids of the children restore started; the fixture kills them.
        self.spawned: list[int] = []
        self.page_server_error: BaseException | None = None
        #: A fake_cuda.CudaWorld: dump and restore carry its CUDA state like CRIU carries memory.
        self.cuda_world: Any = None

    def feature(self, name: str) -> bool:
        return name in self.features

    def lazy_dump_blocker(self) -> str:
        return self.lazy_blocker

    def require_usable(self) -> str:
        if not self.usable:
            raise RefusedError("criu not found", step="criu check", node=self.node, hint="run `make criu`")
        return "4.2.1"

    def dump(
        self,
        pid: int,
        images_dir: Path,
        *,
        leave_running: bool = False,
        leave_stopped: bool = True,
        shell_job: bool = False,
        timeout_s: int = 0,
        on_start: Callable[[int], None] | None = None,
        page_server: tuple[str, int] | None = None,
        tls: Any = None,
        log_dir: Path | None = None,
        external: list[str] | None = None,
        track_mem: bool = False,
        parent_img: str = "",
        log_level: int = 4,
    ) -> DumpResult:
        self.dumps.append(
            {
                "pid": pid,
                "images_dir": images_dir,
                "shell_job": shell_job,
                "streamed": page_server is not None,
                "tls": tls,
                "log_dir": log_dir,
                "track_mem": track_mem,
                "parent_img": parent_img,
                "log_level": log_level,
            }
        )
        if self.dump_error is not None:
            raise self.dump_error
        # As CRIU documents: tracking needs the kernel's help (mem_dirty_track), an increment needs
        # tracking and its parent's inventory, and links the parent as `parent`.
        if track_mem and "mem_dirty_track" not in self.features:
            raise CriuError("dump", "Tracking memory is not available. Consider omitting --track-mem option.")
        if parent_img:
            if not track_mem:
                raise CriuError("dump", "an incremental dump needs --track-mem")
            if not (images_dir / parent_img / "inventory.img").is_file():
                raise CriuError("dump", "Pid-reuse detection failed: no parent inventory")
            os.symlink(parent_img, images_dir / "parent")
        (images_dir / "inventory.img").write_bytes(b"inventory")
        (images_dir / f"core-{pid}.img").write_bytes(b"core" * 100)
        (images_dir / "pstree.img").write_bytes(b"pstree")
        pages = os.urandom(PAGES_BYTES // 8 if parent_img else PAGES_BYTES)  # an increment: what was written
        if page_server is not None:  # the memory goes to the page server instead
            assert tls is not None, "the job's memory never crosses a network without TLS"
            try:
                with socket.create_connection(page_server, timeout=10) as conn:
                    conn.sendall(pages)
            except OSError as e:  # the far side went away: CRIU's dump fails
                raise CriuError("dump", f"page-xfer: can't write to the page server: {e}") from e
        else:
            (images_dir / "pages-1.img").write_bytes(pages)
        (images_dir / "criu-dump.log").write_text("a log for people; it never travels\n")
        if self.cuda_world is not None:
            self.cuda_world.save_image(procs.tree_pids(pid), images_dir)
        if leave_stopped and not leave_running:
            os.kill(pid, signal.SIGSTOP)
            wait_stopped(pid)
        return DumpResult(
            stats={"frozen_time": 1234, "pages_written": PAGES_BYTES // os.sysconf("SC_PAGE_SIZE")}
        )

    def page_server(
        self, images_dir: Path, log_dir: Path | None = None, *, address: str, tls: Any
    ) -> FakePageServer:
        """Writes what its one connection brings into pages-65537.img until EOF, as CRIU's would."""
        if self.page_server_error is not None:
            raise self.page_server_error
        assert tls is not None and address
        return FakePageServer(images_dir / "pages-65537.img")

    def restore(
        self,
        images_dir: Path,
        *,
        inherit: list[InheritFd] = (),  # type: ignore[assignment]
        shell_job: bool = False,
        log_dir: Path | None = None,
        on_start: Callable[[int], None] | None = None,
        leave_stopped: bool = False,
        lazy_pages: bool = False,
        root: str = "",
        external: list[str] | None = None,
        track_mem: bool = False,
        log_level: int = LOG_LEVEL,
    ) -> RestoreResult:
        assert not lazy_pages, "post-copy runs against real CRIU only (tests/integration)"
        self.restores.append(
            {
                "images_dir": images_dir,
                "files": sorted(p.name for p in images_dir.iterdir()),
                "keys": [i.key for i in inherit],
                "shell_job": shell_job,
                "log_dir": log_dir,
                "track_mem": track_mem,
                "log_level": log_level,
            }
        )
        if self.during_restore is not None:
            self.during_restore()
        if self.restore_error is not None:
            raise self.restore_error
        link = images_dir / "parent"  # CRIU reads an increment's clean pages from its chain
        while link.is_symlink():
            if not (link / "pages-1.img").is_file():
                raise CriuError("restore", f"can't open the parent images of {link.parent}")
            link = link / "parent"
        # The "restored job": prints once a little later (its first progress), then sleeps.
        actions = [(os.POSIX_SPAWN_DUP2, inherit[0].fd, 1)] if inherit else []
        pid = os.posix_spawn(
            SH,
            [SH, "-c", f"sleep 0.3; echo restored; exec {SLEEP} 60"],
            dict(os.environ),
            file_actions=actions,
            setsid=True,
        )
        self.spawned.append(pid)
        if leave_stopped:
            os.kill(pid, signal.SIGSTOP)
            wait_stopped(pid)
        if self.cuda_world is not None:
            self.cuda_world.load_image(images_dir, pid)
        return RestoreResult(pid=pid, stats={})

    def cleanup(self) -> None:
        for pid in self.spawned:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in self.spawned:
            # The registry's watch thread reaps a restored child; reap it here only if none did.
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.01)
            else:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)


class FakePeer:
    """The target agent as a source sees it (agent.migration.model.Peer).

    Like every real target it grants the page stream, and takes it as a real target does
    (agent.migration.pagestream.TargetRelay into a page server writing its staging);
    `page_stream=False` is a target that grants only the staged push. `fail[method]` is an
    exception that method raises; `status_answers` are returned (or raised) by status() in
    turn, the last one repeating.
    """

    def __init__(
        self,
        staging: Path,
        *,
        address: str = "127.0.0.1:7071",
        node_name: str = "nodeb",
        agent_id: str = "target-agent",
        page_stream: bool = True,
    ) -> None:
        self.address = address
        self.node_name = node_name
        self.agent_id = agent_id
        self.staging = staging
        self.calls: list[str] = []
        self.fail: dict[str, BaseException] = {}
        self.status_answers: list[int | BaseException] = [pb.TARGET_STATE_UNKNOWN]
        self.prepare_req: pb.PrepareRequest | None = None
        self.commit_req: pb.CommitRequest | None = None
        self.aborts: list[tuple[str, str]] = []
        self.manifest = None
        self.received: dict[str, bytes] = {}
        #: Applied to each chunk before intake, to corrupt it in transit.
        self.mangle: Callable[[pb.ImageChunk], pb.ImageChunk] = lambda c: c
        self.page_stream = page_stream
        #: What the page stream delivered (None: no stream came).
        self.pages: StreamDigest | None = None

    def _enter(self, method: str) -> None:
        self.calls.append(method)
        if method in self.fail:
            raise self.fail[method]

    def info(self) -> pb.NodeInfo:
        self._enter("info")
        return pb.NodeInfo(node_name=self.node_name, agent_id=self.agent_id, criu_version="4.2.1")

    def prepare(self, req: pb.PrepareRequest) -> pb.Lease:
        self.prepare_req = req
        self._enter("prepare")
        self.data_identity = DataIdentity.new(f"{self.node_name} {req.migration_id}")
        return pb.Lease(
            migration_id=req.migration_id,
            node_name=self.node_name,
            max_bytes=1 << 30,
            page_stream=self.page_stream,
            data_cert=self.data_identity.cert_pem if self.page_stream else b"",
        )

    def stream_pages(self, requests: Iterable[pb.PageData]) -> LocalPageCall:
        self._enter("stream_pages")
        return LocalPageCall(self, requests)

    def serve_pages(self, requests: Iterator[pb.PageData]) -> Iterator[pb.PageData]:
        """What a target's StreamPages does: the migration id first; then where a page server
        writing staging listens; at the source's end, what it wrote."""
        first = next(requests, None)
        assert first is not None and first.migration_id, "a page stream starts with its migration id"
        assert self.prepare_req is not None and self.prepare_req.data_cert
        self.staging.mkdir(parents=True, exist_ok=True)
        tls = DataTls(self.data_identity, self.prepare_req.data_cert, self.staging.parent)
        pages = TargetPages(
            FakeCriu(self.node_name), self.staging, 1 << 30, self.node_name, tls.files, "127.0.0.1"
        )
        try:
            digest = yield from pages.run(requests)
        except BaseException:
            pages.kill()
            raise
        finally:
            tls.close()
        self.pages = digest
        yield pb.PageData(end=pb.PageStreamEnd(bytes=digest.bytes, check=CHECK))

    def push(self, chunks: Iterator[pb.ImageChunk]) -> pb.PushImageResponse:
        self._enter("push")
        self.staging.mkdir(parents=True, exist_ok=True)
        intake = Intake(self.staging, 1 << 30, self.node_name)
        try:
            for chunk in chunks:
                intake.feed(self.mangle(chunk))
            self.manifest = intake.finish()
        finally:
            intake.close()
        self.received = {p.name: p.read_bytes() for p in self.staging.iterdir()}
        return pb.PushImageResponse(bytes=intake.bytes, files=len(intake.received))

    def commit(self, req: pb.CommitRequest) -> pb.CommitResponse:
        self.commit_req = req
        self._enter("commit")
        return pb.CommitResponse(
            node_name=self.node_name,
            pid=4242,
            phases=[pb.PhaseTiming(phase="restore", seconds=0.25)],
            resumed_after_s=0.0001,
            answered_after_s=0.0002,  # within the call, as a real target's is
        )

    def abort(self, migration_id: str, reason: str) -> None:
        self.aborts.append((migration_id, reason))
        self._enter("abort")

    def status(self, migration_id: str) -> int:
        self.calls.append("status")
        answer = self.status_answers.pop(0) if len(self.status_answers) > 1 else self.status_answers[0]
        if isinstance(answer, BaseException):
            raise answer
        return answer


def launched_record(
    name: str, proc: subprocess.Popen[bytes], out: Path, err: Path, cwd: str = "/"
) -> JobRecord:
    """A record like `ferry run` makes, for a process the test started."""
    return JobRecord(
        name=name,
        kind=JobKind.LAUNCHED,
        state=JobState.RUNNING,
        pid=proc.pid,
        pid_started=procs.create_time(proc.pid),
        command=[SLEEP, "60"],
        cwd=cwd,
        stdout_path=str(out),
        stderr_path=str(err),
    )


class LocalPageCall:
    """agent.migration.pagestream.PageCall straight onto a TargetMigrations (or a FakePeer's
    serve_pages) in this process."""

    def __init__(self, target: Any, requests: Iterable[pb.PageData]) -> None:
        serve = target.serve_pages if isinstance(target, FakePeer) else target.stream_pages
        self._answers = serve(iter(requests))

    def __iter__(self) -> Iterator[pb.PageData]:
        return self._answers

    def cancel(self) -> None:
        """Nothing to cancel: the source closing its sockets ends the request stream."""


class LocalPeer:
    """agent.migration.model.Peer straight onto a TargetMigrations in this process: the shared
    in-process peer of the unit tests."""

    address = "127.0.0.1:7071"

    def __init__(self, target: Any) -> None:
        self.target = target

    def info(self) -> pb.NodeInfo:
        return pb.NodeInfo(node_name="nodeb", agent_id="target-agent")

    def prepare(self, req: pb.PrepareRequest) -> pb.Lease:
        return self.target.prepare(req)

    def stream_pages(self, requests: Iterable[pb.PageData]) -> LocalPageCall:
        return LocalPageCall(self.target, requests)

    def push(self, chunks: Iterator[pb.ImageChunk]) -> pb.PushImageResponse:
        return self.target.push(chunks)

    def commit(self, req: pb.CommitRequest) -> pb.CommitResponse:
        return self.target.commit(req)

    def abort(self, migration_id: str, reason: str) -> None:
        self.target.abort(migration_id, reason)

    def stop_moved(self, migration_id: str, timeout_s: float) -> Any:
        return self.target.registry.stop_later(self.target.moved_here(migration_id), timeout_s)

    def status(self, migration_id: str) -> int:
        return self.target.status(migration_id)


#: Every status a gRPC call can end with but OK.
FAULT_CODES = [c for c in grpc.StatusCode if c is not grpc.StatusCode.OK]


def rpc_error(code: grpc.StatusCode, address: str = "127.0.0.1:7071") -> FerryError:
    """What a source sees when a call to the target ends with `code`, as the real client maps it
    (agent.client.from_rpc_error)."""

    class _E(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return code

        def details(self) -> str:
            return f"injected {code.name}"

    return from_rpc_error(_E(), address, "test")
