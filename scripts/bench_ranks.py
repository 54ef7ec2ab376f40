"""`make bench`, distributed case: moving one rank of a 3-rank job against restarting the job.

On the multi-node bed (agent/testing/bed.py: network and mount namespaces, real agents over
mutual TLS, a spare node), a 3-rank gloo DDP job (scripts/workloads/train_ddp.py, one rank
per node, each holding --ballast-mb of live state) runs four times, one after the other:

  undisturbed          nothing happens: its wall time is the reference
  ferry                at step --fail-at, `ferry migrate` moves rank 1 to the spare
  checkpoint-restart   every rank wrote a checkpoint K steps before step --fail-at; there
                       every rank ends abruptly, then all restart (rank 1 on the spare),
                       reload and recompute K steps. K = 0 (the checkpoint was taken at the
                       failure: the best case) and K = --interval-steps / 2 (the expected K
                       when checkpoints come every --interval-steps)

Lost time = the run's wall time (rank 0's first step to its last) minus the undisturbed
run's. For the move it also prints the group's pause ferry reported (frozen time plus the peers'
wait after the release, which the target measured on the moved rank's connections), the peers'
longest step gap in their own logs, and checks issue 29's target: the peers' pause (that gap
minus their median step, which a freeze does not remove) is at most the frozen time + 0.5 s.
Each run must end with the undisturbed run's parameters, bit for bit. Then it projects
goodput for a 1,024- and a 16,384-GPU job (MTTF 7.9 h and 1.8 h) from the lost time per
failure (--ferry-only: the undisturbed run and the move alone, no projection). Needs root,
CRIU (`make criu`) and `ip`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

OUT = Path("bench-results") / "ranks.json"
#: (GPUs, mean time to the job's next failure in hours): Meta's figures for Llama 3.
CLUSTERS = ((1024, 7.9), (16384, 1.8))
DIGEST = re.compile(r"^final digest (\w+)$", re.M)
LOSS = re.compile(r"^step \d+ loss (\S+)", re.M)


class BenchError(Exception):
    """A failure reported as one line and exit status 1."""


#: Issue 29's target: the peers' pause may exceed the frozen time by this much.
PAUSE_SLACK_S = 0.5

# -- pure parts: wall time, lost time, goodput ----------------------------------------------


def wall_s(first: list[float], last: list[float]) -> float:
    """Rank 0's first step (in the run's first log) to its last step (in its last log)."""
    if not first or not last:
        raise BenchError("a run logged no stamped steps on rank 0")
    return last[-1] - first[0]


def median_step(stamps: list[float]) -> float:
    """A rank's usual step: the median time between its consecutive steps."""
    gaps = sorted(b - a for a, b in itertools.pairwise(stamps))
    if not gaps:
        raise BenchError("a rank logged fewer than two stamped steps")
    mid = len(gaps) // 2
    return gaps[mid] if len(gaps) % 2 else (gaps[mid - 1] + gaps[mid]) / 2


def pause_target(gap_s: float, step_s: float, frozen_s: float) -> tuple[float, bool]:
    """The peers' pause (their longest step gap minus their usual step) and whether it met issue
    29's target: at most the frozen time plus PAUSE_SLACK_S."""
    pause = gap_s - step_s
    return pause, pause <= frozen_s + PAUSE_SLACK_S


@dataclass(frozen=True)
class Projection:
    gpus: int
    mttf_h: float
    restart: float  # goodput when every failure is a checkpoint-restart
    warned_half: float  # goodput when ferry moves the half of failures that give warning
    warned_all: float  # ... and when every failure gives warning (the bound)


def goodput(mttf_s: float, lost_s: float) -> float:
    """The share of the machine's time that trains, when each failure costs lost_s."""
    return max(0.0, 1.0 - lost_s / mttf_s)


def project(restart_s: float, interval_s: float, move_s: float) -> list[Projection]:
    """Per failure, checkpoint-restart loses its restart and half an interval of recompute; a
    move loses move_s, but only for a failure ferry sees coming (the rest still restart)."""
    restart = restart_s + interval_s / 2
    out = []
    for gpus, mttf_h in CLUSTERS:
        m = mttf_h * 3600
        out.append(
            Projection(
                gpus,
                mttf_h,
                goodput(m, restart),
                goodput(m, 0.5 * move_s + 0.5 * restart),
                goodput(m, move_s),
            )
        )
    return out


def _seconds(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} s"


def format_report(runs: dict[str, dict[str, Any]], projections: dict[str, list[Projection]]) -> str:
    lines = [
        f"{'run':34} {'wall':>8} {'lost':>8} {'frozen':>8} {'group pause':>12} {'peers gap':>10} "
        f"{'recomputed':>10} {'exact':>6}",
    ]
    for label, r in runs.items():
        k = r.get("recomputed_steps")
        cells = [_seconds(r.get(key)) for key in ("wall_s", "lost_s", "frozen_s", "group_pause_s")]
        lines.append(
            f"{label:34} {cells[0]:>8} {cells[1]:>8} {cells[2]:>8} {cells[3]:>12} "
            f"{_seconds(r.get('peers_gap_s')):>10} {'-' if k is None else k:>10} "
            f"{ {True: 'yes', False: 'no', None: '-'}[r.get('bit_identical')]:>6}"
        )
    for label, r in runs.items():
        if "peers_pause_s" not in r:
            continue
        lines += [
            "",
            f"{label}: the group's pause as ferry reported it: "
            + (f"{r['group_pause_s']:.2f} s" if r.get("group_pause_s") is not None else "not measured")
            + f" ({r.get('group_pause_by') or 'no words'})",
            f"  peers' pause from their logs: longest step gap {r['peers_gap_s']:.2f} s - usual step "
            f"{r['step_s']:.2f} s = {r['peers_pause_s']:.2f} s; target <= frozen {r['frozen_s']:.2f} s "
            f"+ {PAUSE_SLACK_S} s: {'met' if r['pause_target_met'] else 'NOT met'}",
        ]
        if (own := r.get("moved_gap_s")) is not None:
            within = r["peers_gap_s"] <= own + PAUSE_SLACK_S
            lazy = str(r.get("method", "")).startswith("post-copy")
            lines.append(
                f"  the moved rank's own longest step gap {own:.2f} s: its peers' is "
                + (f"within it + {PAUSE_SLACK_S} s" if within else f"{r['peers_gap_s'] - own:.2f} s longer")
                + (" (post-copy: it steps again once its next step's pages are in)" if lazy else "")
            )
    for title, rows in projections.items():
        lines += [
            "",
            f"goodput, {title}",
            f"{'GPUs':>6} {'MTTF':>6} {'restart':>8} {'half warned':>12} {'all warned':>11}",
        ]
        lines += [
            f"{p.gpus:>6} {p.mttf_h:>5}h {p.restart:>8.2%} {p.warned_half:>12.2%} {p.warned_all:>11.2%}"
            for p in rows
        ]
    return "\n".join(lines)


# -- measuring -------------------------------------------------------------------------------


class Progress:
    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def __call__(self, text: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.1f}s] {text}", file=sys.stderr, flush=True)


class Runs:
    """The four runs on one bed: nodes a, b, c hold ranks 0-2; d is the spare."""

    def __init__(self, bed: Any, args: argparse.Namespace, say: Progress) -> None:
        self.bed, self.args, self.say = bed, args, say
        self.nodes = [bed.node(n) for n in ("node-a", "node-b", "node-c")]
        self.spare = bed.node("node-d")
        self.port = 29500
        self.digests: list[str] = []
        self.losses: list[list[str]] = []
        self.exact = True

    def train(self, *extra: str) -> list[str]:
        a = self.args
        return [
            "--steps",
            str(a.steps),
            "--step-time",
            str(a.step_time),
            "--ballast-mb",
            str(a.ballast_mb),
            "--hidden",
            str(a.hidden),
            *extra,
        ]

    def start(self, prefix: str, nodes: list[Any], *extra: str) -> list[str]:
        from agent.testing.ranks import start_job

        self.port += 1
        return start_job(nodes, "bench", self.port, self.train(*extra), prefix=prefix)

    def finish(self, names: list[str], nodes: list[Any], code: int = 0, exact: bool = True) -> list[str]:
        """Wait for every rank and return their logs, checking exit codes; at the end, that each
        rank's parameters are the undisturbed run's (exact: bit for bit; else its last loss to 6
        decimals, and self.exact says whether the bits matched too)."""
        logs = []
        for name, node in zip(names, nodes, strict=True):
            j = node.wait_exited(name, timeout_s=self.args.steps * (self.args.step_time + 1) + 300)
            log = node.cli("logs", name).stdout
            if j["exit_code"] != code:
                tail = node.cli("logs", name).stderr[-1500:]
                raise BenchError(f"{name} on {node.node} exited {j['exit_code']}, not {code}:\n{tail}")
            logs.append(log)
        if code != 0:
            return logs
        # Each rank's own ballast is in its digest: rank by rank, as in the undisturbed run.
        digests = [m[1] for log in logs for m in DIGEST.finditer(log)]
        losses = [LOSS.findall(log)[-1:] for log in logs]
        if not self.digests:
            self.digests, self.losses = digests, losses
        self.exact = digests == self.digests
        if not self.exact and (exact or losses != self.losses):
            raise BenchError(f"the ranks' final parameters {digests} differ from the undisturbed run's")
        return logs

    def undisturbed(self) -> dict[str, Any]:
        from agent.testing.ranks import stamps

        self.say("undisturbed run")
        names = self.start("ref", self.nodes)
        logs = self.finish(names, self.nodes)
        return {"wall_s": wall_s(stamps(logs[0]), stamps(logs[0]))}

    def ferry(self, method: str = "default") -> dict[str, Any]:
        from agent.testing.ranks import longest_gap, stamps

        self.say(f"ferry: rank 1 moves to the spare at step {self.args.fail_at} ({method})")
        names = self.start(f"mv{self.port}", self.nodes)
        b = self.nodes[1]
        b.wait_log(names[1], rf"^step {self.args.fail_at} ", timeout_s=600)
        asked = time.time()
        how = () if method == "default" else (f"--{method}",)
        moved = json.loads(b.cli("migrate", names[1], "--to", self.spare.address, *how, "--json").stdout)
        answered = time.time()
        where = [self.nodes[0], self.spare, self.nodes[2]]
        logs = self.finish(names, where)
        # The answer comes once the group's pause was measured (up to 12 s after the move).
        gap = max(longest_gap(logs[r], asked, answered) for r in (0, 2))
        # The moved rank's own (its log came with it): after a post-copy release it steps again
        # only once the pages its next step touches are in, and its peers cannot step before it.
        own = longest_gap(logs[1], asked, answered)
        step = max(median_step(stamps(logs[r])) for r in (0, 2))
        pause, met = pause_target(gap, step, moved["frozen_s"])
        return {
            "wall_s": wall_s(stamps(logs[0]), stamps(logs[0])),
            "frozen_s": moved["frozen_s"],
            "group_pause_s": moved.get("group_pause_s"),
            "group_pause_by": moved.get("group_pause_by", ""),
            "peers_gap_s": gap,
            "moved_gap_s": own,
            "step_s": step,
            "peers_pause_s": pause,
            "pause_target_met": met,
            "image_bytes": moved["image_bytes"],
            "method": moved.get("method", ""),
            "recomputed_steps": 0,
            "bit_identical": self.exact,
        }

    def restart(self, k: int) -> dict[str, Any]:
        from agent.testing.ranks import stamps

        a = self.args
        self.say(
            f"checkpoint-restart: checkpoint at step {a.fail_at - k}, every rank fails at step {a.fail_at}"
        )
        ckpt = self.bed.shared / f"ckpt-k{k}"
        ckpt.mkdir()
        save = ("--save-dir", str(ckpt))
        names = self.start(
            f"k{k}", self.nodes, *save, "--save-at", str(a.fail_at - k), "--exit-at", str(a.fail_at)
        )
        before = self.finish(names, self.nodes, code=3)
        # The job's scheduler restarts every rank at once, the failed rank 1 on the spare.
        where = [self.nodes[0], self.spare, self.nodes[2]]
        again = self.start(f"k{k}b", where, *save, "--resume")
        # A restarted 3-rank DDP job ends a few bits off an undisturbed one (its losses agree to
        # 6 decimals): its new processes sum gradients in another order. Only the moved one is exact.
        after = self.finish(again, where, exact=False)
        first, last = stamps(before[0]), stamps(after[0])
        resumed_from = int(re.search(r"^resumed at step (\d+)", after[0], re.M)[1])  # type: ignore[index]
        gap = last[0] - first[-1]
        return {
            "wall_s": wall_s(first, last),
            "restart_s": gap,
            "recomputed_steps": a.fail_at + 1 - resumed_from,
            "checkpoint_bytes": sum(f.stat().st_size for f in ckpt.iterdir()),
            "bit_identical": self.exact,
        }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_ranks.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=120, help="training steps per run (default 120)")
    p.add_argument("--step-time", type=float, default=0.25, help="seconds each step sleeps (default 0.25)")
    p.add_argument("--ballast-mb", type=int, default=256, help="MiB of live state per rank (default 256)")
    p.add_argument(
        "--hidden",
        type=int,
        default=64,
        help="the model's hidden width, passed to train_ddp.py: each step's allreduce carries 136 "
        "bytes per unit (default 64)",
    )
    p.add_argument(
        "--ferry-only",
        action="store_true",
        help="only the undisturbed run and the move (no checkpoint-restart runs, no projection)",
    )
    p.add_argument(
        "--fail-at", type=int, default=100, help="the step at which a rank fails or moves (default 100)"
    )
    p.add_argument(
        "--interval-steps",
        type=int,
        default=180,
        help="steps between checkpoints at a realistic interval: 180 is 30 min at 10 s a step "
        "(default); the expected K is half of it",
    )
    p.add_argument(
        "--interval-min",
        type=float,
        default=30.0,
        help="the checkpoint interval of the projected large job, in minutes (default 30)",
    )
    p.add_argument(
        "--gpu-move-s",
        type=float,
        default=120.0,
        help="the modelled time to move one H200 rank today (docs/performance.md, default 120 s), "
        "for a second projection",
    )
    p.add_argument(
        "--move-methods",
        type=methods,
        default=["default"],
        help="how the move carries rank 1's memory, one run each, in this order: default (what "
        "`ferry migrate` picks), pre-copy, post-copy (default: default). The projection uses the "
        "first",
    )
    p.add_argument("--json", type=Path, default=OUT, help=f"where to write the figures (default {OUT})")
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()), help="where the bed lives")
    return p


MOVE_METHODS = ("default", "pre-copy", "post-copy")


def move_label(method: str) -> str:
    return "ferry: move rank 1" + ("" if method == "default" else f", {method}")


def methods(text: str) -> list[str]:
    out = [m.strip() for m in text.split(",") if m.strip()]
    if not out or (bad := set(out) - set(MOVE_METHODS)):
        raise argparse.ArgumentTypeError(f"{sorted(bad) or text!r}: not among {', '.join(MOVE_METHODS)}")
    return list(dict.fromkeys(out))


def preflight(args: argparse.Namespace) -> None:
    if os.geteuid() != 0:
        raise BenchError("needs root: the bed creates network namespaces and CRIU dumps processes")
    if shutil.which("ip") is None:
        raise BenchError("`ip` (iproute2) is missing: apt-get install iproute2")
    k = args.interval_steps // 2
    if args.ferry_only and not 0 < args.fail_at < args.steps - 1:
        raise BenchError(f"need 0 < --fail-at ({args.fail_at}) < --steps-1 ({args.steps - 1})")
    if not args.ferry_only and not 0 < k <= args.fail_at < args.steps - 1:
        raise BenchError(
            f"need 0 < --interval-steps/2 ({k}) <= --fail-at ({args.fail_at}) < --steps-1 ({args.steps - 1})"
        )
    require_criu()


def require_criu() -> None:
    from agent import config
    from agent.errors import FerryError

    try:
        config.criu_binary()
    except FerryError as e:
        raise BenchError(f"CRIU not found: {e}") from e


def run(args: argparse.Namespace, say: Progress) -> dict[str, Any]:
    preflight(args)
    from bench_migrate import PIPE_MAX, allow_lazy_dumps

    from agent.testing.bed import node_bed

    k = args.interval_steps // 2
    root = Path(tempfile.mkdtemp(prefix="ferry-bench-ranks-", dir=args.workdir))
    # Post-copy (the default's first choice) needs it where the agent lacks CAP_SYS_RESOURCE.
    old_pipe_max = allow_lazy_dumps(say) if set(args.move_methods) - {"pre-copy"} else None
    try:
        with node_bed(root) as bed:
            r = Runs(bed, args, say)
            runs = {"undisturbed": r.undisturbed()}
            for m in args.move_methods:
                runs[move_label(m)] = r.ferry(m)
            if not args.ferry_only:
                runs["checkpoint-restart, K=0"] = r.restart(0)
                runs[f"checkpoint-restart, K={k}"] = r.restart(k)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if old_pipe_max is not None:
            PIPE_MAX.write_text(old_pipe_max)
    ref = runs["undisturbed"]["wall_s"]
    for v in runs.values():
        v["lost_s"] = v["wall_s"] - ref
    if args.ferry_only:
        return {
            "args": {k: str(v) for k, v in vars(args).items()},
            "runs": runs,
            "projections": {},
            "report": format_report(runs, {}),
        }
    move = runs[move_label(args.move_methods[0])]["lost_s"]
    restart = runs["checkpoint-restart, K=0"]["lost_s"]
    interval = args.interval_min * 60
    projections = {
        f"move {move:.1f} s (measured), restart {restart:.1f} s (measured), checkpoints every "
        f"{args.interval_min:g} min": project(restart, interval, move),
        f"move {args.gpu_move_s:g} s (an H200 rank today, modelled), restart {restart:.1f} s, "
        f"checkpoints every {args.interval_min:g} min": project(restart, interval, args.gpu_move_s),
    }
    return {
        "args": {k: str(v) for k, v in vars(args).items()},
        "runs": runs,
        "projections": {t: [asdict(p) for p in rows] for t, rows in projections.items()},
        "report": format_report(runs, projections),
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    say = Progress()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # the bed comes down on SIGTERM too
    try:
        results = run(args, say)
    except BenchError as e:
        print(f"bench_ranks: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench_ranks: interrupted", file=sys.stderr)
        return 130
    print(results["report"])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
