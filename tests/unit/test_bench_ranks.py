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


def test_the_peers_usual_step_is_their_median_step() -> None:
    assert bench.median_step([0.0, 0.25, 0.5, 0.75, 2.0]) == pytest.approx(0.25)  # a 1.25 s gap is no step
    assert bench.median_step([0.0, 0.2, 0.5]) == pytest.approx(0.25)
    with pytest.raises(bench.BenchError, match="fewer than two"):
        bench.median_step([1.0])


def test_the_pause_target_is_the_frozen_time_and_half_a_second() -> None:
    pause, met = bench.pause_target(gap_s=1.5, step_s=0.25, frozen_s=0.7)
    assert pause == pytest.approx(1.25) and not met
    assert bench.pause_target(gap_s=1.2, step_s=0.25, frozen_s=0.7) == (pytest.approx(0.95), True)


def test_the_report_says_the_groups_pause_and_whether_the_target_was_met() -> None:
    moved = {
        "wall_s": 32.5,
        "lost_s": 2.5,
        "frozen_s": 0.9,
        "group_pause_s": 1.02,
        "group_pause_by": "frozen 0.90 s, then the peers reached the job again 0.12 s after its release",
        "peers_gap_s": 1.3,
        "step_s": 0.25,
        "peers_pause_s": 1.05,
        "pause_target_met": True,
        "recomputed_steps": 0,
        "bit_identical": True,
    }
    text = bench.format_report({"undisturbed": {"wall_s": 30.0, "lost_s": 0.0}, "ferry": moved}, {})
    row = text.splitlines()[2]
    assert row.split()[:9] == ["ferry", "32.50", "s", "2.50", "s", "0.90", "s", "1.02", "s"]
    assert "the group's pause as ferry reported it: 1.02 s (frozen 0.90 s, then" in text
    assert (
        "longest step gap 1.30 s - usual step 0.25 s = 1.05 s; target <= frozen 0.90 s + 0.5 s: met" in text
    )
    unmet = bench.format_report({"ferry": {**moved, "group_pause_s": None, "pause_target_met": False}}, {})
    assert "reported it: not measured" in unmet and "NOT met" in unmet
    assert "own longest step gap" not in text  # a run from before the figure was kept
    post = bench.format_report({"ferry": {**moved, "moved_gap_s": 1.1, "method": "post-copy"}}, {})
    assert "the moved rank's own longest step gap 1.10 s: its peers' is within it + 0.5 s (post-copy:" in post
    late = bench.format_report({"ferry": {**moved, "moved_gap_s": 0.5}}, {})
    assert "own longest step gap 0.50 s: its peers' is 0.80 s longer" in late


def test_the_model_width_reaches_the_workload() -> None:
    args = bench.build_parser().parse_args(["--hidden", "262144"])
    runs = bench.Runs.__new__(bench.Runs)
    runs.args = args
    train = runs.train()
    assert train[train.index("--hidden") + 1] == "262144"
    assert bench.build_parser().parse_args([]).hidden == 64


def test_ferry_only_needs_no_checkpoint_schedule(monkeypatch) -> None:
    monkeypatch.setattr(bench.os, "geteuid", lambda: 0)
    short = ["--steps", "40", "--fail-at", "20"]
    with pytest.raises(bench.BenchError, match="--interval-steps/2"):
        bench.preflight(bench.build_parser().parse_args(short))
    with pytest.raises(bench.BenchError, match=r"--fail-at \(50\)"):
        bench.preflight(bench.build_parser().parse_args(["--ferry-only", "--steps", "40", "--fail-at", "50"]))
    from agent import config

    monkeypatch.setattr(config, "criu_binary", lambda: "/usr/local/sbin/criu")
    bench.preflight(bench.build_parser().parse_args(["--ferry-only", *short]))
