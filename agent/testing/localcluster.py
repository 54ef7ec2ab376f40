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
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from itertools import count
from pathlib import Path

import psutil

from agent.jobs import procs

_LISTENING = re.compile(r"listening on ([0-9.]+:\d+|\[[0-9a-fA-F:.]+\]:\d+)")
_METRICS = re.compile(r"metrics on ([0-9.]+:\d+|\[[0-9a-fA-F:.]+\]:\d+)/metrics")
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
            if (agent := self._under_wrapper()) is not None:  # `unshare --fork` ignores SIGTERM
                with contextlib.suppress(psutil.Error):
                    agent.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.stacks()  # where it hung, written to its log: a failing test's evidence
                # Killed with its CRIU children (its process group; jobs have their own).
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        code = self.proc.returncode
        self.proc = None
        return code

    def stacks(self) -> str:
        """Every thread's stack, which the agent writes to its log on SIGUSR1 (a hung test's
        evidence)."""
        if self.proc is None or self.proc.poll() is not None:
            return f"agent {self.node} is not running"
        seen = self.log_path.stat().st_size
        with contextlib.suppress(psutil.Error):
            (self._under_wrapper() or psutil.Process(self.proc.pid)).send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        return self.log_path.read_bytes()[seen:].decode(errors="replace")

    def _under_wrapper(self) -> psutil.Process | None:
        """The agent itself where a wrapper forked it: the child whose arguments hold ours."""
        assert self.proc is not None
        found = None
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(self.proc.pid)
            ours = p.cmdline()[-8:]  # --node-name … --socket …: no job's arguments end like this
            while child := next((c for c in p.children() if c.cmdline()[-8:] == ours), None):
                p = found = child
        return found

    def cleanup(self) -> None:
        """After the last stop: staging and the socket's directory."""
        shutil.rmtree(self.staging_dir, ignore_errors=True)
        shutil.rmtree(self.socket.parent, ignore_errors=True)

    def kill_jobs(self) -> None:
        """SIGKILL every process this agent's records name (test and demo cleanup)."""
        for path in self.state_dir.glob("jobs/*/job.json"):
            with contextlib.suppress(OSError, ValueError, KeyError):
                rec = json.loads(path.read_text())
                active = rec["state"] in ("running", "migrating", "fenced")
                if active and procs.alive(rec["pid"], rec["pid_started"]):
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


#: The parent run_to_the_end gives a command: a child subreaper (prctl), so that whatever the
#: command leaves behind when its own parent ends (an agent put in the background by a shell that
#: exited, a job in a session of its own) is re-parented to it, not to init, and stays in its tree
#: until ended; it reaps them all, says the command's exit status on fd $1, and exits with the
#: last of them.
_SUBREAPER = r"""
import ctypes, os, sys
if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
    sys.exit("run_to_the_end: cannot become a child subreaper")
said = int(sys.argv[1])
command = os.fork()
if command == 0:
    os.close(said)
    try:
        os.execvp(sys.argv[2], sys.argv[2:])
    except OSError as e:
        print(f"{sys.argv[2]}: {e.strerror}", file=sys.stderr)
    os._exit(127)
while True:
    try:
        pid, status = os.wait()
    except ChildProcessError:
        break
    if pid == command:
        os.write(said, b"%d\n" % os.waitstatus_to_exitcode(status))
"""


def run_to_the_end(cmd: list[str], timeout_s: float, **popen: object) -> subprocess.CompletedProcess[str]:
    """Run cmd, its output in files, under a parent that keeps all it starts (_SUBREAPER), and end
    everything it started (`end_family`) once it exits, times out (TimeoutExpired, with its output)
    or the caller is interrupted (a test's timeout, Ctrl-C): agents it put in the background,
    their CRIU children and jobs never outlive it, nor hold its output open."""
    said, tell = os.pipe()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            proc = subprocess.Popen(  # type: ignore[call-overload]
                [sys.executable, "-c", _SUBREAPER, str(tell), *cmd],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
                pass_fds=(tell,),
                **popen,
            )
        except BaseException:
            os.close(said)
            raise
        finally:
            os.close(tell)
        try:
            ready, _, _ = select.select([said], [], [], timeout_s)
            status = os.read(said, 64).decode().strip() if ready else None
        finally:
            end_family(proc.pid)
            proc.wait()
            os.close(said)
        out.seek(0)
        err.seek(0)
        stdout, stderr = (f.read().decode(errors="replace") for f in (out, err))
    if status is None:
        raise subprocess.TimeoutExpired(cmd, timeout_s, stdout, stderr)
    return subprocess.CompletedProcess(cmd, int(status or proc.returncode), stdout, stderr)


def end_family(root: int, timeout_s: float = 10.0) -> list[int]:
    """SIGKILL root and all it started: its descendants and the rest of its session and process
    group (root leads both: start_new_session), background children orphaned by their shell
    included. All are frozen (SIGSTOP) as they are found, so that none forks behind the search;
    then all but root are killed, root goes on (a subreaper reaps them) until they are gone or
    zombies, and is killed last. Returns the PIDs still there after timeout_s, root aside (the
    caller's child, to reap)."""
    found: set[int] = set()
    while new := _family(root, _processes()) - found:
        procs.signal_all(sorted(new), signal.SIGSTOP)
        found |= new
    others = sorted(found - {root})
    procs.signal_all(others, signal.SIGKILL)
    procs.signal_all([root], signal.SIGCONT)
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in others if procs.alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.02)
    while (zombies := [p for p in others if os.path.exists(f"/proc/{p}")]) and time.monotonic() < deadline:
        time.sleep(0.02)  # a subreaper root reaps them
    procs.signal_all([root], signal.SIGKILL)
    return left or zombies


def _processes() -> dict[int, tuple[int, int, int]]:
    """Every process now: pid → (parent, process group, session)."""
    out: dict[int, tuple[int, int, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:  # gone meanwhile
            continue
        out[int(entry)] = (int(fields[1]), int(fields[2]), int(fields[3]))
    return out


def _family(root: int, table: dict[int, tuple[int, int, int]]) -> set[int]:
    """root, the members of its session and process group, and their descendants; never this
    process or its ancestors."""
    spared, pid = set(), os.getpid()
    while pid > 0 and pid not in spared:
        spared.add(pid)
        pid = table.get(pid, (0, 0, 0))[0]
    family = {p for p, (_, group, session) in table.items() if p == root or root in (group, session)}
    while more := {p for p, (parent, _, _) in table.items() if parent in family and p not in family}:
        family |= more
    return family - spared
