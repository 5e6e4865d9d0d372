#!/usr/bin/env bash
# Installs checkov (pinned) into a venv of its own under <repo>/.cache/checkov, for the
# Kubernetes manifests' policy check (tests/unit/test_kubernetes.py, run when CHECKOV_BIN
# names it). Not in .venv: checkov pins packaging and networkx below what torch and the
# rest of the stack use. Idempotent: installed only when missing. Prints the binary's path.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CHECKOV_VERSION="3.3.30"
VENV="$ROOT/.cache/checkov"
BIN="$VENV/bin/checkov"
if [ ! -x "$BIN" ] || ! "$BIN" --version 2>/dev/null | grep -qx "$CHECKOV_VERSION"; then
  echo "install-checkov: checkov $CHECKOV_VERSION into $VENV" >&2
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  LOG="$(mktemp)"
  if ! "$VENV/bin/pip" install -q --disable-pip-version-check "checkov==$CHECKOV_VERSION" \
      >"$LOG" 2>&1; then
    grep -v "is ignored: it is neither a file nor a directory" "$LOG" >&2 || true
    rm -f "$LOG"
    exit 1
  fi
  rm -f "$LOG"
fi
echo "$BIN"
