"""The source's end of one migration's data connection: what it is, who may use it, how it ends.

One owner for the pieces a source needs to send the job's memory CRIU to CRIU
(agent/migration/pagestream.py): its one-time identity, the TLS files once the lease names the
target's certificate, the StreamPages control, and the cut that makes its CRIU fail at once
when that control breaks. The target keeps its own pieces on its Incoming record.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Callable, Iterable
from pathlib import Path

from agent.jobs import procs
from agent.migration.datatls import DataIdentity, DataTls, check_peer_cert
from agent.migration.pagestream import PageCall, SourcePages
from agent.migration.sockets import cut_connection, free_port, route_address
from agent.rpc import pb

log = logging.getLogger(__name__)


class SourceDataPath:
    def __init__(
        self, migration_id: str, node: str, criu: Callable[[], tuple[int, float]], staging_root: Path
    ) -> None:
        self.migration_id = migration_id
        self.node = node
        self.staging_root = staging_root  # where the one-time key goes (datatls.KEYS_PREFIX)
        self.criu = criu  # the CRIU at our end of the connection: its pid and start time, journaled
        self.identity = DataIdentity.new(f"{node} {migration_id}")
        self.tls: DataTls | None = None
        self.pages: SourcePages | None = None
        self.job_pid = 0  # the job's root: its own sockets are never cut
        self.host = ""
        self.port = 0
        self.listening = False  # a lazy dump: our CRIU listens at host:port

    @property
    def cert(self) -> bytes:
        return self.identity.cert_pem

    def accept(self, lease: pb.Lease) -> bool:
        """The lease's side of it: whether the target takes the memory on a data connection."""
        if not (lease.page_stream and lease.data_cert):
            return False
        check_peer_cert(lease.data_cert, f"target {lease.node_name}")
        self.tls = DataTls(self.identity, lease.data_cert, self.staging_root)
        return True

    def open(
        self,
        open_call: Callable[[Iterable[pb.PageData]], PageCall],
        job_pid: int,
        step: str,
        progress: Callable[[int], None] = lambda n: None,
    ) -> None:
        self.job_pid = job_pid
        self.pages = SourcePages(open_call, self.migration_id, self.node, step, progress, self.cut)

    def target(self, dialed_host: str) -> tuple[str, int]:
        """Pre-copy: where the target's page server listens; our dump connects there."""
        assert self.pages is not None
        self.host, self.port = self.pages.target_address(dialed_host)
        return self.host, self.port

    def listen(self, target_host: str) -> tuple[str, int]:
        """Post-copy: where our lazy dump is to listen, on our address toward the target."""
        self.host = route_address(target_host)
        self.port = free_port(self.host)
        self.listening = True
        return self.host, self.port

    def cut(self) -> None:
        """CRIU's data connection, shut down: CRIU fails at once and lets the job go."""
        pid, started = self.criu()
        if not (pid and self.port and procs.alive(pid, started)):
            return
        job = procs.tree_pids(self.job_pid) if self.job_pid else []
        n = cut_connection(pid, self.port, spare=job)
        if self.listening and not n:
            # Still waiting for the target to connect: a connection that fails its TLS ends the wait.
            with contextlib.suppress(OSError), socket.create_connection((self.host, self.port), timeout=2):
                pass
        log.info("migration %s: cut CRIU's data connection (%d socket(s))", self.migration_id, n)

    def close(self) -> None:
        if self.pages is not None:
            self.pages.close()
        if self.tls is not None:
            self.tls.close()
