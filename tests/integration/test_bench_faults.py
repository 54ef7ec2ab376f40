"""The fault bench (scripts/bench_faults.py), small: the same job under the same two failures (a
node dead without warning, then one whose GPU warned first) finished undisturbed, by
checkpoint-restart, by TorchFT and by ferry, each on a fresh multi-node bed. Checked: all four
finish every step; each disturbed run is slower than the undisturbed one; ferry and
checkpoint-restart end bit-identical to the undisturbed run, and ferry recomputes no step on the
warned failure. The order issue 30's targets ask for (ferry's excess at most half of
checkpoint-restart's, ferry faster than TorchFT) is printed with the report, not asserted: it
does not hold yet (at this size, one run: checkpoint-restart 48.8 s, ferry 55.0 s, TorchFT
59.2 s, undisturbed 32.5 s). (The hard failure comes first: a node that dies
seconds after a warned move, before a round has covered the moved member, rolls the group back
past the move: docs/performance.md.)

Serial: the bench raises fs.pipe-max-size for ferry's post-copy moves, which every agent reads.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from agent.testing.etcd import have_etcd
from tests.integration.jobtools import REPO

pytestmark = [
    pytest.mark.serial,
    pytest.mark.skipif(not have_etcd(), reason="no etcd binary: `make etcd` installs Debian's etcd-server"),
]

STEPS = 300


@pytest.mark.timeout(900)
def test_four_ways_finish_the_same_job_under_the_same_failures_in_the_expected_order(tmp_path: Path) -> None:
    out = tmp_path / "faults.json"
    args = [
        *("--steps", str(STEPS), "--step-time", "0.1", "--ballast-mb", "32"),
        *("--schedule", "hard:2,warned:1", "--warning-s", "6", "--every", "4", "--detect-s", "3"),
        *("--methods", "checkpoint-restart,torchft,ferry", "--json", str(out), "--workdir", str(tmp_path)),
    ]
    p = subprocess.run(
        [sys.executable, str(REPO / "scripts/bench_faults.py"), *args],
        capture_output=True,
        text=True,
        timeout=840,
    )
    print(p.stdout)
    assert p.returncode == 0, p.stdout + p.stderr[-4000:]
    r = json.loads(out.read_text())
    runs = r["runs"]
    assert set(runs) == {"undisturbed", "checkpoint-restart", "torchft", "ferry"}
    assert [f["kind"] for f in r["schedule"]] == ["hard", "warned"]
    base = runs["undisturbed"]["wall_s"]
    assert base > STEPS * 0.1, base  # every step slept its 0.1 s
    for name, x in runs.items():
        if name == "undisturbed":
            continue
        # Every failure struck this run, and the job got past it.
        assert [f["kind"] for f in x["failures"]] == ["hard", "warned"], (name, x["failures"])
        assert all(math.isfinite(f["lost_s"]) for f in x["failures"]), (name, x["failures"])
        assert x["wall_s"] > base, f"{name} ({x['wall_s']:.1f} s) beat the undisturbed run ({base:.1f} s)"
    assert runs["ferry"]["bit_identical"] and runs["checkpoint-restart"]["bit_identical"], p.stdout
    (warned,) = [f for f in runs["ferry"]["failures"] if f["kind"] == "warned"]
    assert warned["recomputed"] == 0, warned
    assert out.with_suffix(".png").stat().st_size > 0
    assert not [d for d in tmp_path.iterdir() if d.name.startswith("ferry-bench-faults-")], "beds left behind"
