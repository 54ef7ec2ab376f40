"""An exhaustive model of the move protocol: every interleaving, every gRPC status, every crash.

The source, the target and recovery are small state machines whose every state change goes
through the product's own tables (SOURCE_TRANSITIONS, TARGET_TRANSITIONS) and whose every
"may this copy run?" goes through the product's own decision (agent.migration.fencing:
`ask_target` against a peer double, then `decide`). A breadth-first search visits every
reachable world within a budget of faults (a reply lost or any non-OK gRPC status on any
call), crashes (the source agent, the target agent, at every step, each restarted) and
delayed messages (a Commit delivered late, or never), with lease expiry and post-copy's
page transfer breaking at any time; the target ends a migration as it does, through DROPPING
or UNWINDING (ABORTED only once nothing of it is left). It checks:

- at no moment do two copies of the job run;
- every world where nothing more can happen is settled: the source's record is final, exactly
  one copy runs, no lease is held on the target, no one-time key is left on the source, no
  message is still on its way.

The explorer is also run against a decision that resumes on any failed commit (the rule before
issue 27): it must find two running copies, or it would prove nothing.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator

import pytest
from fakes import FAULT_CODES, rpc_error

from agent.compat import StrEnum
from agent.errors import FerryError, RefusedError, UnavailableError
from agent.migration import fencing
from agent.migration.fencing import TargetAnswer, Verdict, ask_target, decide
from agent.migration.states import (
    MAYBE_SENT,
    NOT_SENT,
    SOURCE_TRANSITIONS,
    TARGET_TRANSITIONS,
    MigrationState,
    TargetState,
)

S, T = MigrationState, TargetState


class Copy(StrEnum):
    NONE = "none"
    RUNNING = "running"
    FROZEN = "frozen"  # the source's stopped tree
    HELD = "held"  # the target's restored tree before its commit point
    DEAD = "dead"


@dataclasses.dataclass(frozen=True)
class World:
    lazy: bool
    s: MigrationState = S.PREPARING  # the source's journal
    s_pc: str = "start"  # where the source's code is: a step name, "down" or "done"
    src: Copy = Copy.RUNNING
    key: bool = False  # the source's one-time data key on disk
    t: TargetState | None = None  # the target's journal (None: no record)
    t_pc: str = "idle"  # idle | restoring | held | down
    tgt: Copy = Copy.NONE
    commit_sent: bool = False  # a Commit on its way to the target
    reply: str = ""  # the answer to the source's Commit, once the target gave it: ok | refused
    faults: int = 3
    s_crashes: int = 2
    t_crashes: int = 2

    def but(self, **kw: object) -> World:
        return dataclasses.replace(self, **kw)

    def to_s(self, state: MigrationState) -> World:
        return self.but(s=SOURCE_TRANSITIONS.check(self.s, state, "model"))

    def to_t(self, state: TargetState) -> World:
        assert self.t is not None
        return self.but(t=TARGET_TRANSITIONS.check(self.t, state, "model"))

    @property
    def t_up(self) -> bool:
        return self.t_pc != "down"

    @property
    def lease(self) -> bool:
        return self.t is not None and self.t.in_flight


class Chooser:
    """Enumerates every sequence of choices one atomic step can make (depth-first, by replay)."""

    def __init__(self, prefix: list[int]) -> None:
        self.prefix, self.made, self.widths = prefix, [], []

    def pick(self, n: int) -> int:
        i = len(self.made)
        c = self.prefix[i] if i < len(self.prefix) else 0
        self.made.append(c)
        self.widths.append(n)
        return c


def every_run(step: Callable[[Chooser], World]) -> Iterator[World]:
    prefix: list[int] = []
    while True:
        ch = Chooser(prefix)
        yield step(ch)
        made, widths = ch.made, ch.widths
        while made and made[-1] + 1 >= widths[-1]:
            made.pop()
            widths.pop()
        if not made:
            return
        prefix = [*made[:-1], made[-1] + 1]


class Net:
    """One call's fate: delivered and answered, or any gRPC failure before or after delivery
    (each failure spends a fault). A target that is down answers UNAVAILABLE, free."""

    def __init__(self, w: World, ch: Chooser) -> None:
        self.w, self.ch = w, ch

    def call(self, deliver: Callable[[World], World]) -> None:
        if not self.w.t_up:
            raise UnavailableError("target down")
        options = 1 + (2 * len(FAULT_CODES) if self.w.faults else 0)
        c = self.ch.pick(options)
        if c == 0:
            self.w = deliver(self.w)
            return
        self.w = self.w.but(faults=self.w.faults - 1)
        code = FAULT_CODES[(c - 1) % len(FAULT_CODES)]
        if c > len(FAULT_CODES):  # delivered, its answer lost
            self.w = deliver(self.w)
        raise rpc_error(code)


class ModelPeer:
    """The target agent as the source sees it, over Net, acting on the model's target."""

    address = "target:7071"

    def __init__(self, net: Net) -> None:
        self.net = net

    def status(self, mid: str) -> int:
        out: list[int] = []

        def ask(w: World) -> World:
            out.append(w.t.wire if w.t is not None else fencing.pb.TARGET_STATE_UNKNOWN)
            return w

        self.net.call(ask)
        return out[0]

    def abort(self, mid: str, reason: str) -> None:
        refused: list[bool] = []

        def deliver(w: World) -> World:
            w2, no = target_abort(w)
            refused.append(no)
            return w2

        self.net.call(deliver)
        if refused[0]:
            raise RefusedError(f"migration {mid} is restoring the job here; it cannot be aborted")


def target_abort(w: World) -> tuple[World, bool]:
    """TargetMigrations.abort: drop what has not begun restoring (DROPPING, then ABORTED once its
    staging is gone); a tombstone for an unknown id; refused once a copy may exist here."""
    if w.t is None:
        return w.but(t=T.ABORTED), False
    if w.t in (T.RESTORING, T.POSTCOPY, T.UNWINDING, T.RUNNING):
        return w, True
    if w.t in (T.ABORTED, T.DROPPING):
        return w, False
    return w.to_t(T.DROPPING), False


# -- the source ---------------------------------------------------------------------


Decide = Callable[[MigrationState, TargetAnswer], Verdict]


def ask(w: World, ch: Chooser, fence: bool, tries: int) -> tuple[World, TargetAnswer]:
    net = Net(w, ch)
    answer = ask_target(
        ModelPeer(net), "m", fence="model" if fence else "", tries=tries, sleep=lambda s: None
    )
    return net.w, answer


def tell_abort(w: World, ch: Chooser) -> World:
    """Best effort, as the source's abort path and recovery do for a commit never sent."""
    net = Net(w, ch)
    with contextlib.suppress(FerryError):
        ModelPeer(net).abort("m", "model")
    return net.w


def resume(w: World) -> World:
    """rollback.resume, then ABORTED; the live source's abort path also drops its key."""
    live = w.s is S.ABORTING
    return w.to_s(S.ABORTED).but(src=Copy.RUNNING, s_pc="done", key=w.key and not live)


def source_steps(w: World, decide_fn: Decide) -> Iterator[tuple[str, Callable[[Chooser], World]]]:
    pc = w.s_pc
    if pc == "start":

        def prepare(ch: Chooser) -> World:
            net = Net(w, ch)
            try:
                prepare_call(net)
            except FerryError:  # refused or no answer: the lease (if granted) is released
                return tell_abort(net.w, ch).to_s(S.ABORTED).but(s_pc="done")
            return net.w.but(s_pc="granted", key=True)

        yield "prepare", prepare
    elif pc == "granted":
        # A refusal after the lease (no post-copy offered, a GPU unmapped): released at once.
        yield "refuse after lease", lambda ch: tell_abort(w, ch).to_s(S.ABORTED).but(s_pc="done", key=False)
        yield "freeze", lambda ch: w.to_s(S.DUMPING).but(src=Copy.FROZEN, s_pc="dumped")
    elif pc == "dumped":

        def push(ch: Chooser) -> World:
            net = Net(w, ch)
            try:
                net.call(target_push)
            except FerryError:
                return net.w.but(s_pc="aborting")
            return net.w.to_s(S.TRANSFERRING).to_s(S.RESTORING).but(s_pc="pushed")

        yield "push", push
    elif pc == "aborting":  # commit never sent: ABORTING journaled, the target told
        yield "abort", lambda ch: tell_abort(w.to_s(S.ABORTING), ch).but(s_pc="resuming")
    elif pc == "resuming":
        yield "resume", lambda ch: resume(w)
    elif pc == "pushed":
        yield "send commit", lambda ch: w.but(commit_sent=True, s_pc="commit-wait")
        yield "fail before commit", lambda ch: w.but(s_pc="settle")
    elif pc == "commit-wait":
        if w.reply == "ok":
            nxt = w.to_s(S.PAGING).but(s_pc="paging") if w.lazy else w.but(s_pc="finishing")
            yield "commit answered", lambda ch: nxt.but(reply="")
        elif w.reply == "refused":
            yield "commit refused", lambda ch: w.but(reply="", s_pc="settle")
        if not w.t_up or w.faults:  # no answer: a deadline, the connection lost
            spent = 0 if not w.t_up else 1
            yield "commit unanswered", lambda ch: w.but(s_pc="settle", faults=w.faults - spent)
    elif pc == "settle":

        def settle(ch: Chooser) -> World:
            w2, answer = ask(w, ch, fence=True, tries=fencing.ASK_TRIES)
            return act(w2, decide_fn(w2.s, answer), live=True)

        yield "settle", settle
    elif pc == "unresolved":

        def poll(ch: Chooser) -> World:
            w2, answer = ask(w, ch, fence=True, tries=1)
            return act(w2, decide_fn(w2.s, answer), live=False)

        yield "poll", poll
    elif pc == "finishing":  # rollback.finish, then COMMITTED
        yield "finish", lambda ch: w.but(src=Copy.DEAD, s_pc="committing")
    elif pc == "committing":  # the live source drops its key; recovery has none (swept at start)
        yield "committed", lambda ch: w.to_s(S.COMMITTED).but(s_pc="done", key=False)
    elif pc == "paging":
        if w.t is T.POSTCOPY and w.t_up:
            yield "pages all in", lambda ch: w.to_t(T.RUNNING).but(s_pc="finishing")
        yield "page transfer fails", lambda ch: w.but(s_pc="settle")
    elif pc == "down":
        yield "source restarts", lambda ch: recover_source(w.but(key=False), ch, decide_fn)
    if pc not in ("down", "done") and w.s_crashes:
        yield "source crashes", lambda ch: w.but(s_pc="down", s_crashes=w.s_crashes - 1, reply="")


def prepare_call(net: Net) -> None:
    """The Prepare call of the peer double: a lease, once per id."""

    def grant(w: World) -> World:
        return w if w.t is not None else w.but(t=T.PREPARED)  # an id already known is refused

    net.call(grant)
    if net.w.t is not T.PREPARED:
        raise RefusedError("migration already known")


def act(w: World, verdict: Verdict, live: bool) -> World:
    """The verdict carried out: by the live source (its ABORTING, its key dropped) or by
    recovery, which goes straight to the end."""
    if verdict is Verdict.RESUME:
        return w.to_s(S.ABORTING).but(s_pc="resuming") if live else resume(w)
    if verdict is Verdict.FINISH:
        return w.but(s_pc="finishing")
    held = w if w.s is S.UNRESOLVED else w.to_s(S.UNRESOLVED)
    return held.but(s_pc="unresolved", key=w.key and not live)


def recover_source(w: World, ch: Chooser, decide_fn: Decide) -> World:
    """SourceRecovery._settle at the agent's start."""
    if w.s in (S.COMMITTED, S.ABORTED):
        return w.but(s_pc="done")
    if w.s in NOT_SENT:
        return resume(tell_abort(w, ch))
    w2, answer = ask(w, ch, fence=True, tries=1)
    return act(w2, decide_fn(w2.s, answer), live=False)


# -- the target ----------------------------------------------------------------------


def target_push(w: World) -> World:
    if w.t is not T.PREPARED:
        raise RefusedError("not waiting for an image")  # dropped meanwhile: the source aborts
    return w.to_t(T.RECEIVING).to_t(T.VERIFIED)


def target_steps(w: World) -> Iterator[tuple[str, Callable[[Chooser], World]]]:
    if not w.t_up:
        yield "target restarts", lambda ch: recover_target(w)
        return
    if w.commit_sent:
        if w.t is T.VERIFIED:
            yield "commit arrives", lambda ch: w.to_t(T.RESTORING).but(commit_sent=False, t_pc="restoring")
        else:
            yield "commit arrives, refused", lambda ch: w.but(commit_sent=False, reply=_reply(w, "refused"))
        yield "commit lost", lambda ch: w.but(commit_sent=False)
    if w.t_pc == "restoring":
        yield "restored, held", lambda ch: w.but(tgt=Copy.HELD, t_pc="held")
        yield "restore fails", lambda ch: w.to_t(T.UNWINDING).but(t_pc="idle", reply=_reply(w, "refused"))
    if w.t_pc == "held":
        state = T.POSTCOPY if w.lazy else T.RUNNING
        yield (
            "commit point",
            lambda ch: w.to_t(state).but(tgt=Copy.RUNNING, t_pc="idle", reply=_reply(w, "ok")),
        )
        yield (
            "held copy fails",
            lambda ch: w.to_t(T.UNWINDING).but(t_pc="idle", reply=_reply(w, "refused")),
        )
    if w.t is T.POSTCOPY and w.t_pc == "idle":  # pages stop coming: the target ends its copy
        yield "pages break", lambda ch: w.to_t(T.UNWINDING).but(s_pc=_pages_broke(w))
    if w.t in (T.PREPARED, T.STREAMED, T.VERIFIED):
        yield "lease expires", lambda ch: w.to_t(T.DROPPING)
    # Decided under the lock, done outside it (target_effects): ABORTED only once nothing is left.
    if w.t is T.DROPPING:
        yield "dropped", lambda ch: w.to_t(T.ABORTED)
    if w.t is T.UNWINDING and w.t_pc == "idle":
        tgt = Copy.DEAD if w.tgt in (Copy.HELD, Copy.RUNNING) else w.tgt
        yield "unwound", lambda ch: w.to_t(T.ABORTED).but(tgt=tgt)
    if w.t_crashes:
        yield "target crashes", lambda ch: w.but(t_pc="down", t_crashes=w.t_crashes - 1)


def _reply(w: World, answer: str) -> str:
    """The Commit's answer reaches the source only while it waits for one."""
    return answer if w.s_pc == "commit-wait" else ""


def _pages_broke(w: World) -> str:
    return "settle" if w.s_pc == "paging" else w.s_pc


def recover_target(w: World) -> World:
    """recover_incoming: a restore not seen finish is killed; whatever was in flight is dropped."""
    if w.t is None or not w.t.in_flight:
        return w.but(t_pc="idle")
    tgt = Copy.DEAD if w.tgt in (Copy.HELD, Copy.RUNNING) else w.tgt
    return w.to_t(T.ABORTED).but(t_pc="idle", tgt=tgt)


# -- the explorer --------------------------------------------------------------------


@dataclasses.dataclass
class Report:
    states: int = 0
    runs: int = 0  # every run of every step: each gRPC status on each call is one
    terminal: int = 0
    violations: list[str] = dataclasses.field(default_factory=list)
    seen: set[tuple[object, ...]] = dataclasses.field(default_factory=set)  # (source, target, copies)


def explore(
    decide_fn: Decide = decide, lazy: bool = False, limit: int = 2_000_000, budget: tuple[int, int] = (3, 2)
) -> Report:
    logging.disable(logging.WARNING)  # every fault would log; the report says what matters
    try:
        return _explore(decide_fn, lazy, limit, budget)
    finally:
        logging.disable(logging.NOTSET)


def _explore(decide_fn: Decide, lazy: bool, limit: int, budget: tuple[int, int]) -> Report:
    faults, crashes = budget
    start = World(lazy=lazy, faults=faults, s_crashes=crashes, t_crashes=crashes)
    seen = {start}
    queue = collections.deque([(start, ())])
    report = Report()
    while queue:
        w, trail = queue.popleft()
        report.states += 1
        if w.src is Copy.RUNNING and w.tgt is Copy.RUNNING:
            report.violations.append(f"two copies run after {' → '.join(trail)}")
            continue
        steps = list(source_steps(w, decide_fn)) + list(target_steps(w))
        successors = [(name, nxt) for name, step in steps for nxt in every_run(step)]
        report.runs += len(successors)
        report.seen.add((w.s, w.t, w.src, w.tgt))
        if all(nxt == w for _, nxt in successors):  # nothing can happen any more (or only asking)
            report.terminal += 1
            if problem := unsettled(w):
                report.violations.append(f"{problem} after {' → '.join(trail)}: {w}")
            continue
        for name, nxt in successors:
            if nxt not in seen:
                seen.add(nxt)
                queue.append((nxt, (*trail, name)))
        assert len(seen) < limit, "the model's state space grew past its bound"
    return report


def unsettled(w: World) -> str:
    if w.s not in (S.COMMITTED, S.ABORTED):
        return f"the source is left {w.s.value}"
    running = [c for c in (w.src, w.tgt) if c is Copy.RUNNING]
    if len(running) != 1:
        return f"{len(running)} copies run"
    if w.src is Copy.FROZEN:
        return "a frozen copy is left"
    if w.lease:
        return "the target still holds a lease"
    if w.key:
        return "the source's one-time key is left"
    if w.commit_sent:
        return "a commit is still on its way"
    return ""


@pytest.mark.parametrize("lazy", [False, True], ids=["pre-copy", "post-copy"])
def test_the_move_protocol_never_runs_two_copies_and_always_settles(lazy: bool) -> None:
    report = explore(lazy=lazy)
    print(
        f"{'post' if lazy else 'pre'}-copy: {report.states} states, {report.runs} step runs, "
        f"{report.terminal} settled ends"
    )
    assert report.violations == []
    # The hard cases were reached, not skipped: a source holding its copy while the target
    # restores, a target that crashed with its copy held, a commit fenced before it arrived.
    assert (S.UNRESOLVED, T.RESTORING, Copy.FROZEN, Copy.NONE) in report.seen
    assert (S.UNRESOLVED, T.RESTORING, Copy.FROZEN, Copy.HELD) in report.seen
    assert (S.UNRESOLVED, T.UNWINDING, Copy.FROZEN, Copy.HELD) in report.seen
    assert (S.ABORTED, T.ABORTED, Copy.RUNNING, Copy.DEAD) in report.seen
    assert (S.COMMITTED, T.RUNNING, Copy.DEAD, Copy.RUNNING) in report.seen
    assert (S.ABORTED, T.ABORTED, Copy.RUNNING, Copy.NONE) in report.seen


def _resume_on_any_commit_failure(state: MigrationState, answer: TargetAnswer) -> Verdict:
    """Close to the rule before issue 27, under which a failed Commit resumed the copy unless the
    failure was "no answer": here, a live source's UNKNOWN resumes."""
    if state in MAYBE_SENT and answer is TargetAnswer.UNKNOWN and state is not S.UNRESOLVED:
        return Verdict.RESUME
    return decide(state, answer)


def test_the_explorer_finds_two_copies_under_the_old_rule() -> None:
    report = explore(_resume_on_any_commit_failure)
    assert any("two copies run" in v for v in report.violations)
