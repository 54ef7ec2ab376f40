"""The GPU self-test (agent/gpus/selftest.py) on a real GPU: its kernels load through the driver,
every word of the tested memory reads back right, and the FMA rate is within the chip's expected
range. The figures are printed for the device check's report."""

from __future__ import annotations

import pytest

from agent.gpus import selftest
from agent.gpus.inventory import Nvml


def test_every_gpu_passes_its_self_test_with_its_figures() -> None:
    if not selftest.ptx_path().exists():
        pytest.fail(f"no self-test kernels at {selftest.ptx_path()}: `make native` builds them where nvcc is")
    for g in Nvml().inventory().gpus:
        got = selftest.run(g.uuid, 0.05, timeout_s=120)
        print(
            f"{g.uuid} ({got.name}): {got.memory_bytes / 2**30:.1f} GiB tested, {got.memory_errors} errors, "
            f"{got.memory_gbps:.0f} GB/s; FP32 {got.tflops:.1f} TFLOP/s "
            f"(expected {selftest.EXPECTED_TFLOPS.get(got.name, 'unknown')}); took {got.took_s:.1f} s"
        )
        assert selftest.judge(got) == [], got
        assert got.memory_bytes > 0 and got.tflops > 0
