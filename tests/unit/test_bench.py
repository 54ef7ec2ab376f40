"""The pure parts of scripts/bench_migrate.py: step lines, downtime, medians, ratios, the table."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from scriptload import load

bench = load("bench_migrate")


def log(*steps: tuple[int, float], extra: str = "") -> str:
    return "ready 123 params\n" + "".join(f"step {i} t={t:.6f} loss 0.5\n" for i, t in steps) + extra


def test_parse_steps_reads_only_step_lines_in_order() -> None:
    text = (
        "ready 10 params\nstep 0 t=100.5 loss 1\nwarning: step 3 t=1\n"
        "step 1 t=101.000001 loss 0.9\nsaved 1 t=102\n"
    )
    assert bench.parse_steps(text) == [(0, 100.5), (1, 101.000001)]


def test_parse_steps_ignores_a_partial_last_line_without_time() -> None:
    assert bench.parse_steps("step 0 t=1.0 loss 1\nstep 1 ") == [(0, 1.0)]


def test_normal_step_is_the_median_of_the_last_intervals() -> None:
    steps = [(0, 0.0), (1, 5.0), (2, 6.0), (3, 7.0), (4, 8.5), (5, 9.5)]
    # The slow first step falls out of a window of 3; the median of 1.0, 1.5, 1.0 is 1.0.
    assert bench.normal_step_s(steps, window=3) == pytest.approx(1.0)
    assert bench.normal_step_s(steps, window=10) == pytest.approx(1.0)


def test_normal_step_skips_intervals_across_a_gap_in_numbering() -> None:
    assert bench.normal_step_s([(0, 0.0), (1, 1.0), (5, 100.0), (6, 101.0)]) == pytest.approx(1.0)


def test_normal_step_needs_two_consecutive_steps() -> None:
    with pytest.raises(ValueError):
        bench.normal_step_s([(3, 1.0)])


def test_gap_of_a_move_in_separate_outputs() -> None:
    before = log((0, 10.0), (1, 11.0), (2, 12.0), (3, 13.0))
    after = log((4, 20.0), (5, 21.0))
    gap = bench.measure_gap(before, after, requested_at=13.4)
    assert gap["last_step_before"] == 3
    assert gap["first_step_after"] == 4
    assert gap["steps_skipped"] == 0
    assert gap["step_s"] == pytest.approx(1.0)
    assert gap["gap_s"] == pytest.approx(7.0)
    assert gap["downtime_s"] == pytest.approx(6.0)
    assert gap["total_s"] == pytest.approx(6.6)


def test_gap_when_the_moved_log_repeats_the_old_output() -> None:
    """ferry's target log starts with the source's output: those steps are not "after"."""
    before = log((0, 10.0), (1, 11.0), (2, 12.0))
    after = before + "step 3 t=15.500000 loss 0.4\nstep 4 t=16.5 loss 0.3\n"
    gap = bench.measure_gap(before, after, requested_at=12.5)
    assert (gap["last_step_before"], gap["first_step_after"]) == (2, 3)
    assert gap["downtime_s"] == pytest.approx(2.5)


def test_gap_of_checkpoint_restart_uses_the_step_before_saved() -> None:
    before = log((0, 1.0), (1, 2.0), (2, 3.0), extra="saved 2 t=3.400000\n")
    after = "ready 123 params\nstep 3 t=9.0 loss 1\n"
    gap = bench.measure_gap(before, after, requested_at=2.5)
    assert gap["downtime_s"] == pytest.approx(5.0)
    assert gap["total_s"] == pytest.approx(6.5)


def test_gap_without_a_step_after_the_move_is_an_error() -> None:
    before = log((0, 1.0), (1, 2.0))
    with pytest.raises(ValueError, match="no step after step 1"):
        bench.measure_gap(before, before, requested_at=2.0)
    with pytest.raises(ValueError, match="no step lines before"):
        bench.measure_gap("ready 1 params\n", log((0, 1.0)), requested_at=0.0)


def test_steps_after_counts_only_new_steps() -> None:
    before = log((0, 1.0), (1, 2.0))
    assert bench.steps_after(before, before) == 0
    assert bench.steps_after(before + "step 2 t=3.0 loss 1\nstep 3 t=4.0 loss 1\n", before) == 2
    assert bench.steps_after("step 0 t=1.0 loss 1\n", "") == 1


def test_gbps() -> None:
    assert bench.gbps(4e9, 2.0) == pytest.approx(2.0)
    assert bench.gbps(1, 0) is None


def test_idle_rate_is_the_rate_of_memory_the_host_had_reclaimed() -> None:
    # Two chunks of backed memory at 2 GB/s, then three the host had to back again at 0.2 GB/s.
    r = bench.idle_rate(1_000_000_000, [0.5, 0.5, 5.0, 5.0, 5.0])
    assert (r["kind"], r["gbps"]) == ("reclaimed", pytest.approx(0.2))
    assert (r["backed_bytes"], r["reclaimed_bytes"]) == (2e9, 3e9)
    assert r["backed_gbps"] == pytest.approx(2.0)


def test_idle_rate_where_the_host_reclaims_nothing_is_the_whole_write() -> None:
    # A slower chunk that stays above a third of the first is still backed memory.
    r = bench.idle_rate(1_000_000_000, [0.5, 1.0, 1.4])
    assert (r["kind"], r["reclaimed_bytes"], r["reclaimed_gbps"]) == ("backed", 0, None)
    assert r["gbps"] == pytest.approx(3e9 / 2.9 / 1e9)


def test_median_run_takes_medians_of_numbers_and_nested_dicts() -> None:
    runs = [
        {"downtime_s": 3.0, "phases_s": {"dump": 1.0, "restore": 2.0}, "id": "a", "ferry_downtime_s": None},
        {"downtime_s": 1.0, "phases_s": {"dump": 3.0, "restore": 4.0}, "id": "b", "ferry_downtime_s": 0.5},
        {"downtime_s": 2.0, "phases_s": {"dump": 2.0, "restore": 9.0}, "id": "c", "ferry_downtime_s": 0.7},
    ]
    med = bench.median_run(runs)
    assert med["downtime_s"] == 2.0
    assert med["phases_s"] == {"dump": 2.0, "restore": 4.0}
    assert med["id"] == "c"  # not a number: the last run's
    assert med["ferry_downtime_s"] == 0.7
    assert bench.median_run([]) == {}


def run(down: float, total: float, nbytes: int) -> dict[str, float]:
    return {"downtime_s": down, "total_s": total, "bytes": nbytes, "gbps": nbytes / total / 1e9}


def summary() -> dict:
    runs = {
        "ferry": [run(1.0, 2.0, 4_000_000_000), run(3.0, 4.0, 4_000_000_000), run(2.0, 3.0, 4_000_000_000)],
        "criu": [run(8.0, 9.0, 4_100_000_000)],
        "ckpt": [run(12.0, 13.0, 3_000_000_000)],
    }
    return bench.size_summary(2.0, runs, {"fresh_gbps": 1.0, "touched_gbps": 4.0, "idle_gbps": 0.5})


def test_size_summary_bound_and_ratios() -> None:
    s = summary()
    assert s["median"]["ferry"]["downtime_s"] == 2.0
    # The bound copies ferry's image bytes: 4 GB at 1 and 4 GB/s.
    assert s["bound"] == {
        "bytes": 4_000_000_000,
        "fresh_s": pytest.approx(4.0),
        "touched_s": pytest.approx(1.0),
        "floor_s": pytest.approx(8.0),  # one write into idle memory, at 0.5 GB/s
    }
    r = s["ratios"]
    assert r["ferry_over_floor"] == pytest.approx(0.25)
    assert r["ferry_over_bound_fresh"] == pytest.approx(0.5)
    assert r["ferry_over_bound_touched"] == pytest.approx(2.0)
    assert r["criu_over_ferry"] == pytest.approx(4.0)
    assert r["ckpt_over_ferry"] == pytest.approx(6.0)
    assert r["total_criu_over_ferry"] == pytest.approx(3.0)
    assert r["total_ckpt_over_ferry"] == pytest.approx(13.0 / 3.0)


def test_post_copy_is_compared_with_pre_copy_and_the_baselines_from_the_same_run() -> None:
    runs = {
        "ferry": [run(4.0, 5.0, 4_000_000_000)],
        "lazy": [run(1.0, 6.0, 4_000_000_000)],
        "criu": [run(3.0, 4.0, 4_000_000_000)],
        "ckpt": [run(2.5, 4.0, 3_000_000_000)],
    }
    s = bench.size_summary(2.0, runs, {"fresh_gbps": 1.0, "touched_gbps": 4.0})
    r = s["ratios"]
    assert r["lazy_over_ferry"] == pytest.approx(0.25)
    assert r["criu_over_lazy"] == pytest.approx(3.0) and r["ckpt_over_lazy"] == pytest.approx(2.5)
    text = bench.format_table([s])
    assert "post-copy/pre-copy 0.25x" in text
    assert "plain CRIU/post-copy 3.0x, checkpoint-restart/post-copy 2.5x" in text
    assert "ferry (post-copy)" in text.splitlines()[4] and "ferry --pre-copy" in text.splitlines()[1]
    assert bench.FERRY_FLAGS["lazy"] == ("--post-copy",) and bench.FERRY_FLAGS["ferry"] == ("--pre-copy",)


def test_size_summary_without_ferry_bounds_the_next_method_and_leaves_ratios_empty() -> None:
    s = bench.size_summary(1.0, {"criu": [run(2.0, 3.0, 1_000_000_000)]}, {"fresh_gbps": 2.0})
    assert s["bound"]["bytes"] == 1_000_000_000
    assert s["bound"]["fresh_s"] == pytest.approx(0.5)
    assert s["bound"]["touched_s"] is None
    assert all(v is None for v in s["ratios"].values())


def test_format_table_rows_and_ratio_line() -> None:
    text = bench.format_table([summary()])
    lines = text.splitlines()
    assert lines[0].split() == ["SIZE", "METHOD", "DOWNTIME", "TOTAL", "BYTES", "GB/S"]
    rows = [ln for ln in lines[1:] if ln.startswith("2 GiB  ")]
    assert len(rows) == 6  # three methods, the floor, two copy bounds
    assert "ferry" in rows[0] and "2.00 s" in rows[0] and "4.00 GB" in rows[0] and "1.33" in rows[0]
    assert "floor (one write, idle memory)" in rows[3] and "8.00 s" in rows[3] and "0.50" in rows[3]
    assert "copy bound (fresh)" in rows[4] and "4.00 s" in rows[4]
    assert "copy bound (pre-touched)" in rows[5] and "1.00 s" in rows[5]
    assert lines[-1] == (
        "2 GiB: downtime post-copy/floor -x, pre-copy/floor 0.25x; "  # post-copy not run here
        "plain CRIU/post-copy -x, checkpoint-restart/post-copy -x; post-copy/pre-copy -x; "
        "pre-copy/copy bound 0.5x (fresh), 2.0x (pre-touched); plain CRIU/pre-copy 4.0x; "
        "checkpoint-restart/pre-copy 6.0x; ferry --staged/pre-copy -x"
    )


def test_format_table_marks_missing_figures() -> None:
    s = bench.size_summary(1.0, {"ckpt": [run(2.0, 3.0, 10**9)]}, {})
    text = bench.format_table([s])
    assert "checkpoint-restart" in text and "pre-copy/floor -x" in text


@pytest.mark.parametrize(
    ("text", "want"), [("1,2,4", [1.0, 2.0, 4.0]), ("0.25, 0.5", [0.25, 0.5]), ("8", [8.0])]
)
def test_parse_sizes(text: str, want: list[float]) -> None:
    assert bench.parse_sizes(text) == want


@pytest.mark.parametrize("text", ["", "a,b", "1,-2", "0"])
def test_parse_sizes_rejects(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        bench.parse_sizes(text)


def test_parse_methods_keeps_the_interleaved_order() -> None:
    assert bench.parse_methods("ckpt,ferry") == ["ferry", "ckpt"]
    with pytest.raises(argparse.ArgumentTypeError):
        bench.parse_methods("ferry,scp")


def test_parser_defaults() -> None:
    args = bench.build_parser().parse_args([])
    assert args.sizes == [1.0, 2.0, 4.0]
    assert args.repeat == 1
    assert args.methods == ["ferry", "criu", "ckpt", "staged", "lazy"]
    assert args.json == Path("bench-results/bench.json")
    assert args.plot == Path("bench-results/downtime.png")
    assert args.workdir == Path("/var/tmp")


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "sub" / "downtime.png"
    bench.plot([summary()], out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
