"""GPUs ferry no longer places jobs on: each one caused an automatic migration.

A quarantined GPU is never chosen as a target (incoming migrations, resumes) until an
operator clears it with `ferry gpus --clear UUID`. The set lives in
``<state>/quarantine.json`` so that it survives agent restarts.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from agent.durable import replace_file
from agent.errors import RefusedError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Entry:
    uuid: str
    reason: str
    since: float


class Quarantine:
    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "quarantine.json"
        self._lock = threading.Lock()
        self._entries = self._load()

    def add(self, uuid: str, reason: str) -> bool:
        """False when it was already quarantined (the first reason is kept)."""
        with self._lock:
            if uuid in self._entries:
                return False
            self._entries[uuid] = Entry(uuid, reason, time.time())
            self._save()
            return True

    def clear(self, uuid: str) -> Entry | None:
        with self._lock:
            entry = self._entries.pop(uuid, None)
            if entry is not None:
                self._save()
            return entry

    def get(self, uuid: str) -> Entry | None:
        with self._lock:
            return self._entries.get(uuid)

    def all(self) -> dict[str, Entry]:
        with self._lock:
            return dict(self._entries)

    def _load(self) -> dict[str, Entry]:
        try:
            raw = json.loads(self.path.read_text())
            return {e["uuid"]: Entry(str(e["uuid"]), str(e["reason"]), float(e["since"])) for e in raw}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, TypeError, KeyError) as e:
            # Losing the list would put jobs back on bad GPUs: refuse to start instead.
            raise RefusedError(
                f"unreadable quarantine list {self.path}: {e}",
                step="start",
                hint="fix it, or remove it to clear every quarantine",
            ) from e

    def _save(self) -> None:
        # Durable: a quarantine must outlive a power loss, or a bad GPU takes jobs again.
        replace_file(self.path, json.dumps([asdict(e) for e in self._entries.values()], indent=2).encode())
