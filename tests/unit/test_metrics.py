"""The agent's Prometheus metrics (agent.service.metrics), scraped over HTTP from an in-process agent."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent import tls
from agent.certs import Role
from agent.errors import InvalidArgumentError
from agent.jobs.record import JobKind, JobRecord, JobState
from agent.migration.model import MigrationResult


def scrape(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.fixture
def served(agent) -> Iterator[tuple[object, str]]:
    svc = agent[0]
    stop = svc.metrics.serve("127.0.0.1:0", None)
    yield svc, svc.metrics.address
    stop()


def test_build_info_and_jobs_by_state(served) -> None:
    svc, address = served
    svc.registry.save(
        JobRecord(name="a", kind=JobKind.LAUNCHED, state=JobState.MOVED, pid=1, command=["x"], cwd="/")
    )
    got = scrape(address)
    build = next(labels for (name, labels) in got if name == "ferry_build_info")
    assert ("node", "nodea") in build and any(k == "version" for k, _ in build)
    assert got[("ferry_jobs", (("state", "moved"),))] == 1
    assert got[("ferry_jobs", (("state", "running"),))] == 0
    assert got[("ferry_staging_bytes", ())] == 0


def test_a_migration_ending_moves_the_counters_and_histograms(served) -> None:
    svc, address = served
    result = MigrationResult(
        "m1",
        "train",
        "nodea",
        phases={"dump": 1.5, "restore": 0.3},
        host_bytes=1000,
        frozen_s=0.4,
        downtime_s=0.6,
    )
    svc.metrics.source_ended(result)
    svc.metrics.source_ended(None)
    svc.metrics.target_ended("aborted")
    got = scrape(address)
    assert got[("ferry_migrations_total", (("result", "committed"), ("role", "source")))] == 1
    assert got[("ferry_migrations_total", (("result", "failed"), ("role", "source")))] == 1
    assert got[("ferry_migrations_total", (("result", "aborted"), ("role", "target")))] == 1
    assert got[("ferry_migration_phase_seconds_sum", (("phase", "dump"),))] == 1.5
    assert got[("ferry_migration_phase_seconds_count", (("phase", "restore"),))] == 1
    assert got[("ferry_migration_downtime_seconds_bucket", (("le", "1.0"),))] == 1
    assert got[("ferry_migration_downtime_seconds_bucket", (("le", "0.5"),))] == 0
    assert got[("ferry_migration_bytes_total", (("kind", "host"),))] == 1000


def test_an_unmeasured_downtime_is_not_observed(served) -> None:
    svc, address = served
    svc.metrics.source_ended(MigrationResult("m1", "train", "nodea", downtime_s=-1.0))
    assert scrape(address)[("ferry_migration_downtime_seconds_count", ())] == 0


def test_metrics_off_loopback_need_the_agents_certificate(agent) -> None:
    with pytest.raises(InvalidArgumentError, match="only over mutual TLS"):
        agent[0].metrics.serve("0.0.0.0:0", None)


def test_a_taken_metrics_port_is_named(served, agent) -> None:
    _, address = served
    with pytest.raises(
        InvalidArgumentError, match=f"cannot serve metrics on {address}: Address already in use"
    ):
        agent[0].metrics.serve(address, None)


#: The prometheus-client release that added each keyword the agent gives start_http_server
#: (its changelog: TLS in 0.19.0, #946; tls_min_version and tls_max_version in 0.26.0, #1178).
_KEYWORD_SINCE = {
    "certfile": (0, 19, 0),
    "keyfile": (0, 19, 0),
    "client_cafile": (0, 19, 0),
    "client_auth_required": (0, 19, 0),
    "tls_min_version": (0, 26, 0),
}


def test_the_prometheus_client_floor_has_every_keyword_the_agent_passes(
    agent, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An install at pyproject's floor must accept what metrics.serve passes, or `--metrics-listen`
    fails with a TypeError at start on a node that resolved the oldest allowed release."""
    import prometheus_client

    passed: dict[str, Any] = {}

    def start(port: int, addr: str, registry: object, **kw: Any) -> None:
        passed.update(kw)
        raise OSError(98, "stop here")

    monkeypatch.setattr(prometheus_client, "start_http_server", start)
    ident = tls.Identity("nodea", Role.NODE, b"", b"", b"", tmp_path, tmp_path / "c.pem", tmp_path / "k.pem")
    with pytest.raises(InvalidArgumentError):
        agent[0].metrics.serve("10.0.0.1:0", ident)
    assert passed, "metrics.serve no longer passes TLS keywords: this test has nothing to check"
    unknown = sorted(set(passed) - set(_KEYWORD_SINCE))
    assert not unknown, f"say in _KEYWORD_SINCE which prometheus-client release added {unknown}"
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    m = re.search(r'"prometheus-client>=([0-9.]+)"', pyproject)
    assert m, "pyproject.toml no longer gives prometheus-client a floor"
    floor = tuple(int(x) for x in m.group(1).split("."))
    floor = floor + (0,) * (3 - len(floor))
    needed = max(_KEYWORD_SINCE[k] for k in passed)
    assert floor >= needed, f"prometheus-client>={m.group(1)}, but {sorted(passed)} need {needed}"


def test_metrics_read_only_what_they_are_given(tmp_path: Path) -> None:
    """No agent here: AgentMetrics takes the node's name, CRIU's version and read callables
    (metrics.Sources), so it needs nothing else of the node, and reads them at each scrape."""
    from prometheus_client import generate_latest

    from agent.health.verdicts import Evidence, GpuHealth, State
    from agent.service.metrics import AgentMetrics, Sources

    jobs: list[JobRecord] = []
    hot = Evidence("temperature", State.DEGRADED, "91 C >= 90 C", 0.0)
    gpu = GpuHealth("GPU-x", 0, "X", State.DEGRADED, (hot,), 0.0, 0.0, {"temperature_c": 91}, 1, 0, 1)
    (tmp_path / "in-m1").mkdir()
    (tmp_path / "in-m1" / "pages-1.img").write_bytes(b"x" * 100)
    metrics = AgentMetrics(
        "nodez", "4.2.1", Sources(lambda: jobs, lambda: [gpu], lambda: {"GPU-x": object()}, tmp_path)
    )

    def now() -> dict[str, float]:
        """Each sample as `name{label=value,...}`, labels sorted."""
        text = generate_latest(metrics.registry).decode()
        return {
            s.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}": s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    got = now()
    build = next(k for k in got if k.startswith("ferry_build_info{"))
    assert "criu=4.2.1" in build and "node=nodez" in build
    assert got["ferry_jobs{state=running}"] == 0
    assert got["ferry_gpu_health_state{gpu=GPU-x,index=0,state=degraded}"] == 1
    assert got["ferry_gpu_health_evidence{gpu=GPU-x,severity=degraded,signal=temperature}"] == 1
    assert got["ferry_gpus_quarantined{}"] == 1
    assert got["ferry_staging_bytes{}"] == 100
    jobs.append(
        JobRecord(name="a", kind=JobKind.LAUNCHED, state=JobState.RUNNING, pid=1, command=["x"], cwd="/")
    )
    assert now()["ferry_jobs{state=running}"] == 1  # read again at this scrape


def test_snapshot_rounds_and_recoveries_are_counted(served) -> None:
    from agent.rpc import pb
    from agent.snapshots.recover import Recovered

    svc, address = served
    snap = pb.SnapshotSet(epoch=3, group_pause_s=1.2, members=[pb.MemberCopy(job="r0", bytes=1000)])
    svc.metrics.snapshot_round("llm", snap, "")
    svc.metrics.snapshot_round("llm", None, "node-b did not answer")
    svc.metrics.recovered(Recovered("llm", 3, times={"recovery": 3.5, "lost": 20.0}), "")
    svc.metrics.recovered(None, "no spare")
    got = scrape(address)
    assert got[("ferry_snapshot_rounds_total", (("group", "llm"), ("result", "complete")))] == 1
    assert got[("ferry_snapshot_rounds_total", (("group", "llm"), ("result", "failed")))] == 1
    assert got[("ferry_snapshot_group_pause_seconds_sum", (("group", "llm"),))] == pytest.approx(1.2)
    assert got[("ferry_snapshot_bytes_total", (("group", "llm"),))] == 1000
    assert got[("ferry_recoveries_total", (("result", "recovered"),))] == 1
    assert got[("ferry_recoveries_total", (("result", "failed"),))] == 1
    assert got[("ferry_recovery_seconds_sum", ())] == pytest.approx(3.5)
    assert got[("ferry_recovery_lost_seconds_total", ())] == 20.0
