"""scripts/device-check.sh and its report, as far as a machine without a GPU can check them: the
count of GPU tests that ran (all skipped must fail the check), the refusals before any test, the
bundle's packages, the bed probe, the figures table and the driver facts."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "device-check.sh"


def count_ran(junit: Path) -> int:
    """The script's own tests_run function, sourced from it, on a junit report."""
    fn = subprocess.run(
        ["sed", "-n", "/^tests_run() {/,/^}/p", str(SCRIPT)], capture_output=True, text=True, check=True
    ).stdout
    assert fn, "tests_run is gone from device-check.sh"
    p = subprocess.run(
        ["bash", "-c", f'{fn}\ntests_run "$1"', "bash", str(junit)],
        capture_output=True,
        text=True,
        env={**os.environ, "VPY": sys.executable},
        check=True,
    )
    return int(p.stdout.strip())


def junit(path: Path, tests: int, skipped: int) -> Path:
    path.write_text(
        f'<testsuites><testsuite name="pytest" tests="{tests}" skipped="{skipped}"/></testsuites>'
    )
    return path


def test_all_skipped_counts_as_none_ran(tmp_path: Path) -> None:
    assert count_ran(junit(tmp_path / "j.xml", 9, 9)) == 0
    assert count_ran(tmp_path / "missing.xml") == 0  # pytest killed before it wrote one
    assert count_ran(junit(tmp_path / "k.xml", 9, 2)) == 7


def test_a_run_that_ran_nothing_fails_whatever_pytest_said() -> None:
    text = SCRIPT.read_text()
    assert '(( ran > 0 )) || { echo "device-check: FAILED: no GPU test ran' in text


def test_run_without_a_bundle_says_how_to_make_one(tmp_path: Path) -> None:
    copy = tmp_path / "repo"
    (copy / "scripts").mkdir(parents=True)
    (copy / "scripts" / "device-check.sh").write_bytes(SCRIPT.read_bytes())
    p = subprocess.run(
        ["bash", str(copy / "scripts" / "device-check.sh")], capture_output=True, text=True, timeout=30
    )
    assert p.returncode == 1
    assert "no bundle at .ferry/device: run 'scripts/device-check.sh bundle' first" in p.stderr


def test_not_root_is_refused_first_with_one_line() -> None:
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
    # A copy nobody can read wherever the checkout lives (a root-only home, pytest's 0700 tmp).
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        copy = Path(d) / "scripts" / "device-check.sh"
        copy.parent.mkdir()
        copy.write_bytes(SCRIPT.read_bytes())
        for path in (Path(d), copy.parent):
            path.chmod(0o755)
        copy.chmod(0o644)
        p = subprocess.run([*as_nobody, "bash", str(copy), "run"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1
    said = (p.stdout + p.stderr).strip().splitlines()
    assert said == [said[0]] and said[0].startswith("device-check: STOPPED: not root (euid 65534)")


def test_the_report_prints_each_phase_the_rates_and_the_verdict(tmp_path: Path) -> None:
    figures = tmp_path / "figures.jsonl"
    gib = 1 << 30
    rows = [
        {
            "label": "cuda-counter 1 GiB",
            "gpu": "GPU-a -> GPU-a",
            "bit_identical": True,
            "gpu_bytes": gib,
            "frozen_s": 2.5,
            "downtime_s": 2.7,
            "phases_s": {
                "cuda lock": 0.01,
                "cuda checkpoint": 0.5,
                "dump": 1.0,
                "pages": 0.2,
                "target restore": 0.4,
                "target cuda restore": 0.25,
                "target cuda unlock": 0.001,
            },
        },
        {"label": "pytorch job", "gpu": "x", "bit_identical": False, "gpu_bytes": 0, "phases_s": {}},
        {"label": "managed memory", "note": {"results": [["CUDA_ERROR_NOT_SUPPORTED", "801"]]}},
        {
            "label": "forked DataLoader worker: get-state",
            "note": {
                "fake": "no context",
                "driver": "no context (CUDA_ERROR_INVALID_VALUE (1))",
                "agrees": True,
            },
        },
        {
            "label": "restore thread of a stopped, checkpointed process",
            "note": {
                "fake": "the last thread",
                "driver": "tid 12",
                "agrees": False,
                "threads": {"12": "cuda"},
            },
        },
    ]
    figures.write_text("".join(json.dumps(r) + "\n" for r in rows))
    p = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "device_report.py"), str(figures)],
        capture_output=True,
        text=True,
        check=True,
    )
    lines = p.stdout.splitlines()
    row = next(ln for ln in lines if ln.startswith("cuda-counter 1 GiB"))
    assert "2.1 GB/s" in row  # 1 GiB in 0.5 s, device to host
    assert "4.3 GB/s" in row  # and in 0.25 s back
    assert row.split()[-1] == "yes"
    assert next(ln for ln in lines if ln.startswith("pytorch job")).split()[-1] == "NO"
    assert any("CUDA_ERROR_NOT_SUPPORTED" in ln for ln in lines)
    assert any(ln.startswith("python: ") for ln in lines)
    facts = lines[lines.index("== driver facts (the fake's assumptions)") :]
    assert "forked DataLoader worker: get-state: AGREES" in facts
    at = facts.index("restore thread of a stopped, checkpointed process: DIFFERS")
    assert facts[at + 1 : at + 4] == [
        "  the fake assumes: the last thread",
        "  the driver answered: tid 12",
        '  measured: {"threads": {"12": "cuda"}}',
    ]
    assert not any(ln.startswith("managed memory") for ln in facts[:at])  # not a fact: listed apart


def test_the_report_says_when_nothing_was_measured(tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "device_report.py"), str(tmp_path / "none.jsonl")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "no migration was measured" in p.stdout
    assert "no driver fact was recorded" in p.stdout


def run_preflight(tmp_path: Path, vpy_fails_on: str, **env: str) -> str:
    """The script's own stop_check and preflight functions, with CRIU and Python stand-ins: a
    Python that fails every command containing `vpy_fails_on` and succeeds otherwise."""
    fns = "".join(
        subprocess.run(
            ["sed", "-n", f"/^{name}() {{/,/^}}/p", str(SCRIPT)], capture_output=True, text=True, check=True
        ).stdout
        for name in ("stop_check", "staging_gib", "preflight")
    )
    assert "preflight()" in fns, "preflight is gone from device-check.sh"
    vpy = tmp_path / "python"
    vpy.write_text(
        f'#!/bin/sh\ncase "$*" in *"{vpy_fails_on}"*)\n'
        '  echo "ModuleNotFoundError: no module" >&2; exit 1;;\nesac\necho "probe: ok"\n'
    )
    vpy.chmod(0o755)
    p = subprocess.run(
        [shutil.which("bash") or "/bin/bash", "-c", f"{fns}\npreflight"],  # PATH may be the test's
        capture_output=True,
        text=True,
        env={**os.environ, "VPY": str(vpy), "FERRY_CRIU": "/bin/true", **env},
        timeout=30,
    )
    return p.stdout + p.stderr


def test_preflight_names_missing_cuda_bindings_as_such(tmp_path: Path) -> None:
    out = run_preflight(tmp_path, "import cuda.bindings.driver")
    assert "device-check: STOPPED: cuda-bindings is not importable" in out, out
    assert "no CUDA checkpoint API" not in out


def test_preflight_stops_when_a_bed_nodes_dev_shm_cannot_stage_the_gpu_tests(tmp_path: Path) -> None:
    out = run_preflight(tmp_path, "never", FERRY_DEVICE_SHM_GIB="1000000")
    assert "device-check: STOPPED: a bed node's /dev/shm" in out and "need 1000000 GiB" in out, out
    assert out.strip().splitlines()[-1].startswith("device-check: STOPPED:"), out


def test_preflight_passes_and_says_what_it_found(tmp_path: Path) -> None:
    out = run_preflight(tmp_path, "never", FERRY_DEVICE_SHM_GIB="0")
    assert "STOPPED" not in out, out
    assert re.search(r"^staging: a bed node's /dev/shm can hold \d+ GiB$", out, re.M), out


def test_preflight_stops_when_a_tool_of_the_bed_is_missing(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"  # PATH: ip and unshare only, no nsenter
    bin_dir.mkdir()
    for tool in ("ip", "unshare"):
        (bin_dir / tool).symlink_to("/bin/true")
    out = run_preflight(tmp_path, "never", PATH=str(bin_dir))
    said = out.strip().splitlines()
    assert said[-1].startswith("device-check: STOPPED: the GPU suite runs its jobs on a multi-node bed"), out
    assert "needs nsenter (iproute2, util-linux)" in said[-1], out


def test_preflight_stops_when_a_bed_node_cannot_run_here(tmp_path: Path) -> None:
    out = run_preflight(tmp_path, "tests.gpu.bedcheck")
    stop = "device-check: STOPPED: the GPU suite's multi-node bed cannot run here: ModuleNotFoundError"
    assert stop in out, out
    assert "staging:" not in out


@pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in ("ip", "unshare", "nsenter")),
    reason="a bed node needs root, ip, unshare and nsenter",
)
def test_the_bed_probe_builds_a_node_that_sees_ferrys_python() -> None:
    """tests.gpu.bedcheck for real, less its NVIDIA checks: a node of the bed, with its own
    network and mount namespaces, in which this Python imports ferry and its packages."""
    p = subprocess.run(
        [sys.executable, "-m", "tests.gpu.bedcheck", "--no-gpu"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.startswith("bed: a node (network namespace, veth, bridge"), p.stdout
    assert "ferry's python and binaries" in p.stdout


def bundle_pkgs() -> set[str]:
    text = SCRIPT.read_text()
    m = re.search(r"^PKGS=\((.*?)\)", text, re.M | re.S)
    assert m, "PKGS is gone from device-check.sh"
    return {n.lower().replace("_", "-") for n in m[1].split()}


def test_the_bundle_carries_every_package_the_agent_and_the_gpu_suite_import() -> None:
    """Every third-party module imported anywhere in agent/ or tests/gpu/ comes from a package in
    the bundle's PKGS, but for what the GPU machine has itself (torch, cuda-bindings): an agent that
    cannot import one (prometheus-client, cryptography) would fail every GPU test."""
    carried = bundle_pkgs() | {"torch", "numpy", "cuda-bindings", "cuda-python", "cuda-pathfinder"}
    dists = metadata.packages_distributions()
    missing: dict[str, set[str]] = {}
    for path in [*(REPO / "agent").rglob("*.py"), *(REPO / "tests" / "gpu").glob("*.py")]:
        if "criu_pb" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in {name.split(".")[0] for name in names}:
                if top in sys.stdlib_module_names or top in ("agent", "ferry", "tests", "torch"):
                    continue
                # A namespace (google) may come from several distributions: one carried is enough.
                candidates = {d.lower().replace("_", "-") for d in dists.get(top, [top])}
                if not candidates & carried:
                    missing.setdefault(top, set()).add(str(path.relative_to(REPO)))
    assert not missing, f"imported but not in the bundle's PKGS: {missing}"
