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

Steady-state overhead: the protected run's wall time minus the undisturbed run's, divided by
its complete rounds, is what one round costs the job; at the agent's default interval
([snapshots] every_s, 300 s) the overhead is that cost / 300 s, and the target is at most 2 %
of the undisturbed run's wall time (PASS/FAIL). The overhead at --every is printed for
reference. A missed target is reported, not an error. Each run must end with the undisturbed
run's final digest on every rank, bit for bit: a snapshot must not change the training.
Writes the figures to bench-results/snapshots.json. Needs root, CRIU (`make criu`) and `ip`.
"""

from __future__ import annotations

import argparse
import json
import os
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
    PAUSE_SLACK_S,
    BenchError,
    Progress,
    median_step,
    pause_target,
    wall_s,
)

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
    lines += [
        f"  cost per round: {r['cost_per_round_s']:.3f} s (the protected run's extra wall time / "
        f"{r['rounds']} rounds)",
        f"  overhead at the default interval, every {r['default_every_s']:g} s: {r['overhead_default']:.3%} "
        f"(target <= {OVERHEAD_TARGET:.0%} of the undisturbed run's wall time): "
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

    def __init__(self, bed: Any, args: argparse.Namespace, say: Progress) -> None:
        self.args, self.say = args, say
        self.nodes = [bed.node(n) for n in NODES]
        self.port = 29500

    def start(self, group: str, size: int) -> list[str]:
        from agent.testing.ranks import start_job

        a = self.args
        train = ["--steps", str(a.steps), "--step-time", str(a.step_time), "--ballast-mb", str(size)]
        self.port += 1
        return start_job(self.nodes, group, self.port, train)

    def finish(self, names: list[str]) -> list[str]:
        """Wait for every rank to end well; their logs."""
        logs = []
        for name, node in zip(names, self.nodes, strict=True):
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
        ref = self.run(f"ref{size}", size, protect=False)
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
        at_default = overhead(cost, default_every)
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
            "default_every_s": default_every,
            "overhead_default": at_default,
            "overhead_met": at_default <= OVERHEAD_TARGET,
            "overhead_every": overhead(cost, self.args.every),
            "sets": sets,
        }


def build_parser() -> argparse.ArgumentParser:
    from agent.cli.parser import duration

    p = argparse.ArgumentParser(
        prog="bench_snapshots.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--sizes",
        default="256,1024",
        help="MiB of live state per member (train_ddp.py --ballast-mb), comma-separated: two runs "
        "each (default 256,1024)",
    )
    p.add_argument("--steps", type=int, default=240, help="training steps per run (default 240)")
    p.add_argument("--step-time", type=float, default=0.25, help="seconds each step sleeps (default 0.25)")
    p.add_argument(
        "--every",
        type=duration,
        default=10.0,
        help="time between rounds in the protected run, as `ferry protect --every` takes it: 10, "
        "10s or 1m (default 10 s, so that a short run sees several rounds)",
    )
    p.add_argument("--on-at", type=int, default=5, help="the step at which protection starts (default 5)")
    p.add_argument(
        "--off-at",
        type=int,
        help="the step at which protection stops, leaving the last round time to complete before "
        "the job ends (default: 5/6 of --steps)",
    )
    p.add_argument("--json", type=Path, default=OUT, help=f"where to write the figures (default {OUT})")
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()), help="where the bed lives")
    p.add_argument(
        "--keep", action="store_true", help="keep the bed's directory (agents' logs and state) afterwards"
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
    need = MEMORY_FACTOR * len(NODES) * (max(sizes) + BASE_MIB)
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) // 1024 for line in f if line.startswith("MemAvailable:"))
    if need > avail:
        raise BenchError(
            f"{max(sizes)} MiB per member needs about {need} MiB of memory; {avail} MiB is available"
        )
    from agent import config
    from agent.errors import FerryError

    try:
        config.criu_binary()
    except FerryError as e:
        raise BenchError(f"CRIU not found: {e}") from e


def run(args: argparse.Namespace, say: Progress) -> dict[str, Any]:
    sizes = parse_sizes(args.sizes)
    if args.off_at is None:
        args.off_at = args.steps * 5 // 6
    preflight(args, sizes)
    from agent.testing.bed import node_bed

    root = Path(tempfile.mkdtemp(prefix="ferry-bench-snapshots-", dir=args.workdir))
    results: dict[int, dict[str, Any]] = {}
    try:
        with node_bed(root) as bed:
            r = Runs(bed, args, say)
            for size in sizes:
                results[size] = r.size(size)
    except (AssertionError, RuntimeError, subprocess.TimeoutExpired) as e:
        # The bed's own failures (a job that never logged a step, a CLI call that failed): one line.
        raise BenchError(" ".join(str(e).split())[:500]) from e
    finally:
        if args.keep:
            say(f"kept the bed's directory: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    return {
        "args": {k: str(v) for k, v in vars(args).items()},
        "sizes": {str(k): v for k, v in results.items()},
        "report": format_report(results),
    }


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
    print(results["report"])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
