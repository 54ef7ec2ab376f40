"""The agent's Prometheus metrics (`ferry agent --metrics-listen`), with the standard client.

Counters and histograms are updated where a migration ends (agent.service.node for the source
side, TargetMigrations.on_end for the target side); jobs, GPU health and staging are read from
their owners at scrape time, so a scrape always shows what is true now. The agent hands over
only those reads (`Sources`), never itself: metrics sit below the composition root.
"""

from __future__ import annotations

import contextlib
import logging
import os
import ssl
from collections.abc import Callable, Iterable, Iterator, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from agent import __version__, client
from agent.errors import InvalidArgumentError
from agent.health.verdicts import GpuHealth, State
from agent.jobs.record import JobRecord, JobState
from agent.migration.model import MigrationResult
from agent.migration.staging import free_bytes

if TYPE_CHECKING:
    from agent.gpus.verify import Verdict
    from agent.snapshots.recover import Recovered
    from agent.tls import Identity
    from ferry.v1.agent_pb2 import SnapshotSet

log = logging.getLogger(__name__)

#: Seconds: from a sub-second post-copy freeze to a many-minute move of a GPU node's memory.
SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300, 600, 1800, float("inf"))


@dataclass(frozen=True)
class Sources:
    """What a scrape reads, each from its owner, at the time of the scrape."""

    jobs: Callable[[], Iterable[JobRecord]]  # the registry's records
    gpus: Callable[[], Iterable[GpuHealth]]  # the health monitor's latest verdicts
    quarantined: Callable[[], Sized]  # the GPUs the quarantine holds
    staging_root: Path


class AgentMetrics:
    """One agent's metrics, in a registry of its own (two agents in one process stay apart)."""

    def __init__(self, node: str, criu_version: str, sources: Sources) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.migrations = Counter(
            "ferry_migrations",
            "Migrations that ended on this node, by its role in them and how they ended",
            ["role", "result"],
            registry=r,
        )
        self.phase = Histogram(
            "ferry_migration_phase_seconds",
            "How long each phase of the migrations this node sent took",
            ["phase"],
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.downtime = Histogram(
            "ferry_migration_downtime_seconds",
            "How long the job made no progress, per migration this node sent (where measured)",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.frozen = Histogram(
            "ferry_migration_frozen_seconds",
            "How long the job was frozen, per migration this node sent",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.moved = Counter(
            "ferry_migration_bytes",
            "Bytes of job state this node sent in migrations that committed: host memory and GPU memory",
            ["kind"],
            registry=r,
        )
        self.snapshot_rounds = Counter(
            "ferry_snapshot_rounds",
            "Snapshot rounds of the groups this agent protects, by how they ended",
            ["group", "result"],
            registry=r,
        )
        self.snapshot_pause = Histogram(
            "ferry_snapshot_group_pause_seconds",
            "Per complete round: from the first member's hold to the last one's release",
            ["group"],
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.snapshot_bytes = Counter(
            "ferry_snapshot_bytes",
            "Bytes of member images that complete rounds stored on buddies",
            ["group"],
            registry=r,
        )
        self.recoveries = Counter(
            "ferry_recoveries",
            "Recoveries of groups whose member's node died, run by this agent, by how they ended",
            ["result"],
            registry=r,
        )
        self.recovery_seconds = Histogram(
            "ferry_recovery_seconds",
            "Per recovery this agent ran: from claiming it to every member going on",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.recovery_lost = Counter(
            "ferry_recovery_lost_seconds",
            "Per recovery this agent ran: the time from the snapshot it went back to until the group "
            "ran again (the work replayed, and the recovery itself)",
            registry=r,
        )
        self.stragglers = Counter(
            "ferry_stragglers",
            "Straggler verdicts against this node's members (a member that held its group back over "
            "the whole window), by group",
            ["group"],
            registry=r,
        )
        self._paced: dict[str, set[str]] = {}  # group → its jobs with a busy share set here
        self.member_busy = Gauge(
            "ferry_member_busy_ratio",
            "Each of this node's group members: the share of the last straggler window its busiest "
            "thread wanted a CPU (ran or waited for one)",
            ["group", "job"],
            registry=r,
        )
        self.selftests = Counter(
            "ferry_gpu_selftests",
            "GPU self-tests run here (before a lease or on the idle schedule), by result: passed, "
            "failed (the GPU is quarantined) or untested (this node cannot run one)",
            ["result"],
            registry=r,
        )
        self.selftest_tflops = Gauge(
            "ferry_gpu_selftest_tflops", "Each GPU's FP32 rate in its last self-test", ["gpu"], registry=r
        )
        self.selftest_gbps = Gauge(
            "ferry_gpu_selftest_memory_gbps",
            "Each GPU's device-memory rate (written and read back) in its last self-test",
            ["gpu"],
            registry=r,
        )
        Info("ferry_build", "This agent's build", registry=r).info(
            {"version": __version__, "node": node, "criu": criu_version}
        )
        r.register(_Now(sources))

    def source_ended(self, result: MigrationResult | None, error: BaseException | None = None) -> None:
        if result is None:
            self.migrations.labels("source", "failed").inc()
            return
        self.migrations.labels("source", "committed").inc()
        for phase, seconds in result.phases.items():
            self.phase.labels(phase).observe(seconds)
        if result.downtime_s >= 0:
            self.downtime.observe(result.downtime_s)
        self.frozen.observe(result.frozen_s)
        self.moved.labels("host").inc(result.host_bytes)
        self.moved.labels("gpu").inc(result.gpu_bytes)

    def snapshot_round(self, group: str, snap: SnapshotSet | None, error: str) -> None:
        """A round of a group this agent protects ended: complete (`snap`) or failed."""
        if snap is None:
            self.snapshot_rounds.labels(group, "failed").inc()
            return
        self.snapshot_rounds.labels(group, "complete").inc()
        self.snapshot_pause.labels(group).observe(snap.group_pause_s)
        self.snapshot_bytes.labels(group).inc(sum(m.bytes for m in snap.members))

    def recovered(self, done: Recovered | None, error: str) -> None:
        """A recovery this agent ran ended: the group goes on (`done`), or it failed."""
        if done is None:
            self.recoveries.labels("failed").inc()
            return
        self.recoveries.labels("recovered").inc()
        self.recovery_seconds.observe(done.times.get("recovery", 0.0))
        self.recovery_lost.inc(done.times.get("lost", 0.0))

    def pace(self, group: str, busy: dict[str, float], straggler: str) -> None:
        """A group's judgement: this node's members' busy shares; `straggler` if one is here
        and its verdict is new."""
        for job in self._paced.get(group, set()) - set(busy):  # gone from here: no stale share
            self.member_busy.remove(group, job)
        self._paced[group] = set(busy)
        for job, share in busy.items():
            self.member_busy.labels(group, job).set(share)
        if straggler:
            self.stragglers.labels(group).inc()

    def selftest(self, v: Verdict) -> None:
        """A GPU's self-test ended (agent.gpus.verify)."""
        self.selftests.labels("failed" if v.problems else "untested" if v.untested else "passed").inc()
        if v.figures is not None:
            self.selftest_tflops.labels(v.uuid).set(v.figures.tflops)
            self.selftest_gbps.labels(v.uuid).set(v.figures.memory_gbps)

    def target_ended(self, result: str) -> None:
        """An incoming migration ran the job here ("committed") or was dropped ("aborted")."""
        self.migrations.labels("target", result).inc()

    def serve(self, address: str, identity: Identity | None) -> Callable[[], None]:
        """Serve /metrics on address: loopback in plain HTTP, any other address only over mutual
        TLS with the agent's certificate (the scraper needs one of the cluster CA's). Returns
        what stops it."""
        from prometheus_client import start_http_server

        host, port = check_listen(address, identity)
        tls: dict[str, Any] = {}
        if not client.is_loopback(host):
            assert identity is not None  # check_listen refuses plain HTTP off loopback
            tls = {
                "certfile": str(identity.cert_path),
                "keyfile": str(identity.key_path),
                "client_cafile": str(identity.directory / "ca.pem"),
                "client_auth_required": True,
                "tls_min_version": ssl.TLSVersion.TLSv1_2,
            }
        try:
            server, thread = start_http_server(port, host, self.registry, **tls)
        except OSError as e:
            raise InvalidArgumentError(
                f"cannot serve metrics on {address}: {e.strerror or e}",
                hint="pick another --metrics-listen",
            ) from e
        self.address = host_port(host, server.server_address[1])
        log.info("metrics on %s://%s/metrics", "https" if tls else "http", self.address)

        def stop() -> None:
            server.shutdown()
            server.server_close()
            thread.join(5)

        return stop


def split_listen(address: str, option: str) -> tuple[str, int]:
    """An address to listen on, `HOST:PORT` or `[V6]:PORT` (port 0: any), as (host, port); anything
    else is named as the option's (`--listen`, `--metrics-listen`), not as an agent's address."""
    host, sep, port = address.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    host = host[1:-1] if bracketed else host
    well_formed = sep and host and (bracketed or ":" not in host) and "[" not in host and "]" not in host
    if not well_formed or not (port.isascii() and port.isdigit() and int(port) < 65536):
        raise InvalidArgumentError(
            f"invalid {option} {address!r}: expected HOST:PORT (an IPv6 address in brackets, "
            "[::1]:PORT; port 0: any free one)"
        )
    return host, int(port)


def check_listen(address: str, identity: Identity | None) -> tuple[str, int]:
    """`--metrics-listen` as (host, port), before the agent starts: malformed, or off loopback
    without the agent's certificate, is refused (exit 2)."""
    host, port = split_listen(address, "--metrics-listen")
    if not client.is_loopback(host) and identity is None:
        raise InvalidArgumentError(
            f"--metrics-listen {address} is not loopback: metrics off loopback are served only "
            "over mutual TLS, and this agent has no certificate (--insecure)",
            hint="serve metrics on 127.0.0.1, or run the agent with --tls-dir",
        )
    return host, port


def host_port(host: str, port: int) -> str:
    """HOST:PORT as a URL or a --listen takes it: an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _dir_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            with contextlib.suppress(OSError):  # removed while we walked: an ended migration
                total += os.lstat(os.path.join(dirpath, f)).st_size
    return total


class _Now(Collector):
    """What is true at scrape time: jobs by state, GPU health and its evidence, staging in use."""

    def __init__(self, sources: Sources) -> None:
        self.sources = sources

    def collect(self) -> Iterator[Any]:
        jobs = GaugeMetricFamily("ferry_jobs", "Jobs this agent has a record of, by state", labels=["state"])
        counts = dict.fromkeys((s.value for s in JobState), 0)
        for rec in self.sources.jobs():
            counts[rec.state.value] += 1
        for state, n in counts.items():
            jobs.add_metric([state], n)
        yield jobs

        health = GaugeMetricFamily(
            "ferry_gpu_health_state",
            "1 for each GPU's current health state (healthy, degraded, failing)",
            labels=["gpu", "index", "state"],
        )
        evidence = GaugeMetricFamily(
            "ferry_gpu_health_evidence",
            "1 for each piece of evidence that holds against a GPU now, by signal and severity",
            labels=["gpu", "signal", "severity"],
        )
        readings = GaugeMetricFamily(
            "ferry_gpu_reading",
            "The latest raw value NVML gave for each GPU reading the health judge uses (counters "
            "such as ECC errors and XIDs as counted by the driver)",
            labels=["gpu", "reading"],
        )
        for g in self.sources.gpus():
            for state in State:
                health.add_metric([g.uuid, str(g.index), state.value], 1 if g.state is state else 0)
            for e in g.evidence:
                evidence.add_metric([g.uuid, e.signal, e.severity.value], 1)
            for name, value in g.readings.items():
                readings.add_metric([g.uuid, name], value)
        yield health
        yield evidence
        yield readings

        quarantined = GaugeMetricFamily(
            "ferry_gpus_quarantined", "GPUs quarantined after a job was moved off them"
        )
        quarantined.add_metric([], len(self.sources.quarantined()))
        yield quarantined

        root = self.sources.staging_root
        staging = GaugeMetricFamily(
            "ferry_staging_bytes", "Bytes of incoming images in this agent's staging area now"
        )
        staging.add_metric([], _dir_bytes(root) if root.is_dir() else 0)
        yield staging
        free = GaugeMetricFamily("ferry_staging_free_bytes", "Free bytes on the staging area's filesystem")
        try:
            free.add_metric([], free_bytes(root))
        except OSError:
            free.add_metric([], 0)
        yield free
