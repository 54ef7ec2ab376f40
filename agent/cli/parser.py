"""The `ferry` argument tree: every command, option and `--help` text, and how bad input is reported.

Why one module: it is the whole of what a user can type, read top to bottom as `ferry --help`
shows it; split by command, the shared options (--agent, --json, TLS) would be wired in several
places.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from agent import __version__, config

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


class Usage(Exception):
    """Bad command-line input: printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """Usage errors raise Usage instead of exiting, so main() prints them in one line."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise Usage(f"{self.prog}: {message} (see `{self.prog} --help`)")


def _agent_arg(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("reaching the agent")
    g.add_argument(
        "--agent",
        default=config.default_agent(),
        metavar="ADDRESS",
        help="HOST:PORT (mutual TLS) or unix:PATH (the local socket; root only). "
        f"Default: $FERRY_AGENT, else {config.DEFAULT_AGENT}",
    )
    g.add_argument(
        "--tls-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="directory with ca.pem and your certificate (default: $FERRY_TLS_DIR, else /etc/ferry/tls)",
    )
    g.add_argument(
        "--tls-name",
        default=os.environ.get("FERRY_TLS_NAME", ""),
        metavar="NAME",
        help="use DIR/NAME.pem and DIR/NAME-key.pem (default: $FERRY_TLS_NAME, else the only one in DIR)",
    )
    g.add_argument(
        "--insecure",
        action="store_true",
        default=os.environ.get("FERRY_INSECURE") == "1",
        help="plaintext to a loopback agent started with --insecure (default: $FERRY_INSECURE=1)",
    )


def _reconnect_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--reconnect-s",
        type=float,
        default=None,
        metavar="SECONDS",
        help="when the agent is lost while following (restarted, crashed), retry it this long before "
        "giving up with exit status 255 (default 60)",
    )


def _json_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


def duration(text: str) -> float:
    """Seconds from 90, 90s, 1.5m or 1h."""
    t = text.strip().lower()
    unit = t[-1:] if t[-1:] in _UNITS and not t[-1:].isdigit() else ""
    try:
        value = float(t[: len(t) - len(unit)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration: use 90, 90s, 5m or 1h") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration above zero")
    return value * _UNITS[unit]


def build_parser() -> Parser:
    p = Parser(
        prog="ferry",
        description="Live-migrate unmodified training processes between nodes. Every node runs "
        "`ferry agent`; the other commands talk to an agent over gRPC.",
    )
    p.add_argument("--version", action="version", version=f"ferry {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND", parser_class=Parser)

    a = sub.add_parser("agent", help="run the node agent (as root)", description="Run the node agent.")
    a.add_argument("--listen", required=True, metavar="HOST:PORT", help="address to serve on (port 0: any)")
    a.add_argument("--state-dir", required=True, type=Path, help="where job records and logs live")
    a.add_argument(
        "--node-name", default=config.default_node_name(), help="this node's name (default: hostname)"
    )
    a.add_argument("--staging-dir", type=Path, help="where images are staged (default: /dev/shm/ferry/NODE)")
    a.add_argument(
        "--tls-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="ca.pem and this node's NODE.pem / NODE-key.pem from `ferry certs node` "
        "(default: $FERRY_TLS_DIR, else /etc/ferry/tls)",
    )
    a.add_argument(
        "--socket",
        default=str(config.DEFAULT_SOCKET),
        metavar="PATH",
        help=f"root-only unix socket for the local CLI (default {config.DEFAULT_SOCKET}; 'none': no socket)",
    )
    a.add_argument(
        "--insecure",
        action="store_true",
        help="serve plaintext instead of TLS; allowed only on a loopback --listen address (tests, demos)",
    )
    a.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help="TOML file with the health thresholds ([health]), the self-healing policy ([policy]) and "
        'the peers jobs may move to ([[peers]] address = "HOST:PORT", spare = true); see docs/health.md',
    )
    a.add_argument(
        "--metrics-listen",
        default="",
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics ([::1]:PORT for IPv6; port 0: any). "
        "Plain HTTP on "
        "loopback; any other address is served over mutual TLS with --tls-dir's certificate, so the "
        "scraper needs a certificate of the cluster CA (docs/operations.md). Default: no metrics",
    )
    a.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="how much the agent logs on stderr (default info)",
    )

    r = sub.add_parser(
        "run",
        help="start a job under the agent",
        description="Start CMD in its own PID namespace under a small init; stdin is /dev/null, "
        "stdout/stderr go to files the agent owns (see `ferry logs`).",
    )
    _agent_arg(r)
    r.add_argument("--name", required=True, help="the job's name, unique on the node")
    r.add_argument("--cwd", default=None, help="working directory (default: the current one)")
    r.add_argument("--env", action="append", default=[], metavar="K=V", help="set an environment variable")
    r.add_argument(
        "--group",
        default="",
        metavar="NAME",
        help="label the job as one member of the training job NAME (one per node, e.g. each node's "
        "torchrun agent or each RANK of an env:// launch); `ferry ps --group NAME` lists the members",
    )
    r.add_argument(
        "--max-pause",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="the longest the job's peers tolerate it frozen (its process group's timeout, if smaller "
        "than gloo's 30 min default); a move expected to freeze it longer is refused (docs/distributed.md)",
    )
    r.add_argument(
        "--protect",
        type=duration,
        default=0.0,
        metavar="DURATION",
        help="with --group, on a node with [coordination]: keep snapshots of the group, a round every "
        "DURATION (as `ferry protect GROUP --every DURATION`). Give it to every member: one agent at a "
        "time runs the rounds, and another takes over if its node dies (docs/recovery.md)",
    )
    r.add_argument(
        "--gpu",
        action="append",
        default=[],
        metavar="UUID",
        help="give the job this GPU to itself (repeatable; see `ferry gpus`); it becomes the job's "
        "CUDA_VISIBLE_DEVICES, and its health is the job's: see --on-degraded",
    )
    r.add_argument(
        "--priority",
        choices=["normal", "low"],
        default="normal",
        help="low: preemptible. When a normal job must leave a degrading or failing GPU and no idle GPU "
        "is left, a low job is suspended to storage to make room, and resumes on its node once a GPU is "
        "free again",
    )
    r.add_argument(
        "--on-degraded",
        choices=["migrate", "alert"],
        default="migrate",
        help="what the agent does when the job's GPU degrades or fails: migrate it to a peer by itself "
        "(default), or only record an alert (`ferry events`)",
    )
    r.add_argument(
        "--attach",
        action="store_true",
        help="block while the job runs, wherever it moves; print its output and exit with its exit "
        "status (128+N if killed by signal N) once it has ended. The first SIGTERM or Ctrl-C stops "
        "the job (SIGTERM, SIGKILL 10 s later) and waits for its end; a third exits at once. Exit "
        "status 255: its agent stayed unreachable. For a scheduler's batch step or a pod's main "
        "container: docs/slurm.md",
    )
    _reconnect_arg(r)
    _json_arg(r)
    r.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        metavar="-- CMD [ARGS...]",
        help="the command to run, after `--`",
    )

    ps = sub.add_parser(
        "ps",
        help="list jobs",
        description="List this agent's jobs and their states; with --group, the members of one training "
        "job on this agent, on each --peer, and on the peers this agent's config names.",
    )
    _agent_arg(ps)
    ps.add_argument(
        "--group", default="", metavar="NAME", help="only the members of training job NAME, on every agent"
    )
    ps.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="with --group: also ask this agent (repeatable; the local agent's [[peers]] are asked anyway)",
    )
    _json_arg(ps)

    lg = sub.add_parser("logs", help="print a job's output", description="Print a job's stdout and stderr.")
    _agent_arg(lg)
    lg.add_argument("name", help="the job's name (see `ferry ps`)")
    lg.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="keep printing while the job runs; when it moves, say where and go on printing there "
        "(reaching that agent needs --insecure on loopback or a client certificate)",
    )
    _reconnect_arg(lg)

    st = sub.add_parser("stop", help="stop a job", description="SIGTERM the job, SIGKILL after --timeout.")
    _agent_arg(st)
    st.add_argument("name", help="the job to stop")
    st.add_argument("--timeout", type=float, default=10.0, help="seconds before SIGKILL (default 10)")
    _json_arg(st)

    fg = sub.add_parser(
        "forget",
        help="drop an ended job's record and logs",
        description="Remove the record and the logs of a job that ended here (exited, stopped, moved, "
        "checkpointed or lost), so that `ferry ps` no longer lists it. A running or preempted job is "
        "refused. A checkpoint's image directory is kept. An arriving job replaces an ended record "
        "of its name by itself.",
    )
    _agent_arg(fg)
    fg.add_argument("name", help="the ended job to forget")
    _json_arg(fg)

    ad = sub.add_parser(
        "adopt",
        help="take over a running process",
        description="Track a process ferry did not start. It keeps its host PIDs: a migration "
        "target must have them free (checked before anything is frozen).",
    )
    _agent_arg(ad)
    ad.add_argument("--pid", type=int, required=True, help="the process to take over (its whole tree)")
    ad.add_argument("--name", required=True, help="the name to give it, unique on the node")
    _json_arg(ad)

    mg = sub.add_parser(
        "migrate",
        help="move a running job to another agent",
        description="Prepare on the target, freeze the job, move it, run it there, then end "
        "the source copy. By default the move is post-copy where both nodes can serve it (the "
        "faster method in docs/performance.md), else pre-copy; the summary says which ran and "
        "why. A protected group member moved by default or pre-copy to the node that keeps its "
        "last snapshot image goes as an increment over that image: only what it wrote since "
        "crosses, and the target restores it over the copy it keeps. A failure before the move "
        "completes resumes the job here: it never runs twice.",
    )
    _agent_arg(mg)
    mg.add_argument("name", help="the job to move (see `ferry ps`)")
    mg.add_argument("--to", required=True, metavar="HOST:PORT", help="the target agent")
    how = mg.add_mutually_exclusive_group()
    how.add_argument(
        "--post-copy",
        "--lazy",
        dest="method",
        action="store_const",
        const="post-copy",
        help="post-copy, and fail rather than fall back: everything but the memory moves, the job "
        "runs on the target at once and each page follows from this node's frozen copy (CRIU lazy "
        "pages); the job's memory is written once, straight into it. Until its last page is in, "
        "the job needs both nodes: if either fails, the target's copy is killed and the job "
        "resumes here from where it froze. Needs userfaultfd on the target and, without "
        "CAP_SYS_RESOURCE, fs.pipe-max-size >= 4 MiB here",
    )
    how.add_argument(
        "--pre-copy",
        dest="method",
        action="store_const",
        const="pre-copy",
        help="pre-copy: the memory streams into the target's staging while the job is dumped and "
        "the target restores from there; the job needs this node only until the target runs it",
    )
    how.add_argument(
        "--staged",
        dest="method",
        action="store_const",
        const="staged",
        help="dump the whole image into staging on this node first, then copy it (slowest: the "
        "pipeline before memory streaming, kept for comparison)",
    )
    _json_arg(mg)

    ck = sub.add_parser(
        "checkpoint",
        help="save a job to a directory",
        description="Dump a job into DIR (on the agent's node). "
        "The job ends afterwards unless --leave-running.",
    )
    _agent_arg(ck)
    ck.add_argument("name", help="the job to save")
    ck.add_argument("--out", required=True, type=Path, metavar="DIR", help="a new or empty directory")
    ck.add_argument("--leave-running", action="store_true", help="keep the job running after the dump")
    _json_arg(ck)

    pr = sub.add_parser(
        "protect",
        help="keep snapshots of a group, every interval",
        description="Keep a consistent snapshot of every member of a group (`ferry run --group`): each "
        "round freezes every member and cuts its link, dumps each, releases them all together, then "
        "sends each image to the memory of another node (its buddy). A round counts once every buddy "
        "has verified its copy; the previous one is kept until then. The agent asked coordinates the "
        "rounds, and goes on after a restart. `ferry ps --group` shows the last snapshot.",
    )
    _agent_arg(pr)
    pr.add_argument("group", help="the group to protect")
    pr.add_argument(
        "--every",
        type=duration,
        default=0.0,
        metavar="DURATION",
        help="time between rounds: 90, 90s, 5m or 1h (default: the agent's [snapshots] every_s, 300 s)",
    )
    pr.add_argument(
        "--members-on",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="the agent of a node that runs members of the group, this one's included (repeatable; "
        "with [coordination], etcd's member keys say it)",
    )
    pr.add_argument(
        "--off", action="store_true", help="stop protecting the group (its last snapshot is kept)"
    )
    _json_arg(pr)

    sn = sub.add_parser(
        "snapshot",
        help="take a group's snapshot now",
        description="Run one snapshot round of a group this agent protects (`ferry protect`) now, and "
        "print each member's pause, image size and buddy.",
    )
    _agent_arg(sn)
    sn.add_argument("group", help="a group this agent protects")
    sn.add_argument(
        "--last", action="store_true", help="print the last complete snapshot instead of taking one"
    )
    _json_arg(sn)

    rb = sub.add_parser(
        "rollback",
        help="roll a group back to its last snapshot",
        description="Bring every member of a group this agent protects back to its last complete "
        "snapshot (`ferry snapshot GROUP --last`), each on the node it ran on then: the images come "
        "from their buddies while the job runs; then every running copy of a member ends, every "
        "member is restored, and all go on together. The steps since the snapshot run again; what "
        "the job wrote to its logs and to shared storage since then stays (docs/recovery.md).",
    )
    _agent_arg(rb)
    rb.add_argument("group", help="a group this agent protects")
    _json_arg(rb)

    rs = sub.add_parser(
        "restore",
        help="resume a saved job",
        description="Resume a job saved by `checkpoint`. Refused while the job runs (on this agent, "
        "or on a peer it lists, when DIR is readable here) and once DIR was restored: one image, "
        "one running copy, unless --as-copy.",
    )
    _agent_arg(rs)
    rs.add_argument("dir", type=Path, metavar="DIR", help="an image saved by `ferry checkpoint`")
    named = rs.add_mutually_exclusive_group()
    named.add_argument("--name", default="", help="run it under another name")
    named.add_argument(
        "--as-copy",
        default="",
        metavar="NAME",
        help="run a second copy of the job, named NAME, although the job runs or DIR was restored "
        "before; on a job network the copy gets its own address",
    )
    _json_arg(rs)

    rv = sub.add_parser(
        "resolve",
        help="settle a migration left unresolved",
        description="A migration is UNRESOLVED when the target stopped answering while it restored "
        "the job: the source keeps its copy frozen so that two never run, and keeps asking. This asks "
        "the target once more and acts only on a definite answer. If the target node is gone for good "
        "or you checked it yourself, say what you know: --resume (the job does not run there) resumes "
        "the frozen copy here; --finish (it does) ends it.",
    )
    _agent_arg(rv)
    rv.add_argument("name", help="the job (on the source agent)")
    how = rv.add_mutually_exclusive_group()
    how.add_argument("--resume", action="store_true", help="the target does not run the job: resume it here")
    how.add_argument("--finish", action="store_true", help="the target runs the job: end the copy here")
    _json_arg(rv)

    ins = sub.add_parser(
        "inspect",
        help="describe a saved image",
        description="Show an image's manifest and check its digests.",
    )
    ins.add_argument("dir", type=Path, metavar="DIR", help="an image saved by `ferry checkpoint`")
    ins.add_argument("--no-verify", action="store_true", help="skip the digest check")
    _json_arg(ins)

    gp = sub.add_parser(
        "gpus",
        help="list an agent's GPUs",
        description="Show the GPUs of the agent's node (NVML): chip, memory, processes, and whether "
        "its NVIDIA driver can checkpoint CUDA processes (needed to migrate GPU jobs).",
    )
    _agent_arg(gp)
    gp.add_argument(
        "--clear",
        metavar="UUID",
        help="an operator's word that this GPU is fixed: lift its quarantine and forget the faults it "
        "latched (XIDs, uncorrectable ECC), so ferry places jobs on it again",
    )
    _json_arg(gp)

    he = sub.add_parser(
        "health",
        help="show the GPUs' health",
        description="Each GPU's state as the agent's health monitor sees it through NVML: healthy, "
        "degraded (a precursor crossed its threshold: heat, corrected-ECC bursts, pending row remaps, "
        "throttling, PCIe replays, NVLink errors) or failing (a hard fault: XID 79, uncorrectable ECC, "
        "remap failure), with the evidence, the jobs on it and whether it is quarantined. With --group, "
        "the pace of a training job's members instead, and which one holds the group back.",
    )
    _agent_arg(he)
    he.add_argument("--watch", action="store_true", help="then keep printing health changes as they happen")
    he.add_argument(
        "--group",
        metavar="NAME",
        help="show group NAME's members instead: each one's share of the straggler window its busiest "
        "thread wanted a CPU (ran, or waited for one), over this agent's members and its peers', and the "
        "verdict: the straggler holding the group back, or why there is none",
    )
    _json_arg(he)

    ev = sub.add_parser(
        "events",
        help="what the agent did by itself, and why",
        description="GPU state changes and every automatic decision with its reason: migrations, "
        "alerts, moves held back by the cooldown or storm guard, preemptions, resumes, quarantines.",
    )
    _agent_arg(ev)
    ev.add_argument("-f", "--follow", action="store_true", help="keep printing new events")
    ev.add_argument("-n", "--limit", type=int, default=50, metavar="N", help="the last N events (default 50)")
    _json_arg(ev)

    ce = sub.add_parser(
        "certs",
        help="make a cluster CA and node/client certificates",
        description="Create a cluster CA, then certificates it signs: one per node (an agent: serves "
        "and calls peers) and one per client (drives agents). Keys are written 0600 and never "
        "overwritten. Meant for a test or small cluster.",
    )
    ce_sub = ce.add_subparsers(dest="certs_cmd", required=True, metavar="WHAT", parser_class=Parser)
    c_ca = ce_sub.add_parser("ca", help="create the CA (ca.pem, ca-key.pem)")
    c_node = ce_sub.add_parser("node", help="issue a node certificate (NAME.pem, NAME-key.pem)")
    c_node.add_argument("name", help="the node's name (its certificate's common name)")
    c_node.add_argument(
        "--host",
        action="append",
        default=[],
        required=True,
        metavar="HOST",
        help="a DNS name or IP address peers dial to reach this node (repeatable)",
    )
    c_client = ce_sub.add_parser("client", help="issue a client certificate (NAME.pem, NAME-key.pem)")
    c_client.add_argument("name", help="who the client is (its certificate's common name)")
    for c in (c_ca, c_node, c_client):
        c.add_argument("--dir", type=Path, required=True, help="the directory holding the CA")
        _json_arg(c)

    dr = sub.add_parser(
        "doctor", help="check this host", description="Check whether this host can migrate jobs."
    )
    dr.add_argument(
        "--staging-dir",
        type=Path,
        default=config.DEFAULT_STAGING_ROOT,
        help="where the agent stages incoming images (default: %(default)s)",
    )
    dr.add_argument(
        "--config",
        type=Path,
        default=None,
        help="the agent's config file, to check its [network] too (the job network's bridge)",
    )
    dr.add_argument(
        "--deep",
        action="store_true",
        help="also run every GPU's self-test: a device-memory pattern test over --share of its free "
        "memory and an FP32 throughput test against its chip's expected rate (seconds to a minute "
        "per GPU; needs `make native`'s kernels, built where nvcc is)",
    )
    dr.add_argument(
        "--share",
        type=float,
        default=0.05,
        help="with --deep: the share of each GPU's free memory the pattern test covers (default %(default)s)",
    )
    _json_arg(dr)
    return p
