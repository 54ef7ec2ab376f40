"""The pure parts of scripts/bench_faults.py: the failure schedule, Young/Daly, what a failure
cost a run (from its step lines), the steady step, the targets and the report."""

from __future__ import annotations

import itertools
import math

import pytest
from scriptload import load

bench = load("bench_faults")


def test_a_seed_gives_one_schedule_within_the_bounds_and_the_spacing() -> None:
    a = bench.schedule(7, 300.0, 4, 6, 20.0, 0.5, 10.0)
    assert a == bench.schedule(7, 300.0, 4, 6, 20.0, 0.5, 10.0)
    assert 4 <= len(a) <= 6
    times = [f.at_s for f in a]
    assert times == sorted(times) and times[0] >= 20.0 and times[-1] < 300.0
    assert all(b - x >= 20.0 - 0.1 for x, b in itertools.pairwise(times))  # rounded to 0.1 s
    assert {f.kind for f in a} <= {"warned", "hard"} and all(0 <= f.replica < bench.WORLD for f in a)
    others = {tuple(bench.schedule(s, 300.0, 4, 6, 20.0, 0.5, 10.0)) for s in range(1, 6)}
    assert len(others) > 1  # the seed matters


def test_a_schedule_that_cannot_fit_is_refused_with_what_to_change() -> None:
    with pytest.raises(bench.BenchError, match="4 failures 20 s apart do not fit in 60 s: more steps"):
        bench.schedule(1, 70.0, 4, 6, 20.0, 0.5, 10.0)


def test_the_defaults_fit_a_run_as_short_as_this_machine_s_500_steps() -> None:
    """500 steps took 119 s here: at most six failures 20 s apart would not fit, four or five do."""
    a = bench.schedule(1, 119.0, 4, 6, 20.0, 0.5, 10.0)
    assert 4 <= len(a) <= 5 and a[0].at_s >= 20.0 and a[-1].at_s < 119.0


def test_young_daly_interval_in_steps() -> None:
    # sqrt(2 x 0.5 s x 36 s) = 6 s, at 0.25 s a step: 24 steps; never below one step.
    assert bench.young_daly_steps(0.5, 36.0, 0.25) == 24
    assert bench.young_daly_steps(0.0001, 1.0, 10.0) == 1


def lines(*pairs: tuple[int, float]) -> str:
    return "".join(f"step {s} loss 0.5 at {t:.3f}\n" for s, t in pairs)


def test_steps_are_read_from_every_log_in_time_order_and_the_wall_time_spans_them() -> None:
    pts = bench.steps_of([lines((0, 10.0), (1, 11.0)), lines((0, 10.1), (1, 11.2), (2, 12.0))])
    assert pts == [(10.0, 0), (10.1, 0), (11.0, 1), (11.2, 1), (12.0, 2)]
    assert bench.wall(pts, 3) == pytest.approx(2.0)
    assert bench.frontier(pts, 11.1) == 1 and bench.frontier(pts, 9.0) == -1
    with pytest.raises(bench.BenchError, match="did not log both step 0 and step 3"):
        bench.wall(pts, 4)


def test_a_hard_failure_costs_the_time_to_pass_the_reached_step_and_counts_the_steps_done_again() -> None:
    # Steps every 1 s to step 10 at t=10; killed at 10.5; back from step 7 at t=20, step 11 at 24.
    pts = bench.steps_of(
        [lines(*[(s, float(s)) for s in range(11)], (7, 20.0), (8, 21.0), (9, 22.0), (10, 23.0), (11, 24.0))]
    )
    f = bench.Failure(10.0, "hard", 1)
    s = bench.Struck(f, "node-b", None, 10.5)
    bench.judge(pts, s, 1.0)
    assert s.recomputed == 4  # steps 7-10 again
    assert s.back_at == 24.0
    assert s.lost_s == pytest.approx(24.0 - 10.5 - 1 * 1.0)  # one new step (11) made in the window


def test_a_warned_failure_is_counted_from_its_warning_and_a_move_recomputes_nothing() -> None:
    # Warned at 5.5, a 3 s pause (step 6 at 9.0), killed at 10.5 (no effect), steps go on.
    pts = bench.steps_of([lines(*[(s, float(s)) for s in range(6)], *[(s, s + 3.0) for s in range(6, 15)])])
    s = bench.Struck(bench.Failure(10.0, "warned", 0), "node-a", 5.5, 10.5)
    bench.judge(pts, s, 1.0)
    assert s.recomputed == 0
    assert s.back_at == 11.0  # step 8 (reached 7 at 10.0)
    # From 5.5 to 11.0, steps 6..8 made: 5.5 s - 3 steps = 2.5 s lost (the pause less its step).
    assert s.lost_s == pytest.approx(2.5)


def ranked(rank: int, *pairs: tuple[int, float]) -> str:
    return "".join(f"step {s} loss 0.5 at {t:.3f} rank {rank}\n" for s, t in pairs)


def test_a_step_counts_as_done_again_only_when_the_same_rank_logs_it_twice() -> None:
    # Rank 0 logs step 5 at 5.00; rank 1, frozen by a move across the kill at 5.02, logs its
    # step 5 at 7.0 once restored: the step was done once by each rank.
    logs = [
        ranked(0, *[(s, float(s)) for s in range(6)], (6, 7.1)),
        ranked(1, *[(s, float(s) + 0.01) for s in range(5)], (5, 7.0), (6, 7.1)),
    ]
    s = bench.Struck(bench.Failure(5.0, "warned", 1), "node-b", 3.0, 5.02)
    bench.judge(bench.steps_of(logs), s, 1.0, bench.steps_by_rank(logs))
    assert s.recomputed == 0
    # The log that moved with rank 1 holds its earlier lines again, on the node it moved to.
    moved = [*logs, ranked(1, *[(s, float(s) + 0.01) for s in range(5)], (5, 7.0), (6, 7.1))]
    s = bench.Struck(bench.Failure(5.0, "warned", 1), "node-b", 3.0, 5.02)
    bench.judge(bench.steps_of(moved), s, 1.0, bench.steps_by_rank(moved))
    assert s.recomputed == 0
    # Across ranks without their names the same lines looked like steps 5 and 6 done again.
    s = bench.Struck(bench.Failure(5.0, "warned", 1), "node-b", 3.0, 5.02)
    bench.judge(bench.steps_of(logs), s, 1.0)
    assert s.recomputed == 2
    # Rolled back to a snapshot taken after step 2, rank 1 logs steps 3 and 4 again: two steps.
    logs = [
        ranked(0, *[(s, float(s)) for s in range(6)], (6, 9.1)),
        ranked(1, *[(s, float(s) + 0.01) for s in range(5)], (3, 8.0), (4, 8.5), (5, 9.0), (6, 9.1)),
    ]
    s = bench.Struck(bench.Failure(5.0, "hard", 1), "node-b", None, 5.02)
    bench.judge(bench.steps_of(logs), s, 1.0, bench.steps_by_rank(logs))
    assert s.recomputed == 2


def test_where_the_job_goes_on_without_the_dead_rank_its_replacement_is_not_waited_for() -> None:
    # TorchFT: rank 1 dies at 5.5; rank 0 stalls until the heartbeat timeout and steps on from
    # 10.5 with one replica; rank 1's replacement heals and logs its first step (step 14) at 19.0.
    logs = [
        ranked(0, *[(s, float(s)) for s in range(6)], *[(s, s + 5.0) for s in range(6, 20)]),
        ranked(1, *[(s, float(s)) for s in range(6)], *[(s, s + 5.0) for s in range(14, 20)]),
    ]
    s = bench.Struck(bench.Failure(5.5, "hard", 1), "node-b", None, 5.5, left_out=1)
    bench.judge(bench.steps_of(logs), s, 1.0, bench.steps_by_rank(logs))
    assert s.back_at == 11.0  # rank 0 past step 5
    assert s.lost_s == pytest.approx(11.0 - 5.5 - 1.0)
    # Waited for, the replacement's late start read as the job's stall.
    s = bench.Struck(bench.Failure(5.5, "hard", 1), "node-b", None, 5.5)
    bench.judge(bench.steps_of(logs), s, 1.0, bench.steps_by_rank(logs))
    assert s.back_at == 19.0


def test_the_job_is_back_when_every_rank_is_past_the_step_reached_not_at_the_step_in_flight() -> None:
    # Rank 1 dies at 5.5 having given its part of step 6: rank 0 logs step 6 at 5.51. Both
    # come back rolled back to step 3 at 10.0 and pass step 6 (rank 0's reached) at 13.0.
    logs = [
        ranked(0, *[(s, float(s)) for s in range(6)], (6, 5.51), (4, 10.0), (5, 11.0), (6, 12.0), (7, 13.0)),
        ranked(1, *[(s, float(s)) for s in range(6)], (4, 10.0), (5, 11.0), (6, 12.0), (7, 13.0)),
    ]
    s = bench.Struck(bench.Failure(5.5, "hard", 1), "node-b", None, 5.5)
    bench.judge(bench.steps_of(logs), s, 1.0, bench.steps_by_rank(logs))
    assert s.back_at == 12.0  # rank 1 past step 5, the job's frontier at the kill
    assert s.lost_s == pytest.approx(12.0 - 5.5 - 1.0)
    assert s.recomputed == 3  # rank 0: steps 4-6 again
    # Over all ranks at once the rollback after the step in flight says the same; the steps
    # done again are then every rank's together.
    s = bench.Struck(bench.Failure(5.5, "hard", 1), "node-b", None, 5.5)
    bench.judge(bench.steps_of(logs), s, 1.0)
    assert s.back_at == 12.0 and s.recomputed == 6


def test_a_step_every_rank_logs_just_after_the_kill_is_not_the_job_back_when_a_rollback_follows() -> None:
    # The defaults' run at e17002b: node-a killed at 5.5 while every rank finished step 6, the
    # dead one too before its SIGKILL landed (5.51); the group rolled back to step 3 at 8.0 and
    # passed step 5 again at 11.0. The next failure (a kill at 20.0) rolls back below step 5.
    logs = [
        ranked(
            r,
            *[(s, float(s)) for s in range(6)],
            (6, 5.51),
            (4, 8.0),
            (5, 9.0),
            (6, 10.0),
            (7, 11.0),
            (8, 12.0),
            (3, 21.0),
            (4, 22.0),
        )
        for r in range(3)
    ]
    s = bench.Struck(bench.Failure(5.5, "hard", 0), "node-a", None, 5.5)
    bench.judge(bench.steps_of(logs), s, 1.0, bench.steps_by_rank(logs), until=20.0)
    assert s.back_at == 10.0  # step 6 again, after the rollback, not step 6 in flight at 5.51
    assert s.lost_s == pytest.approx(10.0 - 5.5 - 1.0)
    assert s.recomputed == 3  # steps 4-6 again
    # Without the bound, the next failure's rollback below step 5 would count as this one's.
    s = bench.Struck(bench.Failure(5.5, "hard", 0), "node-a", None, 5.5)
    bench.judge(bench.steps_of(logs), s, 1.0, bench.steps_by_rank(logs))
    assert s.back_at is None or s.back_at > 20.0


def test_a_replay_that_runs_past_the_next_kill_is_the_earlier_failures() -> None:
    # Killed at 5.5 (hard), back from step 3 at 7.0, the replay passes step 5 at 9.5; a warned
    # node dies at 8.5, during the replay: its step 5 again is the hard failure's.
    logs = [ranked(0, *[(s, float(s)) for s in range(6)], (3, 7.0), (4, 8.0), (5, 9.0), (6, 9.5), (7, 10.0))]
    pts, br = bench.steps_of(logs), bench.steps_by_rank(logs)
    hard = bench.Struck(bench.Failure(5.5, "hard", 0), "node-b", None, 5.5)
    bench.judge(pts, hard, 1.0, br)
    assert hard.recomputed == 3 and hard.back_at == 9.5
    warned = bench.Struck(bench.Failure(8.5, "warned", 1), "node-c", 7.5, 8.5)
    bench.judge(pts, warned, 1.0, br, counted_until=hard.back_at)
    assert warned.recomputed == 0
    warned = bench.Struck(bench.Failure(8.5, "warned", 1), "node-c", 7.5, 8.5)
    bench.judge(pts, warned, 1.0, br)
    assert warned.recomputed == 1  # step 5 at 9.0, counted again without the bound


def test_a_failure_the_run_never_got_past_has_no_cost_to_report() -> None:
    pts = bench.steps_of([lines((0, 0.0), (1, 1.0))])
    s = bench.Struck(bench.Failure(1.0, "hard", 0), "node-a", None, 1.5)
    bench.judge(pts, s, 1.0)
    assert math.isnan(s.lost_s) and s.back_at is None


def test_the_steady_step_leaves_out_failure_windows_and_repeated_steps() -> None:
    pts = bench.steps_of([lines((0, 0.0), (1, 1.0), (2, 2.0), (3, 10.0), (4, 11.0), (2, 11.5), (5, 12.0))])
    assert bench.steady_step(pts, []) == pytest.approx((1 + 1 + 8 + 1 + 1) / 5)
    assert bench.steady_step(pts, [(2.5, 10.5)]) == pytest.approx(1.0)


def run(wall: float, failures: list[dict] | None = None, exact: bool | None = True) -> dict:
    return {"wall_s": wall, "step_s": 0.3, "failures": failures or [], "bit_identical": exact}


def test_the_targets_are_judged_on_the_runs_of_one_bench() -> None:
    warned = {"kind": "warned", "recomputed": 0, "lost_s": 2.0, "at_s": 30.0, "replica": 0}
    runs = {
        "undisturbed": run(100.0, exact=None),
        "checkpoint-restart": run(200.0),
        "torchft": run(160.0, exact=False),
        "ferry": run(140.0, [warned]),
    }
    got = {t["what"].split(" ")[1]: t["met"] for t in bench.targets(runs)}
    assert got == {"excess": True, "wall": True, "run": True, "recomputed": True}
    runs["ferry"] = run(170.0, [{**warned, "recomputed": 3}], exact=False)
    assert not any(t["met"] for t in bench.targets(runs))


def test_the_report_prints_every_run_and_every_target() -> None:
    hard = {"kind": "hard", "recomputed": 12, "lost_s": 20.0, "at_s": 30.0, "replica": 1}
    r = {
        "seed": 3,
        "mtbf_s": 25.0,
        "schedule": [{"at_s": 30.0, "kind": "hard", "replica": 1}],
        "runs": {"undisturbed": run(100.0, exact=None), "checkpoint-restart": run(150.0, [hard])},
        "targets": [{"what": "something", "met": False}],
    }
    text = bench.format_report(r)
    assert "30.0 s hard (replica 1)" in text
    assert "checkpoint-restart" in text and "1.50x" in text and "12.0" in text
    assert "NOT met  something" in text


def test_a_fixed_schedule_spreads_its_failures_evenly_and_refuses_what_is_not_kind_replica() -> None:
    got = bench.fixed_schedule("warned:0, hard:2", 90.0)
    assert got == [bench.Failure(30.0, "warned", 0), bench.Failure(60.0, "hard", 2)]
    for bad in ("soft:0", "hard:3", "hard", "warned:x"):
        with pytest.raises(bench.BenchError, match="is not KIND:REPLICA"):
            bench.fixed_schedule(bad, 90.0)
