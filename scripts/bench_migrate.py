"""`make bench`: how long a training job stops when it moves, with ferry and without.

For jobs holding S GiB of live training state (scripts/workloads/train_sized.py), all on
this machine and in one run, it measures:

  ferry               `ferry migrate --pre-copy` between two real agents on loopback
                      (mutual TLS); lazy: `ferry migrate --post-copy`, the default method
  plain CRIU          `criu dump` to a directory on disk, `cp -a` of that directory,
                      `criu restore -d` from the copy: CRIU as people use it by hand
  checkpoint-restart  the job torch.saves model and optimizer and exits; a fresh
                      process imports torch, torch.loads it and continues
  copy bound          the image's bytes over the memory-copy bandwidth measured here,
                      into fresh memory and into memory already touched

Per method and size: downtime (first step after the move - last step before it - one
normal step), total time (move requested -> first step after it), bytes moved and
bytes / total time. The methods run interleaved per size (ferry, plain CRIU,
checkpoint-restart, then again for --repeat) so that they see similar conditions; the
figures reported are medians over the repeats. Needs root and CRIU (`make criu`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

WORKLOAD = REPO / "scripts" / "workloads" / "train_sized.py"
OUT_DIR = Path("bench-results")
METHODS = ("ferry", "criu", "ckpt", "staged", "lazy")
#: "ferry" is ferry's pre-copy (`ferry migrate --pre-copy`); "lazy" its post-copy, the default
#: (`ferry migrate --post-copy`, which does not fall back); "staged" is ferry before memory
#: streaming (`ferry migrate --staged`): what streaming bought.
LABELS = {
    "ferry": "ferry --pre-copy",
    "criu": "plain CRIU",
    "ckpt": "checkpoint-restart",
    "staged": "ferry --staged",
    "lazy": "ferry (post-copy)",
}
#: The ferry variants: their migrate flag.
FERRY_FLAGS = {"ferry": ("--pre-copy",), "staged": ("--staged",), "lazy": ("--post-copy",)}
GIB = 1 << 30
#: Step intervals (the last ones before the move) whose median is "one normal step".
STEP_WINDOW = 8
#: Freed memory is handed back to the hypervisor after about 2 s on some VMs; waiting
#: longer before each fresh-memory copy measures what a restore on such a host pays.
FRESH_PAUSE_S = 3.0
COPY_TRIALS = 3
#: This VM backs memory that has been free for a while at a fraction of the copy rate; a second
#: node's memory is such memory. The floor's probe starts after at least this long idle...
IDLE_PAUSE_S = 12.0
#: ...and writes chunks of this size until it has written this much memory the host had
#: reclaimed: a chunk written below this fraction of the first chunk's rate.
IDLE_CHUNK = 64 << 20
IDLE_SAMPLE_MAX = 2 * GIB
RECLAIMED_FRACTION = 1 / 3
#: What the probe leaves free of the memory available when it starts.
IDLE_MARGIN_BYTES = 4 * GIB
#: The copy-bandwidth buffers are sized like the image, but no larger than this.
COPY_MAX_BYTES = 4 * GIB
STEP_RE = re.compile(r"^step (\d+) t=([0-9.]+)", re.M)


class BenchError(Exception):
    """A failure reported as one line (plus, for CRIU, the tail of its log) and exit status 1."""


# -- pure parts: parsing, downtime, medians, ratios, the table ---------------------------


def parse_steps(text: str) -> list[tuple[int, float]]:
    """The `step <i> t=<unix time>` lines of a job's output, as (i, t), in output order."""
    return [(int(m[1]), float(m[2])) for m in STEP_RE.finditer(text)]


def normal_step_s(steps: list[tuple[int, float]], window: int = STEP_WINDOW) -> float:
    """Median interval between consecutive steps over the last `window` intervals."""
    gaps = [t1 - t0 for (i0, t0), (i1, t1) in itertools.pairwise(steps) if i1 == i0 + 1]
    if not gaps:
        raise ValueError("need at least two consecutive steps before the move")
    return statistics.median(gaps[-window:])


def measure_gap(before: str, after: str, requested_at: float) -> dict[str, Any]:
    """The gap a move left in a job's output.

    `before` is what the job printed before it moved (its old process's output, read
    once that process is gone), `after` what it printed since (the new process's output;
    it may repeat `before`, as ferry's moved log does). The first step after the move is
    the first step in `after` numbered past the last step in `before`.
    """
    old = parse_steps(before)
    if not old:
        raise ValueError("no step lines before the move")
    last_i, last_t = old[-1]
    new = [(i, t) for i, t in parse_steps(after) if i > last_i]
    if not new:
        raise ValueError(f"no step after step {last_i} in the output after the move")
    first_i, first_t = new[0]
    step = normal_step_s(old)
    return {
        "last_step_before": last_i,
        "last_step_before_t": last_t,
        "first_step_after": first_i,
        "first_step_after_t": first_t,
        "steps_skipped": first_i - last_i - 1,
        "step_s": step,
        "gap_s": first_t - last_t,
        "downtime_s": first_t - last_t - step,
        "total_s": first_t - requested_at,
    }


def steps_after(after: str, before: str) -> int:
    """How many steps `after` holds that are numbered past the last step in `before`."""
    old = parse_steps(before)
    last = old[-1][0] if old else -1
    return sum(1 for i, _ in parse_steps(after) if i > last)


def gbps(nbytes: float, seconds: float) -> float | None:
    return nbytes / seconds / 1e9 if seconds > 0 else None


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-key median of the repeats' numbers (nested dicts such as ferry's phases too)."""
    out: dict[str, Any] = {}
    if not runs:
        return out
    for key in runs[0]:
        values = [r[key] for r in runs if key in r]
        if all(isinstance(v, dict) for v in values):
            out[key] = median_run(values)
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            out[key] = statistics.median(values)
        else:
            nums = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
            out[key] = statistics.median(nums) if nums and len(nums) == len(values) else values[-1]
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def size_summary(
    gib: float, runs: dict[str, list[dict[str, Any]]], bandwidth: dict[str, Any]
) -> dict[str, Any]:
    """Medians per method, the copy bound for the image's bytes, and the ratios between them."""
    med = {m: median_run(r) for m, r in runs.items() if r}
    image_bytes = next((med[m]["bytes"] for m in METHODS if m in med), 0)
    bound = {
        "bytes": image_bytes,
        "fresh_s": _ratio(image_bytes / 1e9, bandwidth.get("fresh_gbps")),
        "touched_s": _ratio(image_bytes / 1e9, bandwidth.get("touched_gbps")),
        "floor_s": _ratio(image_bytes / 1e9, bandwidth.get("idle_gbps")),
    }
    down = {m: med[m]["downtime_s"] for m in med}
    total = {m: med[m]["total_s"] for m in med}
    ratios = {
        "ferry_over_floor": _ratio(down.get("ferry"), bound["floor_s"]),
        "lazy_over_floor": _ratio(down.get("lazy"), bound["floor_s"]),
        "ferry_over_bound_fresh": _ratio(down.get("ferry"), bound["fresh_s"]),
        "ferry_over_bound_touched": _ratio(down.get("ferry"), bound["touched_s"]),
        "criu_over_ferry": _ratio(down.get("criu"), down.get("ferry")),
        "ckpt_over_ferry": _ratio(down.get("ckpt"), down.get("ferry")),
        "total_criu_over_ferry": _ratio(total.get("criu"), total.get("ferry")),
        "total_ckpt_over_ferry": _ratio(total.get("ckpt"), total.get("ferry")),
        "staged_over_ferry": _ratio(down.get("staged"), down.get("ferry")),
        "lazy_over_ferry": _ratio(down.get("lazy"), down.get("ferry")),
        "criu_over_lazy": _ratio(down.get("criu"), down.get("lazy")),
        "ckpt_over_lazy": _ratio(down.get("ckpt"), down.get("lazy")),
    }
    return {"gib": gib, "median": med, "bandwidth": bandwidth, "bound": bound, "ratios": ratios}


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def format_table(summaries: list[dict[str, Any]]) -> str:
    """The stdout report: per size, one row per method and the bound, then the ratios."""
    head = ["SIZE", "METHOD", "DOWNTIME", "TOTAL", "BYTES", "GB/S"]
    rows: list[list[str]] = []
    notes: list[str] = []
    for s in summaries:
        size = f"{s['gib']:g} GiB"
        for m in METHODS:
            if m not in s["median"]:
                continue
            r = s["median"][m]
            rows.append(
                [
                    size,
                    LABELS[m],
                    f"{r['downtime_s']:.2f} s",
                    f"{r['total_s']:.2f} s",
                    f"{r['bytes'] / 1e9:.2f} GB",
                    _num(r.get("gbps"), ".2f"),
                ]
            )
        b, bw = s["bound"], s["bandwidth"]
        bounds = (
            ("floor", "idle", "floor (one write, idle memory)"),
            ("fresh", "fresh", "copy bound (fresh)"),
            ("touched", "touched", "copy bound (pre-touched)"),
        )
        for kind, rate, label in bounds:
            rows.append(
                [
                    size,
                    label,
                    _num(b.get(f"{kind}_s"), ".2f") + " s",
                    "",
                    f"{b['bytes'] / 1e9:.2f} GB",
                    _num(bw.get(f"{rate}_gbps"), ".2f"),
                ]
            )
        r = s["ratios"]
        notes.append(
            f"{size}: downtime post-copy/floor {_num(r.get('lazy_over_floor'), '.2f')}x, "
            f"pre-copy/floor {_num(r.get('ferry_over_floor'), '.2f')}x; "
            f"plain CRIU/post-copy {_num(r.get('criu_over_lazy'), '.1f')}x, "
            f"checkpoint-restart/post-copy {_num(r.get('ckpt_over_lazy'), '.1f')}x; "
            f"post-copy/pre-copy {_num(r.get('lazy_over_ferry'), '.2f')}x; "
            f"pre-copy/copy bound {_num(r['ferry_over_bound_fresh'], '.1f')}x (fresh), "
            f"{_num(r['ferry_over_bound_touched'], '.1f')}x (pre-touched); "
            f"plain CRIU/pre-copy {_num(r['criu_over_ferry'], '.1f')}x; "
            f"checkpoint-restart/pre-copy {_num(r['ckpt_over_ferry'], '.1f')}x; "
            f"ferry --staged/pre-copy {_num(r['staged_over_ferry'], '.1f')}x"
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [head, *rows]
    ]
    return "\n".join([*lines, "", *notes])


def parse_sizes(text: str) -> list[float]:
    try:
        sizes = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}") from None
    if not sizes or any(s <= 0 for s in sizes):
        raise argparse.ArgumentTypeError(f"sizes must be positive GiB values: {text!r}")
    return sizes


def parse_methods(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise argparse.ArgumentTypeError(f"methods are a comma-separated subset of {','.join(METHODS)}")
    return [m for m in METHODS if m in methods]


# -- measuring -------------------------------------------------------------------------


class Progress:
    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def __call__(self, text: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.1f}s] {text}", file=sys.stderr, flush=True)


def wait_until(
    pred: Callable[[], Any], timeout_s: float, what: str, alive: Callable[[], bool] = lambda: True
) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := pred():
            return value
        if not alive():
            raise BenchError(f"the job died while waiting for {what}")
        time.sleep(0.2)
    raise BenchError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is gone for our purposes.
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def kill_and_wait(pid: int, timeout_s: float = 30.0) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def dir_bytes(path: Path, skip_suffix: str = ".log") -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.name.endswith(skip_suffix))


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(cannot read {path}: {e.strerror})"


def read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def timeouts(gib: float) -> dict[str, float]:
    """Generous limits that grow with the job's size (cold starts on a slow VM included)."""
    return {"warm": 120 + 60 * gib, "move": 120 + 120 * gib, "after": 60 + 30 * gib}


class Bench:
    def __init__(self, args: argparse.Namespace, criu: str, say: Progress) -> None:
        self.args = args
        self.criu = criu
        self.say = say
        self.work = Path(tempfile.mkdtemp(prefix="ferry-bench-", dir=args.workdir))
        self.root = Path(tempfile.mkdtemp(prefix="ferry-bench-agents-"))
        self.no_plugins = Path(tempfile.mkdtemp(prefix="ferry-bench-no-plugins-"))
        self.agents: list[Any] = []
        self.pids: set[int] = set()
        self.seq = 0

    # -- lifecycle

    def start_agents(self) -> None:
        from agent import certs
        from agent.testing.localcluster import LocalAgent

        pki = self.root / "pki"
        certs.create_ca(pki)
        for node in ("node-a", "node-b"):
            certs.issue(pki, node, certs.Role.NODE, ["127.0.0.1"])
        self.agents = [LocalAgent(self.root, n, tls_dir=pki) for n in ("node-a", "node-b")]
        for a in self.agents:
            try:
                a.start()
            except RuntimeError as e:
                raise BenchError(f"cannot start the ferry agent {a.node}: {str(e).splitlines()[0]}") from e
        self.say(
            f"agents node-a at {self.agents[0].address}, node-b at {self.agents[1].address} (mutual TLS)"
        )

    def close(self) -> None:
        for pid in self.pids:
            kill_and_wait(pid, 5)
        for a in self.agents:
            with contextlib.suppress(Exception):
                a.kill_jobs()
            with contextlib.suppress(Exception):
                a.stop()
            with contextlib.suppress(Exception):
                a.cleanup()
        for d in (self.work, self.root, self.no_plugins):
            shutil.rmtree(d, ignore_errors=True)

    # -- helpers

    def workload(self, gib: float, *extra: str) -> list[str]:
        return [sys.executable, str(WORKLOAD), "--gib", f"{gib:g}", *extra]

    def spawn(self, cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
        """A job as people start one by hand: its own session, no terminal, output to a file."""
        with open(log, "ab") as out:
            p = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True, cwd=self.work
            )
        self.pids.add(p.pid)
        return p

    def warm_up(self, read_log: Callable[[], str], gib: float, alive: Callable[[], bool]) -> None:
        n = self.args.warmup_steps
        wait_until(lambda: len(parse_steps(read_log())) >= n, timeouts(gib)["warm"], f"{n} steps", alive)

    def wait_after(
        self, read_after: Callable[[], str], before: str, gib: float, alive: Callable[[], bool]
    ) -> str:
        n = self.args.after_steps
        wait_until(
            lambda: steps_after(read_after(), before) >= n,
            timeouts(gib)["after"],
            f"{n} steps after the move",
            alive,
        )
        return read_after()

    def gap(
        self, before: str, after: str, requested_at: float, what: str, hold_s: float = 0.0
    ) -> dict[str, Any]:
        """The move's gap; time the bench spent holding memory (below) is not the method's."""
        try:
            rec = measure_gap(before, after, requested_at)
        except ValueError as e:
            raise BenchError(f"{what}: {e}") from e
        rec["downtime_s"] -= hold_s
        rec["total_s"] -= hold_s
        return rec

    def hold(self, nbytes: int) -> tuple[Any, float]:
        """HOLD: take and touch `nbytes` of memory right after the source process ended.

        All three methods run on one host here. When plain CRIU's dump kills the job, or
        the checkpointing job exits, the memory it frees would stay on the source node of a
        real move; on one host the copy and the restore would reuse it instead. Many VMs
        (this one included) charge a host fault for memory that was free a while, and the
        kernel zeroes it everywhere, so that reuse is a discount a second node never gives.
        ferry keeps its source copy frozen until the target runs, so it gets no such
        discount. Holding the freed memory takes the discount away; the seconds spent
        taking it are subtracted from the method's times.
        """
        if not self.args.hold or nbytes <= 0:
            return None, 0.0
        import torch

        t = time.monotonic()
        held = torch.ones(nbytes, dtype=torch.uint8)  # touches every page
        return held, time.monotonic() - t

    # -- (a) ferry

    def run_ferry(self, gib: float, rep: int, method: str = "ferry") -> dict[str, Any]:
        a, b = self.agents
        name = f"bench-{gib:g}g-{rep}-{method}".replace(".", "_")
        self.say(f"  ferry: starting the job on node-a ({name})")
        try:
            job = json.loads(a.cli("run", "--name", name, "--json", "--", *self.workload(gib)).stdout)
            src_log = Path(job["stdout_path"])
            alive = lambda: pid_alive(job["pid"])  # noqa: E731
            self.warm_up(lambda: read(src_log), gib, alive)
            self.say(f"  ferry: {self.args.warmup_steps} steps done; ferry migrate {name} --to node-b")
            requested = time.time()
            res = a.cli(
                "migrate",
                name,
                "--to",
                b.address,
                "--json",
                *FERRY_FLAGS[method],
                check=False,
                timeout_s=timeouts(gib)["move"],
            )
            done = time.time()
            if res.returncode != 0:
                tails = "\n".join(f"{x.log_path} ends:\n{log_tail(x.log_path, 8)}" for x in self.agents)
                raise BenchError(
                    f"ferry migrate failed ({res.returncode}): {res.stderr.strip()[-1500:]}\n{tails}"
                )
            result = json.loads(res.stdout)
            before = read(src_log)
            self.say(
                f"  ferry: moved in {done - requested:.2f} s; "
                f"waiting for {self.args.after_steps} steps on node-b"
            )
            moved = next((j for j in json.loads(b.cli("ps", "--json").stdout) if j["name"] == name), None)
            if moved is None:
                raise BenchError(f"ferry migrate succeeded but node-b does not list job {name}")
            dst_log = Path(moved["stdout_path"])
            after = self.wait_after(lambda: read(dst_log), before, gib, lambda: pid_alive(moved["pid"]))
        finally:
            for agent in self.agents:
                with contextlib.suppress(Exception):
                    agent.kill_jobs()
        rec = self.gap(before, after, requested, "ferry")
        rec.update(
            bytes=result["image_bytes"],
            command_s=done - requested,
            phases_s=result["phases_s"],
            ferry_downtime_s=result["downtime_s"],
            ferry_frozen_s=result["frozen_s"],
            ferry_result=result,
        )
        rec["gbps"] = gbps(rec["bytes"], rec["total_s"])
        return rec

    # -- (b) plain CRIU

    def criu_cmd(self, *args: str, log: Path, what: str, timeout_s: float) -> float:
        env = {**os.environ, "CRIU_LIBS_DIR": str(self.no_plugins)}
        t = time.monotonic()
        try:
            p = subprocess.run(
                [self.criu, *args], env=env, capture_output=True, text=True, timeout=timeout_s, check=False
            )
        except subprocess.TimeoutExpired:
            raise BenchError(
                f"{what} timed out after {timeout_s:.0f} s; its log ends:\n{log_tail(log)}"
            ) from None
        if p.returncode != 0:
            raise BenchError(
                f"{what} failed ({p.returncode}): {p.stderr.strip()[-300:]}; {log} ends:\n{log_tail(log)}"
            )
        return time.monotonic() - t

    def run_criu(self, gib: float, rep: int) -> dict[str, Any]:
        tag = f"criu-{gib:g}g-{rep}"
        out = self.work / f"{tag}.out"
        dump, copy = self.work / f"{tag}-dump", self.work / f"{tag}-copy"
        dump.mkdir()
        limit = timeouts(gib)["move"]
        self.say(f"  plain CRIU: starting the job (setsid, output to {out.name})")
        job = self.spawn(self.workload(gib), out)
        pid = job.pid
        restored = False
        held: Any = None
        try:
            self.warm_up(lambda: read(out), gib, lambda: job.poll() is None)
            rss = tree_rss(pid)
            self.say(f"  plain CRIU: criu dump -t {pid} -D {dump}")
            requested = time.time()
            common = ["-v4", "--ghost-limit", "2G"]
            dump_s = self.criu_cmd(
                "dump", "-t", str(pid), "-D", str(dump), "-o", "dump.log", *common,
                log=dump / "dump.log", what="criu dump", timeout_s=limit,
            )  # fmt: skip
            job.wait()  # reap it, or the restore cannot have its pid back
            held, hold_s = self.hold(rss)
            before = read(out)
            nbytes = dir_bytes(dump)
            self.say(f"  plain CRIU: dumped {nbytes / 1e9:.2f} GB in {dump_s:.2f} s; cp -a to {copy.name}")
            t = time.monotonic()
            cp = subprocess.run(
                ["cp", "-a", str(dump), str(copy)], capture_output=True, text=True, check=False
            )
            if cp.returncode != 0:
                raise BenchError(f"cp -a {dump} {copy} failed: {cp.stderr.strip()}")
            copy_s = time.monotonic() - t
            self.say(f"  plain CRIU: copied in {copy_s:.2f} s; criu restore -D {copy.name} -d")
            restored = True
            restore_s = self.criu_cmd(
                "restore", "-D", str(copy), "-d", "-o", "restore.log", *common,
                log=copy / "restore.log", what="criu restore", timeout_s=limit,
            )  # fmt: skip
            self.say(
                f"  plain CRIU: restored in {restore_s:.2f} s; waiting for {self.args.after_steps} steps"
            )
            after = self.wait_after(lambda: read(out)[len(before) :], before, gib, lambda: pid_alive(pid))
        finally:
            if job.poll() is None:
                job.kill()
                job.wait()
            if restored:
                kill_and_wait(pid)
            self.pids.discard(pid)
            shutil.rmtree(dump, ignore_errors=True)
            shutil.rmtree(copy, ignore_errors=True)
            out.unlink(missing_ok=True)
            del held
        rec = self.gap(before, after, requested, "plain CRIU", hold_s)
        rec.update(bytes=nbytes, dump_s=dump_s, copy_s=copy_s, restore_s=restore_s, hold_s=hold_s)
        rec["gbps"] = gbps(nbytes, rec["total_s"])
        return rec

    # -- (c) checkpoint-restart

    def run_ckpt(self, gib: float, rep: int) -> dict[str, Any]:
        tag = f"ckpt-{gib:g}g-{rep}"
        out, ckpt = self.work / f"{tag}.out", self.work / f"{tag}.pt"
        limit = timeouts(gib)["move"]
        self.say(f"  checkpoint-restart: starting the job (--save {ckpt.name})")
        old = self.spawn(self.workload(gib, "--save", str(ckpt)), out)
        new: subprocess.Popen[bytes] | None = None
        held: Any = None
        try:
            self.warm_up(lambda: read(out), gib, lambda: old.poll() is None)
            rss = tree_rss(old.pid)
            self.say("  checkpoint-restart: SIGUSR1: save at the next step boundary and exit")
            requested = time.time()
            old.send_signal(signal.SIGUSR1)
            try:
                code = old.wait(limit)
            except subprocess.TimeoutExpired:
                raise BenchError(f"checkpoint-restart: the job did not save within {limit:.0f} s") from None
            before = read(out)
            if code != 0 or "\nsaved " not in before:
                raise BenchError(
                    f"checkpoint-restart: the job exited {code} without saving: {before[-300:]!r}"
                )
            held, hold_s = self.hold(rss)
            nbytes = ckpt.stat().st_size
            saved_t = float(re.findall(r"^saved \d+ t=([0-9.]+)", before, re.M)[-1])
            self.say(f"  checkpoint-restart: saved {nbytes / 1e9:.2f} GB; starting a new process (--resume)")
            started = time.time()
            new = self.spawn(self.workload(gib, "--resume", str(ckpt)), out)
            after = self.wait_after(lambda: read(out)[len(before) :], before, gib, lambda: new.poll() is None)
        finally:
            for p in (old, new):
                if p is not None:
                    if p.poll() is None:
                        p.kill()
                    p.wait()
                    self.pids.discard(p.pid)
            ckpt.unlink(missing_ok=True)
            out.unlink(missing_ok=True)
            del held
        rec = self.gap(before, after, requested, "checkpoint-restart", hold_s)
        rec.update(
            bytes=nbytes,
            save_s=saved_t - requested,
            restart_s=rec["first_step_after_t"] - started - hold_s,
            hold_s=hold_s,
        )
        rec["gbps"] = gbps(nbytes, rec["total_s"])
        return rec


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and its descendants."""
    import psutil

    try:
        root = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
    except psutil.Error:
        return 0


# -- the copy bound --------------------------------------------------------------------


def copy_bandwidth(nbytes: int, say: Progress) -> dict[str, Any]:
    """Best-of-N memory copy bandwidth (GB/s) of `nbytes`, into fresh and into pre-touched memory."""
    import torch

    n = max(1 << 20, min(nbytes, COPY_MAX_BYTES))
    src = torch.empty(n, dtype=torch.uint8)
    src.fill_(1)
    fresh, touched = [], []
    for _ in range(COPY_TRIALS):
        time.sleep(FRESH_PAUSE_S)
        dst = torch.empty(n, dtype=torch.uint8)
        t = time.perf_counter()
        dst.copy_(src)
        fresh.append(n / (time.perf_counter() - t) / 1e9)
        del dst
    dst = torch.empty(n, dtype=torch.uint8)
    dst.copy_(src)
    for _ in range(COPY_TRIALS):
        t = time.perf_counter()
        dst.copy_(src)
        touched.append(n / (time.perf_counter() - t) / 1e9)
    del dst, src
    idle = idle_write(n)
    out = {
        "idle_gbps": idle["gbps"],
        "idle": idle,
        "buffer_bytes": n,
        "threads": torch.get_num_threads(),
        "fresh_gbps": max(fresh),
        "touched_gbps": max(touched),
        "fresh_trials_gbps": fresh,
        "touched_trials_gbps": touched,
    }
    say(
        f"  copy bandwidth ({n / GIB:.2f} GiB, {out['threads']} threads): "
        f"fresh {out['fresh_gbps']:.2f} GB/s, "
        f"pre-touched {out['touched_gbps']:.2f} GB/s (best of {COPY_TRIALS}); "
        f"one write into idle memory ({idle['kind']}): {_num(idle['gbps'], '.2f')} GB/s "
        f"(the first {idle['backed_bytes'] / 1e9:.1f} GB of fresh memory was still backed, "
        f"{_num(idle['backed_gbps'], '.2f')} GB/s)"
    )
    return out


def idle_write(n: int) -> dict[str, Any]:
    """The rate of one write into memory the host has reclaimed: what a restore on a second node,
    whose memory has been idle, pays per byte (the floor).

    Fresh memory on this VM comes in two kinds: a pool the host still backs (memory freed in the
    last seconds, and some it never takes back) and memory it has reclaimed, which it backs again
    at a fraction of the rate on the first write. How big the pool is depends on what ran before,
    so waiting IDLE_PAUSE_S alone does not reach idle memory. The probe writes fresh chunks until
    it has written min(n, IDLE_SAMPLE_MAX) bytes of reclaimed memory (a chunk written slower than
    RECLAIMED_FRACTION of the first), and reports that rate. On a host that reclaims nothing every
    chunk is backed and the rate is the whole write's."""
    import psutil
    import torch

    time.sleep(IDLE_PAUSE_S)
    want = min(n, IDLE_SAMPLE_MAX)
    # Never push the machine into swap or the OOM killer: stop a margin short of what is free.
    budget = psutil.virtual_memory().available - IDLE_MARGIN_BYTES
    held: list[Any] = []
    durations: list[float] = []
    try:
        while len(durations) * IDLE_CHUNK + IDLE_CHUNK <= budget:
            t = time.perf_counter()
            chunk = torch.empty(IDLE_CHUNK, dtype=torch.uint8)
            chunk.fill_(1)
            durations.append(time.perf_counter() - t)
            held.append(chunk)
            if idle_rate(IDLE_CHUNK, durations)["reclaimed_bytes"] >= want:
                break
    finally:
        del held
    return idle_rate(IDLE_CHUNK, durations)


def idle_rate(chunk_bytes: int, durations: list[float]) -> dict[str, Any]:
    """Split the probe's chunk write times into backed and reclaimed memory (slower than
    RECLAIMED_FRACTION of the first chunk) and give the floor's rate: the reclaimed memory's, or
    the whole write's where none was reclaimed (a host that backs all memory)."""
    first = chunk_bytes / durations[0] if durations else 0.0
    reclaimed = [d for d in durations if chunk_bytes / d < RECLAIMED_FRACTION * first]
    backed = [d for d in durations if chunk_bytes / d >= RECLAIMED_FRACTION * first]
    out: dict[str, Any] = {
        "backed_bytes": chunk_bytes * len(backed),
        "backed_gbps": gbps(chunk_bytes * len(backed), sum(backed)),
        "reclaimed_bytes": chunk_bytes * len(reclaimed),
        "reclaimed_gbps": gbps(chunk_bytes * len(reclaimed), sum(reclaimed)),
    }
    kind = "reclaimed" if reclaimed else "backed"
    return {**out, "kind": kind, "gbps": out[f"{kind}_gbps"]}


# -- the plot --------------------------------------------------------------------------


def plot(summaries: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [s["gib"] for s in summaries]
    for m, style in zip(METHODS, ("o-", "s-", "^-", "d:", "v-."), strict=True):
        pts = [(s["gib"], s["median"][m]["downtime_s"]) for s in summaries if m in s["median"]]
        if pts:
            ax.plot(*zip(*pts, strict=True), style, label=LABELS[m])
    for kind, style in (("fresh", "kx--"), ("touched", "k+:")):
        ys = [s["bound"][f"{kind}_s"] for s in summaries]
        if all(y is not None for y in ys):
            label = "copy bound (fresh memory)" if kind == "fresh" else "copy bound (pre-touched memory)"
            ax.plot(xs, ys, style, label=label)
    ax.set_xlabel("live training state (GiB)")
    ax.set_ylabel("downtime (s)")
    ax.set_title("Downtime of moving a training job")
    ax.set_xticks(xs)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- main ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_migrate.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--sizes",
        type=parse_sizes,
        default=[1.0, 2.0, 4.0],
        metavar="GIB,...",
        help="live training state of the jobs, in GiB, comma-separated (default 1,2,4). Memory: a ferry "
        "move of S GiB holds about 4*S GiB at its peak",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="measure every method N times per size, interleaved, and report the medians (default 1)",
    )
    p.add_argument(
        "--methods",
        type=parse_methods,
        default=list(METHODS),
        metavar="M,...",
        help="which methods to run, a subset of ferry,criu,ckpt,staged,lazy (default all five; ferry "
        "is `ferry migrate --pre-copy`; lazy is `ferry migrate --post-copy`, post-copy, the default "
        "method; staged is `ferry migrate --staged`, the pipeline before memory streaming)",
    )
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=6,
        metavar="N",
        help="steps the job runs before it is moved; their median interval is the normal step (default 6)",
    )
    p.add_argument(
        "--after-steps",
        type=int,
        default=3,
        metavar="N",
        help="steps to wait for after the move before the job is killed (default 3)",
    )
    p.add_argument(
        "--workdir",
        type=Path,
        default=Path("/var/tmp"),
        metavar="DIR",
        help="disk directory for plain CRIU's dumps and copies and for the checkpoint files; not a tmpfs "
        "(default /var/tmp)",
    )
    p.add_argument(
        "--json",
        type=Path,
        default=OUT_DIR / "bench.json",
        metavar="PATH",
        help="write every measurement, the medians and the ratios here (default bench-results/bench.json)",
    )
    p.add_argument(
        "--no-hold",
        dest="hold",
        action="store_false",
        help="let plain CRIU and checkpoint-restart reuse the memory their source process frees "
        "(by default the bench holds it, as it would stay on the source node of a real move: "
        "see HOLD in the source)",
    )
    p.add_argument(
        "--plot",
        type=Path,
        default=OUT_DIR / "downtime.png",
        metavar="PATH",
        help="write a PNG of downtime against size for each method and the copy bounds here "
        "(default bench-results/downtime.png)",
    )
    return p


def preflight(args: argparse.Namespace) -> str:
    if os.geteuid() != 0:
        raise BenchError("needs root: CRIU dumps and restores processes (run it as root, e.g. with sudo)")
    if args.repeat < 1 or args.warmup_steps < 3 or args.after_steps < 1:
        raise BenchError("--repeat and --after-steps must be at least 1, --warmup-steps at least 3")
    from agent import config
    from agent.errors import FerryError

    try:
        criu = config.criu_binary()
    except FerryError as e:
        raise BenchError(f"CRIU not found: {e}") from e
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise BenchError("matplotlib is missing: `.venv/bin/pip install matplotlib` (or make deps)") from None
    if not args.workdir.is_dir():
        raise BenchError(f"--workdir {args.workdir} is not a directory")
    return criu


def run(args: argparse.Namespace, say: Progress) -> dict[str, Any]:
    criu = preflight(args)
    import psutil

    avail = psutil.virtual_memory().available
    biggest = max(args.sizes)
    if "ferry" in args.methods and 4.5 * biggest * GIB > avail:
        say(
            f"warning: {avail / GIB:.1f} GiB of memory available; "
            f"a {biggest:g} GiB ferry move may need about {4.5 * biggest:.0f} GiB"
        )
    if (load := os.getloadavg()[0]) > 0.5:
        say(
            f"warning: load average {load:.1f} before the start: other work on this machine skews the figures"
        )
    bench = Bench(args, criu, say)
    results: dict[str, Any] = {
        "config": {
            "sizes_gib": args.sizes,
            "repeat": args.repeat,
            "methods": args.methods,
            "warmup_steps": args.warmup_steps,
            "after_steps": args.after_steps,
            "workdir": str(args.workdir),
            "hold_freed_memory": args.hold,
            "criu": criu,
            "host": platform.node(),
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "memory_bytes": psutil.virtual_memory().total,
            "started_at": time.time(),
            "loadavg_1m_at_start": os.getloadavg()[0],
        },
        "sizes": [],
    }
    runners = {
        "criu": bench.run_criu,
        "ckpt": bench.run_ckpt,
        **{m: functools.partial(bench.run_ferry, method=m) for m in FERRY_FLAGS},
    }
    old_pipe_max = allow_lazy_dumps(say) if "lazy" in args.methods else None
    try:
        if set(FERRY_FLAGS) & set(args.methods):
            bench.start_agents()
        for gib in args.sizes:
            runs: dict[str, list[dict[str, Any]]] = {m: [] for m in args.methods}
            for rep in range(args.repeat):
                for m in args.methods:
                    say(f"size {gib:g} GiB, run {rep + 1}/{args.repeat}: {LABELS[m]}")
                    rec = runners[m](gib, rep)
                    runs[m].append(rec)
                    say(
                        f"  {LABELS[m]}: downtime {rec['downtime_s']:.2f} s, total {rec['total_s']:.2f} s, "
                        f"{rec['bytes'] / 1e9:.2f} GB (step {rec['step_s']:.2f} s)"
                    )
            image = next(statistics.median(r["bytes"] for r in runs[m]) for m in args.methods)
            say(f"size {gib:g} GiB: memory-copy bandwidth")
            bw = copy_bandwidth(int(image), say)
            summary = size_summary(gib, runs, bw)
            summary["runs"] = runs
            results["sizes"].append(summary)
    finally:
        say("cleaning up")
        bench.close()
        if old_pipe_max is not None:
            PIPE_MAX.write_text(old_pipe_max)
    return results


PIPE_MAX = Path("/proc/sys/fs/pipe-max-size")


def allow_lazy_dumps(say: Progress) -> str | None:
    """Root without CAP_SYS_RESOURCE needs fs.pipe-max-size raised for post-copy (the agent
    refuses --post-copy otherwise): raise it for the run; return the value to put back."""
    from agent.criu.runner import LAZY_PIPE_BYTES, lazy_dump_blocker

    if not lazy_dump_blocker():
        return None
    old = PIPE_MAX.read_text()
    say(
        f"raising fs.pipe-max-size from {old.strip()} to {LAZY_PIPE_BYTES} for ferry --post-copy "
        "(put back at the end)"
    )
    PIPE_MAX.write_text(str(LAZY_PIPE_BYTES))
    return old


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    say = Progress()
    # SIGTERM unwinds like Ctrl-C: jobs and agents are stopped and fs.pipe-max-size is put back.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        results = run(args, say)
    except BenchError as e:
        print(f"bench_migrate: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench_migrate: interrupted", file=sys.stderr)
        return 130
    print(format_table(results["sizes"]))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    plot(results["sizes"], args.plot)
    print(f"\nwrote {args.json} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
