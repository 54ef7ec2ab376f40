"""A gloo training job across the bed's nodes, one rank per node, each rank a ferry job; or a
torchrun c10d job, one torchrun agent (and its worker) per node, each a ferry job.

The ranks are started the plain `env://` way: RANK, WORLD_SIZE, MASTER_ADDR (rank 0's job
address; rank 0 itself reaches its store on its own loopback), GLOO_SOCKET_IFNAME=eth0 (the
job's link). Shared by the rank tests (tests/integration/test_ranks.py) and the distributed
bench (scripts/bench_ranks.py), so both measure the same job.
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
from pathlib import Path

from agent.testing.bed import BedAgent

TRAIN = Path(__file__).resolve().parents[2] / "scripts" / "workloads" / "train_ddp.py"
_STAMPED = re.compile(r"^step \d+ .* at (\d+\.\d+)$", re.M)


def start_rank(
    agent: BedAgent,
    name: str,
    group: str,
    rank: int,
    world: int,
    master: str,
    port: int,
    train_args: list[str],
    flags: tuple[str, ...] = (),
) -> str:
    """`ferry run` one rank of train_ddp.py on agent's node (every rank prints, with stamps)."""
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": master,
        "MASTER_PORT": str(port),
        "GLOO_SOCKET_IFNAME": "eth0",
        "OMP_NUM_THREADS": "1",
    }
    envs = [x for k, v in env.items() for x in ("--env", f"{k}={v}")]
    cmd = [sys.executable, str(TRAIN), *train_args, "--every-rank", "--stamp"]
    agent.cli("run", "--name", name, "--group", group, *envs, *flags, "--", *cmd)
    return name


def start_job(
    nodes: list[BedAgent],
    group: str,
    port: int,
    train_args: list[str],
    flags: dict[int, tuple[str, ...]] | None = None,
    prefix: str | None = None,
) -> list[str]:
    """Rank 0 first (its address is where the others find the store), then the others; job
    names are PREFIX-rN (PREFIX defaults to the group)."""
    flags = flags or {}
    world, prefix = len(nodes), prefix or group

    def one(rank: int, master: str) -> str:
        node = nodes[rank]
        name = f"{prefix}-r{rank}"
        return start_rank(node, name, group, rank, world, master, port, train_args, flags.get(rank, ()))

    names = [one(0, "127.0.0.1")]
    master = nodes[0].job_address(names[0])
    return names + [one(r, master) for r in range(1, world)]


def start_torchrun(
    agent: BedAgent,
    name: str,
    group: str,
    endpoint: str,
    train_args: list[str],
    hosts: bool = False,
    flags: tuple[str, ...] = (),
) -> str:
    """`ferry run` a torchrun agent on agent's node (c10d rendezvous at ENDPOINT:29400, 3 nodes,
    one worker each, every rank printing with stamps). It names its own job address
    (--local-addr: its hostname means nothing on the job network); the one that hosts the store
    (is_host) gives "$ME", its own address."""
    run = f"exec {sys.executable} -m torch.distributed.run --nnodes=3 --nproc_per_node=1 "
    run += "--rdzv-backend=c10d --rdzv-id=llm --max-restarts=0 --local-addr=$ME "
    run += f"--rdzv-conf=is_host={int(hosts)} --rdzv-endpoint={endpoint}:29400 "
    run += f"{TRAIN} {' '.join(train_args)} --every-rank --stamp"
    env = ["--env", "GLOO_SOCKET_IFNAME=eth0", "--env", "OMP_NUM_THREADS=1"]
    me = "ME=$(hostname -I | cut -d' ' -f1); "
    agent.cli("run", "--name", name, "--group", group, *env, *flags, "--", "sh", "-c", me + run)
    return name


def stamps(log: str) -> list[float]:
    """The wall time of every step a rank logged, in order."""
    return [float(m[1]) for m in _STAMPED.finditer(log)]


def longest_gap(log: str, since: float, until: float) -> float:
    """The longest time between two steps of a rank that overlap [since, until]."""
    t = stamps(log)
    gaps = [b - a for a, b in itertools.pairwise(t) if b >= since and a <= until]
    return max(gaps, default=0.0)


def tell(where: dict[str, BedAgent], nodes: list[BedAgent]) -> None:
    """Each node's events and warnings and each member's last lines: a failure's evidence in the
    test's output. An agent that does not answer in 10 s prints its threads' stacks instead."""

    def ask(n: BedAgent, *args: str) -> str | None:
        try:
            return n.cli(*args, check=False, timeout_s=10).stdout
        except subprocess.TimeoutExpired:
            print(f"-- {n.node}'s agent did not answer `ferry {' '.join(args)}` in 10 s; its threads:")
            print(n.stacks())
            return None

    for n in nodes:
        said = ask(n, "events", "--json")
        for e in json.loads(said) if said else []:
            print(f"{n.node} {e['time']:.2f} {e['kind']} {e['job']}: {e['message']}")
        lines = n.log_path.read_text(errors="replace").splitlines()
        print(f"-- {n.node}'s agent log, its warnings and errors:")
        print("\n".join([x for x in lines if " WARNING " in x or " ERROR " in x][-40:]))
    for name, n in where.items():
        ps = ask(n, "ps", "--json")
        j = next((j for j in json.loads(ps) if j["name"] == name), None) if ps else None
        print(f"{name} on {n.node}: " + (f"{j['state']} ({j['note']})" if j else "no answer"))
        print("\n".join((ask(n, "logs", name) or "").splitlines()[-5:]))
        print("\n".join(Path(j["stderr_path"]).read_text(errors="replace").splitlines()[-10:] if j else []))
