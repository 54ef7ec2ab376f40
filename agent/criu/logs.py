"""Where CRIU writes its logs during a migration, and which of its lines is the cause.

Each migration's CRIU logs (dump, page server, restore, lazy pages) go to
`<state>/criu-logs/<migration id>/` on its node, not into staging: staging is
dropped when a migration fails, and the log an error names must still be there
to read. A checkpoint's dump logs there too (`<checkpoint id>`), not in its
`--out`, which may be read-only, or full, and is emptied when it fails. A
successful migration's logs are removed; the newest `KEEP` failed ones are
kept, older ones pruned when a new migration starts.

CRIU marks harmless lines as errors too (on this kernel every run logs
"Can't setup RLIMIT_NOFILE"), and its RPC error message is the first error it
logged, harmless or not. `cause` skips the known harmless lines and the
summaries ("Dumping FAILED."), and quotes the first line that remains: the one
that made CRIU fail, before the consequences it logs after it.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

DIR = "criu-logs"
KEEP = 20
_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: Error lines that never are the cause, with why.
HARMLESS = (
    re.compile(r"RLIMIT_NOFILE"),  # CRIU cannot raise its own fd limit past the hard limit; it goes on
    re.compile(r"[Aa]ddress already assigned"),  # restoring a netns's loopback addresses twice (4.2.1)
    # Probes for the iptables tools, to save or restore a job's netfilter rules; absent here, and
    # the rules then go through nftables.
    re.compile(r'execvp\("ip6?tables'),
    re.compile(r"ip6?tables(-legacy)?-(save|restore) -V failed"),
)
_STAMP = re.compile(r"^\s*\(\s*[\d.]+\)\s*")  # CRIU's "(00.038573) " time stamp
#: CRIU's closing lines: they say that it failed, not why.
SUMMARY = re.compile(r"(Dumping|Restoring|Pre-dumping|Lazy pages) FAILED|Dump files \(pid: \d+\) failed")


class CriuLogs:
    """One node's CRIU log directories, one per migration."""

    def __init__(self, state_dir: Path, keep: int = KEEP) -> None:
        self.root = state_dir / DIR
        self.keep = keep

    def dir_for(self, key: str) -> Path:
        """The (new or existing) log directory of migration `key`; prunes the oldest beyond KEEP."""
        if not _KEY.match(key):
            raise ValueError(f"not a migration id: {key!r}")
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = self.root / key
        path.mkdir(mode=0o700, exist_ok=True)
        self._prune(keep_also=path)
        return path

    def done(self, key: str) -> None:
        """The migration succeeded: its logs are not needed."""
        if _KEY.match(key):
            shutil.rmtree(self.root / key, ignore_errors=True)

    def _prune(self, keep_also: Path) -> None:
        with contextlib.suppress(OSError):
            dirs = sorted(
                (d for d in self.root.iterdir() if d.is_dir() and d != keep_also),
                key=lambda d: d.stat().st_mtime,
                reverse=True,
            )
            for old in dirs[self.keep - 1 :]:
                log.info("criu logs: pruning %s", old)
                shutil.rmtree(old, ignore_errors=True)


def cause(log_path: Path | str, rpc_message: str = "") -> str:
    """The line that made CRIU fail: the first error in its log that is neither harmless nor a
    summary; else the RPC's message unless harmless; else the last error line; else ""."""
    try:
        lines = Path(log_path).read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    marked = (ln for ln in lines if "Error (" in ln or ln.lstrip().startswith("Error"))
    errors = [_STAMP.sub("", ln).strip() for ln in marked]
    real = [ln for ln in errors if not _harmless(ln) and not SUMMARY.search(ln)]
    if real:
        return real[0]
    if rpc_message and not _harmless(rpc_message):
        return rpc_message.strip()
    rest = [ln for ln in errors if not _harmless(ln)]
    return rest[-1] if rest else ""


def _harmless(line: str) -> bool:
    return any(p.search(line) for p in HARMLESS)
