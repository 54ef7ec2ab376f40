"""`ferry` with test doubles chosen on its command line, for tests and drills on machines without a GPU.

    python -m agent.testing.agent --nvml-replay FILE agent --listen ... (the usual ferry arguments)

installs `ReplayNvml.from_file(FILE)` through agent.gpus.inventory.use_nvml, so the inventory and
the health monitor answer from the telemetry file (rewritten to inject faults), and then runs the
normal CLI (agent.cli.main.main) with the rest of the arguments. Production code never chooses a
double itself: only this entry point, or a test calling use_nvml, does.
"""

from __future__ import annotations

import sys

from agent.cli.main import main as ferry_main
from agent.gpus import inventory
from agent.testing.nvml_replay import ReplayNvml

USAGE = (
    "usage: python -m agent.testing.agent --nvml-replay FILE FERRY_ARGS...\n"
    "(tests and drills only: NVML answered from a replayed telemetry file)"
)
EXIT_USAGE = 2


def main(argv: list[str] | None = None) -> int:
    """Our options come first; everything after them goes to ferry as it is (its --help, --version too)."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] and args[0].startswith("--nvml-replay="):
        path, rest = args[0].partition("=")[2], args[1:]
    elif args[:1] == ["--nvml-replay"] and len(args) >= 2:
        path, rest = args[1], args[2:]
    else:
        print(USAGE, file=sys.stderr)
        return EXIT_USAGE
    if not path:
        print(f"{USAGE}\n--nvml-replay needs a file", file=sys.stderr)
        return EXIT_USAGE
    inventory.use_nvml(ReplayNvml.from_file(path), f"the replay of {path}")
    return ferry_main(rest)


if __name__ == "__main__":
    sys.exit(main())
