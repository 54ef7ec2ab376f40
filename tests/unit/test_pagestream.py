"""Streaming a job's memory while it is dumped (agent.migration.pagestream and TargetMigrations.stream_pages).

CRIU's two ends are fakes here (FakeCriu.dump writes the "pages" into the page-server
socket, FakeCriu.page_server copies its socket into a file); the relays, the target's
lease and state checks and the manifest cross-check are the real ones. The same path
with real CRIU is in tests/integration/test_pagestream.py.
"""

from __future__ import annotations

import contextlib
import os
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakes import FakeCriu, LocalPageCall
from test_migrate_target import MID, chunks_for, make_image, prepare_req, staged, state

from agent.errors import (
    CriuError,
    FerryError,
    ImageError,
    InvalidArgumentError,
    NotFoundError,
    RefusedError,
    TransferError,
)
from agent.image import StreamDigest
from agent.migration import target as incoming
from agent.migration.pagestream import SourceRelay
from agent.migration.target import TargetMigrations
from agent.rpc import pb


@pytest.fixture
def target(tmp_path: Path, fake_criu: FakeCriu, monkeypatch: pytest.MonkeyPatch) -> TargetMigrations:
    monkeypatch.delenv("FERRY_FAULTS", raising=False)
    monkeypatch.setattr(incoming, "PROGRESS_WAIT_S", 2.0)
    registry = incoming.JobRegistry(tmp_path / "tstate", "nodeb")
    return TargetMigrations(registry, fake_criu, tmp_path / "tstaging", "nodeb")


def messages(*blobs: bytes, mid: str = MID) -> Iterator[pb.PageData]:
    yield pb.PageData(migration_id=mid)
    for b in blobs:
        yield pb.PageData(data=b)


def check_of(*blobs: bytes) -> StreamDigest:
    crc = 0
    for b in blobs:
        crc = zlib.crc32(b, crc)
    return StreamDigest(sum(map(len, blobs)), f"crc32:{crc:08x}")


def stream(target: TargetMigrations, *blobs: bytes) -> list[pb.PageData]:
    return list(target.stream_pages(messages(*blobs)))


def test_the_lease_offers_a_page_stream(target: TargetMigrations) -> None:
    assert target.prepare(prepare_req()).page_stream


def test_streamed_pages_land_in_staging_and_the_end_says_what_arrived(target: TargetMigrations) -> None:
    target.prepare(prepare_req())
    blobs = (os.urandom(300_000), os.urandom(5), os.urandom(70_000))
    out = stream(target, *blobs)

    assert out[-1].HasField("end")
    want = check_of(*blobs)
    assert (out[-1].end.bytes, out[-1].end.check) == (want.bytes, want.check)
    assert (target.staging_root / f"in-{MID}" / "pages-65537.img").read_bytes() == b"".join(blobs)
    assert state(target) == pb.TARGET_STATE_PREPARED  # waiting, under its lease, for the rest


def test_after_a_page_stream_the_image_needs_a_manifest_naming_it(
    target: TargetMigrations, tmp_path: Path
) -> None:
    target.prepare(prepare_req())
    pages = os.urandom(100_000)
    stream(target, pages)
    target.push(iter(chunks_for(make_image(tmp_path), page_stream=check_of(pages))))

    assert state(target) == pb.TARGET_STATE_VERIFIED
    assert "pages-65537.img" in os.listdir(target.staging_root / f"in-{MID}")


@pytest.mark.parametrize(
    "named",
    [None, StreamDigest(100_000, "crc32:00000000"), StreamDigest(99_999, "")],
    ids=["none", "another-checksum", "another-length"],
)
def test_a_manifest_that_names_another_page_stream_is_refused(
    target: TargetMigrations, tmp_path: Path, named: StreamDigest | None
) -> None:
    target.prepare(prepare_req())
    pages = os.urandom(100_000)
    stream(target, pages)
    if named is not None and not named.check:
        named = StreamDigest(named.bytes, check_of(pages).check)
    with pytest.raises(ImageError, match="page stream"):
        target.push(iter(chunks_for(make_image(tmp_path), page_stream=named)))
    assert state(target) == pb.TARGET_STATE_ABORTED
    assert staged(target) == []


def test_a_manifest_naming_a_page_stream_that_never_came_is_refused(
    target: TargetMigrations, tmp_path: Path
) -> None:
    target.prepare(prepare_req())
    with pytest.raises(ImageError, match="none arrived"):
        target.push(iter(chunks_for(make_image(tmp_path), page_stream=StreamDigest(10, "crc32:00000001"))))


def test_a_page_stream_beyond_the_lease_cap_is_cut_off_and_dropped(target: TargetMigrations) -> None:
    lease = target.prepare(prepare_req())
    chunk = bytes(16 << 20)  # a lease allows at least 1 GiB: reach it in few messages
    with pytest.raises(TransferError, match="exceeds the lease's cap"):
        stream(target, *[chunk] * (lease.max_bytes // len(chunk)), b"x")
    assert state(target) == pb.TARGET_STATE_ABORTED
    assert staged(target) == []


def test_a_page_stream_must_name_a_prepared_migration(target: TargetMigrations) -> None:
    with pytest.raises(NotFoundError):
        stream(target, b"data")
    with pytest.raises(InvalidArgumentError, match="migration id"):
        list(target.stream_pages(iter([pb.PageData(data=b"no id")])))


def test_a_second_page_stream_is_refused(target: TargetMigrations) -> None:
    target.prepare(prepare_req())
    stream(target, b"pages")
    with pytest.raises(RefusedError, match="already has its page stream"):
        stream(target, b"more")


def test_a_lease_that_expires_after_its_page_stream_drops_the_pages(target: TargetMigrations) -> None:
    target.prepare(prepare_req())
    stream(target, os.urandom(1000))
    target._incoming[MID].expires_at = 0  # the source never sent the rest
    target.expire()
    assert state(target) == pb.TARGET_STATE_ABORTED
    assert staged(target) == []


def test_a_message_out_of_order_fails_the_stream(target: TargetMigrations) -> None:
    target.prepare(prepare_req())

    def bad() -> Iterator[pb.PageData]:
        yield from messages(b"abc")
        yield pb.PageData(migration_id=MID)

    with pytest.raises(TransferError, match="out of order"):
        list(target.stream_pages(bad()))
    assert state(target) == pb.TARGET_STATE_ABORTED


def test_a_page_server_that_cannot_start_drops_the_migration(
    target: TargetMigrations, fake_criu: FakeCriu
) -> None:
    target.prepare(prepare_req())
    fake_criu.page_server_error = CriuError("page-server", "no page server today")
    with pytest.raises(CriuError, match="no page server today"):
        stream(target, b"pages")
    assert state(target) == pb.TARGET_STATE_ABORTED
    assert staged(target) == []


def test_a_source_whose_stream_breaks_off_leaves_nothing(target: TargetMigrations) -> None:
    target.prepare(prepare_req())

    def broken() -> Iterator[pb.PageData]:
        yield from messages(b"half of the")
        raise OSError("connection reset")

    with pytest.raises(TransferError, match="broke off"):
        list(target.stream_pages(broken()))
    assert state(target) == pb.TARGET_STATE_ABORTED
    assert staged(target) == []


# -- the source's relay ------------------------------------------------------------------


def relay_through(target: TargetMigrations, *blobs: bytes) -> SourceRelay:
    """A SourceRelay whose "CRIU" writes blobs into the page-server socket, as a dump would."""
    relay = SourceRelay(lambda reqs: LocalPageCall(target, reqs), MID, "nodea")
    # A target that refuses shuts the socket: CRIU's writes then fail, as a dump's would.
    with contextlib.suppress(BrokenPipeError), os.fdopen(os.dup(relay.criu_fd), "wb") as criu_side:
        for b in blobs:
            criu_side.write(b)
    return relay


def test_the_source_relay_confirms_what_the_target_received(target: TargetMigrations) -> None:
    target.prepare(prepare_req())
    blobs = (os.urandom(1 << 20), os.urandom(12345))
    seen: list[int] = []
    relay = relay_through(target, *blobs)
    relay.progress = seen.append
    assert relay.finish(10) == check_of(*blobs)
    assert state(target) == pb.TARGET_STATE_PREPARED


def test_the_source_relay_reports_a_target_that_refused_the_stream(target: TargetMigrations) -> None:
    relay = relay_through(target, b"pages for a migration never prepared")
    with pytest.raises(NotFoundError):
        relay.finish(10)


class _LyingCall:
    """A target that confirms a different stream than the one it was sent."""

    def __init__(self, requests: Iterator[pb.PageData]) -> None:
        self.requests = requests

    def __iter__(self) -> Iterator[pb.PageData]:
        for _ in self.requests:
            pass
        yield pb.PageData(end=pb.PageStreamEnd(bytes=3, check="crc32:00000000"))

    def cancel(self) -> None:
        pass


def test_the_source_relay_refuses_a_confirmation_that_does_not_match() -> None:
    relay = SourceRelay(_LyingCall, MID, "nodea")
    with os.fdopen(os.dup(relay.criu_fd), "wb") as criu_side:
        criu_side.write(b"abc")
    with pytest.raises(TransferError, match="arrived damaged"):
        relay.finish(10)


def test_closing_the_source_relay_ends_a_stream_in_flight(target: TargetMigrations) -> None:
    target.prepare(prepare_req())
    relay = SourceRelay(lambda reqs: LocalPageCall(target, reqs), MID, "nodea")
    os.write(relay.criu_fd, b"some pages")
    relay.close()
    with pytest.raises(FerryError):
        relay.finish(10)
