"""Real agents, real CRIU, real PyTorch jobs on loopback. Needs root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent import config as ferry_config


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    if os.geteuid() != 0:
        skip = pytest.mark.skip(reason="integration tests need root (CRIU dumps and restores processes)")
        for item in items:
            if here in Path(item.fspath).parents:
                item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _criu_present() -> None:
    # Fail loudly, not skip, when root lacks CRIU: `make test` installs it.
    ferry_config.criu_binary()
