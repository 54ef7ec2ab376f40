"""Edges of `ferry agent`'s start and of the job commands, against real agents (issue 28, items 9
and 11): an agent that cannot start leaves nothing behind and says why, its IPv6 metrics URL is one
a scraper can use, and `ferry run`/`ps` against it say what happened in words."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from agent.testing.poll import wait_for


def agent_argv(tmp_path: Path, *more: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "agent.cli.main",
        "agent",
        "--insecure",
        "--listen",
        "127.0.0.1:0",
        "--state-dir",
        str(tmp_path / "state"),
        "--staging-dir",
        str(tmp_path / "staging"),
        "--socket",
        str(tmp_path / "run" / "agent.sock"),
        "--node-name",
        "edge",
        *more,
    ]


def start_fails(tmp_path: Path, *more: str) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(agent_argv(tmp_path, *more), capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode != 0, f"the agent started:\n{p.stdout}\n{p.stderr}"
    assert p.stderr.startswith("ferry: ") and p.stderr.count("\n") == 1, p.stderr
    assert not (tmp_path / "run" / "agent.sock").exists(), "the agent's socket was left behind"
    return p


def test_a_taken_metrics_port_leaves_no_socket_behind(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        p = start_fails(tmp_path, "--metrics-listen", f"127.0.0.1:{port}")
    assert p.returncode == 2 and f"cannot serve metrics on 127.0.0.1:{port}" in p.stderr
    # Malformed: named as the metrics address it is, before anything is taken.
    p = start_fails(tmp_path, "--metrics-listen", "127.0.0.1:9478:1")
    assert p.returncode == 2 and "invalid --metrics-listen '127.0.0.1:9478:1': expected HOST:PORT" in p.stderr


def test_an_agent_whose_bridge_is_missing_refuses_to_start(tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text('[network]\nbridge = "fnobr9"\nsubnet = "10.77.0.0/16"\npool = "10.77.1.0/24"\n')
    p = start_fails(tmp_path, "--config", str(config))
    assert p.returncode == 1
    assert "start on edge: the job network's bridge fnobr9 does not exist" in p.stderr
    assert "docs/networking.md" in p.stderr


def test_the_ipv6_metrics_url_is_bracketed_and_serves(tmp_path: Path) -> None:
    if not os.path.exists("/proc/net/if_inet6"):
        pytest.skip("no IPv6 on this host")
    log = tmp_path / "agent.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            agent_argv(tmp_path, "--metrics-listen", "[::1]:0"),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for("the agent to listen", lambda: "node edge listening on" in log.read_text(), 60)
        m = re.search(r"ferry agent: metrics on (\S+)/metrics", log.read_text())
        assert m and re.fullmatch(r"\[::1\]:\d+", m[1]), log.read_text()
        body = urllib.request.urlopen(f"http://{m[1]}/metrics", timeout=10).read().decode()
        assert "ferry_build_info" in body
    finally:
        proc.terminate()
        proc.wait(30)
    assert not (tmp_path / "run" / "agent.sock").exists()


def test_run_ps_and_peers_against_a_real_agent(agents) -> None:
    a = agents("node-a")
    p = a.cli("run", "--name", "x1", "--", "/no/such/exe", check=False)
    assert p.returncode == 2 and "cannot run /no/such/exe: no such file" in p.stderr
    assert "running" not in p.stdout

    a.cli("run", "--name", "k", "--", "/bin/sh", "-c", "kill -9 $$", "one\ntwo")
    wait_for("k to end", lambda: json.loads(a.cli("ps", "--json").stdout)[0]["state"] == "exited", 30)
    rows = a.cli("ps").stdout.strip().splitlines()
    assert len(rows) == 2, rows
    assert "one\\ntwo" in rows[1] and rows[1].endswith("killed by signal 9 (SIGKILL)")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        down = s.getsockname()[1]
    p = a.cli("ps", "--group", "g", "--peer", f"127.0.0.1:{down}", "--insecure", check=False)
    assert p.returncode == 0 and "no members of group 'g' on 1 agent(s)" in p.stdout
    assert f"agent 127.0.0.1:{down} is unreachable: connection refused" in p.stderr
    assert "UNKNOWN" not in p.stderr
    for bad in ("garbage", "127.0.0.1:99999", ""):
        p = a.cli("ps", "--group", "g", "--peer", bad, check=False)
        assert p.returncode == 2 and "--peer: invalid agent address" in p.stderr
