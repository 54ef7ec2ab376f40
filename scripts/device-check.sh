#!/usr/bin/env bash
# Run ferry's GPU test suite (tests/gpu) on a GPU machine that has no internet
# and no CRIU, from a bundle built beforehand on a machine that has both.
#
#   scripts/device-check.sh bundle
#       On the build machine (Debian 12, package index reachable, `make all`
#       done; root, so that CRIU can be tried for real). Builds .ferry/device/
#       (git-ignored), everything the GPU machine lacks:
#         criu/        CRIU (.ferry/criu/bin/criu, debug info stripped) with its
#                      whole shared-library closure, glibc and the dynamic
#                      loader included, and criu/criu, a wrapper that runs it
#                      through that loader: the GPU machine's glibc may be
#                      older than the build machine's.
#         iproute/     ip (iproute2), the same way: the bed builds its nodes
#                      with it, and a GPU machine may have no iproute2
#         bin/         ferry-init, a static ferry-init for hosts whose glibc is
#                      too old for the dynamic one, cuda-counter when
#                      .ferry/bin/cuda-counter exists, criu -> ../criu/criu
#                      and ip -> ../iproute/ip
#         stubs/       the generated (git-ignored) ferry/ and agent/criu_pb/
#         wheels/      CPython 3.10-3.13 manylinux x86_64 wheels of grpcio,
#                      grpcio-health-checking, grpcio-reflection, protobuf,
#                      psutil, nvidia-ml-py, cryptography, prometheus-client,
#                      pytest, pytest-timeout and their dependencies, pinned
#                      to .venv's versions in requirements.txt
#         pip/         a pip wheel, run straight from the wheel (no ensurepip)
#         MANIFEST.txt what is inside and the build host's versions;
#         sources.sha256, digests of proto/ and native/ the stubs and binaries
#                      were built from (run mode warns when they differ)
#       It runs `make proto native` first, and checks the wrapper: --version,
#       `criu check`, and a dump + restore of a sleeping process.
#       Left out, because the GPU machine has them: torch, numpy, cuda-bindings,
#       cuda-pathfinder, the nvidia-* CUDA wheels and the driver.
#
#   scripts/device-check.sh [run] [PYTEST_ARGS...]
#       On the GPU machine, from the repository root, offline, as root. Makes a
#       venv with --system-site-packages at /tmp/ferry-device-venv (so the
#       preinstalled torch and cuda-bindings stay visible; when that is not
#       possible, installs into /tmp/ferry-device-site on PYTHONPATH instead),
#       installs the wheels with --no-index, puts the stubs back in ferry/ and
#       agent/criu_pb/, exports FERRY_CRIU, FERRY_INIT, FERRY_CUDA_COUNTER, FERRY_SELFTEST_PTX
#       (when bundled) and PYTHONPATH (agent/testing/bed.py keeps what these
#       name visible in each bed node's fresh /tmp), and prints a report header
#       (host, GPU, python, torch, CRIU). Then it stops at once, with one line
#       and exit 1, at the first precondition that does not hold: root; `criu check`;
#       cuda-bindings importable (named as missing, not as a driver without the
#       API); the driver's CUDA checkpoint API; NVML reporting PIDs as the agent sees
#       them (python -m agent.cuda.pidprobe: an agent in a PID namespace of its own
#       gets host PIDs from NVML and could move no CUDA job); ip, unshare and
#       nsenter on PATH, and a node of the multi-node bed the suite runs its jobs
#       on (agent/testing/bed.py: network namespaces, veths, bridges, a mount
#       namespace with fresh /tmp, /dev/shm and /run, no PID namespace) built for
#       real, in which ferry's python, stubs and binaries, /dev/nvidia*,
#       cuda-bindings and NVML must answer (python -m tests.gpu.bedcheck);
#       room to stage in a node's /dev/shm, a fresh tmpfs (half of RAM, and no
#       more than the RAM available): FERRY_DEVICE_SHM_GIB (default 16) GiB.
#       Then it runs
#         python -m pytest tests/gpu -v -rs -p no:cacheprovider --timeout 120
#       plus PYTEST_ARGS, with pytest plugin autoloading off (only
#       pytest-timeout is loaded: a preinstalled plugin cannot break the run),
#       bounded as a whole by FERRY_DEVICE_BUDGET_S (default 450 s). It fails
#       when pytest fails and when no GPU test ran (all skipped is never a pass
#       on a GPU machine). It ends with the figures table
#       (scripts/device_report.py): per migration lock, checkpoint (D2H GB/s),
#       CRIU dump, transfer, CRIU restore, CUDA restore (H2D GB/s), unlock,
#       frozen, downtime and bit-identical; the driver facts (what the unit
#       tests' fake driver assumes, what the real one answered, AGREES or
#       DIFFERS: tests/gpu/test_gpu_driver_facts.py); and the driver, CUDA,
#       cuda-bindings, NVML and Python versions and the GPU's UUID.
#       With $OUT set it leaves there 4 files (the device tool brings back at
#       most 8): device-check.log, figures.jsonl, junit.xml and
#       test-logs.tar.gz (agent, CRIU and job logs, repacked after every test
#       and from an EXIT/TERM trap, so a run killed at its limit still brings
#       them back); without $OUT, the same under .ferry/device-check/. Reads
#       the GPU's state, never changes its settings.
#       Overrides: FERRY_DEVICE_PYTHON (the base python; default: the first of
#       python3, python that imports torch), FERRY_DEVICE_VENV,
#       FERRY_DEVICE_BUDGET_S.
#
# Carry list, the only git-ignored path the GPU machine needs: .ferry/device
# (tests/gpu and this script are untracked-but-not-ignored or tracked, so they
# travel with the working tree).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUNDLE_REL=.ferry/device
BUNDLE="$REPO/$BUNDLE_REL"
# Python versions the wheels cover; 3.14 would add ~7.4 MiB (grpcio) and overflow the budget.
PY_VERSIONS=(3.10 3.11 3.12 3.13)
# Runtime and test dependencies, pinned to what .venv has. Every agent imports prometheus-client
# (agent.service.metrics); cryptography makes the bed's certificates and reads every TLS peer's
# (agent.tls, agent.migration.datatls); its cffi brings pycparser, which pip picks per version
# (the newest needs CPython 3.11). They add about 10 MiB: two abi3 cryptography wheels.
PKGS=(grpcio grpcio-health-checking grpcio-reflection protobuf psutil nvidia-ml-py
  cryptography cffi prometheus-client
  pytest pytest-timeout pluggy iniconfig packaging pygments typing-extensions)
# Only Python 3.10 needs these (pytest's backports); .venv (3.11) has none to pin to.
PY310_EXTRAS=("exceptiongroup>=1" "tomli>=2")
PLATFORMS=(manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_28_x86_64)
# With cryptography and ip, about 61 MiB: wheels 41 MiB (grpcio 7 MiB a version), CRIU and its libraries
# 12 MiB, ip and its libraries 4 MiB, pip 2 MiB, bin/ 2 MiB.
SIZE_WARN_MIB=62
SIZE_MAX_MIB=64

log() { echo "device-check: $*" >&2; }
die() { log "error: $*"; exit 1; }

usage() {
  sed -n '2,/^set -euo pipefail/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"
}

# ---------------------------------------------------------------------------
# bundle mode
# ---------------------------------------------------------------------------

# The newest GLIBC_x.y symbol version a binary needs ("2.34"), or "none".
glibc_needed() {
  local v
  v="$(objdump -T "$1" 2>/dev/null | grep -o 'GLIBC_[0-9][0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -n 1)"
  echo "${v:-none}"
}

# The newest GLIBCXX_/CXXABI_ versions a C++ binary needs, or nothing.
glibcxx_needed() {
  local p
  for p in GLIBCXX CXXABI; do
    objdump -T "$1" 2>/dev/null | grep -o "${p}_[0-9][0-9.]*" | sort -uV | tail -n 1
  done | paste -sd ' ' -
}

# Copy a binary ($1) and every shared object it loads, the loader included, into $2, with $2/$3,
# a wrapper that runs it as $3 through that loader (the GPU machine's glibc may be older).
bundle_elf() {
  local src dest=$2 tool=$3 interp line name path
  src="$(readlink -f "$1")"
  mkdir -p "$dest/lib"
  if command -v strip >/dev/null; then
    strip --strip-debug -o "$dest/$tool.bin" "$src"
  else
    cp "$src" "$dest/$tool.bin"
  fi
  chmod 0755 "$dest/$tool.bin"
  interp="$(readelf -l "$src" | sed -n 's/.*Requesting program interpreter: \(.*\)\]/\1/p')"
  [[ -n $interp && -f $interp ]] || die "cannot find $tool's program interpreter (${interp:-none})"
  cp -L "$interp" "$dest/lib/$(basename "$interp")"
  while read -r line; do
    case $line in
      *"=> not found"*) die "$tool needs a library this machine lacks: $line" ;;
      *" => /"*)
        name="${line%% =>*}"
        path="${line#*=> }"
        path="${path%% (*}"
        cp -L "$path" "$dest/lib/$name"
        ;;
    esac
  done < <(ldd "$src")
  [[ -f $dest/lib/libc.so.6 ]] || die "ldd did not list libc.so.6 for $src"
  chmod 0644 "$dest"/lib/*
  chmod 0755 "$dest/lib/$(basename "$interp")"
  # The wrapper: the tool under its own loader, which never reads /etc/ld.so.cache
  # and ignores LD_LIBRARY_PATH; what it execs (CRIU: ip, iptables, sh, tar) gets
  # the environment untouched and runs on the host's own libraries (or on the
  # bundle's wrappers, first on PATH).
  cat >"$dest/$tool" <<EOF
#!/bin/sh
# $tool with the glibc and libraries it was built with (ferry's device bundle).
dir=\$(dirname -- "\$(readlink -f -- "\$0")")
exec "\$dir/lib/$(basename "$interp")" --inhibit-cache --library-path "\$dir/lib" --argv0 $tool "\$dir/$tool.bin" "\$@"
EOF
  chmod 0755 "$dest/$tool"
}

os_name() {
  { sed -n 's/^PRETTY_NAME=//p' /etc/os-release 2>/dev/null || true; } | tr -d '"' | grep . || echo "unknown os"
}

criu_version() {
  { "$1" --version 2>/dev/null || true; } | sed -n 's/^Version: *//p' | head -n 1
}

# Dump a sleeping process through the wrapper and restore it: the loader trick
# must survive CRIU's parasite and restorer, not just `criu --version`.
verify_criu() {
  local w=$1 tmp pid rpid ver
  ver="$(criu_version "$w")"
  [[ -n $ver ]] || die "'$w --version' printed no version"
  log "wrapper runs: criu $ver"
  if (( EUID != 0 )); then
    log "warning: not root, so 'criu check' and the dump/restore test of the wrapper were skipped"
    return 0
  fi
  "$w" check >"$BUNDLE_LOG.criu-check" 2>&1 \
    || { cat "$BUNDLE_LOG.criu-check" >&2; die "'criu check' through the wrapper failed"; }
  log "wrapper: criu check: $(tail -n 1 "$BUNDLE_LOG.criu-check")"
  tmp="$(mktemp -d /tmp/ferry-criu-verify.XXXXXX)"
  setsid sleep 1000 </dev/null >/dev/null 2>&1 &
  pid=$!
  sleep 0.3
  [[ $(cat "/proc/$pid/comm" 2>/dev/null) == sleep ]] || die "test process $pid is not 'sleep'"
  if ! "$w" dump -t "$pid" -D "$tmp" -o dump.log -v4; then
    kill "$pid" 2>/dev/null || true
    tail -n 20 "$tmp/dump.log" >&2
    die "criu dump through the wrapper failed (log: $tmp/dump.log)"
  fi
  { wait "$pid" || true; } 2>/dev/null  # the dumped task was killed: reap it, its PID is needed
  "$w" restore -D "$tmp" -o restore.log -v4 --restore-detached --pidfile "$tmp/restored.pid" \
    || { tail -n 20 "$tmp/restore.log" >&2; die "criu restore through the wrapper failed (log: $tmp/restore.log)"; }
  rpid="$(cat "$tmp/restored.pid")"
  sleep 0.3
  [[ $(cat "/proc/$rpid/comm" 2>/dev/null) == sleep && $(readlink "/proc/$rpid/exe") == */sleep ]] \
    || die "restored process $rpid is not a running sleep"
  [[ $(awk '{print $3}' "/proc/$rpid/stat") != [ZT] ]] || die "restored process $rpid is stopped or dead"
  kill "$rpid"
  log "wrapper: dumped sleep (pid $pid) and restored it detached (pid $rpid): ok"
  rm -rf "$tmp"
}

bundle_wheels() {
  local dest=$1 v abi req pins plat=() p
  local vpy="$REPO/.venv/bin/python"
  mkdir -p "$dest/wheels" "$dest/pip"
  for p in "${PLATFORMS[@]}"; do plat+=(--platform "$p"); done
  pins="$("$vpy" - "${PKGS[@]}" <<'EOF'
import sys
from importlib import metadata
for name in sys.argv[1:]:
    try:
        print(f"{name}=={metadata.version(name)}")
    except metadata.PackageNotFoundError:
        sys.exit(f"{name} is not installed in .venv: run `make deps`")
EOF
)"
  for v in "${PY_VERSIONS[@]}"; do
    abi="cp${v//./}"
    req="$(mktemp)"
    printf '%s\n' "$pins" >"$req"
    [[ $v == 3.10 ]] && printf '%s\n' "${PY310_EXTRAS[@]}" >>"$req"
    log "downloading wheels for CPython $v"
    "$vpy" -m pip download --disable-pip-version-check --only-binary=:all: --python-version "$v" \
      --implementation cp --abi "$abi" "${plat[@]}" -d "$dest/wheels" -r "$req" >>"$BUNDLE_LOG" 2>&1 \
      || { tail -n 20 "$BUNDLE_LOG" >&2; die "pip download for CPython $v failed (log: $BUNDLE_LOG)"; }
    rm -f "$req"
  done
  "$vpy" -m pip download --disable-pip-version-check --only-binary=:all: --no-deps -d "$dest/pip" \
    "pip>=24.2" >>"$BUNDLE_LOG" 2>&1 || die "pip download of pip failed (log: $BUNDLE_LOG)"
  # What run mode installs: the pins, plus the 3.10 backports at the versions fetched.
  {
    printf '%s\n' "$pins"
    for p in exceptiongroup tomli; do
      v="$(find "$dest/wheels" -name "${p}-*.whl" -printf '%f\n' | sed -n "s/^${p}-\([^-]*\)-.*/\1/p" | sort -V | tail -n 1)"
      [[ -n $v ]] || die "no $p wheel was downloaded for CPython 3.10"
      printf '%s==%s ; python_version < "3.11"\n' "$p" "$v"
    done
  } >"$dest/requirements.txt"
  # Offline resolution per version (markers follow this python, so 3.10's
  # backports are checked by the download above, not here).
  for v in "${PY_VERSIONS[@]}"; do
    "$vpy" -m pip install --disable-pip-version-check --dry-run --quiet --no-index --find-links "$dest/wheels" \
      --only-binary=:all: --python-version "$v" --implementation cp --abi "cp${v//./}" "${plat[@]}" \
      --target "$(mktemp -d)" --ignore-installed -r "$dest/requirements.txt" >>"$BUNDLE_LOG" 2>&1 \
      || { tail -n 20 "$BUNDLE_LOG" >&2; die "the wheels do not resolve offline for CPython $v (log: $BUNDLE_LOG)"; }
  done
}

write_manifest() {
  local dest=$1 f
  {
    echo "ferry device bundle ($BUNDLE_REL), built $(date -u +%FT%TZ)"
    echo "carry: $BUNDLE_REL"
    echo
    echo "== build host"
    echo "os: $(os_name)"
    echo "kernel: $(uname -r)"
    echo "glibc: $(getconf GNU_LIBC_VERSION 2>/dev/null || echo unknown)"
    echo "cc: $(${CC:-cc} --version 2>/dev/null | head -n 1)"
    echo "python (.venv): $("$REPO/.venv/bin/python" -V 2>&1)"
    echo "git: $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo none)$(git -C "$REPO" diff --quiet HEAD 2>/dev/null || echo ' (dirty working tree)')"
    echo
    echo "== criu/ (run criu/criu, never criu.bin)"
    echo "criu: $(criu_version "$dest/criu/criu") (from $(readlink -f "$REPO/.ferry/criu/bin/criu"))"
    echo "libraries (glibc $(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}') and loader included):"
    for f in "$dest"/criu/lib/*; do printf '  %-28s %s\n' "$(basename "$f")" "$(du -k "$f" | cut -f1) KiB"; done
    echo "runtime needs on the host: none for checkpoint/restore of ferry's jobs;"
    echo "  'ip' (iproute2) and 'iptables' only for jobs in their own network namespace."
    echo
    echo "== bin/ (newest GLIBC, GLIBCXX and CXXABI symbol versions each needs)"
    for f in "$dest"/bin/*; do
      [[ -L $f ]] && { echo "  $(basename "$f") -> $(readlink "$f")"; continue; }
      echo "  $(basename "$f"): $(glibc_needed "$f") $(glibcxx_needed "$f")"
    done
    echo
    echo "== stubs/"
    (cd "$dest/stubs" && find . -type f | sort | sed 's|^\./|  |')
    echo
    echo "== wheels/ (CPython ${PY_VERSIONS[*]}, manylinux x86_64), pinned by requirements.txt"
    find "$dest/wheels" -type f -printf '  %f\n' | sort
    echo "pip/: $(find "$dest/pip" -type f -printf '%f ')"
    echo
    echo "== sizes"
    (cd "$dest" && du -sh criu bin stubs wheels pip | sed 's/^/  /')
  } >"$dest/MANIFEST.txt"
}

bundle_mode() {
  local tmp="$BUNDLE.tmp" f size
  BUNDLE_LOG="$REPO/.ferry/device-bundle.log"
  mkdir -p "$REPO/.ferry"
  : >"$BUNDLE_LOG"
  [[ -x $REPO/.venv/bin/python ]] || die "no .venv: run 'make all' first"
  [[ -x $REPO/.ferry/criu/bin/criu ]] || die "no .ferry/criu/bin/criu: run 'make criu' first"
  for f in readelf objdump ldd; do command -v "$f" >/dev/null || die "$f is missing (binutils / libc-bin)"; done

  log "make proto native (stubs and ferry-init up to date)"
  make -C "$REPO" --no-print-directory proto native >>"$BUNDLE_LOG" 2>&1 \
    || { tail -n 20 "$BUNDLE_LOG" >&2; die "make proto native failed (log: $BUNDLE_LOG)"; }

  rm -rf "$tmp"
  mkdir -p "$tmp/bin" "$tmp/stubs/agent"

  log "criu and its libraries"
  bundle_elf "$REPO/.ferry/criu/bin/criu" "$tmp/criu" criu
  ln -s ../criu/criu "$tmp/bin/criu"
  # The bed (agent/testing/bed.py) builds its nodes with ip; a GPU machine may have no iproute2.
  log "ip (iproute2) and its libraries"
  command -v ip >/dev/null || die "ip is missing here (iproute2): the bundle carries it for the GPU machine"
  bundle_elf "$(command -v ip)" "$tmp/iproute" ip
  "$tmp/iproute/ip" -V >/dev/null || die "the bundled ip does not run through its wrapper"
  ln -s ../iproute/ip "$tmp/bin/ip"

  log "ferry-init (dynamic, and static for an older glibc)"
  install -m 0755 "$REPO/.ferry/bin/ferry-init" "$tmp/bin/ferry-init"
  ${CC:-cc} -O2 -Wall -Wextra -static -o "$tmp/bin/ferry-init.static" "$REPO/native/ferry-init.c" >>"$BUNDLE_LOG" 2>&1 \
    || { log "warning: static ferry-init did not build (log: $BUNDLE_LOG); hosts with glibc older than $(glibc_needed "$tmp/bin/ferry-init") cannot run jobs"; rm -f "$tmp/bin/ferry-init.static"; }
  if [[ -x $REPO/.ferry/bin/cuda-counter ]]; then
    install -m 0755 "$REPO/.ferry/bin/cuda-counter" "$tmp/bin/cuda-counter"
  else
    log "note: no .ferry/bin/cuda-counter, so the bundle has none"
  fi
  if [[ -f $REPO/.ferry/bin/gpu-selftest.ptx ]]; then
    install -m 0644 "$REPO/.ferry/bin/gpu-selftest.ptx" "$tmp/bin/gpu-selftest.ptx"
  else
    log "note: no .ferry/bin/gpu-selftest.ptx, so the GPU self-test has no kernels there"
  fi

  log "generated stubs"
  [[ -f $REPO/ferry/v1/agent_pb2.py && -f $REPO/agent/criu_pb/rpc_pb2.py ]] || die "stubs missing: run 'make proto'"
  tar -C "$REPO" --exclude=__pycache__ -cf - ferry | tar -C "$tmp/stubs" -xf -
  tar -C "$REPO/agent" --exclude=__pycache__ -cf - criu_pb | tar -C "$tmp/stubs/agent" -xf -
  (cd "$REPO" && find proto native -type f ! -name '*.o' -print0 | sort -z | xargs -0 sha256sum) >"$tmp/sources.sha256"

  bundle_wheels "$tmp"

  log "checking the criu wrapper"
  verify_criu "$tmp/criu/criu"

  write_manifest "$tmp"
  size="$(du -sm "$tmp" | cut -f1)"
  (( size < SIZE_MAX_MIB )) || die "bundle is ${size} MiB, over the ${SIZE_MAX_MIB} MiB carry limit: drop a python version from PY_VERSIONS"
  rm -rf "$BUNDLE"
  mv "$tmp" "$BUNDLE"
  echo
  du -sh "$BUNDLE"/* | sed "s|$REPO/||"
  du -sh "$BUNDLE" | sed "s|$REPO/||"
  (( size <= SIZE_WARN_MIB )) || log "warning: bundle is ${size} MiB, above the ${SIZE_WARN_MIB} MiB target"
  echo
  echo "bundle ready: $BUNDLE_REL (${size} MiB; contents in $BUNDLE_REL/MANIFEST.txt)"
  echo "carry exactly these ignored paths: $BUNDLE_REL"
  echo "then run there, from the repository root: scripts/device-check.sh"
}

# ---------------------------------------------------------------------------
# run mode
# ---------------------------------------------------------------------------

# The base python: $FERRY_DEVICE_PYTHON, else the first python3/python that imports torch.
pick_python() {
  local c first=""
  if [[ -n ${FERRY_DEVICE_PYTHON:-} ]]; then
    command -v "$FERRY_DEVICE_PYTHON" || die "FERRY_DEVICE_PYTHON=$FERRY_DEVICE_PYTHON not found"
    return 0
  fi
  for c in python3 python; do
    command -v "$c" >/dev/null || continue
    [[ -n $first ]] || first="$(command -v "$c")"
    if "$c" -c 'import torch' >/dev/null 2>&1; then command -v "$c"; return 0; fi
  done
  [[ -n $first ]] || die "no python3 on PATH"
  log "warning: no python on PATH imports torch; using $first"
  echo "$first"
}

# Sets VPY (the python to test with) and EXTRA_SITE (a dir for PYTHONPATH, or empty),
# then installs the bundle's wheels offline.
setup_python() {
  local base=$1 venv=${FERRY_DEVICE_VENV:-/tmp/ferry-device-venv} pipwhl tag why="" v
  pipwhl="$(find "$BUNDLE/pip" -name 'pip-*.whl' | head -n 1)"
  [[ -n $pipwhl ]] || die "no pip wheel in $BUNDLE_REL/pip: rebuild the bundle"
  tag="$("$base" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
  compgen -G "$BUNDLE/wheels/grpcio-*-$tag-$tag-*.whl" >/dev/null \
    || die "$base is CPython $("$base" -c 'import platform; print(platform.python_version())'), but the bundle has wheels only for CPython ${PY_VERSIONS[*]}"
  # Only the bundle's wheels: no index, no pip.conf, no PIP_* from the host.
  for v in $(compgen -e | grep '^PIP_' || true); do unset "$v"; done
  export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

  VPY="" EXTRA_SITE=""
  rm -rf "$venv"
  if "$base" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
    why="$base is itself a virtualenv, whose packages a nested venv would not see"
  elif ! "$base" -m venv --without-pip --system-site-packages "$venv" >/dev/null 2>&1; then
    why="'$base -m venv' failed"
  elif "$base" -c 'import torch' >/dev/null 2>&1 && ! "$venv/bin/python" -c 'import torch' >/dev/null 2>&1; then
    why="torch is not visible from a --system-site-packages venv"
  else
    VPY="$venv/bin/python"
  fi
  if [[ -n $VPY ]]; then
    "$VPY" "$pipwhl/pip" install -q --no-index --find-links "$BUNDLE/wheels" --only-binary=:all: \
      --no-warn-script-location -r "$BUNDLE/requirements.txt" || die "offline pip install into $venv failed"
  else
    rm -rf "$venv"
    EXTRA_SITE="${venv%-venv}-site"
    [[ $EXTRA_SITE != "$venv" ]] || EXTRA_SITE="$venv-site"
    log "$why; installing into $EXTRA_SITE on PYTHONPATH instead"
    rm -rf "$EXTRA_SITE"
    VPY="$base"
    "$VPY" "$pipwhl/pip" install -q --no-index --find-links "$BUNDLE/wheels" --only-binary=:all: \
      --no-warn-script-location --target "$EXTRA_SITE" -r "$BUNDLE/requirements.txt" \
      || die "offline pip install into $EXTRA_SITE failed"
  fi
}

# A bundled binary the host's loader and libraries can run ("not found" covers
# missing libraries and too-old GLIBC_/GLIBCXX_ versions).
runs_here() { ! command -v ldd >/dev/null || ! ldd "$1" 2>&1 | grep -q 'not found'; }

report_header() {
  local criu_out
  echo "== ferry device check: $(date -u +%FT%TZ)"
  echo "host: $(uname -n) | kernel $(uname -r) | $(os_name) | $(getconf GNU_LIBC_VERSION 2>/dev/null || echo 'glibc unknown') | uid $(id -u)"
  if command -v nvidia-smi >/dev/null; then
    echo "gpu: $(nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv,noheader 2>&1 | paste -sd ';' -)"
  else
    echo "gpu: nvidia-smi not found"
  fi
  "$VPY" - <<'EOF' 2>&1 || echo "python: version probe failed"
import sys
from importlib import metadata
print(f"python: {sys.version.split()[0]} ({sys.executable})")
try:
    import torch
    print(f"torch: {torch.__version__} (CUDA {torch.version.cuda}), cuda available: {torch.cuda.is_available()}")
except Exception as e:  # report, never stop the check
    print(f"torch: not importable: {e}")
def ver(d):
    try:
        return metadata.version(d)
    except metadata.PackageNotFoundError:
        return "not installed"
print("packages: " + ", ".join(f"{d} {ver(d)}" for d in
      ("cuda-bindings", "nvidia-ml-py", "grpcio", "protobuf", "psutil", "cryptography",
       "prometheus-client", "pytest")))
EOF
  local need
  need="$(sed -n 's/^requires-python *= *"\(.*\)"/\1/p' "$REPO/pyproject.toml" 2>/dev/null | head -n 1)"
  if [[ -n $need ]] && ! "$VPY" -c 'import platform, sys; from packaging.specifiers import SpecifierSet
sys.exit(platform.python_version() not in SpecifierSet(sys.argv[1]))' "$need" 2>/dev/null; then
    echo "WARNING: ferry requires python $need (pyproject.toml) and this is $("$VPY" -c 'import platform; print(platform.python_version())'): expect import errors below"
  fi
  echo "criu: $(criu_version "$FERRY_CRIU" || true) via $BUNDLE_REL/criu/criu | ip: $(command -v ip || echo none) | iptables: $(command -v iptables || echo none) | unshare: $(command -v unshare || echo none) | nsenter: $(command -v nsenter || echo none)"
  if criu_out="$("$FERRY_CRIU" check 2>&1)"; then
    echo "criu check: $(tail -n 1 <<<"$criu_out")"
  else
    echo "criu check: FAILED"
    printf '%s\n' "$criu_out" | tail -n 15 | sed 's/^/  /'
  fi
  echo "ferry-init: $FERRY_INIT"
  echo "cuda-counter: ${FERRY_CUDA_COUNTER:-not in the bundle}"
  echo "bundle: $(head -n 1 "$BUNDLE/MANIFEST.txt")"
}

# Packs the *.log files under $1 (agents, CRIU, jobs) into the archive $2, newest first, 12 MiB at most.
pack_logs() {
  local from=$1 to=$2
  [[ -d $from ]] || return 0
  if (cd "$from" && find . -type f -name '*.log' -printf '%T@ %s %P\n' | sort -rn \
    | awk '{ t += $2; if (t > 12 * 1048576) exit; print $3 }' \
    | tar -czf "$to.part" -T - 2>/dev/null); then
    mv -f "$to.part" "$to"
  else
    rm -f "$to.part"
  fi
}

# One line, exit 1: the check cannot run here, and why.
stop_check() {
  echo "device-check: STOPPED: $*"
  exit 1
}

# What a node of the bed can stage in its /dev/shm, in GiB: a fresh tmpfs gets half of RAM, and
# what it holds is RAM, so no more than is available, to this memory cgroup too where one limits it
# (v2, then v1; its directory as mounted, else the mount's root, as in a cgroup namespace).
staging_gib() {
  local total avail v2 v1 entry dir lim use max cur
  total=$(awk '/^MemTotal:/ {print $2}' /proc/meminfo)
  avail=$(awk '/^MemAvailable:/ {print $2}' /proc/meminfo)
  (( avail <= total / 2 )) || avail=$(( total / 2 ))
  v2="$(sed -n 's/^0:://p' /proc/self/cgroup 2>/dev/null | head -n 1)"
  v1="$(sed -n 's/^[0-9]*:memory://p' /proc/self/cgroup 2>/dev/null | head -n 1)"
  for entry in "/sys/fs/cgroup$v2|memory.max|memory.current" "/sys/fs/cgroup|memory.max|memory.current" \
    "/sys/fs/cgroup/memory$v1|memory.limit_in_bytes|memory.usage_in_bytes" \
    "/sys/fs/cgroup/memory|memory.limit_in_bytes|memory.usage_in_bytes"; do
    IFS='|' read -r dir lim use <<<"$entry"
    [[ -r $dir/$lim && -r $dir/$use ]] || continue
    max=$(<"$dir/$lim")
    cur=$(<"$dir/$use")
    [[ $max =~ ^[0-9]+$ && $cur =~ ^[0-9]+$ ]] || break  # "max": no limit
    (( (max - cur) / 1024 >= avail )) || avail=$(( (max - cur) / 1024 ))
    break
  done
  echo $(( avail / 1048576 ))
}

# What must hold before any GPU test: each failure is one line.
preflight() {
  local out tool missing="" room
  out="$("$FERRY_CRIU" check 2>&1)" \
    || stop_check "'criu check' fails on this host (kernel $(uname -r)): $(grep -v '^[[:space:]]*$' <<<"$out" | tail -n 1)"
  # cuda-bindings is the host's (the bundle leaves it out): missing, it is named as missing,
  # not read as a driver without the checkpoint API.
  out="$("$VPY" -c 'import cuda.bindings.driver' 2>&1)" \
    || stop_check "cuda-bindings is not importable by $VPY (the bundle does not carry it; install the build matching driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)): $(tail -n 1 <<<"$out")"
  out="$("$VPY" -c 'import sys
from agent.cuda.driver import CudaDriver
i = CudaDriver().probe()
print(i.detail)
sys.exit(0 if i.checkpoint else 1)' 2>&1)" \
    || stop_check "the NVIDIA driver offers no CUDA checkpoint API here: $(tail -n 1 <<<"$out")"
  echo "cuda checkpoint: $out"
  out="$("$VPY" -m agent.cuda.pidprobe 2>&1)" \
    || stop_check "NVML PID probe: $(paste -sd ' ' <<<"$out")"
  echo "$out"
  # The suite's jobs run on the multi-node bed: each node its own network and mount namespaces,
  # each job its own address and network namespace on the job network.
  for tool in ip unshare nsenter; do command -v "$tool" >/dev/null || missing+=" $tool"; done
  [[ -z $missing ]] \
    || stop_check "the GPU suite runs its jobs on a multi-node bed (agent/testing/bed.py), which needs${missing} (iproute2, util-linux): not on PATH"
  out="$("$VPY" -m tests.gpu.bedcheck 2>&1)" \
    || stop_check "the GPU suite's multi-node bed cannot run here: $(grep -v '^[[:space:]]*$' <<<"$out" | tail -n 1)"
  echo "$out"
  # Staging is each node's /dev/shm: a move of a GPU job stages its host copy there (device memory included).
  room=$(staging_gib)
  (( room >= ${FERRY_DEVICE_SHM_GIB:-16} )) \
    || stop_check "a bed node's /dev/shm (a fresh tmpfs: half of RAM, and only RAM that is free) can hold ${room} GiB here; the GPU tests stage their images there and need ${FERRY_DEVICE_SHM_GIB:-16} GiB (free memory, or set FERRY_DEVICE_SHM_GIB)"
  echo "staging: a bed node's /dev/shm can hold ${room} GiB"
}

# How many tests of a junit report ran (not skipped).
tests_run() {
  "$VPY" - "$1" <<'EOF'
import sys
import xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    print(0)
    sys.exit()
suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
print(sum(int(s.get("tests", 0)) - int(s.get("skipped", 0)) for s in suites))
EOF
}

run_inner() {
  set -euo pipefail
  local base bad basetemp=/tmp/ferry-device-pytest pylog rc=0 last ran budget=${FERRY_DEVICE_BUDGET_S:-450}
  cd "$REPO"
  (( EUID == 0 )) || stop_check "not root (euid $EUID): CRIU and the CUDA checkpoint API act on other processes; run as root"
  # The stubs the bundle was built with (ferry/ and agent/criu_pb/ are git-ignored).
  mkdir -p ferry agent/criu_pb
  cp -R "$BUNDLE/stubs/ferry/." ferry/
  cp -R "$BUNDLE/stubs/agent/criu_pb/." agent/criu_pb/
  if ! bad="$(sha256sum --quiet -c "$BUNDLE/sources.sha256" 2>&1)"; then
    log "warning: proto/ or native/ changed since the bundle was built; stubs or binaries may be stale:"
    printf '%s\n' "$bad" | sed 's/^/  /' >&2
  fi
  base="$(pick_python)"
  setup_python "$base"

  export FERRY_CRIU="$BUNDLE/criu/criu"
  export FERRY_INIT="$BUNDLE/bin/ferry-init"
  if ! runs_here "$FERRY_INIT" && [[ -x $BUNDLE/bin/ferry-init.static ]]; then
    log "the host's glibc cannot run the bundled ferry-init; using the static build"
    FERRY_INIT="$BUNDLE/bin/ferry-init.static"
  fi
  [[ -f $BUNDLE/bin/gpu-selftest.ptx ]] && export FERRY_SELFTEST_PTX="$BUNDLE/bin/gpu-selftest.ptx"
  if [[ -x $BUNDLE/bin/cuda-counter ]]; then
    export FERRY_CUDA_COUNTER="$BUNDLE/bin/cuda-counter"
    runs_here "$FERRY_CUDA_COUNTER" \
      || log "warning: the host cannot load cuda-counter: $(ldd "$FERRY_CUDA_COUNTER" 2>&1 | grep 'not found' | head -n 3 | tr '\n' ' ')"
  fi
  export PATH="$BUNDLE/bin:$PATH"
  export PYTHONPATH="$REPO${EXTRA_SITE:+:$EXTRA_SITE}${PYTHONPATH:+:$PYTHONPATH}"
  export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 PYTHONDONTWRITEBYTECODE=1
  export FERRY_DEVICE_FIGURES="$RESULTS/figures.jsonl" FERRY_DEVICE_LOGS="$RESULTS/test-logs.tar.gz"
  export FERRY_DEVICE_BASETEMP="$basetemp"
  : >"$FERRY_DEVICE_FIGURES"
  trap 'pack_logs "$FERRY_DEVICE_BASETEMP" "$FERRY_DEVICE_LOGS"' EXIT
  trap 'pack_logs "$FERRY_DEVICE_BASETEMP" "$FERRY_DEVICE_LOGS"; exit 143' TERM

  report_header
  [[ -d tests/gpu ]] || stop_check "there is no tests/gpu directory in this working tree"
  preflight
  echo "== python -m pytest tests/gpu -v -rs -p no:cacheprovider --timeout 120 $* (budget ${budget} s)"
  pylog="$(mktemp /tmp/ferry-device-pytest.XXXXXX.log)"
  timeout --signal=TERM --kill-after=20 "$budget" \
    "$VPY" -m pytest tests/gpu -v -rs -p no:cacheprovider -p pytest_timeout --timeout 120 \
    --junitxml "$RESULTS/junit.xml" --basetemp "$basetemp" "$@" 2>&1 | tee "$pylog" || rc=${PIPESTATUS[0]}
  pack_logs "$basetemp" "$FERRY_DEVICE_LOGS"
  last="$(grep -v '^[[:space:]]*$' "$pylog" | tail -n 1 | sed 's/^=* *//; s/ *=*$//')"
  rm -f "$pylog"
  (( rc != 124 )) || last="stopped after its ${budget} s budget; $last"
  ran="$(tests_run "$RESULTS/junit.xml")"
  echo
  "$VPY" "$REPO/scripts/device_report.py" "$FERRY_DEVICE_FIGURES" || true
  echo
  echo "== summary: pytest on $(uname -n) ($("$VPY" -c 'import platform; print(platform.python_version())'))," \
    "criu $(criu_version "$FERRY_CRIU"), $(command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 || echo 'no GPU') finished:" \
    "${last:-no output} -- $ran GPU tests ran, exit code $rc; results in $RESULTS."
  (( ran > 0 )) || { echo "device-check: FAILED: no GPU test ran (all skipped or none collected): see the skip reasons above"; return 1; }
  return "$rc"
}

run_mode() {
  local logfile rc
  (( EUID == 0 )) || stop_check "not root (euid $EUID): CRIU and the CUDA checkpoint API act on other processes; run as root"
  [[ -f $BUNDLE/MANIFEST.txt && -x $BUNDLE/criu/criu ]] \
    || die "no bundle at $BUNDLE_REL: run 'scripts/device-check.sh bundle' first (on a machine with the package index), and carry $BUNDLE_REL"
  RESULTS="${OUT:-$REPO/.ferry/device-check}"
  mkdir -p "$RESULTS"
  logfile="$RESULTS/device-check.log"
  set +e
  run_inner "$@" 2>&1 | tee "$logfile"
  rc=${PIPESTATUS[0]}
  set -e
  return "$rc"
}

case ${1:-run} in
  bundle) shift; (( $# == 0 )) || die "bundle takes no arguments"; bundle_mode ;;
  run) shift || true; run_mode "$@" ;;
  -h | --help | help) usage ;;
  -*) run_mode "$@" ;;
  *) die "unknown mode '$1' (bundle, run, or pytest arguments after run)" ;;
esac
