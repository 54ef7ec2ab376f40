"""The GPU self-test (agent/gpus/selftest.py) against a fake of the CUDA driver API
(agent.testing.fake_selftest: the calls answer as cuda.bindings documents them, the kernels do what
native/gpu_selftest.cu does). The real driver runs it in tests/gpu and the device check."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from agent.gpus import selftest
from agent.gpus.selftest import SelfTest, judge, measure
from agent.testing.fake_selftest import UUID, FakeDriver

ROOT = Path(__file__).resolve().parents[2]


def test_a_sound_gpu_passes_with_its_figures() -> None:
    drv = FakeDriver()
    got = measure(UUID, 0.5, b"PTX", drv)
    assert (got.name, got.memory_bytes, got.memory_errors) == ("NVIDIA H200", 32 << 10, 0)
    assert got.tflops == pytest.approx(60.0) and got.memory_gbps == pytest.approx(4000.0)
    assert judge(got) == []
    assert drv.mem == {} and "cuDevicePrimaryCtxRelease" in drv.calls and "cuModuleUnload" in drv.calls


def test_a_word_that_does_not_hold_its_bits_fails_the_memory_test() -> None:
    got = measure(UUID, 0.5, b"PTX", FakeDriver(stuck=1234))
    assert got.memory_errors == 2  # once per pattern
    assert judge(got) == ["2 word(s) of device memory read back wrong in 0.0 MiB tested"]


def test_a_gpu_that_computes_at_a_third_of_its_chip_s_rate_fails_and_an_unknown_chip_is_not_judged() -> None:
    slow = measure(UUID, 0.1, b"PTX", FakeDriver(tflops=20.0))
    assert judge(slow) == ["FP32 throughput 20.0 TFLOP/s, below 50% of a NVIDIA H200's 67"]
    other = measure(UUID, 0.1, b"PTX", FakeDriver(name="NVIDIA Future GPU", tflops=1.0))
    assert judge(other) == []


def test_a_gpu_the_driver_does_not_list_is_said_so() -> None:
    with pytest.raises(RuntimeError, match="lists no GPU GPU-6b1f"):
        measure(UUID, 0.1, b"PTX", FakeDriver(uuid="GPU-00000000-0000-0000-0000-000000000000"))


def test_a_driver_call_that_fails_names_itself() -> None:
    drv = FakeDriver()
    drv.cuMemAlloc = lambda n: (2, None)  # type: ignore[method-assign]  # CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(RuntimeError, match="cuMemAlloc failed: CUresult 2"):
        measure(UUID, 0.1, b"PTX", drv)
    assert "cuDevicePrimaryCtxRelease" in drv.calls  # the context is given back whatever failed


def test_without_a_driver_the_child_says_the_node_cannot_test(tmp_path: Path) -> None:
    """The real path on a machine without the driver library (this one): the node cannot test,
    which says nothing against the GPU (a lease is not refused for it in "auto")."""
    if Path("/dev/nvidiactl").exists():
        pytest.skip("this machine has an NVIDIA driver")
    ptx = tmp_path / "k.ptx"
    ptx.write_bytes(b"PTX")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FERRY_SELFTEST_PTX", str(ptx))
        with pytest.raises(selftest.SelfTestUnavailable) as e:
            selftest.run(UUID, 0.05, timeout_s=60)
    assert "the self-test cannot run here: " in str(e.value)
    assert "driver library cannot be loaded" in str(e.value) or "cuda-bindings is not installed" in str(
        e.value
    )


@pytest.mark.skipif(
    not shutil.which("nvcc") and not Path("/usr/local/cuda-13.0/bin/nvcc").exists(), reason="no nvcc"
)
def test_the_kernels_compile_to_ptx_with_the_three_entries(tmp_path: Path) -> None:
    nvcc = shutil.which("nvcc") or "/usr/local/cuda-13.0/bin/nvcc"
    out = tmp_path / "k.ptx"
    subprocess.run(
        [nvcc, "-ptx", "-arch=compute_80", "-o", str(out), str(ROOT / "native" / "gpu_selftest.cu")],
        check=True,
    )
    text = out.read_text()
    assert all(f".entry {k}(" in text for k in ("ferry_fill", "ferry_check", "ferry_fma"))


def test_the_result_round_trips_through_the_child_s_json() -> None:
    import json
    from dataclasses import asdict

    t = SelfTest(UUID, "NVIDIA H200", 1 << 30, 0, 3900.0, 61.0, 2.5)
    assert SelfTest(**json.loads(json.dumps(asdict(t)))) == t


def test_ferry_doctor_deep_fails_a_gpu_its_self_test_fails_and_says_why_one_could_not_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from agent.cli import doctor
    from agent.gpus.inventory import Nvml
    from agent.testing.nvml_replay import ReplayNvml, Timeline

    two = {
        "driver_version": "580.65.06",
        "gpus": [{"uuid": u, "name": "NVIDIA H200"} for u in ("GPU-a", "GPU-b")],
    }
    nvml = Nvml(ReplayNvml.from_timeline(Timeline(two, []), lambda: 0.0))

    def run(uuid: str, share: float, timeout_s: float) -> SelfTest:
        if uuid == "GPU-b":
            raise RuntimeError("the self-test of GPU-b did not end within 180 s (killed)")
        return SelfTest(uuid, "NVIDIA H200", 1 << 30, 3, 3900.0, 61.0, 2.0)

    monkeypatch.setattr(selftest, "run", run)
    a, b = doctor.deep_checks(0.05, nvml=nvml)
    assert (a.name, a.ok) == ("gpu self-test GPU-a", False) and "3 word(s) of device memory" in a.detail
    assert "1.00 GiB tested, 3 wrong, 3900 GB/s; FP32 61.0 TFLOP/s" in a.detail
    assert (b.ok, b.detail) == (False, "the self-test of GPU-b did not end within 180 s (killed)")
    assert not doctor.can_migrate([a])
    empty = Nvml(
        ReplayNvml.from_timeline(Timeline({"driver_version": "580.65.06", "gpus": []}, []), lambda: 0.0)
    )
    assert [(c.ok, c.detail) for c in doctor.deep_checks(0.05, nvml=empty)] == [(True, "no GPU to test here")]
