"""The `ferry` command line: parse, call the agent, render. No logic of its own."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from agent import __version__, config
from agent.errors import FerryError

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


class Usage(Exception):
    """Bad command-line input: printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
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


def _json_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


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
    a.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])

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
    _json_arg(r)
    r.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]")

    ps = sub.add_parser("ps", help="list jobs", description="List this agent's jobs and their states.")
    _agent_arg(ps)
    _json_arg(ps)

    lg = sub.add_parser("logs", help="print a job's output", description="Print a job's stdout and stderr.")
    _agent_arg(lg)
    lg.add_argument("name")
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing while the job runs")

    st = sub.add_parser("stop", help="stop a job", description="SIGTERM the job, SIGKILL after --timeout.")
    _agent_arg(st)
    st.add_argument("name")
    st.add_argument("--timeout", type=float, default=10.0, help="seconds before SIGKILL (default 10)")
    _json_arg(st)

    ad = sub.add_parser(
        "adopt",
        help="take over a running process",
        description="Track a process ferry did not start. It keeps its host PIDs: a migration "
        "target must have them free (checked before anything is frozen).",
    )
    _agent_arg(ad)
    ad.add_argument("--pid", type=int, required=True)
    ad.add_argument("--name", required=True)
    _json_arg(ad)

    mg = sub.add_parser(
        "migrate",
        help="move a running job to another agent",
        description="Prepare on the target, freeze and dump the job while its memory streams "
        "into the target's staging, send the rest of the image, restore on the target, then end "
        "the source copy. Any failure before the target runs the job resumes it on the source.",
    )
    _agent_arg(mg)
    mg.add_argument("name")
    mg.add_argument("--to", required=True, metavar="HOST:PORT", help="the target agent")
    mg.add_argument(
        "--staged",
        action="store_true",
        help="dump the whole image into staging on this node first, then copy it (slower: the "
        "pipeline before memory streaming, kept for comparison)",
    )
    mg.add_argument(
        "--lazy",
        action="store_true",
        help="post-copy: resume the job on the target before its memory has arrived; each page "
        "follows when the job first touches it. Until its last page is in, the job needs both "
        "nodes: if either fails, the target's copy is killed and the job resumes here from where "
        "it froze. A job that touches all its memory at once (a training step) waits on every "
        "page, which is slower than the default (docs/performance.md). Needs userfaultfd on the "
        "target",
    )
    _json_arg(mg)

    ck = sub.add_parser(
        "checkpoint",
        help="save a job to a directory",
        description="Dump a job into DIR (on the agent's node). "
        "The job ends afterwards unless --leave-running.",
    )
    _agent_arg(ck)
    ck.add_argument("name")
    ck.add_argument("--out", required=True, type=Path, metavar="DIR", help="a new or empty directory")
    ck.add_argument("--leave-running", action="store_true", help="keep the job running after the dump")
    _json_arg(ck)

    rs = sub.add_parser(
        "restore", help="resume a saved job", description="Resume a job saved by `checkpoint`."
    )
    _agent_arg(rs)
    rs.add_argument("dir", type=Path, metavar="DIR")
    rs.add_argument("--name", default="", help="run it under another name")
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
    ins.add_argument("dir", type=Path, metavar="DIR")
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
        "remap failure), with the evidence, the jobs on it and whether it is quarantined.",
    )
    _agent_arg(he)
    he.add_argument("--watch", action="store_true", help="then keep printing health changes as they happen")
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
    _json_arg(dr)
    return p


# -- commands -------------------------------------------------------------------------


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True))


def cmd_agent(args: argparse.Namespace) -> int:
    from agent.service.serve import serve

    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from agent import tls
    from agent.certs import Role

    staging = args.staging_dir or config.DEFAULT_STAGING_ROOT / args.node_name
    identity = None
    if args.insecure and args.tls_dir:
        raise Usage("ferry agent: --insecure serves plaintext and --tls-dir TLS; give one of them")
    if not args.insecure:
        try:
            identity = tls.load(args.tls_dir or tls.default_dir(), args.node_name, Role.NODE)
        except FerryError as e:
            e.hint = (
                f"issue one with `ferry certs node {args.node_name} --host HOST --dir DIR` and pass "
                "--tls-dir DIR; or serve plaintext on loopback with --insecure"
            )
            raise
    args.state_dir.mkdir(parents=True, exist_ok=True)
    from agent import agent_config

    settings = agent_config.load(args.config)
    socket_path = None if args.socket == "none" else Path(args.socket)
    serve(
        args.listen,
        args.state_dir.resolve(),
        args.node_name,
        staging,
        args.insecure,
        identity,
        socket_path,
        settings,
    )
    return EXIT_OK


def _job_out(job: Any, as_json: bool, text: str) -> None:
    from agent.cli.render import job_dict

    _print_json(job_dict(job)) if as_json else print(text)


def cmd_run(args: argparse.Namespace) -> int:
    from agent.rpc import pb

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise Usage("ferry run: no command given (usage: ferry run --name NAME -- CMD [ARGS...])")
    cwd = os.path.abspath(args.cwd or os.getcwd())
    req = pb.RunRequest(
        name=args.name,
        command=command,
        cwd=cwd,
        env=args.env,
        priority=args.priority,
        on_degraded=args.on_degraded,
        gpus=args.gpu,
    )
    job = _call(args, "Run", req, 30)
    _job_out(job, args.json, f"job {job.name} running as pid {job.pid} on {job.node_name}")
    return EXIT_OK


def cmd_ps(args: argparse.Namespace) -> int:
    from agent.cli.render import job_dict, jobs_table
    from agent.rpc import pb

    jobs = list(_call(args, "ListJobs", pb.ListJobsRequest(), 10).jobs)
    _print_json([job_dict(j) for j in jobs]) if args.json else print(jobs_table(jobs))
    return EXIT_OK


def cmd_logs(args: argparse.Namespace) -> int:
    from agent.rpc import pb

    req = pb.LogsRequest(name=args.name, follow=args.follow)
    for chunk in _stream(args, "Logs", req, None if args.follow else 60):
        out = sys.stdout if chunk.stream == pb.LOG_STREAM_STDOUT else sys.stderr
        out.buffer.write(chunk.data)
        out.flush()
    return EXIT_OK


def cmd_stop(args: argparse.Namespace) -> int:
    from agent.rpc import pb

    job = _call(args, "StopJob", pb.StopJobRequest(name=args.name, timeout_s=args.timeout), args.timeout + 30)
    _job_out(job, args.json, f"job {job.name} stopped")
    return EXIT_OK


def cmd_adopt(args: argparse.Namespace) -> int:
    from agent.rpc import pb

    job = _call(args, "Adopt", pb.AdoptRequest(name=args.name, pid=args.pid), 30)
    _job_out(job, args.json, f"job {job.name} adopted (pid {job.pid})")
    return EXIT_OK


def _follow_progress(events: Iterator[Any], as_json: bool) -> int:
    from agent.cli.render import ProgressLine, result_dict, summary

    line = ProgressLine()
    result = None
    try:
        for ev in events:
            if ev.HasField("result"):
                result = ev.result
            elif not as_json:
                line.update(ev)
    finally:
        line.close()
    if result is None:
        raise FerryError("the agent ended the stream without a result; see `ferry ps`")
    _print_json(result_dict(result)) if as_json else print(summary(result))
    return EXIT_OK


def cmd_migrate(args: argparse.Namespace) -> int:
    from agent.client import split_address
    from agent.errors import InvalidArgumentError
    from agent.rpc import pb

    try:
        split_address(args.to)
    except InvalidArgumentError as e:
        raise Usage(f"ferry migrate: --to: {e.cause}") from e
    if args.lazy and args.staged:
        raise Usage("ferry migrate: --lazy and --staged exclude each other (post-copy stages nothing)")
    req = pb.MigrateRequest(name=args.name, target=args.to, staged=args.staged, lazy=args.lazy)
    events = _stream(args, "Migrate", req, 3600)
    return _follow_progress(events, args.json)


def cmd_checkpoint(args: argparse.Namespace) -> int:
    from agent.rpc import pb

    req = pb.CheckpointRequest(
        name=args.name, out_dir=str(args.out.absolute()), leave_running=args.leave_running
    )
    return _follow_progress(_stream(args, "Checkpoint", req, 3600), args.json)


def cmd_restore(args: argparse.Namespace) -> int:
    from agent.rpc import pb

    req = pb.RestoreRequest(image_dir=str(args.dir.absolute()), name=args.name)
    job = _call(args, "Restore", req, 600)
    _job_out(job, args.json, f"job {job.name} restored as pid {job.pid} on {job.node_name}")
    return EXIT_OK


def cmd_resolve(args: argparse.Namespace) -> int:
    from agent.cli.render import job_state
    from agent.rpc import pb

    action = "resume" if args.resume else "finish" if args.finish else ""
    job = _call(args, "Resolve", pb.ResolveRequest(name=args.name, action=action), 60)
    _job_out(job, args.json, f"job {job.name} is {job_state(job)}: {job.note}")
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    from agent.cli.render import human_bytes, table
    from agent.image import inspect_data

    d = inspect_data(args.dir, check=not args.no_verify)
    if args.json:
        _print_json(d)
        return EXIT_OK
    job = d["job"]
    print(
        f"image {d['path']}  (manifest version {d['version']}, "
        f"{'digests verified' if d['verified'] else 'digests NOT checked'})"
    )
    print(f"job {job['name']} ({job['kind']}) from node {d['source_node']}: {' '.join(job['command'])}")
    print(
        f"host memory {human_bytes(d['host_bytes'])}, GPU memory {human_bytes(d['gpu_bytes'])}, "
        f"image {human_bytes(d['image_bytes'])} in {len(d['files'])} files"
    )
    print(
        table(["FILE", "SIZE", "SHA256"], [[f["name"], str(f["size"]), f["sha256"][:16]] for f in d["files"]])
    )
    if cuda := d.get("cuda"):
        for g in cuda["gpus"]:
            print(f"GPU {g['uuid']} ({g['name']}): {human_bytes(g['memory_bytes'])} of device memory")
        pids = ", ".join(str(p["ns_pid"]) for p in cuda["processes"])
        print(f"CUDA processes (job PIDs): {pids}; dumped under driver {cuda['driver_version']}")
    if d["criu_stats"]:
        print("criu stats: " + ", ".join(f"{k}={v}" for k, v in sorted(d["criu_stats"].items())))
    if d["timings"]:
        print("timings: " + ", ".join(f"{k} {v:.3f} s" for k, v in d["timings"].items()))
    return EXIT_OK


def cmd_gpus(args: argparse.Namespace) -> int:
    from agent.cli.render import gpus_dict, gpus_text, health_dict
    from agent.rpc import pb

    if args.clear:
        g = _call(args, "ClearGpu", pb.ClearGpuRequest(uuid=args.clear), 30)
        if args.json:
            _print_json(health_dict(pb.HealthReport(nvml_available=True, gpus=[g]))["gpus"][0])
        else:
            now = g.state or "not seen by NVML"
            print(f"GPU {g.uuid} cleared: ferry may place jobs on it again (now {now})")
        return EXIT_OK
    inv = _call(args, "ListGpus", pb.ListGpusRequest(), 30)
    _print_json(gpus_dict(inv)) if args.json else print(gpus_text(inv))
    return EXIT_OK


def cmd_health(args: argparse.Namespace) -> int:
    from agent.cli.render import event_dict, event_line, health_dict, health_text
    from agent.rpc import pb

    report = _call(args, "GetHealth", pb.GetHealthRequest(), 30)
    _print_json(health_dict(report)) if args.json else print(health_text(report))
    if args.watch:
        since = max((g.sampled_at for g in report.gpus), default=0.0)
        for e in _stream(args, "Events", pb.EventsRequest(follow=True, limit=1), None):
            if e.kind == "health" and e.time > since:  # changes after the table above
                print(json.dumps(event_dict(e)) if args.json else event_line(e), flush=True)
    return EXIT_OK


def cmd_events(args: argparse.Namespace) -> int:
    from agent.cli.render import event_dict, event_line
    from agent.rpc import pb

    if not 0 < args.limit <= 100_000:
        raise Usage(f"ferry events: --limit {args.limit}: expected 1 to 100000")
    req = pb.EventsRequest(follow=args.follow, limit=args.limit)
    seen = False
    for e in _stream(args, "Events", req, None if args.follow else 30):
        seen = True  # --json: one object per line, so a follower can parse as events come
        print(json.dumps(event_dict(e), sort_keys=True) if args.json else event_line(e), flush=True)
    if not seen and not args.json:
        print("no events yet")
    return EXIT_OK


def cmd_certs(args: argparse.Namespace) -> int:
    from agent import certs

    if args.certs_cmd == "ca":
        out = certs.create_ca(args.dir)
    else:
        role = certs.Role.NODE if args.certs_cmd == "node" else certs.Role.CLIENT
        out = certs.issue(args.dir, args.name, role, getattr(args, "host", []))
    if args.json:
        _print_json(
            {
                "cert": str(out.cert),
                "key": str(out.key),
                "subject": out.subject,
                "not_after": out.not_after.isoformat(),
            }
        )
    else:
        print(f"{out.cert} and {out.key} ({out.subject}, valid until {out.not_after:%Y-%m-%d})")
    return EXIT_OK


def cmd_doctor(args: argparse.Namespace) -> int:
    from agent import agent_config
    from agent.cli.doctor import can_migrate, run_checks

    checks = run_checks(args.staging_dir, agent_config.load(args.config).network)
    ok = can_migrate(checks)
    if args.json:
        _print_json({"can_migrate": ok, "checks": [c.__dict__ for c in checks]})
    else:
        for c in checks:
            mark = "ok  " if c.ok else ("FAIL" if c.required else "warn")
            fix = f"  -> {c.fix}" if not c.ok and c.fix else ""
            print(f"[{mark}] {c.name}: {c.detail}{fix}")
        print("this host can migrate jobs" if ok else "this host cannot migrate jobs yet (see FAIL above)")
    return EXIT_OK if ok else EXIT_ERROR


# -- plumbing -------------------------------------------------------------------------


def _dial(args: argparse.Namespace) -> Any:
    """Credentials for --agent: none for the unix socket or --insecure, else our client certificate."""
    from agent import tls
    from agent.client import Dial

    if args.agent.startswith("unix:") or args.insecure:
        return Dial(insecure=args.insecure)
    return Dial(tls.load(args.tls_dir or tls.default_dir(), args.tls_name))


def _call(args: argparse.Namespace, method: str, req: Any, timeout: float) -> Any:
    import grpc

    from agent.client import from_rpc_error, stub

    dial = _dial(args)
    try:
        return getattr(stub(args.agent, dial), method)(req, timeout=timeout)
    except grpc.RpcError as e:
        raise from_rpc_error(e, args.agent, method, dial) from e


def _stream(args: argparse.Namespace, method: str, req: Any, timeout: float | None) -> Iterator[Any]:
    import grpc

    from agent.client import from_rpc_error, stub

    dial = _dial(args)
    try:
        yield from getattr(stub(args.agent, dial), method)(req, timeout=timeout)
    except grpc.RpcError as e:
        raise from_rpc_error(e, args.agent, method, dial) from e


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "agent": cmd_agent,
    "run": cmd_run,
    "ps": cmd_ps,
    "logs": cmd_logs,
    "stop": cmd_stop,
    "adopt": cmd_adopt,
    "migrate": cmd_migrate,
    "checkpoint": cmd_checkpoint,
    "restore": cmd_restore,
    "resolve": cmd_resolve,
    "inspect": cmd_inspect,
    "gpus": cmd_gpus,
    "health": cmd_health,
    "events": cmd_events,
    "certs": cmd_certs,
    "doctor": cmd_doctor,
}


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return COMMANDS[args.cmd](args)
    except Usage as e:
        print(str(e), file=sys.stderr)
        return EXIT_USAGE
    except FerryError as e:
        print(f"ferry: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(
            "ferry: interrupted (a migration in progress goes on in the agent; see `ferry ps`)",
            file=sys.stderr,
        )
        return 130


if __name__ == "__main__":
    sys.exit(main())
