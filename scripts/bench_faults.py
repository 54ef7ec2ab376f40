"""`make bench-faults`: the same training run under the same failures, finished four ways.

On the multi-node bed (agent/testing/bed.py: nodes that share only the cluster file system), a
data-parallel gloo job of 3 replicas, one rank per node (scripts/workloads/train_faults.py,
--ballast-mb of live state per rank), runs --steps steps:

  undisturbed          no failure: the baseline, under torchrun (c10d rendezvous)
  checkpoint-restart   the job saves a checkpoint every K steps (rank 0's torch.save to the
                       shared file system) and runs under torchrun (--max-restarts); a node
                       that dies fails the job, and the scheduler (this bench) starts it again
                       once it knows (--detect-s after the death, or at once when a torchrun
                       fails), the dead node's torchrun on a spare, every rank from the newest
                       checkpoint. Once with K chosen as a real job would for this failure rate
                       (Young/Daly: K steps ~ sqrt(2 x checkpoint cost x MTBF)), once with K =
                       ferry's snapshot interval
  torchft              the same model and data written for TorchFT (its lighthouse on a host of
                       its own, a replica group of one rank per node): a dead replica drops out
                       of the quorum at the lighthouse's heartbeat timeout (--detect-s) and the
                       survivors go on; the scheduler starts a new replica on a spare as soon as
                       it knows (--detect-s after the death), which heals from a peer
  ferry                the unmodified job under `ferry run --group`, protected by group
                       snapshots (`ferry protect --every`, etcd on the bed): a warned failure
                       is self-healing's planned move to a spare, a hard one a rollback to the
                       last snapshot with the lost member restored on a spare

The failures come from one seeded schedule (--seed), printed, the same for every method: at an
MTBF that gives --failures-min to --failures-max failures over the undisturbed run's length,
each at a time after the job's first step, on the node that then holds a given replica (its
index among the nodes holding the job, sorted), either warned (the node's GPU telemetry shows a
burst of corrected ECC errors --warning-s before it dies: the replayed NVML every node answers
from) or hard (no warning). A node dies as a power loss would: its link to the fabric deleted,
every process on it SIGKILLed (agent/testing/bed.py's power_off). Spares: one per failure.
Every method notices a dead node --detect-s after its death (default 5 s: ferry's lease TTL and
TorchFT's heartbeat timeout by default): ferry's agents hold leases that long, TorchFT's
lighthouse waits that long for a heartbeat, and the scheduler answers a death that long after.

For each method it prints the wall time (the job's first step to its last, over every log), its
ratio to the baseline, the time lost per failure by kind (from the warning or the kill until the
job passes the step it had reached, less the steps it made meanwhile at the baseline's pace),
the steps recomputed per failure, the steady overhead per step (the mean step outside failure
windows less the baseline's), and whether every rank ended with the baseline's final digest, bit
for bit. The targets (issue 30): ferry's excess over the baseline at most half of
checkpoint-restart's (the Young/Daly K), ferry faster than TorchFT, and ferry bit-identical.
It writes bench-results/faults.json and, beside it, faults.png: steps completed against time
for every run, failures marked. Needs root, CRIU (`make criu`), etcd (`make etcd`), `ip`, and
torchft (in the dev extra).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
for _p in (REPO, SCRIPTS):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from bench_migrate import PIPE_MAX, allow_lazy_dumps  # noqa: E402
from bench_ranks import BenchError, Progress, require_criu  # noqa: E402

from agent.testing.nvml_replay import one_gpu, write_world  # noqa: E402

OUT = Path("bench-results") / "faults.json"
TRAIN = SCRIPTS / "workloads" / "train_faults.py"
WORLD = 3
STEP_LINE = re.compile(r"^step (\d+) loss (\S+) at (\d+\.\d+)(?: rank (\d+))?$", re.M)
DIGEST = re.compile(r"^final digest (\w+)$", re.M)
#: Where the rendezvous store and TorchFT's lighthouse live: the bed's outside host, which no
#: failure takes down (a cluster's are on hosts of their own).
RDZV_PORT, LIGHTHOUSE_PORT = 29400, 29510
#: Issue 30's target: ferry's excess wall time at most this share of checkpoint-restart's.
EXCESS_TARGET = 0.5


# -- the schedule -------------------------------------------------------------------------


@dataclass(frozen=True)
class Failure:
    at_s: float  # after the job's first step
    kind: str  # "warned" or "hard"
    replica: int  # the index, among the nodes then holding the job (sorted by name), of the victim


def schedule(
    seed: int, span_s: float, lo: int, hi: int, spacing_s: float, warned_share: float, start_s: float
) -> list[Failure]:
    """A Poisson process over [start_s, span_s] at an MTBF of (span - start) / the middle of
    [lo, hi], redrawn (from the same seed) until it gives lo..hi failures at least spacing_s
    apart; each warned with probability warned_share, on a replica drawn uniformly."""
    # The fewest asked for must fit: the first half a spacing in, each next a spacing later.
    if start_s + spacing_s / 2 + (lo - 1) * spacing_s >= span_s:
        raise BenchError(
            f"{lo} failures {spacing_s:g} s apart do not fit in {span_s - start_s:.0f} s: "
            "more steps or fewer failures"
        )
    rng = random.Random(seed)
    mtbf = (span_s - start_s) / ((lo + hi) / 2)
    for _ in range(10_000):
        times, t = [], start_s
        while (t := t + rng.expovariate(1 / mtbf)) < span_s:
            times.append(t)
        apart = all(b - a >= spacing_s for a, b in itertools.pairwise(times))
        if lo <= len(times) <= hi and apart and times[0] - start_s >= spacing_s / 2:
            return [
                Failure(
                    round(x, 1), "warned" if rng.random() < warned_share else "hard", rng.randrange(WORLD)
                )
                for x in times
            ]
    raise BenchError(
        f"no schedule of {lo}-{hi} failures {spacing_s:g} s apart in {span_s - start_s:.0f} s within 10000 "
        "draws: more steps or fewer failures"
    )


def fixed_schedule(text: str, span_s: float) -> list[Failure]:
    """--schedule KIND:REPLICA,...: those failures, in that order, evenly spread over the span."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    out = []
    for i, item in enumerate(items):
        kind, _, replica = item.partition(":")
        if kind not in ("warned", "hard") or not replica.isdigit() or not 0 <= int(replica) < WORLD:
            raise BenchError(f"--schedule: {item!r} is not KIND:REPLICA (warned or hard, 0-{WORLD - 1})")
        out.append(Failure(round(span_s * (i + 1) / (len(items) + 1), 1), kind, int(replica)))
    return out


def young_daly_steps(cost_s: float, mtbf_s: float, step_s: float) -> int:
    """The checkpoint interval a job would choose (Young/Daly: sqrt(2 x cost x MTBF)), in steps."""
    return max(1, round(math.sqrt(2 * cost_s * mtbf_s) / step_s))


# -- reading a run's logs ----------------------------------------------------------------------


def steps_of(logs: list[str]) -> list[tuple[float, int]]:
    """Every step line of every log, (time, step), in time order."""
    return sorted((float(m[3]), int(m[1])) for log in logs for m in STEP_LINE.finditer(log))


def steps_by_rank(logs: list[str]) -> dict[int | None, list[tuple[float, int]]]:
    """Each rank's step lines, (time, step), in time order (None: lines that name no rank). A
    member's lines may lie in several logs, one on every node it ran on, and a log that moved
    with it holds its earlier lines again: a line is counted once."""
    out: dict[int | None, set[tuple[float, int]]] = {}
    for log in logs:
        for m in STEP_LINE.finditer(log):
            out.setdefault(None if m[4] is None else int(m[4]), set()).add((float(m[3]), int(m[1])))
    return {r: sorted(pts) for r, pts in out.items()}


def frontier(points: list[tuple[float, int]], t: float) -> int:
    """The highest step any rank had finished by time t (-1: none)."""
    return max((s for x, s in points if x <= t), default=-1)


def wall(points: list[tuple[float, int]], steps: int) -> float:
    first = min((t for t, s in points if s == 0), default=None)
    last = max((t for t, s in points if s == steps - 1), default=None)
    if first is None or last is None:
        raise BenchError(f"the run did not log both step 0 and step {steps - 1}")
    return last - first


@dataclass
class Struck:
    """One failure as a run met it."""

    failure: Failure
    node: str
    warned_at: float | None
    killed_at: float
    lost_s: float = 0.0
    recomputed: int = 0
    back_at: float | None = None  # when the job first passed the step it had reached
    #: The rank that died, where the job goes on without it (TorchFT: the survivors step on and
    #: a replacement joins later); None where the job is back only with it (a lockstep job).
    left_out: int | None = None


def judge(
    points: list[tuple[float, int]],
    struck: Struck,
    step_s: float,
    by_rank: dict[int | None, list[tuple[float, int]]] | None = None,
    counted_until: float = -math.inf,
    until: float = math.inf,
) -> None:
    """The failure's cost: from its warning (or its kill) until every rank has finished a step
    past the one the job had reached at the kill, for good, less the steps it made in that time
    at step_s each; and how many steps it did again: the most any one rank did (the steps it
    logged from the kill until the job was back that it had logged before). Per rank, since
    ranks log one step a few milliseconds apart: the ranks may finish the step in flight at the
    kill (the dead rank may log it too before its SIGKILL lands), which is not the job being
    back when a rollback follows; and a rank frozen by a move across the kill logs after it the
    step its peers logged before it, which it did once. A step done again before
    `counted_until` (an earlier failure's job back) is that failure's: its replay may run past
    this one's kill. `until`: the next failure's kill, whose rollback is not this one's. The
    rank `struck.left_out` (the dead one, where the job goes on without it) is not waited for:
    its replacement joins when it is ready, while the job runs."""
    start = struck.warned_at if struck.warned_at is not None else struck.killed_at
    reached = frontier(points, struck.killed_at)
    ranks = by_rank or {None: points}
    if struck.left_out is not None:
        ranks = {r: pts for r, pts in ranks.items() if r != struck.left_out}
    past: float | None = None
    for pts in ranks.values():
        first = past_for_good(pts, struck.killed_at, reached, until)
        if first is None and any(t > struck.killed_at for t, _ in pts):
            past = None  # a rank that went on but never got past: the job never did
            break
        if first is not None:
            past = first if past is None else max(past, first)
    if past is None:
        struck.lost_s, struck.back_at = math.nan, None
        return
    made = reached - frontier(points, start) + 1
    struck.back_at = past
    struck.lost_s = (past - start) - made * step_s
    again, since = 0, max(struck.killed_at, counted_until)
    for pts in ranks.values():
        done: set[int] = set()
        twice = 0
        for t, s in pts:  # in time order
            if since < t <= past and s in done:
                twice += 1
            done.add(s)
        again = max(again, twice)
    struck.recomputed = again


def past_for_good(pts: list[tuple[float, int]], after: float, reached: int, until: float) -> float | None:
    """When a rank logged, after `after`, a step past `reached` with no step at or below it
    since (a rollback starts the count again); the scan stops at `until` once the rank is past."""
    first: float | None = None
    for t, s in pts:
        if t <= after:
            continue
        if t > until and first is not None:
            break
        if s <= reached:
            first = None
        elif first is None:
            first = t
    return first


def steady_step(points: list[tuple[float, int]], windows: list[tuple[float, float]]) -> float:
    """The mean time between consecutive new steps, outside the failures' windows."""
    gaps, best, last = [], -1, None
    for t, s in points:
        if s > best:
            if last is not None and s == best + 1 and not any(a <= t and last <= b for a, b in windows):
                gaps.append(t - last)
            best, last = s, t
    return sum(gaps) / len(gaps) if gaps else math.nan


# -- running processes on bed nodes ------------------------------------------------------------


@dataclass
class Proc:
    """A process a method started on a bed node, outside ferry, its output in a file of its own."""

    popen: subprocess.Popen[bytes]
    node: Any
    log: Path
    replica: int = -1  # TorchFT: the replica group it runs
    tended: bool = False  # its end was seen to and answered (or it belongs to a stopped job)


def start_proc(node: Any, cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [*node.enter(), "env", *[f"{k}={v}" for k, v in env.items()], *cmd],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def kill_tree(p: subprocess.Popen[bytes]) -> None:
    """SIGKILL a process and every descendant (torchrun starts its workers in sessions of their
    own, which a process-group kill would miss)."""
    import psutil

    with contextlib.suppress(psutil.Error):
        procs = [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
        for q in procs:
            with contextlib.suppress(psutil.Error):
                q.kill()
    p.wait()


def train_args(args: argparse.Namespace, mode: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(TRAIN),
        mode,
        "--steps",
        str(args.steps),
        "--step-time",
        str(args.step_time),
        "--ballast-mb",
        str(args.ballast_mb),
        "--timeout-s",
        str(args.timeout_s),
        *extra,
    ]


def node_ip(node: Any) -> str:
    return node.address.split(":")[0]


# -- the methods -----------------------------------------------------------------------------


@dataclass
class Outcome:
    method: str
    logs: list[str]
    struck: list[Struck] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class Method:
    """One way of finishing the job on its own bed: start it, say which nodes hold it, take a
    node's warning and its death, and wait for the end."""

    name = ""

    def __init__(self, bed: Any, args: argparse.Namespace, say: Progress) -> None:
        self.bed, self.args, self.say = bed, args, say
        self.notes: list[str] = []
        self.failure: BaseException | None = None  # raised on a timer's thread, re-raised here
        self.answers: list[threading.Timer] = []  # the scheduler's answers to deaths, still due

    def start(self) -> None: ...
    def logs(self) -> list[str]: ...
    def done(self) -> bool: ...
    def nodes_holding(self) -> list[Any]: ...
    def kill(self, node: Any) -> None: ...
    def stop(self) -> None: ...

    def warn(self, node: Any) -> None:
        """A GPU on node shows the precursors of its failure."""

    def replace(self, dead: Any) -> None:
        """The scheduler's answer to a dead node."""

    def goes_on_without(self, dead: Any) -> int | None:
        """The rank that died with `dead` where the job goes on without it; else None."""
        return None

    def replace_later(self, dead: Any) -> None:
        """replace() on the injector's timer: what it raises ends the run (`failure`)."""
        try:
            self.replace(dead)
        except BaseException as e:
            self.failure = e


class Scheduled(Method):
    """The job as users run it without ferry, under a scheduler (this bench) that starts a
    replacement on a spare when a node dies and starts again what fails: processes on bed nodes
    with no agent, plus a service on the outside host (a rendezvous store, a lighthouse)."""

    def __init__(self, bed: Any, args: argparse.Namespace, say: Progress, spares: int) -> None:
        super().__init__(bed, args, say)
        nodes = [bed.node(f"node-{c}", start=False) for c in "abcdefghij"[: WORLD + spares]]
        self.holding, self.spares_left = nodes[:WORLD], nodes[WORLD:]
        self.dead: set[str] = set()
        self.procs: list[Proc] = []
        self.service: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()  # the injector and the waiting loop both tend the processes
        (bed.root / "logs").mkdir()

    def launch(self, node: Any, replica: int) -> None: ...
    def service_cmd(self) -> list[str]: ...

    def failed(self, p: Proc) -> None:
        """What the scheduler does when one of the job's processes (on a live node) fails."""

    def _start(self, node: Any, cmd: list[str], env: dict[str, str], replica: int = -1) -> None:
        log = self.bed.root / "logs" / f"{len(self.procs)}-{node.node}.log"
        self.procs.append(Proc(start_proc(node, cmd, env, log), node, log, replica))

    def start(self) -> None:
        self.service = self.bed.outside(
            self.service_cmd(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        for i, n in enumerate(self.holding):
            self.launch(n, i)

    def nodes_holding(self) -> list[Any]:
        return sorted(self.holding, key=lambda n: n.node)

    def logs(self) -> list[str]:
        return [p.log.read_text(errors="replace") for p in self.procs]

    def done(self) -> bool:
        with self._lock:
            if len(DIGEST.findall("\n".join(self.logs()))) >= WORLD:
                return True
            for p in list(self.procs):
                code = p.popen.poll()
                if code not in (None, 0) and p.node.node not in self.dead and not p.tended:
                    p.tended = True
                    self.failed(p)
            return False

    def kill(self, node: Any) -> None:
        with self._lock:
            self.dead.add(node.node)
            self.bed.power_off(node)
            self.holding.remove(node)

    def replace(self, dead: Any) -> None:
        with self._lock:
            if not self.spares_left:
                raise BenchError(f"{self.name}: no spare left to replace {dead.node}")
            n = self.spares_left.pop(0)
            self.holding.append(n)
            self.replaced(n, next((p.replica for p in self.procs if p.node is dead), -1))

    def replaced(self, spare: Any, replica: int) -> None:
        """The dead node's work starts on `spare` (called with the lock held)."""
        self.launch(spare, replica)

    def stop(self) -> None:
        for p in self.procs:
            kill_tree(p.popen)
        if self.service is not None:
            self.service.kill()
            self.service.wait()


class Torchrun(Scheduled):
    """torchrun on every node (c10d rendezvous on the outside host, --max-restarts for what
    fails inside a node). A node that dies fails the job, and the scheduler starts it again at
    once, as Slurm's requeue or a Kubernetes Job's restart does: every torchrun killed and
    started again, the dead node's on a spare, on a new rendezvous, each rank from the newest
    checkpoint. (Left to torchrun's own elastic replacement, a spare's joining stalled its
    re-rendezvous on the store's 60 s timeout every time on the bed: see docs/performance.md.)"""

    name = "undisturbed"

    def __init__(
        self, bed: Any, args: argparse.Namespace, say: Progress, spares: int, every: int = 0
    ) -> None:
        super().__init__(bed, args, say, spares)
        self.every = every
        self.ckpt = bed.shared / "checkpoints"
        self.ckpt.mkdir()
        self.generation = 0

    def service_cmd(self) -> list[str]:
        from agent.testing.bed import OUTSIDE_ADDR

        code = (
            "import time; from torch.distributed import TCPStore; "
            f"s = TCPStore('{OUTSIDE_ADDR}', {RDZV_PORT}, is_master=True, wait_for_workers=False); "
            "time.sleep(1e9)"
        )
        return [sys.executable, "-c", code]

    def launch(self, node: Any, replica: int) -> None:
        from agent.testing.bed import OUTSIDE_ADDR

        extra = ("--save-every", str(self.every), "--save-dir", str(self.ckpt)) if self.every else ()
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={WORLD}",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={OUTSIDE_ADDR}:{RDZV_PORT}",
            f"--rdzv-id=bench-{self.generation}",
            "--rdzv-conf=is_host=0",
            "--max-restarts=100",
            "--monitor-interval=0.5",
            f"--local-addr={node_ip(node)}",
            *train_args(self.args, "plain", *extra)[1:],
        ]
        env = {"GLOO_SOCKET_IFNAME": "ferry0", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self._start(node, cmd, env, replica)

    def failed(self, p: Proc) -> None:
        tail = p.log.read_text(errors="replace").strip().splitlines()[-1:]
        self._requeue(f"torchrun on {p.node.node} failed ({tail[0][:120] if tail else 'no output'})")

    def replaced(self, spare: Any, replica: int) -> None:
        self._requeue(f"a node died; {spare.node} takes its place")

    def _requeue(self, why: str) -> None:
        self.say(f"{self.name}: {why}: the scheduler starts the whole job again")
        self.notes.append(f"{why}: the job was started again")
        for q in self.procs:
            kill_tree(q.popen)
            q.tended = True
        self.generation += 1
        for i, n in enumerate(self.nodes_holding()):
            self.launch(n, i)


class TorchFT(Scheduled):
    """TorchFT's way: a lighthouse on the outside host, each replica group one rank under a
    torchrun of its own (static rendezvous on its node); a replacement heals from a peer, and a
    replica that fails is started again on its node (TorchFT's answer to any failure)."""

    name = "torchft"

    def service_cmd(self) -> list[str]:
        lighthouse = shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent))
        if lighthouse is None:
            raise BenchError("torchft_lighthouse is missing: pip install torchft (the dev extra has it)")
        # Its README's settings, and the bench's detection time as its heartbeat timeout.
        return [lighthouse, "--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000",
                "--heartbeat_timeout_ms", str(self.args.detect_s * 1000),
                "--bind", f"[::]:{LIGHTHOUSE_PORT}"]  # fmt: skip

    def launch(self, node: Any, replica: int) -> None:
        from agent.testing.bed import OUTSIDE_ADDR

        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=1",
            "--nproc-per-node=1",
            f"--master-addr={node_ip(node)}",
            "--master-port=29600",
            *train_args(self.args, "torchft")[1:],
        ]
        env = {
            "GLOO_SOCKET_IFNAME": "ferry0",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "TORCHFT_LIGHTHOUSE": f"http://{OUTSIDE_ADDR}:{LIGHTHOUSE_PORT}",
            "REPLICA_GROUP_ID": str(replica),
            "NUM_REPLICA_GROUPS": str(WORLD),
        }
        self._start(node, cmd, env, replica)

    def goes_on_without(self, dead: Any) -> int | None:
        # A replica group of one rank: its REPLICA_GROUP_ID is the rank its lines name.
        return next((p.replica for p in reversed(self.procs) if p.node is dead), None)

    def failed(self, p: Proc) -> None:
        self.say(f"{self.name}: replica {p.replica} on {p.node.node} failed: the scheduler starts it again")
        self.notes.append(f"replica {p.replica} on {p.node.node} failed and was started again")
        self.launch(p.node, p.replica)


def fence_margin(ttl_s: int) -> float:
    """ferry's default fence margin where a lease of ttl_s leaves room for it, else its floor."""
    from agent.coord.config import MIN_FENCE_MARGIN_S, CoordConfig
    from agent.errors import InvalidArgumentError

    default = CoordConfig().fence_margin_s
    try:
        CoordConfig(endpoints=("etcd:2379",), lease_ttl_s=ttl_s, fence_margin_s=default).check()
    except InvalidArgumentError:
        return MIN_FENCE_MARGIN_S
    return default


#: Self-healing's pace for the bench (tests/integration/test_selfheal.py's): health every 0.3 s.
HEALTH = "[health]\ninterval_s = 0.3\necc_window_s = 600\n"
#: A burst of corrected ECC errors: the GPU degrades, and a job on it is moved off (migrate).
PRECURSOR = {"ecc_corrected": 40}


class Ferry(Method):
    """The unmodified job, one rank per node, each a `ferry run --group --gpu` member; every
    agent protects the group through etcd (one runs its rounds); every node lists every spare."""

    name = "ferry"

    def __init__(self, bed: Any, args: argparse.Namespace, say: Progress, spares: int) -> None:
        from agent.testing.bed import coordination_config

        super().__init__(bed, args, say)
        bed.etcd()
        names = [f"node-{c}" for c in "abcdefghij"[: WORLD + spares]]
        addresses = {n: f"10.98.0.{i + 1}:7070" for i, n in enumerate(names)}
        self.telemetry = {n: bed.root / f"{n}-nvml.json" for n in names}
        nodes = []
        for n in names:
            peers = "".join(
                f'[[peers]]\naddress = "{addresses[s]}"\nspare = true\n' for s in names[WORLD:] if s != n
            )
            config = (
                coordination_config(ttl_s=args.detect_s, margin_s=fence_margin(args.detect_s))
                + "[snapshots]\nhold_s = 10\n"
                + HEALTH
                + peers
            )
            write_world(self.telemetry[n], one_gpu(f"GPU-{n}"))
            node = bed.node(n, config=config, start=False)
            node.nvml_replay = self.telemetry[n]
            node.env["FERRY_HOUSEKEEPING_S"] = "1"
            node.start()
            if node.address != addresses[n]:
                raise BenchError(f"{n} is at {node.address}, not {addresses[n]}, which the others list")
            nodes.append(node)
        self.nodes = nodes
        self.alive = set(names)
        self.members = [f"ft-r{r}" for r in range(WORLD)]

    def _run(self, node: Any, rank: int, master: str) -> None:
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(WORLD),
            "MASTER_ADDR": master,
            "MASTER_PORT": "29500",
            "GLOO_SOCKET_IFNAME": "eth0",
            "OMP_NUM_THREADS": "1",
        }
        envs = [x for k, v in env.items() for x in ("--env", f"{k}={v}")]
        node.cli(
            "run",
            "--name",
            self.members[rank],
            "--group",
            "ft",
            "--gpu",
            f"GPU-{node.node}",
            *envs,
            "--",
            *train_args(self.args, "plain"),
        )

    def start(self) -> None:
        a = self.nodes[0]
        self._run(a, 0, "127.0.0.1")
        master = a.job_address(self.members[0])
        for r in range(1, WORLD):
            self._run(self.nodes[r], r, master)
        # Every agent protects the group, so that one runs its rounds whichever nodes die.
        deadline = time.monotonic() + 120
        for node in self.nodes:
            while (p := node.cli("protect", "ft", "--every", f"{self.args.every:g}", check=False)).returncode:
                if time.monotonic() > deadline:
                    raise BenchError(
                        f"ferry protect was refused on {node.node} for 120 s: {p.stderr.strip()}"
                    )
                time.sleep(0.5)

    def _records(self) -> list[tuple[Any, dict[str, Any]]]:
        """The members' job records on every node (read from the node's state directory)."""
        out = []
        for node in self.nodes:
            for name in self.members:
                path = node.state_dir / "jobs" / name / "job.json"
                try:
                    out.append((node, json.loads(path.read_text())))
                except (OSError, ValueError):
                    continue
        return out

    def nodes_holding(self) -> list[Any]:
        """The live nodes with a member running, or held by a round or a move; during a
        recovery fewer than WORLD, so asked again for a while."""
        deadline = time.monotonic() + 60
        while True:
            here = {
                n.node: n
                for n, r in self._records()
                if r.get("state") in ("running", "migrating") and n.node in self.alive
            }
            if len(here) >= WORLD or time.monotonic() > deadline:
                return [here[k] for k in sorted(here)]
            time.sleep(0.2)

    def logs(self) -> list[str]:
        out = []
        for node in self.nodes:
            for name in self.members:
                with contextlib.suppress(OSError):  # never ran there
                    out.append((node.state_dir / "jobs" / name / "stdout.log").read_text(errors="replace"))
        return out

    def done(self) -> bool:
        ended = [r for n, r in self._records() if n.node in self.alive and r.get("state") == "exited"]
        if bad := [r for r in ended if r.get("exit_code") != 0]:
            raise BenchError(
                f"ferry: member {bad[0].get('name')} exited {bad[0].get('exit_code')} "
                f"(its stderr is in {bad[0].get('stderr_path', 'its job directory')}; --keep keeps it)"
            )
        return len(ended) >= WORLD

    def warn(self, node: Any) -> None:
        write_world(self.telemetry[node.node], one_gpu(f"GPU-{node.node}", **PRECURSOR))

    def kill(self, node: Any) -> None:
        self.bed.power_off(node)
        self.alive.discard(node.node)

    def stop(self) -> None:
        # What the agents decided and did, in their words (read from every node's state, the
        # dead ones' too): the run's evidence in the results.
        kept = []
        for node in self.nodes:
            with contextlib.suppress(OSError):
                for line in (node.state_dir / "events.jsonl").read_text().splitlines():
                    with contextlib.suppress(ValueError, KeyError):
                        e = json.loads(line)
                        if e["kind"] in ("decision", "migration", "alert") or "recover" in e["message"]:
                            kept.append((float(e["time"]), f"{node.node}: {e['message'][:300]}"))
        self.notes += [text for _, text in sorted(kept)]
        for node in self.nodes:
            if node.node in self.alive:
                with contextlib.suppress(OSError, subprocess.SubprocessError, AssertionError):
                    node.cli("protect", "ft", "--off", check=False, timeout_s=30)


# -- the injector ------------------------------------------------------------------------------


def first_step(method: Method, timeout_s: float) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if points := steps_of(method.logs()):
            return points[0][0]
        time.sleep(0.2)
    raise BenchError(f"{method.name}: no step within {timeout_s:.0f} s of its start")


def victim(method: Method, f: Failure) -> Any:
    holding = method.nodes_holding()
    if not holding:
        raise BenchError(f"{method.name}: no node holds the job when failure {f} strikes")
    return holding[f.replica % len(holding)]  # fewer than WORLD: a recovery is under way


def inject(
    method: Method, failures: list[Failure], t0: float, lead_s: float, detect_s: float, say: Progress
) -> list[Struck]:
    """Strike each failure at its time after t0 (the job's first step), the method's scheduler
    told detect_s after each death; stop once the job ended."""
    struck: list[Struck] = []

    def until(t: float) -> bool:
        # Whether the job ended is asked once a second (it reads the job's logs: CPU the job
        # would miss on two cores); the failure itself strikes within 0.1 s of its time.
        asked = 0.0
        while time.time() < t:
            if time.monotonic() - asked >= 1.0:
                asked = time.monotonic()
                if method.done():
                    return False
            time.sleep(min(0.1, max(0.0, t - time.time())))
        return not method.done()

    for f in failures:
        warned_at = None
        if f.kind == "warned":
            if not until(t0 + max(0.0, f.at_s - lead_s)):
                break
            node = victim(method, f)
            warned_at = time.time()
            method.warn(node)
            say(f"{method.name}: {node.node}'s GPU warns ({f.at_s - lead_s:.1f} s)")
        if not until(t0 + f.at_s):
            break
        if warned_at is None:
            node = victim(method, f)
        killed = time.time()
        method.kill(node)
        say(f"{method.name}: {node.node} dies ({f.kind}, {f.at_s:.1f} s)")
        # A scheduler learns of a dead node from its health checks, as ferry from the lease.
        answer = threading.Timer(detect_s, method.replace_later, args=(node,))
        answer.daemon = True
        method.answers.append(answer)
        answer.start()
        struck.append(Struck(f, node.node, warned_at, killed, left_out=method.goes_on_without(node)))
    return struck


def run_method(method: Method, failures: list[Failure], args: argparse.Namespace, say: Progress) -> Outcome:
    try:
        method.start()
        t0 = first_step(method, 300)
        say(f"{method.name}: first step")
        struck = inject(method, failures, t0, args.warning_s, args.detect_s, say)
        deadline = time.monotonic() + args.steps * (args.step_time + 1) + 600
        while not method.done():
            if method.failure is not None:
                raise method.failure
            if time.monotonic() > deadline:
                raise BenchError(f"{method.name}: the job did not end")
            time.sleep(0.5)
        return Outcome(method.name, method.logs(), struck, method.notes)
    finally:
        for answer in method.answers:  # a job that ended first needs no replacement
            answer.cancel()
        method.stop()


# -- the report --------------------------------------------------------------------------------


def summarise(
    o: Outcome, args: argparse.Namespace, base_step: float, base_digests: list[str] | None
) -> dict[str, Any]:
    points, by_rank = steps_of(o.logs), steps_by_rank(o.logs)
    back = -math.inf
    for i, s in enumerate(o.struck):
        until = o.struck[i + 1].killed_at if i + 1 < len(o.struck) else math.inf
        judge(points, s, base_step, by_rank, counted_until=back, until=until)
        back = max(back, s.back_at or -math.inf)
    windows = [(s.warned_at or s.killed_at, s.back_at or math.inf) for s in o.struck]
    digests = sorted(m for log in o.logs for m in DIGEST.findall(log))[-WORLD:]
    out: dict[str, Any] = {
        "wall_s": wall(points, args.steps),
        "step_s": steady_step(points, windows),
        "digests": digests,
        "bit_identical": None if base_digests is None else digests == base_digests,
        "failures": [
            {**asdict(s.failure), "node": s.node, "lost_s": s.lost_s, "recomputed": s.recomputed}
            for s in o.struck
        ],
        "notes": o.notes,
        "points": points,
        "struck_at": [(s.warned_at, s.killed_at) for s in o.struck],
    }
    return out


def save_cost(ballast_mb: int, where: Path) -> float:
    """What one checkpoint costs the job: torch.save of its state (the ballast dominates) to the
    shared file system, timed here, the median of three."""
    import torch

    state = {"ballast": torch.randn(ballast_mb * 2**18), "model": torch.randn(4096)}
    times = []
    for i in range(3):
        path = where / f"probe-{i}.pt"
        t = time.monotonic()
        torch.save(state, path)
        times.append(time.monotonic() - t)
        path.unlink()
    return sorted(times)[1]


METHODS = ("undisturbed", "checkpoint-restart", "checkpoint-restart-k", "torchft", "ferry")


def make(
    method: str, bed: Any, args: argparse.Namespace, say: Progress, spares: int, k: dict[str, int]
) -> Method:
    if method == "undisturbed":
        return Torchrun(bed, args, say, 0)
    if method.startswith("checkpoint-restart"):
        m = Torchrun(bed, args, say, spares, every=k[method])
        m.name = method
        return m
    if method == "torchft":
        return TorchFT(bed, args, say, spares)
    return Ferry(bed, args, say, spares)


def one(
    method: str, args: argparse.Namespace, say: Progress, failures: list[Failure], k: dict[str, int]
) -> Outcome:
    from agent.testing.bed import node_bed

    root = Path(tempfile.mkdtemp(prefix=f"ferry-bench-faults-{method}-", dir=args.workdir))
    try:
        with node_bed(root) as bed:
            say(f"{method}: starting" + (f" (a checkpoint every {k[method]} steps)" if method in k else ""))
            return run_method(make(method, bed, args, say, len(failures), k), failures, args, say)
    finally:
        if args.keep:
            say(f"{method}: its bed's files (agents' logs, state, the job's logs) are kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def _s(v: float | None) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.1f} s"


def format_report(r: dict[str, Any]) -> str:
    base = r["runs"]["undisturbed"]["wall_s"]
    lines = [
        f"schedule (seed {r['seed']}, MTBF {r['mtbf_s']:.1f} s): "
        + ", ".join(f"{f['at_s']:.1f} s {f['kind']} (replica {f['replica']})" for f in r["schedule"]),
        "",
        f"{'method':26} {'wall':>8} {'x base':>7} {'excess':>8} {'step':>7} {'lost/warned':>12} "
        f"{'lost/hard':>10} {'recomputed/hard':>16} {'exact':>6}",
    ]
    for name, x in r["runs"].items():
        by = {kind: [f for f in x["failures"] if f["kind"] == kind] for kind in ("warned", "hard")}

        def mean(fs: list[dict[str, Any]], key: str) -> float | None:
            vals = [f[key] for f in fs if not math.isnan(f[key])]
            return sum(vals) / len(vals) if vals else None

        rec = mean(by["hard"], "recomputed")
        lines.append(
            f"{name:26} {_s(x['wall_s']):>8} {x['wall_s'] / base:>6.2f}x {_s(x['wall_s'] - base):>8} "
            f"{x['step_s'] * 1000:>5.0f}ms {_s(mean(by['warned'], 'lost_s')):>12} "
            f"{_s(mean(by['hard'], 'lost_s')):>10} "
            f"{'-' if rec is None else f'{rec:.1f}':>16} "
            f"{ {True: 'yes', False: 'no', None: '-'}[x['bit_identical']]:>6}"
        )
    for name, x in r["runs"].items():
        lines += [f"  {name}: {n}" for n in x.get("notes", [])]
    lines.append("")
    for t in r["targets"]:
        lines.append(f"{'met' if t['met'] else 'NOT met':8} {t['what']}")
    return "\n".join(lines)


def targets(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    base = runs["undisturbed"]["wall_s"]
    out = []
    if "ferry" in runs and "checkpoint-restart" in runs:
        f, c = runs["ferry"]["wall_s"] - base, runs["checkpoint-restart"]["wall_s"] - base
        out.append(
            {
                "what": f"ferry's excess {f:.1f} s <= {EXCESS_TARGET} x checkpoint-restart's {c:.1f} s",
                "met": f <= EXCESS_TARGET * c,
            }
        )
    if "ferry" in runs and "torchft" in runs:
        f, t = runs["ferry"]["wall_s"], runs["torchft"]["wall_s"]
        out.append({"what": f"ferry's wall time {f:.1f} s < TorchFT's {t:.1f} s", "met": f < t})
    if "ferry" in runs:
        out.append(
            {
                "what": "ferry's run is bit-identical to the baseline",
                "met": bool(runs["ferry"]["bit_identical"]),
            }
        )
        warned = [x for x in runs["ferry"]["failures"] if x["kind"] == "warned"]
        out.append(
            {
                "what": f"ferry recomputed no step on {sum(x['recomputed'] == 0 for x in warned)} of "
                f"{len(warned)} warned failures",
                "met": all(x["recomputed"] == 0 for x in warned),
            }
        )
    return out


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for name, x in r["runs"].items():
        pts = x["points"]
        if not pts:
            continue
        t0 = pts[0][0]
        # Every rank's steps in time order: a rollback or a restart shows as a drop.
        (line,) = ax.plot([t - t0 for t, _ in pts], [s for _, s in pts], label=name, linewidth=1)
        for _, killed in x["struck_at"]:
            ax.axvline(killed - t0, color=line.get_color(), linestyle=":", linewidth=0.8)
    ax.set_xlabel("seconds since the job's first step")
    ax.set_ylabel("step")
    ax.set_title("the same job under the same failures (dotted: a node dies)")
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_faults.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--steps",
        type=int,
        default=500,
        help="training steps per run (default 500: five runs in under 20 minutes on 2 cores)",
    )
    p.add_argument("--step-time", type=float, default=0.25, help="seconds each step sleeps (default 0.25)")
    p.add_argument("--ballast-mb", type=int, default=256, help="MiB of live state per rank (default 256)")
    p.add_argument("--seed", type=int, default=1, help="the failure schedule's seed (default 1)")
    p.add_argument("--failures-min", type=int, default=4, help="fewest failures in the schedule (default 4)")
    p.add_argument("--failures-max", type=int, default=6, help="most failures in the schedule (default 6)")
    p.add_argument(
        "--spacing-s", type=float, default=20.0, help="failures at least this far apart (default 20 s)"
    )
    p.add_argument(
        "--warned-share", type=float, default=0.5, help="the chance a failure is warned (default 0.5)"
    )
    p.add_argument(
        "--warning-s",
        type=float,
        default=8.0,
        help="how long before a warned death its GPU warns (default 8 s)",
    )
    p.add_argument(
        "--schedule",
        default="",
        help="instead of a seeded schedule: KIND:REPLICA,... (warned or hard, on replica 0-2), in "
        "that order, evenly spread over the undisturbed run's length",
    )
    p.add_argument(
        "--every",
        type=float,
        default=3.0,
        help="ferry's snapshot interval (default 3 s, near Young/Daly's for the hard failures alone, which "
        "are all a round serves: 2.7 s with what a round costs the job's steps, about 0.056 s, rather than "
        "the group's pause; four ferry runs at 3 s had 3 s less excess on average than four at 6 s: "
        "docs/performance.md)",
    )
    p.add_argument(
        "--detect-s",
        type=int,
        default=5,
        help="how long a dead node goes unnoticed, the same for every method (default 5 s, both ferry's "
        "and TorchFT's own default): ferry's lease TTL in etcd, TorchFT's lighthouse heartbeat timeout, "
        "and the delay before the scheduler of checkpoint-restart and TorchFT answers a death (ferry's "
        "floor: 2 s)",
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=30.0,
        help="the job's collective timeout, torch.distributed's and TorchFT's (default 30 s)",
    )
    p.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"which runs, comma-separated, of {','.join(METHODS)} (the undisturbed one always runs)",
    )
    p.add_argument(
        "--keep", action="store_true", help="keep each bed's files (agents' logs and state) for a look after"
    )
    p.add_argument("--json", type=Path, default=OUT, help=f"where to write the figures (default {OUT})")
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()), help="where the beds live")
    return p


def run(args: argparse.Namespace, say: Progress) -> dict[str, Any]:
    methods = [m for m in args.methods.split(",") if m]
    if bad := [m for m in methods if m not in METHODS]:
        raise BenchError(f"unknown method(s) {bad}: choose among {', '.join(METHODS)}")
    if os.geteuid() != 0:
        raise BenchError("needs root: the bed creates network namespaces and CRIU dumps processes")
    require_criu()
    outcomes: dict[str, dict[str, Any]] = {}
    base = one("undisturbed", args, say, [], {})
    points = steps_of(base.logs)
    span, step = wall(points, args.steps), steady_step(points, [])
    if args.schedule:
        failures = fixed_schedule(args.schedule, span)
    else:
        lo, hi, start = args.failures_min, args.failures_max, args.spacing_s / 2
        failures = schedule(args.seed, span, lo, hi, args.spacing_s, args.warned_share, start)
    mtbf = span / len(failures)
    say("schedule: " + ", ".join(f"{f.at_s:.1f} s {f.kind} (replica {f.replica})" for f in failures))
    cost = save_cost(args.ballast_mb, args.workdir)
    k = {
        "checkpoint-restart": young_daly_steps(cost, mtbf, step),
        "checkpoint-restart-k": max(1, round(args.every / step)),
    }
    say(f"a checkpoint costs {cost:.2f} s: Young/Daly gives one every {k['checkpoint-restart']} steps")
    outcomes["undisturbed"] = summarise(base, args, step, None)
    ref = outcomes["undisturbed"]["digests"]
    for m in methods:
        if m == "undisturbed":
            continue
        # ferry's moves are post-copy where the node allows it (bench_migrate's raise, put back).
        old_pipe_max = allow_lazy_dumps(say) if m == "ferry" else None
        try:
            outcomes[m] = summarise(one(m, args, say, failures, k), args, step, ref)
        finally:
            if old_pipe_max is not None:
                PIPE_MAX.write_text(old_pipe_max)
    r = {
        "args": {key: str(v) for key, v in vars(args).items()},
        "seed": args.seed,
        "mtbf_s": mtbf,
        "schedule": [asdict(f) for f in failures],
        "checkpoint_cost_s": cost,
        "checkpoint_every_steps": k,
        "runs": outcomes,
        "targets": targets(outcomes),
    }
    r["report"] = format_report(r)
    return r


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from agent.coord.config import MIN_TTL_S

    if args.detect_s < MIN_TTL_S:
        parser.error(f"--detect-s {args.detect_s}: ferry's lease in etcd lasts at least {MIN_TTL_S} s")
    args.workdir.mkdir(parents=True, exist_ok=True)  # a --workdir named for this run
    say = Progress()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # the beds come down on SIGTERM too
    try:
        results = run(args, say)
    except BenchError as e:
        print(f"bench_faults: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench_faults: interrupted", file=sys.stderr)
        return 130
    print(results["report"])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    png = args.json.with_suffix(".png")
    plot(results, png)
    print(f"\nwrote {args.json} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
