"""The minimal CRIU image reader: bound unix socket directories from files.img."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from agent.criu.images import IMG_COMMON_MAGIC, bound_socket_dirs, entries, fields

FILES_MAGIC = 0x56303138


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def field(num: int, value: int | bytes) -> bytes:
    if isinstance(value, int):
        return varint(num << 3) + varint(value)
    return varint(num << 3 | 2) + varint(len(value)) + value


def unix_entry(name: bytes, name_dir: bytes | None = None, deleted: bool = False) -> bytes:
    usk = field(1, 7) + field(2, 1234) + field(11, name)
    if name_dir is not None:
        usk += field(14, name_dir)
    if deleted:
        usk += field(15, 1)
    return field(1, 5) + field(2, 7) + field(16, usk)  # file_entry{type, id, usk}


def write_files_img(d: Path, *messages: bytes) -> None:
    body = b"".join(struct.pack("<I", len(m)) + m for m in messages)
    (d / "files.img").write_bytes(struct.pack("<II", IMG_COMMON_MAGIC, FILES_MAGIC) + body)


def test_bound_socket_dirs_lists_path_bound_sockets_only(tmp_path: Path) -> None:
    write_files_img(
        tmp_path,
        unix_entry(b"/tmp/pymp-abc/listener-1"),
        unix_entry(b"sock", name_dir=b"/run/app"),
        unix_entry(b"\0abstract"),
        unix_entry(b""),
        unix_entry(b"/tmp/gone/sock", deleted=True),
        unix_entry(b"/tmp/../etc/sock"),
        field(1, 1) + field(2, 3) + field(3, field(1, 5)),  # a regular file entry
    )
    assert bound_socket_dirs(tmp_path) == {Path("/tmp/pymp-abc"), Path("/run/app")}


def test_no_files_image_means_no_dirs(tmp_path: Path) -> None:
    assert bound_socket_dirs(tmp_path) == set()


def test_truncated_image_is_an_error() -> None:
    raw = struct.pack("<III", IMG_COMMON_MAGIC, FILES_MAGIC, 100) + b"short"
    with pytest.raises(ValueError, match="truncated"):
        list(entries(raw))


def test_fields_decodes_every_wire_type() -> None:
    msg = field(1, 300) + varint(2 << 3 | 1) + b"8bytes!!" + field(3, b"xy") + varint(4 << 3 | 5) + b"4byt"
    assert list(fields(msg)) == [(1, 300), (2, b"8bytes!!"), (3, b"xy"), (4, b"4byt")]
