"""What a new user hit first on the command line: every argument explained, bad input named and
exit status 2 wherever it is caught, no gRPC log lines, JSON and watches that say something."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent import certs
from agent.cli import main as cli


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _arguments(parser: argparse.ArgumentParser, path: str) -> Iterator[tuple[str, argparse.Action]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _arguments(sub, f"{path} {name}")
        elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield path, action


def test_every_argument_of_every_command_has_a_description() -> None:
    missing = [
        f"{path} {'/'.join(a.option_strings) or a.dest}"
        for path, a in _arguments(cli.build_parser(), "ferry")
        if not (a.help and a.help.strip())
    ]
    assert missing == []


def test_a_malformed_agent_address_is_named_before_any_tls_file(capsys) -> None:
    code, out, err = run(capsys, "ps", "--agent", "garbage")
    assert (code, out) == (2, "")
    assert err == "ferry: invalid agent address 'garbage': expected HOST:PORT\n"


def test_bad_input_the_agent_catches_exits_2(capsys, agent) -> None:
    code, _, err = run(capsys, "stop", "anything", "--timeout", "99999", "--agent", agent[1])
    assert code == 2 and "invalid stop timeout 99999" in err and err.count("\n") == 1


def test_watching_a_node_without_gpus_says_so_and_ends(capsys, agent) -> None:
    code, _, err = run(capsys, "health", "--watch", "--agent", agent[1])
    assert code == 1
    assert "nothing to watch" in err and "ferry events -f" in err


def test_events_json_is_a_list_even_when_empty(capsys, agent) -> None:
    code, out, _ = run(capsys, "events", "--json", "--agent", agent[1])
    assert code == 0 and json.loads(out) == []


@pytest.fixture
def not_tls() -> Iterator[int]:
    """A TCP port that answers a TLS handshake with HTTP: gRPC's core logs the failed handshake."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    t.join()
    srv.close()


def test_no_grpc_log_lines_reach_the_terminal(tmp_path: Path, not_tls: int) -> None:
    certs.create_ca(tmp_path)
    certs.issue(tmp_path, "alice", certs.Role.CLIENT, [])
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    argv = [sys.executable, "-m", "agent.cli.main", "ps", "--agent", f"127.0.0.1:{not_tls}"]
    p = subprocess.run(
        [*argv, "--tls-dir", str(tmp_path)], capture_output=True, text=True, env=env, timeout=60
    )
    assert p.returncode == 1
    assert p.stderr.startswith("ferry: ") and p.stderr.count("\n") == 1, p.stderr


def test_forget_drops_an_ended_record_and_refuses_a_running_job(capsys, agent, sleeper) -> None:
    from fakes import launched_record

    from agent.jobs.record import JobState

    svc, address, _ = agent
    proc, out, err = sleeper()
    svc.registry.save(launched_record("live", proc, out, err))
    done = launched_record("done", proc, out, err)
    done.state = JobState.EXITED
    svc.registry.save(done)
    code, _, err_text = run(capsys, "forget", "live", "--agent", address)
    assert code == 1 and "only an ended job's record can be forgotten" in err_text
    assert "`ferry stop live` first" in err_text
    code, out_text, _ = run(capsys, "forget", "done", "--agent", address)
    assert code == 0 and "job done: its record and logs are gone from nodea" in out_text
    code, out_text, _ = run(capsys, "ps", "--json", "--agent", address)
    assert [j["name"] for j in json.loads(out_text)] == ["live"]
    assert not svc.registry.job_dir("done").exists()
    code, _, err_text = run(capsys, "forget", "done", "--agent", address)
    assert code == 1 and "no job named 'done'" in err_text


def test_a_second_agent_on_a_served_address_is_refused_in_one_line(agent, tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "agent.cli.main", "agent", "--listen", agent[1], "--insecure"]
    argv += ["--state-dir", str(tmp_path / "b"), "--node-name", "b", "--socket", "none"]
    argv += ["--staging-dir", str(tmp_path / "b-staging")]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert p.returncode == 2
    assert p.stderr == (
        f"ferry: cannot listen on {agent[1]}: Address already in use; another process (another ferry "
        "agent?) may serve it: stop it, or pick another --listen\n"
    )
