"""What the agent saw and did by itself, in order: `ferry events`.

GPU state changes, the decisions they led to (migrate, alert, hold back), automatic
migrations and preemptions, quarantine set and cleared. Each event is one JSON line in
``<state>/events.jsonl`` (kept to its last EVENTS_KEPT lines) and is handed to every
follower as it happens.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from agent.durable import replace_file

log = logging.getLogger(__name__)

#: Lines kept on disk; the file is cut back to this many once it holds twice as many.
EVENTS_KEPT = 5000


@dataclass(frozen=True)
class Event:
    kind: str  # health | decision | migration | preempt | resume | quarantine | alert | straggler | verify
    message: str
    gpu: str = ""
    job: str = ""
    node: str = ""
    time: float = field(default_factory=time.time)


class EventLog:
    """Append-only and thread-safe; followers get every event recorded after they subscribed."""

    def __init__(self, state_dir: Path, node: str) -> None:
        self.path = state_dir / "events.jsonl"
        self.node = node
        self._lock = threading.Lock()
        self._followers: list[queue.Queue[Event]] = []
        self._lines = _count_lines(self.path)

    def record(self, kind: str, message: str, *, gpu: str = "", job: str = "") -> Event:
        ev = Event(kind, message, gpu=gpu, job=job, node=self.node)
        log.info(
            "event %s%s%s: %s", kind, f" gpu {gpu}" if gpu else "", f" job {job}" if job else "", message
        )
        with self._lock:
            try:
                with open(self.path, "a") as f:
                    f.write(json.dumps(asdict(ev), sort_keys=True) + "\n")
                self._lines += 1
                if self._lines > 2 * EVENTS_KEPT:
                    self._trim()
            except OSError as e:  # the event still reaches followers and the log
                log.warning("cannot record an event in %s: %s", self.path, e)
            for q in self._followers:
                q.put(ev)
        return ev

    @property
    def followers(self) -> int:
        with self._lock:
            return len(self._followers)

    def recent(self, limit: int = 50) -> list[Event]:
        with self._lock:
            return self._read()[-limit:] if limit > 0 else []

    def follow(self, limit: int, alive: Callable[[], bool] = lambda: True) -> Iterator[Event]:
        """The last `limit` events, then each new one while `alive()` (the caller is still there)."""
        q: queue.Queue[Event] = queue.Queue()
        with self._lock:
            past = self._read()[-limit:] if limit > 0 else []
            self._followers.append(q)
        try:
            yield from past
            while alive():
                try:
                    yield q.get(timeout=0.5)
                except queue.Empty:
                    continue
        finally:
            with self._lock:
                self._followers.remove(q)

    def _read(self) -> list[Event]:
        out = []
        try:
            with open(self.path) as f:
                for line in f:
                    try:
                        out.append(Event(**json.loads(line)))
                    except (ValueError, TypeError):
                        continue  # a line cut by a crash
        except FileNotFoundError:
            pass
        return out

    def _trim(self) -> None:
        keep = self._read()[-EVENTS_KEPT:]
        replace_file(self.path, "".join(json.dumps(asdict(e), sort_keys=True) + "\n" for e in keep).encode())
        self._lines = len(keep)


def _count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0
