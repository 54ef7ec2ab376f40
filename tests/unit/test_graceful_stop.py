"""Graceful stop (agent.service.serve, AgentNode.wait_idle): the target's Commit, `ferry restore` and
Preempt count as work in flight, as moves do, and health says NOT_SERVING from the drain's start."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from fakes import FakeCriu, wait_for
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agent.jobs.record import JobKind, JobRecord, JobState
from agent.rpc import pb, pb_grpc
from agent.service import node as node_mod
from agent.service import serve as serve_mod
from agent.service.node import AgentNode

HealthStatus = health_pb2.HealthCheckResponse


def _blocking(answer: Any, entered: threading.Event, release: threading.Event) -> Callable[..., Any]:
    def call(*_args: object, **_kw: object) -> Any:
        entered.set()
        assert release.wait(10), "the test never released the call"
        return answer

    return call


@pytest.mark.parametrize("rpc", ["Commit", "Restore", "Preempt"])
def test_a_target_side_call_in_flight_holds_a_graceful_stop(
    rpc: str, agent, stub: pb_grpc.AgentStub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop waits (within its bound) for the restore under Commit, `ferry restore` and a
    preemption's suspend, as it waits for a move: each is cut short otherwise."""
    svc: AgentNode = agent[0]
    entered, release = threading.Event(), threading.Event()
    restored = JobRecord("train", JobKind.LAUNCHED, JobState.RUNNING, 1, ["x"], "/")
    if rpc == "Commit":
        monkeypatch.setattr(svc.targets, "commit", _blocking(pb.CommitResponse(), entered, release))
        call = lambda: stub.Commit(pb.CommitRequest(migration_id="m1"), timeout=30)  # noqa: E731
    elif rpc == "Restore":
        monkeypatch.setattr(node_mod, "restore_image", _blocking(restored, entered, release))
        call = lambda: stub.Restore(pb.RestoreRequest(image_dir="/img"), timeout=30)  # noqa: E731
    else:
        monkeypatch.setattr(svc.healing, "preempt", _blocking(pb.PreemptResponse(), entered, release))
        call = lambda: stub.Preempt(pb.PreemptRequest(job="train", source_node="nodeb"), timeout=30)  # noqa: E731
    errors: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    try:
        assert entered.wait(10), f"{rpc} never reached the agent"
        assert not svc.wait_idle(timeout_s=0.2), f"a graceful stop would not wait for {rpc}"
    finally:
        release.set()
        t.join(10)
    assert errors == []
    assert svc.wait_idle(timeout_s=5)


def test_health_says_not_serving_from_the_start_of_a_graceful_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """serve() itself: SIGTERM while a move is in flight; until the move ends the agent still
    answers (a source's Commit and GetMigration need it), but its health says NOT_SERVING."""
    made: dict[str, Any] = {}
    criu = FakeCriu("nodea")
    real_create = serve_mod.create_server

    def node(*args: Any, **kw: Any) -> AgentNode:
        made["agent"] = AgentNode(*args, criu=criu, **kw)
        return made["agent"]

    def create(address: str, agent: AgentNode, **kw: Any) -> tuple[grpc.Server, int]:
        server, port = real_create(address, agent, **kw)
        made["port"] = port
        return server, port

    monkeypatch.setattr(serve_mod, "AgentNode", node)
    monkeypatch.setattr(serve_mod, "create_server", create)
    seen: list[int] = []
    release = threading.Event()
    failures: list[BaseException] = []

    def check() -> int:
        with grpc.insecure_channel(f"127.0.0.1:{made['port']}") as ch:
            req = health_pb2.HealthCheckRequest(service="ferry.v1.Agent")
            return health_pb2_grpc.HealthStub(ch).Check(req, timeout=5).status

    def drive() -> None:
        try:
            wait_for(lambda: "port" in made, timeout_s=30, what="the agent to bind")
            made["agent"]._spawn(lambda: release.wait(30))  # a move in flight
            wait_for(lambda: _answers(check) == HealthStatus.SERVING, timeout_s=30, what="the agent to serve")
            os.kill(os.getpid(), signal.SIGTERM)
            wait_for(lambda: made["agent"].healing.draining.is_set(), what="the drain to start")
            seen.append(check())
            seen.append(check())  # still answering: the move holds the stop
        except BaseException as e:
            failures.append(e)
        finally:
            release.set()

    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    driver = threading.Thread(target=drive)
    driver.start()
    try:
        serve_mod.serve("127.0.0.1:0", tmp_path / "state", "nodea", tmp_path / "staging", insecure=True)
    finally:
        release.set()
        driver.join(30)
        for s, h in handlers.items():
            signal.signal(s, h)
        criu.cleanup()
    assert failures == []
    assert seen == [HealthStatus.NOT_SERVING, HealthStatus.NOT_SERVING]


def _answers(check: Callable[[], int]) -> int | None:
    try:
        return check()
    except grpc.RpcError:
        return None
