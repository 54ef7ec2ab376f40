"""The control of a job's memory on its data connection (agent.migration.pagestream and
TargetMigrations.stream_pages).

CRIU's two ends are fakes here (FakeCriu.page_server listens on loopback and copies its one
connection into a file; the tests' "dump" connects there and writes the pages, as CRIU's
would), without CRIU's TLS; the control messages, the target's lease and state checks, the
cap, the counts and the manifest cross-check are the real ones. The same path with real CRIU
and its TLS is in tests/integration/test_pagestream.py.
"""

from __future__ import annotations

import os
import queue
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakes import FakeCriu, LocalPageCall
from test_migrate_target import MID, chunks_for, make_image, prepare_req, staged, state

from agent.client import split_address
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
from agent.migration.pagestream import CHECK, SourcePages
from agent.migration.sockets import cut_connection
from agent.migration.target import TargetMigrations
from agent.rpc import pb


def send(address: tuple[str, int], *blobs: bytes) -> None:
    """What a dump does with the page server's address: connect, send the pages, close."""
    host, port = address
    with socket.create_connection(("127.0.0.1" if host == "0.0.0.0" else host, port), timeout=10) as c:
        for blob in blobs:
            c.sendall(blob)


class Source:
    """The source's side of a StreamPages call, by hand: its messages go in as the test says."""

    def __init__(self, target: TargetMigrations, mid: str = MID) -> None:
        self.out: queue.Queue[pb.PageData | None] = queue.Queue()
        self.out.put(pb.PageData(migration_id=mid))
        self.answers = target.stream_pages(self._requests())

    def _requests(self) -> Iterator[pb.PageData]:
        while (msg := self.out.get()) is not None:
            yield msg

    def page_server(self) -> tuple[str, int]:
        first = next(self.answers)
        assert first.data_address, first
        return split_address(first.data_address)

    def end(self, sent: int) -> list[pb.PageData]:
        self.out.put(pb.PageData(end=pb.PageStreamEnd(bytes=sent, check=CHECK)))
        self.out.put(None)
        return list(self.answers)


def stream(target: TargetMigrations, *blobs: bytes, claim: int | None = None) -> list[pb.PageData]:
    """A whole pre-copy stream: the page server's address, the pages sent there, the end."""
    src = Source(target)
    send(src.page_server(), *blobs)
    return src.end(sum(map(len, blobs)) if claim is None else claim)


def test_the_lease_offers_a_page_stream(target: TargetMigrations) -> None:
    assert target.prepare(prepare_req()).page_stream


def test_streamed_pages_land_in_staging_and_the_end_says_what_arrived(target: TargetMigrations) -> None:
    target.prepare(prepare_req())
    blobs = (os.urandom(300_000), os.urandom(5), os.urandom(70_000))
    out = stream(target, *blobs)

    assert out[-1].HasField("end")
    assert (out[-1].end.bytes, out[-1].end.check) == (370_005, CHECK)
    assert (target.staging_root / f"in-{MID}" / "pages-65537.img").read_bytes() == b"".join(blobs)
    assert state(target) == pb.TARGET_STATE_PREPARED  # waiting, under its lease, for the rest


def test_the_target_tells_the_source_what_has_arrived_as_it_goes(
    target: TargetMigrations, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("agent.migration.pagestream.PROGRESS_BYTES", 100_000)
    monkeypatch.setattr("agent.migration.pagestream.PROGRESS_S", 0.05)
    target.prepare(prepare_req())
    src = Source(target)
    send(src.page_server(), os.urandom(250_000))
    progress = next(src.answers)  # the source is still "dumping": the target reports unasked
    assert progress.written == 250_000 and not progress.HasField("end")
    assert src.end(250_000)[-1].end.bytes == 250_000


def test_pages_that_do_not_match_the_sources_count_are_refused(target: TargetMigrations) -> None:
    target.prepare(prepare_req())
    with pytest.raises(TransferError, match="sent 100001 bytes, the page server here wrote 100000"):
        stream(target, os.urandom(100_000), claim=100_001)
    assert state(target) == pb.TARGET_STATE_ABORTED
    assert staged(target) == []


def test_after_a_page_stream_the_image_needs_a_manifest_naming_it(
    target: TargetMigrations, tmp_path: Path
) -> None:
    target.prepare(prepare_req())
    stream(target, os.urandom(100_000))
    target.push(iter(chunks_for(make_image(tmp_path), page_stream=StreamDigest(100_000, CHECK))))

    assert state(target) == pb.TARGET_STATE_VERIFIED
    assert "pages-65537.img" in os.listdir(target.staging_root / f"in-{MID}")


@pytest.mark.parametrize(
    "named",
    [None, StreamDigest(100_000, "crc32:00000000"), StreamDigest(99_999, CHECK)],
    ids=["none", "another-check", "another-length"],
)
def test_a_manifest_that_names_another_page_stream_is_refused(
    target: TargetMigrations, tmp_path: Path, named: StreamDigest | None
) -> None:
    target.prepare(prepare_req())
    stream(target, os.urandom(100_000))
    with pytest.raises(ImageError, match="page stream"):
        target.push(iter(chunks_for(make_image(tmp_path), page_stream=named)))
    assert state(target) == pb.TARGET_STATE_ABORTED
    assert staged(target) == []


def test_a_manifest_naming_a_page_stream_that_never_came_is_refused(
    target: TargetMigrations, tmp_path: Path
) -> None:
    target.prepare(prepare_req())
    with pytest.raises(ImageError, match="none arrived"):
        target.push(iter(chunks_for(make_image(tmp_path), page_stream=StreamDigest(10, CHECK))))


def test_a_page_stream_beyond_the_lease_cap_is_cut_off_and_dropped(target: TargetMigrations) -> None:
    target.prepare(prepare_req())
    target._incoming[MID].max_bytes = 200_000  # a small lease, so the test sends little
    with pytest.raises(TransferError, match="exceeds the lease's cap of 200000 bytes"):
        stream(target, os.urandom(300_000))
    assert state(target) == pb.TARGET_STATE_ABORTED
    assert staged(target) == []


def test_a_page_stream_must_name_a_prepared_migration(target: TargetMigrations) -> None:
    with pytest.raises(NotFoundError):
        list(target.stream_pages(iter([pb.PageData(migration_id=MID)])))
    with pytest.raises(InvalidArgumentError, match="migration id"):
        list(target.stream_pages(iter([pb.PageData(end=pb.PageStreamEnd())])))


def test_a_lease_without_a_data_connection_takes_no_page_stream(target: TargetMigrations) -> None:
    lease = target.prepare(prepare_req(data_cert=b""))
    assert not lease.page_stream and not lease.data_cert  # the source pushes the whole image
    with pytest.raises(RefusedError, match="leased no data connection"):
        list(target.stream_pages(iter([pb.PageData(migration_id=MID)])))


def test_a_certificate_that_does_not_parse_is_refused_before_the_lease(target: TargetMigrations) -> None:
    with pytest.raises(InvalidArgumentError, match="one-time data certificate does not parse"):
        target.prepare(prepare_req(data_cert=b"-----BEGIN CERTIFICATE-----\nnope\n"))
    assert state(target) == pb.TARGET_STATE_UNKNOWN


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
    src = Source(target)
    src.page_server()
    src.out.put(pb.PageData(migration_id=MID))
    with pytest.raises(TransferError, match="out of order"):
        src.end(0)
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
        yield pb.PageData(migration_id=MID)
        raise OSError("connection reset")

    with pytest.raises(TransferError, match="broke off"):
        list(target.stream_pages(broken()))
    assert state(target) == pb.TARGET_STATE_ABORTED
    assert staged(target) == []


# -- the source's control ----------------------------------------------------------------


def source_pages(target: TargetMigrations) -> SourcePages:
    return SourcePages(lambda reqs: LocalPageCall(target, reqs), MID, "nodea")


def test_the_source_confirms_what_the_target_wrote(target: TargetMigrations) -> None:
    target.prepare(prepare_req())
    seen: list[int] = []
    pages = source_pages(target)
    pages.progress = seen.append
    send(pages.target_address("127.0.0.1"), os.urandom(1 << 20), os.urandom(12345))
    assert pages.finish((1 << 20) + 12345, 10) == StreamDigest((1 << 20) + 12345, CHECK)
    assert state(target) == pb.TARGET_STATE_PREPARED


def test_a_wildcard_page_server_is_reached_at_the_host_the_source_dialed(target: TargetMigrations) -> None:
    target.prepare(prepare_req())
    pages = source_pages(target)
    host, port = pages.target_address("10.98.0.2")
    assert host == "10.98.0.2" and port > 0  # target.data_host is 0.0.0.0 here
    pages.close()


def test_the_source_reports_a_target_that_refused_the_stream(target: TargetMigrations) -> None:
    pages = source_pages(target)  # a migration never prepared there
    with pytest.raises(NotFoundError):
        pages.target_address("127.0.0.1", timeout_s=10)


class _LyingCall:
    """A target that confirms a different count than the one it was sent."""

    def __init__(self, requests: Iterator[pb.PageData]) -> None:
        self.requests = requests

    def __iter__(self) -> Iterator[pb.PageData]:
        yield pb.PageData(data_address="127.0.0.1:9")
        for _ in self.requests:
            pass
        yield pb.PageData(end=pb.PageStreamEnd(bytes=3, check=CHECK))

    def cancel(self) -> None:
        pass


def test_the_source_refuses_a_confirmation_that_does_not_match() -> None:
    pages = SourcePages(_LyingCall, MID, "nodea")
    assert pages.target_address("127.0.0.1") == ("127.0.0.1", 9)
    with pytest.raises(TransferError, match="sent 4 bytes, the target's page server wrote 3"):
        pages.finish(4, 10)


class _BrokenCall:
    def __init__(self, requests: Iterator[pb.PageData]) -> None:
        self.requests = requests

    def __iter__(self) -> Iterator[pb.PageData]:
        yield pb.PageData(data_address="127.0.0.1:9")
        raise ConnectionResetError("the target's link went down")

    def cancel(self) -> None:
        pass


def test_a_control_call_that_breaks_cuts_the_data_connection() -> None:
    cut: list[bool] = []
    pages = SourcePages(_BrokenCall, MID, "nodea", on_break=lambda: cut.append(True))
    with pytest.raises(TransferError, match="control call broke"):
        pages.finish(4, 10)
    assert cut == [True]


def test_closing_the_source_ends_a_stream_in_flight(target: TargetMigrations) -> None:
    target.prepare(prepare_req())
    pages = source_pages(target)
    pages.target_address("127.0.0.1")
    pages.close()
    with pytest.raises(FerryError):
        pages.finish(0, 10)


def test_a_cut_shuts_down_that_connection_only_and_spares_the_jobs_own() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        with client, conn:
            assert cut_connection(os.getpid(), port, spare=[os.getpid()]) == 0  # "the job's" socket
            assert cut_connection(os.getpid(), port) >= 2  # both ends live in this process
            assert client.recv(10) == b"" and conn.recv(10) == b""
