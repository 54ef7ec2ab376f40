"""Property-based tests of the image intake (agent.migration.transfer.Intake), the target's push and commit.

Every case is a stream a hostile or broken source could send: a real image from
transfer.send_image, damaged by a few generated mutations, or a sequence of
chunks made up from scratch. For every one:

- only FerryError subclasses come out (TransferError and kin), never an OSError,
  KeyError or UnicodeError;
- nothing outside the staging directory changes, though a link planted inside
  staging points outside it;
- an image is accepted only when it is the image that was sent, byte for byte,
  and nothing is restored from one that was not accepted;
- the intake holds one chunk in memory, however long the stream.

Hypothesis tests make their own temporary directories: a function-scoped
tmp_path would be shared by every example of a test.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import hashlib
import json
import os
import tempfile
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fakes import FakeCriu, is_dead, target_migrations, wait_for
from hypothesis import HealthCheck, Phase, currently_in_test_context, event, example, given, settings
from hypothesis import strategies as st
from test_migrate_target import MID, chunks_for, make_image, prepare_req

from agent.errors import FerryError, TransferError
from agent.image import MANIFEST, Manifest
from agent.jobs.record import JobState
from agent.jobs.registry import JobRegistry
from agent.migration import target as incoming
from agent.migration import transfer
from agent.migration.datatls import KEYS_PREFIX
from agent.migration.target import TargetMigrations
from agent.migration.transfer import Intake
from agent.rpc import pb

#: Small enough that the 5000-byte pages file travels in four chunks.
CHUNK = 1500
#: The intake's limits in the Intake-level tests: a few times the image, a few more files.
CAP = 64 << 10
FILES_CAP = 12
#: The names of the links planted in staging; both point outside it.
PLANTED_FILE = "evil.img"
PLANTED_DIR = "updir"
HOSTILE_NAMES = [
    "../x",
    "a/b",
    "/abs",
    "/etc/passwd",
    ".hidden",
    "x\n",
    "",
    ".",
    "..",
    "a..b",
    "n" * 300,
    "nul\0.img",
    "é.img",
    "-dash.img",
    "spa ce.img",
    MANIFEST,
    PLANTED_FILE,
    f"{PLANTED_DIR}/x",
    "core-1.img",
]

SETTINGS = settings(
    deadline=None,
    database=None,  # no .hypothesis/ directory in the checkout
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


# -- the image every mutation starts from ---------------------------------------------------


@dataclass(frozen=True, repr=False)
class Source:
    """A small real image as send_image streams it, and what the target must end up with."""

    raw_chunks: tuple[bytes, ...]  # serialized: every example parses its own copies
    files: dict[str, bytes]  # name → content of every travelling file, the manifest included
    manifest: dict[str, Any]

    def chunks(self) -> list[pb.ImageChunk]:
        return [pb.ImageChunk.FromString(r) for r in self.raw_chunks]

    def __repr__(self) -> str:  # hypothesis prints it with every failing example
        return f"Source({len(self.raw_chunks)} chunks)"


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Source]:
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("FERRY_FAULTS", raising=False)
        mp.delenv("FERRY_PAUSE", raising=False)
        mp.setattr(transfer, "CHUNK_BYTES", CHUNK)
        image = make_image(tmp_path_factory.mktemp("source"), pages=5000)
        chunks = chunks_for(image)
    assert sum(c.file == "pages-1.img" for c in chunks) == 4  # multi-chunk files are exercised
    files = {p.name: p.read_bytes() for p in image.iterdir()}
    files[MANIFEST] = chunks[-1].data
    yield Source(tuple(c.SerializeToString() for c in chunks), files, json.loads(chunks[-1].data))


@pytest.fixture(scope="module")
def quiet_target() -> Iterator[None]:
    """No fault points; commit does not wait for the restored job's first output."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("FERRY_FAULTS", raising=False)
        mp.delenv("FERRY_PAUSE", raising=False)
        mp.setattr(incoming, "RESUME_LOOK_S", 0.0)
        yield


# -- mutations ----------------------------------------------------------------------------------


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def manifest_bytes(original: dict[str, Any], kind: str) -> bytes:
    """A manifest that is wrong in one way the intake must notice (or, for "same", is right)."""
    m = copy.deepcopy(original)
    if kind == "same":
        pass
    elif kind == "empty":
        return b""
    elif kind == "not-json":
        return b"{not json"
    elif kind == "not-utf8":
        return b'{"version": 1, "x": "\xff\xfe"}'
    elif kind == "array":
        return b"[]"
    elif kind == "null":
        return b"null"
    elif kind == "drop-file":
        m["files"] = m["files"][1:]
    elif kind == "extra-file":
        m["files"].append({"name": "extra.img", "size": 1, "sha256": sha(b"x")})
    elif kind == "wrong-digest":
        m["files"][0]["sha256"] = sha(b"something else")
    elif kind == "wrong-size":
        m["files"][0]["size"] += 1
    elif kind == "version":
        m["version"] = 2
    elif kind == "no-version":
        del m["version"]
    elif kind == "other-job":
        m["job"]["name"] = "other"
    elif kind == "job-missing-key":
        del m["job"]["cwd"]
    elif kind == "job-extra-key":
        m["job"]["bogus"] = 1
    elif kind == "bad-float":
        m["created_at"] = "soon"
    elif kind == "files-dict":
        m["files"] = {"a": 1}
    elif kind == "files-of-strings":
        m["files"] = ["core-1.img"]
    elif kind == "stats-list":
        m["criu_stats"] = [1, 2]
    elif kind == "cuda-garbage":
        m["cuda"] = {"driver_version": "1", "processes": "no", "gpus": []}
    else:  # pragma: no cover
        raise AssertionError(kind)
    return json.dumps(m).encode()


MANIFEST_KINDS = [
    "same",
    "empty",
    "not-json",
    "not-utf8",
    "array",
    "null",
    "drop-file",
    "extra-file",
    "wrong-digest",
    "wrong-size",
    "version",
    "no-version",
    "other-job",
    "job-missing-key",
    "job-extra-key",
    "bad-float",
    "files-dict",
    "files-of-strings",
    "stats-list",
    "cuda-garbage",
]


def file_runs(chunks: list[pb.ImageChunk]) -> list[tuple[str, list[int]]]:
    """(file, indexes of its chunks) in stream order; a chunk without a name continues the file."""
    runs: list[tuple[str, list[int]]] = []
    for i, c in enumerate(chunks):
        if c.file or not runs:
            runs.append((c.file, [i]))
        else:
            runs[-1][1].append(i)
    return runs


def fix_digest(chunks: list[pb.ImageChunk], i: int) -> None:
    """Make the digest on the last chunk of chunk i's file match the bytes the file now carries."""
    for _, idx in file_runs(chunks):
        if i in idx:
            h = hashlib.sha256()
            for j in idx:
                h.update(chunks[j].data)
            chunks[idx[-1]].sha256 = h.hexdigest()
            return


def first_with_list(chunks: list[pb.ImageChunk]) -> pb.ImageChunk | None:
    return next((c for c in chunks if c.files), None)


Op = tuple[Any, ...]


def apply(op: Op, chunks: list[pb.ImageChunk], src: Source, cap: int, files_cap: int) -> None:
    """Damage the stream in place; indexes wrap, so every op applies to any stream."""
    kind, *args = op
    n = len(chunks)
    if n == 0:
        return
    at = args[0] % n if args and isinstance(args[0], int) else 0
    c = chunks[at]
    listing = first_with_list(chunks)
    if kind == "flip":
        if c.data:
            pos = args[1] % len(c.data)
            c.data = c.data[:pos] + bytes([c.data[pos] ^ (1 << args[2])]) + c.data[pos + 1 :]
    elif kind == "flip-and-fix":  # the digest agrees with the damage: only the manifest can tell
        if c.data:
            pos = args[1] % len(c.data)
            c.data = c.data[:pos] + bytes([c.data[pos] ^ 0xFF]) + c.data[pos + 1 :]
            fix_digest(chunks, at)
    elif kind == "data":
        c.data = args[1]
        if args[2]:
            fix_digest(chunks, at)
    elif kind == "drop":
        del chunks[at]
    elif kind == "dup":
        chunks.insert(args[1] % (n + 1), copy.deepcopy(c))
    elif kind == "move":
        moved = chunks.pop(at)
        chunks.insert(args[1] % n, moved)
    elif kind == "truncate":
        del chunks[at:]
    elif kind == "rename-chunk":
        c.file = args[1]
    elif kind == "rename-file":  # the listing and every chunk agree on the new name
        old = c.file
        if old:
            for d in chunks:
                if d.file == old:
                    d.file = args[1]
                for f in d.files:
                    if f.name == old:
                        f.name = args[1]
    elif kind == "lie-size" and listing is not None and listing.files:
        f = listing.files[args[1] % len(listing.files)]
        f.size = max(0, min(f.size + args[2], (1 << 64) - 1))
    elif kind == "list-manifest" and listing is not None:
        listing.files.add(name=MANIFEST, size=len(src.files[MANIFEST]))
    elif kind == "list-twice" and listing is not None and listing.files:
        f = listing.files[args[0] % len(listing.files)]
        listing.files.add(name=f.name, size=f.size)
    elif kind == "list-over-cap" and listing is not None:
        listing.files.add(name="huge.img", size=cap)
    elif kind == "list-too-many" and listing is not None:
        listing.files.extend(pb.ImageFile(name=f"f{k}.img", size=0) for k in range(files_cap + 1))
    elif kind == "list-hostile" and listing is not None:
        listing.files.add(name=args[0], size=args[1])
    elif kind == "unlist":
        del chunks[0].files[:]
    elif kind == "relist" and listing is not None:  # the list again, on a later chunk
        c.files.extend(copy.deepcopy(listing.files))
    elif kind == "toggle-last":
        c.last = not c.last
    elif kind == "digest":
        c.sha256 = args[1]
    elif kind == "manifest":
        for d in chunks:
            if d.file == MANIFEST:
                d.data = manifest_bytes(src.manifest, args[0])
                d.sha256 = sha(d.data)
    elif kind == "mid":
        c.migration_id = args[1]


indexes = st.integers(0, 1 << 16)
ops: st.SearchStrategy[Op] = st.one_of(
    st.tuples(st.just("flip"), indexes, indexes, st.integers(0, 7)),
    st.tuples(st.just("flip-and-fix"), indexes, indexes),
    st.tuples(st.just("data"), indexes, st.binary(max_size=64), st.booleans()),
    st.tuples(st.just("drop"), indexes),
    st.tuples(st.just("dup"), indexes, indexes),
    st.tuples(st.just("move"), indexes, indexes),
    st.tuples(st.just("truncate"), indexes),
    st.tuples(st.just("rename-chunk"), indexes, st.sampled_from(HOSTILE_NAMES)),
    st.tuples(st.just("rename-file"), indexes, st.sampled_from(HOSTILE_NAMES)),
    st.tuples(st.just("lie-size"), indexes, indexes, st.sampled_from([-1, 1, -100, 100, 1 << 62, 1 << 64])),
    st.tuples(st.just("list-manifest")),
    st.tuples(st.just("list-twice"), indexes),
    st.tuples(st.just("list-over-cap")),
    st.tuples(st.just("list-too-many")),
    st.tuples(st.just("list-hostile"), st.sampled_from(HOSTILE_NAMES), st.integers(0, 100)),
    st.tuples(st.just("unlist")),
    st.tuples(st.just("relist"), indexes),
    st.tuples(st.just("toggle-last"), indexes),
    st.tuples(st.just("digest"), indexes, st.sampled_from(["", "0" * 64, sha(b""), "not hex", "A" * 300])),
    st.tuples(st.just("manifest"), st.sampled_from(MANIFEST_KINDS)),
)
#: Mostly damaged streams, and now and then an intact one (which must be accepted).
mutations = st.one_of(st.just([]), st.lists(ops, min_size=1, max_size=4))


def mutated(src: Source, muts: list[Op], cap: int, files_cap: int) -> list[pb.ImageChunk]:
    chunks = src.chunks()
    for op in muts:
        apply(op, chunks, src, cap, files_cap)
    return chunks


#: Streams made up from scratch: any names, sizes, flags and digests, in any order. Half the
#: names are plain ones, so that streams get past the name checks to the later ones.
any_name = st.one_of(st.sampled_from(["core-1.img", "pages-1.img", MANIFEST]), st.sampled_from(HOSTILE_NAMES))
raw_chunks = st.builds(
    lambda file, data, last, digest, files, mid: pb.ImageChunk(
        migration_id=mid,
        file=file,
        data=data,
        last=last,
        sha256={"good": sha(data), "bad": sha(data + b"!"), "none": ""}[digest],
        files=[pb.ImageFile(name=n, size=s) for n, s in files],
    ),
    file=st.one_of(any_name, st.just("")),
    data=st.binary(max_size=40),
    last=st.booleans(),
    digest=st.sampled_from(["good", "bad", "none"]),
    files=st.lists(
        st.tuples(any_name, st.one_of(st.integers(0, 64), st.sampled_from([CAP, CAP + 1, (1 << 64) - 1]))),
        max_size=3,
    ),
    mid=st.sampled_from(["", MID, "../x", "nope"]),
)


# -- the tree around staging, and what may change in it ----------------------------------------


def plant(root: Path, staging: Path) -> None:
    """Sentinels beside staging, and links inside it that point outside."""
    (root / "outside").mkdir()
    (root / "outside" / "target.txt").write_bytes(b"precious")
    (root / "sibling.txt").write_bytes(b"sibling")
    (root / "sibling-dir").mkdir()
    (root / "sibling-dir" / "inner.txt").write_bytes(b"inner")
    (staging / PLANTED_FILE).symlink_to(root / "outside" / "target.txt")
    (staging / PLANTED_DIR).symlink_to(root / "outside", target_is_directory=True)


def snapshot(root: Path, staging: Path) -> dict[str, tuple[object, ...]]:
    """Every entry under root outside staging: kind, and for files size, mtime and content.

    Directories are listed without their mtime: staging's parent changes when staging comes and goes.
    The one-time key beside staging (datatls.KEYS_PREFIX) is the migration's too, and goes with it.
    """
    out: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            key = any(q.parent == staging.parent and q.name.startswith(KEYS_PREFIX) for q in (p, *p.parents))
            if p == staging or staging in p.parents or key:
                continue
            st_ = p.lstat()
            if p.is_symlink():
                out[str(p.relative_to(root))] = ("link", os.readlink(p))
            elif p.is_dir():
                out[str(p.relative_to(root))] = ("dir",)
            else:
                out[str(p.relative_to(root))] = ("file", st_.st_size, st_.st_mtime_ns, p.read_bytes())
    return out


def planted_links_intact(root: Path, staging: Path) -> None:
    for name, target in ((PLANTED_FILE, root / "outside" / "target.txt"), (PLANTED_DIR, root / "outside")):
        link = staging / name
        if os.path.lexists(link):  # push drops a failed staging dir, links and all
            assert link.is_symlink() and Path(os.readlink(link)) == target
    assert (root / "outside" / "target.txt").read_bytes() == b"precious"
    assert sorted(p.name for p in (root / "outside").iterdir()) == ["target.txt"]


def assert_is_the_sent_image(staging: Path, src: Source) -> None:
    """Staging holds exactly the files that were sent, byte for byte, and a manifest listing them.

    The manifest itself may be re-encoded (its digest then travels with it): only what it says counts.
    """
    staged = {p.name: p.read_bytes() for p in staging.iterdir() if not p.is_symlink()}
    sent = dict(src.files)
    assert json.loads(staged.pop(MANIFEST))["files"] == json.loads(sent.pop(MANIFEST))["files"]
    assert staged == sent


def outcome_event(outcome: object) -> None:
    """Tell hypothesis's statistics (--hypothesis-show-statistics) how each case ended."""
    if not currently_in_test_context():
        return
    if isinstance(outcome, BaseException):
        cause = getattr(outcome, "cause", str(outcome))
        event(f"{type(outcome).__name__}: {' '.join(cause.split()[:3])}")
    else:
        event("accepted")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# -- Intake ---------------------------------------------------------------------------------------


def run_intake(staging: Path, chunks: list[pb.ImageChunk]) -> Manifest | BaseException:
    """Feed a stream and finish it: the manifest, or the (permitted) error the intake refused it with."""
    intake = Intake(staging, CAP, node="nodeb", max_files=FILES_CAP)
    opening = ""
    try:
        for c in chunks:
            opening = c.file
            intake.feed(c)
        return intake.finish()
    except FerryError as e:
        return e
    except OSError as e:
        # The one OSError the intake lets out (transfer.Intake._open): its O_CREAT|O_EXCL|O_NOFOLLOW
        # refusing a name that already exists in staging, here a planted link. TargetMigrations.push
        # turns it into a TransferError; test_image.py pins this behaviour of the bare Intake.
        assert e.errno in (errno.EEXIST, errno.ELOOP), e
        assert opening == PLANTED_FILE, f"{e} while opening {opening!r}"
        return e
    finally:
        intake.close()


def check_intake_case(chunks: list[pb.ImageChunk], src: Source, intact: bool) -> None:
    fds = open_fds()
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        staging = root / "staging"
        staging.mkdir()
        plant(root, staging)
        before = snapshot(root, staging)

        outcome = run_intake(staging, chunks)
        outcome_event(outcome)

        assert snapshot(root, staging) == before, "something outside staging changed"
        planted_links_intact(root, staging)
        if isinstance(outcome, Manifest):
            # Accepted: it must be the image that was sent, every byte of it, and nothing else.
            assert_is_the_sent_image(staging, src)
            assert json.loads(outcome.to_json())["files"] == src.manifest["files"]
        else:
            assert not intact, f"an intact image was refused: {outcome}"
    assert open_fds() == fds, "the intake leaked a file descriptor"


def test_an_intact_image_passes_the_intake(source: Source) -> None:
    check_intake_case(source.chunks(), source, intact=True)
    # ...and any single one of these refusals is a refusal, so the properties below can fail.
    with tempfile.TemporaryDirectory() as d:
        bad = source.chunks()
        bad[4].data = bytes([bad[4].data[0] ^ 1]) + bad[4].data[1:]
        assert isinstance(run_intake(Path(d), bad), TransferError)


@settings(SETTINGS, max_examples=150)
@given(muts=mutations)
@example(muts=[("rename-file", 0, PLANTED_FILE)])  # exclusive create meets the planted link
@example(muts=[("rename-chunk", 0, "../x")])
@example(muts=[("manifest", "not-utf8")])
@example(muts=[("flip-and-fix", 5, 3)])
@example(muts=[("list-manifest",)])
@example(muts=[("dup", 8, 9)])  # the manifest twice
@example(muts=[("relist", 3)])
def test_damaged_images_are_refused_cleanly(source: Source, muts: list[Op]) -> None:
    check_intake_case(mutated(source, muts, CAP, FILES_CAP), source, intact=not muts)


@settings(SETTINGS, max_examples=150)
@given(chunks=st.lists(raw_chunks, max_size=8))
def test_made_up_streams_are_refused_cleanly(source: Source, chunks: list[pb.ImageChunk]) -> None:
    check_intake_case(chunks, source, intact=False)


# -- hostile manifest content ------------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 70), 1 << 70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
#: Where in the manifest a made-up value goes.
MANIFEST_PATHS = [
    ("version",),
    ("job",),
    ("job", "name"),
    ("job", "command"),
    ("job", "pid"),
    ("source_node",),
    ("files",),
    ("files", 0),
    ("files", 0, "name"),
    ("files", 0, "size"),
    ("files", 0, "sha256"),
    ("created_at",),
    ("host_bytes",),
    ("gpu_bytes",),
    ("criu_stats",),
    ("timings",),
    ("cuda",),
]


def manifest_with(original: dict[str, Any], path: tuple[Any, ...], value: object) -> bytes:
    m = copy.deepcopy(original)
    node: Any = m
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return json.dumps(m).encode()  # NaN and Infinity as JSON's common extension writes them


def hostile_manifest_stream(src: Source, raw: bytes) -> list[pb.ImageChunk]:
    chunks = src.chunks()
    chunks[-1].data, chunks[-1].sha256 = raw, sha(raw)
    return chunks


#: Manifests that reach Manifest.from_json with a good digest, but make it (or Intake.finish) raise
#: something other than a FerryError (bugs): agent/image.py Manifest.from_json catches only
#: ValueError/KeyError/TypeError/AttributeError, not OverflowError (int(inf), float(10**400)) or
#: RecursionError (json.loads), and checks no field's type, so Intake.finish's
#: `{f.name: f for f in m.files}` (outside its try) meets an unhashable name.
KNOWN_BAD_MANIFESTS = {
    "infinite host_bytes (OverflowError)": ("host_bytes", float("inf")),
    "criu_stats value 1e999 (OverflowError)": ("criu_stats", {"x": float("inf")}),
    "huge created_at (OverflowError)": ("created_at", 10**400),
    "a file name that is a list (TypeError: unhashable)": (("files", 0, "name"), [1]),
    "nested 100000 deep (RecursionError)": (None, b"[" * 100_000),
}


def known_bad_manifest(src: Source, label: str) -> bytes:
    where, value = KNOWN_BAD_MANIFESTS[label]
    if where is None:
        assert isinstance(value, bytes)
        return value
    path = where if isinstance(where, tuple) else (where,)
    return manifest_with(src.manifest, path, value)


def _finish_raises_only_ferry_errors(src: Source, raw: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        intake = Intake(Path(d), CAP)
        try:
            for c in hostile_manifest_stream(src, raw):
                intake.feed(c)
            intake.finish()
        except FerryError:
            pass
        finally:
            intake.close()


@settings(SETTINGS, max_examples=150, phases=[Phase.explicit, Phase.generate])
@given(path=st.sampled_from(MANIFEST_PATHS), value=json_values)
@example(path=("host_bytes",), value=float("inf"))
@example(path=("files", 0, "name"), value=[1])
def test_hostile_manifest_content_is_refused_cleanly(source: Source, path: tuple[Any, ...], value) -> None:
    _finish_raises_only_ferry_errors(source, manifest_with(source.manifest, path, value))


@pytest.mark.parametrize("label", list(KNOWN_BAD_MANIFESTS))
def test_known_bad_manifest_is_a_transfer_error(source: Source, label: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        intake = Intake(Path(d), CAP)
        with pytest.raises(TransferError, match=r"manifest|cap"):  # a huge one is stopped by the cap
            for c in hostile_manifest_stream(source, known_bad_manifest(source, label)):
                intake.feed(c)
            intake.finish()


# -- through TargetMigrations: push, then a commit attempt -----------------------------------------


@dataclass
class Target:
    target: TargetMigrations
    criu: FakeCriu
    root: Path  # the tree around staging
    staging: Path  # this migration's staging dir


def with_target(fn: Callable[[Target], None]) -> None:
    """A fresh target node with one prepared migration (MID, job "train") and links planted in its
    staging dir; its restored children are killed afterwards."""
    with tempfile.TemporaryDirectory() as d:
        root, state = Path(d) / "tree", Path(d) / "state"
        root.mkdir()
        criu = FakeCriu("nodeb")
        registry = JobRegistry(state, "nodeb")
        target = target_migrations(registry, criu, root / "staging")
        try:
            target.prepare(prepare_req())
            staging = root / "staging" / f"in-{MID}"
            plant(root, staging)
            fn(Target(target, criu, root, staging))
        finally:
            criu.cleanup()
            if criu.spawned and any(r.name == "train" for r in registry.list()):
                # Its watch thread records the end: let it, before the directory goes.
                wait_for(lambda: registry.get("train").state is not JobState.RUNNING, what="job end")


def push_and_commit(t: Target, chunks: list[pb.ImageChunk], intact: bool, src: Source) -> None:
    before = snapshot(t.root, t.staging)
    fds = open_fds()
    try:
        t.target.push(iter(chunks))
        accepted = True
        outcome_event(None)
    except FerryError as e:
        accepted = False
        outcome_event(e)
        assert not intact, f"an intact image was refused: {e}"
    # Anything but a FerryError fails the test here, with its traceback.
    assert open_fds() == fds, "push leaked a file descriptor"
    planted_links_intact(t.root, t.staging)
    state = t.target.status(MID)
    if accepted:
        assert state == pb.TARGET_STATE_VERIFIED
        assert_is_the_sent_image(t.staging, src)  # what is restored is what was sent
    else:
        assert state in (pb.TARGET_STATE_ABORTED, pb.TARGET_STATE_PREPARED)
        if state == pb.TARGET_STATE_ABORTED:
            assert not t.staging.exists(), "a refused image was left in staging"

    try:
        t.target.commit(pb.CommitRequest(migration_id=MID))
        committed = True
    except FerryError:
        committed = False

    assert snapshot(t.root, t.staging) == before, "something outside staging changed"
    assert (t.root / "outside" / "target.txt").read_bytes() == b"precious"
    if accepted:
        assert committed
        assert [r["images_dir"] for r in t.criu.restores] == [t.staging]
        assert t.target.status(MID) == pb.TARGET_STATE_RUNNING
    else:
        assert not committed
        assert t.criu.restores == [], "an image that was not verified was restored"


def test_an_intact_image_is_pushed_and_restored(source: Source, quiet_target: None) -> None:
    with_target(lambda t: push_and_commit(t, source.chunks(), True, source))


@settings(SETTINGS, max_examples=60)
@given(
    muts=st.one_of(
        mutations,
        st.lists(
            st.one_of(ops, st.tuples(st.just("mid"), st.just(0), st.sampled_from(["", "../x", "nope"]))),
            min_size=1,
            max_size=3,
        ),
    )
)
@example(muts=[("rename-file", 0, PLANTED_FILE)])  # push turns the intake's OSError into a TransferError
@example(muts=[("manifest", "other-job")])  # a good image of another job than the lease's
@example(muts=[("mid", 0, "nope")])
@example(muts=[("list-too-many",)])
def test_no_unverified_image_is_ever_restored(source: Source, quiet_target: None, muts: list[Op]) -> None:
    # Push-level limits are the real ones: a lease of 1 GiB and MAX_FILES files.
    chunks = mutated(source, muts, 1 << 30, transfer.MAX_FILES)
    with_target(lambda t: push_and_commit(t, chunks, not muts, source))


@pytest.mark.parametrize("label", list(KNOWN_BAD_MANIFESTS))
def test_a_manifest_that_crashes_the_intake_still_restores_nothing(
    source: Source, quiet_target: None, label: str
) -> None:
    """Push refuses these with a FerryError, the lease is dropped and nothing is restored."""

    def case(t: Target) -> None:
        with pytest.raises(FerryError):
            t.target.push(iter(hostile_manifest_stream(source, known_bad_manifest(source, label))))
        assert t.target.status(MID) == pb.TARGET_STATE_ABORTED
        assert not t.staging.exists()
        with pytest.raises(FerryError, match="no verified image"):
            t.target.commit(pb.CommitRequest(migration_id=MID))
        assert t.criu.restores == []

    with_target(case)


@pytest.mark.parametrize("label", list(KNOWN_BAD_MANIFESTS))
def test_a_hostile_manifest_is_a_ferry_error_from_push(
    source: Source, quiet_target: None, label: str
) -> None:
    def case(t: Target) -> None:
        with pytest.raises(FerryError):
            t.target.push(iter(hostile_manifest_stream(source, known_bad_manifest(source, label))))

    with_target(case)


# -- verified, yet not restorable: what commit does with it -----------------------------------------


def test_a_verified_image_with_an_unknown_job_kind_leaves_nothing_running(
    source: Source, quiet_target: None
) -> None:
    """Refused at intake (the manifest's fields are checked); were it not, commit must end clean."""
    m = copy.deepcopy(source.manifest)
    m["job"]["kind"] = "bogus"  # a newer source's kind, say

    def case(t: Target) -> None:
        with contextlib.suppress(TransferError):
            t.target.push(iter(hostile_manifest_stream(source, json.dumps(m).encode())))
        crashed: BaseException | None = None
        try:
            t.target.commit(pb.CommitRequest(migration_id=MID))
        except FerryError:
            pass  # refusing it is fine
        except Exception as e:
            crashed = e
        alive = [p for p in t.criu.spawned if not is_dead(p)]
        if t.target.status(MID) != pb.TARGET_STATE_RUNNING:
            assert not alive, f"the commit failed ({crashed!r}) but its restore runs on: {alive}"
        assert crashed is None

    with_target(case)


# -- memory ---------------------------------------------------------------------------------------

MEM_CHUNK = 256 << 10


def peak_while_feeding(n: int) -> int:
    """Peak traced memory while the intake takes n chunks of MEM_CHUNK bytes, made one at a time."""
    block = bytes(range(256)) * (MEM_CHUNK // 256)
    digest = hashlib.sha256()
    for _ in range(n):
        digest.update(block)
    whole = digest.hexdigest()

    def stream() -> Iterator[pb.ImageChunk]:
        for k in range(n):
            yield pb.ImageChunk(
                file="pages-1.img" if k == 0 else "",
                data=block,
                last=k == n - 1,
                sha256=whole if k == n - 1 else "",
                files=[pb.ImageFile(name="pages-1.img", size=n * MEM_CHUNK)] if k == 0 else [],
            )

    with tempfile.TemporaryDirectory() as d:
        intake = Intake(Path(d), max_bytes=n * MEM_CHUNK + (1 << 20))
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            for c in stream():
                intake.feed(c)
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
            intake.close()
        assert intake.received["pages-1.img"].size == n * MEM_CHUNK
    return peak


def test_intake_memory_does_not_grow_with_the_stream() -> None:
    short, long = peak_while_feeding(8), peak_while_feeding(64)
    assert long < short + (64 << 10), f"peak {long} B for 64 chunks vs {short} B for 8"
    for peak in (short, long):
        assert peak < 4 * MEM_CHUNK + (256 << 10), f"peak {peak} B holds more than a chunk or two"
