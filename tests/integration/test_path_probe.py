"""A large move probes its path first (agent.migration.probe), on the multi-node bed: one target's
link is held to a few Mbit/s (a token bucket on the fabric's end of it, as a link that trained
down would be); the move there is refused before anything freezes, with the figure, and the job
runs on untouched; the same move to a target with a sound path goes, its rate in the result.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from agent.testing.bed import Bed, node_bed
from tests.integration.jobtools import WORKLOAD, final_digest, reference_digest, steps_in, train_args

#: Every move is probed (above 0 MiB) with 8 MiB and must see 20 MB/s.
VERIFY = "[verify]\nprobe_above_mib = 0\nprobe_mib = 8\npath_min_mbps = 20\n"
#: Long enough to be running at the second move: the refused one's probe crosses the slow path
#: first (about 2 s), and under the whole suite's load a 0.1 s step took 0.27 s (a job of 60
#: steps once ended just before that move froze it, and the move found its link gone with it).
STEPS = 150


@pytest.fixture
def bed(tmp_path: Path):
    with node_bed(tmp_path) as b:
        yield b


def test_a_move_over_a_slow_path_is_refused_before_it_freezes_and_a_sound_path_takes_it(bed: Bed) -> None:
    a = bed.node("node-a", config=VERIFY)
    slow, sound = bed.node("node-b"), bed.node("node-c")
    bed.throttle(slow, 40)  # 5 MB/s into node-b
    a.cli("run", "--name", "train", "--", sys.executable, str(WORKLOAD), *train_args(STEPS))
    a.wait_log("train", r"^step 5 ")

    refused = a.cli("migrate", "train", "--to", slow.address, check=False)
    assert refused.returncode != 0
    assert "prepare path probe" in refused.stderr and "the path to node-b carries " in refused.stderr
    assert "below [verify] path_min_mbps 20" in refused.stderr, refused.stderr
    rate = float(refused.stderr.split("carries ")[1].split(" MB/s")[0])
    assert 1 < rate < 20  # measured, not assumed: about 5 MB/s through the bucket
    assert a.job("train")["state"] == "running"  # nothing froze
    assert "train" not in {j["name"] for j in json.loads(slow.cli("ps", "--json").stdout)}
    events = json.loads(a.cli("events", "--json").stdout)
    assert any(e["kind"] == "verify" and "the path to node-b carries" in e["message"] for e in events)

    result = json.loads(a.cli("migrate", "train", "--to", sound.address, "--json").stdout)
    assert result["path_mbps"] is not None and result["path_mbps"] >= 20, result
    print(f"path probe: node-b {rate:.1f} MB/s (refused), node-c {result['path_mbps']:.0f} MB/s (moved)")
    j = sound.wait_exited("train")
    out = sound.cli("logs", "train").stdout
    assert j["exit_code"] == 0 and steps_in(out) == list(range(STEPS))
    assert final_digest(out) == reference_digest(STEPS)
