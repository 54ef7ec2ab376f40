"""docs/architecture.md stays true to the code: its transition tables are the code's, its module
map names every module, and every module over about 400 lines says why at its top."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from agent.coord.liveness import LIVENESS
from agent.jobs.registry import JOB_TRANSITIONS
from agent.migration.states import SOURCE_TRANSITIONS, TARGET_TRANSITIONS
from agent.snapshots.member import HELD_TRANSITIONS
from agent.snapshots.restores import RESTORE_TRANSITIONS
from agent.statemachine import Transitions

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "architecture.md").read_text()
#: Beyond this a module must say at its top why it is one module.
LONG = 420


def _block(name: str) -> dict[str, set[str]]:
    m = re.search(rf"```transitions:{name}\n(.*?)```", DOC, re.S)
    assert m, f"docs/architecture.md has no transitions:{name} block"
    out: dict[str, set[str]] = {}
    for line in m.group(1).strip().splitlines():
        state, _, nexts = line.partition("→")
        out[state.strip()] = set() if "(final)" in nexts else {n.strip() for n in nexts.split(",")}
    return out


@pytest.mark.parametrize(
    ("name", "table"),
    [
        ("source", SOURCE_TRANSITIONS),
        ("target", TARGET_TRANSITIONS),
        ("job", JOB_TRANSITIONS),
        ("liveness", LIVENESS),
        ("snapshot", HELD_TRANSITIONS),
        ("restore", RESTORE_TRANSITIONS),
    ],
)
def test_the_documented_transitions_are_the_codes(name: str, table: Transitions) -> None:
    code = {s.value: {n.value for n in nxt} for s, nxt in table.table.items()}
    assert _block(name) == code


def _modules() -> list[Path]:
    return sorted(
        p for p in (ROOT / "agent").rglob("*.py") if p.name != "__init__.py" and "criu_pb" not in p.parts
    )


def test_the_module_map_names_every_module() -> None:
    missing = []
    for p in _modules():
        rel = p.relative_to(ROOT / "agent").as_posix()
        if f"`{rel}`" not in DOC:
            missing.append(rel)
    assert not missing, f"docs/architecture.md's module map lacks {missing}"


def test_a_long_module_says_why_at_its_top() -> None:
    silent = []
    for p in _modules():
        text = p.read_text()
        if text.count("\n") <= LONG:
            continue
        doc = ast.get_docstring(ast.parse(text)) or ""
        if "one module" not in doc.lower():
            silent.append(f"{p.relative_to(ROOT)} ({text.count(chr(10))} lines)")
    assert not silent, f"over {LONG} lines without a reason at the top (say why it is one module): {silent}"
