"""A protected member moved to the spare that keeps its last snapshot image goes as an increment
over that image (agent/migration/chainmove.py): on the etcd bed of tests/integration/
test_recovery.py, where the spare keeps every member's images."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from agent.jobs import procs
from agent.testing.bed import Bed, node_bed
from agent.testing.etcd import have_etcd
from agent.testing.poll import wait_for
from agent.testing.ranks import start_job as start_ranks
from agent.testing.ranks import tell
from tests.integration.jobtools import final_digest, steps_in
from tests.integration.test_nodes import wait_exited
from tests.integration.test_nodes import wait_for as wait_log
from tests.integration.test_recovery import _cluster, _protection, _runs_rounds

pytestmark = pytest.mark.skipif(
    not have_etcd(), reason="no etcd binary: `make etcd` installs Debian's etcd-server"
)

STEPS = 220
SHIP_PAUSE_S = 8.0  # longer than a loaded node takes from the log line to the move's Prepare


@pytest.fixture
def bed(tmp_path: Path):
    with node_bed(tmp_path) as b:
        b.etcd()
        yield b


@pytest.mark.timeout(240)
def test_a_member_moved_to_the_spare_keeping_its_image_moves_as_an_increment_and_runs_on(bed: Bed) -> None:
    """Rounds keep every member's chain on the spare. node-c's member, moved there by
    default (`ferry migrate`, as self-healing moves it), moves as an increment over its last
    image: a small part of its memory crosses, no post-copy follows, the spare's next round
    dumps it as an increment over the image it moved as, and every rank ends with every step
    once, in order, bit-identical to an undisturbed run. The move is asked while the member's
    last dump ships: it waits for the spare to have that image, and goes over it."""
    # node-c's agent pauses before it ships each image of its member: the move is asked there,
    # after the round's dump cleared the member's dirty bits and before the spare has that image.
    (a, b, c), (spare,) = _cluster(bed, env={"node-c": {"FERRY_PAUSE": f"snapshot-shipping={SHIP_PAUSE_S}"}})
    nodes = [a, b, c]
    ref = start_ranks(nodes, "ref", 29510, ["--steps", str(STEPS), "--step-time", "0", "--ballast-mb", "256"])
    # Rounds every 8 s: a move asked as one completes comes before the next (one that a round
    # holds is refused, and asked again), and the move makes the next come at once.
    protect = {rank: ("--protect", "8s") for rank in range(3)}
    # Ballast: memory the job keeps and rarely writes, as a model's is (a round's increment is then a
    # part of it, and its chain runs on: agent.snapshots.member.CHAIN_MAX).
    train = ["--steps", str(STEPS), "--step-time", "0.25", "--ballast-mb", "256"]
    job = start_ranks(nodes, "llm", 29500, train, flags=protect)
    wait_log(a, job[0], r"^step 5 ", timeout_s=240)

    rss = procs.tree_rss(int(c.job(job[2])["pid"]))  # what a move of its whole memory carries

    def kept_on_spare() -> dict:  # node-c's member in the last round
        for n in nodes:
            if _runs_rounds(n):
                last = _protection(n)["last"]
                return next((m for m in last.get("members", []) if m["job"] == job[2]), {})
        return {}

    def steady(m: dict) -> bool:  # kept on the spare, an increment of a job done allocating
        small = 0 < int(m.get("bytes", 0)) < rss // 4
        return m.get("buddy_node") == "node-d" and int(m.get("parent_epoch", 0)) > 0 and small

    # The first rounds' images may come before the job built its memory: the move goes over one after.
    wait_for("a round of the job's steady state kept on the spare", lambda: steady(kept_on_spare()), 90)

    said = f"FERRY_PAUSE: pausing {SHIP_PAUSE_S:.1f} s at 'snapshot-shipping'"
    before = c.log_path.read_text().count(said)
    wait_for("node-c's next ship", lambda: c.log_path.read_text().count(said) > before, 30)
    moved: subprocess.CompletedProcess[str] | None = None
    busy = re.compile(r"migrating, not running|held for a group snapshot")
    for _ in range(10):  # a move asked while a round holds the member is refused: ask again
        moved = c.cli("migrate", job[2], "--to", spare.address, "--json", check=False, timeout_s=120)
        if moved.returncode == 0 or not busy.search(moved.stderr):
            break
    assert moved is not None and moved.returncode == 0, moved.stderr if moved else ""
    result = json.loads(moved.stdout)
    print(
        f"moved as {result['method']!r}: {result['image_bytes'] >> 20} MiB crossed (its resident "
        f"memory: {rss >> 20} MiB), frozen {result['frozen_s']:.2f} s"
    )
    assert "an increment over its snapshot image of round" in result["method"], result
    waited = "its move waits for its image of round"
    assert waited in c.log_path.read_text(), "the move was not asked while the dump shipped"
    assert "node-d" in result["method"], result
    assert 0 < result["image_bytes"] < rss // 4, result

    # The move's image is the member's last dump on the spare now (under a number etcd gave it):
    # its next round's image there is an increment over it, not its whole memory again.
    def moved_copy() -> dict:
        for n in [a, b, spare]:
            if _runs_rounds(n):
                last = _protection(n)["last"]
                return next((m for m in last.get("members", []) if m["job"] == job[2]), {})
        return {}

    wait_for("a round over the moved member", lambda: moved_copy().get("node") == "node-d", 60)
    after = moved_copy()
    print(f"the round after the move: {int(after['bytes']) >> 20} MiB of the moved member's, {after}")
    assert int(after.get("parent_epoch", 0)) > 0 and int(after["bytes"]) < rss // 4, after

    where = {job[0]: a, job[1]: b, job[2]: spare}
    try:
        for name, node in where.items():
            assert wait_exited(node, name, timeout_s=150)["exit_code"] == 0
    except BaseException:
        tell(where, [*nodes, spare])
        raise
    logs = {name: node.cli("logs", name).stdout for name, node in where.items()}
    for name, log in logs.items():
        assert steps_in(log) == list(range(STEPS)), f"{name}: {steps_in(log)}"
    ref_digests = {final_digest(n.cli("logs", r).stdout) for r, n in zip(ref, nodes, strict=True)}
    assert {final_digest(log) for log in logs.values()} == ref_digests
