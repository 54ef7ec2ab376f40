"""Where ferry finds its native parts and keeps its state."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

from agent.errors import RefusedError

#: The repository checkout this package runs from (for the built native parts).
REPO_ROOT = Path(__file__).resolve().parent.parent
#: What `make` builds and installs locally: ferry-init, and CRIU when the host lacks one.
LOCAL_PREFIX = REPO_ROOT / ".ferry"

#: The agent's root-only unix socket: the local CLI's default way in.
DEFAULT_SOCKET = Path("/run/ferry/agent.sock")
DEFAULT_AGENT = f"unix:{DEFAULT_SOCKET}"
DEFAULT_STAGING_ROOT = Path("/dev/shm/ferry")


def default_agent() -> str:
    return os.environ.get("FERRY_AGENT") or DEFAULT_AGENT


def default_node_name() -> str:
    return socket.gethostname()


def _find(env: str, local: Path, name: str, how: str) -> str:
    """Explicit env var, then the project-local build, then PATH."""
    explicit = os.environ.get(env)
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise RefusedError(f"{env}={explicit} is not an executable file", step="setup", hint=how)
        return explicit
    if os.access(local, os.X_OK):
        return str(local)
    found = shutil.which(name)
    if found:
        return found
    raise RefusedError(f"{name} not found (looked at ${env}, {local} and PATH)", step="setup", hint=how)


def criu_binary() -> str:
    return _find("FERRY_CRIU", LOCAL_PREFIX / "criu" / "bin" / "criu", "criu", "run `make criu`")


def init_binary() -> str:
    return _find("FERRY_INIT", LOCAL_PREFIX / "bin" / "ferry-init", "ferry-init", "run `make native`")
