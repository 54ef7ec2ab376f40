"""agent.coord.pings: the other members' agents asked all along, so that the answer is there when
a lease expires (the probe's bound no longer follows every expiry)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from agent.coord.pings import Pings


def wait_for(ok: Callable[[], bool], within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while not ok() and time.monotonic() < deadline:
        time.sleep(0.01)
    return ok()


def ping_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("ping-")}


def test_an_agent_that_stops_answering_is_said_silent_until_it_answers_again() -> None:
    down: dict[str, str] = {}
    asked: list[str] = []

    def probe(agent: str) -> str:
        asked.append(agent)
        return down.get(agent, "")

    pings = Pings(probe, every_s=0.02)
    try:
        pings.watch({"a:1", "b:1"})
        assert wait_for(lambda: {"a:1", "b:1"} <= set(asked))
        assert pings.silent("a:1") == "" and pings.silent("b:1") == ""
        down["b:1"] = "deadline exceeded after 1.5 s"
        assert wait_for(lambda: pings.silent("b:1") == "deadline exceeded after 1.5 s")
        assert pings.silent("a:1") == ""
        del down["b:1"]
        assert wait_for(lambda: pings.silent("b:1") == "")
        assert pings.silent("never-asked:1") == "", "no ping is no evidence: the caller probes"
    finally:
        pings.stop()


def test_agents_no_longer_watched_are_no_longer_pinged_and_forget_their_answer() -> None:
    pings = Pings(lambda agent: "refused", every_s=0.02)
    pings.watch({"a:1", "b:1"})
    assert wait_for(lambda: pings.silent("a:1") == "refused")
    assert ping_threads() >= {"ping-a:1", "ping-b:1"}
    pings.watch({"b:1"})
    assert wait_for(lambda: "ping-a:1" not in ping_threads())
    assert pings.silent("a:1") == "" and pings.silent("b:1") == "refused"
    pings.stop()
    assert wait_for(lambda: not ping_threads())


def test_a_probe_that_raises_counts_as_unanswered_and_the_pings_go_on() -> None:
    calls = {"n": 0}

    def probe(agent: str) -> str:
        calls["n"] += 1
        raise OSError("no route to host")

    pings = Pings(probe, every_s=0.01)
    try:
        pings.watch({"a:1"})
        assert wait_for(lambda: calls["n"] >= 3)
        assert pings.silent("a:1") == "no route to host"
    finally:
        pings.stop()
