"""The `criu swrk` exchange: one protobuf request and its answer over a SEQPACKET socketpair.

A tracked dump's answer carries descriptors beside it (SCM_RIGHTS: the userfaultfds that keep
the tree's written memory tracked, agent.criu.tracking); any answer's are taken, and closed
unless the caller keeps them.

Every read has a deadline. One that expires kills CRIU (a CRIU left running may hold
the job frozen) and raises StepTimeoutError naming the step, the node, the images and
CRIU's log; a lost connection or a CRIU that exits without answering is a CriuError.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from agent.criu import child
from agent.criu import logs as criu_logs
from agent.criu.tracking import close_fds
from agent.errors import CriuError
from agent.jobs import procs

try:
    from agent.criu_pb import rpc_pb2
except ImportError as e:  # pragma: no cover - only without a build
    raise SystemExit("ferry: CRIU's protos are not compiled (agent/criu_pb); run `make proto`") from e

log = logging.getLogger(__name__)

_MAX_MSG = 1 << 20
#: The most descriptors one answer carries (CRIU's CR_SCM_MAX_FD).
_MAX_FDS = 252
#: How long CRIU may take to start a page server and say so (it only opens its images).
START_TIMEOUT_S = 60.0
#: A dump or restore exchange, unless the caller gives its own deadline. CRIU moves the job's
#: memory at disk or stream speed: an hour is ~1 TiB at 300 MB/s. Only a stuck CRIU (a hung
#: mount, a page server that stopped reading) should reach it, with the job frozen meanwhile.
SWRK_TIMEOUT_S = 3600.0
#: A page server lives as long as the dump that feeds it (bounded as above), plus its start.
PAGE_SERVER_MAX_S = SWRK_TIMEOUT_S + START_TIMEOUT_S


def start(
    binary: str, op: str, node: str, pass_fds: list[int], stderr: int
) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """`criu swrk` on one end of a SEQPACKET pair, no plugins; the other end is returned."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        proc = subprocess.Popen(
            [binary, "swrk", str(theirs.fileno())],
            env=child.env(),
            pass_fds=[theirs.fileno(), *pass_fds],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    except OSError as e:
        ours.close()
        raise CriuError(op, f"cannot start {binary}: {e}", node=node) from e
    finally:
        theirs.close()
    return proc, ours


def exchange(
    binary: str,
    node: str,
    op: str,
    req: rpc_pb2.criu_req,
    *,
    images_dir: Path,
    log_path: str,
    pass_fds: list[int],
    on_start: Callable[[int], None] | None,
    deadline_s: float,
    keep_fds: Callable[[rpc_pb2.criu_resp, list[int]], None] | None = None,
) -> rpc_pb2.criu_resp:
    """Run one swrk for req; its successful answer, within deadline_s. `keep_fds` takes the
    descriptors a successful answer carries, with it (closed otherwise)."""
    fds: list[int] = []
    # stderr to a file, not a pipe: a pipe nobody reads until CRIU answers could fill and stall it.
    with tempfile.TemporaryFile() as err:
        proc, ours = start(binary, op, node, pass_fds, stderr=err.fileno())
        try:
            if on_start is not None:
                on_start(proc.pid)
            data, fds = ask(ours, req, deadline_s)
        except ConnectionResetError:  # it exited without reading the request: its stderr says why
            data = b""
        except TimeoutError:
            raise child.timed_out(
                proc,
                op,
                f"CRIU did not answer within {deadline_s:g} s",
                node=node,
                images_dir=images_dir,
                log_path=log_path,
            ) from None
        except OSError as e:
            cause = f"lost the RPC connection to criu swrk: {e}"
            raise CriuError(op, cause, log_path=log_path, node=node) from e
        finally:
            ours.close()  # swrk exits on EOF
            child.finish(proc)
        if not data:
            err.seek(0)
            detail = err.read().decode(errors="replace").strip().splitlines()[-1:] or ["no response"]
            cause = f"criu swrk exited ({proc.returncode}): {detail[0]}"
            raise CriuError(op, cause, log_path=log_path, node=node)
    resp = rpc_pb2.criu_resp()
    try:
        resp.ParseFromString(data)
    except Exception:
        close_fds(fds)
        raise
    if fds and resp.success and keep_fds is not None:
        keep_fds(resp, fds)
    else:
        close_fds(fds)
    if not resp.success:
        cause = criu_logs.cause(log_path, resp.cr_errmsg) or "CRIU reported failure"
        raise CriuError(op, cause, log_path=log_path, errno=resp.cr_errno, node=node)
    log.debug("criu %s ok (log %s)", op, log_path)
    return resp


def ask(sock: socket.socket, req: rpc_pb2.criu_req, timeout_s: float) -> tuple[bytes, list[int]]:
    """Send req and read the answer and the descriptors beside it, both within timeout_s
    (TimeoutError otherwise). The caller owns the descriptors."""
    deadline = time.monotonic() + timeout_s
    # Never 0: that would make the socket non-blocking, and its error no timeout.
    sock.settimeout(max(timeout_s, 1e-3))
    sock.send(req.SerializeToString())
    sock.settimeout(max(deadline - time.monotonic(), 1e-3))
    data, fds, _, _ = socket.recv_fds(sock, _MAX_MSG, _MAX_FDS)
    return data, fds


class PageServer:
    """A running `criu page-server` child of a `criu swrk` we hold the RPC socket of."""

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        sock: socket.socket,
        log_path: str,
        node: str,
        *,
        images_dir: Path | None = None,
    ) -> None:
        self.proc = proc
        self.sock = sock
        self.log_path = log_path
        self.node = node
        self.images_dir = images_dir
        self.pid = 0
        self.port = 0  # where it listens, once started
        #: The server as a pidfd, taken as soon as CRIU names it: a kill through it reaches that
        #: process or none, never another that got its PID after it was reaped. Where pidfds are
        #: refused (an old kernel, a seccomp profile), its start time tells it apart instead.
        self._pidfd = -1
        self._started = 0.0

    def started(self, pid: int, port: int) -> None:
        """CRIU says its page server runs as pid. PAGE_SERVER_CHLD forks it from our swrk, which
        reaps it only when asked (WAIT_PID) or when swrk itself ends: until then the PID is its
        own, so the child of our swrk with that PID is the server."""
        self.pid, self.port = pid, port
        try:
            self._pidfd = os.pidfd_open(pid)
        except OSError as e:
            log.debug("no pidfd for criu page server %d (%s): its start time identifies it", pid, e)
        if procs.parent(pid) != self.proc.pid:  # gone already, or not the process CRIU started
            log.warning("criu page server pid %d is gone, or not a child of swrk %d", pid, self.proc.pid)
            self._close_pidfd()
            return
        self._started = procs.create_time(pid)

    def request(self, req: rpc_pb2.criu_req, timeout_s: float | None = None) -> rpc_pb2.criu_resp:
        """One request and its answer within timeout_s (None: PAGE_SERVER_MAX_S); on expiry the
        server and its swrk are killed."""
        timeout_s = PAGE_SERVER_MAX_S if timeout_s is None else timeout_s
        try:
            data, fds = ask(self.sock, req, timeout_s)
            close_fds(fds)  # a page server's answers carry none
        except TimeoutError:
            self._kill_server()
            self.sock.close()
            raise child.timed_out(
                self.proc,
                "page-server",
                f"CRIU's page server did not answer within {timeout_s:g} s",
                node=self.node,
                images_dir=self.images_dir,
                log_path=self.log_path,
            ) from None
        except OSError as e:
            cause = f"lost the RPC connection to criu swrk: {e}"
            raise CriuError("page-server", cause, log_path=self.log_path, node=self.node) from e
        if not data:
            raise CriuError("page-server", "criu swrk exited", log_path=self.log_path, node=self.node)
        resp = rpc_pb2.criu_resp()
        resp.ParseFromString(data)
        return resp

    def wait(self, timeout_s: float | None) -> None:
        """Until the server has exited (within timeout_s; None: PAGE_SERVER_MAX_S); raise unless
        it wrote every page it was sent."""
        try:
            resp = self.request(rpc_pb2.criu_req(type=rpc_pb2.WAIT_PID, pid=self.pid), timeout_s)
        finally:
            self.close()
        status = resp.status if resp.HasField("status") else -1
        if not resp.success or status != 0:
            cause = criu_logs.cause(self.log_path) or f"page server ended with wait status {status}"
            raise CriuError("page-server", cause, log_path=self.log_path, node=self.node)

    def kill(self) -> None:
        """Stop it now (an aborted migration); its swrk parent then exits too."""
        self._kill_server()
        self.close()

    def close(self) -> None:
        self.sock.close()
        child.finish(self.proc)
        self._close_pidfd()

    def _close_pidfd(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1

    def _kill_server(self) -> None:
        # Never by bare PID: once the server has exited and been reaped, that PID may be anyone's.
        with contextlib.suppress(ProcessLookupError):
            if self._pidfd >= 0:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            elif self._started and procs.alive(self.pid, self._started):
                os.kill(self.pid, signal.SIGKILL)
