"""`make bench`, group snapshots: what protecting a training job costs it (issue 29).

On the multi-node bed (agent/testing/bed.py: network and mount namespaces, real agents over
mutual TLS), a 3-rank gloo DDP job (scripts/workloads/train_ddp.py, one rank per node on
node-a, node-b and node-c) runs twice for each size in --sizes, the MiB of live state
(--ballast-mb) each member holds:

  undisturbed   nothing happens: its wall time (rank 0's first step to its last) is the reference
  protected     at step --on-at, node-a's agent protects the group (`ferry protect --every
                --members-on` over the three agents): a round holds every member, dumps each,
                releases them all together, then ships each image to another node's memory; at
                step --off-at, `ferry protect --off` (the round in progress still completes)

While each run trains, `ferry snapshot GROUP --last --json` is polled on node-a about every
0.3 s, in both runs so that the two carry the same load: in the protected run each new epoch's
set is recorded (the group's pause, each member's frozen time and image bytes, when the members
were released). Per size it prints each member's pause per snapshot (median and max of its
frozen time over the rounds), the group's pause, the image bytes per member, and, for each
round, the peers' pause in their own logs (the longest step gap of any rank within [released -
group pause - 1 s, released + 2 s], minus the rank's median step, which a pause does not
remove), checked against issue 29's target: at most the group's pause + 0.5 s.

Steady-state overhead: what each round cost the job, from rank 0's own step stamps (from
just before the round froze it to just before the next round did, the time its steps took
less what they take in the undisturbed run), averaged over the rounds after the first
WARM_ROUNDS (2), which touch memory the node never used (this VM's first touch runs at 0.3
GB/s); at the agent's default interval ([snapshots] every_s, 300 s) the overhead is that cost
/ 300 s, and the target is at most 2 % of the undisturbed run's wall time (PASS/FAIL). The
protected run's extra wall time divided by all its rounds is printed beside it, and the
overhead at --every for reference. A missed target is reported, not an error. Each run must
end with the undisturbed run's final digest on every rank, bit for bit: a snapshot must not
change the training.

Recovery (after the snapshot case, for each size; --recovery-only: alone, after an undisturbed
reference run of each size; --no-recovery: skipped), on a bed of its own per size (a powered-off
node does not come back, and a claimed spare stays claimed): etcd, node-a/b/c with test timings
(a 3 s lease, `[snapshots] hold_s = 10`) listing node-d as their `[[peers]] spare`. node-a
protects the 3-rank job through etcd (`ferry protect --every`, no --members-on); 4 steps after
the first complete round, node-b is powered off (`bed.power_off`: agent and rank SIGKILLed, link
deleted). From the kill it prints detection (to the first "is lost" alert in `ferry events` on
node-a or node-c), the recovery (that alert to the "recovered from snapshot round" event, with
ferry's own spare claim, fetch, end and restore), the release (that event to every rank's first
step after the kill, the latest) and the total (kill to every rank stepping again; rank 1's log
is on node-d), against the target: at most 10 s at 256 MiB per member (PASS/FAIL). The job must
end with the undisturbed run's digests, bit for bit; the steps replayed since the snapshot are
the work lost.

Lost time per hard failure: the recovered run's wall time minus the undisturbed run's, then less
its rounds (each at the protected run's cost per round; with --recovery-only, estimated as the
group's pause), which leaves the replayed steps and a fixed part. Checkpoint-restart is measured
with bench_ranks' own machinery (Runs.restart, on the same bed): every rank ends where node-b
died and all restart from a checkpoint written at the snapshot's step. Both are then modelled at
this bench's interval and at realistic ones (ferry every [snapshots] every_s, checkpoint-restart
every --interval-min: restart + half an interval recomputed), and goodput is projected with
bench_ranks.project for 1,024 and 16,384 GPUs (MTTF 7.9 h and 1.8 h), ferry's including its
overhead at the default interval.

Writes the figures to bench-results/snapshots.json. Needs root, CRIU (`make criu`), `ip` and,
for the recovery case, etcd (`make etcd`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
for _p in (REPO, SCRIPTS):  # the agent package, and bench_ranks beside this file
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from bench_ranks import (  # noqa: E402
    DIGEST,
    LOSS,
    PAUSE_SLACK_S,
    BenchError,
    Progress,
    median_step,
    pause_target,
    project,
    require_criu,
    wall_s,
)
from bench_ranks import Runs as RanksRuns  # noqa: E402

OUT = Path("bench-results") / "snapshots.json"
NODES = ("node-a", "node-b", "node-c")
#: Issue 29's target: at the default interval, protection adds at most this share of wall time.
OVERHEAD_TARGET = 0.02
POLL_S = 0.3
#: After the job ends, how long the round that was in progress at `--off` may take to complete.
SETTLE_S = 180.0
#: Live state, staged images and the buddies' copies (the previous round's is kept until the
#: new one is recorded): about this many times a member's image, in memory (tmpfs).
MEMORY_FACTOR = 4
#: A member's image beyond its ballast: the Python and torch process itself (about 220 MiB).
BASE_MIB = 256
#: The recovery target: every rank stepping again this long after the kill, at this size.
RECOVERY_TARGET_S = 10.0
RECOVERY_TARGET_MIB = 256
#: node-d, the 4th node the recovery bed creates (10.98.0.N): the spare node-a/b/c list.
SPARE = "10.98.0.4:7070"
#: Steps rank 0 takes after the first complete snapshot is seen before node-b dies.
KILL_AFTER_STEPS = 4
#: train_ddp.py's default width, which the snapshot runs use: bench_ranks' restart passes it.
TRAIN_HIDDEN = 64
RECOVERED = re.compile(
    r"recovered from snapshot round (\d+) in ([\d.]+) s \(spare claimed ([\d.]+) s, images "
    r"fetched ([\d.]+) s, old copies ended ([\d.]+) s, restored ([\d.]+) s\)"
)
STEPPED = re.compile(r"^step (\d+) .* at (\d+\.\d+)$", re.M)


# -- pure parts: the sets, the pauses, the overhead ----------------------------------------


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise BenchError(f"--sizes {text!r}: give MiB per member as integers, e.g. 256,1024") from None
    if not sizes or any(s <= 0 for s in sizes):
        raise BenchError(f"--sizes {text!r}: give at least one size, each above 0 MiB")
    return sizes


def snapshot_set(last: dict[str, Any]) -> dict[str, Any]:
    """The figures of one set from `ferry snapshot --last --json` (its uint64s come as strings)."""
    return {
        "epoch": int(last.get("epoch", 0)),
        "taken_at": float(last.get("taken_at", 0.0)),
        "group_pause_s": float(last.get("group_pause_s", 0.0)),
        "members": [
            {
                "job": m["job"],
                "rank": m.get("rank", ""),
                "node": m.get("node", ""),
                "buddy_node": m.get("buddy_node", ""),
                "frozen_s": float(m.get("frozen_s", 0.0)),
                "bytes": int(m.get("bytes", 0)),
            }
            for m in last.get("members", [])
        ],
    }


def member_stats(sets: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per member (by job name, in rank order): median and max frozen time, median image bytes."""
    by_job: dict[str, list[dict[str, Any]]] = {}
    for s in sets:
        for m in s["members"]:
            by_job.setdefault(m["job"], []).append(m)
    out = []
    for job, ms in sorted(by_job.items()):
        frozen = [m["frozen_s"] for m in ms]
        out.append(
            {
                "job": job,
                "rank": ms[-1]["rank"],
                "node": ms[-1]["node"],
                "buddy_node": ms[-1]["buddy_node"],
                "frozen_median_s": statistics.median(frozen),
                "frozen_max_s": max(frozen),
                "bytes": int(statistics.median(m["bytes"] for m in ms)),
                "rounds": len(ms),
            }
        )
    return out


def round_pause(logs: list[str], steps: list[float], s: dict[str, Any]) -> dict[str, Any]:
    """The peers' pause around one round: every rank's longest step gap overlapping [released -
    group pause - 1 s, released + 2 s], less that rank's usual step; the worst rank counts."""
    from agent.testing.ranks import longest_gap

    since = s["taken_at"] - s["group_pause_s"] - 1.0
    until = s["taken_at"] + 2.0
    worst: tuple[float, float, float] | None = None  # (pause, gap, step)
    for log, step in zip(logs, steps, strict=True):
        gap = longest_gap(log, since, until)
        pause = gap - step
        if worst is None or pause > worst[0]:
            worst = (pause, gap, step)
    assert worst is not None
    pause, gap, step = worst
    _, met = pause_target(gap, step, s["group_pause_s"])
    return {
        "epoch": s["epoch"],
        "group_pause_s": s["group_pause_s"],
        "peers_gap_s": gap,
        "step_s": step,
        "peers_pause_s": pause,
        "pause_target_met": met,
    }


def cost_per_round(protected_s: float, undisturbed_s: float, rounds: int) -> float:
    """What one round cost the job: the wall time protection added, shared by its rounds."""
    if rounds <= 0:
        raise BenchError("the protected run completed no snapshot round")
    return (protected_s - undisturbed_s) / rounds


#: The first rounds touch memory the node never used (its images, local and kept for its buddy):
#: on this VM a first touch runs at 0.3 GB/s, later ones at memory speed. Not steady state.
WARM_ROUNDS = 2


def round_costs(log: str, step_s: float, sets: list[dict[str, Any]]) -> list[float]:
    """What each round cost the job, from its own step stamps: from just before the round froze
    it to just before the next one did (the last, to its last step), the time its steps took
    less what they take undisturbed (step_s each)."""
    from agent.testing.ranks import stamps

    t = stamps(log)
    starts = [x["taken_at"] - x["group_pause_s"] - step_s for x in sets]
    costs = []
    for a, b in zip(starts, [*starts[1:], t[-1]], strict=True):
        inside = [x for x in t if a <= x <= b]
        costs.append(inside[-1] - inside[0] - (len(inside) - 1) * step_s if len(inside) > 1 else 0.0)
    return costs


def steady_cost(costs: list[float]) -> float:
    """A round's cost once the node's memory has been touched: the mean after WARM_ROUNDS."""
    later = costs[WARM_ROUNDS:] or costs
    return sum(later) / len(later)


def overhead(cost_s: float, every_s: float) -> float:
    """The share of the job's time that rounds take, one every every_s. The agent waits every_s
    after a round ends, so the true period is a little longer: this errs on the high side."""
    return cost_s / every_s


def _s(v: float) -> str:
    return f"{v:.2f} s"


def format_size(size: int, r: dict[str, Any]) -> list[str]:
    from agent.cli.render import human_bytes

    lines = [
        f"size {size} MiB per member: {r['rounds']} complete round(s), {r['failed']} failed, "
        f"every {r['every_s']:g} s; final digests as undisturbed: {'yes' if r['bit_identical'] else 'NO'}",
        f"  wall time: undisturbed {_s(r['undisturbed_wall_s'])}, protected {_s(r['protected_wall_s'])} "
        f"({r['protected_wall_s'] - r['undisturbed_wall_s']:+.2f} s)",
    ]
    if r["last_error"]:
        lines.append(f"  a round failed: {r['last_error']}")
    if r["sets_missed"]:
        lines.append(f"  the poll missed {r['sets_missed']} complete round(s)' sets: figures from the rest")
    lines.append(
        f"  {'member':24} {'node':7} {'frozen median':>13} {'frozen max':>11} {'image':>11}  kept on"
    )
    for m in r["members"]:
        lines.append(
            f"  {'rank ' + str(m['rank']) + ' (' + m['job'] + ')':24} {m['node']:7} "
            f"{_s(m['frozen_median_s']):>13} {_s(m['frozen_max_s']):>11} {human_bytes(m['bytes']):>11}  "
            f"{m['buddy_node']}"
        )
    lines += [
        f"  group pause: median {_s(r['group_pause_median_s'])}, max {_s(r['group_pause_max_s'])}",
        f"  {'round':>7} {'group pause':>12} {'peers gap':>10} {'step':>7} {'peers pause':>12}  "
        f"target <= group pause + {PAUSE_SLACK_S} s",
    ]
    for p in r["peers"]:
        lines.append(
            f"  {p['epoch']:>7} {_s(p['group_pause_s']):>12} {_s(p['peers_gap_s']):>10} "
            f"{_s(p['step_s']):>7} {_s(p['peers_pause_s']):>12}  "
            f"{'met' if p['pause_target_met'] else 'NOT met'}"
        )
    costs = ", ".join(f"{c:.2f}" for c in r["round_costs_s"])
    lines += [
        f"  cost per round, all rounds: {r['cost_per_round_s']:.3f} s (the protected run's extra wall "
        f"time / {r['rounds']} rounds): {r['overhead_all_rounds']:.3%} every {r['default_every_s']:g} s",
        f"  cost of each round, from rank 0's step stamps: {costs} s; steady state (after the first "
        f"{WARM_ROUNDS}, which touch fresh memory): {r['steady_cost_s']:.3f} s",
        f"  steady-state overhead at the default interval, every {r['default_every_s']:g} s: "
        f"{r['overhead_default']:.3%} (target <= {OVERHEAD_TARGET:.0%} of the undisturbed run's wall time): "
        f"{'PASS' if r['overhead_met'] else 'FAIL'}",
        f"  overhead at this bench's interval, every {r['every_s']:g} s: {r['overhead_every']:.2%} "
        "(for reference)",
    ]
    return lines


def format_report(results: dict[int, dict[str, Any]]) -> str:
    return "\n\n".join("\n".join(format_size(size, r)) for size, r in results.items())


# -- measuring -------------------------------------------------------------------------------


class Poller:
    """`ferry snapshot GROUP --last --json` on node-a about every POLL_S, in a thread: each new
    epoch's set, and the latest answer (its rounds tried and failed)."""

    def __init__(self, agent: Any, group: str) -> None:
        self.agent, self.group = agent, group
        self.sets: dict[int, dict[str, Any]] = {}
        self.latest: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"poll-{group}", daemon=True)

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def poll(self) -> None:
        try:
            p = self.agent.cli("snapshot", self.group, "--last", "--json", check=False, timeout_s=60)
        except subprocess.TimeoutExpired:
            return
        if p.returncode != 0:
            return  # not protected (yet, or in the undisturbed run): the same load all the same
        d = json.loads(p.stdout)
        s = snapshot_set(d.get("last", {}))
        if s["epoch"] and s["epoch"] not in self.sets:
            self.sets[s["epoch"]] = s
        self.latest = d

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(POLL_S)

    def settled(self) -> bool:
        """No round in progress: the latest round tried is the last complete one (the group is
        new, so round N is epoch N), or every round tried has failed or been seen complete."""
        d = self.latest
        if not d:
            return False
        tried = int(d.get("rounds", 0))
        last = int(d.get("last", {}).get("epoch", 0))
        return last == tried or int(d.get("failed", 0)) + len(self.sets) >= tried


class Runs:
    """The runs on one bed: nodes a, b, c hold ranks 0-2; node-a's agent protects the group."""

    def __init__(
        self, bed: Any, args: argparse.Namespace, say: Progress, nodes: list[Any] | None = None
    ) -> None:
        self.args, self.say = args, say
        self.nodes = nodes or [bed.node(n) for n in NODES]
        self.port = 29500
        #: Each size's undisturbed run: the recovery case's reference (digests, wall time, logs).
        self.refs: dict[int, dict[str, Any]] = {}

    def start(self, group: str, size: int) -> list[str]:
        from agent.testing.ranks import start_job

        a = self.args
        train = ["--steps", str(a.steps), "--step-time", str(a.step_time), "--ballast-mb", str(size)]
        self.port += 1
        return start_job(self.nodes, group, self.port, train)

    def finish(self, names: list[str], nodes: list[Any] | None = None) -> list[str]:
        """Wait for every rank to end well (on nodes, by default where it started); their logs."""
        logs = []
        for name, node in zip(names, nodes or self.nodes, strict=True):
            j = node.wait_exited(name, timeout_s=self.args.steps * (self.args.step_time + 1) + 300)
            if j["exit_code"] != 0:
                err = node.cli("logs", name).stderr.strip().splitlines()
                raise BenchError(
                    f"{name} on {node.node} exited {j['exit_code']}: {err[-1] if err else 'no stderr'}"
                )
            logs.append(node.cli("logs", name).stdout)
        return logs

    def run(self, group: str, size: int, protect: bool) -> dict[str, Any]:
        """One run of the job; protected from step --on-at to --off-at if `protect`. Both runs wait
        for the same steps and poll alike, so only protection tells them apart."""
        from agent.testing.ranks import stamps

        a, head = self.args, self.nodes[0]
        names = self.start(group, size)
        members_on = [x for n in self.nodes for x in ("--members-on", n.address)]
        with Poller(head, group) as poller:
            head.wait_log(names[0], rf"^step {a.on_at} ", timeout_s=600)
            if protect:
                head.cli("protect", group, "--every", f"{a.every:g}", *members_on)
            head.wait_log(names[0], rf"^step {a.off_at} ", timeout_s=600)
            if protect:
                head.cli("protect", group, "--off")
            logs = self.finish(names)
            deadline = time.monotonic() + SETTLE_S
            while protect and not poller.settled() and time.monotonic() < deadline:
                time.sleep(POLL_S)
        digests = [m[1] for log in logs for m in DIGEST.finditer(log)]
        if len(digests) != len(names):
            raise BenchError(f"{group}: {len(digests)} of {len(names)} ranks printed a final digest")
        return {
            "wall_s": wall_s(stamps(logs[0]), stamps(logs[0])),
            "digests": digests,
            "logs": logs,
            "sets": [poller.sets[e] for e in sorted(poller.sets)],
            "protection": poller.latest,
        }

    def size(self, size: int) -> dict[str, Any]:
        from agent.snapshots.config import SnapshotConfig
        from agent.testing.ranks import stamps

        self.say(f"{size} MiB per member: undisturbed run")
        ref = self.refs[size] = self.run(f"ref{size}", size, protect=False)
        self.say(f"{size} MiB per member: protected run, a round every {self.args.every:g} s")
        prot = self.run(f"snap{size}", size, protect=True)
        if prot["digests"] != ref["digests"]:
            raise BenchError(
                f"{size} MiB: the protected run's final digests {prot['digests']} differ from the "
                f"undisturbed run's {ref['digests']}"
            )
        p = prot["protection"]
        tried, failed = int(p.get("rounds", 0)), int(p.get("failed", 0))
        complete, sets = tried - failed, prot["sets"]
        if not sets:
            why = p.get("last_error") or "none failed"
            raise BenchError(f"{size} MiB: no complete snapshot round was seen ({failed} failed: {why})")
        steps = [median_step(stamps(log)) for log in prot["logs"]]
        peers = [round_pause(prot["logs"], steps, s) for s in sets]
        cost = cost_per_round(prot["wall_s"], ref["wall_s"], complete)
        default_every = SnapshotConfig().every_s
        costs = round_costs(prot["logs"][0], median_step(stamps(ref["logs"][0])), sets)
        steady = steady_cost(costs)
        at_default = overhead(steady, default_every)
        pauses = [s["group_pause_s"] for s in sets]
        return {
            "every_s": self.args.every,
            "rounds": complete,
            "failed": failed,
            "last_error": p.get("last_error", ""),
            "sets_missed": complete - len(sets),
            "undisturbed_wall_s": ref["wall_s"],
            "protected_wall_s": prot["wall_s"],
            "bit_identical": True,
            "digests": ref["digests"],
            "members": member_stats(sets),
            "group_pause_median_s": statistics.median(pauses),
            "group_pause_max_s": max(pauses),
            "peers": peers,
            "peers_target_met": all(x["pause_target_met"] for x in peers),
            "cost_per_round_s": cost,
            "overhead_all_rounds": overhead(cost, default_every),
            "round_costs_s": costs,
            "steady_cost_s": steady,
            "default_every_s": default_every,
            "overhead_default": at_default,
            "overhead_met": at_default <= OVERHEAD_TARGET,
            "overhead_every": overhead(cost, self.args.every),
            "sets": sets,
        }


# -- the recovery case: pure parts ---------------------------------------------------------


def recovery_config(spare: bool) -> str:
    """An agent's config for the recovery bed: tests/integration/test_recovery.py's timings (a 3 s
    lease; a held member goes on by itself after 10 s); node-a/b/c list node-d as their spare."""
    from agent.testing.bed import coordination_config

    config = coordination_config(ttl_s=3, margin_s=1.0) + "[snapshots]\nhold_s = 10\n"
    return config + (f'[[peers]]\naddress = "{SPARE}"\nspare = true\n' if spare else "")


def parse_recovered(message: str) -> dict[str, float]:
    """The figures of agent/snapshots/recover.py's "recovered from snapshot round" event."""
    m = RECOVERED.search(message)
    if m is None:
        raise BenchError(f"a recovery event this bench cannot read: {message!r}")
    keys = ("round", "recovery_s", "claim_s", "fetch_s", "end_s", "restore_s")
    return {k: float(v) for k, v in zip(keys, m.groups(), strict=True)}


def stepped(log: str) -> list[tuple[int, float]]:
    """Every (step, wall time) a rank logged, in the log's order (a replay logs steps again)."""
    return [(int(m[1]), float(m[2])) for m in STEPPED.finditer(log)]


def first_after(log: str, t: float) -> float | None:
    """A rank's first step stamp after t; None while it has logged none."""
    return next((at for _, at in stepped(log) if at > t), None)


def replayed(log: str, killed: float) -> tuple[int, int]:
    """A rank's last step logged before the kill, and how many steps it logged again after it:
    the steps since the snapshot, the work the failure lost."""
    steps = stepped(log)
    before = [n for n, at in steps if at <= killed]
    after = [n for n, at in steps if at > killed]
    if not before or not after:
        raise BenchError("a rank logged no step before the kill, or none after it")
    return before[-1], max(0, before[-1] - after[0] + 1)


def breakdown(
    killed: float, lost_at: float, recovered_at: float, back: list[float], said: dict[str, float]
) -> dict[str, float]:
    """Kill -> every rank stepping again, in parts that add up: detection (to the first "is lost"
    alert), the recovery (to the "recovered" event: ferry's own four figures and the rest, which
    holds the claim of the group and the reads of etcd), the release (to the latest rank's first
    step; the RESUME is sent before the event is recorded, so it may be short or below zero)."""
    window = recovered_at - lost_at
    four = said["claim_s"] + said["fetch_s"] + said["end_s"] + said["restore_s"]
    return {
        "detection_s": lost_at - killed,
        "recovery_window_s": window,
        "recovery_said_s": said["recovery_s"],
        "claim_s": said["claim_s"],
        "fetch_s": said["fetch_s"],
        "end_s": said["end_s"],
        "restore_s": said["restore_s"],
        "other_s": window - four,
        "release_s": max(back) - recovered_at,
        "total_s": max(back) - killed,
    }


def lost_per_failure(
    recovered_wall_s: float,
    undisturbed_wall_s: float,
    rounds: int,
    round_cost_s: float,
    replayed_steps: int,
    step_s: float,
) -> dict[str, float]:
    """ferry's lost time: the recovered run's wall time less the undisturbed run's. Its snapshot
    rounds are protection's steady cost, not the failure's (the projection counts them as
    overhead): less them, the failure cost the replayed steps and a fixed part (detection,
    recovery, release), which does not grow with the interval."""
    lost = recovered_wall_s - undisturbed_wall_s
    failure = lost - rounds * round_cost_s
    replay = replayed_steps * step_s
    return {
        "lost_s": lost,
        "rounds_s": rounds * round_cost_s,
        "failure_s": failure,
        "replay_s": replay,
        "fixed_s": failure - replay,
    }


def project_goodput(
    fixed_s: float, overhead_share: float, every_s: float, restart_s: float, interval_s: float
) -> list[dict[str, float]]:
    """Goodput per cluster (bench_ranks.CLUSTERS) through bench_ranks.project: checkpoint-restart
    every interval_s loses its restart and half an interval per failure; ferry, snapshots every
    every_s, loses its fixed part and half its interval (project's "all warned" column: a cost
    every failure pays), and its rounds take overhead_share of the time besides. Writing
    checkpoints is not counted against checkpoint-restart (it errs in its favour)."""
    ferry_s = fixed_s + every_s / 2
    return [
        {
            "gpus": p.gpus,
            "mttf_h": p.mttf_h,
            "restart": p.restart,
            "ferry": (1 - overhead_share) * p.warned_all,
            "ferry_lost_s": ferry_s,
            "restart_lost_s": restart_s + interval_s / 2,
        }
        for p in project(restart_s, interval_s, ferry_s)
    ]


def format_recovery(size: int, r: dict[str, Any]) -> list[str]:
    b, lost, cr = r["breakdown"], r["lost"], r["restart"]
    target = (
        ("PASS" if r["target_met"] else "FAIL")
        if size == RECOVERY_TARGET_MIB
        else f"not judged (the target is for {RECOVERY_TARGET_MIB} MiB)"
    )
    lines = [
        f"recovery, size {size} MiB per member: node-b powered off at rank 0's step {r['killed_at_step']}, "
        f"{KILL_AFTER_STEPS} steps after snapshot round {r['snapshot_round']} (taken after step "
        f"{r['killed_at_step'] - r['replayed_steps']}) was seen complete"
        + (" (a round was in progress)" if r["round_in_progress_at_kill"] else "")
        + f"; {r['recoveries']} recovery, from round {int(r['said']['round'])}, rank 1 onto node-d; "
        f"final digests as undisturbed: {'yes' if r['bit_identical'] else 'NO'}",
        f'  detection      {_s(b["detection_s"]):>8}  kill -> the first "is lost" alert ({r["lost_by"]})',
        f'  recovery       {_s(b["recovery_window_s"]):>8}  that alert -> the "recovered" event '
        f"({r['recovered_by']}; ferry said {b['recovery_said_s']:.1f} s from its claim):",
        f"    spare claim  {_s(b['claim_s']):>8}",
        f"    fetch        {_s(b['fetch_s']):>8}  images from the buddies",
        f"    end          {_s(b['end_s']):>8}  every old copy ended",
        f"    restore      {_s(b['restore_s']):>8}",
        f"    other        {_s(b['other_s']):>8}  the group's claim, reading etcd, recording",
        f'  release        {_s(b["release_s"]):>8}  the "recovered" event -> every rank\'s first step, '
        "the latest",
        f"  total          {_s(b['total_s']):>8}  kill -> every rank stepping again (rank 1's log on node-d)",
        f"  target: recovery <= {RECOVERY_TARGET_S:g} s on the bed at {RECOVERY_TARGET_MIB} MiB per "
        f"member: {target}",
        f"  replayed: {r['replayed_steps']} steps ({_s(lost['replay_s'])}) since the snapshot: the lost work",
        "",
        "  lost time per hard failure:",
        f"    ferry, measured: recovered run {_s(r['recovered_wall_s'])} - undisturbed "
        f"{_s(r['undisturbed_wall_s'])} = {_s(lost['lost_s'])}; less its {r['rounds']} complete round(s) x "
        f"{r['round_cost_s']:.2f} s ({r['round_cost_from']}; {r['failed_rounds']} failed, not counted) = "
        f"{_s(lost['failure_s'])}: {_s(lost['replay_s'])} replayed + {_s(lost['fixed_s'])} fixed",
        f"    checkpoint-restart, measured (bench_ranks' Runs.restart): every rank ended at step "
        f"{cr['fail_at']}, all started again from the checkpoint written after step "
        f"{cr['fail_at'] - cr['recomputed_steps']} (the snapshot's): {_s(cr['lost_s'])} = restart "
        f"{_s(cr['restart_cost_s'])} + {cr['recomputed_steps']} steps recomputed",
        f"    at this bench's interval, every {r['every_s']:g} s (half an interval replayed, modelled "
        f"from the measured parts): ferry {_s(lost['fixed_s'] + r['every_s'] / 2)}, "
        f"checkpoint-restart {_s(cr['restart_cost_s'] + r['every_s'] / 2)}",
        f"    at realistic intervals (modelled): ferry every {r['default_every_s']:g} s "
        f"{_s(lost['fixed_s'] + r['default_every_s'] / 2)}, its rounds {r['overhead_default']:.3%} of "
        f"the time ({r['overhead_from']}); checkpoint-restart every {r['interval_min']:g} min "
        f"{_s(cr['restart_cost_s'] + r['interval_min'] * 30)}",
        "",
        "  goodput (bench_ranks' projection, these costs; checkpoint writes not counted):",
        f"  {'GPUs':>6} {'MTTF':>6} {'restart every ' + format(r['interval_min'], 'g') + ' min':>22} "
        f"{'ferry every ' + format(r['default_every_s'], 'g') + ' s':>18}",
    ]
    lines += [
        f"  {p['gpus']:>6} {p['mttf_h']:>5}h {p['restart']:>22.2%} {p['ferry']:>18.2%}" for p in r["goodput"]
    ]
    return lines


# -- the recovery case: measuring ----------------------------------------------------------


class RestartRuns(RanksRuns):
    """bench_ranks' checkpoint-restart, measured its own way, on the recovery bed after the
    recovered run: every rank ends abruptly at --fail-at and all start again from checkpoints
    written K steps before. Its __init__ would create nodes the bed has; node-b is dead, so rank
    1 runs on node-d before and after (a fresh process either way, as on a spare)."""

    def __init__(
        self, bed: Any, args: argparse.Namespace, say: Progress, nodes: list[Any], ref_logs: list[str]
    ) -> None:
        self.bed, self.args, self.say = bed, args, say
        self.nodes, self.spare = nodes, nodes[1]
        self.port = 29600
        # The undisturbed run's: a restart must end with its last losses (bench_ranks' check).
        self.digests = [m[1] for log in ref_logs for m in DIGEST.finditer(log)]
        self.losses = [LOSS.findall(log)[-1:] for log in ref_logs]
        self.exact = True


class Recovery:
    """The recovery case for one size, on a bed of its own: etcd, node-a/b/c with a rank each,
    node-d their spare. A powered-off node does not come back and a claimed spare stays claimed,
    so each size gets a fresh bed."""

    def __init__(self, bed: Any, args: argparse.Namespace, say: Progress) -> None:
        self.bed, self.args, self.say = bed, args, say
        bed.etcd()
        self.nodes = [bed.node(n, config=recovery_config(spare=True)) for n in NODES]
        self.spare = bed.node("node-d", config=recovery_config(spare=False))  # the 4th: SPARE
        if self.spare.address != SPARE:
            raise BenchError(f"node-d is at {self.spare.address}, not {SPARE}, which the others list")
        self.runs = Runs(bed, args, say, nodes=self.nodes)

    def reference(self, size: int) -> dict[str, Any]:
        self.say(f"recovery, {size} MiB per member: undisturbed reference run (--recovery-only)")
        return self.runs.run(f"ref{size}", size, protect=False)

    def _first_snapshot(self, poller: Poller, group: str) -> dict[str, Any]:
        """Protect the group through etcd (no --members-on; retried while refused, as it may be
        before its members' keys are there), and wait for its first complete round."""
        a, every = self.nodes[0], f"{self.args.every:g}"
        deadline, protected, why = time.monotonic() + 180, False, ""
        while not poller.sets:
            if time.monotonic() > deadline:
                why = why or poller.latest.get("last_error", "") or "none failed"
                raise BenchError(f"{group}: no complete snapshot within 180 s ({why})")
            if not protected:
                p = a.cli("protect", group, "--every", every, check=False)
                protected, why = p.returncode == 0, p.stderr.strip()
            time.sleep(0.5)
        return poller.sets[min(poller.sets)]

    def _stepping_again(self, names: list[str], where: list[Any], killed: float) -> list[float]:
        """Every rank's first step stamp after the kill. Polled once a second: on two cores, a
        faster poll would take CPU from the recovery it measures; the stamps give the times."""
        back: dict[str, float] = {}
        deadline = time.monotonic() + 300
        while len(back) < len(names):
            if time.monotonic() > deadline:
                raise BenchError(f"ranks {sorted(set(names) - set(back))} did not step again within 300 s")
            time.sleep(1.0)
            for name, node in zip(names, where, strict=True):
                if name not in back:
                    p = node.cli("logs", name, check=False)  # on the spare: none until restored
                    if p.returncode == 0 and (t := first_after(p.stdout, killed)) is not None:
                        back[name] = t
        return [back[n] for n in names]

    def _events(self, group: str, killed: float) -> tuple[tuple[float, str], tuple[float, str, str], int]:
        """(time, node) of the first "is lost" alert after the kill on node-a or node-c; (time,
        node, message) of the "recovered" event; how many recoveries were recorded."""
        lost: list[tuple[float, str]] = []
        recovered: list[tuple[float, str, str]] = []
        for node in (self.nodes[0], self.nodes[2]):
            for e in json.loads(node.cli("events", "--json", "--limit", "5000").stdout):
                msg, t = e["message"], float(e["time"])
                if not msg.startswith(f"group {group} ") or t < killed:
                    continue
                if " is lost: " in msg:  # the alert that the member is lost
                    lost.append((t, node.node))
                elif "recovered from snapshot round" in msg:
                    recovered.append((t, node.node, msg))
        if not lost or not recovered:
            raise BenchError(f'{group}: {len(lost)} "is lost" alert(s), {len(recovered)} recovery event(s)')
        return min(lost), min(recovered), len(recovered)

    def measure(self, size: int, ref: dict[str, Any], protected: dict[str, Any] | None) -> dict[str, Any]:
        from agent.snapshots.config import SnapshotConfig
        from agent.testing.ranks import stamps

        a, b, c = self.nodes
        where, group = [a, self.spare, c], f"rec{size}"
        self.say(f"recovery, {size} MiB per member: protected run, a round every {self.args.every:g} s")
        names = self.runs.start(group, size)
        # Polled until the kill only: afterwards the CLI's CPU would slow the recovery it measures.
        with Poller(a, group) as poller:
            a.wait_log(names[0], rf"^step {self.args.on_at} ", timeout_s=600)
            snap = self._first_snapshot(poller, group)
            now = stepped(a.cli("logs", names[0]).stdout)[-1][0]
            # A few steps on: between rounds (each waits --every after the last), with work to lose.
            a.wait_log(names[0], rf"^step {now + KILL_AFTER_STEPS} ", timeout_s=120)
        in_round = not poller.settled()
        killed = time.time()
        self.bed.power_off(b)
        self.say(f"recovery, {size} MiB per member: node-b powered off")
        back = self._stepping_again(names, where, killed)
        self.say(f"recovery, {size} MiB per member: every rank steps again, {max(back) - killed:.1f} s after")
        # The job's wall time then holds only the rounds before the failure (and one in flight).
        a.cli("protect", group, "--off", check=False)
        logs = self.runs.finish(names, where)
        deadline = time.monotonic() + SETTLE_S
        while True:
            poller.poll()
            if poller.settled() or time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
        digests = [m[1] for log in logs for m in DIGEST.finditer(log)]
        if digests != ref["digests"]:
            raise BenchError(
                f"{size} MiB: the recovered run's final digests {digests} differ from the undisturbed "
                f"run's {ref['digests']}"
            )
        (lost_at, lost_by), (recovered_at, recovered_by, said_msg), recoveries = self._events(group, killed)
        said = parse_recovered(said_msg)
        parts = breakdown(killed, lost_at, recovered_at, back, said)
        killed_at, replays = replayed(logs[0], killed)

        p = poller.latest
        rounds = int(p.get("rounds", 0)) - int(p.get("failed", 0))
        default_every = SnapshotConfig().every_s
        if protected is not None:
            cost, cost_from = protected["cost_per_round_s"], "measured: the protected run"
            at_default, overhead_from = protected["overhead_default"], "measured: the protected run"
        else:  # --recovery-only: no protected run; a round costs at least the group's pause
            cost = statistics.median(s["group_pause_s"] for s in poller.sets.values())
            cost_from = "estimated: the group's pause, no protected run"
            at_default, overhead_from = overhead(cost, default_every), "estimated from the group's pause"
        step = median_step(stamps(ref["logs"][0]))
        recovered_wall = wall_s(stamps(logs[0]), stamps(logs[0]))
        lost = lost_per_failure(recovered_wall, ref["wall_s"], rounds, cost, replays, step)

        self.say(
            f"recovery, {size} MiB per member: total {parts['total_s']:.2f} s (detection "
            f"{parts['detection_s']:.2f} s, recovery {parts['recovery_window_s']:.2f} s, release "
            f"{parts['release_s']:.2f} s); {replays} steps replayed; lost {lost['lost_s']:.2f} s"
        )
        cr = self.restart(size, ref, killed_at, replays)
        cr["restart_cost_s"] = cr["lost_s"] - cr["recomputed_steps"] * step
        interval_s = self.args.interval_min * 60
        return {
            "every_s": self.args.every,
            "snapshot_round": snap["epoch"],
            "round_in_progress_at_kill": in_round,
            "killed_at": killed,
            "killed_at_step": killed_at,
            "recoveries": recoveries,
            "lost_by": lost_by,
            "recovered_by": recovered_by,
            "said": said,
            "said_message": said_msg,
            "breakdown": parts,
            "target_s": RECOVERY_TARGET_S,
            "target_met": parts["total_s"] <= RECOVERY_TARGET_S,
            "replayed_steps": replays,
            "bit_identical": True,
            "digests": digests,
            "undisturbed_wall_s": ref["wall_s"],
            "recovered_wall_s": recovered_wall,
            "rounds": rounds,
            "failed_rounds": int(p.get("failed", 0)),
            "round_cost_s": cost,
            "round_cost_from": cost_from,
            "step_s": step,
            "lost": lost,
            "restart": cr,
            "default_every_s": default_every,
            "overhead_default": at_default,
            "overhead_from": overhead_from,
            "interval_min": self.args.interval_min,
            "goodput": project_goodput(
                lost["fixed_s"], at_default, default_every, cr["restart_cost_s"], interval_s
            ),
        }

    def restart(self, size: int, ref: dict[str, Any], fail_at: int, k: int) -> dict[str, Any]:
        """Checkpoint-restart of the whole job, failing where node-b died and restarting from a
        checkpoint written at the snapshot's step: the same work lost as ferry's recovery."""
        a = self.args
        ns = argparse.Namespace(
            steps=a.steps, step_time=a.step_time, ballast_mb=size, hidden=TRAIN_HIDDEN, fail_at=fail_at
        )
        runs = RestartRuns(self.bed, ns, self.say, [self.nodes[0], self.spare, self.nodes[2]], ref["logs"])
        r = runs.restart(k)
        return {**r, "fail_at": fail_at, "lost_s": r["wall_s"] - ref["wall_s"]}


def recover(
    root: Path,
    args: argparse.Namespace,
    say: Progress,
    size: int,
    ref: dict[str, Any] | None,
    protected: dict[str, Any] | None,
) -> dict[str, Any]:
    from agent.testing.bed import node_bed

    with node_bed(root) as bed:
        rec = Recovery(bed, args, say)
        return rec.measure(size, ref or rec.reference(size), protected)


def build_parser() -> argparse.ArgumentParser:
    from agent.cli.parser import duration

    p = argparse.ArgumentParser(
        prog="bench_snapshots.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--sizes",
        default="256,1024",
        help="MiB of live state per member (train_ddp.py --ballast-mb), comma-separated: each runs "
        "the snapshot case's two runs and the recovery case's (default 256,1024)",
    )
    p.add_argument("--steps", type=int, default=240, help="training steps per run (default 240)")
    p.add_argument("--step-time", type=float, default=0.25, help="seconds each step sleeps (default 0.25)")
    p.add_argument(
        "--every",
        type=duration,
        default=10.0,
        help="time between rounds in the protected and the recovered run, as `ferry protect --every` "
        "takes it: 10, 10s or 1m (default 10 s, so that a short run sees several rounds)",
    )
    p.add_argument(
        "--on-at",
        type=int,
        default=5,
        help="the step at which protection starts, in both cases (default 5)",
    )
    p.add_argument(
        "--off-at",
        type=int,
        help="the step at which protection stops, leaving the last round time to complete before "
        "the job ends (default: 5/6 of --steps)",
    )
    cases = p.add_mutually_exclusive_group()
    cases.add_argument(
        "--recovery-only",
        action="store_true",
        help="only the recovery case (after an undisturbed reference run of each size on its bed)",
    )
    cases.add_argument("--no-recovery", action="store_true", help="skip the recovery case")
    p.add_argument(
        "--interval-min",
        type=float,
        default=30.0,
        help="the realistic checkpoint-restart interval the recovery case compares with, in minutes "
        "(default 30)",
    )
    p.add_argument(
        "--json",
        type=Path,
        default=OUT,
        help=f"where to write the figures (default {OUT}); a case skipped keeps its figures there",
    )
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()), help="where the beds live")
    p.add_argument(
        "--keep", action="store_true", help="keep the beds' directory (agents' logs and state) afterwards"
    )
    return p


def preflight(args: argparse.Namespace, sizes: list[int]) -> None:
    from agent.snapshots.config import MIN_EVERY_S

    if os.geteuid() != 0:
        raise BenchError("needs root: the bed creates network namespaces and CRIU dumps processes")
    if shutil.which("ip") is None:
        raise BenchError("`ip` (iproute2) is missing: apt-get install iproute2")
    if not 0 < args.on_at < args.off_at < args.steps - 1:
        raise BenchError(
            f"need 0 < --on-at ({args.on_at}) < --off-at ({args.off_at}) < --steps-1 ({args.steps - 1})"
        )
    if args.every < MIN_EVERY_S:
        raise BenchError(f"--every {args.every:g} is below the agent's minimum, {MIN_EVERY_S:g} s")
    if args.interval_min <= 0:
        raise BenchError(f"--interval-min {args.interval_min:g}: give minutes above 0")
    if not args.no_recovery:
        from agent.testing.etcd import have_etcd

        if not have_etcd():
            raise BenchError("the recovery case needs etcd: `make etcd` (or --no-recovery)")
    need = MEMORY_FACTOR * len(NODES) * (max(sizes) + BASE_MIB)
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) // 1024 for line in f if line.startswith("MemAvailable:"))
    if need > avail:
        raise BenchError(
            f"{max(sizes)} MiB per member needs about {need} MiB of memory; {avail} MiB is available"
        )
    require_criu()


def run(args: argparse.Namespace, say: Progress) -> dict[str, Any]:
    sizes = parse_sizes(args.sizes)
    if args.off_at is None:
        args.off_at = args.steps * 5 // 6
    preflight(args, sizes)
    from agent.testing.bed import node_bed

    root = Path(tempfile.mkdtemp(prefix="ferry-bench-snapshots-", dir=args.workdir))
    results: dict[int, dict[str, Any]] = {}
    refs: dict[int, dict[str, Any]] = {}
    recoveries: dict[int, dict[str, Any]] = {}
    try:
        if not args.recovery_only:
            with node_bed(root / "snapshots") as bed:
                r = Runs(bed, args, say)
                for size in sizes:
                    results[size] = r.size(size)
                refs = r.refs
        # After the snapshot bed is gone, whose tmpfs copies would crowd memory; a bed per size.
        for size in sizes if not args.no_recovery else []:
            recoveries[size] = recover(
                root / f"recovery{size}", args, say, size, refs.get(size), results.get(size)
            )
    except (AssertionError, RuntimeError, subprocess.TimeoutExpired) as e:
        # The bed's own failures (a job that never logged a step, a CLI call that failed): one line.
        raise BenchError(" ".join(str(e).split())[:500]) from e
    finally:
        if args.keep:
            say(f"kept the beds' directory: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    given = {k: str(v) for k, v in vars(args).items()}
    out: dict[str, Any] = {}
    if not args.recovery_only:
        out.update(args=given, sizes={str(k): v for k, v in results.items()}, report=format_report(results))
    if not args.no_recovery:
        out.update(
            recovery_args=given,
            recovery={str(k): v for k, v in recoveries.items()},
            recovery_report="\n\n".join("\n".join(format_recovery(k, v)) for k, v in recoveries.items()),
        )
    return out


def merged(path: Path, new: dict[str, Any]) -> dict[str, Any]:
    """The figures to write: a case this invocation skipped keeps its figures from the file."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        old = {}
    return {**(old if isinstance(old, dict) else {}), **new}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    say = Progress()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # the bed comes down on SIGTERM too
    try:
        results = run(args, say)
    except BenchError as e:
        print(f"bench_snapshots: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench_snapshots: interrupted", file=sys.stderr)
        return 130
    print("\n\n".join(results[k] for k in ("report", "recovery_report") if k in results))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(merged(args.json, results), indent=2, sort_keys=True) + "\n")
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
