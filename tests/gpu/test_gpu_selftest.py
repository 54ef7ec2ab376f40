"""The GPU self-test (agent/gpus/selftest.py) on a real GPU: its kernels load through the driver,
every word of the tested memory reads back right, and the FMA rate is within the chip's expected
range. The figures go to the device check's report."""

from __future__ import annotations

import pytest

from agent.gpus import selftest
from agent.gpus.inventory import Nvml
from tests.gpu.devicetools import record_note


def test_every_gpu_passes_its_self_test_with_its_figures() -> None:
    if not selftest.ptx_path().exists():
        pytest.fail(f"no self-test kernels at {selftest.ptx_path()}: `make native` builds them where nvcc is")
    for g in Nvml().inventory().gpus:
        got = selftest.run(g.uuid, 0.05, timeout_s=120)
        # In the device report's "other driver answers" (a passing test's output is not shown).
        record_note(
            f"GPU self-test of {g.uuid} ({got.name})",
            tested_gib=round(got.memory_bytes / 2**30, 2),
            memory_errors=got.memory_errors,
            memory_gbps=round(got.memory_gbps),
            fp32_tflops=round(got.tflops, 1),
            expected_tflops=selftest.EXPECTED_TFLOPS.get(got.name, "unknown"),
            took_s=round(got.took_s, 1),
        )
        assert selftest.judge(got) == [], got
        assert got.memory_bytes > 0 and got.tflops > 0
