"""Fixtures for the unit tests (the fakes themselves are in fakes.py)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from fakes import SLEEP, FakeCriu, target_migrations

from agent.jobs.registry import JobRegistry
from agent.migration import target as incoming
from agent.migration.target import TargetMigrations
from agent.rpc import pb_grpc
from agent.service.node import AgentNode
from agent.service.serve import create_server


@pytest.fixture(autouse=True)
def _plaintext_loopback_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-process agents here serve plaintext on loopback, so the CLI dials them --insecure.
    Tests of the TLS path remove this (monkeypatch.delenv)."""
    monkeypatch.setenv("FERRY_INSECURE", "1")


@pytest.fixture
def sleeper(tmp_path: Path) -> Iterator[Callable[[], tuple[subprocess.Popen[bytes], Path, Path]]]:
    """Start harmless `sleep 60` children with stdout/stderr in files; killed at teardown."""
    started: list[subprocess.Popen[bytes]] = []

    def start() -> tuple[subprocess.Popen[bytes], Path, Path]:
        n = len(started)
        out, err = tmp_path / f"sleeper{n}.out", tmp_path / f"sleeper{n}.err"
        out.write_text("step 1 loss 0.9\n")
        err.write_text("")
        with open(out, "ab") as o, open(err, "ab") as e:
            p = subprocess.Popen(
                [SLEEP, "60"], stdin=subprocess.DEVNULL, stdout=o, stderr=e, start_new_session=True
            )
        started.append(p)
        return p, out, err

    yield start
    for p in started:
        p.kill()
        p.wait(timeout=10)


@pytest.fixture
def fake_criu() -> Iterator[FakeCriu]:
    c = FakeCriu(node="test")
    yield c
    c.cleanup()


@pytest.fixture
def registry(tmp_path: Path) -> JobRegistry:
    return JobRegistry(tmp_path / "state", "nodea")


@pytest.fixture
def target(tmp_path: Path, fake_criu: FakeCriu, monkeypatch: pytest.MonkeyPatch) -> TargetMigrations:
    """A target node's incoming migrations (its own registry and staging), with no fault armed."""
    monkeypatch.delenv("FERRY_FAULTS", raising=False)
    monkeypatch.setattr(incoming, "RESUME_LOOK_S", 0.2)
    registry = JobRegistry(tmp_path / "tstate", "nodeb")
    return target_migrations(registry, fake_criu, tmp_path / "tstaging")


@pytest.fixture
def make_agent(tmp_path: Path) -> Iterator[Callable[..., tuple[AgentNode, str, FakeCriu]]]:
    """Start in-process agents on loopback (port 0) with a fake CRIU: (service, address, criu)."""
    started: list[tuple[grpc.Server, FakeCriu]] = []

    def make(node: str = "nodea") -> tuple[AgentNode, str, FakeCriu]:
        criu = FakeCriu(node)
        svc = AgentNode(tmp_path / node / "state", node, tmp_path / node / "staging", criu=criu)
        server, port = create_server("127.0.0.1:0", svc, max_workers=8)
        server.start()
        started.append((server, criu))
        return svc, f"127.0.0.1:{port}", criu

    yield make
    for server, criu in started:
        server.stop(None).wait()
        criu.cleanup()


@pytest.fixture
def agent(make_agent) -> tuple[AgentNode, str, FakeCriu]:
    """One in-process agent (nodea): (service, address, fake CRIU)."""
    return make_agent("nodea")


@pytest.fixture
def stub(agent) -> Iterator[pb_grpc.AgentStub]:
    """A plaintext gRPC stub for `agent`."""
    with grpc.insecure_channel(agent[1]) as ch:
        yield pb_grpc.AgentStub(ch)
