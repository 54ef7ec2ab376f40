"""Where post-copy (`ferry migrate --post-copy`) can be served from. The source's and target's
refusals and failure handling are in test_migrate_source.py and test_migrate_target.py; the
transfer itself runs against real CRIU in tests/integration/test_postcopy.py."""

from __future__ import annotations

from pathlib import Path

from agent.criu.runner import LAZY_PIPE_BYTES, lazy_dump_blocker

# -- where a lazy dump can run -----------------------------------------------------------------


def proc_files(tmp_path: Path, cap_eff: str, pipe_max: int) -> tuple[Path, Path]:
    status, pipe = tmp_path / "status", tmp_path / "pipe-max-size"
    status.write_text(f"Name:\tferry\nCapInh:\t0000000000000000\nCapEff:\t{cap_eff}\n")
    pipe.write_text(f"{pipe_max}\n")
    return status, pipe


def test_a_lazy_dump_runs_with_cap_sys_resource_whatever_the_pipe_limit(tmp_path: Path) -> None:
    assert lazy_dump_blocker(*proc_files(tmp_path, "000001ffffffffff", 1 << 20)) == ""


def test_a_lazy_dump_runs_without_it_once_pipes_may_grow_to_4_mib(tmp_path: Path) -> None:
    assert lazy_dump_blocker(*proc_files(tmp_path, "000001fffeffffff", LAZY_PIPE_BYTES)) == ""


def test_a_lazy_dump_is_refused_without_either_and_says_what_to_raise(tmp_path: Path) -> None:
    why = lazy_dump_blocker(*proc_files(tmp_path, "000001fffeffffff", 1 << 20))
    assert "CAP_SYS_RESOURCE" in why and f"sysctl fs.pipe-max-size={LAZY_PIPE_BYTES}" in why
