"""A real, single-member etcd for tests: mutual TLS with certificates from a ferry CA, a
throwaway data directory, and stop / restart / kill to play failures.

Runs Debian's `etcd` (`make etcd` installs it). With `prefix` (a node's namespace from
agent.testing.bed, or `nsenter --net=... --`) it runs inside that node; pass a `data_dir`
the node can see then, since a bed node mounts its own /tmp.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from agent import certs

# Ready once it serves clients over TLS, which etcd 3.4 starts after its member is published
# (so a leader is elected); its zap logger says this on every start.
READY = "serving client traffic securely"
# Raft timing (ms): a lone member elects itself within ~election timeout of (re)starting.
HEARTBEAT_MS = 50
ELECTION_MS = 250


def have_etcd() -> bool:
    return shutil.which("etcd") is not None


def free_port(host: str) -> int:
    """A port free on host now; an address this namespace lacks (a bed node's) falls back to
    loopback's choice, which a fresh namespace has free as well."""
    for addr in (host, "127.0.0.1"):
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
            return s.getsockname()[1]
    raise OSError(f"no free port on {host}")


class EtcdServer:
    """One etcd member; `endpoint` is what agent.coord.etcd.EtcdClient dials."""

    def __init__(
        self,
        ca_dir: Path,
        *,
        name: str = "etcd0",
        host: str = "127.0.0.1",
        port: int = 0,
        data_dir: Path | None = None,
        prefix: list[str] | None = None,
    ) -> None:
        self.ca_dir = ca_dir
        self.name = name
        self.host = host
        self.port = port or free_port(host)
        self.peer_port = free_port(host)
        self._own_dir = data_dir is None
        self.root = Path(tempfile.mkdtemp(prefix="ferry-etcd-")) if data_dir is None else data_dir
        self.data_dir = self.root / "data"
        self.log_path = self.root / "etcd.log"
        self.prefix = list(prefix or [])
        self.proc: subprocess.Popen[bytes] | None = None
        # The server's certificate names the address clients dial; it is a node certificate
        # (serverAuth and clientAuth) from the same CA the clients' come from.
        if not (ca_dir / f"{name}.pem").exists():
            certs.issue(ca_dir, name, certs.Role.NODE, [host])

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def command(self) -> list[str]:
        peer = f"http://{self.host}:{self.peer_port}"
        client = f"https://{self.endpoint}"
        return [
            *self.prefix,
            "etcd",
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster={self.name}={peer}",
            f"--cert-file={self.ca_dir / f'{self.name}.pem'}",
            f"--key-file={self.ca_dir / f'{self.name}-key.pem'}",
            f"--trusted-ca-file={self.ca_dir / certs.CA_CERT}",
            "--client-cert-auth",
            f"--heartbeat-interval={HEARTBEAT_MS}",
            f"--election-timeout={ELECTION_MS}",
            "--logger=zap",
            "--log-outputs=stderr",
        ]

    def start(self, timeout_s: float = 20.0) -> EtcdServer:
        if self.running():
            return self
        self.root.mkdir(parents=True, exist_ok=True)
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self._wait_ready(offset, timeout_s)
        return self

    def _wait_ready(self, offset: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.log_path.open("rb") as f:
                f.seek(offset)
                if READY.encode() in f.read():
                    return
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; log: {self.tail()}")
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"etcd not ready within {timeout_s:.0f} s; log: {self.tail()}")

    def tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _signal(self, sig: int, timeout_s: float) -> None:
        if not self.running():
            return
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)  # the group: a prefix's helpers go too
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self, timeout_s: float = 10.0) -> None:
        """A clean shutdown (SIGTERM); the data stays for restart()."""
        self._signal(signal.SIGTERM, timeout_s)

    def kill(self) -> None:
        """SIGKILL, as a crashed or powered-off member; the data stays for restart()."""
        self._signal(signal.SIGKILL, 10.0)

    def restart(self, down_s: float = 0.0, timeout_s: float = 20.0) -> EtcdServer:
        """Stop, stay down for down_s, start again on the same data and ports."""
        self.stop()
        time.sleep(down_s)
        return self.start(timeout_s)

    def close(self) -> None:
        self.kill()
        if self._own_dir:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
