"""A multi-node test bed on one machine: nodes that share nothing a cluster's nodes would not.

Each node is a network namespace and a mount namespace of its own: its own /tmp, /dev/shm
and /run (fresh tmpfs when the node comes up, kept across agent restarts as a real node keeps
them, gone with a power-off), its own state and staging, its own address, and its agent
listening there. A bridge in a namespace of its own (the fabric) joins the nodes' `ferry0` bridges into
one layer-2 segment, which carries both the agents' traffic and the job network
(10.98.0.0/16; node N's agent at 10.98.0.N, its jobs from the pool 10.98.N.0/24). One more
namespace, `outside`, stands for a host beyond the jobs (a client, a service) on the same
segment. The only thing the nodes share is the cluster file system: `bed.shared`, a
directory every node sees at the same path.

    with node_bed(tmp_path) as bed:
        a, b = bed.node("node-a"), bed.node("node-b")
        a.cli("run", "--name", "web", "--", sys.executable, server, cwd=bed.shared)
        bed.outside(["python3", client, a.job_address("web")])

Traffic never leaves namespaces the bed created; everything is removed on exit.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from agent import certs
from agent.jobs.network import in_netns
from agent.jobs.registry import tmp_keeps
from agent.testing.etcd import EtcdServer
from agent.testing.localcluster import LocalAgent

REPO = Path(__file__).resolve().parents[2]
SUBNET = "10.98.0.0/16"
OUTSIDE_ADDR = "10.98.0.200"
#: The bed's etcd: a namespace of its own on the fabric, as a cluster's etcd is a host of its own.
ETCD_ADDR = "10.98.0.250"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if check and p.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({p.returncode}): {p.stderr.strip()}")
    return p


#: Variables naming binaries a node's agent runs (agent.config; the GPU suite's CUDA counter).
BINARY_VARS = ("FERRY_CRIU", "FERRY_INIT", "FERRY_CUDA_COUNTER")


def _env_paths() -> list[str]:
    """The paths this environment points a node's agent at: PYTHONPATH's entries and BINARY_VARS."""
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    return paths + [os.environ.get(v, "") for v in BINARY_VARS]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


class BedAgent(LocalAgent):
    """A node's agent: started inside the node's namespaces; its CLI runs there too, as root on
    that node would run it (its socket lives in the node's own /run)."""

    def __init__(
        self, bed: Bed, node: str, index: int, env: dict[str, str] | None = None, config: str = ""
    ) -> None:
        self.bed, self.index = bed, index
        self.netns = f"{bed.tag}-{index}"
        path = bed.root / node / "agent.toml"
        path.parent.mkdir(parents=True, exist_ok=True)
        net = f'[network]\nbridge = "ferry0"\nsubnet = "{SUBNET}"\npool = "10.98.{index}.0/24"\n'
        path.write_text(net + config)  # config: more of the agent's config file ([cuda], ...)
        super().__init__(
            bed.root,
            node,
            env={"PYTHONWARNINGS": "ignore", **(env or {})},
            tls_dir=bed.node_tls(node, f"10.98.0.{index}"),
            host=f"10.98.0.{index}",
            staging_dir=Path("/dev/shm/ferry-staging"),
            config=path,
        )
        self.socket = Path("/run/ferry/agent.sock")  # in the node's own /run
        self.holder: subprocess.Popen[bytes] | None = None  # holds the node's namespaces
        self.cli_cwd = bed.shared
        self.address = f"10.98.0.{index}:7070"
        self.fabric_link = ""  # the fabric's end of its link (Bed.throttle)

    def start(self, prefix: list[str] | None = None, timeout_s: float = 30.0) -> LocalAgent:
        """The agent, in the node's namespaces: a restarted agent finds the node's /dev/shm, /tmp
        and /run as the last one left them, as on a real node (only a power-off empties them)."""
        return super().start(prefix=[*self.enter(), *(prefix or [])], timeout_s=timeout_s)

    def enter(self) -> list[str]:
        """The command prefix that runs a process on this node (its mount and network namespaces,
        held by the node's own process since the node came up, or since it was powered on again)."""
        if self.holder is None or self.holder.poll() is not None:
            self.holder = subprocess.Popen(
                [*self.bed.node_prefix(self.netns), "sleep", "infinity"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            deadline = time.monotonic() + 10  # its mounts are made once it runs `sleep`
            while _comm(self.holder.pid) != "sleep" and time.monotonic() < deadline:
                if self.holder.poll() is not None:
                    raise RuntimeError(f"node {self.node}'s namespaces could not be made")
                time.sleep(0.01)
        return ["nsenter", f"--target={self.holder.pid}", "--mount", "--net", "--"]

    def power_off(self) -> None:
        """What the node's memory held (its /dev/shm, /tmp and /run) goes with it."""
        if self.holder is not None:
            self.holder.kill()
            self.holder.wait()
            self.holder = None

    def cli_prefix(self) -> list[str]:
        """The CLI runs on this node: in its mount and network namespaces, against its socket."""
        assert self.proc is not None, f"agent {self.node} is not running"
        return self.enter()

    def cleanup(self) -> None:
        """The node's /run, /tmp and staging vanish with its namespaces."""

    def job(self, name: str) -> dict:
        jobs = {j["name"]: j for j in json.loads(self.cli("ps", "--json").stdout)}
        return jobs[name]

    def job_address(self, name: str) -> str:
        return self.job(name)["address"]

    def wait_log(self, name: str, pattern: str, timeout_s: float = 120) -> str:
        """The job's output once a line matches pattern (a regex, multi-line)."""
        deadline = time.monotonic() + timeout_s
        out = ""
        while time.monotonic() < deadline:
            out = self.cli("logs", name).stdout
            if re.search(pattern, out, re.M):
                return out
            time.sleep(0.1)
        raise AssertionError(f"{name} on {self.node}: no {pattern!r} in its output:\n{out[-800:]}")

    def wait_exited(self, name: str, timeout_s: float = 180) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            j = self.job(name)
            if j["state"] == "exited":
                return j
            time.sleep(0.2)
        raise AssertionError(f"{name} on {self.node} did not finish: {self.job(name)}")


class Bed:
    def __init__(self, root: Path) -> None:
        self.tag = "fb" + secrets.token_hex(3)
        self.root = root / "bed"
        self.shared = self.root / "shared"  # the cluster file system
        self.shared.mkdir(parents=True, exist_ok=True)
        self.pki = self.root / "pki"  # the admin machine's `ferry certs` directory
        self.fabric = f"{self.tag}-fab"
        self.outside_ns = f"{self.tag}-out"
        self.agents: list[BedAgent] = []
        self._links = 0
        self.etcd_server: EtcdServer | None = None

    # -- set-up -----------------------------------------------------------------------------

    def node_tls(self, node: str, address: str) -> Path:
        """The node's own TLS directory: the cluster CA and its certificate, nothing else."""
        pki = self.pki
        if not (pki / certs.CA_CERT).exists():
            certs.create_ca(pki)
        if not (pki / f"{node}.pem").exists():  # a test may have issued it with `ferry certs`
            certs.issue(pki, node, certs.Role.NODE, [address])
        mine = self.root / node / "tls"
        mine.mkdir(parents=True, mode=0o700, exist_ok=True)
        for f in (certs.CA_CERT, f"{node}.pem", f"{node}-key.pem"):
            shutil.copy2(pki / f, mine / f)
        return mine

    def up(self) -> None:
        _ip("netns", "add", self.fabric)
        _ip("-n", self.fabric, "link", "add", "fab0", "type", "bridge")
        _ip("-n", self.fabric, "link", "set", "fab0", "up")
        _ip("netns", "add", self.outside_ns)
        self._uplink(self.outside_ns, "eth0")
        _ip("-n", self.outside_ns, "addr", "add", f"{OUTSIDE_ADDR}/16", "dev", "eth0")
        _ip("-n", self.outside_ns, "link", "set", "eth0", "up")
        _ip("-n", self.outside_ns, "link", "set", "lo", "up")

    def _uplink(self, ns: str, inner: str) -> str:
        """A veth from namespace ns (named inner there) to the fabric's bridge; its fabric end's name."""
        self._links += 1
        outer = f"{self.tag}l{self._links}"
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner, "netns", ns)
        _ip("link", "set", outer, "netns", self.fabric)
        _ip("-n", self.fabric, "link", "set", outer, "master", "fab0", "up")
        return outer

    def node(
        self, name: str, env: dict[str, str] | None = None, start: bool = True, config: str = ""
    ) -> BedAgent:
        index = len(self.agents) + 1
        agent = BedAgent(self, name, index, env, config)
        ns = agent.netns
        _ip("netns", "add", ns)
        agent.fabric_link = self._uplink(ns, "uplink")
        _ip("-n", ns, "link", "add", "ferry0", "type", "bridge")
        _ip("-n", ns, "link", "set", "uplink", "master", "ferry0", "up")
        _ip("-n", ns, "addr", "add", f"10.98.0.{index}/16", "dev", "ferry0")
        _ip("-n", ns, "link", "set", "ferry0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        self.agents.append(agent)
        if start:
            agent.start()
        return agent

    def node_prefix(self, netns: str) -> list[str]:
        """Run a command as a node: its network namespace, a mount namespace with fresh /tmp,
        /dev/shm and /run; the repository, this Python, what PYTHONPATH and ferry's binary
        variables name (the device check's site and bundle) and the bed stay visible. /dev
        (the NVIDIA device files) is the host's; no PID namespace: host PIDs, as NVML's."""
        keep = tmp_keeps(
            [str(REPO), sys.prefix, os.path.realpath(sys.executable), str(self.root), *_env_paths()]
        )
        binds = " && ".join(
            f"mkdir -p {shlex.quote(k)} && mount -c --bind /proc/self/fd/3/{shlex.quote(k[len('/tmp/') :])} "
            f"{shlex.quote(k)}"
            for k in keep
        )
        script = (
            "exec 3</tmp && mount -t tmpfs tmpfs /tmp && "
            + (binds + " && " if binds else "")
            + 'exec 3<&- && mount -t tmpfs tmpfs /dev/shm && mount -t tmpfs tmpfs /run && exec "$@"'
        )
        return [
            "ip",
            "netns",
            "exec",
            netns,
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "--",
            "sh",
            "-c",
            script,
            "node",
        ]

    def etcd(self) -> EtcdServer:
        """Start the bed's etcd (mutual TLS, the bed's CA) at ETCD_ADDR:2379, in a namespace of its
        own; an agent joins it with `coordination_config()` in its config."""
        ns = f"{self.tag}-etcd"
        _ip("netns", "add", ns)
        self._uplink(ns, "eth0")
        _ip("-n", ns, "addr", "add", f"{ETCD_ADDR}/16", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        if not (self.pki / certs.CA_CERT).exists():
            certs.create_ca(self.pki)
        server = EtcdServer(
            self.pki,
            host=ETCD_ADDR,
            port=2379,
            data_dir=self.root / "etcd",
            prefix=["ip", "netns", "exec", ns],
        )
        self.etcd_server = server.start()
        return server

    def power_off(self, agent: BedAgent) -> None:
        """The node dies without warning: its agent and every job SIGKILLed, its link to the
        fabric gone (no FIN, no RST: its peers' packets just stop being answered)."""
        # The link first: a process killed while it is up would send its peers a FIN or a RST.
        _ip("-n", agent.netns, "link", "del", "uplink", check=False)
        agent.stop(sig=signal.SIGKILL, timeout_s=10)
        agent.kill_jobs()
        self.kill_all(agent)
        agent.power_off()

    def kill_all(self, agent: BedAgent) -> None:
        """SIGKILL every process in the node's network namespace: what runs there outside ferry
        (a torchrun, a plain job) dies with the node too."""
        pids = _ip("netns", "pids", agent.netns, check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)

    def partition(self, agent: BedAgent) -> None:
        """The node is cut off from everything (the fabric, etcd, its peers); it lives on."""
        _ip("-n", agent.netns, "link", "set", "uplink", "down")

    def throttle(self, agent: BedAgent, mbit: int) -> None:
        """What reaches the node from the fabric is held to `mbit` Mbit/s (a token bucket on the
        fabric's end of its link): a link that trained down, a congested path."""
        subprocess.run(
            ["tc", "-n", self.fabric, "qdisc", "replace", "dev", agent.fabric_link, "root", "tbf",
             "rate", f"{mbit}mbit", "burst", "64kb", "latency", "200ms"],
            check=True, capture_output=True, text=True,
        )  # fmt: skip

    @contextlib.contextmanager
    def frames_from(self, agent: BedAgent, address: str) -> Iterator[list[str]]:
        """What leaves the node onto the fabric with `address` as its sender (an IPv4 packet's
        source, an ARP's sender), while the block runs: a line per frame."""
        seen: list[str] = []
        opened: list[socket.socket] = []

        def open_tap() -> None:  # in the fabric's namespace; the socket stays there
            # Protocol 0 until bound: it queues nothing from the fabric's other ports meanwhile.
            s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
            s.bind((agent.fabric_link, _ETH_P_ALL))
            opened.append(s)

        in_netns(f"/run/netns/{self.fabric}", open_tap)
        tap = opened[0]
        tap.settimeout(0.05)
        stop = threading.Event()
        failed: list[BaseException] = []

        def watch() -> None:
            try:
                while not stop.is_set():
                    with contextlib.suppress(TimeoutError):
                        frame, where = tap.recvfrom(65536)
                        # From the node (not to it), on its link: the bind says so, this checks.
                        if where[0] == agent.fabric_link and where[2] != socket.PACKET_OUTGOING:
                            seen.extend(_sent_by(frame, address))
            except BaseException as e:  # the caller's: an empty list must mean nothing was sent
                failed.append(e)

        t = threading.Thread(target=watch, name=f"frames-from-{agent.node}", daemon=True)
        t.start()
        try:
            yield seen
        finally:
            time.sleep(0.2)  # what was on its way
            stop.set()
            t.join(5)
            tap.close()
        if failed:
            raise AssertionError(f"watching {agent.node}'s link failed: {failed[0]!r}") from failed[0]

    def heal(self, agent: BedAgent) -> None:
        _ip("-n", agent.netns, "link", "set", "uplink", "up")

    def outside(self, cmd: list[str], **kw: object) -> subprocess.Popen[str]:
        """A process on the outside host (not a job, not a node)."""
        return subprocess.Popen(["ip", "netns", "exec", self.outside_ns, *cmd], text=True, **kw)  # type: ignore[call-overload]

    def down(self) -> None:
        for agent in self.agents:
            with contextlib.suppress(Exception):
                agent.kill_jobs()
            with contextlib.suppress(Exception):
                agent.stop()
            agent.power_off()
        if self.etcd_server is not None:
            self.etcd_server.close()
            _ip("netns", "del", f"{self.tag}-etcd", check=False)
        for ns in [a.netns for a in self.agents] + [self.outside_ns, self.fabric]:
            _ip("netns", "del", ns, check=False)


_ETH_P_ALL = 0x0003


def _sent_by(frame: bytes, address: str) -> list[str]:
    """A line for an Ethernet frame whose IPv4 source or ARP sender is `address`, else none."""
    kind = int.from_bytes(frame[12:14], "big")
    sender = frame[26:30] if kind == 0x0800 else frame[28:32] if kind == 0x0806 else b""
    if sender != socket.inet_aton(address):
        return []
    protocol = {6: "TCP", 17: "UDP", 1: "ICMP"}.get(frame[23], f"IP protocol {frame[23]}")
    what = "ARP" if kind == 0x0806 else protocol
    return [f"{what} from {address} ({frame[6:12].hex(':')}), {len(frame)} bytes"]


def coordination_config(ttl_s: int = 3, margin_s: float = 1.0) -> str:
    """The `[coordination]` table that joins an agent to the bed's etcd (short timings: tests)."""
    table = f'[coordination]\nendpoints = ["{ETCD_ADDR}:2379"]\n'
    return table + f"lease_ttl_s = {ttl_s}\nfence_margin_s = {margin_s}\n"


@contextlib.contextmanager
def node_bed(root: Path) -> Iterator[Bed]:
    bed = Bed(root)
    try:
        bed.up()
        yield bed
    finally:
        bed.down()
