"""The GPU self-test (agent/gpus/selftest.py) against a fake of the CUDA driver API: the calls
answer as cuda.bindings documents them ((CUresult, value...) tuples, kernel parameters passed as
an array of pointers), and the three kernels do what native/gpu_selftest.cu does, in Python.
The real driver runs it in tests/gpu and the device check; here there is none."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from agent.cuda.driver import uuid_bytes
from agent.gpus import selftest
from agent.gpus.selftest import SelfTest, judge, measure

UUID = "GPU-6b1f3d2a-0c4e-4a57-9e11-2f5c8b7d9a01"
ROOT = Path(__file__).resolve().parents[2]


def pattern(i: int, seed: int) -> int:
    """native/gpu_selftest.cu's ferry_pattern, bit for bit."""
    x = ((i ^ (i >> 32)) & 0xFFFFFFFF) ^ seed
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    x ^= x >> 16
    return x


@dataclass
class FakeDriver:
    """One GPU: `free` bytes of memory, a word that reads back with a bit flipped (`stuck`), and
    how fast it moves memory and computes (what cuEventElapsedTime then says)."""

    name: str = "NVIDIA H200"
    uuid: str = UUID
    free: int = 64 << 10
    stuck: int | None = None  # a word index whose bit 3 always reads back flipped
    gbps: float = 4000.0
    tflops: float = 60.0
    sms: int = 132
    mem: dict[int, bytearray] = field(default_factory=dict)
    clock_ms: float = 0.0
    events: dict[int, float] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)
    made: int = 0  # events created
    CUdevice_attribute = SimpleNamespace(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT=16)

    def __getattr__(self, name: str):  # every other driver call succeeds and returns nothing
        if name.startswith("cu"):
            return lambda *a: self.calls.append(name) or (0,)
        raise AttributeError(name)

    def cuInit(self, flags):
        return (0,)

    def cuDeviceGetCount(self):
        return (0, 1)

    def cuDeviceGet(self, i):
        return (0, i)

    def cuDeviceGetUuid(self, dev):
        return (0, SimpleNamespace(bytes=uuid_bytes(self.uuid)))

    def cuDeviceGetName(self, n, dev):
        return (0, self.name.encode() + b"\0" * (n - len(self.name)))

    def cuDevicePrimaryCtxRetain(self, dev):
        return (0, "ctx")

    def cuDeviceGetAttribute(self, attr, dev):
        assert attr == 16
        return (0, self.sms)

    def cuModuleLoadData(self, image):
        assert b".entry ferry_fill" in ctypes.string_at(image) or ctypes.string_at(image) == b"PTX"
        return (0, "module")

    def cuModuleGetFunction(self, module, name):
        return (0, name.decode())

    def cuMemGetInfo(self):
        return (0, self.free, self.free * 2)

    def cuMemAlloc(self, n):
        ptr = 0x7000_0000 + sum(len(b) for b in self.mem.values()) + 4096 * len(self.mem)
        self.mem[ptr] = bytearray(n)
        return (0, ptr)

    def cuMemFree(self, ptr):
        del self.mem[int(ptr)]
        return (0,)

    def cuMemsetD8(self, ptr, value, n):
        self.mem[int(ptr)][:n] = bytes([value]) * n
        return (0,)

    def cuMemcpyDtoH(self, host, ptr, n):
        ctypes.memmove(host, bytes(self.mem[int(ptr)][:n]), n)
        return (0,)

    def cuEventCreate(self, flags):
        self.made += 1
        return (0, self.made)

    def cuEventRecord(self, event, stream):
        self.events[event] = self.clock_ms
        return (0,)

    def cuEventElapsedTime(self, start, end):
        return (0, self.events[end] - self.events[start])

    def cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra):
        ptrs = (ctypes.c_void_p * 4).from_address(params)

        def arg(i: int, kind: type) -> int:
            return kind.from_address(ptrs[i]).value

        threads = gx * bx
        if f in ("ferry_fill", "ferry_check"):
            buf, n, seed = self.mem[arg(0, ctypes.c_uint64)], arg(1, ctypes.c_uint64), arg(2, ctypes.c_uint32)
            if f == "ferry_fill":
                for i in range(n):
                    v = pattern(i, seed) ^ (8 if i == self.stuck else 0)
                    buf[4 * i : 4 * i + 4] = v.to_bytes(4, "little")
            else:
                wrong = sum(
                    int.from_bytes(buf[4 * i : 4 * i + 4], "little") != pattern(i, seed) for i in range(n)
                )
                counter = self.mem[arg(3, ctypes.c_uint64)]
                counter[:8] = (int.from_bytes(counter[:8], "little") + wrong).to_bytes(8, "little")
            self.clock_ms += n * 4 / (self.gbps * 1e9) * 1e3
        else:
            assert f == "ferry_fma" and threads * 4 <= len(self.mem[arg(0, ctypes.c_uint64)])
            self.clock_ms += 16.0 * arg(1, ctypes.c_uint32) * threads / (self.tflops * 1e12) * 1e3
        return (0,)


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


def test_without_a_gpu_the_child_says_why_in_words(tmp_path: Path) -> None:
    """The real path on this machine: the child process loads the driver and finds none."""
    ptx = tmp_path / "k.ptx"
    ptx.write_bytes(b"PTX")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FERRY_SELFTEST_PTX", str(ptx))
        with pytest.raises(RuntimeError) as e:
            selftest.run(UUID, 0.05, timeout_s=60)
    assert f"the self-test of {UUID} failed (exit 1): " in str(e.value)


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
