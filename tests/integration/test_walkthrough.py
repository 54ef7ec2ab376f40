"""The README's "Certificates for two nodes", command for command, on the bed: an admin machine
issues the certificates with `ferry certs`, each node's agent serves mutual TLS on its own
address, root on a node drives its agent through the local socket, and alice drives them from
her own machine (the bed's outside host) with her client certificate."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from agent.testing.bed import Bed, node_bed
from tests.integration.jobtools import WORKLOAD, final_digest, reference_digest, steps_in, train_args

FERRY = [sys.executable, "-m", "agent.cli.main"]


def ferry(*args: str) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([*FERRY, *args], capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 0, f"`ferry {' '.join(args)}`: {p.stderr}"
    return p


def alice(bed: Bed, home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`ferry ARGS` from alice's machine, with FERRY_AGENT / FERRY_TLS_DIR / FERRY_TLS_NAME set."""
    p = bed.outside([*FERRY, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={
        **os.environ, "FERRY_TLS_DIR": str(home / ".ferry" / "tls"), "FERRY_TLS_NAME": "alice"})  # fmt: skip
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, f"alice: `ferry {' '.join(args)}`: {err}"
    return subprocess.CompletedProcess(args, p.returncode, out, err)


def test_the_two_node_walkthrough_runs_as_written(tmp_path: Path) -> None:
    with node_bed(tmp_path) as bed:
        # 1. On an admin machine: the CA, a certificate per node and one for alice.
        pki = bed.pki
        ferry("certs", "ca", "--dir", str(pki))
        ferry("certs", "node", "node-a", "--host", "node-a", "--host", "10.98.0.1", "--dir", str(pki))
        ferry("certs", "node", "node-b", "--host", "node-b", "--host", "10.98.0.2", "--dir", str(pki))
        said = ferry("certs", "client", "alice", "--dir", str(pki)).stdout
        assert "alice.pem and" in said and "valid until" in said
        # 2. Each node gets ca.pem and its own pair (the bed copies them to the node's TLS dir);
        #    alice gets ca.pem and hers.
        home = tmp_path / "alice"
        (home / ".ferry" / "tls").mkdir(parents=True, mode=0o700)
        for f in ("ca.pem", "alice.pem", "alice-key.pem"):
            shutil.copy2(pki / f, home / ".ferry" / "tls" / f)
        # 3. An agent on each node, mutual TLS on its address.
        a, b = bed.node("node-a"), bed.node("node-b")
        # 4. On a node, as root, through the local socket.
        a.cli("run", "--name", "train", "--", sys.executable, str(WORKLOAD), *train_args(40))
        assert re.search(r"^train\s+running", a.cli("ps").stdout, re.M)
        # 5. From alice's machine.
        listed = alice(bed, home, "ps", "--agent", "10.98.0.1:7070").stdout
        assert re.search(r"^train\s+running", listed, re.M), listed
        deadline = time.monotonic() + 60
        while len(steps_in(a.cli("logs", "train").stdout)) < 5:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        # 6. Migrate: the request goes to the source agent, here from alice's machine.
        moved = alice(bed, home, "migrate", "train", "--to", "10.98.0.2:7070", "--agent", "10.98.0.1:7070")
        assert "moved node-a -> node-b" in moved.stdout, moved.stdout
        there = alice(bed, home, "ps", "--agent", "10.98.0.2:7070").stdout
        assert re.search(r"^train\s+(running|exited).*moved here from node-a", there, re.M), there
        deadline = time.monotonic() + 120
        while b.job("train")["state"] != "exited":
            assert time.monotonic() < deadline
            time.sleep(0.2)
        out = b.cli("logs", "train").stdout
        assert steps_in(out) == list(range(40)) and final_digest(out) == reference_digest(40)
