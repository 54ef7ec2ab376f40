"""The link benchmark runs end to end (a small size): its CRIU dump, page server and raw TLS
socket, and the report. `make bench` is the only other caller, so a change to the data path's
files would otherwise break it unseen."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.integration.jobtools import REPO


def test_the_link_benchmark_runs_and_reports_both_paths(tmp_path: Path) -> None:
    out = tmp_path / "link.json"
    p = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts/bench_link.py"),
            "--gib",
            "0.05",
            "--json",
            str(out),
            "--workdir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "ferry / raw:" in p.stdout
    figures = json.loads(out.read_text())
    assert figures["bytes"] >= 0.05 * (1 << 30) and figures["cipher"].startswith("TLS_")
    assert figures["ferry_gbps"] > 0 and figures["raw_gbps"] > 0 and figures["ratio"] > 0
    assert not [d for d in tmp_path.iterdir() if d.name.startswith("ferry-bench-link-")], (
        "scratch left behind"
    )
