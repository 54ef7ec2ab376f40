"""The `ferry` command line: parse, call the agent, render. No logic of its own.

The entry point (pyproject's console script, `python -m agent.cli.main`). What it dispatches to:
agent.cli.parser (the argument tree and usage errors), agent.cli.jobs, agent.cli.moves,
agent.cli.gpus and agent.cli.node (the commands, by area), agent.cli.calls (reaching the agent),
agent.cli.render (text and JSON shapes).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from agent.cli import gpus, jobs, moves, node, snapshots
from agent.cli.parser import EXIT_ERROR, EXIT_OK, EXIT_USAGE, Usage, build_parser
from agent.errors import FerryError, InvalidArgumentError

__all__ = ["COMMANDS", "EXIT_ERROR", "EXIT_OK", "EXIT_USAGE", "Usage", "build_parser", "main"]

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "agent": node.cmd_agent,
    "run": jobs.cmd_run,
    "ps": jobs.cmd_ps,
    "logs": jobs.cmd_logs,
    "stop": jobs.cmd_stop,
    "forget": jobs.cmd_forget,
    "adopt": jobs.cmd_adopt,
    "migrate": moves.cmd_migrate,
    "checkpoint": moves.cmd_checkpoint,
    "protect": snapshots.cmd_protect,
    "snapshot": snapshots.cmd_snapshot,
    "rollback": snapshots.cmd_rollback,
    "restore": moves.cmd_restore,
    "resolve": moves.cmd_resolve,
    "inspect": moves.cmd_inspect,
    "gpus": gpus.cmd_gpus,
    "health": gpus.cmd_health,
    "events": gpus.cmd_events,
    "certs": node.cmd_certs,
    "doctor": node.cmd_doctor,
}


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        # gRPC's C core logs a failed handshake, a failed bind and the like on stderr, repeating
        # our one-line error in its own format. GRPC_VERBOSITY=error brings them back for
        # debugging. gRPC reads it when first imported, which is later than this.
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")
        return COMMANDS[args.cmd](args)
    except Usage as e:
        print(str(e), file=sys.stderr)
        return EXIT_USAGE
    except InvalidArgumentError as e:
        # Bad input is exit status 2 wherever it is caught: here, or by the agent.
        print(f"ferry: {e}", file=sys.stderr)
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
