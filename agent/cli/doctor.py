"""`ferry doctor`: can this host migrate jobs, and what is missing?"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent import config
from agent.client import split_address
from agent.coord.config import CoordConfig
from agent.criu.runner import LAZY_PIPE_BYTES, Criu, lazy_dump_blocker
from agent.cuda import pidprobe
from agent.cuda.driver import CudaDriver
from agent.cuda.jobs import REMAP_BRANCH
from agent.errors import FerryError
from agent.gpus.inventory import Nvml
from agent.jobs.network import NetworkConfig, bridge_problem

MIN_STAGING_BYTES = 1 << 30


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True


def run_checks(
    staging_root: Path, network: NetworkConfig | None = None, coordination: CoordConfig | None = None
) -> list[Check]:
    checks: list[Check] = []
    checks.append(Check("root", os.geteuid() == 0, f"euid {os.geteuid()}", "run the agent as root"))
    try:
        init = config.init_binary()
        checks.append(Check("ferry-init", True, init))
    except FerryError as e:
        checks.append(Check("ferry-init", False, e.cause, "run `make native`"))
    checks.extend(_criu_checks())
    probe = staging_root if staging_root.exists() else staging_root.parent
    try:
        free = shutil.disk_usage(probe).free
        checks.append(
            Check(
                "staging space",
                free >= MIN_STAGING_BYTES,
                f"{free >> 20} MiB free in {probe}",
                "point --staging-dir at a tmpfs with room for a job's memory",
            )
        )
    except OSError as e:
        checks.append(Check("staging space", False, f"{probe}: {e.strerror}", "create it or pick another"))
    checks.extend(_job_checks(network or NetworkConfig()))
    checks.append(_coordination_check(coordination or CoordConfig()))
    checks.extend(_gpu_checks())
    return checks


def _coordination_check(coord: CoordConfig) -> Check:
    """etcd: what automatic recovery needs (planned moves and checkpoints do not)."""
    name, fix = (
        "coordination (etcd)",
        "configure [coordination] endpoints in the agent's config (docs/recovery.md)",
    )
    if not coord.enabled:
        return Check(
            name,
            False,
            "none given (`ferry doctor --config FILE` reads the agent's [coordination]): planned moves "
            "and checkpoints work, but automatic recovery after a node dies needs etcd",
            fix,
            required=False,
        )
    answered, why = [], []
    for endpoint in coord.endpoints:
        try:
            socket.create_connection(split_address(endpoint), timeout=2.0).close()
            answered.append(endpoint)
        except OSError as e:
            why.append(f"{endpoint}: {e.strerror or e}")
    detail = (
        f"etcd answers at {', '.join(answered)}; this node's lease lasts {coord.lease_ttl_s} s and its "
        f"group members are fenced {coord.fence_margin_s:g} s before it could expire"
        if answered
        else f"no etcd endpoint answers ({'; '.join(why)}): this node's members would be fenced"
    )
    return Check(name, bool(answered), detail, "start etcd or fix [coordination] endpoints", required=False)


def _job_checks(network: NetworkConfig) -> list[Check]:
    """What a job started here gets, and so what can move with it."""
    checks = []
    try:
        init = config.init_binary()
        with tempfile.TemporaryDirectory(prefix="ferry-doctor-") as logs:
            for f in ("stdout.log", "stderr.log"):
                Path(logs, f).write_bytes(b"")
            p = subprocess.run(
                [init, "--private", "--netns", "--logs", logs, "--no-io-uring", "--", "true"],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
        ok, said = p.returncode == 0, (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
    except (FerryError, OSError, subprocess.TimeoutExpired) as e:
        ok, said = False, str(e)
    checks.append(
        Check(
            "job namespaces",
            ok,
            "each job gets its own PID, mount (fresh /tmp, /dev/shm, /run) and network namespace"
            if ok
            else said,
            "run the agent as root on a kernel with mount and network namespaces",
        )
    )
    uring = _read("/proc/sys/kernel/io_uring_disabled")
    checks.append(
        Check(
            "io_uring",
            True,
            f"kernel.io_uring_disabled = {uring or 'n/a'}; CRIU cannot dump io_uring: jobs started by "
            "`ferry run` cannot open one (seccomp), so libraries fall back; adopted processes holding "
            "one are refused before anything is frozen",
            required=False,
        )
    )
    if not network.enabled:
        checks.append(
            Check(
                "job network",
                False,
                "none given (`ferry doctor --config FILE` reads the agent's [network]): jobs share this "
                "node's network, and jobs holding inet sockets cannot move to another node",
                "configure [network] (docs/networking.md)",
                required=False,
            )
        )
    else:
        problem = bridge_problem(network.bridge)  # the agent refuses to start with it too
        checks.append(
            Check(
                "job network",
                not problem,
                problem
                or f"jobs get addresses from {network.pool} of {network.subnet} on bridge {network.bridge}; "
                "their TCP connections move with them",
                "name a bridge in [network] bridge"
                if "not a bridge" in problem
                else f"create bridge {network.bridge} and join it to the job network's segment",
            )
        )
    return checks


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def _criu_checks() -> list[Check]:
    try:
        criu = Criu()
        version = criu.require_usable()
    except FerryError as e:
        return [Check("criu", False, e.cause, e.hint or "run `make criu`")]
    ok, said = criu.check()
    return [
        Check("criu", True, f"CRIU {version} at {criu.binary}"),
        Check(
            "criu check", ok, said.splitlines()[-1] if said else "", "see `criu check` output; run as root"
        ),
        Check(
            "userfaultfd (lazy pages)",
            criu.feature("uffd-noncoop"),
            "receiving a post-copy migration (the default; else pre-copy)",
            "enable CONFIG_USERFAULTFD",
            required=False,
        ),
        Check(
            "lazy page server",
            not (blocker := lazy_dump_blocker()),
            blocker or "sending a post-copy migration (the default; else pre-copy)",
            f"sysctl fs.pipe-max-size={LAZY_PIPE_BYTES}",
            required=False,
        ),
        Check(
            "dirty tracking (incremental snapshots)",
            criu.feature("mem_dirty_track"),
            "a group snapshot's dumps after the first carry only the pages written since",
            "a kernel with CONFIG_MEM_SOFT_DIRTY, or Linux >= 6.7 with CONFIG_USERFAULTFD and ferry's "
            "CRIU (`make criu`): else every snapshot dump is whole",
            required=False,
        ),
    ]


def _gpu_checks(
    nvml: Nvml | None = None,
    driver: CudaDriver | None = None,
    pid_probe: Callable[[Nvml], pidprobe.PidProbe] = pidprobe.probe,
) -> list[Check]:
    """NVIDIA driver (NVML) and what its CUDA checkpoint API offers: optional, CPU jobs move without."""
    nvml = nvml or Nvml()
    inv = nvml.inventory()
    if not inv.available:
        return [Check("nvidia driver", False, inv.detail, "CPU jobs only on this host", required=False)]
    checks = [Check("nvidia driver", True, inv.detail, required=False)]
    info = (driver or CudaDriver()).probe()
    branch = inv.driver_branch
    checks.append(
        Check(
            "cuda checkpoint",
            info.checkpoint,
            info.detail if info.loaded else f"the CUDA driver library does not load: {info.detail}",
            "upgrade the NVIDIA driver to r580 or newer",
            required=False,
        )
    )
    checks.append(
        Check(
            "gpu remap on restore",
            branch >= REMAP_BRANCH,
            f"driver branch r{branch} (restore onto another GPU needs r{REMAP_BRANCH})",
            "upgrade the NVIDIA driver to r580 or newer",
            required=False,
        )
    )
    checks.append(
        Check(
            "cuda custom storage",
            info.custom_storage,
            "device memory copied by ferry, not staged in host RAM"
            if info.custom_storage
            else "not offered by this driver: device memory is staged in the job's host memory",
            "a newer NVIDIA driver",
            required=False,
        )
    )
    if info.checkpoint and inv.gpus:
        probe = pid_probe(nvml)
        checks.append(
            Check(
                "nvml pids",
                probe.verdict is pidprobe.PidVerdict.MATCH,
                f"{probe.verdict.value}: {probe.detail}",
                pidprobe.MISMATCH_HINT if probe.mismatch else "see the detail",
                required=False,
            )
        )
    from agent.gpus import selftest

    why = selftest.unavailable()
    checks.append(
        Check(
            "gpu self-test",
            not why,
            why or f"kernels at {selftest.ptx_path()}: a lease's GPUs are tested before a job moves in",
            'without it GPUs are trusted on NVML alone ([verify] selftest = "auto")',
            required=False,
        )
    )
    if mig := [g.uuid for g in inv.gpus if g.mig]:
        checks.append(
            Check(
                "mig", False, f"MIG mode on {', '.join(mig)}", "CUDA checkpoint cannot move MIG jobs", False
            )
        )
    return checks


def deep_checks(share: float, timeout_s: float = 180.0, nvml: Nvml | None = None) -> list[Check]:
    """`ferry doctor --deep`: every GPU's self-test (agent.gpus.selftest), one after the other."""
    from agent.gpus import selftest

    inv = (nvml or Nvml()).inventory()
    if not inv.available or not inv.gpus:
        return [Check("gpu self-test", True, "no GPU to test here", required=False)]
    out = []
    for g in inv.gpus:
        name = f"gpu self-test {g.uuid}"
        try:
            t = selftest.run(g.uuid, share, timeout_s)
        except RuntimeError as e:
            out.append(Check(name, False, str(e), "see the reason; `make native` builds the kernels"))
            continue
        figures = (
            f"{t.name}: {t.memory_bytes / 2**30:.2f} GiB tested, {t.memory_errors} wrong, "
            f"{t.memory_gbps:.0f} GB/s; FP32 {t.tflops:.1f} TFLOP/s; {t.took_s:.1f} s"
        )
        problems = selftest.judge(t)
        detail = figures + ("; " + "; ".join(problems) if problems else "")
        out.append(Check(name, not problems, detail, "take the GPU out of service and have it checked"))
    return out


def can_migrate(checks: list[Check]) -> bool:
    return all(c.ok for c in checks if c.required)
