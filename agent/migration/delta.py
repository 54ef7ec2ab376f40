"""A snapshot image sent as what changed since the copy its keeper already holds.

Without dirty tracking (a CUDA member, `[snapshots] incremental = false`) every round dumps each
member whole, and most of its memory is what the last round's image held (libraries, heap,
state the job keeps); so is every chain's first, whole, image. The keeper of a member's copy
still holds that member's image of the last round it verified: a file of the new image is
sent as pieces, each either bytes or a range of the same file of that base image with the same
bytes. The keeper rebuilds the whole file from the two and checks it against the manifest's
digest, as for any image: a wrong range is a digest mismatch, never a wrong restore.

CRIU writes the pages in the order of their addresses, and a mapping that appears or goes
shifts everything after it, but only by whole pages: a block that differs in place is looked up
page by page among the base's pages (by CRC, then compared byte for byte).
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PAGE = 4096
BLOCK = 1 << 20
#: The longest range one piece copies: the keeper reads it in blocks, but a piece stays bounded.
MAX_COPY = 64 << 20
#: Blocks in a row without a page of base after which pages are no longer looked up one by one
#: (a block is still compared whole, where the last page was found and in place).
GIVE_UP = 4
#: The largest base whose pages are indexed (a dict entry a page: some 25 MB of the agent's
#: memory a GiB). A larger one (a GPU member's image holds its device memory) is compared in
#: place and where the last page was found only, so a mapping that shifts the rest goes whole.
INDEX_MAX_BYTES = 1 << 30


@dataclass(frozen=True)
class Piece:
    """Either data (bytes of the new file) or a range of the base file (data empty)."""

    data: bytes = b""
    base_offset: int = 0
    base_length: int = 0


class _Base:
    """The base file, read where asked; its pages' CRCs indexed at the first miss in place."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.size = os.fstat(fd).st_size
        self._index: dict[int, int] | None = None

    def at(self, offset: int, length: int) -> bytes:
        return os.pread(self.fd, length, offset) if offset + length <= self.size else b""

    def find(self, page: bytes, offset: int) -> int | None:
        """Where base holds these bytes: at `offset` itself, else any page with the same bytes."""
        if self.at(offset, len(page)) == page:
            return offset
        if self._index is None:
            self._index = self._build()
        src = self._index.get(zlib.crc32(page))
        return src if src is not None and self.at(src, len(page)) == page else None

    def _build(self) -> dict[int, int]:
        index: dict[int, int] = {}
        if self.size > INDEX_MAX_BYTES:
            return index
        for off in range(0, self.size - self.size % PAGE, BLOCK):
            block = os.pread(self.fd, BLOCK, off)
            for i in range(0, len(block) - len(block) % PAGE, PAGE):
                index.setdefault(zlib.crc32(block[i : i + PAGE]), off + i)
        return index


def pieces(new: Path, base: Path) -> Iterator[Piece]:
    """The new file, in order, as pieces: runs of base's bytes merged, data in blocks of BLOCK."""
    with open(new, "rb") as f, open(base, "rb") as b:
        src = _Base(b.fileno())
        lit = bytearray()
        run_at, run_len = 0, 0
        off = 0
        shift = 0  # where the last page found lay in base, less where it lies here
        misses = 0  # blocks in a row with no page found: past GIVE_UP, pages are not looked up

        def flush_run() -> Iterator[Piece]:
            nonlocal run_len
            if run_len:
                yield Piece(base_offset=run_at, base_length=run_len)
                run_len = 0

        def flush_lit() -> Iterator[Piece]:
            if lit:
                yield Piece(data=bytes(lit))
                lit.clear()

        while block := f.read(BLOCK):
            # Unchanged where the last page was found (in place, or shifted by a mapping): the usual case.
            whole = next((at for at in {off + shift, off} if src.at(at, len(block)) == block), None)
            # Each part: where base holds its bytes (None: nowhere), and the bytes.
            if whole is not None:
                parts: list[tuple[int | None, bytes]] = [(whole, block)]
                misses = 0
            elif misses >= GIVE_UP:  # memory the job rewrote: not worth a lookup a page
                parts = [(None, block)]
            else:
                parts = []
                for i in range(0, len(block), PAGE):
                    page = block[i : i + PAGE]
                    at = src.find(page, off + i + shift) if len(page) == PAGE else None
                    if at is not None:
                        shift = at - (off + i)
                    parts.append((at, page))
                misses = 0 if any(at is not None for at, _ in parts) else misses + 1
            for at, data in parts:
                if at is not None:
                    yield from flush_lit()
                    if run_len and at == run_at + run_len and run_len + len(data) <= MAX_COPY:
                        run_len += len(data)
                    else:
                        yield from flush_run()
                        run_at, run_len = at, len(data)
                else:
                    yield from flush_run()
                    lit += data
                    if len(lit) >= BLOCK:
                        yield from flush_lit()
            off += len(block)
        yield from flush_run()
        yield from flush_lit()
