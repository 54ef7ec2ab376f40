"""scripts/device-check.sh and its report, as far as a machine without a GPU can check them: the
count of GPU tests that ran (all skipped must fail the check), the refusals before any test, and
the figures table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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


def test_not_root_is_refused_first_with_one_line(tmp_path: Path) -> None:
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
    p = subprocess.run([*as_nobody, "bash", str(SCRIPT), "run"], capture_output=True, text=True, timeout=60)
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


def test_the_report_says_when_nothing_was_measured(tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "device_report.py"), str(tmp_path / "none.jsonl")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "no migration was measured" in p.stdout


def run_preflight(tmp_path: Path, vpy_fails_on: str, **env: str) -> str:
    """The script's own stop_check and preflight functions, with CRIU and Python stand-ins: a
    Python that fails every command containing `vpy_fails_on` and succeeds otherwise."""
    fns = "".join(
        subprocess.run(
            ["sed", "-n", f"/^{name}() {{/,/^}}/p", str(SCRIPT)], capture_output=True, text=True, check=True
        ).stdout
        for name in ("stop_check", "preflight")
    )
    assert "preflight()" in fns, "preflight is gone from device-check.sh"
    vpy = tmp_path / "python"
    vpy.write_text(
        f'#!/bin/sh\ncase "$*" in *"{vpy_fails_on}"*)\n'
        '  echo "ModuleNotFoundError: no module" >&2; exit 1;;\nesac\necho "probe: ok"\n'
    )
    vpy.chmod(0o755)
    p = subprocess.run(
        ["bash", "-c", f"{fns}\npreflight"],
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


def test_preflight_stops_when_dev_shm_cannot_stage_the_gpu_tests(tmp_path: Path) -> None:
    out = run_preflight(tmp_path, "never", FERRY_DEVICE_SHM_GIB="1000000")
    assert "device-check: STOPPED: /dev/shm has" in out and "need 1000000 GiB" in out, out
