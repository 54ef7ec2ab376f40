"""The on-disk image: CRIU's files, the job's logs and a manifest, in one flat directory.

One format serves local checkpoints and migrations. An image is untrusted
input until every file matches the digest its manifest lists, and every other
part of the manifest (the job's command, cwd, env, name..., field by field) the
digest it lists in `sections`: what `ferry ps` shows of a restored job is data
those digests cover. Digests detect an edit, not a forger who writes them anew.

Beside the image, never travelling and covered by no digest: CRIU's logs, and
the restores that reached their commit point (`RESTORES`), so that an image is
not restored twice by accident. An incremental snapshot image also has CRIU's
`parent` link to the image its clean pages live in, which its manifest names.

Why one module: the manifest's fields, the digests that cover them and `verify`
that reads both are one format; split, a field could be added where no check
sees it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agent.durable import replace_file
from agent.errors import ImageError
from agent.gpus.inventory import GpuNeed

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
STDOUT_LOG = "ferry-stdout.log"
STDERR_LOG = "ferry-stderr.log"
#: CRIU writes the process memory into these; they are the "host bytes".
PAGES_PREFIX = "pages-"
#: Each restore of the image that reached its commit point (`restored`, `mark_restored`).
RESTORES = "ferry-restores.json"
#: Files CRIU writes for people, not for restore, and the record of the image's restores: they
#: never travel.
LOCAL_ONLY = frozenset(
    {
        "criu-dump.log",
        "criu-page-server.log",
        "criu-restore.log",
        "stats-restore",
        RESTORES,
        RESTORES + ".tmp",
    }
)
#: An incremental image's link to the image it was dumped against (CRIU's name for it): always
#: `../../<round>/<job>`, beside it in a snapshot store; it never travels, each side makes its own.
PARENT_LINK = "parent"
_PARENT_TARGET = re.compile(r"^\.\./\.\./([1-9][0-9]{0,17})/([A-Za-z0-9_][A-Za-z0-9_.+-]{0,127})$")
#: The longest chain of incremental images verify follows (a snapshot's is far shorter).
MAX_CHAIN = 64
#: Manifest keys no section digest covers: the files have digests of their own, image_bytes is
#: their sum, and `sections` holds the digests.
_UNSECTIONED = frozenset({"files", "image_bytes", "sections"})

_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}$")
_CHUNK = 1 << 20


def check_name(name: str) -> str:
    """An image file name: a plain name, no separators, no `..`, nothing hidden."""
    if not _SAFE_NAME.fullmatch(name) or ".." in name:
        raise ImageError(f"unsafe file name in image: {name!r}", step="image intake")
    return name


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class FileEntry:
    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class JobSpec:
    """What the job is, independent of where it runs."""

    name: str
    kind: str  # "launched" | "adopted"
    command: list[str]
    cwd: str
    env: list[str]
    stdout_path: str  # the job's log paths on the node it was dumped on (keys for inherit-fd)
    stderr_path: str
    pid: int
    migrations: int = 0
    shell_job: bool = False  # dumped with an external session; restore must say so too
    priority: str = "normal"
    on_degraded: str = "migrate"
    gpus: list[str] = field(default_factory=list)  # `ferry run --gpu` UUIDs on the node it was dumped on
    gpu_chip: str = ""
    private: bool = False  # in namespaces of its own: restore with CRIU's --root /, a new link
    address: str = ""  # its address on the job network, which it keeps wherever it runs
    group: str = ""  # the training job it is one member of (`ferry run --group`)
    max_pause_s: float = 0.0  # the longest its peers tolerate it frozen (0: the derived limits)


def describes(spec: JobSpec, name: str, command: list[str], cwd: str, address: str) -> bool:
    """Whether a job as a node lists it is the one `spec` describes: it has the job's address on
    the job network, which no two jobs share, or its name, command and working directory."""
    if spec.address and address == spec.address:
        return True
    return name == spec.name and list(command) == list(spec.command) and cwd == spec.cwd


@dataclass(frozen=True)
class CudaProcessEntry:
    ns_pid: int  # PID inside the job's namespace: the same on every node it runs on
    gpus: list[str]  # UUIDs of the GPUs it held on the node it was dumped on
    memory_bytes: int


@dataclass(frozen=True)
class CudaSection:
    """The job's CUDA state: checkpointed into its host memory, restored onto matching GPUs."""

    driver_version: str
    processes: list[CudaProcessEntry]
    gpus: list[GpuNeed]

    @property
    def gpu_bytes(self) -> int:
        return sum(g.memory_bytes for g in self.gpus)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CudaSection:
        return cls(
            driver_version=str(d["driver_version"]),
            processes=[
                CudaProcessEntry(int(p["ns_pid"]), [str(u) for u in p["gpus"]], int(p["memory_bytes"]))
                for p in d["processes"]
            ],
            gpus=[GpuNeed(str(g["uuid"]), str(g["name"]), int(g["memory_bytes"])) for g in d["gpus"]],
        )


@dataclass(frozen=True)
class StreamDigest:
    """A byte stream that bypassed the image's files: how long it was, and its checksum."""

    bytes: int
    check: str

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StreamDigest:
        if not (isinstance(d["bytes"], int) and isinstance(d["check"], str)):
            raise TypeError(f"malformed page stream {d!r}")
        return cls(d["bytes"], d["check"])


@dataclass
class Manifest:
    job: JobSpec
    source_node: str
    files: list[FileEntry]
    created_at: float = field(default_factory=time.time)
    host_bytes: int = 0
    gpu_bytes: int = 0
    criu_stats: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    cuda: CudaSection | None = None  # None: a CPU-only job
    # The job's memory when it was streamed to the target's page server while dumping
    # (agent.migration.pagestream): then its pages-/pagemap- files are not in `files`.
    page_stream: StreamDigest | None = None
    version: int = MANIFEST_VERSION
    #: Which save this is: the checkpoint's (or suspend's) id; "" for a migration's image, but for
    #: an increment over a kept chain (agent.migration.chainmove): the migration's id.
    image_id: str = ""
    #: An incremental image: the image_id of the image it was dumped against (its PARENT_LINK),
    #: whose files hold the pages this one does not.
    parent: str = ""
    #: Read from a manifest without `sections` (an earlier ferry's): no digest covers its job.
    legacy: bool = field(default=False, compare=False, repr=False)

    @property
    def image_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> bytes:
        d = asdict(self)
        del d["legacy"]
        d["image_bytes"] = self.image_bytes
        d["sections"] = section_digests(d)
        return json.dumps(d, indent=2, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str = "manifest") -> Manifest:
        try:
            d: dict[str, Any] = json.loads(raw)
            if not isinstance(d, dict):
                raise ImageError(f"{where}: manifest is not a JSON object", step="image intake")
            if d.get("version") != MANIFEST_VERSION:
                raise ImageError(f"{where}: manifest version {d.get('version')!r} is not {MANIFEST_VERSION}")
            job = JobSpec(**d["job"])
            _check_types(job, where)
            files = [FileEntry(**f) for f in d["files"]]
            for f in files:
                if not (isinstance(f.name, str) and isinstance(f.size, int) and isinstance(f.sha256, str)):
                    raise ImageError(f"{where}: malformed file entry {f!r}", step="image intake")
            m = cls(
                job=job,
                source_node=str(d["source_node"]),
                files=files,
                created_at=float(d["created_at"]),
                host_bytes=int(d["host_bytes"]),
                gpu_bytes=int(d["gpu_bytes"]),
                criu_stats={str(k): int(v) for k, v in d.get("criu_stats", {}).items()},
                timings={str(k): float(v) for k, v in d.get("timings", {}).items()},
                cuda=CudaSection.from_dict(d["cuda"]) if d.get("cuda") else None,
                page_stream=StreamDigest.from_dict(d["page_stream"]) if d.get("page_stream") else None,
                image_id=str(d.get("image_id", "")),
                parent=str(d.get("parent", "")),
                legacy="sections" not in d,
            )
            if "sections" in d:
                _check_sections(d, where)
            return m
        except ImageError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError) as e:
            raise ImageError(
                f"{where}: malformed manifest ({type(e).__name__}: {e})", step="image intake"
            ) from e


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def section_digests(d: dict[str, Any]) -> dict[str, str]:
    """The digest of each part of a manifest (as JSON data): the job field by field (`job.command`),
    every other key but the files as a whole (`cuda`, `source_node`...), so that an edit is named."""
    out = {f"job.{k}": _digest(v) for k, v in d["job"].items()}
    out.update({k: _digest(v) for k, v in d.items() if k not in _UNSECTIONED and k != "job"})
    return out


def _check_sections(d: dict[str, Any], where: str) -> None:
    """Every part of the manifest matches the digest `sections` lists for it, and each has one."""
    listed = d["sections"]
    if not isinstance(listed, dict):
        raise ImageError(f"{where}: malformed manifest (sections is not an object)", step="image")
    want = section_digests(d)
    for key in sorted(set(want) | set(listed)):
        if key not in listed:
            problem = "is covered by no digest"
        elif key not in want:
            problem = "has a digest but is missing from the manifest"
        elif listed[key] != want[key]:
            problem = "does not match its digest"
        else:
            continue
        raise ImageError(
            f"{where}: {key} {problem}: the manifest was edited after the image was written",
            step="image",
            hint="restore an unedited copy of the image, or checkpoint the job again",
        )


def _check_types(job: JobSpec, where: str) -> None:
    """A manifest is untrusted input: a job it describes must be one this agent can register."""
    strings = [job.name, job.kind, job.cwd, job.stdout_path, job.stderr_path, job.gpu_chip]
    lists = [job.command, job.env, job.gpus]
    ok = (
        all(isinstance(s, str) for s in strings)
        and all(isinstance(xs, list) and all(isinstance(x, str) for x in xs) for xs in lists)
        and isinstance(job.pid, int)
        and isinstance(job.migrations, int)
        and isinstance(job.shell_job, bool)
        and job.kind in ("launched", "adopted")
        and job.priority in ("normal", "low")
        and job.on_degraded in ("migrate", "alert")
    )
    if not ok:
        raise ImageError(f"{where}: malformed job description in the manifest", step="image intake")


def image_files(image_dir: Path) -> list[Path]:
    """The files of an image that travel, in a stable order (largest last)."""
    out = []
    for p in sorted(image_dir.iterdir()):
        if p.name == MANIFEST or p.name in LOCAL_ONLY or (p.name == PARENT_LINK and p.is_symlink()):
            continue
        if not p.is_file() or p.is_symlink():
            raise ImageError(f"{p} is not a regular file", step="image")
        out.append(p)
    return sorted(out, key=lambda p: (p.name.startswith(PAGES_PREFIX), p.name))


def host_bytes(entries: list[FileEntry]) -> int:
    return sum(e.size for e in entries if e.name.startswith(PAGES_PREFIX))


def write_manifest(image_dir: Path, manifest: Manifest) -> None:
    tmp = image_dir / (MANIFEST + ".tmp")
    tmp.write_bytes(manifest.to_json())
    os.replace(tmp, image_dir / MANIFEST)


def build_manifest(image_dir: Path, job: JobSpec, source_node: str, **extra: Any) -> Manifest:
    """Digest every file of a finished image directory and write its manifest."""
    entries = [FileEntry(p.name, p.stat().st_size, sha256_file(p)) for p in image_files(image_dir)]
    m = Manifest(job=job, source_node=source_node, files=entries, host_bytes=host_bytes(entries), **extra)
    write_manifest(image_dir, m)
    return m


def read_manifest(image_dir: Path) -> Manifest:
    path = image_dir / MANIFEST
    try:
        raw = path.read_bytes()
    except FileNotFoundError as e:
        raise ImageError(f"{image_dir} is not a ferry image (no {MANIFEST})", step="image") from e
    except OSError as e:
        raise ImageError(f"cannot read {path}: {e.strerror}", step="image") from e
    return Manifest.from_json(raw, where=str(path))


def verify(
    image_dir: Path,
    manifest: Manifest | None = None,
    *,
    allow_legacy: bool = False,
    digests: bool = True,
    depth: int = 0,
) -> Manifest:
    """Check that the directory holds exactly the manifest's files, each with its digest, and that
    digests cover the rest of the manifest (allow_legacy: an earlier ferry's manifest, whose job
    no digest covers, is accepted: for an image this agent wrote into its own state directory).
    An incremental image's parent is verified too, and its parent's, to a whole image.
    `digests=False`: names and sizes only, for a copy whose digests were checked as it came into
    this agent's own store (a snapshot kept in memory here): hashing it again would find
    nothing that the node's root could not alter as easily after the check."""
    m = manifest or read_manifest(image_dir)
    listed = {check_name(f.name): f for f in m.files}
    if m.legacy and not allow_legacy:
        raise ImageError(
            f"{image_dir}: its manifest was written by an earlier ferry, and no digest covers its job "
            "(command, cwd, env)",
            step="image",
            hint="restore it with the ferry that wrote it, or checkpoint the job again; "
            f"`ferry inspect --no-verify {image_dir}` shows it",
        )
    present = {p.name for p in image_files(image_dir)}
    if missing := sorted(set(listed) - present):
        raise ImageError(f"{image_dir}: files listed in the manifest are missing: {', '.join(missing)}")
    if extra := sorted(present - set(listed)):
        raise ImageError(f"{image_dir}: files not in the manifest: {', '.join(extra)}")
    for name, entry in listed.items():
        path = image_dir / name
        if path.stat().st_size != entry.size:
            raise ImageError(f"{path}: size {path.stat().st_size} does not match the manifest's {entry.size}")
        if digests and sha256_file(path) != entry.sha256:
            raise ImageError(f"{path}: digest does not match the manifest (corrupt or altered image)")
    if (parent := parent_dir(image_dir, m)) is not None:
        if depth >= MAX_CHAIN:
            raise ImageError(
                f"{image_dir}: a chain of more than {MAX_CHAIN} incremental images", step="image"
            )
        verify(parent, digests=digests, depth=depth + 1)
    return m


def parent_epoch(image_dir: Path, job: str = "") -> int:
    """The round an incremental image in a snapshot store (job's, by default its name) was
    dumped against (its PARENT_LINK); 0 for a whole image. A link of any other shape is refused:
    it could lead anywhere."""
    link = image_dir / PARENT_LINK
    if not link.is_symlink():
        return 0
    m = _PARENT_TARGET.fullmatch(os.readlink(link))
    if m is None or m[2] != (job or image_dir.name):
        raise ImageError(
            f"{link} leads to {os.readlink(link)!r}, not to an image of its job beside it", step="image"
        )
    return int(m[1])


def link_parent(image_dir: Path, epoch: int, job: str = "") -> None:
    """Make `image_dir` (job's, by default its name) an increment over round `epoch`'s image of
    the job beside it."""
    os.symlink(f"../../{epoch}/{job or image_dir.name}", image_dir / PARENT_LINK)


def parent_dir(image_dir: Path, m: Manifest, job: str = "") -> Path | None:
    """The image an incremental image's pages partly live in, checked to be the one its manifest
    names; None for a whole image."""
    epoch = parent_epoch(image_dir, job)
    if not m.parent:
        if epoch:
            raise ImageError(
                f"{image_dir}: a {PARENT_LINK} link, but its manifest names no parent", step="image"
            )
        return None
    if not epoch:
        raise ImageError(
            f"{image_dir}: an increment over image {m.parent}, which is not linked beside it",
            step="image",
            hint="the image it was dumped against must come with it (a snapshot store keeps the chain)",
        )
    parent = image_dir.parent.parent / str(epoch) / (job or image_dir.name)
    if (got := read_manifest(parent).image_id) != m.parent:
        raise ImageError(f"{image_dir}: its {PARENT_LINK} is image {got!r}, not {m.parent!r}", step="image")
    return parent


@dataclass(frozen=True)
class Restored:
    """One restore of an image that reached its commit point: a copy ran from it."""

    job: str  # the name it ran under
    node: str
    restore_id: str  # its journal record there (`restore-…`)
    at: float  # unix seconds
    copy: bool = False  # asked for as a second copy (`ferry restore --as-copy`)


def restored(image_dir: Path) -> list[Restored]:
    """The restores of this image that reached their commit point, oldest first ([] if none).
    An unreadable record is never "none": that would let the image run twice."""
    path = image_dir / RESTORES
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as e:
        raise ImageError(f"cannot read {path}: {e.strerror}", step="restore") from e
    try:
        marks = [Restored(**r) for r in json.loads(raw)["restores"]]
        if not all(isinstance(r.job, str) and isinstance(r.node, str) for r in marks):
            raise TypeError("a restore without a job or node name")
        return marks
    except (ValueError, KeyError, TypeError) as e:
        raise ImageError(
            f"{path}, the record of this image's restores, is unreadable ({e})",
            step="restore",
            hint="if no copy restored from this image runs anywhere, move that file away",
        ) from e


def mark_restored(image_dir: Path, mark: Restored) -> None:
    """Add a restore that reached its commit point to the image's record, durably."""
    marks = [asdict(r) for r in [*restored(image_dir), mark]]
    replace_file(image_dir / RESTORES, json.dumps({"restores": marks}, indent=1).encode())


def inspect_data(image_dir: Path, *, check: bool = True) -> dict[str, Any]:
    """Everything `ferry inspect` shows, as plain data (the JSON renderer prints it as is)."""
    m = verify(image_dir) if check else read_manifest(image_dir)
    d = json.loads(m.to_json())
    d["path"] = str(image_dir)
    d["verified"] = check
    return d
