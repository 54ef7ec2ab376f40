"""The agent's Prometheus metrics (agent.service.metrics), scraped over HTTP from an in-process agent."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

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
