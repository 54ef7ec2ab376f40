"""Who holds a group back: the member that works while its peers wait for it.

Every agent samples its group members' pace (agent.health.pace) and, for each group with a
member here, asks the other members' agents for theirs (GetPace) and judges them together
(`judge`, a pure function of the samples). A member is a **straggler** when, over the whole
window, its busiest thread wanted a CPU a `margin` larger share of the time than the median of
its peers', and none of its samples is less than half that margin ahead of its peers' pace
over the same span: a pause shorter than the window is not a straggler. No verdict while any
member is not running (a move, its post-copy pages still coming, a snapshot round) or has not
been sampled for the whole window (a member restored after a move starts over), so that a group
sees at most one straggler move at a time and the member that moved is judged on its new node
only. A GPU member is judged first by its GPU's SM clock against its peers' (`_slow_gpu`).

Only the straggler's own agent acts on the verdict, as self-healing acts on its own GPUs:
`[policy] on_straggler = "alert"` records it (an event, once per episode, and the metrics);
`"migrate"` moves the member to a peer that offers room, with self-healing's cooldown and
storm guard. A second slow member is the slowest only once the first has moved, so slow
members move one at a time.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from agent.errors import InvalidArgumentError
from agent.health.pace import Sample

ON_STRAGGLER = ("alert", "migrate")


@dataclass(frozen=True)
class StragglerConfig:
    """`[stragglers]`: how members' pace is sampled and judged."""

    #: How often each member's pace is read (and groups judged).
    sample_s: float = 2.0
    #: A member must be the slowest over this long to be a straggler.
    window_s: float = 60.0
    #: By this much of the wall time (busiest thread's busy share) over its peers' median.
    margin: float = 0.3

    def check(self) -> StragglerConfig:
        if not 0 < self.sample_s <= self.window_s / 3:
            raise InvalidArgumentError(
                f"[stragglers] sample_s {self.sample_s:g} must be above 0 and at most a third of "
                f"window_s ({self.window_s:g}): a verdict needs several samples"
            )
        if not 0 < self.margin < 1:
            raise InvalidArgumentError(f"[stragglers] margin {self.margin:g} must be between 0 and 1")
        return self


@dataclass(frozen=True)
class MemberPace:
    job: str
    node: str
    running: bool
    samples: Sequence[Sample]
    rank: int | None = None


@dataclass(frozen=True)
class Pace:
    """One member's pace over the window, time-weighted."""

    busy: float
    ran: float
    waited: float
    covered_s: float  # how much of the window its samples cover
    gpu_clock: float = -1.0  # its GPU's SM clock against its maximum (-1: no GPU readings)


@dataclass(frozen=True)
class Verdict:
    straggler: str  # the job's name, "" if none
    why: str  # the evidence, or why there is no verdict
    paces: dict[str, Pace] = field(default_factory=dict)


def window_pace(samples: Sequence[Sample], start: float, end: float) -> Pace:
    """The time-weighted shares of the samples' overlap with [start, end]."""
    total = busy = ran = waited = clock = clocked = 0.0
    for s in samples:
        w = min(s.t1, end) - max(s.t0, start)
        if w <= 0:
            continue
        total += w
        busy, ran, waited = busy + s.busy * w, ran + s.ran * w, waited + s.waited * w
        if s.gpu_clock >= 0:
            clock, clocked = clock + s.gpu_clock * w, clocked + w
    if total <= 0:
        return Pace(0.0, 0.0, 0.0, 0.0)
    return Pace(busy / total, ran / total, waited / total, total, clock / clocked if clocked else -1.0)


def judge(
    members: Sequence[MemberPace], now: float, window_s: float, margin: float, sample_s: float
) -> Verdict:
    """The straggler among `members` at `now`, if any, with the evidence (module docstring)."""
    start = now - window_s
    paces = {m.job: window_pace(m.samples, start, now) for m in members}
    if len(members) < 2:
        return Verdict("", "fewer than two members answered: nothing to compare", paces)
    if busy := [m for m in members if not m.running]:
        return Verdict("", f"member {busy[0].job} is not running (moving, or held by a round)", paces)
    # A sample may start up to one interval (and its read) before the window and end as late.
    slack = 2 * sample_s + 1.0
    for m in members:
        if not m.samples or m.samples[0].t0 > start + slack or m.samples[-1].t1 < now - slack:
            got = paces[m.job].covered_s
            why = f"member {m.job} sampled for {got:.0f} s of the {window_s:.0f} s window"
            return Verdict("", why, paces)
    if slow := _slow_gpu(members, paces, start, margin):
        return Verdict(slow[0], slow[1], paces)
    cand = max(members, key=lambda m: paces[m.job].busy)
    peers = [m for m in members if m is not cand]
    ref = statistics.median(paces[m.job].busy for m in peers)
    p = paces[cand.job]
    lead = p.busy - ref
    # All along: each of its samples against its peers' pace over that same span (a slowdown
    # that filled part of the window lowers the peers' mean, not their pace beside the rest).
    leads = [
        s.busy - statistics.median(window_pace(m.samples, s.t0, s.t1).busy for m in peers)
        for s in cand.samples
        if s.t1 > start
    ]
    lowest = min(leads, default=0.0)
    if lead < margin:
        why = f"no straggler: the busiest member, {cand.job}, leads its peers by {lead:.0%}"
        why += f" (margin {margin:.0%})"
        return Verdict("", why, paces)
    if lowest < margin / 2:
        return Verdict(
            "", f"no straggler: {cand.job} led by {lead:.0%} on average but not all along (down to "
            f"{lowest:.0%} in one sample): a passing slowdown",
            paces,
        )  # fmt: skip
    kind = (
        "it waited for a CPU most of that time (a CPU quota, or a noisy neighbour)"
        if p.waited > p.ran
        else "it ran most of that time (a slower CPU, or more work)"
    )
    why = (
        f"{cand.job} on {cand.node} holds its group back: its busiest thread wanted a CPU {p.busy:.0%} "
        f"of the last {window_s:.0f} s (ran {p.ran:.0%}, waited {p.waited:.0%}) while its peers' median was "
        f"{ref:.0%}, waiting for it; {kind}"
    )
    return Verdict(cand.job, why, paces)


def _slow_gpu(
    members: Sequence[MemberPace], paces: dict[str, Pace], start: float, margin: float
) -> tuple[str, str] | tuple[()]:
    """A GPU member whose SM clock ran `margin` of its maximum below its peers' median all along
    (a GPU that slows itself: HW slowdown, thermal, power brake), with the evidence; or ()."""
    gpu = [m for m in members if paces[m.job].gpu_clock >= 0]
    if len(gpu) < 2:
        return ()
    cand = min(gpu, key=lambda m: paces[m.job].gpu_clock)
    ref = statistics.median(paces[m.job].gpu_clock for m in gpu if m is not cand)
    inside = [s for s in cand.samples if s.t1 > start and s.gpu_clock >= 0]
    if ref - paces[cand.job].gpu_clock < margin or any(ref - s.gpu_clock < margin / 2 for s in inside):
        return ()
    why = {s.gpu_brakes for s in inside if s.gpu_brakes}
    because = f" ({', '.join(sorted(why))})" if why else ""
    clock = paces[cand.job].gpu_clock
    return cand.job, (
        f"{cand.job} on {cand.node} holds its group back: its GPU ran at {clock:.0%} of its maximum "
        f"SM clock{because} while its peers' ran at {ref:.0%}"
    )
