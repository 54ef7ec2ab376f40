"""Edges of the command line and of an agent's start (issue 28, items 9 and 11): bad `ps --peer`
values exit 2, unreachable peers are named in words, a command that cannot run is refused before
it "runs", a SIGKILLed job says so, a newline never splits a `ps` row, `--metrics-listen` is
checked as such, a missing job-network bridge is named at start, and a test's helper ends
everything a command started, however the test ends."""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakes import SLEEP, launched_record

from agent.cli import main as cli
from agent.cli.render import jobs_table
from agent.errors import InvalidArgumentError, RefusedError
from agent.jobs import procs
from agent.jobs.launch import exit_words, find_command
from agent.jobs.network import JobNetwork, NetworkConfig
from agent.jobs.record import JobState
from agent.rpc import pb
from agent.service import metrics, serve
from agent.testing.localcluster import run_to_the_end

NET = {"bridge": "br9", "subnet": "10.77.0.0/16", "pool": "10.77.1.0/29"}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def http_port() -> Iterator[int]:
    """A plain HTTP/1 server on loopback: something that answers, but no agent."""

    class Quiet(http.server.BaseHTTPRequestHandler):
        def log_message(self, *_: object) -> None:  # not on the stderr the test reads
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


# -- ps --group --peer ----------------------------------------------------------------


@pytest.mark.parametrize("peer", ["garbage", "127.0.0.1:99999", "", "unix:"])
def test_a_bad_peer_is_a_usage_error_before_any_agent_is_asked(capsys, peer: str) -> None:
    # The agent is unreachable: a check after the first call would exit 1, not 2.
    code, out, err = run(
        capsys, "ps", "--agent", f"127.0.0.1:{closed_port()}", "--group", "g", "--peer", peer
    )
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith("ferry ps: --peer: invalid agent address"), err
    assert repr(peer) in err


def test_a_down_peer_is_named_in_words(capsys, agent) -> None:
    port = closed_port()
    code, out, err = run(capsys, "ps", "--agent", agent[1], "--group", "g", "--peer", f"127.0.0.1:{port}")
    assert code == 0 and out.splitlines() == [
        "no members of group 'g' on 1 agent(s)",
        "group g is not protected (`ferry protect g`)",
    ]
    assert err.count("\n") == 1, err
    assert f"agent 127.0.0.1:{port} is unreachable: connection refused" in err
    for raw in ("UNKNOWN", "failed to connect to all addresses", "ipv4:"):
        assert raw not in err


def test_a_peer_that_is_no_agent_is_named_as_such(capsys, agent, http_port: int) -> None:
    code, _, err = run(capsys, "ps", "--agent", agent[1], "--group", "g", "--peer", f"127.0.0.1:{http_port}")
    assert code == 0
    assert "something answers there, but not in gRPC" in err
    assert "HTTP/2" not in err and "SETTINGS" not in err


def test_an_agent_given_twice_lists_its_members_once(capsys, agent, sleeper) -> None:
    svc, address, _ = agent
    proc, o, e = sleeper()
    rec = launched_record("r0", proc, o, e)
    rec.group = "g"
    svc.registry.save(rec)
    code, out, _ = run(
        capsys,
        "ps",
        "--agent",
        address,
        "--group",
        "g",
        "--peer",
        address.replace("127.0.0.1", "localhost"),
        "--json",
    )
    assert code == 0
    assert [j["name"] for j in json.loads(out)] == ["r0"]


# -- ferry run: a command that cannot run, a cwd that is a file ----------------------


def test_run_of_a_missing_executable_is_refused_and_leaves_no_job(capsys, agent) -> None:
    code, out, err = run(capsys, "run", "--agent", agent[1], "--name", "x1", "--", "/no/such/exe")
    assert (code, out) == (2, ""), err
    assert err.count("\n") == 1 and "cannot run /no/such/exe: no such file" in err
    assert json.loads(run(capsys, "ps", "--agent", agent[1], "--json")[1]) == []


def test_run_with_a_file_as_cwd_says_so(capsys, agent, tmp_path: Path) -> None:
    f = tmp_path / "afile"
    f.write_text("")
    code, _, err = run(capsys, "run", "--agent", agent[1], "--name", "x2", "--cwd", str(f), "--", "true")
    assert code == 2 and f"working directory '{f}' is not a directory" in err
    assert "does not exist" not in err


def _write(path: Path, text: str, mode: int) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("missing", "no such file"),
        ("dir", "it is a directory"),
        ("plain", "it is not executable"),
        ("badinterp", "its interpreter /no/such/interp does not exist"),
    ],
)
def test_a_command_that_cannot_run_is_named_with_why(tmp_path: Path, name: str, words: str) -> None:
    (tmp_path / "dir").mkdir()
    _write(tmp_path / "plain", "echo hi\n", 0o644)
    _write(tmp_path / "badinterp", "#!/no/such/interp\n", 0o755)
    with pytest.raises(InvalidArgumentError, match=words):
        find_command(f"./{name}", str(tmp_path), {"PATH": "/usr/bin:/bin"}, "nodea")


def test_a_command_is_looked_up_as_execvp_does(tmp_path: Path) -> None:
    _write(tmp_path / "tool", "#!/bin/sh\n", 0o755)
    env = {"PATH": f"/no/where:{tmp_path}:/bin"}
    assert find_command("tool", "/", env, "nodea") == str(tmp_path / "tool")
    assert os.path.samefile(find_command("./tool", str(tmp_path), env, "nodea"), tmp_path / "tool")
    assert find_command("sh", "/", env, "nodea") == "/bin/sh"
    with pytest.raises(InvalidArgumentError, match="no such command on the job's PATH"):
        find_command("no-such-tool", "/", env, "nodea")


# -- ps: a killed job, a newline in a command ------------------------------------------


def _exited(code: int, note: str, command: list[str] | None = None) -> pb.Job:
    return pb.Job(
        name="j",
        state=pb.JOB_STATE_EXITED,
        exit_code=code,
        has_exit_code=True,
        note=note,
        command=command or ["sh"],
        kind=pb.JOB_KIND_LAUNCHED,
    )


@pytest.mark.parametrize(
    ("code", "state", "note"),
    [
        (137, "exited (137)", "killed by signal 9 (SIGKILL)"),
        (-9, "exited (137)", "killed by signal 9 (SIGKILL)"),  # a restored tree's own status
        (143, "exited (143)", "killed by signal 15 (SIGTERM)"),
        (1, "exited (1)", "exited with status 1"),
        (255, "exited (255)", "exited with status 255"),
    ],
)
def test_a_killed_job_says_by_which_signal(code: int, state: str, note: str) -> None:
    row = jobs_table([_exited(code, f"exited with status {code}")]).splitlines()[1]
    assert state in row and row.endswith(note)
    assert exit_words(code) == note


def test_a_note_of_its_own_is_kept() -> None:
    row = jobs_table([_exited(137, "its process ended while the agent was down")]).splitlines()[1]
    assert row.endswith("its process ended while the agent was down")


def test_a_newline_in_a_command_never_splits_a_row() -> None:
    table = jobs_table([_exited(0, "a\nnote", ["python3", "-c", "print(1)\nprint(2)", "\x1b[2J"])])
    assert len(table.splitlines()) == 2
    assert "print(1)\\nprint(2) \\x1b[2J" in table and "a\\nnote" in table


def test_a_real_job_killed_by_sigkill_with_a_newline_in_its_command(capsys, agent) -> None:
    svc, address, _ = agent
    code, _, err = run(
        capsys, "run", "--agent", address, "--name", "k", "--", "/bin/sh", "-c", "kill -9 $$", "x\ny"
    )
    assert code == 0, err
    try:
        deadline = time.monotonic() + 30
        while svc.registry.get("k").state is not JobState.EXITED:
            assert time.monotonic() < deadline, svc.registry.get("k")
            time.sleep(0.05)
        out = run(capsys, "ps", "--agent", address)[1]
        assert len(out.strip().splitlines()) == 2, out
        assert (
            "exited (137)" in out and "x\\ny" in out and out.rstrip().endswith("killed by signal 9 (SIGKILL)")
        )
    finally:
        rec = svc.registry.get("k")
        procs.signal_all(procs.tree_pids(rec.pid), signal.SIGKILL)


# -- forget during a move ---------------------------------------------------------------


def test_forget_of_a_moving_job_says_to_wait_or_stop(capsys, agent, sleeper) -> None:
    svc, address, _ = agent
    proc, o, e = sleeper()
    rec = launched_record("mv", proc, o, e)
    rec.state, rec.migration_id, rec.note = JobState.MIGRATING, "m1", "migration in progress"
    svc.registry.save(rec)
    code, _, err = run(capsys, "forget", "mv", "--agent", address)
    assert code == 1 and err.count("\n") == 1
    assert "wait until its move settles" in err and "`ferry stop mv`, which takes effect then" in err
    assert "`ferry stop mv` first" not in err


# -- --metrics-listen -------------------------------------------------------------------


@pytest.mark.parametrize(
    "address", ["127.0.0.1:9478:1", "::1:9478", "garbage", "127.0.0.1:99999", "[::1:0", ""]
)
def test_a_malformed_metrics_address_is_named_as_such(address: str) -> None:
    with pytest.raises(InvalidArgumentError) as e:
        metrics.check_listen(address, None)
    assert str(e.value).startswith(f"invalid --metrics-listen {address!r}: expected HOST:PORT")
    assert "agent address" not in str(e.value) and "loopback" not in str(e.value)


@pytest.mark.parametrize("address", ["127.0.0.1:9478:1", "::1:0", "garbage"])
def test_a_malformed_listen_address_is_named_as_such(address: str) -> None:
    # Not "--insecure serves plaintext only on loopback, not on 127.0.0.1:9478".
    with pytest.raises(InvalidArgumentError) as e:
        serve.check_listen(address, True, None)
    assert str(e.value).startswith(f"invalid --listen {address!r}: expected HOST:PORT")


def test_metrics_listen_takes_bracketed_ipv6() -> None:
    assert metrics.check_listen("[::1]:0", None) == ("::1", 0)
    assert metrics.check_listen("localhost:9478", None) == ("localhost", 9478)
    assert metrics.host_port("::1", 9478) == "[::1]:9478"
    assert metrics.host_port("127.0.0.1", 9478) == "127.0.0.1:9478"


def test_the_ipv6_metrics_address_is_bracketed(agent) -> None:
    if not socket.has_ipv6 or not os.path.exists("/proc/net/if_inet6"):
        pytest.skip("no IPv6 on this host")
    stop = agent[0].metrics.serve("[::1]:0", None)
    try:
        assert agent[0].metrics.address.startswith("[::1]:")
    finally:
        stop()


def test_serve_refuses_a_bad_metrics_address_before_taking_anything(tmp_path: Path, monkeypatch) -> None:
    def taken(*_: object) -> None:
        raise AssertionError("the agent went on to lock its state directory")

    monkeypatch.setattr(serve, "lock_state_dir", taken)
    with pytest.raises(InvalidArgumentError, match="invalid --metrics-listen"):
        serve.serve(
            "127.0.0.1:0",
            tmp_path / "state",
            "nodea",
            tmp_path / "staging",
            True,
            socket_path=tmp_path / "agent.sock",
            metrics_listen="127.0.0.1:9478:1",
        )
    assert not (tmp_path / "agent.sock").exists()


# -- the job network's bridge at start ---------------------------------------------------


def test_a_missing_bridge_is_refused_at_start(tmp_path: Path, monkeypatch) -> None:
    net = JobNetwork(NetworkConfig(**NET), "nodea")
    monkeypatch.setattr(net, "sysfs", str(tmp_path))
    with pytest.raises(RefusedError, match="bridge br9 does not exist") as e:
        net.check_bridge()
    assert e.value.node == "nodea" and "docs/networking.md" in str(e.value)
    (tmp_path / "br9").mkdir()
    with pytest.raises(RefusedError, match="bridge br9 is an interface, but not a bridge"):
        net.check_bridge()
    (tmp_path / "br9" / "bridge").mkdir()
    net.check_bridge()


def test_serve_refuses_a_config_whose_bridge_is_missing(tmp_path: Path, monkeypatch) -> None:
    from agent.agent_config import AgentConfig

    def taken(*_: object) -> None:
        raise AssertionError("the agent went on to lock its state directory")

    monkeypatch.setattr(serve, "lock_state_dir", taken)
    config = AgentConfig(network=NetworkConfig(**{**NET, "bridge": "fnobr9"}))
    with pytest.raises(RefusedError, match="bridge fnobr9 does not exist"):
        serve.serve("127.0.0.1:0", tmp_path / "state", "nodea", tmp_path / "staging", True, config=config)


# -- a test's commands end with it -------------------------------------------------------

#: Leaves processes every way a walkthrough's agents can be left: a background child, a child in
#: a session of its own (a job), orphans of the shell in the session and out of it, a process
#: holding an unreaped child (an agent and its `[criu] <defunct>`); each writes its PID to $1.
FAMILY = f"""
{SLEEP} 300 & echo $! >> "$1"
setsid {SLEEP} 300 & echo $! >> "$1"
( {SLEEP} 300 & echo $! >> "$1" )
( setsid {SLEEP} 300 & echo $! >> "$1" )
python3 -c 'import os, sys, time
child = os.fork()
if child == 0: os._exit(0)
open(sys.argv[1], "a").write(f"{{os.getpid()}}\\n{{child}}\\n"); time.sleep(300)' "$1" &
while [ "$(wc -l < "$1")" -lt 6 ]; do sleep 0.05; done
"""


def _pids(path: Path) -> list[int]:
    return [int(line) for line in path.read_text().split()]


def _assert_all_gone(pids: list[int]) -> None:
    """Not running, nor left a zombie: reaped."""
    assert len(pids) == 6
    left = [p for p in pids if os.path.exists(f"/proc/{p}")]
    assert left == [], f"left behind: {left}"


def test_a_command_that_times_out_leaves_nothing_behind(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    pids.write_text("")
    with pytest.raises(subprocess.TimeoutExpired) as e:
        run_to_the_end(["bash", "-c", FAMILY + f"echo started; exec {SLEEP} 300", "family", str(pids)], 8)
    assert "started" in e.value.stdout
    _assert_all_gone(_pids(pids))


def test_a_command_whose_shell_exits_leaves_nothing_behind(tmp_path: Path) -> None:
    # The agents in the background outlive a failing walkthrough's shell (`set -e`), and would hold
    # its output open: they end as the command does.
    pids = tmp_path / "pids"
    pids.write_text("")
    p = run_to_the_end(["bash", "-c", FAMILY + "echo said; exit 3", "family", str(pids)], 30)
    assert (p.returncode, p.stdout) == (3, "said\n")
    _assert_all_gone(_pids(pids))


def test_a_test_timeout_during_the_command_leaves_nothing_behind(tmp_path: Path) -> None:
    """pytest-timeout's signal method raises inside the test, wherever it waits."""

    class Timeout(Exception):
        pass

    def expire(*_: object) -> None:
        raise Timeout

    pids = tmp_path / "pids"
    pids.write_text("")
    old = signal.signal(signal.SIGALRM, expire)
    try:
        signal.alarm(5)
        with pytest.raises(Timeout):
            run_to_the_end(["bash", "-c", FAMILY + f"exec {SLEEP} 300", "family", str(pids)], 600)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    _assert_all_gone(_pids(pids))
