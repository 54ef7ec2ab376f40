"""A GPU's self-test, before it is trusted with a job: a device-memory pattern test over a share
of its free memory and an FMA throughput test, through the CUDA driver API (cuda-bindings).

The kernels are native/gpu_selftest.cu, built by `make native` into PTX that the driver compiles
for the chip it finds (`cuModuleLoadData`): a node needs only the driver. The test runs in a
child process (`python -m agent.gpus.selftest --uuid GPU-...`), bounded in time: a GPU that
hangs or faults takes the child down, never the agent, and its context never lives in the
agent. `judge` turns the child's figures into problems: any word read back wrong, a compute rate
below `min_ratio` of the chip's expected one (`EXPECTED_TFLOPS`, FP32 without tensor cores).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agent.config import LOCAL_PREFIX

#: The chips' FP32 (non-tensor) peak, TFLOP/s, from NVIDIA's datasheets (SXM parts). A chip not
#: named here has its memory tested and its rate reported, not judged.
EXPECTED_TFLOPS: dict[str, float] = {
    "NVIDIA H200": 67.0,
    "NVIDIA H100 80GB HBM3": 67.0,
    "NVIDIA A100-SXM4-80GB": 19.5,
    "NVIDIA A100-SXM4-40GB": 19.5,
}
PATTERNS = (0x5A5A5A5A, 0xA5A5A5A5)  # each word written and checked twice, every bit both ways
FMA_ITERS = 1 << 14
THREADS = 256
#: The child's exit status when this node cannot run the test (kernels or bindings missing).
UNAVAILABLE_EXIT = 2
#: cuInit's answers that mean no real driver is here (CUDA_ERROR_STUB_LIBRARY, _INSUFFICIENT_DRIVER):
#: the node cannot test, which says nothing against the GPU.
NOT_A_DRIVER = frozenset({34, 35})


@dataclass(frozen=True)
class SelfTest:
    uuid: str
    name: str
    memory_bytes: int  # tested, per pass
    memory_errors: int  # words read back wrong, over every pass
    memory_gbps: float  # written and read back, GB/s
    tflops: float  # FP32 FMA
    took_s: float


def ptx_path() -> Path:
    explicit = os.environ.get("FERRY_SELFTEST_PTX")
    return Path(explicit) if explicit else LOCAL_PREFIX / "bin" / "gpu-selftest.ptx"


def judge(t: SelfTest, min_ratio: float = 0.5) -> list[str]:
    """What is wrong with the GPU by its self-test ([] if nothing)."""
    out = []
    if t.memory_errors:
        out.append(
            f"{t.memory_errors} word(s) of device memory read back wrong in {t.memory_bytes / 2**20:.1f} MiB "
            "tested"
        )
    expected = EXPECTED_TFLOPS.get(t.name)
    if expected and t.tflops < min_ratio * expected:
        out.append(
            f"FP32 throughput {t.tflops:.1f} TFLOP/s, below {min_ratio:.0%} of a {t.name}'s {expected:g}"
        )
    return out


class SelfTestUnavailable(RuntimeError):
    """This node cannot self-test (no kernels, no cuda-bindings): says nothing about the GPU."""


def unavailable() -> str:
    """Why this node cannot run the self-test ("" if it can): read at each call, cheap."""
    import importlib.util

    path = ptx_path()
    if not path.is_file():
        return f"no self-test kernels at {path} (`make native` where nvcc is)"
    try:
        found = importlib.util.find_spec("cuda.bindings") is not None
    except (ImportError, ValueError):
        found = False
    return "" if found else "cuda-bindings is not installed"


def run(uuid: str, share: float, timeout_s: float) -> SelfTest:
    """The self-test of GPU `uuid` in a child process; RuntimeError says why it failed (the GPU's
    fault), SelfTestUnavailable why it could not run here (the node's)."""
    cmd = [sys.executable, "-m", "agent.gpus.selftest", "--uuid", uuid, "--share", str(share)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the self-test of {uuid} did not end within {timeout_s:g} s (killed)") from None
    if p.returncode != 0:
        said = (p.stderr.strip().splitlines() or ["no output"])[-1]
        if p.returncode == UNAVAILABLE_EXIT:
            raise SelfTestUnavailable(f"the self-test cannot run here: {said}")
        raise RuntimeError(f"the self-test of {uuid} failed (exit {p.returncode}): {said}")
    return SelfTest(**json.loads(p.stdout))


class _Cuda:
    """The driver calls the test makes, each checked (`drv` is cuda.bindings.driver or a fake)."""

    def __init__(self, drv: Any) -> None:
        self.drv = drv

    def __call__(self, name: str, *args: Any) -> Any:
        err, *out = getattr(self.drv, name)(*args)
        if int(err) != 0:
            raise RuntimeError(f"{name} failed: CUresult {int(err)}")
        return out[0] if len(out) == 1 else tuple(out) if out else None


def _params(*values: ctypes._SimpleCData) -> tuple[Any, int]:
    """A kernel's parameter array (kernelParams: each argument's address), kept alive by the caller."""
    array = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
    return (array, values), ctypes.addressof(array)


def measure(uuid: str, share: float, ptx: bytes, drv: Any) -> SelfTest:
    """The self-test in this process (the child's work)."""
    from agent.cuda.driver import uuid_bytes

    cu = _Cuda(drv)
    began = time.monotonic()
    cu("cuInit", 0)
    want = uuid_bytes(uuid)
    dev = next(
        (
            d
            for d in (cu("cuDeviceGet", i) for i in range(cu("cuDeviceGetCount")))
            if bytes(cu("cuDeviceGetUuid", d).bytes) == want
        ),
        None,
    )
    if dev is None:
        raise RuntimeError(f"the CUDA driver lists no GPU {uuid}")
    name = cu("cuDeviceGetName", 256, dev)
    name = (name.split(b"\0", 1)[0] if isinstance(name, bytes) else str(name)).strip()
    name = name.decode() if isinstance(name, bytes) else name
    ctx = cu("cuDevicePrimaryCtxRetain", dev)
    try:
        cu("cuCtxSetCurrent", ctx)
        image = ctypes.create_string_buffer(ptx)
        module = cu("cuModuleLoadData", ctypes.addressof(image))
        fill, check, fma = (
            cu("cuModuleGetFunction", module, n) for n in (b"ferry_fill", b"ferry_check", b"ferry_fma")
        )
        sms = cu("cuDeviceGetAttribute", drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev)
        free, _total = cu("cuMemGetInfo")
        words = max(1, int(free * share) // 4)
        buf, bad = cu("cuMemAlloc", words * 4), cu("cuMemAlloc", 8)
        start, end = cu("cuEventCreate", 0), cu("cuEventCreate", 0)
        try:
            cu("cuMemsetD8", bad, 0, 8)
            blocks = int(sms) * 8
            cu("cuEventRecord", start, 0)
            for seed in PATTERNS:
                keep, args = _params(ctypes.c_uint64(int(buf)), ctypes.c_uint64(words), ctypes.c_uint32(seed))
                cu("cuLaunchKernel", fill, blocks, 1, 1, THREADS, 1, 1, 0, 0, args, 0)
                keep2, args2 = _params(
                    ctypes.c_uint64(int(buf)),
                    ctypes.c_uint64(words),
                    ctypes.c_uint32(seed),
                    ctypes.c_uint64(int(bad)),
                )
                cu("cuLaunchKernel", check, blocks, 1, 1, THREADS, 1, 1, 0, 0, args2, 0)
                cu("cuCtxSynchronize")
            cu("cuEventRecord", end, 0)
            cu("cuEventSynchronize", end)
            mem_ms = float(cu("cuEventElapsedTime", start, end))
            errors = ctypes.c_uint64(0)
            cu("cuMemcpyDtoH", ctypes.addressof(errors), bad, 8)
            out = cu("cuMemAlloc", blocks * THREADS * 4)
            try:
                keep3, args3 = _params(ctypes.c_uint64(int(out)), ctypes.c_uint32(FMA_ITERS))
                cu("cuLaunchKernel", fma, blocks, 1, 1, THREADS, 1, 1, 0, 0, args3, 0)  # warm-up
                cu("cuCtxSynchronize")
                cu("cuEventRecord", start, 0)
                cu("cuLaunchKernel", fma, blocks, 1, 1, THREADS, 1, 1, 0, 0, args3, 0)
                cu("cuEventRecord", end, 0)
                cu("cuEventSynchronize", end)
                fma_ms = float(cu("cuEventElapsedTime", start, end))
            finally:
                cu("cuMemFree", out)
            del keep, keep2, keep3
        finally:
            cu("cuMemFree", buf)
            cu("cuMemFree", bad)
            cu("cuModuleUnload", module)
    finally:
        cu("cuDevicePrimaryCtxRelease", dev)
    flops = 16.0 * FMA_ITERS * blocks * THREADS
    moved = 2 * len(PATTERNS) * words * 4  # each pass writes and reads every word
    return SelfTest(
        uuid=uuid,
        name=name,
        memory_bytes=words * 4,
        memory_errors=int(errors.value),
        memory_gbps=moved / (mem_ms / 1e3) / 1e9 if mem_ms > 0 else 0.0,
        tflops=flops / (fma_ms / 1e3) / 1e12 if fma_ms > 0 else 0.0,
        took_s=time.monotonic() - began,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agent.gpus.selftest", description=__doc__.splitlines()[0])
    p.add_argument("--uuid", required=True, help="the GPU to test (NVML's GPU-... UUID)")
    p.add_argument(
        "--share", type=float, default=0.05, help="the share of its free memory to test (default 0.05)"
    )
    args = p.parse_args(argv)
    if not 0 < args.share <= 0.9:
        p.error("--share must be above 0 and at most 0.9")
    path = ptx_path()
    try:
        ptx = path.read_bytes()
    except OSError as e:
        print(
            f"no self-test kernels at {path} ({e.strerror}): run `make native` where nvcc is", file=sys.stderr
        )
        return UNAVAILABLE_EXIT
    try:
        from cuda.bindings import driver
    except ImportError as e:
        print(f"cuda-bindings is not installed ({e})", file=sys.stderr)
        return UNAVAILABLE_EXIT
    try:
        (err,) = driver.cuInit(0)  # loads the driver library: a node without one cannot test
    except Exception as e:
        print(f"the CUDA driver library cannot be loaded ({type(e).__name__}: {e})", file=sys.stderr)
        return UNAVAILABLE_EXIT
    if int(err) in NOT_A_DRIVER:  # the toolkit's stub, or a driver older than the bindings
        print(f"no usable CUDA driver here: cuInit returned CUresult {int(err)}", file=sys.stderr)
        return UNAVAILABLE_EXIT
    try:
        got = measure(args.uuid, args.share, ptx, driver)
    except Exception as e:  # the driver's failure, in words, for the parent
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(asdict(got)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
