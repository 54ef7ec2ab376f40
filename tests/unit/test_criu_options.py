"""One CRIU option set, two renderings (swrk RPC and command line), and a deadline on every
exchange with CRIU. The CRIU here is a fake: small scripts that read the request and
answer, or never answer; the real one runs in tests/integration."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from agent import config
from agent.criu import lazy, runner
from agent.criu.options import GHOST_LIMIT, ONE_PATH_ONLY, CriuOptions, InheritFd, TlsFiles, dump_options
from agent.criu_pb import rpc_pb2
from agent.errors import CriuError, RefusedError, StepTimeoutError

REPO = Path(__file__).resolve().parents[2]
NODE = "nodetest"

# -- both renderings, read back ------------------------------------------------------------------

VALUE_FLAGS = {"--images-dir", "--work-dir", "--log-file", "--tree", "--network-lock", "--ghost-limit"}
VALUE_FLAGS |= {"--timeout", "--root", "--ps-socket", "--status-fd", "--address", "--port"}
VALUE_FLAGS |= {"--tls-cacert", "--tls-cert", "--tls-key", "--prev-images-dir"}
#: Flags whose argument is optional, so it comes as one word: --flag=value.
VALUE_FLAGS |= {"--manage-cgroups"}
REPEATED_FLAGS = {"--external", "--inherit-fd"}


def parse_argv(argv: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    it = iter(argv)
    for arg in it:
        if arg.startswith("-v") and arg[2:].isdigit():
            out["-v"] = int(arg[2:])
        elif arg.startswith("--") and "=" in arg:  # an optional argument, as one word
            key, _, value = arg.partition("=")
            assert key not in out, f"{key} twice in {argv}"
            out[key] = value
        elif arg in REPEATED_FLAGS:
            out.setdefault(arg, []).append(next(it))
        else:
            assert arg.startswith("--") and arg not in out, f"{arg} twice, or not a flag, in {argv}"
            out[arg] = next(it) if arg in VALUE_FLAGS else True
    return out


@contextlib.contextmanager
def rendered(opts: CriuOptions) -> Iterator[tuple[dict[str, Any], rpc_pb2.criu_opts]]:
    """Both renderings: the parsed argv, and the RPC message with its directories open."""
    with contextlib.ExitStack() as stack:
        fds = []
        for d in (opts.images_dir, opts.work_dir):
            fds.append(os.open(d, os.O_RDONLY | os.O_DIRECTORY) if d is not None else -1)
            if fds[-1] >= 0:
                stack.callback(os.close, fds[-1])
        msg = rpc_pb2.criu_opts()
        opts.to_rpc(msg, images_dir_fd=fds[0], work_dir_fd=fds[1])
        yield parse_argv(opts.to_argv()), msg


def fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def rpc_view(msg: rpc_pb2.criu_opts) -> dict[str, Any]:
    """The message's fields, its directory fds as the paths they are open on."""
    view: dict[str, Any] = {}
    for f, v in msg.ListFields():
        if f.name in ("images_dir_fd", "work_dir_fd"):
            view[f.name] = fd_path(v)
        elif hasattr(v, "__iter__") and not isinstance(v, str):  # a repeated field
            view[f.name] = [str(x).strip() for x in v]
        else:
            view[f.name] = str(v).strip()
    return view


def _ps(a: dict[str, Any], opts: CriuOptions) -> Any:
    # A lazy dump serves on the socket; anything else uses a page server through it.
    return (int(a["--ps-socket"]), "--page-server" in a) if "--ps-socket" in a else None


BOOL_FLAGS: dict[str, str] = {}  # flag -> its RPC field


def _bool(flag: str, rpc: str) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    name = flag[2:].replace("-", "_")
    BOOL_FLAGS[flag] = rpc
    return (lambda o: getattr(o, name)), (lambda a, o: a.get(flag, False)), (lambda m: getattr(m, rpc))


#: field -> (its value, as the argv carries it, as the RPC message carries it), all comparable.
RENDERINGS: dict[str, tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]] = {
    "images_dir": (
        lambda o: str(o.images_dir),
        lambda a, o: a["--images-dir"],
        lambda m: fd_path(m.images_dir_fd),
    ),
    "work_dir": (
        lambda o: str(o.work_dir) if o.work_dir else None,
        lambda a, o: a.get("--work-dir"),
        lambda m: fd_path(m.work_dir_fd) if m.HasField("work_dir_fd") else None,
    ),
    "log_file": (lambda o: o.log_file, lambda a, o: a["--log-file"], lambda m: m.log_file),
    "log_level": (lambda o: o.log_level, lambda a, o: a["-v"], lambda m: m.log_level),
    "pid": (lambda o: o.pid, lambda a, o: int(a.get("--tree", 0)), lambda m: m.pid),
    "leave_running": _bool("--leave-running", "leave_running"),
    "leave_stopped": _bool("--leave-stopped", "leave_stopped"),
    "shell_job": _bool("--shell-job", "shell_job"),
    "tcp_established": _bool("--tcp-established", "tcp_established"),
    "ext_unix_sk": _bool("--ext-unix-sk", "ext_unix_sk"),
    "file_locks": _bool("--file-locks", "file_locks"),
    "restore_sibling": _bool("--restore-sibling", "rst_sibling"),
    "lazy_pages": _bool("--lazy-pages", "lazy_pages"),
    "track_mem": _bool("--track-mem", "track_mem"),
    "parent_img": (
        lambda o: o.parent_img,
        lambda a, o: a.get("--prev-images-dir", ""),
        lambda m: m.parent_img,
    ),
    "network_lock": (
        lambda o: o.network_lock,
        lambda a, o: a.get("--network-lock", ""),
        lambda m: (
            rpc_pb2.criu_network_lock_method.Name(m.network_lock).lower()
            if m.HasField("network_lock")
            else ""
        ),
    ),
    "cgroups": (
        lambda o: o.cgroups,
        lambda a, o: a.get("--manage-cgroups", ""),
        lambda m: (
            rpc_pb2.criu_cg_mode.Name(m.manage_cgroups_mode).lower()
            if m.HasField("manage_cgroups_mode")
            else ""
        ),
    ),
    "ghost_limit": (
        lambda o: o.ghost_limit,
        lambda a, o: int(a.get("--ghost-limit", 0)),
        lambda m: m.ghost_limit,
    ),
    "freeze_timeout_s": (
        lambda o: o.freeze_timeout_s,
        lambda a, o: int(a.get("--timeout", 0)),
        lambda m: m.timeout,
    ),
    "external": (
        lambda o: list(o.external),
        lambda a, o: a.get("--external", []),
        lambda m: list(m.external),
    ),
    "root": (lambda o: o.root, lambda a, o: a.get("--root", ""), lambda m: m.root),
    "inherit_fd": (
        lambda o: [f"fd[{i.fd}]:{i.key}" for i in o.inherit_fd],
        lambda a, o: a.get("--inherit-fd", []),
        lambda m: [f"fd[{i.fd}]:{i.key}" for i in m.inherit_fd],
    ),
    "page_server_fd": (
        lambda o: (o.page_server_fd, not o.lazy_pages) if o.page_server_fd >= 0 else None,
        _ps,
        lambda m: (m.ps.fd, m.ps.port == 0) if m.HasField("ps") and m.ps.HasField("fd") else None,
    ),
    "ps_address": (
        lambda o: o.ps_address,
        lambda a, o: a.get("--address", ""),
        lambda m: m.ps.address if m.HasField("ps") else "",
    ),
    "ps_port": (
        lambda o: o.ps_port,
        lambda a, o: int(a.get("--port", 0)),
        lambda m: m.ps.port if m.HasField("ps") and not m.ps.HasField("fd") else 0,
    ),
    "tls": (
        lambda o: (str(o.tls.cacert), str(o.tls.cert), str(o.tls.key), True) if o.tls else None,
        lambda a, o: (
            (a["--tls-cacert"], a["--tls-cert"], a["--tls-key"], a["--tls-no-cn-verify"])
            if "--tls" in a
            else None
        ),
        lambda m: (m.tls_cacert, m.tls_cert, m.tls_key, m.tls_no_cn_verify) if m.tls else None,
    ),
}
#: What the argv carries of the one-path-only fields (their RPC side must carry nothing).
ARGV_ONLY = {"status_fd": lambda a: int(a.get("--status-fd", -1))}
FIELDS = [f.name for f in dataclasses.fields(CriuOptions)]


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    images, work = tmp_path / "images", tmp_path / "work"
    images.mkdir()
    work.mkdir()
    return images, work


def full_sets(images: Path, work: Path) -> list[CriuOptions]:
    """Between them, every field set away from its default."""
    full = CriuOptions(
        images_dir=images,
        log_file="criu-x.log",
        work_dir=work,
        log_level=3,
        pid=4242,
        leave_stopped=True,
        shell_job=True,
        tcp_established=True,
        ext_unix_sk=True,
        file_locks=True,
        network_lock="skip",
        cgroups="ignore",
        ghost_limit=GHOST_LIMIT,
        freeze_timeout_s=7,
        external=("veth[eth0]:fj-1", "mnt[ferry-logs]:/var/lib/ferry/jobs/a"),
        root="/",
        restore_sibling=True,
        inherit_fd=(InheritFd("/var/log/job.out", 11), InheritFd("/var/log/job.err", 12)),
        page_server_fd=9,
        status_fd=10,
        track_mem=True,
        parent_img="../../6/r0",
    )
    # Lazy pages and a page-server socket only meet on the command line (to_rpc refuses them).
    lazy_running = dataclasses.replace(
        full,
        leave_stopped=False,
        leave_running=True,
        lazy_pages=True,
        page_server_fd=-1,
        network_lock="nftables",
        ps_address="10.98.0.1",
        ps_port=7001,
        tls=TlsFiles(images / "peer.pem", images / "ours.pem", images / "ours-key.pem"),
    )
    return [full, lazy_running]


def test_every_field_is_covered_by_the_renderings_table() -> None:
    assert set(ARGV_ONLY) == set(ONE_PATH_ONLY)
    assert sorted([*RENDERINGS, *ONE_PATH_ONLY]) == sorted(FIELDS), "a new field needs a row in RENDERINGS"
    assert all(len(why) > 40 for why in ONE_PATH_ONLY.values()), "say why a field is one-path-only"


def test_the_full_sets_leave_no_field_at_its_default(dirs: tuple[Path, Path]) -> None:
    sets = full_sets(*dirs)
    base = CriuOptions(dirs[0], "x.log")
    for name in FIELDS:
        if name in ("images_dir", "log_file"):
            continue
        assert any(getattr(s, name) != getattr(base, name) for s in sets), f"{name} is never set"


@pytest.mark.parametrize("which", [0, 1])
def test_both_renderings_carry_every_field_with_the_same_value(dirs: tuple[Path, Path], which: int) -> None:
    opts = full_sets(*dirs)[which]
    with rendered(opts) as (argv, msg):
        for name, (value, from_argv, from_rpc) in RENDERINGS.items():
            want = value(opts)
            assert from_argv(argv, opts) == want, f"argv: {name}"
            assert from_rpc(msg) == want, f"rpc: {name}"
        for name, from_argv in ARGV_ONLY.items():
            assert from_argv(argv) == getattr(opts, name)
        # Nothing else: every flag and every RPC field comes from a field of CriuOptions.
        flags = {"-v", "--page-server", "--tls", "--tls-no-cn-verify"}
        assert set(argv) <= VALUE_FLAGS | REPEATED_FLAGS | set(BOOL_FLAGS) | flags
        assert not msg.HasField("status_fd")


def test_no_field_goes_missing_from_either_rendering(dirs: tuple[Path, Path], tmp_path: Path) -> None:
    """Set one field at a time: each must change both renderings, or exactly the one it is for."""
    other = tmp_path / "other"
    other.mkdir()
    base = CriuOptions(dirs[0], "x.log")
    sets = full_sets(*dirs)
    samples = {
        name: next((getattr(s, name) for s in sets if getattr(s, name) != getattr(base, name)), None)
        for name in FIELDS
    }
    samples |= {"images_dir": other, "log_file": "other.log", "leave_running": True, "lazy_pages": True}
    with rendered(base) as (argv0, msg0):
        rpc0 = rpc_view(msg0)
    for name in FIELDS:
        with rendered(dataclasses.replace(base, **{name: samples[name]})) as (argv, msg):
            changed = {"argv": argv != argv0, "rpc": rpc_view(msg) != rpc0}
        if name in ONE_PATH_ONLY:
            assert sum(changed.values()) == 1, f"{name}: {changed}"
        else:
            assert all(changed.values()), f"{name} is rendered only to {[k for k, v in changed.items() if v]}"


def test_a_lazy_rpc_with_a_page_server_socket_is_refused(dirs: tuple[Path, Path]) -> None:
    opts = CriuOptions(dirs[0], "x.log", lazy_pages=True, page_server_fd=5)
    with pytest.raises(ValueError, match="command line"):
        opts.to_rpc(rpc_pb2.criu_opts(), images_dir_fd=-1)
    assert "--ps-socket" in opts.to_argv() and "--page-server" not in opts.to_argv()
    with pytest.raises(ValueError, match="exclude"):
        CriuOptions(dirs[0], "x.log", leave_running=True, leave_stopped=True)
    with pytest.raises(ValueError, match="network_lock"):
        CriuOptions(dirs[0], "x.log", network_lock="none")


def test_the_lazy_dump_and_the_rpc_dump_are_one_dump(dirs: tuple[Path, Path]) -> None:
    """What ferry always told CRIU for a dump, by RPC (Criu.dump) and by argv (LazyDump)."""
    images, work = dirs
    tls = TlsFiles(work / "peer.pem", work / "ours.pem", work / "ours-key.pem")
    ps = ("10.98.0.2", 7001)
    rpc = dump_options(4242, images, "criu-dump.log", work_dir=work, shell_job=True, page_server=ps, tls=tls)
    argv = dump_options(
        4242, images, "criu-dump.log", work_dir=work, shell_job=True, page_server=ps, tls=tls, lazy_pages=True
    )
    with rendered(rpc) as (_, msg):
        want = rpc_pb2.criu_opts(
            images_dir_fd=msg.images_dir_fd,
            work_dir_fd=msg.work_dir_fd,
            log_file="criu-dump.log",
            log_level=4,
            ghost_limit=GHOST_LIMIT,
            pid=4242,
            leave_stopped=True,
            shell_job=True,
            tcp_established=True,
            ext_unix_sk=True,
            file_locks=True,
            network_lock=rpc_pb2.SKIP,
            manage_cgroups_mode=rpc_pb2.IGNORE,
            ps=rpc_pb2.criu_page_server_info(address="10.98.0.2", port=7001),
            tls=True,
            tls_cacert=str(tls.cacert),
            tls_cert=str(tls.cert),
            tls_key=str(tls.key),
            tls_no_cn_verify=True,
        )
        assert msg == want
    old = f"--tree 4242 --images-dir {images} --work-dir {work} --log-file criu-dump.log --lazy-pages "
    old += "--leave-stopped --tcp-established --ext-unix-sk --file-locks --ghost-limit 2147483648 "
    old += "--network-lock skip --manage-cgroups=ignore --shell-job -v4 --address 10.98.0.2 --port 7001 "
    old += "--tls --tls-no-cn-verify "
    old += f"--tls-cacert {tls.cacert} --tls-cert {tls.cert} --tls-key {tls.key}"
    assert parse_argv(argv.to_argv()) == parse_argv(old.split())


def test_the_built_criu_parses_every_flag(dirs: tuple[Path, Path]) -> None:
    """`criu check --feature NONE ARGV` parses ARGV, then fails on the feature, doing nothing."""
    try:
        binary = config.criu_binary()
    except RefusedError:
        pytest.skip("no CRIU built here")
    for opts in full_sets(*dirs):
        cmd = [binary, "check", "--feature", "ferry-no-such-feature", *opts.to_argv()]
        said = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stderr
        assert "unrecognized option" not in said and "Unknown feature ferry-no-such-feature" in said, said


# -- deadlines ------------------------------------------------------------------------------------

#: `criu swrk FD` that reads the request and never answers.
MUTE_SWRK = """
import socket, sys, time
sock = socket.socket(fileno=int(sys.argv[2]))
sock.recv(1 << 20)
time.sleep(600)
"""
#: `criu swrk FD` that records the request (and where its directories are open), then answers.
ANSWERING_SWRK = """
import os, socket, sys
sys.path.insert(0, {repo!r})
from agent.criu_pb import rpc_pb2
sock = socket.socket(fileno=int(sys.argv[2]))
req = rpc_pb2.criu_req()
req.ParseFromString(sock.recv(1 << 20))
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "request.bin"), "wb") as f:
    f.write(req.SerializeToString())
with open(os.path.join(here, "images.path"), "w") as f:
    f.write(os.readlink(f"/proc/{{os.getppid()}}/fd/{{req.opts.images_dir_fd}}"))
resp = rpc_pb2.criu_resp(type=req.type, success=True)
resp.restore.pid = 777
sock.send(resp.SerializeToString())
"""
#: `criu swrk FD` that starts a "page server" (itself) and then never answers WAIT_PID.
PAGE_SERVER_SWRK = """
import os, socket, sys, time
sys.path.insert(0, {repo!r})
from agent.criu_pb import rpc_pb2
sock = socket.socket(fileno=int(sys.argv[2]))
req = rpc_pb2.criu_req()
req.ParseFromString(sock.recv(1 << 20))
resp = rpc_pb2.criu_resp(type=req.type, success=True)
resp.ps.pid = os.getpid()
sock.send(resp.SerializeToString())
sock.recv(1 << 20)
time.sleep(600)
"""
#: `criu swrk FD` whose page server is a child it forks, as CRIU's PAGE_SERVER_CHLD does; it reaps
#: that child the moment it exits (SIGCHLD ignored), which frees its PID for reuse.
FORKING_PAGE_SERVER_SWRK = """
import os, signal, socket, sys, time
sys.path.insert(0, {repo!r})
from agent.criu_pb import rpc_pb2
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
sock = socket.socket(fileno=int(sys.argv[2]))
req = rpc_pb2.criu_req()
req.ParseFromString(sock.recv(1 << 20))
pid = os.fork()
if pid == 0:
    sock.close()
    time.sleep(600)
    os._exit(0)
resp = rpc_pb2.criu_resp(type=req.type, success=True)
resp.ps.pid = pid
sock.send(resp.SerializeToString())
sock.recv(1 << 20)
"""
#: A command-line CRIU that says it is ready on --status-fd (unless told not to), then hangs.
READY_CRIU = """
import os, sys, time
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "argv"), "w") as f:
    f.write("\\n".join(sys.argv[1:]))
if {ready}:
    fd = int(sys.argv[sys.argv.index("--status-fd") + 1])
    os.write(fd, b"\\0")
    os.close(fd)
time.sleep(600)
"""
#: `criu --version` / `criu check` that hangs.
HANGING_PROBE = """
import os, sys, time
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "pid"), "w") as f:
    f.write(str(os.getpid()))
time.sleep(600)
"""


def fake_criu(tmp_path: Path, source: str) -> runner.Criu:
    path = tmp_path / "bin" / "criu"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!{sys.executable}\n{source}")
    path.chmod(0o755)
    return runner.Criu(binary=str(path), node=NODE)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def assert_timeout_named(err: StepTimeoutError, step: str, images: Path, log_path: Path) -> None:
    text = str(err)
    assert err.step == f"criu {step}" and err.node == NODE
    assert text.startswith(f"criu {step} on {NODE}: "), text
    assert f"images: {images}" in text and f"CRIU log: {log_path}" in text and "killed it" in text
    assert err.hint and "CRIU log" in err.hint


#: Where a lazy dump listens (or a daemon connects), and its TLS files: CRIU is a fake here.
PS_ADDR = ("10.98.0.1", 7001)
TLS = TlsFiles(Path("/run/ferry/peer.pem"), Path("/run/ferry/ours.pem"), Path("/run/ferry/ours-key.pem"))


def test_a_dump_criu_never_answers_is_killed_at_its_deadline(tmp_path: Path, dirs: tuple[Path, Path]) -> None:
    images, work = dirs
    criu, started = fake_criu(tmp_path, MUTE_SWRK), []
    with pytest.raises(StepTimeoutError) as err:
        criu.dump(4242, images, log_dir=work, on_start=started.append, deadline_s=0.5)
    assert_timeout_named(err.value, "dump", images, work / runner.DUMP_LOG)
    assert "CRIU did not answer within 0.5 s" in str(err.value)
    assert started and gone(started[0])


def test_a_restore_criu_never_answers_is_killed_at_its_deadline(
    tmp_path: Path, dirs: tuple[Path, Path]
) -> None:
    images, _ = dirs
    criu, started = fake_criu(tmp_path, MUTE_SWRK), []
    with pytest.raises(StepTimeoutError) as err:
        criu.restore(images, on_start=started.append, deadline_s=0.3)
    assert_timeout_named(err.value, "restore", images, images / runner.RESTORE_LOG)
    assert started and gone(started[0])


def test_an_answered_restore_sent_the_rendered_options(tmp_path: Path, dirs: tuple[Path, Path]) -> None:
    images, work = dirs
    criu, started = fake_criu(tmp_path, ANSWERING_SWRK.format(repo=str(REPO))), []
    res = criu.restore(
        images, inherit=[InheritFd("/var/log/a", 0)], log_dir=work, root="/", on_start=started.append
    )
    assert res.pid == 777 and gone(started[0])
    req = rpc_pb2.criu_req()
    req.ParseFromString((tmp_path / "bin" / "request.bin").read_bytes())
    assert req.type == rpc_pb2.RESTORE
    opts = req.opts
    assert opts.rst_sibling and opts.root == "/" and opts.ghost_limit == GHOST_LIMIT and opts.log_level == 4
    assert [(i.key, i.fd) for i in opts.inherit_fd] == [("var/log/a", 0)]
    # The directory was still open in the agent while CRIU read the request.
    assert (tmp_path / "bin" / "images.path").read_text() == str(images)


def test_a_page_server_that_never_starts_is_killed(tmp_path: Path, dirs: tuple[Path, Path]) -> None:
    images, _ = dirs
    criu = fake_criu(tmp_path, MUTE_SWRK)
    with pytest.raises(StepTimeoutError) as err:
        criu.page_server(images, address="127.0.0.1", tls=TLS, timeout_s=0.3)
    assert_timeout_named(err.value, "page-server", images, images / runner.PAGE_SERVER_LOG)


def test_a_page_server_that_never_ends_is_killed(tmp_path: Path, dirs: tuple[Path, Path]) -> None:
    images, work = dirs
    criu = fake_criu(tmp_path, PAGE_SERVER_SWRK.format(repo=str(REPO)))
    server = criu.page_server(images, work, address="127.0.0.1", tls=TLS)
    assert server.pid == server.proc.pid
    with pytest.raises(StepTimeoutError) as err:
        server.wait(0.3)
    assert_timeout_named(err.value, "page-server", images, work / runner.PAGE_SERVER_LOG)
    assert gone(server.proc.pid)


@pytest.fixture(params=["pidfd", "start time"])
def page_server_identity(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """With pidfds, and without (an old kernel, or a seccomp profile that refuses pidfd_open)."""
    if request.param == "start time":

        def refuse(pid: int, flags: int = 0) -> int:
            raise OSError(38, "Function not implemented")

        monkeypatch.setattr(os, "pidfd_open", refuse)


@pytest.mark.usefixtures("page_server_identity")
def test_a_page_server_is_killed_only_while_it_is_the_same_process(
    tmp_path: Path, dirs: tuple[Path, Path]
) -> None:
    """Its PID, once it has exited and been reaped, may name an unrelated process: the kill must
    not reach that one."""
    images, work = dirs
    criu = fake_criu(tmp_path, FORKING_PAGE_SERVER_SWRK.format(repo=str(REPO)))
    server = criu.page_server(images, work, address="127.0.0.1", tls=TLS)
    first = server.pid
    assert first != server.proc.pid and psutil.Process(first).ppid() == server.proc.pid
    os.kill(first, 9)  # it ends by itself, and its swrk reaps it
    deadline = time.monotonic() + 10
    while not gone(first) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gone(first)
    time.sleep(0.1)  # a PID comes round only after the rest have been handed out: never at once
    stranger = subprocess.Popen(["sleep", "60"])
    try:
        server.pid = stranger.pid  # what a reused PID looks like to the agent: its number, another process
        server.kill()
        with pytest.raises(subprocess.TimeoutExpired):
            stranger.wait(0.5)
    finally:
        stranger.kill()
        stranger.wait()


@pytest.mark.usefixtures("page_server_identity")
def test_a_killed_page_server_is_the_one_its_swrk_started(tmp_path: Path, dirs: tuple[Path, Path]) -> None:
    images, work = dirs
    criu = fake_criu(tmp_path, FORKING_PAGE_SERVER_SWRK.format(repo=str(REPO)))
    server = criu.page_server(images, work, address="127.0.0.1", tls=TLS)
    pid = server.pid
    server.kill()
    assert gone(pid) and gone(server.proc.pid)


def test_a_lazy_dump_that_never_gets_ready_is_killed(tmp_path: Path, dirs: tuple[Path, Path]) -> None:
    images, work = dirs
    criu = fake_criu(tmp_path, READY_CRIU.format(ready=False))
    dump = lazy.LazyDump(criu, 4242, images, PS_ADDR, TLS, log_dir=work, external=["veth[eth0]:fj-1"])
    with pytest.raises(StepTimeoutError) as err:
        dump.ready(0.5)
    assert_timeout_named(err.value, "dump", images, work / runner.DUMP_LOG)
    assert gone(dump.pid)
    argv = parse_argv((tmp_path / "bin" / "argv").read_text().splitlines()[1:])
    assert argv["--lazy-pages"] and (argv["--address"], argv["--port"]) == ("10.98.0.1", "7001")
    assert argv["--tls"] and argv["--tls-cacert"] == str(TLS.cacert) and "--status-fd" in argv
    assert argv["--external"] == ["veth[eth0]:fj-1"] and "--page-server" not in argv


def test_a_lazy_dump_whose_pages_are_never_all_fetched_is_killed(
    tmp_path: Path, dirs: tuple[Path, Path]
) -> None:
    images, _ = dirs
    criu = fake_criu(tmp_path, READY_CRIU.format(ready=True))
    dump = lazy.LazyDump(criu, 4242, images, PS_ADDR, TLS)
    dump.ready(10)
    with pytest.raises(StepTimeoutError) as err:
        dump.wait(0.3)
    assert_timeout_named(err.value, "dump", images, images / runner.DUMP_LOG)
    assert gone(dump.pid)


def test_a_lazy_pages_daemon_is_bounded_at_start_and_at_its_end(
    tmp_path: Path, dirs: tuple[Path, Path]
) -> None:
    images, work = dirs
    mute = fake_criu(tmp_path / "mute", READY_CRIU.format(ready=False))
    with pytest.raises(StepTimeoutError) as err:
        lazy.LazyPagesDaemon(mute, images, work, PS_ADDR, TLS, 0.3)
    assert_timeout_named(err.value, "lazy-pages", images, work / lazy.LAZY_PAGES_LOG)
    argv = parse_argv((tmp_path / "mute" / "bin" / "argv").read_text().splitlines()[1:])
    assert argv["--page-server"] and (argv["--address"], argv["--port"]) == ("10.98.0.1", "7001")
    assert argv["--tls"] and argv["--tls-key"] == str(TLS.key)

    daemon = lazy.LazyPagesDaemon(
        fake_criu(tmp_path, READY_CRIU.format(ready=True)), images, work, PS_ADDR, TLS, 10
    )
    with pytest.raises(StepTimeoutError) as err:
        daemon.wait(0.3)
    assert_timeout_named(err.value, "lazy-pages", images, work / lazy.LAZY_PAGES_LOG)
    assert gone(daemon.proc.pid)


def test_a_criu_that_dies_before_it_is_ready_is_a_criu_error(tmp_path: Path, dirs: tuple[Path, Path]) -> None:
    images, work = dirs
    (work / lazy.LAZY_PAGES_LOG).write_text("(00.1) Error (criu/uffd.c:1): uffd: no userfaultfd here\n")
    criu = fake_criu(tmp_path, "import sys; sys.exit(1)")
    with pytest.raises(CriuError, match="no userfaultfd here") as err:
        lazy.LazyPagesDaemon(criu, images, work, PS_ADDR, TLS, 10)
    assert err.value.step == "criu lazy-pages" and err.value.node == NODE


def test_a_swrk_that_exits_without_answering_is_a_criu_error(tmp_path: Path, dirs: tuple[Path, Path]) -> None:
    criu = fake_criu(tmp_path, "import sys; sys.stderr.write('swrk: no such fd\\n'); sys.exit(3)")
    with pytest.raises(CriuError, match=r"criu swrk exited \(3\): swrk: no such fd") as err:
        criu.dump(4242, dirs[0])
    assert err.value.step == "criu dump" and str(dirs[0] / runner.DUMP_LOG) in str(err.value)


def test_hanging_probes_are_timeouts_not_tracebacks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "PROBE_TIMEOUT_S", 0.3)
    criu = fake_criu(tmp_path, HANGING_PROBE)
    with pytest.raises(StepTimeoutError, match=r"did not finish within 0\.3 s") as err:
        criu.require_usable()
    assert err.value.step == "criu version" and err.value.node == NODE and err.value.hint
    assert gone(int((tmp_path / "bin" / "pid").read_text()))
    with pytest.raises(StepTimeoutError):
        criu.feature("uffd-noncoop")
    ok, said = criu.check()
    assert not ok and "criu check" in said and "did not finish" in said


def test_criu_s_version_is_read_once_until_the_binary_changes(tmp_path: Path) -> None:
    """GetInfo asks for it on every peer's ping (every second): one `criu --version` until the
    binary is replaced."""
    calls = tmp_path / "calls"
    fake = tmp_path / "criu"
    fake.write_text(f"#!/bin/sh\necho x >> {calls}\necho 'Version: 4.2.1'\n")
    fake.chmod(0o755)
    criu = runner.Criu(str(fake))
    assert [criu.version() for _ in range(3)] == [(4, 2, 1)] * 3
    assert calls.read_text().count("x") == 1
    new = tmp_path / "criu.new"
    new.write_text(f"#!/bin/sh\necho x >> {calls}\necho 'Version: 4.3'\n")
    new.chmod(0o755)
    new.replace(fake)  # an upgrade under the running agent
    assert criu.version() == (4, 3, 0) and calls.read_text().count("x") == 2
