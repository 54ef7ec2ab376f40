"""A snapshot image sent as what changed since the copy its keeper holds (agent.migration.delta):
the pieces, and the keeper rebuilding the image from them and its copy, checked by digest."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from agent.errors import NotFoundError, TransferError
from agent.image import MANIFEST, JobSpec, build_manifest, read_manifest, verify
from agent.migration import delta
from agent.migration.transfer import Intake, SendStats, send_image
from agent.rpc import pb

PAGE = delta.PAGE
JOB = JobSpec(
    name="train",
    kind="launched",
    command=["python", "train.py"],
    cwd="/work",
    env=[],
    stdout_path="/state/jobs/train/stdout.log",
    stderr_path="/state/jobs/train/stderr.log",
    pid=1,
)


def pages(n: int) -> list[bytes]:
    return [os.urandom(PAGE) for _ in range(n)]


def rebuilt(new: Path, base: Path) -> tuple[bytes, int]:
    """What the pieces of new over base make, and how many bytes of it were sent as data."""
    raw, sent = bytearray(), 0
    old = base.read_bytes()
    for p in delta.pieces(new, base):
        assert not (p.data and p.base_length)
        raw += p.data or old[p.base_offset : p.base_offset + p.base_length]
        sent += len(p.data)
    return bytes(raw), sent


def test_an_unchanged_file_is_one_range_of_its_base(tmp_path: Path) -> None:
    base, new = tmp_path / "base", tmp_path / "new"
    base.write_bytes(b"".join(pages(600)))  # more than one block
    shutil.copy(base, new)
    got = list(delta.pieces(new, base))
    assert got == [delta.Piece(base_offset=0, base_length=600 * PAGE)]


def test_a_shifted_layout_and_a_changed_page_send_only_the_new_bytes(tmp_path: Path) -> None:
    # A mapping that appeared before the others shifts them by whole pages; one page changed.
    a, b, c = pages(300), pages(300), pages(300)
    base, new = tmp_path / "base", tmp_path / "new"
    base.write_bytes(b"".join(a + b + c))
    fresh = pages(7)
    b2 = list(b)
    b2[123] = os.urandom(PAGE)
    new.write_bytes(b"".join(fresh + a + b2 + c))

    raw, sent = rebuilt(new, base)

    assert raw == new.read_bytes()
    assert sent == 8 * PAGE  # the 7 new pages and the changed one


def test_a_file_shorter_or_longer_than_its_base_and_a_partial_page_rebuild(tmp_path: Path) -> None:
    base, new = tmp_path / "base", tmp_path / "new"
    base.write_bytes(b"".join(pages(10)) + b"tail")
    new.write_bytes(base.read_bytes()[: 5 * PAGE] + os.urandom(100))
    assert rebuilt(new, base)[0] == new.read_bytes()
    new.write_bytes(base.read_bytes() * 2)
    assert rebuilt(new, base)[0] == new.read_bytes()


def image(d: Path, files: dict[str, bytes]) -> Path:
    d.mkdir()
    for name, raw in files.items():
        (d / name).write_bytes(raw)
    build_manifest(d, JOB, "node-a")
    return d


def ship(img: Path, base: Path | None, into: Path, keeper_base: Path | None) -> Intake:
    digests = {f.name: f.sha256 for f in read_manifest(img).files}
    m = read_manifest(img)
    chunks = send_image("", img, lambda entries: m, SendStats(), digests=digests, base_dir=base)
    into.mkdir()
    intake = Intake(into, 1 << 30, base=keeper_base)
    for c in chunks:
        intake.feed(c)
    intake.finish()
    return intake


def test_the_keeper_rebuilds_the_image_from_its_copy_and_the_changes_and_verifies_it(tmp_path: Path) -> None:
    old = pages(400)
    base = image(tmp_path / "r1", {"pages-1.img": b"".join(old), "core-1.img": b"core"})
    new = list(old)
    new[17] = os.urandom(PAGE)
    img = image(tmp_path / "r2", {"pages-1.img": b"".join(pages(3) + new), "core-1.img": b"core 2"})
    keeper_copy = tmp_path / "keeper-r1"
    shutil.copytree(base, keeper_copy)

    intake = ship(img, base, tmp_path / "got", keeper_copy)

    assert verify(tmp_path / "got").files == read_manifest(img).files
    assert (tmp_path / "got" / "pages-1.img").read_bytes() == (img / "pages-1.img").read_bytes()
    assert intake.bytes == read_manifest(img).image_bytes + (img / MANIFEST).stat().st_size
    assert intake.sent < 5 * PAGE + 4096  # 4 pages, core-1.img and the manifest


def test_a_keeper_whose_copy_differs_from_the_base_fails_the_digest_never_keeps_a_wrong_image(
    tmp_path: Path,
) -> None:
    old = pages(50)
    base = image(tmp_path / "r1", {"pages-1.img": b"".join(old)})
    img = image(tmp_path / "r2", {"pages-1.img": b"".join(old[:49] + pages(1))})
    keeper_copy = tmp_path / "keeper-r1"
    shutil.copytree(base, keeper_copy)
    (keeper_copy / "pages-1.img").write_bytes(b"".join(pages(50)))  # not what the source read

    with pytest.raises(TransferError, match="digest mismatch"):
        ship(img, base, tmp_path / "got", keeper_copy)


def test_a_range_without_a_base_or_past_its_end_is_refused(tmp_path: Path) -> None:
    listing = [pb.ImageFile(name="pages-1.img", size=PAGE)]
    copy = pb.ImageChunk(file="pages-1.img", base_offset=0, base_length=PAGE, last=True, files=listing)
    (tmp_path / "a").mkdir()
    with pytest.raises(TransferError, match="did not name"):
        Intake(tmp_path / "a", 1 << 20).feed(copy)
    short = image(tmp_path / "short", {"pages-1.img": b"x" * 100})
    (tmp_path / "b").mkdir()
    with pytest.raises(
        TransferError, match=re.escape("copies up to byte 4096 of the base's 'pages-1.img' (100 bytes)")
    ):
        Intake(tmp_path / "b", 1 << 20, base=short).feed(copy)
    far = pb.ImageChunk(file="pages-1.img", base_offset=1 << 63, base_length=1, last=True, files=listing)
    (tmp_path / "d").mkdir()
    with pytest.raises(TransferError, match="copies up to byte"):  # never an OverflowError
        Intake(tmp_path / "d", 1 << 20, base=short).feed(far)
    both = pb.ImageChunk(file="pages-1.img", data=b"x", base_length=PAGE, files=listing)
    (tmp_path / "c").mkdir()
    with pytest.raises(TransferError, match="both bytes and a range"):
        Intake(tmp_path / "c", 1 << 20, base=short).feed(both)


def test_a_base_gone_from_the_keeper_is_not_found_so_the_image_goes_whole(tmp_path: Path) -> None:
    old = pages(20)
    base = image(tmp_path / "r1", {"pages-1.img": b"".join(old)})
    img = image(tmp_path / "r2", {"pages-1.img": b"".join(old[:19] + pages(1))})
    keeper_copy = tmp_path / "keeper-r1"
    shutil.copytree(base, keeper_copy)
    (keeper_copy / "pages-1.img").unlink()  # a DROP removed it after the stream began
    with pytest.raises(NotFoundError, match=re.escape("no 'pages-1.img' to copy from")):
        ship(img, base, tmp_path / "got", keeper_copy)


def test_a_base_gone_from_the_source_before_its_open_sends_the_file_whole(tmp_path: Path) -> None:
    old = pages(20)
    base = image(tmp_path / "r1", {"pages-1.img": b"".join(old)})
    img = image(tmp_path / "r2", {"pages-1.img": b"".join(old[:19] + pages(1))})
    real = delta.pieces

    def gone(new: Path, b: Path):  # the file was there at the check, not at the open
        b.unlink(missing_ok=True)
        return real(new, b)

    delta.pieces = gone  # type: ignore[assignment]
    try:
        intake = ship(img, base, tmp_path / "got", None)
    finally:
        delta.pieces = real  # type: ignore[assignment]
    assert (tmp_path / "got" / "pages-1.img").read_bytes() == (img / "pages-1.img").read_bytes()
    assert intake.sent >= 20 * PAGE


def test_a_block_found_whole_ends_a_row_of_misses(tmp_path: Path) -> None:
    # Rewritten blocks far apart, then a mapping that shifts the rest: the shifted pages are
    # still found, since the unchanged blocks between ended each row of misses.
    blk = delta.BLOCK // PAGE
    parts = [pages(blk) for _ in range(12)]
    base, new = tmp_path / "base", tmp_path / "new"
    base.write_bytes(b"".join(b"".join(p) for p in parts))
    rewritten = [pages(blk) if i % 2 == 0 and i < 10 else p for i, p in enumerate(parts)]
    new.write_bytes(
        b"".join(b"".join(p) for p in rewritten[:10])
        + b"".join(pages(3))
        + b"".join(b"".join(p) for p in rewritten[10:])
    )
    raw, sent = rebuilt(new, base)
    assert raw == new.read_bytes()
    assert sent == (5 * blk + 3) * PAGE  # the five rewritten blocks and the three new pages


def test_a_base_over_the_index_limit_is_compared_in_place_only(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(delta, "INDEX_MAX_BYTES", 4 * PAGE)
    old = pages(8)
    base, new = tmp_path / "base", tmp_path / "new"
    base.write_bytes(b"".join(old))
    new.write_bytes(b"".join(pages(1) + old))  # shifted by a page: found only through the index
    raw, sent = rebuilt(new, base)
    assert raw == new.read_bytes() and sent == 9 * PAGE
    monkeypatch.setattr(delta, "INDEX_MAX_BYTES", 1 << 30)
    assert rebuilt(new, base)[1] == PAGE
