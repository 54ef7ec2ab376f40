"""Text renderings for the CLI: tables, migration summaries, a live progress line, and the words
users see for the API's enums (the same words as the agent's own values, which --json keeps)."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from agent.errors import InvalidArgumentError
from agent.rpc import pb

_STATE = {v: k.removeprefix("JOB_STATE_").lower() for k, v in pb.JobState.items()}
_PHASE = {v: k.removeprefix("PHASE_").lower() for k, v in pb.Phase.items()}


def _words(enum: Any, prefix: str) -> dict[int, str]:
    """Each value's word: its name without the prefix, lower case (PRIORITY_LOW: low)."""
    return {v: k.removeprefix(prefix).lower() for k, v in enum.items() if v}


PRIORITY_WORDS = _words(pb.Priority, "PRIORITY_")
DEGRADED_POLICY_WORDS = _words(pb.OnDegraded, "ON_DEGRADED_")
HEALTH_WORDS = _words(pb.HealthState, "HEALTH_STATE_")
EVENT_KIND_WORDS = _words(pb.EventKind, "EVENT_KIND_")


def _word(words: dict[int, str], number: int) -> str:
    # Unspecified is "" (nothing said, as the empty word was); a number from a newer agent is "?".
    return words.get(number, "?") if number else ""


def priority_word(n: int) -> str:
    return _word(PRIORITY_WORDS, n)


def degraded_policy_word(n: int) -> str:
    return _word(DEGRADED_POLICY_WORDS, n)


def health_word(n: int) -> str:
    return _word(HEALTH_WORDS, n)


def event_kind_word(n: int) -> str:
    return _word(EVENT_KIND_WORDS, n)


def _number(words: dict[int, str], what: str, word: str) -> int:
    for n, w in words.items():
        if w == word:
            return n
    raise InvalidArgumentError(f"unknown {what} {word!r}: expected {' or '.join(words.values())}")


def priority_pb(word: str) -> int:
    """`--priority normal|low` as the request's enum."""
    return _number(PRIORITY_WORDS, "priority", word)


def degraded_policy_pb(word: str) -> int:
    """`--on-degraded migrate|alert` as the request's enum."""
    return _number(DEGRADED_POLICY_WORDS, "on-degraded policy", word)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def printable(text: str) -> str:
    """text on one terminal line: a newline, a tab or an escape sequence (a job's command, a
    note) shown as its escape, never acted on."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def table(headers: list[str], rows: list[list[str]]) -> str:
    rows = [[printable(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()  # noqa: E731
    return "\n".join([line(headers), *(line(r) for r in rows)])


def job_state(job: pb.Job) -> str:
    return _STATE.get(job.state, "?")


def jobs_table(jobs: list[pb.Job]) -> str:
    """One row a job; GROUP, RANK and NODE columns only where a job belongs to a training job."""
    from agent.jobs.launch import exit_words

    grouped = any(j.group for j in jobs)
    rows = []
    for j in jobs:
        state, note = job_state(j), j.note
        if j.state == pb.JOB_STATE_EXITED and j.has_exit_code:
            state += f" ({128 - j.exit_code if j.exit_code < 0 else j.exit_code})"
            if note == f"exited with status {j.exit_code}":  # what the agent says of any status
                note = exit_words(j.exit_code)
        where = f"-> {j.moved_to_node} ({j.moved_to})" if j.state == pb.JOB_STATE_MOVED else note
        member = [j.group or "-", str(j.rank) if j.has_rank else "-", j.node_name] if grouped else []
        rows.append(
            [
                j.name,
                *member,
                state,
                str(j.pid or "-"),
                "-" if not j.kind else pb.JobKind.Name(j.kind).removeprefix("JOB_KIND_").lower(),
                j.address or "-",
                " ".join(j.command)[:48],
                where,
            ]
        )
    head = ["NAME", *(["GROUP", "RANK", "NODE"] if grouped else []), "STATE", "PID", "KIND", "ADDRESS"]
    return table([*head, "COMMAND", "NOTE"], rows) if rows else "no jobs"


def job_dict(job: pb.Job) -> dict[str, Any]:
    return {
        "name": job.name,
        "state": job_state(job),
        "kind": pb.JobKind.Name(job.kind).removeprefix("JOB_KIND_").lower(),
        "pid": job.pid,
        "command": list(job.command),
        "cwd": job.cwd,
        "exit_code": job.exit_code if job.has_exit_code else None,
        "started_at": job.started_at,
        "updated_at": job.updated_at,
        "moved_to": job.moved_to,
        "moved_to_node": job.moved_to_node,
        "migration_id": job.migration_id,
        "checkpoint_dir": job.checkpoint_dir,
        "stdout_path": job.stdout_path,
        "stderr_path": job.stderr_path,
        "node": job.node_name,
        "note": job.note,
        "migrations": job.migrations,
        "priority": priority_word(job.priority_class),
        "on_degraded": degraded_policy_word(job.degraded_policy),
        "gpus": list(job.gpus),
        "address": job.address,
        "group": job.group,
        "rank": job.rank if job.has_rank else None,
    }


def result_dict(r: pb.MigrationResult) -> dict[str, Any]:
    return {
        "migration_id": r.migration_id,
        "job": r.job,
        "source_node": r.source_node,
        "target_node": r.target_node,
        "target": r.target,
        "phases_s": {p.phase: round(p.seconds, 4) for p in r.phases},
        "host_bytes": r.host_bytes,
        "image_bytes": r.image_bytes,
        "gpu_bytes": r.gpu_bytes,
        "frozen_s": round(r.frozen_s, 4),
        "downtime_s": round(r.downtime_s, 4) if r.downtime_s >= 0 else None,
        "downtime_by": r.downtime_by,
        "total_s": round(r.total_s, 4),
        "transfer_gbps": round(r.transfer_gbps, 3),
        "image_dir": r.image_dir,
        "method": r.method,
        # A member of a distributed job: how long its peers were without it (None: not measured,
        # or no member, which group_pause_by "" says).
        "group_pause_s": round(r.group_pause_s, 4) if r.group_pause_by and r.group_pause_s >= 0 else None,
        "group_pause_by": r.group_pause_by,
        "path_mbps": round(r.path_mbps, 1) if r.path_mbps else None,
    }


def summary(r: pb.MigrationResult) -> str:
    lines = []
    if r.target_node:
        lines.append(
            f"job {r.job} moved {r.source_node} -> {r.target_node} ({r.target}) in {r.total_s:.2f} s"
        )
    else:
        lines.append(f"job {r.job} saved to {r.image_dir} in {r.total_s:.2f} s")
    rows = [[p.phase, f"{p.seconds:.3f} s"] for p in r.phases]
    lines.append(table(["PHASE", "TIME"], rows))
    lines.append(
        f"image: {human_bytes(r.image_bytes)} ({human_bytes(r.host_bytes)} host memory, "
        f"{human_bytes(r.gpu_bytes)} GPU memory)"
    )
    if r.transfer_gbps:
        lines.append(f"transfer rate: {r.transfer_gbps:.2f} GB/s")
    if r.path_mbps:
        lines.append(f"path probed before the move: {r.path_mbps:.0f} MB/s")
    if r.target_node:
        if r.method:
            lines.append(f"method: {r.method}")
        lines.append(f"frozen: {r.frozen_s:.3f} s (dump start -> released on the target)")
        down = f"{r.downtime_s:.3f} s" if r.downtime_s >= 0 else "not measured"
        lines.append(f"downtime: {down}" + (f" ({r.downtime_by})" if r.downtime_by else ""))
        if r.group_pause_by:  # a member of a distributed job
            pause = f"{r.group_pause_s:.3f} s" if r.group_pause_s >= 0 else "not measured"
            by = r.group_pause_by.removeprefix("not measured: ")
            lines.append(f"group's pause: {pause} ({by})")
    return "\n".join(lines)


class ProgressLine:
    """One self-rewriting line on a terminal; plain lines per phase otherwise."""

    def __init__(self, out: TextIO = sys.stderr) -> None:
        self.out = out
        self.tty = out.isatty()
        self._last_phase = -1
        self._t0 = time.monotonic()

    def update(self, ev: pb.ProgressEvent) -> None:
        phase = _PHASE.get(ev.phase, "?")
        text = f"[{ev.elapsed_s:6.2f}s] {phase:<9} {ev.message}"
        if ev.bytes_total:
            pct = 100.0 * ev.bytes_done / ev.bytes_total
            rate = ev.bytes_done / max(ev.elapsed_s, 1e-6)
            text += (
                f"  {human_bytes(ev.bytes_done)} / {human_bytes(ev.bytes_total)} ({pct:.0f}%, "
                f"{human_bytes(rate)}/s)"
            )
        if self.tty:
            self.out.write("\r\033[K" + text)
            self.out.flush()
        elif ev.phase != self._last_phase:
            self.out.write(text + "\n")
        self._last_phase = ev.phase

    def close(self) -> None:
        if self.tty:
            self.out.write("\r\033[K")
            self.out.flush()


def gpus_dict(inv: pb.GpuInventory) -> dict[str, Any]:
    return {
        "nvml": {"available": inv.nvml_available, "detail": inv.nvml_detail},
        "driver_version": inv.driver_version,
        "cuda": {
            "loaded": inv.cuda_loaded,
            "checkpoint": inv.cuda_checkpoint,
            "custom_storage": inv.cuda_custom_storage,
            "detail": inv.cuda_detail,
        },
        "gpus": [
            {
                "index": g.index,
                "uuid": g.uuid,
                "name": g.name,
                "memory_total": g.memory_total,
                "memory_used": g.memory_used,
                "memory_free": g.memory_free,
                "persistence": g.persistence,
                "mig": g.mig,
                "processes": [{"pid": p.pid, "used_bytes": p.used_bytes} for p in g.processes],
            }
            for g in inv.gpus
        ],
    }


def gpus_text(inv: pb.GpuInventory) -> str:
    if not inv.nvml_available:
        head = f"no GPUs: {inv.nvml_detail}"
    else:
        head = f"NVIDIA driver {inv.driver_version}, {len(inv.gpus)} GPU(s)"
    cuda = inv.cuda_detail if inv.cuda_loaded else f"CUDA checkpoint unavailable: {inv.cuda_detail}"
    lines = [head, cuda]
    if inv.gpus:
        rows = [
            [
                str(g.index),
                g.uuid,
                g.name + (" (MIG)" if g.mig else ""),
                f"{human_bytes(g.memory_used)} / {human_bytes(g.memory_total)}",
                "on" if g.persistence else "off",
                ", ".join(f"{p.pid} ({human_bytes(p.used_bytes)})" for p in g.processes) or "-",
            ]
            for g in inv.gpus
        ]
        lines.append(table(["GPU", "UUID", "NAME", "MEMORY USED", "PERSISTENCE", "PROCESSES"], rows))
    return "\n".join(lines)


def health_dict(r: pb.HealthReport) -> dict[str, Any]:
    return {
        "node": r.node_name,
        "nvml": {"available": r.nvml_available, "detail": r.nvml_detail},
        "interval_s": r.interval_s,
        "gpus": [
            {
                "index": g.index,
                "uuid": g.uuid,
                "name": g.name,
                "state": health_word(g.health_state),
                "since": g.since,
                "sampled_at": g.sampled_at,
                "evidence": [
                    {
                        "signal": e.signal,
                        "severity": health_word(e.severity_level),
                        "detail": e.detail,
                        "since": e.since,
                    }
                    for e in g.evidence
                ],
                "readings": dict(sorted(g.readings.items())),
                "quarantined": g.quarantined,
                "quarantine_reason": g.quarantine_reason,
                "quarantined_at": g.quarantined_at or None,
                "held_for_incoming_job": g.held,
                "memory_total": g.memory_total,
                "memory_free": g.memory_free,
                "jobs": [
                    {"name": h.job, "priority": priority_word(h.priority_class), "used_bytes": h.used_bytes}
                    for h in g.holders
                ],
                "selftest": selftest_dict(g.selftest) if g.selftest.at else None,
            }
            for g in r.gpus
        ],
    }


def selftest_dict(v: pb.SelfTestVerdict) -> dict[str, Any]:
    return {
        "at": v.at,
        "passed": not v.problems,
        "problems": list(v.problems),
        "untested": v.untested or None,
        "memory_bytes": v.memory_bytes,
        "memory_gbps": v.memory_gbps,
        "tflops": v.tflops,
        "expected_tflops": v.expected_tflops or None,
        "took_s": v.took_s,
    }


def selftest_line(uuid: str, v: pb.SelfTestVerdict) -> str:
    when = f"self-test at {_clock(v.at)}"
    if v.problems:
        return f"  {uuid}: {when} FAILED: {'; '.join(v.problems)}"
    if v.untested:
        return f"  {uuid}: not self-tested ({v.untested}); taken on its NVML state alone"
    expected = f" of {v.expected_tflops:g} expected" if v.expected_tflops else ""
    return (
        f"  {uuid}: {when} passed: {v.memory_bytes / 2**30:.2f} GiB of memory at {v.memory_gbps:.0f} GB/s, "
        f"{v.tflops:.1f} TFLOP/s{expected}"
    )


def health_text(r: pb.HealthReport) -> str:
    if not r.nvml_available:
        return f"node {r.node_name}: no GPU health: {r.nvml_detail}"
    head = f"node {r.node_name}: {len(r.gpus)} GPU(s), sampled every {r.interval_s:.0f} s"
    if r.nvml_detail:
        head += f" ({r.nvml_detail})"
    rows, why, tests = [], [], []
    for g in r.gpus:
        temp = g.readings.get("temperature_c")
        word = health_word(g.health_state)
        state = word.upper() if g.health_state != pb.HEALTH_STATE_HEALTHY else word
        rows.append(
            [
                str(g.index),
                g.uuid,
                g.name,
                state + (" (quarantined)" if g.quarantined else ""),
                f"{temp:.0f} C" if temp is not None else "-",
                ", ".join(
                    h.job + (" (low)" if h.priority_class == pb.PRIORITY_LOW else "") for h in g.holders
                )
                or "-",
            ]
        )
        why += [
            f"  {g.uuid}: {health_word(e.severity_level)}: {e.detail} (since {_clock(e.since)})"
            for e in g.evidence
        ]
        if g.quarantined:
            why.append(
                f"  {g.uuid}: quarantined since {_clock(g.quarantined_at)}: {g.quarantine_reason}; "
                f"`ferry gpus --clear {g.uuid}` once fixed"
            )
        if g.selftest.at:
            tests.append(selftest_line(g.uuid, g.selftest))
    lines = [head, table(["GPU", "UUID", "NAME", "STATE", "TEMP", "JOBS"], rows)]
    if why:
        lines += ["why:", *why]
    if tests:
        lines += ["self-tests:", *tests]
    return "\n".join(lines)


def event_dict(e: pb.Event) -> dict[str, Any]:
    kind = event_kind_word(e.event_kind)
    return {"time": e.time, "kind": kind, "node": e.node, "gpu": e.gpu, "job": e.job, "message": e.message}


def event_line(e: pb.Event) -> str:
    return f"{_clock(e.time, date=True)}  {e.node:<10} {event_kind_word(e.event_kind):<10} {e.message}"


def _clock(t: float, date: bool = False) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S" if date else "%H:%M:%S", time.localtime(t)) if t else "-"
