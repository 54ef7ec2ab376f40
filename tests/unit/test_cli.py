"""The `ferry` command line (agent.cli.main.main) and its renderers (agent.cli.render)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from fakes import launched_record

from agent.cli import main as cli
from agent.cli.render import ProgressLine, human_bytes, job_dict, jobs_table, result_dict, summary, table
from agent.image import JobSpec, build_manifest
from agent.rpc import pb

ALL_COMMANDS = sorted(cli.COMMANDS)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    assert err.endswith("\n")
    assert err.count("\n") == 1, err
    assert "Traceback" not in err
    return err.strip()


# -- usage errors: exit 2, one line ----------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["migrate", "job"], "--to"),
        (["migrate", "--to", "127.0.0.1:7071"], "name"),
        (["migrate", "j", "--to", "127.0.0.1:7071", "--pre-copy", "--lazy"], "not allowed with argument"),
        (["run", "--name", "x"], "no command given"),
        (["run", "--name", "x", "--"], "no command given"),
        (["run", "--", "true"], "--name"),
        (["teleport", "job"], "invalid choice"),
        ([], "required"),
        (["stop"], "name"),
        (["adopt", "--name", "x", "--pid", "twelve"], "invalid int value"),
        (["checkpoint", "job"], "--out"),
        (["ps", "--bogus"], "unrecognized arguments"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(capsys, argv: list[str], words: str) -> None:
    code, out, err = run(capsys, *argv)
    assert code == cli.EXIT_USAGE == 2
    line = one_line(err)
    assert line.startswith("ferry")
    assert words in line
    assert "--help" in line or "usage: " in line  # says what to do next
    assert out == ""


def test_bad_target_address_is_one_line_without_traceback(capsys) -> None:
    code, out, err = run(capsys, "migrate", "job", "--to", "nonsense", "--agent", "127.0.0.1:1")
    assert code != 0
    assert one_line(err) == "ferry migrate: --to: invalid agent address 'nonsense': expected HOST:PORT"
    assert out == ""


def test_bad_target_address_is_a_usage_error(capsys) -> None:
    code, _, _ = run(capsys, "migrate", "job", "--to", "nonsense", "--agent", "127.0.0.1:1")
    assert code == cli.EXIT_USAGE


@pytest.mark.parametrize("cmd", ALL_COMMANDS)
def test_help_for_each_subcommand_exits_0(capsys, cmd: str) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main([cmd, "--help"])
    out, err = capsys.readouterr()
    assert exc.value.code == 0
    assert out.startswith(f"usage: ferry {cmd}")
    assert err == ""


def test_top_level_help_lists_every_command(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    out, _ = capsys.readouterr()
    assert exc.value.code == 0
    for cmd in ALL_COMMANDS:
        assert cmd in out


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("ferry ")


# -- agent errors: exit 1, one line ----------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["ps"],
        ["stop", "job"],
        ["logs", "job"],
        ["migrate", "job", "--to", "127.0.0.1:7071"],
        ["run", "--name", "x", "--", "true"],
        ["restore", "/tmp/ferry-unit-no-image"],
    ],
)
def test_unreachable_agent_is_one_line_naming_the_address(capsys, argv: list[str]) -> None:
    # --agent right after the command: `run` takes everything after `--` as the job's command.
    code, out, err = run(capsys, argv[0], "--agent", "127.0.0.1:1", "--insecure", *argv[1:])
    assert code == cli.EXIT_ERROR == 1
    line = one_line(err)
    assert line.startswith("ferry: ")
    assert "agent 127.0.0.1:1 is unreachable" in line
    assert out == ""


def test_non_loopback_agent_is_refused(capsys) -> None:
    code, out, err = run(capsys, "ps", "--agent", "10.1.2.3:7070")
    assert code == 2  # a bad --agent for --insecure
    line = one_line(err)
    assert "10.1.2.3:7070 is not a loopback address" in line
    assert out == ""


def test_agent_address_from_the_environment(capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRY_AGENT", "127.0.0.1:2")
    code, _, err = run(capsys, "ps")
    assert code == 1
    assert "127.0.0.1:2" in one_line(err)


def test_agent_refuses_plaintext_off_loopback(capsys, tmp_path: Path) -> None:
    argv = ["agent", "--listen", "0.0.0.0:7070", "--state-dir", str(tmp_path / "s"), "--insecure"]
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert "only on loopback" in one_line(err)


def test_agent_refuses_to_serve_without_tls_or_insecure(capsys, tmp_path: Path) -> None:
    code, _, err = run(capsys, "agent", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "s"))
    assert code == 1
    assert "--insecure" in one_line(err)


# -- against a live in-process agent ----------------------------------------------------


def test_ps_against_an_agent(capsys, make_agent, sleeper) -> None:
    svc, addr, _ = make_agent("nodea")
    code, out, _ = run(capsys, "ps", "--agent", addr)
    assert (code, out.strip()) == (0, "no jobs")

    proc, o, e = sleeper()
    svc.registry.save(launched_record("train", proc, o, e))
    code, out, _ = run(capsys, "ps", "--agent", addr)
    assert code == 0
    header, row = out.strip().splitlines()
    assert header.split() == ["NAME", "STATE", "PID", "KIND", "ADDRESS", "COMMAND", "NOTE"]
    assert row.split()[:5] == ["train", "running", str(proc.pid), "launched", "-"]  # no job network

    code, out, _ = run(capsys, "ps", "--agent", addr, "--json")
    assert code == 0
    [job] = json.loads(out)
    assert (job["name"], job["state"], job["pid"], job["node"]) == ("train", "running", proc.pid, "nodea")


def test_stop_unknown_job_against_an_agent(capsys, make_agent) -> None:
    _, addr, _ = make_agent("nodea")
    code, out, err = run(capsys, "stop", "nope", "--agent", addr)
    assert code == 1
    line = one_line(err)
    assert "no job named 'nope'" in line and "nodea" in line
    assert "ferry ps" in line  # what to do next
    assert out == ""


def test_migrate_unknown_job_against_an_agent(capsys, make_agent) -> None:
    _, addr, _ = make_agent("nodea")
    code, _, err = run(capsys, "migrate", "nope", "--to", "127.0.0.1:1", "--agent", addr)
    assert code == 1
    assert "no job named 'nope'" in one_line(err)


# -- inspect (no agent) ---------------------------------------------------------------


@pytest.fixture
def saved_image(tmp_path: Path) -> Path:
    d = tmp_path / "img"
    d.mkdir()
    (d / "pages-1.img").write_bytes(b"p" * 4096)
    (d / "core-1.img").write_bytes(b"c" * 10)
    spec = JobSpec("train", "launched", ["python", "train.py"], "/", [], "/o", "/e", 1)
    build_manifest(d, spec, "nodea", criu_stats={"frozen_time": 5}, timings={"dump": 0.25})
    return d


def test_inspect_text(capsys, saved_image: Path) -> None:
    code, out, err = run(capsys, "inspect", str(saved_image))
    assert code == 0 and err == ""
    assert "digests verified" in out
    assert "job train (launched) from node nodea: python train.py" in out
    assert "host memory 4.0 KiB" in out
    assert "pages-1.img" in out and "core-1.img" in out
    assert "criu stats: frozen_time=5" in out
    assert "timings: dump 0.250 s" in out


def test_inspect_json(capsys, saved_image: Path) -> None:
    code, out, _ = run(capsys, "inspect", str(saved_image), "--json")
    assert code == 0
    d = json.loads(out)
    assert d["verified"] is True
    assert d["host_bytes"] == 4096
    assert {f["name"] for f in d["files"]} == {"pages-1.img", "core-1.img"}


def test_inspect_of_a_tampered_image_fails_naming_the_file(capsys, saved_image: Path) -> None:
    (saved_image / "pages-1.img").write_bytes(b"q" * 4096)
    code, out, err = run(capsys, "inspect", str(saved_image))
    assert code == 1
    assert "pages-1.img: digest does not match" in one_line(err)
    code, out, _ = run(capsys, "inspect", str(saved_image), "--no-verify")
    assert code == 0 and "digests NOT checked" in out


def test_inspect_of_a_directory_that_is_no_image(capsys, tmp_path: Path) -> None:
    code, _, err = run(capsys, "inspect", str(tmp_path))
    assert code == 1
    assert "is not a ferry image" in one_line(err)


# -- rendering ------------------------------------------------------------------------


def _result(**kw: object) -> pb.MigrationResult:
    fields: dict[str, object] = {
        "migration_id": "abc123",
        "job": "train",
        "source_node": "nodea",
        "target_node": "nodeb",
        "target": "127.0.0.1:7071",
        "phases": [pb.PhaseTiming(phase="dump", seconds=0.5), pb.PhaseTiming(phase="transfer", seconds=1.25)],
        "host_bytes": 3 << 30,
        "image_bytes": (3 << 30) + (5 << 20),
        "gpu_bytes": 0,
        "frozen_s": 2.0,
        "downtime_s": 2.5,
        "total_s": 3.14159,
        "transfer_gbps": 2.75,
    }
    fields.update(kw)
    return pb.MigrationResult(**fields)  # type: ignore[arg-type]


def test_summary_of_a_migration() -> None:
    text = summary(_result())
    lines = text.splitlines()
    assert lines[0] == "job train moved nodea -> nodeb (127.0.0.1:7071) in 3.14 s"
    assert lines[1].split() == ["PHASE", "TIME"]
    assert lines[2].split() == ["dump", "0.500", "s"]
    assert lines[3].split() == ["transfer", "1.250", "s"]
    assert "image: 3.0 GiB (3.0 GiB host memory, 0 B GPU memory)" in text
    assert "transfer rate: 2.75 GB/s" in text
    assert "frozen: 2.000 s" in text
    assert "downtime: 2.500 s" in text


def test_summary_names_the_method_that_ran() -> None:
    assert "method: post-copy" in summary(_result(method="post-copy"))
    assert "method" not in summary(_result())  # an older agent says nothing


@pytest.mark.parametrize(
    ("flags", "method", "staged", "lazy"),
    [
        ([], pb.MIGRATION_METHOD_DEFAULT, False, False),  # an older agent then does its pre-copy
        (["--post-copy"], pb.MIGRATION_METHOD_POST_COPY, False, True),
        (["--lazy"], pb.MIGRATION_METHOD_POST_COPY, False, True),
        (["--pre-copy"], pb.MIGRATION_METHOD_PRE_COPY, False, False),
        (["--staged"], pb.MIGRATION_METHOD_STAGED, True, False),
    ],
)
def test_migrate_asks_for_the_method_and_says_it_to_older_agents_too(
    capsys, monkeypatch: pytest.MonkeyPatch, flags: list[str], method: int, staged: bool, lazy: bool
) -> None:
    from agent.cli import moves

    sent: list[pb.MigrateRequest] = []
    monkeypatch.setattr(moves, "stream", lambda args, rpc, req, timeout: sent.append(req) or iter(()))
    code, _, err = run(capsys, "migrate", "j", "--to", "127.0.0.1:7071", *flags)
    assert code != 0 and "without a result" in err  # this stream sent nothing back
    (req,) = sent
    assert (req.method, req.staged, req.lazy) == (method, staged, lazy)


def test_summary_without_a_downtime_measurement() -> None:
    assert "downtime: not measured" in summary(_result(downtime_s=-1.0))


def test_summary_of_a_group_members_move_says_the_groups_pause() -> None:
    by = "frozen 0.60 s, then the peers reached the job again 0.21 s after its release (3 of 4 connections)"
    text = summary(_result(group_pause_s=0.81, group_pause_by=by))
    assert f"group's pause: 0.810 s ({by})" in text.splitlines()
    missing = summary(_result(group_pause_s=-1.0, group_pause_by="not measured: the target did not give it"))
    assert "group's pause: not measured (the target did not give it)" in missing
    assert "group's pause" not in summary(_result())  # no member, or an older agent


def test_json_carries_the_groups_pause_of_a_member_only() -> None:
    d = result_dict(_result(group_pause_s=0.81234, group_pause_by="frozen 0.60 s, then ..."))
    assert (d["group_pause_s"], d["group_pause_by"]) == (0.8123, "frozen 0.60 s, then ...")
    missing = result_dict(_result(group_pause_s=-1.0, group_pause_by="not measured: why"))
    assert (missing["group_pause_s"], missing["group_pause_by"]) == (None, "not measured: why")
    assert (result_dict(_result())["group_pause_s"], result_dict(_result())["group_pause_by"]) == (None, "")


def test_summary_of_a_checkpoint() -> None:
    text = summary(_result(target_node="", target="", image_dir="/ckpt/a", transfer_gbps=0.0))
    assert text.splitlines()[0] == "job train saved to /ckpt/a in 3.14 s"
    assert "frozen" not in text and "downtime" not in text and "transfer rate" not in text


def test_result_dict() -> None:
    d = result_dict(_result())
    assert d["migration_id"] == "abc123"
    assert (d["job"], d["source_node"], d["target_node"], d["target"]) == (
        "train",
        "nodea",
        "nodeb",
        "127.0.0.1:7071",
    )
    assert d["phases_s"] == {"dump": 0.5, "transfer": 1.25}
    assert d["total_s"] == 3.1416
    assert d["downtime_s"] == 2.5
    assert d["host_bytes"] == 3 << 30
    assert d["transfer_gbps"] == 2.75
    json.dumps(d)  # plain data
    assert result_dict(_result(downtime_s=-1.0))["downtime_s"] is None


def _job(**kw: object) -> pb.Job:
    fields: dict[str, object] = {
        "name": "train",
        "state": pb.JOB_STATE_RUNNING,
        "kind": pb.JOB_KIND_LAUNCHED,
        "pid": 4242,
        "command": ["python", "train.py"],
        "node_name": "nodea",
    }
    fields.update(kw)
    return pb.Job(**fields)  # type: ignore[arg-type]


def test_jobs_table() -> None:
    jobs = [
        _job(address="10.77.1.5"),
        _job(name="old", state=pb.JOB_STATE_MOVED, moved_to="127.0.0.1:7071", moved_to_node="nodeb", pid=7),
        _job(name="done", state=pb.JOB_STATE_EXITED, exit_code=3, has_exit_code=True, pid=0),
        _job(name="adopted", kind=pb.JOB_KIND_ADOPTED, note="migration refused: no GPU"),
    ]
    lines = jobs_table(jobs).splitlines()
    assert lines[0].split() == ["NAME", "STATE", "PID", "KIND", "ADDRESS", "COMMAND", "NOTE"]
    assert lines[1].split() == ["train", "running", "4242", "launched", "10.77.1.5", "python", "train.py"]
    assert lines[2].split()[:4] == ["old", "moved", "7", "launched"]
    assert lines[2].endswith("-> nodeb (127.0.0.1:7071)")
    assert lines[3].split()[:4] == ["done", "exited", "(3)", "-"]
    assert lines[4].split()[3] == "adopted"
    assert lines[4].endswith("migration refused: no GPU")
    assert jobs_table([]) == "no jobs"


def test_jobs_table_columns_line_up() -> None:
    lines = jobs_table([_job(name="a"), _job(name="a-much-longer-name")]).splitlines()
    col = lines[0].index("STATE")
    assert all(line[col - 2 : col] == "  " and line[col] != " " for line in lines)


def test_job_dict() -> None:
    d = job_dict(_job(state=pb.JOB_STATE_MIGRATING, migration_id="m1"))
    assert (d["name"], d["state"], d["kind"], d["pid"], d["node"]) == (
        "train",
        "migrating",
        "launched",
        4242,
        "nodea",
    )
    assert d["exit_code"] is None
    assert d["migration_id"] == "m1"
    assert job_dict(_job(exit_code=0, has_exit_code=True))["exit_code"] == 0


def test_jobs_table_with_an_unspecified_kind() -> None:
    assert "train" in jobs_table([_job(kind=pb.JOB_KIND_UNSPECIFIED)])


def test_human_bytes_and_table() -> None:
    assert human_bytes(0) == "0 B"
    assert human_bytes(1023) == "1023 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(5 << 40) == "5.0 TiB"
    assert table(["A", "BB"], []) == "A  BB"
    assert table(["A", "B"], [["xyz", "1"]]) == "A    B\nxyz  1"


def test_progress_line_prints_one_line_per_phase_off_a_terminal() -> None:
    buf = io.StringIO()
    line = ProgressLine(buf)
    line.update(pb.ProgressEvent(phase=pb.PHASE_PREPARE, message="asking", elapsed_s=0.1))
    line.update(pb.ProgressEvent(phase=pb.PHASE_TRANSFER, message="streaming", bytes_total=100, elapsed_s=1))
    line.update(
        pb.ProgressEvent(phase=pb.PHASE_TRANSFER, message="streaming", bytes_done=50, bytes_total=100)
    )
    line.close()
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2
    assert "prepare" in lines[0] and "asking" in lines[0]
    assert "transfer" in lines[1] and "0 B / 100 B (0%" in lines[1]


def test_jobs_table_shows_group_rank_and_node_when_a_job_has_a_group() -> None:
    jobs = [
        _job(name="r1", group="llm", rank=1, has_rank=True, node_name="nodeb"),
        _job(name="r0", group="llm", rank=0, has_rank=True, node_name="nodea"),
        _job(name="solo", node_name="nodea"),
    ]
    lines = jobs_table(jobs).splitlines()
    assert lines[0].split()[:7] == ["NAME", "GROUP", "RANK", "NODE", "STATE", "PID", "KIND"]
    assert lines[1].split()[:4] == ["r1", "llm", "1", "nodeb"]
    assert lines[3].split()[:4] == ["solo", "-", "-", "nodea"]
    assert job_dict(jobs[0])["group"] == "llm" and job_dict(jobs[0])["rank"] == 1
    assert job_dict(jobs[2])["rank"] is None


def test_ps_group_lists_the_members_across_agents_and_names_one_that_is_silent(
    capsys, make_agent, sleeper
) -> None:
    """`ferry run --group` labels; `ferry ps --group` asks this agent and every --peer, rank order."""
    a, addr_a, _ = make_agent("nodea")
    b, addr_b, _ = make_agent("nodeb")
    for svc, name, rank in [(a, "r0", 0), (b, "r1", 1)]:
        proc, o, e = sleeper()
        rec = launched_record(name, proc, o, e)
        rec.group, rec.env = "llm", [f"RANK={rank}", "WORLD_SIZE=2"]
        svc.registry.save(rec)
    proc, o, e = sleeper()
    a.registry.save(launched_record("other", proc, o, e))
    code, out, err = run(
        capsys, "ps", "--agent", addr_a, "--group", "llm", "--peer", addr_b, "--peer", "127.0.0.1:1"
    )
    assert code == 0
    *table, protection = out.strip().splitlines()
    rows = [ln.split()[:4] for ln in table[1:]]
    assert rows == [["r0", "llm", "0", "nodea"], ["r1", "llm", "1", "nodeb"]]
    assert protection == "group llm is not protected (`ferry protect llm`)"
    assert "127.0.0.1:1" in err and "unreachable" in err
    code, out, _ = run(capsys, "ps", "--agent", addr_a, "--group", "llm", "--peer", addr_b, "--json")
    assert [(j["name"], j["rank"], j["node"]) for j in json.loads(out)] == [
        ("r0", 0, "nodea"),
        ("r1", 1, "nodeb"),
    ]
    assert run(capsys, "ps", "--agent", addr_a, "--peer", addr_b)[0] == 2  # --peer without --group


def test_a_members_rank_comes_from_its_environment_or_its_torchrun_command() -> None:
    from agent.jobs.record import job_rank

    assert job_rank(["MASTER_ADDR=10.0.0.1", "RANK=2"], ["python", "train.py"]) == 2
    assert job_rank([], ["python", "-m", "torch.distributed.run", "--node-rank", "1", "t.py"]) == 1
    assert job_rank([], ["torchrun", "--node_rank=3", "--nnodes=4", "t.py"]) == 3
    assert job_rank(["RANK=x"], ["python", "t.py"]) is None
