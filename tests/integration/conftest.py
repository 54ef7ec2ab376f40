"""Real agents, real CRIU, real PyTorch jobs on loopback. Needs root."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent import config as ferry_config
from agent.criu.lazy import LAZY_PIPE_BYTES, lazy_dump_blocker

PIPE_MAX = Path("/proc/sys/fs/pipe-max-size")
#: Run alone, after the part `make test` runs two at a time: these time a job against itself
#: (a step time within 10 %, a gap within half a second of a pause, a lease's expiry within a
#: second), which another test's load would skew.
SERIAL_MODULES = frozenset({"test_stragglers.py", "test_standin.py", "test_ranks.py", "test_etcd_client.py"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    if os.geteuid() != 0:
        skip = pytest.mark.skip(reason="integration tests need root (CRIU dumps and restores processes)")
        for item in items:
            if here in Path(item.fspath).parents:
                item.add_marker(skip)
    for item in items:
        # A test that raises fs.pipe-max-size changes what every agent on the host may do (a
        # default move goes post-copy), so it runs alone too.
        fixtures = getattr(item, "fixturenames", ())
        if here in Path(item.fspath).parents and (
            Path(item.fspath).name in SERIAL_MODULES or "lazy_pipes" in fixtures
        ):
            item.add_marker(pytest.mark.serial)


@pytest.fixture(scope="session", autouse=True)
def _criu_present() -> None:
    # Fail loudly, not skip, when root lacks CRIU: `make test` installs it.
    ferry_config.criu_binary()


@pytest.fixture
def lazy_pipes(request: pytest.FixtureRequest) -> Iterator[None]:
    """Root without CAP_SYS_RESOURCE (this test VM) needs fs.pipe-max-size raised for a lazy dump,
    as an operator would; the agent refuses `--post-copy` with that advice otherwise, and its
    default then moves pre-copy (tests/unit). Only in a serial test: one asked for it by
    getfixturevalue is not marked by pytest_collection_modifyitems, and ran beside others."""
    if request.node.get_closest_marker("serial") is None:
        pytest.fail(f"{request.node.nodeid} raises fs.pipe-max-size: mark it serial (pytest.mark.serial)")
    old = PIPE_MAX.read_text()
    if lazy_dump_blocker():
        PIPE_MAX.write_text(str(LAZY_PIPE_BYTES))
    yield
    PIPE_MAX.write_text(old)
