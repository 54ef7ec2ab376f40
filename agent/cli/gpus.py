"""GPU commands: `ferry gpus` (and `--clear`), `health` and `events`."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

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

    if args.group:
        if args.watch:
            raise Usage(
                "ferry health: --watch follows GPU changes; with --group, run it again (or `ferry events -f`)"
            )
        gp = call(args, "GetPace", pb.GetPaceRequest(group=args.group, whole_group=True), 30)
        print_json(pace_dict(gp)) if args.json else print(pace_text(gp))
        return EXIT_OK
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


def pace_dict(gp: Any) -> dict[str, Any]:
    from google.protobuf import json_format

    d = json_format.MessageToDict(
        gp, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    for m in d["members"]:
        m.pop("samples", None)  # the raw readings: the shares over the window say it
    return d


def pace_text(gp: Any) -> str:
    """Each member's pace over the window, the verdict, and the peers that did not answer."""
    if not gp.members:
        lines = [f"no member of group {gp.group} on this agent or the peers that answered"]
    else:
        lines = [f"group {gp.group}: the last {gp.window_s:.0f} s, busiest thread of each member"]
        lines.append(
            f"  {'member':<20} {'rank':>4}  {'node':<12} {'busy':>5} {'ran':>5} {'waited':>6}  sampled"
        )
        for m in gp.members:
            rank = str(m.rank) if m.has_rank else "-"
            state = "" if m.running else "  (not running)"
            mark = "  <- straggler" if m.job == gp.straggler else ""
            gpu = f"  GPU at {m.gpu_clock:.0%} of its max SM clock" if m.gpu_clock >= 0 else ""
            lines.append(
                f"  {m.job:<20} {rank:>4}  {m.node:<12} {m.busy:>5.0%} {m.ran:>5.0%} {m.waited:>6.0%}  "
                f"{m.covered_s:.0f} s{gpu}{state}{mark}"
            )
    lines.append(("straggler: " if gp.straggler else "") + gp.verdict)
    does = "moves it to a spare" if gp.on_straggler == "migrate" else "records it"
    lines.append(
        f"this agent's [policy] on_straggler = {gp.on_straggler} (a straggler's own agent {does}); "
        f"margin {gp.margin:.0%}"
    )
    lines += [f"not answering: {u}" for u in gp.unreachable]
    return "\n".join(lines)


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
