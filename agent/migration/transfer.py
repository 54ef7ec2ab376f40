"""Streaming an image between agents: chunking with digests, and a bounded, checked intake."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from agent import faults
from agent.durable import write_all
from agent.errors import ImageError, NotFoundError, TransferError
from agent.image import MANIFEST, PAGES_PREFIX, FileEntry, Manifest, check_name, image_files
from agent.migration import delta
from agent.rpc import pb

CHUNK_BYTES = 1 << 20
#: Limits a lease puts on the shape of an image: CRIU writes a few files per process.
MAX_FILES = 20_000
MAX_MANIFEST_BYTES = 8 << 20


@dataclass
class SendStats:
    bytes: int = 0
    entries: list[FileEntry] = field(default_factory=list)


def _blocks(path: Path) -> Iterator[delta.Piece]:
    with open(path, "rb") as f:
        while data := f.read(CHUNK_BYTES):
            yield delta.Piece(data=data)


def send_image(
    migration_id: str,
    image_dir: Path,
    make_manifest: Callable[[list[FileEntry]], Manifest],
    stats: SendStats,
    progress: Callable[[int], None] = lambda n: None,
    digests: dict[str, str] | None = None,
    base_dir: Path | None = None,
) -> Iterator[pb.ImageChunk]:
    """Yield the image as chunks, digesting each file on the way; the manifest goes last.

    Digesting while sending reads every byte once; the manifest is built from
    those digests, so it can only be sent after the files it describes. `digests`: an image
    whose manifest is written already sends its files' digests as they are (the receiver
    checks every byte against them), and spends no time hashing them again. `base_dir`: an
    image the receiver holds too (a snapshot's keeper, agent.migration.delta): each pages file
    of known digest with a namesake there goes as ranges of it where the bytes are the same.
    `stats.bytes` counts what crossed.
    """
    first = True
    corrupt = "corrupt-chunk" in faults.active()
    paths = image_files(image_dir)
    listing = [pb.ImageFile(name=p.name, size=p.stat().st_size) for p in paths]
    for path in paths:
        h = hashlib.sha256()
        known = (digests or {}).get(path.name)
        base = base_dir / path.name if base_dir is not None and known is not None else None
        if not path.name.startswith(PAGES_PREFIX) or (base is not None and not base.is_file()):
            base = None
        size = 0
        parts = delta.pieces(path, base) if base is not None else _blocks(path)
        try:
            piece = next(parts, delta.Piece())  # a generator: its files open here
        except OSError:
            if base is None:
                raise
            # The base went (a DROP) between the check above and its open: this file goes whole.
            # (Once open, a base removed meanwhile stays readable to the end.)
            parts = _blocks(path)
            piece = next(parts, delta.Piece())
        while True:
            nxt = next(parts, None)
            data = piece.data
            if known is None:
                h.update(data)
            size += len(data) + piece.base_length
            last = nxt is None
            if corrupt and data:  # the digest above saw the true bytes
                data, corrupt = bytes([data[0] ^ 0xFF]) + data[1:], False
            yield pb.ImageChunk(
                migration_id=migration_id if first else "",
                file=path.name,
                data=data,
                last=last,
                sha256=(known or h.hexdigest()) if last else "",
                files=listing if first else (),
                base_offset=piece.base_offset,
                base_length=piece.base_length,
            )
            if first:
                faults.check("source-transferring")
            first = False
            stats.bytes += len(data)
            progress(stats.bytes)
            if nxt is None:
                break
            piece = nxt
        stats.entries.append(FileEntry(path.name, size, known or h.hexdigest()))
    if "truncate-image" in faults.active():
        return
    raw = make_manifest(stats.entries).to_json()
    yield pb.ImageChunk(
        migration_id=migration_id if first else "",
        file=MANIFEST,
        data=raw,
        last=True,
        sha256=hashlib.sha256(raw).hexdigest(),
        files=listing if first else (),
    )


class Intake:
    """Writes one incoming image into its staging dir, refusing anything unsafe.

    The first chunk lists every file and its size; the list must fit the lease
    (at most max_bytes in all, MAX_FILES files, plain names) before a byte is
    written. Then each file must be one listed, at most its listed size, created
    exclusively (never through a link), and its digest is checked as it
    completes. Memory holds one chunk: data goes to disk as it arrives.
    `finish()` checks the manifest against what arrived; nothing is restored
    from an image that has not passed it.
    """

    def __init__(
        self,
        staging: Path,
        max_bytes: int,
        node: str = "",
        max_files: int = MAX_FILES,
        base: Path | None = None,
    ) -> None:
        self.staging = staging
        #: An image this node holds whose files a chunk may copy ranges of (a snapshot's delta).
        self.base = base
        self.sent = 0  # what crossed the wire; `bytes` is what was written
        self.max_bytes = max_bytes
        self.max_files = max_files
        self.node = node
        self.bytes = 0
        self.expected: dict[str, int] | None = None
        self.received: dict[str, FileEntry] = {}
        self._name = ""
        self._fd = -1
        self._hash = hashlib.sha256()
        self._size = 0
        self._base_fd = -1  # the current file's namesake in base, opened at its first range

    def _fail(self, cause: str) -> TransferError:
        return TransferError(cause, step="transfer intake", node=self.node)

    def feed(self, chunk: pb.ImageChunk) -> None:
        if self.expected is None:
            self._announce(chunk.files)
        elif chunk.files:
            raise self._fail("the file list may come only with the first chunk")
        if chunk.file and chunk.file != self._name:
            if self._fd >= 0:
                raise self._fail(f"file {self._name!r} ended without its last chunk")
            self._open(chunk.file)
        elif self._fd < 0:
            raise self._fail("a chunk arrived without a file name")
        if chunk.base_length and chunk.data:
            raise self._fail("a chunk carries both bytes and a range of its base image")
        self.sent += len(chunk.data)
        self._take(len(chunk.data) + chunk.base_length)
        if chunk.base_length:
            for data in self._from_base(chunk.base_offset, chunk.base_length):
                write_all(self._fd, data)
                self._hash.update(data)
        else:
            write_all(self._fd, chunk.data)  # the digest below must cover only bytes on disk
            self._hash.update(chunk.data)
        if chunk.last:
            self._close_base()
            os.close(self._fd)
            self._fd = -1
            digest = self._hash.hexdigest()
            if chunk.sha256 != digest:
                raise self._fail(f"digest mismatch for {self._name!r}: the file was corrupted in transit")
            if self._name != MANIFEST and self._size != self._limit(self._name):
                raise self._fail(f"file {self._name!r} is shorter than announced (truncated)")
            self.received[self._name] = FileEntry(self._name, self._size, digest)

    def _take(self, n: int) -> None:
        self.bytes += n
        self._size += n
        if self.bytes > self.max_bytes:
            raise self._fail(f"image exceeds the lease's cap of {self.max_bytes} bytes")
        if self._size > self._limit(self._name):
            raise self._fail(f"file {self._name!r} is larger than listed ({self._limit(self._name)} bytes)")

    def _from_base(self, offset: int, length: int) -> Iterator[bytes]:
        """The base image's bytes of the current file at [offset, offset + length), in blocks."""
        if self.base is None or self._name == MANIFEST:
            raise self._fail(f"a chunk of {self._name!r} copies from a base image the stream did not name")
        if self._base_fd < 0:
            try:
                self._base_fd = os.open(self.base / self._name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError as e:  # gone since the stream began (a DROP): the sender sends it whole
                raise NotFoundError(
                    f"the base image has no {self._name!r} to copy from: {e.strerror}",
                    step="transfer intake",
                    node=self.node,
                    hint="send the image whole",
                ) from e
        end = offset + length
        if end > (have := os.fstat(self._base_fd).st_size):
            raise self._fail(f"a chunk copies up to byte {end} of the base's {self._name!r} ({have} bytes)")
        while offset < end:
            data = os.pread(self._base_fd, min(CHUNK_BYTES, end - offset), offset)
            if not data:
                raise self._fail(f"the base image's {self._name!r} ends before byte {end}")
            offset += len(data)
            yield data

    def _close_base(self) -> None:
        if self._base_fd >= 0:
            os.close(self._base_fd)
            self._base_fd = -1

    def _announce(self, files: list[pb.ImageFile]) -> None:
        if not files:
            raise self._fail("the stream did not start with its file list")
        if len(files) > self.max_files:
            raise self._fail(f"the image lists {len(files)} files; a lease allows {self.max_files}")
        expected: dict[str, int] = {}
        for f in files:
            try:
                check_name(f.name)
            except ImageError as e:
                raise self._fail(e.cause) from e
            if f.name == MANIFEST or f.name in expected:
                raise self._fail(f"file {f.name!r} is listed twice")
            expected[f.name] = f.size
        if (total := sum(expected.values())) > self.max_bytes:
            raise self._fail(f"the image lists {total} bytes; the lease's cap is {self.max_bytes}")
        self.expected = expected

    def _limit(self, name: str) -> int:
        return MAX_MANIFEST_BYTES if name == MANIFEST else (self.expected or {})[name]

    def _open(self, name: str) -> None:
        try:
            check_name(name)
        except ImageError as e:
            raise self._fail(e.cause) from e
        if name != MANIFEST and name not in (self.expected or {}):
            raise self._fail(f"file {name!r} is not in the stream's file list")
        if name in self.received:
            raise self._fail(f"file {name!r} was sent twice")
        self._name, self._hash, self._size = name, hashlib.sha256(), 0
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        self._fd = os.open(self.staging / name, flags, 0o600)

    def close(self) -> None:
        self._close_base()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def finish(self) -> Manifest:
        """The image is complete and every file matches the manifest's digest."""
        self.close()
        if MANIFEST not in self.received:
            raise self._fail("the stream ended before the manifest arrived (truncated image)")
        if missing := sorted(set(self.expected or {}) - set(self.received)):
            raise self._fail(f"the stream ended without listed files: {', '.join(missing[:5])}")
        try:
            m = Manifest.from_json((self.staging / MANIFEST).read_bytes(), where="received manifest")
            listed = {f.name: f for f in m.files}
            got = {k: v for k, v in self.received.items() if k != MANIFEST}
            if listed != got:
                missing = sorted(set(listed) - set(got))
                raise ImageError(f"received files do not match the manifest (missing: {missing or 'none'})")
            return m
        except ImageError as e:
            raise self._fail(e.cause) from e
