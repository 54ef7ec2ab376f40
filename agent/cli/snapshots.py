"""Group snapshot commands: `ferry protect` and `ferry snapshot`, and the snapshot lines that
`ferry ps --group` prints."""

from __future__ import annotations

import argparse
import time
from typing import Any

from agent.cli.calls import call
from agent.cli.output import print_json
from agent.cli.parser import EXIT_OK
from agent.errors import NotFoundError

#: A round holds every member, dumps and ships them: a large group's takes minutes.
ROUND_TIMEOUT_S = 3600.0


def cmd_protect(args: argparse.Namespace) -> int:
    from agent.rpc import pb

    every = -1.0 if args.off else args.every
    req = pb.ProtectRequest(group=args.group, every_s=every, agents=args.members_on)
    p = call(args, "Protect", req, 30)
    if args.json:
        print_json(protection_dict(p))
    elif args.off:
        print(f"group {p.group} is no longer protected; its last snapshot is kept")
    else:
        print(f"group {p.group}: a snapshot every {p.every_s:g} s over {', '.join(p.agents)}; the first now")
    return EXIT_OK


def cmd_snapshot(args: argparse.Namespace) -> int:
    from agent.rpc import pb

    if args.last:
        found = call(args, "ListProtections", pb.ListProtectionsRequest(group=args.group), 10).protections
        if not found:
            raise NotFoundError(f"group {args.group} is not protected by agent {args.agent}")
        p = found[0]
    else:
        p = call(args, "TakeSnapshot", pb.TakeSnapshotRequest(group=args.group), ROUND_TIMEOUT_S)
    print_json(protection_dict(p)) if args.json else print("\n".join(snapshot_lines(p)))
    return EXIT_OK


def cmd_rollback(args: argparse.Namespace) -> int:
    from agent.rpc import pb

    r = call(args, "Rollback", pb.RollbackRequest(group=args.group), ROUND_TIMEOUT_S)
    if args.json:
        print_json(protection_dict(r))
        return EXIT_OK
    print(
        f"group {r.group} is back at snapshot round {r.epoch}: images fetched in {r.fetch_s:.2f} s "
        f"while it ran, then paused {r.paused_s:.2f} s"
    )
    for m in sorted(r.members, key=lambda m: (m.rank, m.job)):
        print(f"  {m.job} (rank {m.rank or '?'}) runs on {m.node}")
    return EXIT_OK


def protection_dict(p: Any) -> dict[str, object]:
    from google.protobuf import json_format

    return json_format.MessageToDict(
        p, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def snapshot_lines(p: Any, now: float | None = None) -> list[str]:
    """The group's last complete snapshot in words: its round, age, pause, size, and where each
    member's copy lives."""
    from agent.cli.render import human_bytes

    s = p.last
    lines = []
    if not s.epoch:
        lines.append(f"group {p.group}: no complete snapshot yet")
    else:
        age = (now or time.time()) - s.taken_at
        size = human_bytes(sum(m.bytes for m in s.members))
        lines.append(
            f"group {p.group}: snapshot round {s.epoch}, {age:.0f} s old, {size}, "
            f"the group paused {s.group_pause_s:.2f} s"
        )
        for m in sorted(s.members, key=lambda m: (m.rank, m.job)):
            lines.append(
                f"  {m.job} (rank {m.rank or '?'}, on {m.node}): frozen {m.frozen_s:.2f} s, "
                f"{human_bytes(m.bytes)} kept on {m.buddy_node}"
                + (f" (an increment over round {m.parent_epoch})" if m.parent_epoch else "")
            )
    if p.last_error:
        lines.append(
            f"  the latest round failed ({p.failed} of {p.rounds} since the agent started): {p.last_error}"
        )
    if p.in_progress:
        lines.append(f"  round {p.in_progress} is in progress")
    if not p.active:
        then = ": the round in progress ends first" if p.in_progress else ""
        lines.append(f"  no longer protected (`ferry protect --off`{then})")
    elif p.rounds_by:
        lines.append(f"  rounds run by {p.rounds_by}; this agent stands by to take them over")
    return lines
