"""Job commands: `ferry run`, `ps`, `logs`, `stop` and `adopt`."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from agent.cli.calls import at, call, stream
from agent.cli.output import job_out, print_json
from agent.cli.parser import EXIT_OK, Usage


def cmd_run(args: argparse.Namespace) -> int:
    from agent.cli.render import degraded_policy_pb, priority_pb
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
        priority_class=priority_pb(args.priority),
        degraded_policy=degraded_policy_pb(args.on_degraded),
        gpus=args.gpu,
        group=args.group,
        max_pause_s=args.max_pause,
        protect_every_s=args.protect,
    )
    if args.protect and not args.group:
        raise Usage("ferry run: --protect needs --group (the group whose snapshots it keeps)")
    if args.attach:
        return _attach(args, args.name, start=lambda: call(args, "Run", req, 30))
    job = call(args, "Run", req, 30)
    job_out(job, args.json, f"job {job.name} running as pid {job.pid} on {job.node_name}")
    return EXIT_OK


def _attach(args: argparse.Namespace, name: str, start: Callable[[], Any] | None = None) -> int:
    """Block while the job runs, wherever it moves; its output on ours; its exit status ours.
    SIGTERM/SIGINT stop it and wait for its end (agent.cli.follow.StopOnSignal), also when they
    come while `start` (the Run call) is under way; a lost agent is retried for --reconnect-s."""
    from agent.cli.follow import EXIT_END_UNKNOWN, EndUnknown, Followed, StopOnSignal, exit_status, follow

    where = Followed(agent=args.agent)
    with StopOnSignal(args, name, where) as stopping:
        if start is not None:
            where.job = start()
            name = where.job.name
        stopping.arm()
        try:
            last = follow(args, name, after_moves=True, into=where)
        except EndUnknown as e:
            print(f"ferry: {e}", file=sys.stderr)
            return EXIT_END_UNKNOWN
    code, why = exit_status(last.job)
    if why:
        print(f"ferry: {why}", file=sys.stderr)
    return code


def cmd_ps(args: argparse.Namespace) -> int:
    from agent.cli.render import job_dict, jobs_table
    from agent.rpc import pb

    if args.peer and not args.group:
        raise Usage("ferry ps: --peer lists a group's members on other agents; give --group NAME too")
    if args.group:
        return _ps_group(args)
    jobs = list(call(args, "ListJobs", pb.ListJobsRequest(), 10).jobs)
    print_json([job_dict(j) for j in jobs]) if args.json else print(jobs_table(jobs))
    return EXIT_OK


def _ps_group(args: argparse.Namespace) -> int:
    """The members of one training job on this agent, the given peers and the peers it knows; an
    agent that does not answer is named on stderr, and the others still listed. A malformed --peer
    is a usage error (exit 2), found before any agent is asked."""
    from agent.cli.render import job_dict, jobs_table
    from agent.errors import FerryError
    from agent.rpc import pb

    for peer in args.peer:
        _check_peer(peer)
    info = _ask(args, args.agent, "GetInfo", pb.GetInfoRequest())
    agents = [args.agent, *dict.fromkeys(a for a in [*args.peer, *info.peers] if a != args.agent)]
    members: dict[tuple[str, str], pb.Job] = {}  # one agent given twice (socket and TCP) lists once
    lost: dict[str, pb.LostMember] = {}  # members on dead nodes, as the agents with etcd saw them
    silent = 0
    for address in agents:
        try:
            jobs = _ask(args, address, "ListJobs", pb.ListJobsRequest())
        except FerryError as e:
            print(f"ferry ps: {e}", file=sys.stderr)
            silent += 1
            continue
        for j in jobs.jobs:
            if j.group == args.group:
                members.setdefault((j.node_name, j.name), j)
        for m in jobs.lost:
            if m.group == args.group:
                lost.setdefault(m.name, m)
    running = {name for (_node, name), j in members.items() if j.state != pb.JOB_STATE_MOVED}
    dead = [_lost_row(m) for name, m in sorted(lost.items()) if name not in running]
    listed = sorted(
        [*members.values(), *dead],
        key=lambda j: (j.rank if j.has_rank else 1 << 30, j.node_name, j.started_at),
    )
    if args.json:
        print_json([job_dict(j) for j in listed])
    else:
        print(
            jobs_table(listed)
            if listed
            else f"no members of group {args.group!r} on {len(agents) - silent} agent(s)"
        )
        if dead:
            print(
                f"group {args.group} is degraded: {len(dead)} member(s) on a dead node (see `ferry events`)"
            )
        for line in _snapshot_lines(args, agents):
            print(line)
    return EXIT_OK


def _snapshot_lines(args: argparse.Namespace, agents: list[str]) -> list[str]:
    """The group's last snapshot, from the agent that protects it (the first that does)."""
    from agent.cli.snapshots import snapshot_lines
    from agent.errors import FerryError
    from agent.rpc import pb

    for address in agents:
        try:
            found = _ask(args, address, "ListProtections", pb.ListProtectionsRequest(group=args.group))
        except FerryError:  # named above already, when it did not answer ListJobs
            continue
        if found.protections:
            return snapshot_lines(found.protections[0])
    return [f"group {args.group} is not protected (`ferry protect {args.group}`)"]


def _lost_row(m: Any) -> Any:
    """A member on a dead node, as a row: state lost, where it was, since when and why."""
    import time

    from agent.rpc import pb

    when = time.strftime("%H:%M:%S", time.localtime(m.since))
    note = f"node {m.node} is dead (seen by {m.seen_by} at {when}): its agent: {m.why}"
    job = pb.Job(name=m.name, group=m.group, node_name=m.node, state=pb.JOB_STATE_LOST, address=m.address)
    job.note = note
    if m.rank.isdigit():
        job.rank, job.has_rank = int(m.rank), True
    return job


def _check_peer(peer: str) -> None:
    """A --peer must be an agent's address, HOST:PORT or unix:PATH: anything else exits 2."""
    from agent.client import split_address
    from agent.errors import InvalidArgumentError

    try:
        if peer.startswith("unix:"):
            if peer == "unix:":
                raise InvalidArgumentError(f"invalid agent address {peer!r}: expected unix:PATH")
        else:
            split_address(peer)
    except InvalidArgumentError as e:
        raise Usage(f"ferry ps: --peer: {e.cause}") from e


def _ask(args: argparse.Namespace, address: str, method: str, req: Any) -> Any:
    """One call to one of the group's agents (an unreachable one is named in words by the client)."""
    return call(at(args, address), method, req, 10)


def cmd_logs(args: argparse.Namespace) -> int:
    from agent.rpc import pb

    if args.follow:
        from agent.cli.follow import EXIT_END_UNKNOWN, EndUnknown, follow

        try:
            follow(args, args.name, after_moves=True)
        except EndUnknown as e:  # its agent stayed unreachable past --reconnect-s
            print(f"ferry: {e}", file=sys.stderr)
            return EXIT_END_UNKNOWN
        return EXIT_OK
    req = pb.LogsRequest(name=args.name)
    for chunk in stream(args, "Logs", req, 60):
        out = sys.stdout if chunk.stream == pb.LOG_STREAM_STDOUT else sys.stderr
        out.buffer.write(chunk.data)
        out.flush()
    return EXIT_OK


def cmd_stop(args: argparse.Namespace) -> int:
    from agent.rpc import pb

    job = call(args, "StopJob", pb.StopJobRequest(name=args.name, timeout_s=args.timeout), args.timeout + 30)
    if job.state == pb.JOB_STATE_MIGRATING:  # remembered: carried out where the move leaves it
        job_out(job, args.json, f"job {job.name} is being moved; it is stopped where the move leaves it")
    else:
        job_out(job, args.json, f"job {job.name} stopped")
    return EXIT_OK


def cmd_forget(args: argparse.Namespace) -> int:
    from agent.rpc import pb

    job = call(args, "ForgetJob", pb.ForgetJobRequest(name=args.name), 30)
    job_out(job, args.json, f"job {job.name}: its record and logs are gone from {job.node_name}")
    return EXIT_OK


def cmd_adopt(args: argparse.Namespace) -> int:
    from agent.rpc import pb

    job = call(args, "Adopt", pb.AdoptRequest(name=args.name, pid=args.pid), 30)
    job_out(job, args.json, f"job {job.name} adopted (pid {job.pid})")
    return EXIT_OK
