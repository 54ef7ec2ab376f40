"""GPU commands: `ferry gpus` (and `--clear`), `health` and `events`."""

from __future__ import annotations

import argparse
import json
import sys

from agent.cli.calls import call, stream
from agent.cli.output import print_json
from agent.cli.parser import EXIT_OK, Usage
from agent.errors import RefusedError


def cmd_gpus(args: argparse.Namespace) -> int:
    from agent.cli.render import gpus_dict, gpus_text, health_dict, health_word
    from agent.rpc import pb

    if args.clear:
        g = call(args, "ClearGpu", pb.ClearGpuRequest(uuid=args.clear), 30)
        if args.json:
            print_json(health_dict(pb.HealthReport(nvml_available=True, gpus=[g]))["gpus"][0])
        else:
            now = health_word(g.health_state) or "not seen by NVML"
            print(f"GPU {g.uuid} cleared: ferry may place jobs on it again (now {now})")
        return EXIT_OK
    inv = call(args, "ListGpus", pb.ListGpusRequest(), 30)
    print_json(gpus_dict(inv)) if args.json else print(gpus_text(inv))
    return EXIT_OK


def cmd_health(args: argparse.Namespace) -> int:
    from agent.cli.render import event_dict, event_line, health_dict, health_text
    from agent.rpc import pb

    report = call(args, "GetHealth", pb.GetHealthRequest(), 30)
    print_json(health_dict(report)) if args.json else print(health_text(report))
    if args.watch and not report.gpus:
        raise RefusedError(
            "nothing to watch: this node has no GPUs"
            if report.nvml_available
            else f"nothing to watch: NVML is not available ({report.nvml_detail or 'no driver'})",
            step="health",
            node=report.node_name,
            hint="run `ferry health --watch` on a GPU node; `ferry events -f` follows what the agent does",
        )
    if args.watch:
        print("watching for changes (Ctrl-C to stop)", file=sys.stderr, flush=True)
        since = max((g.sampled_at for g in report.gpus), default=0.0)
        for e in stream(args, "Events", pb.EventsRequest(follow=True, limit=1), None):
            if e.event_kind == pb.EVENT_KIND_HEALTH and e.time > since:  # changes after the table above
                print(json.dumps(event_dict(e)) if args.json else event_line(e), flush=True)
    return EXIT_OK


def cmd_events(args: argparse.Namespace) -> int:
    from agent.cli.render import event_dict, event_line
    from agent.rpc import pb

    if not 0 < args.limit <= 100_000:
        raise Usage(f"ferry events: --limit {args.limit}: expected 1 to 100000")
    req = pb.EventsRequest(follow=args.follow, limit=args.limit)
    events = stream(args, "Events", req, None if args.follow else 30)
    if args.json and not args.follow:
        print_json([event_dict(e) for e in events])  # a list, like every --json: `[]` when empty
        return EXIT_OK
    seen = False
    for e in events:
        seen = True  # --follow --json: one object per line, so a follower can parse as events come
        print(json.dumps(event_dict(e), sort_keys=True) if args.json else event_line(e), flush=True)
    if not seen and not args.json:
        print("no events yet")
    return EXIT_OK
