"""A node dies without warning; its member comes back on a spare from the group's last snapshot,
every other member rolled back to the same snapshot, by itself (docs/recovery.md).

On the bed: etcd in a namespace of its own; node-a, node-b and node-c each run one rank of a
3-rank gloo job and list node-d (and node-e) as their spares; every member is started with
`--protect`, and the agent holding etcd's claim runs the rounds (every few seconds, its members
found through etcd). A node is powered off (agent and jobs SIGKILLed, its link deleted), or cut
off from everything while it lives, or a recovering agent is killed half-way, at a moment of the
test's choosing; rounds run all the while, so a failure may land in the middle of one.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from agent.testing.bed import Bed, BedAgent, coordination_config, node_bed
from agent.testing.etcd import have_etcd
from agent.testing.poll import wait_for
from agent.testing.ranks import stamps, start_torchrun, tell
from agent.testing.ranks import start_job as start_ranks
from tests.integration.jobtools import final_digest, steps_in
from tests.integration.test_faults import records
from tests.integration.test_nodes import wait_exited
from tests.integration.test_nodes import wait_for as wait_log

pytestmark = pytest.mark.skipif(
    not have_etcd(), reason="no etcd binary: `make etcd` installs Debian's etcd-server"
)

STEPS = 120  # the cut-off test's job: still running once another agent has taken the rounds over
LONG = 200  # the job two nodes die under: still running after both recoveries (the 2nd near step 80)
HALF_WAY_S = 5  # a recovering agent waits this long with every copy ended: the test kills it then
ROUND_PAUSE_S = 2  # a node's agent waits this long in each round's HOLD or SHIP: a node dies then
#: Short timings (a test): a 3 s lease; a held member goes on by itself after 10 s.
CONFIG = coordination_config(ttl_s=3, margin_s=1.0) + "[snapshots]\nhold_s = 10\n"


@pytest.fixture
def bed(tmp_path: Path):
    with node_bed(tmp_path) as b:
        b.etcd()
        yield b


def events(agent: BedAgent) -> list[dict]:
    return json.loads(agent.cli("events", "--json").stdout)


@pytest.mark.timeout(240)  # two recoveries, one taken over, on a 200-step job: 140-170 s here
def test_a_recovery_whose_agent_dies_half_way_is_taken_over_and_two_dead_nodes_are_recovered(
    bed: Bed,
) -> None:
    """etcd restarts during the rounds (nothing lost, nothing recovered); then node-b dies in the
    middle of a round's SHIP (its image of that round not yet on its buddy), and the agent that
    recovers it is SIGKILLed half-way (every copy ended, none restored) and restarted, as its
    service manager would: another agent takes the recovery over from etcd and node-b's member
    comes back from the last complete round on the spare that keeps its copy (the spares keep
    the images). The rounds go on over the new members, kept by the other spare; then node-c dies
    in the middle of a round's HOLD (every member frozen), and its member comes back on the
    second spare. Every rank replays the steps since each snapshot with the same losses, nothing
    restarts, and the job ends bit-identical to an undisturbed run."""
    # Windows to die in: the recoverer's (a and c), node-b's SHIP, node-c's HOLD.
    ended = f"rollback-ended={HALF_WAY_S}"
    env = {
        "node-a": {"FERRY_PAUSE": ended},
        "node-b": {"FERRY_PAUSE": f"snapshot-shipping={ROUND_PAUSE_S}"},
        "node-c": {"FERRY_PAUSE": f"{ended},snapshot-held={ROUND_PAUSE_S}"},
    }
    (a, b, c), (d, e) = _cluster(bed, spares=2, env=env)
    nodes = [a, b, c]
    ref = start_ranks(nodes, "ref", 29510, ["--steps", str(LONG), "--step-time", "0"])
    ref_digests = {
        final_digest(n.cli("logs", r).stdout) for r, n in zip(ref, nodes, strict=True) if _ended(n, r)
    }
    assert len(ref_digests) == 1, ref_digests  # the undisturbed run, before anything dies
    protect = {rank: ("--protect", "3s") for rank in range(3)}
    job = start_ranks(nodes, "llm", 29500, ["--steps", str(LONG), "--step-time", "0.25"], flags=protect)
    wait_log(a, job[0], r"^step 5 ", timeout_s=240)
    wait_for("a first snapshot", lambda: any(_runs_rounds(n) and _epoch(n) >= 1 for n in nodes), 60)

    before = max(_epoch(n) for n in nodes)
    bed.etcd_server.restart(down_s=2.0)
    wait_for("a round after etcd's restart", lambda: max(_epoch(n) for n in (a, c)) > before, 60)
    said = [m["message"] for n in nodes for m in events(n)]
    assert not [m for m in said if " is lost" in m or "recovered" in m], said

    killed = _power_off_in(bed, b, "snapshot-shipping")
    committed = max(_epoch(n) for n in (a, c))  # node-b's round in flight can no longer complete
    paused = f"FERRY_PAUSE: pausing {float(HALF_WAY_S):.1f} s at 'rollback-ended'"
    wait_for(
        "a recovery to end every copy", lambda: any(paused in n.log_path.read_text() for n in (a, c)), 60
    )
    r = next(n for n in (a, c) if paused in n.log_path.read_text())
    r.stop(sig=signal.SIGKILL)  # half-way: its claim goes with its lease, its pending mark stays
    r.env["FERRY_PAUSE"] = r.env["FERRY_PAUSE"].replace(ended, "").strip(",")  # node-c's HOLD window stays
    r.start()
    # On the spare that keeps its copy of the round (the spares keep the images): call it d.
    spares = (d, e)
    try:
        d = wait_for(
            "node-b's member to run on a spare",
            lambda: next((s for s in spares if _runs(s, job[1])), None),
            90,
        )  # type: ignore[assignment]
    except BaseException:
        tell({job[0]: a, job[2]: c}, [a, c, *spares])
        raise
    e = next(s for s in spares if s is not d)  # the other spare, which node-c's member will take
    first = time.time()
    where = {job[0]: a, job[1]: d, job[2]: c}
    back = _stepping_again(where, killed)
    print(
        f"node-b died in a round's SHIP, {r.node}'s agent half-way through its recovery; "
        f"node-b's member ran on {d.node} "
        f"{first - killed:.1f} s after the kill; every rank stepped again {back - killed:.1f} s after it"
    )
    taken = [
        m["message"] for n in (a, c) for m in events(n) if "recovered from snapshot round" in m["message"]
    ]
    assert len(taken) == 1 and f"recovered from snapshot round {committed} " in taken[0], taken
    # The next complete round is over the new members, kept by the spare that runs none.
    after = max(_epoch(n) for n in (a, c))
    wait_for(
        f"a round over {d.node}",
        lambda: any(_runs_rounds(n) and _epoch(n) > after and d.node in _nodes(n) for n in (a, c, d)),
        60,
    )

    killed = _power_off_in(bed, c, "snapshot-held")
    try:
        wait_for("node-c's member to run on the other spare", lambda: _runs(e, job[2]), 90)
    except BaseException:
        tell({job[0]: a, job[1]: d}, [a, d, e])
        raise
    where = {job[0]: a, job[1]: d, job[2]: e}
    back = _stepping_again(where, killed)
    print(
        f"node-c died in a round's HOLD; its member ran on {e.node}; "
        f"every rank stepped again {back - killed:.1f} s after the kill"
    )

    losses = re.compile(r"^step (\d+) loss (\S+)", re.M)
    try:
        for name, node in where.items():
            j = wait_exited(node, name, timeout_s=240)
            assert j["exit_code"] == 0, node.cli("logs", name).stderr[-2000:]
    except BaseException:  # a timeout included: what each node did and said, for the report
        tell(where, [a, d, e])
        raise
    for name, node in where.items():
        log = node.cli("logs", name).stdout
        steps = steps_in(log)
        assert steps[-1] == LONG - 1 and sorted(set(steps)) == list(range(LONG)), f"{name}: {steps}"
        seen: dict[int, str] = {}
        for step, loss in losses.findall(log):
            assert seen.setdefault(int(step), loss) == loss, f"{name}: step {step} replayed with another loss"
        assert len(re.findall(r"^rank \d+ pid \d+ of 3$", log, re.M)) == 1, f"{name} restarted"
    assert {final_digest(n.cli("logs", j).stdout) for j, n in where.items()} == ref_digests
    # One recovery per failure: each spare runs exactly the member it was claimed for.
    assert [j["name"] for j in _group(d)] == [job[1]] and [j["name"] for j in _group(e)] == [job[2]]


def _power_off_in(bed: Bed, node: BedAgent, point: str) -> float:
    """Power `node` off while its agent pauses at `point` (FERRY_PAUSE) in a round to come;
    returns when."""
    said = f"FERRY_PAUSE: pausing {float(ROUND_PAUSE_S):.1f} s at '{point}'"
    before = node.log_path.read_text().count(said)
    wait_for(
        f"{node.node}'s agent to pause at {point}", lambda: node.log_path.read_text().count(said) > before, 60
    )
    killed = time.time()
    bed.power_off(node)
    return killed


def _epoch(a: BedAgent) -> int:
    return int(_protection(a)["last"].get("epoch", 0))


def _nodes(a: BedAgent) -> set[str]:
    return {m["node"] for m in _protection(a)["last"].get("members", [])}


def _group(agent: BedAgent) -> list[dict]:
    return [j for j in json.loads(agent.cli("ps", "--json").stdout) if j["group"] == "llm"]


def _stepping_again(where: dict[str, BedAgent], since: float) -> float:
    """When the last rank printed its first step after `since`."""

    def first(name: str, node: BedAgent) -> float | None:
        return next((t for t in stamps(node.cli("logs", name).stdout) if t > since), None)

    try:
        wait_for("every rank to step again", lambda: all(first(j, n) for j, n in where.items()), 60)
    except BaseException:  # the evidence: which rank is stuck, and what each agent saw
        tell(where, list({id(n): n for n in where.values()}.values()))
        raise
    return max(first(j, n) or 0.0 for j, n in where.items())


def _runs(agent: BedAgent, name: str) -> bool:
    jobs = {j["name"]: j for j in json.loads(agent.cli("ps", "--json").stdout)}
    return name in jobs and jobs[name]["state"] in ("running", "exited")


def _ended(agent: BedAgent, name: str) -> bool:
    return wait_exited(agent, name, timeout_s=240)["exit_code"] == 0


def _cluster(
    bed: Bed, spares: int = 1, env: dict[str, dict[str, str]] | None = None
) -> tuple[list[BedAgent], list[BedAgent]]:
    """node-a, node-b and node-c, each listing the spares (node-d, node-e) in its config; `env`:
    more environment for a node's agent."""
    addresses = [f"10.98.0.{4 + i}:7070" for i in range(spares)]
    listed = "".join(f'[[peers]]\naddress = "{x}"\nspare = true\n' for x in addresses)
    env = env or {}
    nodes = [bed.node(n, config=CONFIG + listed, env=env.get(n)) for n in ("node-a", "node-b", "node-c")]
    free = [bed.node(n, config=CONFIG) for n in ("node-d", "node-e")[:spares]]
    assert [n.address for n in free] == addresses
    return nodes, free


def test_the_protectors_node_cut_off_is_fenced_recovered_and_another_agent_runs_the_rounds(
    bed: Bed,
) -> None:
    """Every member is started with `--protect`: one agent runs the rounds, the others stand by.
    The node of the one that runs them loses everything (fabric and etcd) but lives: its member
    is fenced before its lease expires, the group recovers it on the spare, another member's
    agent takes the rounds over, and when the node comes back its copy ends without printing
    another line, and its agent stands by."""
    (a, b, c), (spare,) = _cluster(bed)
    nodes = [a, b, c]
    protect = {rank: ("--protect", "3s") for rank in range(3)}
    job = start_ranks(nodes, "llm", 29500, ["--steps", str(STEPS), "--step-time", "0.25"], flags=protect)
    wait_log(a, job[0], r"^step 5 ", timeout_s=240)
    wait_for("a first snapshot", lambda: any(_runs_rounds(n) and _epoch(n) >= 1 for n in nodes), 60)
    i = next(i for i, n in enumerate(nodes) if _runs_rounds(n))
    x, member = nodes[i], job[i]
    others = [n for n in nodes if n is not x]
    assert all(_protection(n)["rounds_by"] for n in others)  # they stand by
    cut = time.time()
    bed.partition(x)
    wait_for(f"{x.node}'s member to run on the spare", lambda: _runs(spare, member), 90)
    # Its own CLI: it has not heard of the recovery. Fenced; or, if the cut came while a round
    # held it (rounds come every 3 s), still frozen by that round: a held member whose node
    # loses etcd stays frozen until its key settles it (test_fencing.py). Either way it is not
    # running, and the copy on the spare is the only one that does.
    assert x.job(member)["state"] in ("fenced", "migrating")
    took = time.time()
    wait_for(
        "a round over node-d by another agent",
        lambda: any(_runs_rounds(n) and "node-d" in _nodes(n) for n in others),
        60,
    )
    print(f"{x.node} cut off; another agent's round over node-d {time.time() - took:.1f} s after recovery")
    stdout = Path(x.job(member)["stdout_path"])
    last = stamps(stdout.read_text())[-1]
    bed.heal(x)
    wait_for(f"{x.node}'s copy to end", lambda: x.job(member)["state"] == "stopped", 30)
    assert "node-d" in x.job(member)["note"], x.job(member)
    time.sleep(1.0)
    assert stamps(stdout.read_text())[-1] == last < cut + 3.0  # fenced before its 3 s lease ran out
    wait_for(f"{x.node}'s agent to stand by", lambda: bool(_protection(x)["rounds_by"]), 30)
    where = {j: n for j, n in zip(job, nodes, strict=True)} | {member: spare}
    try:
        for name, node in where.items():
            assert wait_exited(node, name, timeout_s=100)["exit_code"] == 0
    except BaseException:  # a timeout included: what each node did and said, for the report
        tell(where, [*nodes, spare])
        raise
    for name, node in where.items():
        assert sorted(set(steps_in(node.cli("logs", name).stdout))) == list(range(STEPS))
    assert len({final_digest(n.cli("logs", j).stdout) for j, n in where.items()}) == 1


def _protection(agent: BedAgent) -> dict:
    return json.loads(agent.cli("snapshot", "llm", "--last", "--json").stdout)


def _runs_rounds(agent: BedAgent) -> bool:
    """This agent protects the group and holds etcd's claim on its rounds."""
    got = agent.cli("snapshot", "llm", "--last", "--json", check=False)
    return got.returncode == 0 and not json.loads(got.stdout)["rounds_by"]


def test_a_node_that_dies_while_its_torchrun_member_is_moved_is_recovered_on_the_moves_target(
    bed: Bed,
) -> None:
    """A torchrun c10d job (a torchrun agent and its worker per node, node-a's hosting the
    rendezvous store), every member protected. node-c's member is being moved to the spare
    (frozen, dumped, not yet sent) when node-c dies: the move never completes, the spare lets
    the half-done move go, and the group recovers the member there from its last snapshot; no
    rendezvous round follows. Every rank ends bit-identical to an undisturbed run."""
    (a, b, c), (spare,) = _cluster(bed, env={"node-c": {"FERRY_PAUSE": f"source-dumped={HALF_WAY_S * 8}"}})
    nodes = [a, b, c]
    ref = start_ranks(nodes, "ref", 29510, ["--steps", str(STEPS), "--step-time", "0"])
    train, protect = ["--steps", str(STEPS), "--step-time", "0.25"], ("--protect", "3s")
    job = [start_torchrun(a, "llm-a", "llm", "$ME", train, hosts=True, flags=protect)]
    host = a.job_address(job[0])
    job += [start_torchrun(n, f"llm-{n.node[-1]}", "llm", host, train, flags=protect) for n in (b, c)]
    ref_digests = {
        final_digest(n.cli("logs", r).stdout) for r, n in zip(ref, nodes, strict=True) if _ended(n, r)
    }
    assert len(ref_digests) == 1, ref_digests
    wait_log(a, job[0], r"^step 5 ", timeout_s=240)
    wait_for("a first snapshot", lambda: any(_runs_rounds(n) and _epoch(n) >= 1 for n in nodes), 60)

    paused = f"FERRY_PAUSE: pausing {float(HALF_WAY_S * 8):.1f} s at 'source-dumped'"
    moved: list[subprocess.CompletedProcess[str]] = []
    for _ in range(5):  # a move asked while a round holds the member is refused: ask again
        move = threading.Thread(
            target=lambda: moved.append(
                c.cli("migrate", job[2], "--to", spare.address, check=False, timeout_s=120)
            )
        )
        move.start()
        wait_for(
            "node-c's move to freeze its member, or end",
            lambda: paused in c.log_path.read_text() or moved,
            60,
        )
        if not moved:
            break
        said = moved[0].stderr  # refused at the CLI's look, or by the agent's own
        assert "is migrating, not running" in said or "held for a group snapshot round" in said, said
        moved.clear()
    assert paused in c.log_path.read_text()
    killed = time.time()
    bed.power_off(c)
    move.join(150)
    assert moved and moved[0].returncode != 0, moved  # the move never completed
    where = {job[0]: a, job[1]: b, job[2]: spare}
    try:
        wait_for("node-c's member to run on the spare", lambda: _runs(spare, job[2]), 90)
    except BaseException:
        tell(where, [a, b, spare])
        raise
    back = _stepping_again(where, killed)
    print(f"node-c died mid-move; every rank stepped again {back - killed:.1f} s after the kill")

    # The spare lets the half-done move go, before its lease, for etcd has no lease for node-c: at
    # its next housekeeping, which on a loaded machine may come after the recovery.
    def moves() -> list[tuple[str, str]]:
        return [(r["state"], r["note"]) for r in records(spare, "target") if r["state"] != "running"]

    dropped = [("aborted", "its source node node-c has no lease in etcd")]
    try:
        wait_for("the spare to drop the half-done move", lambda: moves() == dropped, 30)
    except AssertionError:
        raise AssertionError(f"the spare's incoming moves: {moves()}") from None
    try:
        for name, node in where.items():
            assert wait_exited(node, name, timeout_s=150)["exit_code"] == 0
    except BaseException:
        tell(where, [a, b, spare])
        raise
    for name, node in where.items():
        log = node.cli("logs", name).stdout
        assert sorted(set(steps_in(log))) == list(range(STEPS)), f"{name}: {steps_in(log)}"
        # No restart: a restarted worker would start with another pid in the job's PID namespace.
        # (CI once saw a rolled-back torchrun tree's start line twice with the same pid.)
        starts = set(re.findall(r"^rank \d+ pid \d+ of 3$", log, re.M))
        assert len(starts) == 1, f"{name} restarted: {starts}"
    assert {final_digest(n.cli("logs", j).stdout) for j, n in where.items()} == ref_digests
