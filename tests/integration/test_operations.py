"""Operating ferry on a cluster: metrics scraped through a real migration, `ferry run --attach`
and `ferry logs --follow` across a move, a stopping agent dropping its staging, a full staging
area named as such, and the systemd unit's command line run as installed by `make install`."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent import certs
from agent.jobs import procs
from agent.testing.bed import node_bed
from agent.testing.localcluster import LocalAgent
from agent.testing.poll import wait_for
from tests.integration.jobtools import wait_state

REPO = Path(__file__).resolve().parents[2]

COUNTER = """\
import sys, time
steps, code = int(sys.argv[1]), int(sys.argv[2])
for i in range(steps):
    print(f"step {i}", flush=True)
    time.sleep(0.1)
print("done", file=sys.stderr, flush=True)
sys.exit(code)
"""


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metric(got: dict, name: str, **labels: str) -> float:
    return got.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
def bed(tmp_path: Path) -> Iterator:
    with node_bed(tmp_path) as b:
        yield b


def client_tls(bed) -> Path:
    """A user's TLS directory (the cluster CA and a client certificate), for the CLI to follow a
    job to another node's agent."""
    d = bed.root / "alice-tls"
    d.mkdir(mode=0o700)
    certs.issue(bed.pki, "alice", certs.Role.CLIENT, [])
    for f in (certs.CA_CERT, "alice.pem", "alice-key.pem"):
        (d / f).write_bytes((bed.pki / f).read_bytes())
    return d


def cli_popen(agent: LocalAgent, *args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    cmd = [*agent.cli_prefix(), *agent.ferry(), args[0], "--agent", f"unix:{agent.socket}", *args[1:]]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=agent.cli_cwd, env=env
    )


def test_attach_and_follow_go_with_the_job_and_metrics_count_the_move(bed) -> None:
    a = bed.node("node-a", start=False)
    b = bed.node("node-b", start=False)
    a.metrics = b.metrics = True
    a.start()
    b.start()
    script = bed.shared / "count.py"
    script.write_text(COUNTER)
    env = {**a.env, "FERRY_TLS_DIR": str(client_tls(bed))}
    before_a, before_b = samples(a.scrape()), samples(b.scrape())
    assert metric(before_a, "ferry_migrations_total", role="source", result="committed") == 0

    attach = cli_popen(
        a, "run", "--attach", "--name", "counter", "--", sys.executable, str(script), "80", "7", env=env
    )
    try:
        started = lambda: attach.poll() is not None or "counter" in a.cli("ps").stdout  # noqa: E731
        wait_for("the attached job to start", started, 60)
        assert attach.poll() is None, attach.communicate()
        a.wait_log("counter", r"^step 5$")
        follow = cli_popen(a, "logs", "counter", "--follow", env=env)
        during = samples(a.scrape())
        assert metric(during, "ferry_jobs", state="running") == 1
        moved = json.loads(a.cli("migrate", "counter", "--to", b.address, "--json").stdout)
        out, err = attach.communicate(timeout=120)
        f_out, f_err = follow.communicate(timeout=60)
    finally:
        for p in (attach, locals().get("follow")):
            if p is not None and p.poll() is None:
                p.kill()

    # The job's exit status, its every line exactly once, and where it went.
    assert attach.returncode == 7, err
    assert out.splitlines() == [f"step {i}" for i in range(80)]
    assert "ferry: job counter moved to node-b (10.98.0.2:7070); following it there" in err
    assert err.rstrip().endswith("done")
    assert follow.returncode == 0, f_err
    assert f_out.splitlines() == [f"step {i}" for i in range(80)]
    assert "moved to node-b (10.98.0.2:7070)" in f_err

    after_a, after_b = samples(a.scrape()), samples(b.scrape())
    assert metric(after_a, "ferry_migrations_total", role="source", result="committed") == 1
    assert metric(after_b, "ferry_migrations_total", role="target", result="committed") == 1
    assert metric(after_a, "ferry_jobs", state="moved") == 1
    assert metric(after_a, "ferry_jobs", state="running") == 0
    assert metric(after_a, "ferry_migration_bytes_total", kind="host") == moved["host_bytes"] > 1 << 20
    dump_count = metric(after_a, "ferry_migration_phase_seconds_count", phase="dump")
    assert dump_count == metric(before_a, "ferry_migration_phase_seconds_count", phase="dump") + 1
    assert metric(after_a, "ferry_migration_frozen_seconds_sum") > 0
    assert metric(after_b, "ferry_jobs", state="exited") == 1
    assert metric(after_b, "ferry_staging_bytes") == 0  # the image left staging once restored


@pytest.fixture
def two(tmp_path: Path) -> Iterator:
    """Two agents on this host's loopback, each with staging of its own; jobs killed at the end."""
    made: list[LocalAgent] = []

    def make(node: str, **kw: object) -> LocalAgent:
        agent = LocalAgent(tmp_path, node, **kw)  # type: ignore[arg-type]
        made.append(agent)
        return agent

    yield make
    for agent in made:
        agent.kill_jobs()
        agent.stop(signal.SIGKILL)
        agent.cleanup()


def hog(tmp_path: Path, mib: int) -> list[str]:
    """A job holding mib MiB of memory that is not all zeros (CRIU would skip zero pages)."""
    script = tmp_path / "hog.py"
    script.write_text(
        "import os, sys, time\n"
        f"data = bytearray(os.urandom(1 << 20) * {mib})\n"
        "print('ready', flush=True)\n"
        "while True:\n    time.sleep(0.2)\n"
    )
    return [sys.executable, str(script)]


def start_hog_move(a: LocalAgent, b: LocalAgent, tmp_path: Path, mib: int) -> subprocess.Popen[str]:
    """A job holding mib MiB on a, and `ferry migrate --pre-copy` of it to b, in the background."""
    a.cli("run", "--name", "hog", "--", *hog(tmp_path, mib))
    wait_for("the job to start", lambda: "ready" in a.cli("logs", "hog").stdout, 60)
    return subprocess.Popen(
        [*a.ferry(), "migrate", "hog", "--agent", f"unix:{a.socket}", "--to", b.address, "--pre-copy"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=a.env,
    )


def test_a_stopping_agent_drops_the_staging_of_an_image_waiting_for_its_commit(two, tmp_path: Path) -> None:
    a = two("node-a", env={"FERRY_PAUSE": "commit=60"}).start()
    b = two("node-b").start()
    mover = start_hog_move(a, b, tmp_path, 64)
    try:
        # The source pauses before its commit: the whole image waits in the target's staging.
        staged = lambda: sum(f.stat().st_size for f in b.staging_dir.rglob("*") if f.is_file())  # noqa: E731
        wait_for("the image in the target's staging", lambda: staged() > 64 << 20, 60)
        assert b.stop() == 0
        assert staged() == 0, sorted(b.staging_dir.rglob("*"))
        assert "dropped 1 incoming migration(s) that had not begun to restore" in b.log_path.read_text()
    finally:
        mover.kill()
        mover.wait()


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m,mode=0700", "tmpfs", str(mnt)], check=True)
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_staging_area_that_fills_during_the_transfer_is_named_as_full(two, tmp_path, small_tmpfs) -> None:
    a = two("node-a", env={"FERRY_PAUSE": "dump=5"}).start()
    b = two("node-b", staging_dir=small_tmpfs / "staging").start()
    mover = start_hog_move(a, b, tmp_path, 96)
    # Space was there when the lease was granted; something else takes it before the dump.
    wait_for("the target's lease", lambda: "lease granted" in b.log_path.read_text(), 60)
    free = os.statvfs(small_tmpfs).f_bfree * os.statvfs(small_tmpfs).f_frsize
    with open(small_tmpfs / "filler", "wb") as f:
        f.truncate(0)
        f.write(b"\1" * (free - (8 << 20)))
    _, err = mover.communicate(timeout=180)
    assert mover.returncode == 1
    assert "no space left in the staging area" in err and str(small_tmpfs / "staging") in err, err
    assert "--staging-dir" in err
    assert wait_state(a, "hog", "running")["state"] == "running"


# -- the systemd unit, as `make install` puts it on a node ---------------------------------


def unit_command(unit: Path, env: dict[str, str]) -> list[str]:
    """ExecStart, expanded as systemd would: ${NAME} (one word each) and %H."""
    text = unit.read_text().replace("\\\n", " ")
    line = next(v for v in text.splitlines() if v.startswith("ExecStart="))
    words = shlex.split(line.removeprefix("ExecStart="))
    return [re.sub(r"\$\{(\w+)\}", lambda m: env[m[1]], w).replace("%H", os.uname().nodename) for w in words]


def unit_defaults(unit: Path) -> dict[str, str]:
    pairs = [
        v.removeprefix("Environment=") for v in unit.read_text().splitlines() if v.startswith("Environment=")
    ]
    return dict(p.split("=", 1) for p in pairs)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    prefix = tmp_path_factory.mktemp("opt") / "ferry"
    units = prefix.parent / "units"
    p = subprocess.run(
        ["make", "-C", str(REPO), "install", f"PREFIX={prefix}", f"UNIT_DIR={units}"],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return prefix


def test_make_install_puts_ferry_and_its_unit_on_the_node(installed: Path) -> None:
    unit = installed.parent / "units" / "ferry-agent.service"
    text = unit.read_text()
    assert f"ExecStart={installed}/bin/ferry agent" in text and "@PREFIX@" not in text
    for f in ("bin/ferry", "bin/ferry-init", "criu/bin/criu"):
        assert os.access(installed / f, os.X_OK), f
    assert (installed / "share/ferry/kubernetes.yaml").is_file()
    assert (installed / "share/doc/ferry/operations.md").is_file()
    p = subprocess.run(
        [installed / "bin/ferry", "doctor"], capture_output=True, text=True, timeout=120, check=False
    )
    assert f"{installed}/criu/bin/criu" in p.stdout, p.stdout
    verify = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    problems = [line for line in verify.stderr.splitlines() if "ferry-agent.service" in line]
    assert problems == [], verify.stderr


def test_the_units_command_line_runs_an_agent(installed: Path, tmp_path: Path) -> None:
    unit = installed / "share/ferry/ferry-agent.service"
    node = os.uname().nodename
    conf, state, run = tmp_path / "etc", tmp_path / "state", Path(f"/tmp/ferry-unit-{os.getpid()}")
    certs.create_ca(conf / "tls")
    certs.issue(conf / "tls", node, certs.Role.NODE, ["127.0.0.1"])
    (conf / "tls" / "ca-key.pem").unlink()  # stays on the admin machine
    run.mkdir(mode=0o700)
    env = unit_defaults(unit) | {
        # What /etc/ferry/agent.env would say on a node, and the directories systemd makes.
        "FERRY_LISTEN": "127.0.0.1:0",
        "FERRY_METRICS_LISTEN": "127.0.0.1:0",
        "FERRY_STAGING_DIR": str(tmp_path / "staging"),
        "STATE_DIRECTORY": str(state),
        "CONFIGURATION_DIRECTORY": str(conf),
        "RUNTIME_DIRECTORY": str(run),
    }
    argv = unit_command(unit, env)
    log = tmp_path / "agent.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={"PATH": "/usr/bin:/bin"})
    try:
        wait_for("the agent to listen", lambda: "listening on" in log.read_text(), 60)
        m = re.search(r"metrics on ([0-9.:]+)/metrics", log.read_text())
        assert m, log.read_text()
        ferry = [str(installed / "bin/ferry")]
        sock = ["--agent", f"unix:{run}/agent.sock"]

        def cli(*args: str) -> str:
            p = subprocess.run([*ferry, *args], capture_output=True, text=True, timeout=60, check=False)
            assert p.returncode == 0, p.stderr
            return p.stdout

        cli("run", *sock, "--name", "sleeper", "--", "/bin/sleep", "600")
        (job,) = json.loads(cli("ps", *sock, "--json"))
        assert (job["name"], job["state"]) == ("sleeper", "running")
        import urllib.request

        with urllib.request.urlopen(f"http://{m[1]}/metrics", timeout=10) as r:
            assert "ferry_build_info{" in r.read().decode()
        proc.send_signal(signal.SIGTERM)  # what KillMode=process sends the agent alone
        assert proc.wait(60) == 0, log.read_text()
        assert not (run / "agent.sock").exists()
        assert procs.alive(job["pid"])  # the job outlives its agent, as the unit intends
    finally:
        if proc.poll() is None:
            proc.kill()
        with contextlib.suppress(NameError, ProcessLookupError):
            os.kill(job["pid"], signal.SIGKILL)
        subprocess.run(["rm", "-rf", str(run)], check=False)
