"""The on-disk image (agent.image): manifest, digests, names; and the chunked transfer of it."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from agent.errors import ImageError, TransferError
from agent.image import (
    MANIFEST,
    MANIFEST_VERSION,
    RESTORES,
    STDOUT_LOG,
    FileEntry,
    JobSpec,
    Manifest,
    Restored,
    build_manifest,
    check_name,
    describes,
    image_files,
    inspect_data,
    mark_restored,
    read_manifest,
    restored,
    section_digests,
    verify,
    write_manifest,
)
from agent.migration.transfer import CHUNK_BYTES, Intake, SendStats, send_image
from agent.rpc import pb

JOB = JobSpec(
    name="train",
    kind="launched",
    command=["python", "train.py", "--epochs", "3"],
    cwd="/work",
    env=["SEED=1"],
    stdout_path="/state/jobs/train/stdout.log",
    stderr_path="/state/jobs/train/stderr.log",
    pid=1,
    migrations=2,
    shell_job=True,
)


@pytest.fixture
def image(tmp_path: Path) -> Path:
    d = tmp_path / "img"
    d.mkdir()
    (d / "core-1.img").write_bytes(b"core" * 10)
    (d / "pages-1.img").write_bytes(os.urandom(5000))
    (d / "pages-2.img").write_bytes(os.urandom(3000))
    (d / STDOUT_LOG).write_bytes(b"hello\n")
    (d / "criu-dump.log").write_text("for people only\n")
    build_manifest(d, JOB, "nodea", criu_stats={"frozen_time": 7}, timings={"dump": 0.5})
    return d


def _manifest_dict(image: Path) -> dict:
    return json.loads((image / MANIFEST).read_bytes())


# -- manifest --------------------------------------------------------------------------


def test_manifest_round_trip(image: Path) -> None:
    m = read_manifest(image)
    assert Manifest.from_json(m.to_json()) == m
    assert m.job == JOB
    assert m.source_node == "nodea"
    assert m.version == MANIFEST_VERSION
    assert m.criu_stats == {"frozen_time": 7}
    assert m.timings == {"dump": 0.5}
    assert m.host_bytes == 8000  # pages-* only
    assert m.image_bytes == 40 + 8000 + 6
    assert _manifest_dict(image)["image_bytes"] == m.image_bytes


def test_manifest_lists_every_travelling_file_with_its_digest(image: Path) -> None:
    m = read_manifest(image)
    names = [f.name for f in m.files]
    assert "criu-dump.log" not in names and MANIFEST not in names
    assert names[-2:] == ["pages-1.img", "pages-2.img"]  # the big files go last
    for f in m.files:
        data = (image / f.name).read_bytes()
        assert f.size == len(data)
        assert f.sha256 == hashlib.sha256(data).hexdigest()


def test_verify_accepts_an_intact_image(image: Path) -> None:
    assert verify(image) == read_manifest(image)


def test_verify_detects_a_changed_byte(image: Path) -> None:
    p = image / "pages-1.img"
    data = bytearray(p.read_bytes())
    data[1234] ^= 0x40
    p.write_bytes(bytes(data))
    with pytest.raises(ImageError, match=r"pages-1\.img: digest does not match"):
        verify(image)


def test_verify_without_digests_checks_names_and_sizes_only(image: Path) -> None:
    """A copy in this agent's own store was hashed as it came in: a rollback does not hash it again."""
    p = image / "pages-1.img"
    data = bytearray(p.read_bytes())
    data[1234] ^= 0x40
    p.write_bytes(bytes(data))
    assert verify(image, digests=False) == read_manifest(image)
    (image / "pages-2.img").unlink()
    with pytest.raises(ImageError, match=r"missing: pages-2\.img"):
        verify(image, digests=False)


def test_verify_detects_a_changed_size(image: Path) -> None:
    with open(image / "core-1.img", "ab") as f:
        f.write(b"!")
    with pytest.raises(ImageError, match=r"core-1\.img: size 41 does not match the manifest's 40"):
        verify(image)


def test_verify_detects_a_missing_file(image: Path) -> None:
    (image / "pages-2.img").unlink()
    with pytest.raises(ImageError, match=r"missing: pages-2\.img"):
        verify(image)


def test_verify_detects_an_extra_file(image: Path) -> None:
    (image / "pages-3.img").write_bytes(b"smuggled")
    with pytest.raises(ImageError, match=r"not in the manifest: pages-3\.img"):
        verify(image)


def test_verify_refuses_a_symlink_in_the_image(image: Path, tmp_path: Path) -> None:
    (tmp_path / "secret").write_bytes(b"x")
    (image / "link.img").symlink_to(tmp_path / "secret")
    with pytest.raises(ImageError, match="not a regular file"):
        verify(image)


def test_verify_refuses_a_manifest_with_an_unsafe_name(image: Path) -> None:
    d = _manifest_dict(image)
    d["files"][0]["name"] = "../../etc/shadow"
    (image / MANIFEST).write_text(json.dumps(d))
    with pytest.raises(ImageError, match="unsafe file name"):
        verify(image)


def test_local_only_files_do_not_count(image: Path) -> None:
    (image / "criu-restore.log").write_text("written by a restore, later")
    verify(image)


# -- what the digests cover beside the files (issue 28, defect 6) ------------------------------


def test_every_part_of_the_manifest_but_its_files_has_a_digest(image: Path) -> None:
    d = _manifest_dict(image)
    listed = d["sections"]
    assert {f"job.{k}" for k in d["job"]} <= set(listed)  # field by field: command, cwd, env, name...
    assert {"source_node", "created_at", "cuda", "criu_stats", "version", "image_id"} <= set(listed)
    assert not {"files", "image_bytes", "sections"} & set(listed)  # files have digests of their own
    assert listed == section_digests(d)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("job", "command"), ["python", "evil.py"]),
        (("job", "cwd"), "/elsewhere"),
        (("job", "env"), ["SEED=2"]),
        (("job", "name"), "other"),
        (("job", "priority"), "low"),
        (("job", "address"), "10.77.1.9"),
        (("source_node",), "nodez"),
        (("timings",), {"dump": 0.1}),
    ],
)
def test_an_edited_part_of_the_manifest_is_refused_naming_it(image: Path, path: tuple, value: object) -> None:
    d = _manifest_dict(image)
    *outer, key = path
    target = d[outer[0]] if outer else d
    target[key] = value
    (image / MANIFEST).write_text(json.dumps(d))
    name = ".".join(path)
    with pytest.raises(
        ImageError, match=rf"manifest\.json: {name} does not match its digest: the manifest was edited"
    ):
        verify(image)  # before: accepted, and `ferry ps` showed the edited value
    with pytest.raises(ImageError, match=f"{name} does not match its digest"):
        inspect_data(image, check=False)  # read at all: the same check


def test_a_part_without_a_digest_or_a_digest_without_a_part_is_refused(image: Path) -> None:
    d = _manifest_dict(image)
    del d["sections"]["job.cwd"]
    with pytest.raises(ImageError, match=r"job\.cwd is covered by no digest"):
        Manifest.from_json(json.dumps(d).encode())
    d = _manifest_dict(image)
    d["sections"]["job.token"] = "0" * 64
    with pytest.raises(ImageError, match=r"job\.token has a digest but is missing from the manifest"):
        Manifest.from_json(json.dumps(d).encode())
    d["sections"] = ["not", "an", "object"]
    with pytest.raises(ImageError, match="sections is not an object"):
        Manifest.from_json(json.dumps(d).encode())


def test_an_earlier_ferrys_manifest_is_read_but_verified_only_when_allowed(image: Path) -> None:
    d = _manifest_dict(image)
    del d["sections"]
    del d["image_id"]
    (image / MANIFEST).write_text(json.dumps(d))
    assert read_manifest(image).legacy and read_manifest(image).job == JOB
    with pytest.raises(ImageError, match="written by an earlier ferry, and no digest covers its job") as ei:
        verify(image)
    assert "--no-verify" in ei.value.hint
    assert verify(image, allow_legacy=True).job == JOB  # a preempted job's own image
    write_manifest(image, read_manifest(image))
    assert not read_manifest(image).legacy  # written again: covered


def test_the_record_of_restores_is_local_and_never_read_as_none(image: Path) -> None:
    assert restored(image) == []
    mark_restored(image, Restored("train", "nodea", "restore-1", 100.0))
    mark_restored(image, Restored("copy", "nodeb", "restore-2", 200.0, copy=True))
    assert [(r.job, r.node, r.copy) for r in restored(image)] == [
        ("train", "nodea", False),
        ("copy", "nodeb", True),
    ]
    verify(image)  # beside the image, not in it: it never travels
    assert RESTORES not in [p.name for p in image_files(image)]
    (image / RESTORES).write_text("{")
    with pytest.raises(ImageError, match="the record of this image's restores, is unreadable") as ei:
        restored(image)
    assert "move that file away" in ei.value.hint


def test_a_job_is_the_images_by_its_address_or_its_name_command_and_cwd() -> None:
    assert describes(JOB, "train", JOB.command, "/work", "")
    assert not describes(JOB, "train", ["python", "other.py"], "/work", "")
    assert not describes(JOB, "train2", JOB.command, "/work", "")
    on_net = JobSpec(**{**JOB.__dict__, "address": "10.77.1.5"})
    assert describes(on_net, "renamed", ["x"], "/", "10.77.1.5")


def test_a_directory_without_a_manifest_is_not_an_image(tmp_path: Path) -> None:
    with pytest.raises(ImageError, match="is not a ferry image"):
        read_manifest(tmp_path)


def test_inspect_data(image: Path) -> None:
    d = inspect_data(image)
    assert d["path"] == str(image)
    assert d["verified"] is True
    assert d["job"]["name"] == "train"
    assert d["host_bytes"] == 8000
    assert inspect_data(image, check=False)["verified"] is False


def test_inspect_data_checks_digests_unless_told_not_to(image: Path) -> None:
    (image / "pages-1.img").write_bytes(b"\0" * 5000)
    with pytest.raises(ImageError):
        inspect_data(image)
    assert inspect_data(image, check=False)["verified"] is False


def test_write_manifest_leaves_no_temporary_file(image: Path) -> None:
    write_manifest(image, read_manifest(image))
    assert sorted(p.name for p in image.iterdir() if p.name.startswith(MANIFEST)) == [MANIFEST]


def test_image_files_refuses_a_subdirectory(image: Path) -> None:
    (image / "sub").mkdir()
    with pytest.raises(ImageError, match="not a regular file"):
        image_files(image)


# -- from_json on untrusted input ------------------------------------------------------


@pytest.mark.parametrize("version", [0, 2, "1", None])
def test_from_json_rejects_another_version(image: Path, version: object) -> None:
    d = _manifest_dict(image)
    d["version"] = version
    with pytest.raises(ImageError, match=f"manifest version {version!r} is not {MANIFEST_VERSION}"):
        Manifest.from_json(json.dumps(d).encode())


def test_from_json_rejects_a_missing_version(image: Path) -> None:
    d = _manifest_dict(image)
    del d["version"]
    with pytest.raises(ImageError, match="manifest version None"):
        Manifest.from_json(json.dumps(d).encode())


@pytest.mark.parametrize(
    "raw", [b"", b"{", b"not json", b"\xff\xfe", b'{"version": 1}', b'{"version": 1, "job": {}}']
)
def test_from_json_rejects_malformed_json(raw: bytes) -> None:
    with pytest.raises(ImageError, match="malformed manifest"):
        Manifest.from_json(raw, where="test manifest")


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("files", [{"name": "a"}]),  # an entry without size and digest
        ("files", [1, 2]),
        ("job", {"name": "train", "unknown_field": 1}),
        ("created_at", "yesterday"),
        ("host_bytes", "lots"),
        ("criu_stats", {"frozen_time": "slow"}),
    ],
)
def test_from_json_rejects_wrong_fields(image: Path, key: str, value: object) -> None:
    d = _manifest_dict(image)
    d[key] = value
    with pytest.raises(ImageError, match="malformed manifest"):
        Manifest.from_json(json.dumps(d).encode())


@pytest.mark.parametrize("mutation", ["list", "null", "criu_stats"])
def test_from_json_rejects_json_of_the_wrong_shape(image: Path, mutation: str) -> None:
    if mutation == "criu_stats":
        d = _manifest_dict(image)
        d["criu_stats"] = [1, 2]
        raw = json.dumps(d).encode()
    else:
        raw = b"[]" if mutation == "list" else b"null"
    with pytest.raises(ImageError):
        Manifest.from_json(raw)


# -- names -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["pages-1.img", "core-4242.img", "ferry-stdout.log", "manifest.json", "_x", "a+b", "A" * 128]
)
def test_check_name_accepts_plain_names(name: str) -> None:
    assert check_name(name) == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        ".",
        "..",
        "../x",
        "a/b",
        "/abs",
        ".hidden",
        "x..y",
        "a\\b",
        "a b",
        "a\nb",
        "a\0b",
        "A" * 129,
        "-rf",
    ],
)
def test_check_name_refuses_anything_else(name: str) -> None:
    with pytest.raises(ImageError, match="unsafe file name"):
        check_name(name)


# -- chunked transfer (agent.migration.transfer) -------------------------------------------------


def _send(image: Path, mid: str = "m1") -> tuple[list[pb.ImageChunk], SendStats]:
    m = read_manifest(image)
    (image / MANIFEST).unlink()
    stats = SendStats()

    def manifest(entries: list[FileEntry]) -> Manifest:
        return Manifest(job=m.job, source_node=m.source_node, files=entries, host_bytes=m.host_bytes)

    return list(send_image(mid, image, manifest, stats)), stats


def test_send_image_then_intake_reproduces_the_image(image: Path, tmp_path: Path) -> None:
    before = read_manifest(image)
    chunks, stats = _send(image)
    assert chunks[0].migration_id == "m1"
    assert all(c.migration_id == "" for c in chunks[1:])
    assert chunks[-1].file == MANIFEST
    assert stats.bytes == before.image_bytes
    assert stats.entries == before.files

    out = tmp_path / "received"
    out.mkdir()
    intake = Intake(out, 1 << 20)
    for c in chunks:
        intake.feed(c)
    got = intake.finish()
    assert got.files == before.files
    assert verify(out) == got


def test_send_image_splits_big_files(tmp_path: Path) -> None:
    d = tmp_path / "big"
    d.mkdir()
    (d / "pages-1.img").write_bytes(os.urandom(2 * CHUNK_BYTES + 10))
    (d / "empty.img").write_bytes(b"")
    build_manifest(d, JOB, "nodea")
    chunks, _ = _send(d)
    pages = [c for c in chunks if c.file == "pages-1.img"]
    assert [len(c.data) for c in pages] == [CHUNK_BYTES, CHUNK_BYTES, 10]
    assert [c.last for c in pages] == [False, False, True]
    assert pages[-1].sha256 and not pages[0].sha256
    empty = [c for c in chunks if c.file == "empty.img"]
    assert len(empty) == 1 and empty[0].last and empty[0].sha256 == hashlib.sha256(b"").hexdigest()

    out = tmp_path / "out"
    out.mkdir()
    intake = Intake(out, 1 << 30)
    for c in chunks:
        intake.feed(c)
    intake.finish()
    assert (out / "pages-1.img").read_bytes() == (d / "pages-1.img").read_bytes()


def listing(sizes: dict[str, int]) -> list[pb.ImageFile]:
    """The file list a stream's first chunk carries."""
    return [pb.ImageFile(name=n, size=s) for n, s in sizes.items()]


def test_intake_refuses_a_file_list_beyond_the_cap_before_writing(tmp_path: Path) -> None:
    intake = Intake(tmp_path, max_bytes=100, node="nodeb")
    first = pb.ImageChunk(
        file="pages-1.img", data=b"a" * 60, files=listing({"pages-1.img": 60, "core-1.img": 60})
    )
    with pytest.raises(TransferError, match="lists 120 bytes; the lease's cap is 100") as exc:
        intake.feed(first)
    intake.close()
    assert exc.value.node == "nodeb"
    assert list(tmp_path.iterdir()) == []  # refused before a byte was written


def test_intake_stops_a_file_at_its_listed_size(tmp_path: Path) -> None:
    intake = Intake(tmp_path, max_bytes=100, node="nodeb")
    intake.feed(pb.ImageChunk(file="pages-1.img", data=b"a" * 60, files=listing({"pages-1.img": 60})))
    with pytest.raises(TransferError, match="larger than listed"):
        intake.feed(pb.ImageChunk(file="pages-1.img", data=b"b" * 30))
    intake.close()
    assert (tmp_path / "pages-1.img").stat().st_size == 60  # nothing beyond the listing was written


def test_intake_refuses_a_file_not_in_the_list(tmp_path: Path) -> None:
    intake = Intake(tmp_path, max_bytes=100)
    with pytest.raises(TransferError, match="not in the stream's file list"):
        intake.feed(pb.ImageChunk(file="core-1.img", data=b"a", files=listing({"pages-1.img": 1})))
    assert list(tmp_path.iterdir()) == []


def test_intake_refuses_a_stream_without_a_file_list(tmp_path: Path) -> None:
    with pytest.raises(TransferError, match="did not start with its file list"):
        Intake(tmp_path, max_bytes=100).feed(pb.ImageChunk(file="core-1.img", data=b"a"))


def test_intake_does_not_write_through_a_planted_symlink(tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    staging.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (staging / "pages-1.img").symlink_to(victim)
    intake = Intake(staging, 1 << 20)
    with pytest.raises(OSError):
        intake.feed(
            pb.ImageChunk(file="pages-1.img", data=b"overwrite", last=True, files=listing({"pages-1.img": 9}))
        )
    assert victim.read_bytes() == b"precious"


def test_intake_finish_without_a_manifest(tmp_path: Path) -> None:
    intake = Intake(tmp_path, 1 << 20)
    data = b"x"
    intake.feed(
        pb.ImageChunk(
            file="core-1.img",
            data=data,
            last=True,
            sha256=hashlib.sha256(data).hexdigest(),
            files=listing({"core-1.img": 1}),
        )
    )
    with pytest.raises(TransferError, match="truncated"):
        intake.finish()


def test_intake_finish_with_a_file_the_manifest_omits(image: Path, tmp_path: Path) -> None:
    chunks, _ = _send(image)
    extra = b"smuggled"
    chunks.insert(
        0,
        pb.ImageChunk(
            migration_id="m1",
            file="extra.img",
            data=extra,
            last=True,
            sha256=hashlib.sha256(extra).hexdigest(),
            files=[*chunks[0].files, pb.ImageFile(name="extra.img", size=len(extra))],
        ),
    )
    del chunks[1].files[:]  # the list comes with the first chunk only
    out = tmp_path / "out"
    out.mkdir()
    intake = Intake(out, 1 << 20)
    for c in chunks:
        intake.feed(c)
    with pytest.raises(TransferError, match="do not match the manifest"):
        intake.finish()


def test_check_name_refuses_a_trailing_newline() -> None:
    with pytest.raises(ImageError):
        check_name("pages-1.img\n")
