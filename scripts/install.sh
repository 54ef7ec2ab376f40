#!/usr/bin/env bash
# Put ferry on a node: `make install PREFIX=/opt/ferry` (after `make all`) runs this.
#
# Usage: scripts/install.sh PREFIX [UNIT_DIR]
#   PREFIX/venv                  ferry and its runtime dependencies (no torch, no test tools, no
#                                test doubles: agent/testing stays in the checkout)
#   PREFIX/bin/ferry             the CLI and agent, pointed at the CRIU and ferry-init below
#   PREFIX/bin/ferry-init        the jobs' PID 1
#   PREFIX/criu/bin/criu         CRIU as `make criu` built it (with ferry's data-path patch)
#   PREFIX/share/ferry/          the systemd unit and the Kubernetes manifest, as installed
#   PREFIX/share/doc/ferry/      the docs
#   UNIT_DIR/ferry-agent.service the unit, with PREFIX filled in (UNIT_DIR: /etc/systemd/system;
#                                "none" skips it)
# A second run replaces what the first installed. Nothing is started: see docs/operations.md.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
PREFIX="${1:?usage: scripts/install.sh PREFIX [UNIT_DIR]}"
UNIT_DIR="${2:-/etc/systemd/system}"
PYTHON="${PYTHON:-python3}"

die() { echo "install: $*" >&2; exit 1; }
case "$PREFIX" in /*) ;; *) die "PREFIX must be an absolute path, got '$PREFIX'" ;; esac
for built in "$REPO/.ferry/criu/bin/criu" "$REPO/.ferry/bin/ferry-init" "$REPO/ferry/v1/agent_pb2.py"; do
  [ -e "$built" ] || die "$built is missing: run \`make all\` first"
done

echo "install: ferry into $PREFIX/venv"
# Built from a fresh copy of the sources: a build in the checkout packs whatever an earlier one
# left in build/lib, agent/testing (the test doubles, kept out by pyproject.toml) included.
SRC="$(mktemp -d)"
trap 'rm -rf "$SRC"' EXIT
cp -r "$REPO/pyproject.toml" "$REPO/README.md" "$REPO/agent" "$REPO/ferry" "$SRC/"
"$PYTHON" -m venv --clear "$PREFIX/venv"
"$PREFIX/venv/bin/pip" install -q --disable-pip-version-check "$SRC"
# -I: the check must not find a checkout through the current directory.
"$PREFIX/venv/bin/python" -I -c 'import importlib.util as u, sys; sys.exit(u.find_spec("agent.testing") is not None)' \
  || die "the install holds agent/testing, the test doubles: it must not"

install -d "$PREFIX/bin" "$PREFIX/criu/bin" "$PREFIX/share/ferry" "$PREFIX/share/doc/ferry"
install -m 0755 "$(readlink -f "$REPO/.ferry/criu/bin/criu")" "$PREFIX/criu/bin/criu"
install -m 0755 "$REPO/.ferry/bin/ferry-init" "$PREFIX/bin/ferry-init"
cat > "$PREFIX/bin/ferry.tmp" <<WRAPPER
#!/bin/sh
# ferry as installed in $PREFIX: its own CRIU and job init unless the environment names others.
export FERRY_CRIU="\${FERRY_CRIU:-$PREFIX/criu/bin/criu}"
export FERRY_INIT="\${FERRY_INIT:-$PREFIX/bin/ferry-init}"
exec "$PREFIX/venv/bin/ferry" "\$@"
WRAPPER
chmod 0755 "$PREFIX/bin/ferry.tmp"
mv "$PREFIX/bin/ferry.tmp" "$PREFIX/bin/ferry"

sed "s|@PREFIX@|$PREFIX|g" "$REPO/scripts/deploy/ferry-agent.service" > "$PREFIX/share/ferry/ferry-agent.service"
install -m 0644 "$REPO/scripts/deploy/kubernetes.yaml" "$PREFIX/share/ferry/kubernetes.yaml"
install -m 0644 "$REPO"/docs/*.md "$PREFIX/share/doc/ferry/"
if [ "$UNIT_DIR" != none ]; then
  install -d "$UNIT_DIR"
  install -m 0644 "$PREFIX/share/ferry/ferry-agent.service" "$UNIT_DIR/ferry-agent.service"
  echo "install: unit $UNIT_DIR/ferry-agent.service"
fi
"$PREFIX/bin/ferry" --version >/dev/null || die "the installed ferry does not run"
echo "install: done; $PREFIX/bin/ferry doctor checks this node, docs/operations.md starts the agent"
