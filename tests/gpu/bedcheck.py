"""Whether the GPU suite's multi-node bed (agent/testing/bed.py) can run on this host, for the
device check's preflight (scripts/device-check.sh): it builds a bed of one node, exactly as the
suite does (network namespaces, veths, bridges, a mount namespace with fresh /tmp, /dev/shm and
/run), and runs a probe as that node's agent would run: this Python with ferry's packages and
stubs, ferry's binaries (FERRY_CRIU, FERRY_INIT, FERRY_CUDA_COUNTER where set), the NVIDIA
device files, cuda-bindings and NVML (NVML answers in any network namespace; the bed creates no
PID namespace, so NVML's PIDs are the agent's, as the PID probe checks on the host).

    python -m tests.gpu.bedcheck [--no-gpu]

Prints one line and exits 0, or one line saying what is missing and exits 1. `--no-gpu` leaves
the NVIDIA checks out (the unit tests run it where there is no GPU).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: Runs inside the node; prints one JSON object.
PROBE = r"""
import glob, importlib, json, os, sys
gpu = sys.argv[1] == "gpu"
missing = []
for mod in ("grpc", "google.protobuf", "psutil", "pynvml", "cryptography.x509", "prometheus_client",
            "ferry.v1.agent_pb2", "agent.cli.main", "agent.service.node"):
    try:
        importlib.import_module(mod)
    except Exception as e:
        missing.append(f"python module {mod} ({type(e).__name__}: {e})")
for var in ("FERRY_CRIU", "FERRY_INIT", "FERRY_CUDA_COUNTER"):
    path = os.environ.get(var)
    if path and not os.access(path, os.X_OK):
        missing.append(f"{var} ({path})")
facts = {}
if gpu:
    devices = sorted(glob.glob("/dev/nvidia*"))
    facts["devices"] = len(devices)
    if "/dev/nvidiactl" not in devices:
        missing.append("/dev/nvidiactl")
    try:
        from cuda.bindings import driver
        (err,) = driver.cuInit(0)
        if int(err) != 0:
            missing.append(f"cuInit ({err})")
    except Exception as e:
        missing.append(f"cuda-bindings ({type(e).__name__}: {e})")
    try:
        import pynvml
        pynvml.nvmlInit()
        facts["gpus"] = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
        if not facts["gpus"]:
            missing.append("GPUs (NVML lists none)")
    except Exception as e:
        missing.append(f"NVML ({type(e).__name__}: {e})")
st = os.statvfs("/dev/shm")
facts["shm_gib"] = round(st.f_bavail * st.f_frsize / 2**30, 1)
print(json.dumps({"missing": missing, **facts}))
"""


def check(gpu: bool = True) -> tuple[bool, str]:
    """(whether a bed node has all it needs, one line saying what it has or lacks)."""
    from agent.testing.bed import node_bed

    root = Path(tempfile.mkdtemp(prefix="ferry-bedcheck-"))
    try:
        with node_bed(root) as bed:
            node = bed.node("probe", start=False)
            p = subprocess.run(
                [*bed.node_prefix(node.netns), sys.executable, "-c", PROBE, "gpu" if gpu else "no-gpu"],
                capture_output=True,
                text=True,
                timeout=120,
                cwd=REPO,
                check=False,
            )
    except Exception as e:  # ip's own words (agent.testing.bed), a timeout, a missing package
        return False, f"cannot build a bed node here: {type(e).__name__}: {e}"
    finally:
        shutil.rmtree(root, ignore_errors=True)
    said = p.stdout.strip().splitlines()
    try:
        facts = json.loads(said[-1])
    except (IndexError, ValueError):
        why = " | ".join((p.stderr.strip() or p.stdout.strip() or "no output").splitlines()[-3:])
        return False, f"a command in a bed node failed (exit {p.returncode}): {why}"
    if facts["missing"]:
        return False, "a bed node (own network and mount namespaces) lacks: " + "; ".join(facts["missing"])
    seen = f"{facts['devices']} /dev/nvidia* files, {facts['gpus']} GPU(s) via NVML, " if gpu else ""
    return True, (
        f"bed: a node (network namespace, veth, bridge, fresh /tmp /dev/shm /run) sees {seen}"
        f"ferry's python and binaries; its /dev/shm has {facts['shm_gib']:g} GiB"
    )


def main(argv: list[str]) -> int:
    if argv not in ([], ["--no-gpu"]):
        print("usage: python -m tests.gpu.bedcheck [--no-gpu]", file=sys.stderr)
        return 2
    ok, line = check(gpu=not argv)
    print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
