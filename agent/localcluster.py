"""Agents on this machine, for the demo, the benchmark and the integration tests.

Each agent is a real `ferry agent` process on loopback with its own state and
staging directories: two of them are two "nodes" on one host.
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
import time
from pathlib import Path

from agent import procs

_LISTENING = re.compile(r"listening on ([0-9.]+:\d+)")


class LocalAgent:
    def __init__(self, root: Path, node: str, env: dict[str, str] | None = None) -> None:
        self.root = root / node
        self.node = node
        self.state_dir = self.root / "state"
        self.staging_dir = Path("/dev/shm") / f"ferry-{os.getpid()}-{node}"
        self.log_path = self.root / "agent.log"
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""

    def start(self, prefix: list[str] | None = None, timeout_s: float = 30.0) -> LocalAgent:
        """Start the agent (optionally under a wrapper such as `unshare`) and wait until it listens."""
        self.root.mkdir(parents=True, exist_ok=True)
        cmd = [
            *(prefix or []),
            sys.executable,
            "-m",
            "agent.cli",
            "agent",
            "--listen",
            self.address or "127.0.0.1:0",
            "--state-dir",
            str(self.state_dir),
            "--node-name",
            self.node,
            "--staging-dir",
            str(self.staging_dir),
            "--insecure",
        ]
        log = open(self.log_path, "ab")  # noqa: SIM115 - the agent owns it until it exits
        seen = log.tell()  # a restarted agent appends: read only what this start writes
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=self.env, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if m := _LISTENING.search(self.log_path.read_bytes()[seen:].decode(errors="replace")):
                self.address = m[1]
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
        shutil.rmtree(self.staging_dir, ignore_errors=True)
        return code

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
        """Run `ferry ARGS --agent <this agent>` as a user would."""
        cmd = [sys.executable, "-m", "agent.cli", *args]
        if args and args[0] not in ("inspect", "doctor"):
            cmd[4:4] = ["--agent", self.address]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=self.env, check=False)
        if check and p.returncode != 0:
            raise RuntimeError(f"`ferry {' '.join(args)}` failed ({p.returncode}): {p.stderr.strip()}")
        return p
