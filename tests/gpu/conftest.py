"""Real GPU, real CUDA checkpoint driver, real CRIU, real agents. Skipped, with the reason, elsewhere.

`scripts/device-check.sh` runs this suite on a GPU machine; `make gpu` runs it here.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.cuda import CudaDriver
from agent.gpus import Nvml


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
