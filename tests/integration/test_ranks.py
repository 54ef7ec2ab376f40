"""One rank of a running multi-node gloo job moves while its peers wait in their collective.

Every rank is a ferry job (`ferry run --group`) on a node of its own on the multi-node bed
(agent/testing/bed.py), with its own address on the job network; a spare node waits. The
ranks are started the plain `env://` way (agent/testing/ranks.py), or by torchrun with c10d.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest

from agent import certs
from agent.testing.bed import Bed, BedAgent, node_bed
from agent.testing.ranks import longest_gap, stamps, start_torchrun, tell
from agent.testing.ranks import start_job as start_ranks
from tests.integration.jobtools import final_digest, steps_in
from tests.integration.test_nodes import migrate, wait_exited, wait_for

STEPS = 120
#: From the last move to every rank's end: well within the test's own timeout, so a hang is told.
FINISH_S = 100.0


@pytest.fixture
def bed(tmp_path: Path):
    with node_bed(tmp_path) as b:
        yield b


def start_job(
    nodes: list[BedAgent],
    group: str,
    port: int,
    step_time: float,
    extra: dict[int, tuple[str, ...]] | None = None,
) -> list[str]:
    return start_ranks(nodes, group, port, ["--steps", str(STEPS), "--step-time", str(step_time)], extra)


def finish_bit_identical(
    job: list[str], where: dict[str, BedAgent], ref: list[str], ref_nodes: list[BedAgent]
) -> None:
    """Every rank ends well, with every step once and in order, never restarted, and the same
    parameters as the uninterrupted run."""
    digests = set()
    deadline = time.monotonic() + FINISH_S
    for name in job:
        try:
            j = wait_exited(where[name], name, timeout_s=max(1.0, deadline - time.monotonic()))
        except BaseException:  # a hung job: what each rank and agent said, for the report
            tell(where, sorted(set(where.values()), key=lambda n: n.node))
            raise
        log = where[name].cli("logs", name).stdout
        assert j["exit_code"] == 0, where[name].cli("logs", name).stderr[-2000:]
        assert steps_in(log) == list(range(STEPS)), f"{name}: steps {steps_in(log)}"
        assert len(re.findall(r"^rank \d+ pid \d+ of 3$", log, re.M)) == 1, f"{name} restarted:\n{log[:400]}"
        digests.add(final_digest(log))
    ref_digests = set()
    for name, node in zip(ref, ref_nodes, strict=True):
        assert wait_exited(node, name, timeout_s=300)["exit_code"] == 0
        ref_digests.add(final_digest(node.cli("logs", name).stdout))
    assert len(ref_digests) == 1 and digests == ref_digests


def test_moving_ranks_of_a_gloo_job_leaves_it_bit_identical(bed: Bed) -> None:
    a, b, c, spare = bed.node("node-a"), bed.node("node-b"), bed.node("node-c"), bed.node("node-d")
    ref = start_job([a, b, c], "ref", 29510, step_time=0.0)
    job = start_job([a, b, c], "llm", 29500, step_time=0.25)
    where = {job[0]: a, job[1]: b, job[2]: c}
    wait_for(a, job[0], r"^step 5 ", timeout_s=240)

    # An operator's client certificate: `ferry ps --group` asks the other agents over mutual TLS.
    certs.issue(bed.pki, "ops", certs.Role.CLIENT, [])
    ops = bed.root / "ops-tls"
    ops.mkdir(mode=0o700)
    for f in (certs.CA_CERT, "ops.pem", "ops-key.pem"):
        shutil.copy2(bed.pki / f, ops / f)
    peers = ["--peer", b.address, "--peer", c.address, "--tls-dir", str(ops), "--tls-name", "ops"]
    members = json.loads(a.cli("ps", "--group", "llm", *peers, "--json").stdout)
    assert [(m["name"], m["rank"], m["node"]) for m in members] == [
        (job[0], 0, "node-a"),
        (job[1], 1, "node-b"),
        (job[2], 2, "node-c"),
    ]

    gaps: list[str] = []
    # rank 1 to the spare; then rank 0, which hosts the store, to node-b; then rank 0 back home.
    for name, dst in [(job[1], spare), (job[0], b), (job[0], a)]:
        src = where[name]
        asked = time.time()  # the ranks stamp their steps with this clock
        result = migrate(src, dst, name)
        where[name] = dst
        wait_for(dst, name, r"^step \d+ ", timeout_s=60)
        # The result comes once the target has watched the peers' wait (peerwait.WINDOW_S), so the
        # gaps are looked for from the ask to the moved rank's last step so far.
        until = stamps(dst.cli("logs", name).stdout)[-1]
        peers = [n for n in job if n != name]
        worst = max(longest_gap(where[p].cli("logs", p).stdout, asked, until) for p in peers)
        pause, frozen = result["group_pause_s"], result["frozen_s"]
        reported = "not measured" if pause is None else f"{pause:.2f} s"
        said = f"{name} {src.node}->{dst.node}: frozen {frozen:.2f} s, group's pause {reported}"
        gaps.append(f"{said}, peers' longest step gap {worst:.2f} s ({result['group_pause_by']})")
        # The reported pause is measured, not assumed: at least the freeze, and what the peers'
        # own logs show (their longest gap is the pause plus a part of a 0.25 s step).
        assert pause is not None and pause >= frozen, gaps[-1]
        assert abs(pause - worst) <= 1.0, gaps[-1]
    print("; ".join(gaps))

    finish_bit_identical(job, where, ref, [a, b, c])


def test_a_rank_whose_move_fails_at_any_phase_goes_on_where_it_was(bed: Bed) -> None:
    """Refused before freezing (its expected pause is longer than its --max-pause), cut during
    the transfer, killed at the target's commit point: each time the rank resumes where it
    was, the peers see only a pause, and the job finishes bit-identical."""
    a, b, c = bed.node("node-a"), bed.node("node-b"), bed.node("node-c")
    cut = bed.node("node-d", env={"FERRY_FAULTS": "target-transfer"})
    dies = bed.node("node-e", env={"FERRY_FAULTS": "target-restored"})
    ref = start_job([a, b, c], "ref", 29510, step_time=0.0)
    job = start_job([a, b, c], "llm", 29500, step_time=0.25, extra={2: ("--max-pause", "1")})
    where = {job[0]: a, job[1]: b, job[2]: c}
    wait_for(a, job[0], r"^step 5 ", timeout_s=240)

    refused = c.cli("migrate", job[2], "--to", cut.address, check=False)
    assert refused.returncode == 1 and "longer than the job's --max-pause: 1 s" in refused.stderr, (
        refused.stderr
    )
    assert c.job(job[2])["state"] == "running"
    for target, said in [(cut, "target-transfer"), (dies, "target-restored")]:
        # A target's copy that never runs must never speak for the job: a peer's bytes it
        # acknowledged would die with it, and the job would wait for them forever.
        with bed.frames_from(target, b.job_address(job[1])) as leaked:
            failed = b.cli("migrate", job[1], "--to", target.address, check=False)
        assert not leaked, f"{target.node}'s copy of {job[1]} reached the fabric: {leaked}"
        assert failed.returncode == 1 and said in failed.stderr, failed.stderr
        assert "migration aborted, the job keeps running on node-b" in failed.stderr, failed.stderr
        assert b.job(job[1])["state"] == "running"
    finish_bit_identical(job, where, ref, [a, b, c])


def test_a_torchrun_agent_moves_with_its_worker_and_the_c10d_job_goes_on(bed: Bed) -> None:
    """torchrun on every node (c10d rendezvous, one worker each): node-b's agent and its worker
    move to the spare together, then the store's host moves and comes back; no rendezvous round
    follows, and the job ends bit-identical."""
    a, b, c, spare = bed.node("node-a"), bed.node("node-b"), bed.node("node-c"), bed.node("node-d")
    ref = start_job([a, b, c], "ref", 29510, step_time=0.0)

    train = ["--steps", str(STEPS), "--step-time", "0.25"]
    start_torchrun(a, "tr-a", "tr", "$ME", train, hosts=True)  # it hosts the rendezvous store
    host = a.job_address("tr-a")
    start_torchrun(b, "tr-b", "tr", host, train)
    start_torchrun(c, "tr-c", "tr", host, train)
    where = {"tr-a": a, "tr-b": b, "tr-c": c}
    try:
        wait_for(a, "tr-a", r"^step 5 ", timeout_s=60)
    except AssertionError:
        for name, node in where.items():
            print(f"==== {name}\n" + node.cli("logs", name).stderr[-2500:])
        raise

    # node-b's agent to the spare; then node-a's, which hosts the c10d store, to node-b; then back.
    said = []
    for name, dst in [("tr-b", spare), ("tr-a", b), ("tr-a", a)]:
        src = where[name]
        result = migrate(src, dst, name)
        where[name] = dst
        wait_for(dst, name, r"^step \d+ ", timeout_s=60)
        said.append(f"torchrun agent {name} {src.node}->{dst.node}: frozen {result['frozen_s']:.2f} s")
    print("; ".join(said))

    digests = set()
    for name, node in where.items():
        j = wait_exited(node, name, timeout_s=300)
        log = node.cli("logs", name).stdout
        assert j["exit_code"] == 0, node.cli("logs", name).stderr[-2000:]
        assert steps_in(log) == list(range(STEPS)), f"{name}: steps {steps_in(log)}"
        assert len(re.findall(r"^rank \d+ pid \d+ of 3$", log, re.M)) == 1, f"{name} restarted:\n{log[:400]}"
        digests.add(final_digest(log))
    ref_digests = {final_digest(n.cli("logs", r).stdout) for r, n in zip(ref, [a, b, c], strict=True)}
    assert len(digests) == 1 and digests == ref_digests
