"""Real GPU, real CUDA checkpoint driver, real CRIU, real agents. Skipped, with the reason, elsewhere.

`scripts/device-check.sh` runs this suite on a GPU machine; `make gpu` runs it here. The agents are
nodes of the multi-node bed (`bed`, agent/testing/bed.py), as in tests/integration/test_nodes.py.
"""

from __future__ import annotations

import os
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.cuda.driver import CudaDriver
from agent.gpus.inventory import Nvml
from agent.testing.bed import Bed, node_bed


def _why_not() -> str:
    if os.geteuid() != 0:
        return "GPU tests need root (CRIU and the CUDA checkpoint API act on other processes)"
    inv = Nvml().inventory()
    if not inv.available:
        return f"no NVIDIA GPU here: {inv.detail}"
    if not inv.gpus:
        return "NVML works but lists no GPU"
    info = CudaDriver().probe()
    if not info.checkpoint:
        return f"the NVIDIA driver cannot checkpoint CUDA processes: {info.detail}"
    return ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    mine = [i for i in items if here in Path(i.fspath).parents]
    if not mine:
        return
    reason = _why_not()
    for item in mine:
        item.add_marker(pytest.mark.gpu)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def bed(tmp_path: Path) -> Iterator[Bed]:
    """Nodes on this host that share only the cluster file system (`bed.shared`): each node its
    own network and mount namespaces (fresh /tmp, /dev/shm, /run; /dev and the host's PIDs as
    they are) and its agent on TLS; a job network (`[network]`) gives every job its own address
    and network namespace, so a restore on the same host never shares its frozen source's."""
    with node_bed(tmp_path) as b:
        yield b


#: Logs of the run so far, packed after every test (a run killed at its limit still brings them
#: back; the device tool returns at most 8 files, so one archive): set by scripts/device-check.sh.
LOG_ARCHIVE = os.environ.get("FERRY_DEVICE_LOGS", "")
MAX_LOG_BYTES = 12 << 20


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    if LOG_ARCHIVE:
        pack_logs(
            Path(os.environ.get("FERRY_DEVICE_BASETEMP", "/tmp/ferry-device-pytest")), Path(LOG_ARCHIVE)
        )


def pack_logs(root: Path, archive: Path) -> None:
    """Every *.log under root (agents, CRIU, jobs), newest first, up to MAX_LOG_BYTES."""
    logs = sorted((p for p in root.rglob("*.log") if p.is_file()), key=lambda p: -p.stat().st_mtime)
    tmp = archive.with_suffix(".part")
    total = 0
    with tarfile.open(tmp, "w:gz") as tar:
        for log in logs:
            total += log.stat().st_size
            if total > MAX_LOG_BYTES:
                break
            tar.add(log, arcname=str(log.relative_to(root)))
    tmp.replace(archive)
