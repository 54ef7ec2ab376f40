"""Fixtures shared by the integration and GPU suites (real agents on loopback)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.testing.localcluster import LocalAgent


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[Callable[..., LocalAgent]]:
    """Start agents on loopback; each is stopped and its jobs killed afterwards."""
    started: list[LocalAgent] = []

    def start(
        node: str, env: dict[str, str] | None = None, prefix: list[str] | None = None, **kw: object
    ) -> LocalAgent:
        agent = LocalAgent(tmp_path, node, env={"PYTHONWARNINGS": "ignore", **(env or {})}, **kw)  # type: ignore[arg-type]
        started.append(agent.start(prefix=prefix))
        return agent

    yield start
    for agent in started:  # each in full, whatever another's teardown raised
        try:
            agent.kill_jobs()
        finally:
            try:
                agent.stop()
            finally:
                agent.cleanup()
