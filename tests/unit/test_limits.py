"""How long a distributed job's member may be frozen (agent.migration.limits), and the refusal."""

from __future__ import annotations

from pathlib import Path

import pytest
from fakes import launched_record, node_parts

from agent.errors import RefusedError
from agent.jobs.record import JobKind, JobRecord, JobState
from agent.migration import limits
from agent.migration.limits import RateLog, pause_limits, refuse_long_pause, tcp_give_up_s


def member(**kw: object) -> JobRecord:
    rec = JobRecord("r1", JobKind.LAUNCHED, JobState.RUNNING, 1, ["python", "train.py"], "/")
    for k, v in kw.items():
        setattr(rec, k, v)
    return rec


def test_tcp_gives_up_after_the_known_924_6_seconds_with_the_default_retries() -> None:
    assert tcp_give_up_s(15) == pytest.approx(924.6)
    assert tcp_give_up_s(8) == pytest.approx(102.2)


def test_only_members_of_distributed_jobs_have_limits() -> None:
    assert pause_limits(member()) == []
    assert pause_limits(member(env=["WORLD_SIZE=1"])) == []
    for rec in (member(group="llm"), member(env=["RANK=1", "WORLD_SIZE=3"])):
        names = [lim.what for lim in pause_limits(rec, tcp_retries2=15)]
        assert names == [
            "TCP retransmission (tcp_retries2 = 15)",
            "gloo's collective timeout (torch.distributed default)",
        ]
    assert (
        pause_limits(member(group="llm", max_pause_s=60), tcp_retries2=15)[0].what == "the job's --max-pause"
    )


def test_the_slowest_recent_rate_judges_and_a_fresh_agent_assumes_a_low_one(tmp_path: Path) -> None:
    rates = RateLog(tmp_path)
    assert rates.slowest() == limits.DEFAULT_RATE_BPS
    rates.record(400_000_000, 2.0)
    rates.record(100_000_000, 1.0)
    assert rates.slowest() == 100e6
    for _ in range(limits.KEEP_RATES):
        rates.record(1_000_000_000, 1.0)
    assert rates.slowest() == 1e9  # only recent moves count
    (tmp_path / "freeze-rates.json").write_text("{garbage")
    assert rates.slowest() == limits.DEFAULT_RATE_BPS


def test_a_member_whose_pause_would_outlast_its_peers_is_refused_with_the_figure_and_the_limit(
    tmp_path: Path,
) -> None:
    rates = RateLog(tmp_path)
    rates.record(100_000_000, 1.0)  # 100 MB/s
    rec = member(group="llm", max_pause_s=10)
    refuse_long_pause(rec, 500_000_000, rates, "nodea")  # 3 + 5 s: fits
    with pytest.raises(RefusedError) as err:
        refuse_long_pause(rec, 2_000_000_000, rates, "nodea")  # 3 + 20 s
    said = str(err.value)
    assert "frozen for about 23 s" in said and "100 MB/s" in said and "the job's --max-pause: 10 s" in said
    assert err.value.step == "prepare" and "nothing was frozen" in err.value.hint
    refuse_long_pause(member(), 10**12, rates, "nodea")  # not a member: no limit


def test_a_migration_of_a_member_is_refused_before_anything_freezes(
    tmp_path, registry, fake_criu, sleeper
) -> None:
    from fakes import FakePeer

    from agent.migration.model import MigrationSpec
    from agent.migration.source import SourceMigration

    proc, out, err = sleeper()
    rec = launched_record("r1", proc, out, err)
    rec.group, rec.max_pause_s = "llm", 0.5  # less than the fixed cost alone
    registry.save(rec)
    peer = FakePeer(tmp_path / "tstaging")
    cuda_jobs, journal = node_parts(registry, "nodea")
    m = SourceMigration(
        MigrationSpec("r1", peer.address, "m1"),
        registry,
        fake_criu,
        peer,
        tmp_path / "st",
        "nodea",
        "me",
        cuda_jobs=cuda_jobs,
        journal=journal,
    )
    with pytest.raises(RefusedError, match=r"longer than the job's --max-pause: 0\.5 s"):
        m.run()
    assert fake_criu.dumps == [] and "prepare" not in peer.calls
    assert registry.get("r1").state is JobState.RUNNING


def test_a_torchrun_agent_is_bounded_by_its_rendezvous_keep_alive() -> None:
    rec = member(command=["torchrun", "--nnodes=2:4", "--nproc_per_node=1", "t.py"])
    tightest = pause_limits(rec, tcp_retries2=15)[0]
    assert tightest.what.startswith("torchrun's c10d keep-alive") and tightest.seconds == 15.0
    raised = member(
        command=[
            "torchrun",
            "--nnodes",
            "3",
            "--rdzv-conf",
            "keep_alive_interval=20,keep_alive_max_attempt=6,read_timeout=300",
            "t.py",
        ]
    )
    assert [lim.seconds for lim in pause_limits(raised, tcp_retries2=15)][:2] == [120.0, 300.0]
    assert pause_limits(member(command=["torchrun", "--standalone", "--nproc_per_node=2", "t.py"])) == []
