"""Jobs people run, moved between nodes that share nothing a cluster's nodes would not.

Every test runs on the multi-node bed (agent/testing/bed.py): each node its own network
and mount namespaces, /tmp, /dev/shm, /run, staging and address; a job network across a
bridged fabric; a shared directory for the cluster file system.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.testing.bed import OUTSIDE_ADDR, Bed, BedAgent, node_bed
from tests.integration.jobtools import WORKLOAD, final_digest, reference_digest, steps_in, train_args

REPO = Path(__file__).resolve().parents[2]
WORKLOADS = REPO / "scripts" / "workloads"
ECHO = WORKLOADS / "echo_peer.py"


@pytest.fixture
def bed(tmp_path: Path):
    with node_bed(tmp_path) as b:
        yield b


def wait_for(agent: BedAgent, name: str, pattern: str, timeout_s: float = 120) -> str:
    return agent.wait_log(name, pattern, timeout_s)


def wait_exited(agent: BedAgent, name: str, timeout_s: float = 180) -> dict:
    return agent.wait_exited(name, timeout_s)


def migrate(src: BedAgent, dst: BedAgent, name: str) -> dict:
    """Move the job; print what the move cost (for the closing figures) and return it."""
    result = json.loads(src.cli("migrate", name, "--to", dst.address, "--json").stdout)
    assert src.job(name)["state"] == "moved"
    down = "not measured" if result["downtime_s"] is None else f"{result['downtime_s']:.3f} s"
    mib = result["image_bytes"] / 2**20
    frozen = result["frozen_s"]
    print(f"moved {name} {src.node} -> {dst.node}: frozen {frozen:.3f} s, downtime {down}, {mib:.1f} MiB")
    return result


def test_a_dataloader_job_moves_to_a_node_with_its_own_tmp_and_shm(bed: Bed) -> None:
    a, b = bed.node("node-a"), bed.node("node-b")
    a.cli("run", "--name", "loader", "--", sys.executable, str(WORKLOAD), *train_args(40, workers=2))
    wait_for(a, "loader", r"^step 5 ")
    address = a.job_address("loader")
    assert address.startswith("10.98.1.")  # from node-a's pool

    migrate(a, b, "loader")

    j = wait_exited(b, "loader")
    out = b.cli("logs", "loader").stdout
    assert j["exit_code"] == 0, b.cli("logs", "loader").stderr[-2000:]
    assert steps_in(out) == list(range(40))
    assert final_digest(out) == reference_digest(40, workers=2)
    assert j["address"] == address  # the job's address went with it


@pytest.mark.usefixtures("lazy_pipes")
def test_a_post_copy_restore_whose_lazy_pages_daemon_dies_is_undone_and_the_source_goes_on(bed: Bed) -> None:
    """The daemon dies after the tasks handed it their memory: CRIU's restore fails at its end and
    kills the tree it made, whose init (ferry-init, PID 1 of the job) waited on CRIU's other
    tracees while CRIU waited on it alone, so the restore never answered (native/criu/restore-reap.patch)."""
    a, b = bed.node("node-a"), bed.node("node-b", env={"FERRY_FAULTS": "target-lazy-gone"})
    a.cli("run", "--name", "loader", "--", sys.executable, str(WORKLOAD), *train_args(40, workers=2))
    wait_for(a, "loader", r"^step 5 ")

    p = a.cli("migrate", "loader", "--to", b.address, "--post-copy", check=False, timeout_s=120)

    assert p.returncode == 1, p.stdout
    assert "Failed sending restore finished indication" in p.stderr, p.stderr
    assert "keeps running on node-a" in p.stderr, p.stderr
    assert "loader" not in {j["name"] for j in json.loads(b.cli("ps", "--json").stdout)}
    j = wait_exited(a, "loader")
    out = a.cli("logs", "loader").stdout
    assert j["exit_code"] == 0, a.cli("logs", "loader").stderr[-2000:]
    assert steps_in(out) == list(range(40))
    assert final_digest(out) == reference_digest(40, workers=2)


def test_shared_memory_of_parent_and_child_moves_with_the_job(bed: Bed) -> None:
    a, b = bed.node("node-a"), bed.node("node-b")
    cmd = [sys.executable, str(WORKLOADS / "shm_counter.py"), "--steps", "40"]
    a.cli("run", "--name", "shm", "--", *cmd)
    wait_for(a, "shm", r"^step 5 ")

    migrate(a, b, "shm")

    assert wait_exited(b, "shm")["exit_code"] == 0
    out = b.cli("logs", "shm").stdout
    assert steps_in(out) == list(range(40))
    assert all(f"step {i} value {i * i}" in out for i in range(40))
    straight = [sys.executable, str(WORKLOADS / "shm_counter.py"), "--steps", "40", "--step-time", "0"]
    b.cli("run", "--name", "ref", "--", *straight)
    assert wait_exited(b, "ref")["exit_code"] == 0
    assert final_digest(out) == final_digest(b.cli("logs", "ref").stdout)


def test_a_server_in_a_job_keeps_its_outside_client_over_many_moves(bed: Bed) -> None:
    a, b = bed.node("node-a"), bed.node("node-b")
    a.cli("run", "--name", "echo", "--", sys.executable, str(ECHO), "serve", "--port", "9000")
    wait_for(a, "echo", r"^listening")
    address = a.job_address("echo")
    client = bed.outside(
        [sys.executable, str(ECHO), "talk", f"{address}:9000", "--steps", "600", "--step-time", "0.01"],
        stdout=subprocess.PIPE,
    )
    try:
        time.sleep(1.0)
        path = [(a, b), (b, a), (a, b)]
        for src, dst in path:  # traffic in flight during every dump
            migrate(src, dst, "echo")
            time.sleep(0.7)
        out, _ = client.communicate(timeout=120)
    finally:
        client.kill()
    assert client.returncode == 0, out[-1500:]
    assert steps_in(out) == list(range(600))  # every message once, in order, never a reset
    gap = float(re.search(r"largest gap ([\d.]+)", out)[1])  # type: ignore[index]
    print(f"echo server moved 3 times; the client's largest gap: {gap:.3f} s")
    assert b.job("echo")["state"] == "running" and b.job("echo")["address"] == address
    # Its route to the job network kept the TCP tuning plumb gave it (docs/networking.md).
    routes = subprocess.run(
        [*b.enter(), "nsenter", f"--net=/proc/{b.job('echo')['pid']}/ns/net", "ip", "-4", "route"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    subnet = [r for r in routes if "dev eth0" in r and not r.startswith("default")]
    assert len(subnet) == 1 and f"src {address} rto_min lock 10ms quickack 1" in subnet[0], routes


def test_a_job_keeps_its_connection_to_an_outside_service(bed: Bed) -> None:
    server = bed.outside([sys.executable, str(ECHO), "serve", "--port", "9100"])
    try:
        a, b = bed.node("node-a"), bed.node("node-b")
        talk = ["talk", f"{OUTSIDE_ADDR}:9100", "--steps", "400", "--step-time", "0.02"]
        a.cli("run", "--name", "client", "--", sys.executable, str(ECHO), *talk)
        wait_for(a, "client", r"^step 20 ")

        migrate(a, b, "client")
        time.sleep(1.0)
        migrate(b, a, "client")

        j = wait_exited(a, "client")
        out = a.cli("logs", "client").stdout
        assert j["exit_code"] == 0, out[-1500:]
        assert steps_in(out) == list(range(400))
        print("outside service:", re.search(r"largest gap .*", out)[0])  # type: ignore[index]
    finally:
        server.kill()


def test_a_torchrun_ddp_tree_moves_whole_and_finishes_bit_identical(bed: Bed) -> None:
    a, b = bed.node("node-a"), bed.node("node-b")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    train = [str(WORKLOADS / "train_ddp.py"), "--steps", "30"]
    a.cli("run", "--name", "ref", "--", *torchrun, *train, "--step-time", "0")
    a.cli("run", "--name", "ddp", "--", *torchrun, *train, "--step-time", "0.2")
    wait_for(a, "ddp", r"^step 4 ", timeout_s=180)

    migrate(a, b, "ddp")

    j = wait_exited(b, "ddp")
    out = b.cli("logs", "ddp").stdout
    assert j["exit_code"] == 0, b.cli("logs", "ddp").stderr[-2000:]
    assert steps_in(out) == list(range(30))
    assert wait_exited(a, "ref")["exit_code"] == 0
    assert final_digest(out) == final_digest(a.cli("logs", "ref").stdout)


def test_a_file_only_the_source_node_has_is_refused_before_freezing(bed: Bed) -> None:
    a, b = bed.node("node-a"), bed.node("node-b")
    # A process of node-a's own (adopted) holding a file in node-a's /run, which node-b lacks.
    holder = subprocess.Popen(
        [*a.enter(), "sh", "-c",
         "echo x > /run/only-here.txt && exec 3</run/only-here.txt && exec setsid sleep 300"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{holder.pid}/comm").read_text().strip() != "sleep":
            assert time.monotonic() < deadline, "the holder did not start"
            time.sleep(0.05)
        a.cli("adopt", "--pid", str(holder.pid), "--name", "pinned")

        p = a.cli("migrate", "pinned", "--to", b.address, check=False)

        assert p.returncode == 1
        error = p.stderr.strip().splitlines()[-1]
        assert "missing here: /run/only-here.txt" in error and "node-b" in error, error
        assert a.job("pinned")["state"] == "running" and holder.poll() is None
    finally:
        holder.kill()


def test_an_aborted_move_gives_the_source_copy_its_connections_back(bed: Bed) -> None:
    """The dump leaves the job's TCP sockets in repair mode and its link off the bridge: an abort
    must undo both before the source copy goes on, or its client would hang for good."""
    a = bed.node("node-a", env={"FERRY_FAULTS": "transfer"})  # every move out of node-a fails
    b = bed.node("node-b")
    a.cli("run", "--name", "echo", "--", sys.executable, str(ECHO), "serve", "--port", "9000")
    wait_for(a, "echo", r"^listening")
    talk = ["talk", f"{a.job_address('echo')}:9000", "--steps", "300", "--step-time", "0.01"]
    client = bed.outside([sys.executable, str(ECHO), *talk], stdout=subprocess.PIPE)
    try:
        time.sleep(1.0)
        for _ in range(2):
            p = a.cli("migrate", "echo", "--to", b.address, check=False)
            assert p.returncode == 1 and "aborted" in p.stderr, p.stderr
            assert a.job("echo")["state"] == "running"
            time.sleep(0.5)
        out, _ = client.communicate(timeout=120)
    finally:
        client.kill()
    assert client.returncode == 0, out[-1500:]
    assert steps_in(out) == list(range(300))
