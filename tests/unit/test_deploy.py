"""The deployment files: the Kubernetes manifest against the Kubernetes API schemas (with
kubernetes-validate) and the systemd unit, each checked against ferry's own argument parser;
and what `make install` puts on a node (scripts/install.sh): ferry without its test doubles."""

from __future__ import annotations

import copy
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from agent.cli.parser import build_parser

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "scripts" / "deploy"
#: The oldest Kubernetes still in wide use, and the newest the validator knows.
VERSIONS = ("1.29.0", kubernetes_validate.latest_version())


def manifest() -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / "kubernetes.yaml").read_text()) if d]


def by_kind(kind: str) -> dict:
    return next(d for d in manifest() if d["kind"] == kind)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_resource_is_valid_against_the_kubernetes_schemas(version: str) -> None:
    docs = manifest()
    assert [d["kind"] for d in docs] == ["Namespace", "DaemonSet", "Service"]
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_rejects_a_misspelt_field() -> None:
    # The check above can fail: strict validation refuses a field the API does not have.
    ds = copy.deepcopy(by_kind("DaemonSet"))
    ds["spec"]["template"]["spec"]["hostPid"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, VERSIONS[-1], strict=True)


def test_the_daemonset_gives_the_agent_what_criu_needs() -> None:
    pod = by_kind("DaemonSet")["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
    assert pod["hostPID"] and pod["hostNetwork"] and agent["securityContext"]["privileged"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    mounts = {m["name"]: m["mountPath"] for m in agent["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts == {"state": "/var/lib/ferry", "run": "/run/ferry", "dev": "/dev", "tls": "/etc/ferry/tls"}
    assert volumes["dev"]["hostPath"]["path"] == "/dev"
    assert volumes["state"]["hostPath"]["path"] == "/var/lib/ferry"
    assert volumes["tls"]["secret"]["secretName"] == "ferry-tls"
    assert pod["terminationGracePeriodSeconds"] > 600  # the agent's wait for moves in flight


def test_the_daemonsets_command_is_one_ferry_accepts() -> None:
    (agent,) = by_kind("DaemonSet")["spec"]["template"]["spec"]["containers"]
    argv = [a.replace("$(FERRY_NODE_NAME)", "gpu-node-1") for a in agent["command"][1:]]
    args = build_parser().parse_args(argv)
    assert (args.cmd, args.listen, args.node_name) == ("agent", "0.0.0.0:7070", "gpu-node-1")
    assert str(args.staging_dir) == "/dev/shm/ferry/gpu-node-1"
    ports = {p["name"]: p["containerPort"] for p in agent["ports"]}
    assert args.metrics_listen == f"0.0.0.0:{ports['metrics']}"
    assert args.listen.endswith(f":{ports['grpc']}")


def test_the_metrics_service_selects_the_agents() -> None:
    svc, ds = by_kind("Service"), by_kind("DaemonSet")
    assert svc["spec"]["selector"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    assert svc["spec"]["ports"][0]["targetPort"] == "metrics"


def unit() -> dict[str, list[str]]:
    """The unit's [Service] settings (a setting given twice keeps both), continuations joined."""
    text = (DEPLOY / "ferry-agent.service").read_text().replace("\\\n", " ")
    out: dict[str, list[str]] = {}
    section = ""
    for line in text.splitlines():
        if m := re.fullmatch(r"\[(\w+)\]", line.strip()):
            section = m[1]
        elif section == "Service" and "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def expand(word: str, env: dict[str, str]) -> str:
    """systemd's ${NAME} (one word) and %H (the host name) in an ExecStart word."""
    return re.sub(r"\$\{(\w+)\}", lambda m: env[m[1]], word).replace("%H", "gpu-node-1")


def unit_env(settings: dict[str, list[str]], **dirs: str) -> dict[str, str]:
    env = dict(v.split("=", 1) for v in settings["Environment"])
    return {k: expand(v, {}) for k, v in env.items()} | dirs


def test_the_unit_leaves_jobs_running_when_the_agent_stops() -> None:
    s = unit()
    assert s["KillMode"] == ["process"]
    assert s["RuntimeDirectoryPreserve"] == ["yes"]
    assert int(s["TimeoutStopSec"][0]) > 600
    assert s["Restart"] == ["on-failure"] and s["RestartPreventExitStatus"] == ["2"]


def test_the_units_command_line_is_one_ferry_accepts() -> None:
    s = unit()
    env = unit_env(
        s,
        STATE_DIRECTORY="/var/lib/ferry",
        CONFIGURATION_DIRECTORY="/etc/ferry",
        RUNTIME_DIRECTORY="/run/ferry",
    )
    argv = [expand(w, env) for w in shlex.split(s["ExecStart"][0])]
    assert argv[0] == "@PREFIX@/bin/ferry"
    args = build_parser().parse_args(argv[1:])
    assert (args.listen, args.node_name, str(args.state_dir)) == (
        "0.0.0.0:7070",
        "gpu-node-1",
        "/var/lib/ferry",
    )
    assert (str(args.tls_dir), args.socket) == ("/etc/ferry/tls", "/run/ferry/agent.sock")
    assert args.metrics_listen == "127.0.0.1:9478"


# -- what the install ships ----------------------------------------------------------------------


def install_sources() -> list[str]:
    """What scripts/install.sh copies out of the checkout to build ferry from (its one `cp -r`)."""
    script = (REPO / "scripts" / "install.sh").read_text()
    (line,) = [ln for ln in script.splitlines() if ln.startswith('cp -r "$REPO/')]
    words = shlex.split(line)
    assert words[-1] == "$SRC/", line
    return [w.removeprefix("$REPO/") for w in words[2:-1]]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Path]:
    """The wheel install.sh builds (from its copy, with this pyproject.toml), offline: its file
    names, and the directory it unpacks to (what a node's venv gets)."""
    if not (REPO / "ferry" / "v1" / "agent_pb2.py").exists():
        pytest.skip("the generated stubs are missing: run `make proto`")
    tmp = tmp_path_factory.mktemp("install")
    src, out, site = tmp / "src", tmp / "wheel", tmp / "site"
    src.mkdir()
    for name in install_sources():
        copy_ = shutil.copytree if (REPO / name).is_dir() else shutil.copy2
        copy_(REPO / name, src / name)
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
    subprocess.run([*pip, "-w", str(out), str(src)], check=True, capture_output=True, timeout=120)
    (wheel,) = out.glob("ferry-*.whl")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
        return z.namelist(), site


def test_the_install_ships_every_product_module_and_no_test_double(installed) -> None:
    names, _ = installed
    shipped = {n for n in names if n.startswith("agent/") and n.endswith(".py")}
    product = {
        p.relative_to(REPO).as_posix()
        for p in (REPO / "agent").rglob("*.py")
        if "__pycache__" not in p.parts and p.parts[len(REPO.parts) + 1] != "testing"
    }
    assert not {n for n in shipped if n.startswith("agent/testing/")}
    assert shipped == product


def test_the_installed_agent_runs_without_the_checkouts_doubles(installed) -> None:
    """Every module of the install imports from it alone, and agent.testing (with the NVML
    switch and `python -m agent.testing.agent`) is not there to import."""
    _, site = installed
    check = f"""
import importlib, importlib.util, pkgutil, sys
sys.path.insert(0, {str(site)!r})  # before the checkout, which this venv's editable install adds
import agent
assert agent.__path__ == [{str(site / "agent")!r}], agent.__path__
for m in pkgutil.walk_packages(agent.__path__, "agent."):
    importlib.import_module(m.name)
assert importlib.util.find_spec("agent.testing") is None
assert not hasattr(importlib.import_module("agent.gpus.inventory"), "use_nvml")
"""
    done = subprocess.run(
        [sys.executable, "-I", "-c", check], capture_output=True, text=True, timeout=120, cwd=site
    )
    assert done.returncode == 0, done.stderr
