"""The pure parts of scripts/bench_ranks.py: wall time, goodput, the projection, the report."""

from __future__ import annotations

import pytest
from scriptload import load

bench = load("bench_ranks")


def test_wall_time_runs_from_the_first_logs_first_step_to_the_last_logs_last() -> None:
    assert bench.wall_s([10.0, 11.0, 12.0], [40.0, 41.5]) == pytest.approx(31.5)
    with pytest.raises(bench.BenchError, match="no stamped steps"):
        bench.wall_s([], [1.0])


def test_goodput_is_the_share_left_after_the_lost_time_and_never_negative() -> None:
    assert bench.goodput(3600.0, 360.0) == pytest.approx(0.9)
    assert bench.goodput(100.0, 500.0) == 0.0


def test_projection_charges_half_an_interval_to_every_restart_and_the_move_only_when_warned() -> None:
    rows = bench.project(restart_s=60.0, interval_s=1800.0, move_s=6.0)
    assert [(p.gpus, p.mttf_h) for p in rows] == [(1024, 7.9), (16384, 1.8)]
    big = rows[1]
    m = 1.8 * 3600
    assert big.restart == pytest.approx(1 - 960 / m)
    assert big.warned_half == pytest.approx(1 - (3 + 480) / m)
    assert big.warned_all == pytest.approx(1 - 6 / m)
    assert big.restart < big.warned_half < big.warned_all
    assert rows[0].restart > big.restart  # a smaller job fails less often


def test_the_report_has_a_line_per_run_and_a_table_per_projection() -> None:
    runs = {
        "undisturbed": {"wall_s": 30.0, "lost_s": 0.0},
        "ferry: move rank 1": {
            "wall_s": 32.5,
            "lost_s": 2.5,
            "frozen_s": 2.0,
            "peers_gap_s": 2.4,
            "recomputed_steps": 0,
            "bit_identical": True,
        },
        "checkpoint-restart, K=90": {
            "wall_s": 60.0,
            "lost_s": 30.0,
            "recomputed_steps": 90,
            "bit_identical": False,
        },
    }
    text = bench.format_report(runs, {"move 2.5 s": bench.project(5.0, 1800.0, 2.5)})
    lines = text.splitlines()
    assert lines[1].split()[:3] == ["undisturbed", "30.00", "s"]
    assert "2.00 s" in lines[2] and "2.40 s" in lines[2]
    assert lines[2].endswith(" yes") and lines[1].endswith(" -")
    assert lines[3].endswith(" 90     no") and " - " in lines[3]
    assert "goodput, move 2.5 s" in text and text.count("%") == 6


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--interval-steps", "400"], "--interval-steps/2 (200)"),
        (["--fail-at", "130"], "--fail-at (130)"),
    ],
)
def test_impossible_schedules_are_refused_before_any_bed(monkeypatch, argv, said) -> None:
    monkeypatch.setattr(bench.os, "geteuid", lambda: 0)
    with pytest.raises(bench.BenchError, match=said.replace("(", r"\(").replace(")", r"\)")):
        bench.preflight(bench.build_parser().parse_args(argv))
