"""A node dies without warning; its member comes back on a spare from the group's last snapshot,
every other member rolled back to the same snapshot, by itself (docs/recovery.md).

On the bed: etcd in a namespace of its own; node-a, node-b and node-c each run one rank of a
3-rank gloo job and list node-d as their spare; node-a's agent protects the group (rounds every
few seconds, its members found through etcd). node-b is powered off (agent and jobs SIGKILLed,
its link deleted) at a moment of the test's choosing.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from agent.testing.bed import Bed, BedAgent, coordination_config, node_bed
from agent.testing.etcd import have_etcd
from agent.testing.poll import wait_for
from agent.testing.ranks import stamps
from agent.testing.ranks import start_job as start_ranks
from tests.integration.jobtools import final_digest, steps_in
from tests.integration.test_nodes import wait_exited
from tests.integration.test_nodes import wait_for as wait_log

pytestmark = pytest.mark.skipif(
    not have_etcd(), reason="no etcd binary: `make etcd` installs Debian's etcd-server"
)

STEPS = 80
SPARE = "10.98.0.4:7070"
#: Short timings (a test): a 3 s lease; a held member goes on by itself after 10 s.
CONFIG = coordination_config(ttl_s=3, margin_s=1.0) + "[snapshots]\nhold_s = 10\n"


@pytest.fixture
def bed(tmp_path: Path):
    with node_bed(tmp_path) as b:
        b.etcd()
        yield b


def events(agent: BedAgent) -> list[dict]:
    return json.loads(agent.cli("events", "--json").stdout)


def test_a_dead_nodes_member_comes_back_on_the_spare_and_the_job_ends_bit_identical(bed: Bed) -> None:
    with_spare = CONFIG + f'[[peers]]\naddress = "{SPARE}"\nspare = true\n'
    a, b, c = (bed.node(n, config=with_spare) for n in ("node-a", "node-b", "node-c"))
    spare = bed.node("node-d", config=CONFIG)
    assert spare.address == SPARE
    nodes = [a, b, c]
    ref = start_ranks(nodes, "ref", 29510, ["--steps", str(STEPS), "--step-time", "0"])
    ref_digests = {
        final_digest(n.cli("logs", r).stdout) for r, n in zip(ref, nodes, strict=True) if _ended(n, r)
    }
    assert len(ref_digests) == 1, ref_digests  # the undisturbed run, before node-b dies
    job = start_ranks(nodes, "llm", 29500, ["--steps", str(STEPS), "--step-time", "0.25"])
    wait_log(a, job[0], r"^step 5 ", timeout_s=240)
    # The members' keys are in etcd within a renewal; then node-a protects the group through them.
    wait_for("a first snapshot", lambda: _protected(a), 60)
    snap = json.loads(a.cli("snapshot", "llm", "--last", "--json").stdout)["last"]
    wait_log(a, job[0], rf"^step {max(steps_in(a.cli('logs', job[0]).stdout)) + 4} ", timeout_s=60)

    killed = time.time()
    bed.power_off(b)
    wait_for("node-b's member to run on the spare", lambda: _runs(spare, job[1]), 90)
    recovered = time.time()
    where = {job[0]: a, job[1]: spare, job[2]: c}
    for name, node in where.items():
        j = wait_exited(node, name, timeout_s=240)
        assert j["exit_code"] == 0, node.cli("logs", name).stderr[-2000:]
    # Every rank stepped again; the first step after the kill says how long the job stood still.
    back = max(next(t for t in stamps(n.cli("logs", j).stdout) if t > killed) for j, n in where.items())
    said = [
        e["message"] for n in (a, c) for e in events(n) if "recovered from snapshot round" in e["message"]
    ]
    assert len(said) == 1, said  # exactly one recovery
    print(
        f"recovery: the spare ran the member {recovered - killed:.1f} s after the kill; every rank "
        f"stepped again {back - killed:.1f} s after it; {said[0]}"
    )

    losses = re.compile(r"^step (\d+) loss (\S+)", re.M)
    for name, node in where.items():
        log = node.cli("logs", name).stdout
        steps = steps_in(log)
        assert steps[-1] == STEPS - 1 and sorted(set(steps)) == list(range(STEPS)), f"{name}: {steps}"
        seen: dict[int, str] = {}
        for step, loss in losses.findall(log):
            assert seen.setdefault(int(step), loss) == loss, f"{name}: step {step} replayed with another loss"
        assert len(re.findall(r"^rank \d+ pid \d+ of 3$", log, re.M)) == 1, f"{name} restarted"
    digests = {final_digest(n.cli("logs", j).stdout) for j, n in where.items()}
    assert digests == ref_digests and int(snap["epoch"]) >= 1


def _protected(a: BedAgent, every: str = "4s") -> bool:
    """Protected once etcd has every member's key; True once a round is complete."""
    if a.cli("snapshot", "llm", "--last", check=False).returncode != 0:
        a.cli("protect", "llm", "--every", every, check=False)
        return False
    last = json.loads(a.cli("snapshot", "llm", "--last", "--json").stdout)["last"]
    return int(last.get("epoch", 0)) >= 1


def _runs(agent: BedAgent, name: str) -> bool:
    jobs = {j["name"]: j for j in json.loads(agent.cli("ps", "--json").stdout)}
    return name in jobs and jobs[name]["state"] in ("running", "exited")


def _ended(agent: BedAgent, name: str) -> bool:
    return wait_exited(agent, name, timeout_s=240)["exit_code"] == 0


def _cluster(bed: Bed) -> tuple[list[BedAgent], BedAgent]:
    with_spare = CONFIG + f'[[peers]]\naddress = "{SPARE}"\nspare = true\n'
    nodes = [bed.node(n, config=with_spare) for n in ("node-a", "node-b", "node-c")]
    spare = bed.node("node-d", config=CONFIG)
    assert spare.address == SPARE
    return nodes, spare


def test_a_cut_off_node_fences_its_member_and_its_copy_never_runs_again_once_it_heals(bed: Bed) -> None:
    """node-b loses everything (fabric and etcd) but lives: its member is fenced before its lease
    expires, the group recovers it on the spare, and when node-b comes back its copy ends
    without printing another line."""
    (a, b, c), spare = _cluster(bed)
    job = start_ranks([a, b, c], "llm", 29500, ["--steps", str(STEPS), "--step-time", "0.25"])
    wait_log(a, job[0], r"^step 5 ", timeout_s=240)
    wait_for("a first snapshot", lambda: _protected(a), 60)
    cut = time.time()
    bed.partition(b)
    wait_for("node-b's member to run on the spare", lambda: _runs(spare, job[1]), 90)
    assert b.job(job[1])["state"] == "fenced"  # b's own CLI: it has not heard of the recovery
    stdout = Path(b.job(job[1])["stdout_path"])
    last = stamps(stdout.read_text())[-1]
    bed.heal(b)
    wait_for("node-b's copy to end", lambda: b.job(job[1])["state"] == "stopped", 30)
    assert "node-d" in b.job(job[1])["note"], b.job(job[1])
    time.sleep(1.0)
    assert stamps(stdout.read_text())[-1] == last < cut + 3.0  # fenced before its 3 s lease ran out
    where = {job[0]: a, job[1]: spare, job[2]: c}
    for name, node in where.items():
        assert wait_exited(node, name, timeout_s=240)["exit_code"] == 0
        assert sorted(set(steps_in(node.cli("logs", name).stdout))) == list(range(STEPS))
    assert len({final_digest(n.cli("logs", j).stdout) for j, n in where.items()}) == 1


def test_etcd_restarting_during_rounds_loses_nothing_and_recovers_nothing(bed: Bed) -> None:
    """etcd down for 2 s while rounds run every 3 s: the lease outlives it (etcd renews leases when
    it comes back), rounds go on after it, no member is found lost, nothing is recovered."""
    (a, b, c), _spare = _cluster(bed)
    job = start_ranks([a, b, c], "llm", 29500, ["--steps", str(STEPS), "--step-time", "0.25"])
    wait_log(a, job[0], r"^step 5 ", timeout_s=240)
    wait_for("a first snapshot", lambda: _protected(a, every="3s"), 60)
    before = int(json.loads(a.cli("snapshot", "llm", "--last", "--json").stdout)["last"]["epoch"])
    bed.etcd_server.restart(down_s=2.0)
    wait_for(
        "a round after the restart",
        lambda: (
            int(json.loads(a.cli("snapshot", "llm", "--last", "--json").stdout)["last"]["epoch"]) > before
        ),
        60,
    )
    where = dict(zip(job, (a, b, c), strict=True))
    for name, node in where.items():
        assert wait_exited(node, name, timeout_s=240)["exit_code"] == 0
        assert steps_in(node.cli("logs", name).stdout) == list(range(STEPS)), name
    said = [e["message"] for n in (a, b, c) for e in events(n)]
    assert not [m for m in said if " is lost" in m or "recover" in m], said
