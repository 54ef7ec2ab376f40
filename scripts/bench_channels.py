"""The CPU an agent-to-agent call costs over a new TLS channel against one kept (client.PeerClients).

An agent over mutual TLS (certificates from agent.certs, on loopback) answers GetInfo --calls
times from this process three ways, in one run: a new PeerClient per call (a TCP and a TLS
handshake each time), one kept channel, and new ones again. For each it prints the wall time a
call took and the CPU a call cost the caller (this process, every thread) and the agent (its
process, read through psutil). An agent of the multi-node bed makes some ten such calls a second
(pings every renewal interval, the straggler watch's GetPace every 2 s to every peer), so the
difference is CPU the training job's ranks share their cores with.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from agent import certs, tls
from agent.certs import Role
from agent.client import Dial, PeerClient, PeerClients
from agent.testing.localcluster import LocalAgent


def measure(label: str, call: Callable[[], object], agent: psutil.Process, n: int) -> None:
    agent0, ours0, t0 = sum(agent.cpu_times()[:2]), time.process_time(), time.monotonic()
    for _ in range(n):
        call()
    agent1, ours1, t1 = sum(agent.cpu_times()[:2]), time.process_time(), time.monotonic()
    print(
        f"{label:16s} {(t1 - t0) / n * 1000:6.2f} ms a call; CPU a call: caller "
        f"{(ours1 - ours0) / n * 1000:.2f} ms, agent {(agent1 - agent0) / n * 1000:.2f} ms"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=200, help="GetInfo calls each way (default 200)")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ferry-bench-channels-"))
    try:
        pki = root / "pki"
        pki.mkdir()
        certs.create_ca(pki)
        for node in ("node-a", "node-b"):
            certs.issue(pki, node, Role.NODE, ["127.0.0.1"])
        a = LocalAgent(root, "node-a", tls_dir=pki).start()
        try:
            assert a.proc is not None
            agent = psutil.Process(a.proc.pid)
            dial = Dial(identity=tls.load(pki, "node-b"))
            peers = PeerClients(dial)
            measure("new channel", lambda: PeerClient(a.address, dial).info(timeout_s=5), agent, args.calls)
            measure("kept channel", lambda: peers.get(a.address).info(timeout_s=5), agent, args.calls)
            measure("new channel", lambda: PeerClient(a.address, dial).info(timeout_s=5), agent, args.calls)
            peers.close()
        finally:
            a.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
