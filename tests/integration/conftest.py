"""Real agents, real CRIU, real PyTorch jobs on loopback. Needs root."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent import config as ferry_config
from agent.criu.lazy import LAZY_PIPE_BYTES, lazy_dump_blocker

PIPE_MAX = Path("/proc/sys/fs/pipe-max-size")


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


@pytest.fixture
def lazy_pipes() -> Iterator[None]:
    """Root without CAP_SYS_RESOURCE (this test VM) needs fs.pipe-max-size raised for a lazy dump,
    as an operator would; the agent refuses `--post-copy` with that advice otherwise, and its
    default then moves pre-copy (tests/unit)."""
    old = PIPE_MAX.read_text()
    if lazy_dump_blocker():
        PIPE_MAX.write_text(str(LAZY_PIPE_BYTES))
    yield
    PIPE_MAX.write_text(old)
