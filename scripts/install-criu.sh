#!/usr/bin/env bash
# Install CRIU (>= 4.2.1) for ferry at PREFIX/bin/criu, plus the rpc/stats protos
# at PREFIX/share/criu/proto/ that ferry compiles at build time.
#
# Usage: scripts/install-criu.sh [PREFIX]
#   PREFIX defaults to $FERRY_CRIU_PREFIX, else <repo>/.ferry/criu.
#
# Builds CRIU from Debian's pristine source tarball with ferry's patches, in name
# order: native/criu/data-path.patch (CRIU's TLS page transfer without a syscall per
# record, post-copy with several requests in flight), proc-mountpoint.patch (a
# task dumped while another node dumps a task with the same cwd on shared storage
# no longer fails on the parasite's fixed mountpoint name), restore-reap.patch (a
# restore of a tree with its own PID namespace that fails late, a lazy one whose
# daemon died, answers instead of waiting forever on its killed init),
# uffd-track.patch (--track-mem where the kernel lacks soft-dirty: written memory
# tracked with userfaultfd write-protect, its descriptors handed to the RPC client
# with the dump's answer, and with a restore's, which tracks the restored tree from
# then on; agent.criu.tracking), netns-conntrack.patch (a job's netns that tracks no
# connection is not asked for its conntrack table: each ask walked the host's whole
# table, twice per dump, with the job frozen), tmpfs-reuse.patch (an incremental dump
# links the parent's archive of a tmpfs that did not change instead of running tar
# again) and restore-populate.patch (a restore faults in each range of private memory
# it reads with one madvise, not a fault per page). FERRY_SYSTEM_CRIU=1 uses a system CRIU instead (symlinked) when it is new
# enough and `criu check` passes; it works, but moves memory over TLS at stock CRIU's
# speed.
set -euo pipefail

CRIU_VERSION=4.2.1
CRIU_TARBALL="criu_${CRIU_VERSION}.orig.tar.xz"
# As listed in Debian's criu_4.2.1-1.dsc (Checksums-Sha256).
CRIU_SHA256=29ec0ee09e296479fe7048c80980e8ef1d0684d0b0204c2b101dfea19f6725b9
# Debian 12's CRIU 3.17 fails on 6.x kernels, and 4.1.1 cannot dump any inet socket on
# Linux >= 6.16 (it asks every socket for SO_PASSCRED), so anything below 4.2.1 is rejected.
MIN_VERSION=4.2.1
# What `make criu` needs (libaio/libnl-route are only for CRIU's tests,
# python3-protobuf only for crit); iproute2 is a runtime need (criu runs `ip`).
BUILD_DEPS=(build-essential pkg-config libprotobuf-dev libprotobuf-c-dev
  protobuf-c-compiler protobuf-compiler libnl-3-dev libcap-dev libnet1-dev
  libbsd-dev libgnutls28-dev libnftables-dev uuid-dev xz-utils curl iproute2)

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PREFIX="${1:-${FERRY_CRIU_PREFIX:-$REPO/.ferry/criu}}"
BIN="$PREFIX/bin/criu"
PROTO_DIR="$PREFIX/share/criu/proto"
PATCHES=("$REPO"/native/criu/*.patch)
# Records which patches the installed binary was built with: a changed patch rebuilds.
STAMP="$PREFIX/share/criu/ferry-patch.sha256"
CACHE="$REPO/.ferry/cache"
TARBALL="$CACHE/$CRIU_TARBALL"

log() { echo "install-criu: $*" >&2; }
die() { log "error: $*"; exit 1; }

# Prints the "X.Y.Z" from `criu --version` ("Version: 4.2.1"), or nothing.
criu_version() {
  { "$1" --version 2>/dev/null || true; } | sed -n '/^Version:/{s/^Version: *\([0-9][0-9.]*\).*/\1/p;q}'
}
# True when version $1 ("4.2.1") is MIN_VERSION or newer.
version_ok() {
  [[ $1 =~ ^[0-9]+(\.[0-9]+)*$ ]] || return 1
  [[ $(printf '%s\n%s\n' "$MIN_VERSION" "$1" | sort -V | head -n 1) == "$MIN_VERSION" ]]
}
protos_ok() { [[ -s $PROTO_DIR/rpc.proto && -s $PROTO_DIR/stats.proto ]]; }

sha_of() { sha256sum "$1" | cut -d' ' -f1; }
# The stamp the binary must carry: the sha256 of the patches in order, or "system".
want_stamp() {
  if [[ ${FERRY_SYSTEM_CRIU:-0} == 1 ]]; then echo system; else cat "${PATCHES[@]}" | sha256sum | cut -d' ' -f1; fi
}

# Fast path (no network, no apt): a working install is already in place.
have_bin=0
if [[ -x $BIN ]] && ver="$(criu_version "$BIN")" && version_ok "$ver" \
  && [[ -r $STAMP && $(cat "$STAMP") == "$(want_stamp)" ]]; then
  have_bin=1
  if protos_ok; then echo "criu $ver at $BIN (already installed)"; exit 0; fi
fi

# apt-get install only the packages that are missing (dpkg-query), updating
# the index only when something must actually be installed.
ensure_pkgs() {
  local p missing=()
  for p in "$@"; do
    # shellcheck disable=SC2016  # ${Status} is a dpkg-query field, not ours
    [[ $(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true) == "install ok installed" ]] || missing+=("$p")
  done
  (( ${#missing[@]} )) || return 0
  (( EUID == 0 )) || die "missing packages: ${missing[*]}; rerun as root (sudo) or install them yourself"
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  local aptlog="$REPO/.ferry/apt.log"
  mkdir -p "$REPO/.ferry"
  { apt-get update -q && apt-get install -y -q --no-install-recommends "${missing[@]}"; } >"$aptlog" 2>&1 \
    || { tail -n 20 "$aptlog" >&2; die "apt-get install failed; full log: $aptlog"; }
}

# Candidate Debian archive URIs, taken from this machine's apt configuration
# (so no mirror is hard-coded): deb822 *.sources "Types: deb" stanzas first,
# then one-line "deb [opts] URI suite comps" lists. Security suites are skipped
# since their pool does not carry the orig tarball.
apt_uris() {
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [[ -r $f ]] || continue
    awk 'function flush(  i) {
           if (types ~ /(^|[ \t])deb([ \t]|$)/ && suites !~ /-security/ && enabled !~ /no/)
             for (i = 1; i <= n; i++) print u[i]
           types = suites = enabled = ""; n = 0 }
         /^[ \t]*$/ { flush(); next }
         /^[ \t]*#/ { next }
         tolower($1) == "types:"   { types = $0 }
         tolower($1) == "suites:"  { suites = $0 }
         tolower($1) == "enabled:" { enabled = tolower($2) }
         tolower($1) == "uris:"    { for (i = 2; i <= NF; i++) u[++n] = $i }
         END { flush() }' "$f"
  done
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [[ -r $f ]] || continue
    awk '$1 == "deb" { i = 2; if ($i ~ /^\[/) { while (i < NF && $i !~ /\]$/) i++; i++ }
                       if ($(i + 1) !~ /-security/) print $i }' "$f"
  done
}

# Fetch the source tarball into the cache (reused on reruns), verifying sha256.
fetch_tarball() {
  [[ -f $TARBALL && $(sha_of "$TARBALL") == "$CRIU_SHA256" ]] && return 0
  rm -f "$TARBALL"  # absent or corrupt: (re)download
  ensure_pkgs curl xz-utils ca-certificates
  mkdir -p "$CACHE"
  local uri got
  while read -r uri; do
    [[ $uri =~ ^(https?|ftp|file): ]] || continue
    uri="${uri%/}/pool/main/c/criu/$CRIU_TARBALL"
    log "downloading $uri"
    curl -fsSL --connect-timeout 15 --max-time 600 -o "$TARBALL.part" "$uri" || continue
    got="$(sha_of "$TARBALL.part")"
    [[ $got == "$CRIU_SHA256" ]] || { rm -f "$TARBALL.part"
      die "checksum mismatch for $uri: expected $CRIU_SHA256, got $got (corrupt download or tampered mirror)"; }
    mv "$TARBALL.part" "$TARBALL"
    return 0
  done < <(apt_uris | awk '!seen[$0]++')
  rm -f "$TARBALL.part"
  die "could not download $CRIU_TARBALL from any Debian mirror in /etc/apt (see errors above)"
}

# The protos always come from the pinned tarball, so ferry's generated RPC
# code matches CRIU 4.2.1 even when a (newer) system CRIU is used.
install_protos() {
  local f
  mkdir -p "$PROTO_DIR"
  for f in rpc stats; do
    tar -xJOf "$TARBALL" "criu-$CRIU_VERSION/images/$f.proto" >"$PROTO_DIR/$f.proto.tmp" \
      || die "images/$f.proto not found in $TARBALL"
    mv "$PROTO_DIR/$f.proto.tmp" "$PROTO_DIR/$f.proto"
  done
}

# Build only the criu binary: no docs (asciidoc), lib, crit or plugins.
build_criu() {
  local build="$REPO/.ferry/build" src="$REPO/.ferry/build/criu-$CRIU_VERSION"
  ensure_pkgs "${BUILD_DEPS[@]}"
  rm -rf "$src" && mkdir -p "$build"
  tar -xJf "$TARBALL" -C "$build"
  local p
  for p in "${PATCHES[@]}"; do
    patch -d "$src" -p1 --quiet --forward <"$p" >"$build/patch.log" 2>&1 \
      || { cat "$build/patch.log" >&2; die "$p does not apply to criu $CRIU_VERSION"; }
  done
  log "building criu $CRIU_VERSION in $src (log: $build/make.log)"
  make -C "$src" -j"$(nproc)" criu >"$build/make.log" 2>&1 \
    || { tail -n 25 "$build/make.log" >&2; die "criu build failed; full log: $build/make.log"; }
  mkdir -p "$PREFIX/bin" && rm -f "$BIN"
  install -m 0755 "$src/criu/criu" "$BIN"
}

did=""
if (( ! have_bin )) && [[ ${FERRY_SYSTEM_CRIU:-0} == 1 ]]; then
  # Skip our own PREFIX/bin/criu if PREFIX/bin is on PATH.
  for cand in "$(command -v criu || true)" /usr/sbin/criu; do
    [[ -n $cand && -x $cand && ! $cand -ef $BIN ]] || continue
    ver="$(criu_version "$cand")"
    if ! version_ok "$ver"; then log "ignoring $cand (version ${ver:-unknown}, need >= $MIN_VERSION)"; continue; fi
    if ! "$cand" check >/dev/null 2>&1; then log "ignoring $cand ($ver): 'criu check' fails"; continue; fi
    mkdir -p "$PREFIX/bin" && ln -sfn "$(readlink -f "$cand")" "$BIN"
    did="using system criu $ver ($cand) -> $BIN"
    break
  done
  [[ -n $did ]] || die "FERRY_SYSTEM_CRIU=1, but no system criu >= $MIN_VERSION passes 'criu check'; unset it to build one"
fi

fetch_tarball
install_protos
if [[ -z $did && $have_bin == 1 ]]; then
  did="criu $(criu_version "$BIN") at $BIN; restored protos in $PROTO_DIR"
elif [[ -z $did ]]; then
  build_criu
  did="built criu $CRIU_VERSION from source -> $BIN"
fi

# CRIU is useless if the kernel can't checkpoint; fail loudly now, not mid-migration.
if ! out="$("$BIN" check 2>&1)"; then
  log "'$BIN check' failed:"
  printf '%s\n' "$out" >&2
  (( EUID == 0 )) || die "criu check needs root (CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE); rerun as root"
  die "the kernel ($(uname -r)) lacks what CRIU needs to checkpoint/restore. Use a kernel
  with CONFIG_CHECKPOINT_RESTORE, CONFIG_NAMESPACES, CONFIG_MEM_SOFT_DIRTY,
  CONFIG_{UNIX,INET,PACKET,NETLINK}_DIAG and CONFIG_NETFILTER (see CRIU's output above)."
fi
mkdir -p "$(dirname "$STAMP")" && want_stamp >"$STAMP"
echo "install-criu: $did"
