"""Moving and saving jobs: `ferry migrate`, `checkpoint`, `restore`, `resolve`, and `inspect` for a
saved image."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

from agent.cli.calls import call, stream
from agent.cli.output import job_out, print_json
from agent.cli.parser import EXIT_OK, Usage
from agent.errors import FerryError


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
    print_json(result_dict(result)) if as_json else print(summary(result))
    return EXIT_OK


def cmd_migrate(args: argparse.Namespace) -> int:
    from agent.client import split_address
    from agent.errors import InvalidArgumentError
    from agent.rpc import pb

    try:
        split_address(args.to)
    except InvalidArgumentError as e:
        raise Usage(f"ferry migrate: --to: {e.cause}") from e
    from agent.migration.model import Method
    from agent.wire import METHODS

    method = Method(args.method or Method.DEFAULT)
    req = pb.MigrateRequest(
        name=args.name,
        target=args.to,
        method=0 if method is Method.DEFAULT else METHODS.pb(method),
        # An older agent reads these; it knows no default but pre-copy.
        staged=method is Method.STAGED,
        lazy=method is Method.POST_COPY,
    )
    events = stream(args, "Migrate", req, 3600)
    return _follow_progress(events, args.json)


def cmd_checkpoint(args: argparse.Namespace) -> int:
    from agent.rpc import pb

    req = pb.CheckpointRequest(
        name=args.name, out_dir=str(args.out.absolute()), leave_running=args.leave_running
    )
    return _follow_progress(stream(args, "Checkpoint", req, 3600), args.json)


def cmd_restore(args: argparse.Namespace) -> int:
    import sys

    from agent.cli.calls import at
    from agent.errors import AlreadyExistsError, ImageError
    from agent.image import describes, read_manifest
    from agent.rpc import pb

    image = args.dir.absolute()
    copy = f"`ferry restore {image} --as-copy NAME` runs a second copy"
    # The agent refuses to restore a job that runs on its node. Its peers are asked here, with
    # the caller's credentials (agents may not list each other's jobs), when DIR is readable here.
    try:
        spec = None if args.as_copy else read_manifest(image).job
    except ImageError:
        spec = None  # DIR is on the agent's node only: the agent checks what it can
    live = (pb.JOB_STATE_RUNNING, pb.JOB_STATE_MIGRATING, pb.JOB_STATE_PREEMPTED)
    peers = call(args, "GetInfo", pb.GetInfoRequest(), 10).peers if spec is not None else []
    for peer in dict.fromkeys(p for p in peers if p != args.agent):
        assert spec is not None
        try:
            jobs = call(at(args, peer), "ListJobs", pb.ListJobsRequest(), 3).jobs
        except FerryError as e:
            print(
                f"ferry restore: cannot ask {peer} whether job {spec.name} runs there: {e}", file=sys.stderr
            )
            continue
        for j in jobs:
            if j.state in live and describes(spec, j.name, list(j.command), j.cwd, j.address):
                where = f"{j.node_name} ({peer}, pid {j.pid})"
                raise AlreadyExistsError(
                    f"job {j.name!r}, which image {image} holds, still runs on {where}",
                    step="restore",
                    hint=f"stop it there first, or {copy}",
                )
    name = args.as_copy or args.name
    req = pb.RestoreRequest(image_dir=str(image), name=name, as_copy=bool(args.as_copy))
    job = call(args, "Restore", req, 600)
    job_out(job, args.json, f"job {job.name} restored as pid {job.pid} on {job.node_name}")
    return EXIT_OK


def cmd_resolve(args: argparse.Namespace) -> int:
    from agent.cli.render import job_state
    from agent.rpc import pb

    how = (
        pb.RESOLVE_ACTION_RESUME
        if args.resume
        else pb.RESOLVE_ACTION_FINISH
        if args.finish
        else pb.RESOLVE_ACTION_ASK
    )
    job = call(args, "Resolve", pb.ResolveRequest(name=args.name, resolution=how), 60)
    job_out(job, args.json, f"job {job.name} is {job_state(job)}: {job.note}")
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    from agent.cli.render import human_bytes, table
    from agent.image import inspect_data

    d = inspect_data(args.dir, check=not args.no_verify)
    if args.json:
        print_json(d)
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
