"""Reading the few facts ferry needs out of CRIU's image files, without CRIU's 80 protos.

CRIU images are a magic number (two for service files) followed by
length-prefixed protobuf messages. For the one field we need we decode the
protobuf wire format directly.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

IMG_COMMON_MAGIC = 0x54564319
IMG_SERVICE_MAGIC = 0x55105940
FILES_IMG = "files.img"
_FILE_ENTRY_USK = 16  # file_entry.usk (fdinfo.proto)
_USK_NAME, _USK_NAME_DIR, _USK_DELETED = 11, 14, 15  # unix_sk_entry (sk-unix.proto)


def entries(raw: bytes) -> Iterator[bytes]:
    """The messages of one image file."""
    off = (
        8
        if len(raw) >= 8 and struct.unpack_from("<I", raw)[0] in (IMG_COMMON_MAGIC, IMG_SERVICE_MAGIC)
        else 4
    )
    while off + 4 <= len(raw):
        (size,) = struct.unpack_from("<I", raw, off)
        off += 4
        if off + size > len(raw):
            raise ValueError("truncated CRIU image entry")
        yield raw[off : off + size]
        off += size


def _varint(buf: bytes, off: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if off >= len(buf):
            raise ValueError("truncated varint")
        b = buf[off]
        off += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, off
        shift += 7


def fields(buf: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) for each field of one protobuf message; groups are not used by CRIU."""
    off = 0
    while off < len(buf):
        key, off = _varint(buf, off)
        num, wire = key >> 3, key & 7
        if wire == 0:
            value, off = _varint(buf, off)
            yield num, value
        elif wire == 1:
            yield num, buf[off : off + 8]
            off += 8
        elif wire == 2:
            size, off = _varint(buf, off)
            yield num, buf[off : off + size]
            off += size
        elif wire == 5:
            yield num, buf[off : off + 4]
            off += 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")


def bound_socket_dirs(images_dir: Path) -> set[Path]:
    """Directories of the path-bound unix sockets in an image.

    CRIU re-binds such sockets at their paths and fails when the directory is
    missing, as it is on a new host for e.g. the /tmp/pymp-* listeners of
    PyTorch DataLoader workers. The target creates them before restoring.
    """
    path = images_dir / FILES_IMG
    if not path.exists():
        return set()
    dirs: set[Path] = set()
    for entry in entries(path.read_bytes()):
        for num, usk in fields(entry):
            if num != _FILE_ENTRY_USK or not isinstance(usk, bytes):
                continue
            sk = dict(fields(usk))
            name = sk.get(_USK_NAME, b"")
            if not isinstance(name, bytes) or not name or name.startswith(b"\0") or sk.get(_USK_DELETED):
                continue  # unbound, abstract or already unlinked
            base = sk.get(_USK_NAME_DIR, b"/")
            full = Path(base.decode() if isinstance(base, bytes) else "/") / name.decode(errors="replace")
            if full.is_absolute() and ".." not in full.parts:
                dirs.add(full.parent)
    return dirs
