"""Agents on this machine, for the demo, the benchmark and the integration tests.

Each agent is a real `ferry agent` process with its own state and staging
directories and its own local socket: two of them are two "nodes" on one host.
Agents speak plaintext on loopback (`--insecure`) unless given a TLS directory
holding certificates from `ferry certs`; the CLI reaches each through its
unix socket, as an operator on the node would. An agent given `nvml_replay` (a telemetry file,
agent/testing/nvml_replay.py) runs under agent.testing.agent, which answers NVML from that file:
GPUs on a machine without one.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from itertools import count
from pathlib import Path

from agent.jobs import procs

_LISTENING = re.compile(r"listening on ([0-9.]+:\d+)")
_METRICS = re.compile(r"metrics on ([0-9.]+:\d+)/metrics")
_SEQ = count()
#: CLI commands that run on their own, not through the agent's socket.
_LOCAL_COMMANDS = ("inspect", "doctor", "certs")


class LocalAgent:
    def __init__(
        self,
        root: Path,
        node: str,
        env: dict[str, str] | None = None,
        tls_dir: Path | None = None,
        host: str = "127.0.0.1",
        staging_dir: Path | None = None,
        config: Path | None = None,
        nvml_replay: Path | None = None,
        metrics: bool = False,
    ) -> None:
        self.root = root / node
        self.metrics = metrics  # serve Prometheus metrics on a free loopback port
        self.metrics_address = ""
        self.config = config  # `ferry agent --config`: health thresholds, policy, peers
        self.nvml_replay = nvml_replay  # NVML answered from this telemetry file (None: the real one)
        self.node = node
        self.state_dir = self.root / "state"
        self.staging_dir = staging_dir or Path("/dev/shm") / f"ferry-{os.getpid()}-{node}"
        # Unix socket paths are short (108 bytes): not under a test's deep tmp_path.
        self.socket = Path(tempfile.gettempdir()) / f"ferry-{os.getpid()}-{next(_SEQ)}" / "agent.sock"
        self.log_path = self.root / "agent.log"
        self.env = {**os.environ, **(env or {})}
        self.tls_dir = tls_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""
        self.host = host
        self.cli_cwd: Path | None = None  # where the CLI runs (None: the caller's directory)

    def start(self, prefix: list[str] | None = None, timeout_s: float = 30.0) -> LocalAgent:
        """Start the agent (optionally under a wrapper such as `unshare`) and wait until it listens."""
        self.root.mkdir(parents=True, exist_ok=True)
        cmd = [
            *(prefix or []),
            *self.ferry(),
            "agent",
            "--listen",
            self.address or f"{self.host}:0",
            "--state-dir",
            str(self.state_dir),
            "--node-name",
            self.node,
            "--staging-dir",
            str(self.staging_dir),
            "--socket",
            str(self.socket),
            *(["--tls-dir", str(self.tls_dir)] if self.tls_dir else ["--insecure"]),
            *(["--config", str(self.config)] if self.config else []),
            *(["--metrics-listen", "127.0.0.1:0"] if self.metrics else []),
        ]
        log = open(self.log_path, "ab")  # noqa: SIM115 - the agent owns it until it exits
        seen = log.tell()  # a restarted agent appends: read only what this start writes
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=self.env, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            started = self.log_path.read_bytes()[seen:].decode(errors="replace")
            if m := _LISTENING.search(started):
                self.address = m[1]
                if self.metrics and (mm := _METRICS.search(started)):
                    self.metrics_address = mm[1]
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"agent {self.node} did not start; its log:\n{self.log_path.read_text()[-2000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        code = self.proc.returncode
        self.proc = None
        return code

    def cleanup(self) -> None:
        """After the last stop: staging and the socket's directory."""
        shutil.rmtree(self.staging_dir, ignore_errors=True)
        shutil.rmtree(self.socket.parent, ignore_errors=True)

    def kill_jobs(self) -> None:
        """SIGKILL every process this agent's records name (test and demo cleanup)."""
        for path in self.state_dir.glob("jobs/*/job.json"):
            with contextlib.suppress(OSError, ValueError, KeyError):
                rec = json.loads(path.read_text())
                if rec["state"] in ("running", "migrating") and procs.alive(rec["pid"], rec["pid_started"]):
                    procs.signal_all(procs.tree_pids(rec["pid"]), signal.SIGKILL)

    def cli(
        self, *args: str, check: bool = True, timeout_s: float = 300.0
    ) -> subprocess.CompletedProcess[str]:
        """Run `ferry ARGS` against this agent's local socket, as root on its node would."""
        local = bool(args) and args[0] in _LOCAL_COMMANDS
        if args and not local:
            args = (args[0], "--agent", f"unix:{self.socket}", *args[1:])
        cmd = [*self.ferry(nvml=local), *args]
        p = subprocess.run(
            [*self.cli_prefix(), *cmd],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=self.env,
            cwd=self.cli_cwd,
            check=False,
        )
        if check and p.returncode != 0:
            raise RuntimeError(
                f"`ferry {' '.join(args)}` on {self.node} failed ({p.returncode}): {p.stderr.strip()}"
            )
        return p

    def scrape(self) -> str:
        """This agent's /metrics, fetched from its node (the address is loopback there)."""
        assert self.metrics_address, f"agent {self.node} serves no metrics"
        fetch = (
            "import sys, urllib.request; "
            f"sys.stdout.write(urllib.request.urlopen('http://{self.metrics_address}/metrics', timeout=10)"
            ".read().decode())"
        )
        p = subprocess.run(
            [*self.cli_prefix(), sys.executable, "-c", fetch],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return p.stdout

    def ferry(self, nvml: bool = True) -> list[str]:
        """The `ferry` command line: the CLI, or, for a command that reads NVML itself (the agent, and
        the local commands such as `ferry doctor`), the test entry point that replays this agent's file."""
        if self.nvml_replay is None or not nvml:
            return [sys.executable, "-m", "agent.cli.main"]
        return [sys.executable, "-m", "agent.testing.agent", "--nvml-replay", str(self.nvml_replay)]

    def cli_prefix(self) -> list[str]:
        """What the CLI runs under to be on this agent's node (nothing: this host)."""
        return []
