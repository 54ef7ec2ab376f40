"""`make bench-stragglers` (also in `make bench`): how fast and how surely ferry finds the member
that holds its group back, and what moving it is worth.

On the multi-node bed (agent/testing/bed.py), a 3-rank gloo job (scripts/workloads/train_ddp.py,
no sleep between steps, --hidden wide enough that a step computes for tens of milliseconds) runs
on node-a, node-b and node-c; node-d is a spare. Every agent samples its members each second and
judges over --window seconds with a margin of 0.3. A slowed node is a CFS quota of --quota of
one CPU on its member's process (agent/testing/cpuquota.py).

  detection   on_straggler = "alert" (nothing moves). --runs episodes in which node-b's member
              is slowed for --window + 10 s, then released until its verdict ends: the time to
              the verdict is from the quota to node-b's straggler event. Then --runs episodes of
              the same length with no quota: each is a false positive if any agent names a
              straggler in it.
  effect      a --steps-step job whose node-b member is slowed from step 30 to its end: left in
              place (alert) against moved (migrate), and the undisturbed job: wall times.

Needs root, CRIU (`make criu`), `ip` and cgroup CPU bandwidth control.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OUT = Path("bench-results") / "stragglers.json"
MARGIN = 0.3


def config(index: int, policy: str, window_s: float) -> str:
    peers = "".join(
        f'[[peers]]\naddress = "10.98.0.{i}:7070"\nspare = {str(i == 4).lower()}\n'
        for i in range(1, 5)
        if i != index
    )
    head = f'[policy]\non_straggler = "{policy}"\n[stragglers]\nsample_s = 1\nwindow_s = {window_s:g}\n'
    return head + f"margin = {MARGIN}\n" + peers


def said(node: Any, since: float) -> list[dict]:
    """The straggler verdicts node's agent recorded after `since` (not their ends)."""
    got = json.loads(node.cli("events", "--json", "--limit", "1000").stdout)
    return [
        e
        for e in got
        if e["kind"] == "straggler" and e["time"] >= since and "no longer holds" not in e["message"]
    ]


def train(hidden: int, steps: int) -> list[str]:
    return ["--steps", str(steps), "--step-time", "0", "--hidden", str(hidden)]


def wall(node: Any, name: str) -> float:
    from agent.testing.ranks import stamps

    t = stamps(node.cli("logs", name).stdout)
    return t[-1] - t[0]


def detection(bed: Any, args: argparse.Namespace, say: Any) -> dict[str, Any]:
    from agent.testing.cpuquota import CpuQuota
    from agent.testing.ranks import start_job

    a, b, c = bed.agents[:3]
    job = start_job([a, b, c], "det", 29500, train(args.hidden, 10**7))
    a.wait_log(job[0], r"^step 30 ", 240)
    slow = CpuQuota(f"{bed.tag}-det")
    slow.add(b.job(job[1])["pid"])
    episode = args.window + 10
    verdicts: list[float | None] = []
    false: list[int] = []
    try:
        time.sleep(args.window + 2)  # every member sampled over a whole window first
        for i in range(args.runs):
            t0 = time.time()
            slow.set(args.quota)
            first = None
            while time.time() < t0 + episode:
                time.sleep(0.5)
                got = said(b, t0)
                if got and first is None:
                    first = got[0]["time"] - t0
            slow.lift()
            verdicts.append(first)
            say(
                f"slowed episode {i + 1}/{args.runs}: "
                + (f"verdict after {first:.1f} s" if first else "no verdict")
            )
            time.sleep(args.window + 3)  # the verdict ends before the next episode
        for i in range(args.runs):
            t0 = time.time()
            time.sleep(episode)
            n = sum(len(said(x, t0)) for x in (a, b, c))
            false.append(n)
            say(f"unslowed episode {i + 1}/{args.runs}: {n} verdict(s)")
    finally:
        slow.close()
        for name, node in zip(job, (a, b, c), strict=True):
            node.cli("stop", name, check=False)
    found = [v for v in verdicts if v is not None]
    return {
        "slowed_episodes": args.runs,
        "found": len(found),
        "time_to_verdict_s": found,
        "time_to_verdict_median_s": statistics.median(found) if found else None,
        "time_to_verdict_max_s": max(found) if found else None,
        "unslowed_episodes": args.runs,
        "false_positive_episodes": sum(1 for n in false if n),
    }


def effect(bed: Any, args: argparse.Namespace, label: str, slowed: bool, say: Any) -> dict[str, Any]:
    from agent.testing.cpuquota import CpuQuota
    from agent.testing.ranks import start_job

    a, b, c = bed.agents[:3]
    port = {"calm": 29510, "kept": 29520, "moved": 29530}[label]
    job = start_job([a, b, c], label, port, train(args.hidden, args.steps))
    a.wait_log(job[0], r"^step 30 ", 240)
    slow = CpuQuota(f"{bed.tag}-{label}")
    try:
        if slowed:
            slow.add(b.job(job[1])["pid"])
            slow.set(args.quota)
        a.wait_exited(job[0], 1800)
    finally:
        slow.close()
    took = wall(a, job[0])
    moved = [e["message"] for e in json.loads(b.cli("events", "--json").stdout) if e["kind"] == "migration"]
    say(f"{label}: {took:.1f} s" + (f" ({moved[-1]})" if moved else ""))
    return {"wall_s": took, "moves": moved}


def run(args: argparse.Namespace, say: Any) -> dict[str, Any]:
    from agent.testing.bed import node_bed

    out: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    root = Path(tempfile.mkdtemp(prefix="ferry-bench-stragglers-", dir=args.workdir))
    try:
        for policy in ("alert", "migrate"):
            with node_bed(root / policy) as bed:
                for i, n in enumerate("abcd", 1):
                    bed.node(f"node-{n}", config=config(i, policy, args.window))
                if policy == "alert":
                    if not args.effect_only:
                        out["detection"] = detection(bed, args, say)
                    out["undisturbed"] = effect(bed, args, "calm", False, say)
                    out["left in place"] = effect(bed, args, "kept", True, say)
                else:
                    out["moved"] = effect(bed, args, "moved", True, say)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out["report"] = report(out, args)
    return out


def report(out: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"stragglers: window {args.window:g} s, margin {MARGIN:.0%}, slowed node at {args.quota:.0%} of a CPU"
    ]
    if d := out.get("detection"):
        med = d["time_to_verdict_median_s"]
        lines.append(
            f"detection: found {d['found']} of {d['slowed_episodes']} slowed episodes, time to verdict "
            + (f"median {med:.1f} s, max {d['time_to_verdict_max_s']:.1f} s" if med is not None else "-")
            + f"; false positives in {d['false_positive_episodes']} of {d['unslowed_episodes']} "
            + "unslowed episodes"
        )
    base = out["undisturbed"]["wall_s"]
    for k in ("undisturbed", "left in place", "moved"):
        w = out[k]["wall_s"]
        lines.append(f"{k:<14} {w:7.1f} s  {w / base:5.2f}x the undisturbed job")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="bench_stragglers.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--runs", type=int, default=10, help="slowed episodes, and as many unslowed (default 10)")
    p.add_argument("--window", type=float, default=8.0, help="the straggler window, seconds (default 8)")
    p.add_argument(
        "--quota", type=float, default=0.25, help="the slowed node's share of a CPU (default 0.25)"
    )
    p.add_argument("--steps", type=int, default=600, help="steps of each effect run (default 600)")
    p.add_argument("--hidden", type=int, default=16384, help="the model's hidden width (default 16384)")
    p.add_argument("--effect-only", action="store_true", help="skip the detection episodes")
    p.add_argument(
        "--workdir", type=Path, default=None, help="where the bed's files go (default: the system's temp)"
    )
    p.add_argument("--json", type=Path, default=OUT, help=f"where to write the figures (default {OUT})")
    args = p.parse_args(argv)
    if not 0 < args.quota < 1 or args.runs < 1 or args.window < 3:
        p.error("--quota must be between 0 and 1, --runs at least 1, --window at least 3 s")

    def say(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # the bed comes down on SIGTERM too
    try:
        results = run(args, say)
    except KeyboardInterrupt:
        print("bench_stragglers: interrupted", file=sys.stderr)
        return 130
    print(results["report"])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
