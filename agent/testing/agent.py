"""`ferry` with test doubles chosen on its command line, for tests and drills on machines without a GPU.

    python -m agent.testing.agent --nvml-replay FILE agent --listen ... (the usual ferry arguments)

installs `ReplayNvml.from_file(FILE)` with `use_nvml`, so the inventory and the health monitor
answer from the telemetry file (rewritten to inject faults), and the GPU self-test runs against
a fake of the CUDA driver shaped by the same file (agent.testing.fake_selftest), and then runs the normal CLI
(agent.cli.main.main) with the rest of the arguments. Production code never chooses a double
itself, and has no switch for one: only this entry point, or a test calling use_nvml, installs it,
and neither ships in the installed package (only a checkout has agent.testing).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import pynvml

from agent.cli.main import main as ferry_main
from agent.gpus import selftest
from agent.testing.fake_selftest import ReplayedSelfTest
from agent.testing.nvml_replay import ReplayNvml

log = logging.getLogger(__name__)

USAGE = (
    "usage: python -m agent.testing.agent --nvml-replay FILE FERRY_ARGS...\n"
    "(tests and drills only: NVML answered from a replayed telemetry file)"
)
EXIT_USAGE = 2


def use_nvml(module: Any, what: str = "") -> Any:
    """Make `pynvml` answer `module` for every reader in this process (agent.gpus.inventory's
    nvml_module looks it up at each call, so the inventory and the health monitor see the same
    GPUs); None puts the real pynvml back. The stand-in takes the module's place in sys.modules:
    the product needs no hook for it. `what` names it in the warning logged now. Returns what
    was installed before (None: the real pynvml), so a caller can put it back."""
    current = sys.modules.get("pynvml", pynvml)
    sys.modules["pynvml"] = pynvml if module is None else module
    if module is not None:
        log.warning("NVML answers from %s: these are not real GPUs", what or repr(module))
    return None if current is pynvml else current


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
    replay = ReplayNvml.from_file(path)
    use_nvml(replay, f"the replay of {path}")
    # The replayed GPUs' self-test: the real measure and judge, the driver faked (no real GPU here).
    selftest.run = ReplayedSelfTest(replay._now)  # type: ignore[assignment]
    selftest.unavailable = lambda: ""  # type: ignore[assignment]
    return ferry_main(rest)


if __name__ == "__main__":
    sys.exit(main())
