"""A stand-in for the CUDA driver API's calls that the GPU self-test makes (agent.gpus.selftest),
for machines without a GPU: the calls answer as cuda.bindings documents them ((CUresult, value...)
tuples, kernel parameters passed as an array of pointers), and the three kernels do what
native/gpu_selftest.cu does, in Python, on a GPU whose faults and speed a test chooses.

`ReplayedSelfTest` runs the real `measure` and `judge` against it for GPUs that an NVML replay
file describes (agent.testing.nvml_replay: a GPU's optional "selftest" entry), so that an agent
under agent.testing.agent self-tests its replayed GPUs; the real driver runs in tests/gpu and the
device check.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

from agent.cuda.driver import uuid_bytes, uuid_text
from agent.gpus.selftest import SelfTest, measure

UUID = "GPU-6b1f3d2a-0c4e-4a57-9e11-2f5c8b7d9a01"


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


def measured(uuid: str, share: float, **gpu: Any) -> SelfTest:
    """The real measure of GPU `uuid` through a FakeDriver shaped by `gpu` (its fields). Tests and
    replay files name GPUs briefly ("GPU-a0"); the driver speaks in 16-byte UUIDs."""
    raw = uuid_text(hashlib.sha256(uuid.encode()).digest()[:16])
    return replace(measure(raw, share, b"PTX", FakeDriver(uuid=raw, **gpu)), uuid=uuid)


def sound_selftest(uuid: str, share: float, timeout_s: float) -> SelfTest:
    """`selftest.run` for a rig's fake GPUs (an H200 with nothing wrong): the real measure."""
    return measured(uuid, share)


class ReplayedSelfTest:
    """`selftest.run` for replayed GPUs: each GPU's "selftest" entry in the world, e.g.
    ``{"stuck": 12, "tflops": 20.0, "gbps": 3000.0, "hang": false}`` (all optional: a sound H200
    by default), measured through FakeDriver; a GPU the world does not list is not found."""

    def __init__(self, world: Callable[[], dict[str, Any]]) -> None:
        self.world = world

    def __call__(self, uuid: str, share: float, timeout_s: float) -> SelfTest:
        g = next((g for g in self.world().get("gpus", []) if g.get("uuid") == uuid), None)
        if g is None:
            raise RuntimeError(
                f"the self-test of {uuid} failed (exit 1): the CUDA driver lists no GPU {uuid}"
            )
        spec = g.get("selftest", {})
        if spec.get("hang"):
            raise RuntimeError(f"the self-test of {uuid} did not end within {timeout_s:g} s (killed)")
        return measured(
            uuid,
            share,
            name=str(g.get("name", "NVIDIA H200")),
            stuck=spec.get("stuck"),
            tflops=float(spec.get("tflops", 60.0)),
            gbps=float(spec.get("gbps", 4000.0)),
        )
