#!/usr/bin/env bash
# Installs what the browser test (tests/e2e/test_console_browser.py) needs on a fresh Debian
# machine: Debian's chromium at /usr/bin/chromium, node + npm, and npm playwright-core (pinned)
# under <repo>/.cache/node, where tests/e2e/console_browser.mjs looks for it.
# Idempotent and quiet: each piece is installed only when it is missing.
# (`npx playwright install` does not work here: it downloads browsers of its own.)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PLAYWRIGHT_CORE_VERSION="1.65.1"
PREFIX="$ROOT/.cache/node"
export DEBIAN_FRONTEND=noninteractive

SUDO=""
if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then
  SUDO="sudo"
fi

APT_UPDATED=0
apt_install() {
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-browser: apt-get not found; install $* yourself" >&2
    return 1
  fi
  if [ "$APT_UPDATED" = 0 ]; then
    $SUDO apt-get update -qq >/dev/null
    APT_UPDATED=1
  fi
  echo "install-browser: apt-get install $*"
  $SUDO apt-get install -y -qq "$@" >/dev/null
}

if [ ! -x /usr/bin/chromium ]; then
  apt_install chromium
fi

if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  apt_install nodejs npm
fi

installed="$(node -p "try { require('$PREFIX/node_modules/playwright-core/package.json').version } catch (e) { '' }")"
if [ "$installed" != "$PLAYWRIGHT_CORE_VERSION" ]; then
  echo "install-browser: npm install playwright-core@$PLAYWRIGHT_CORE_VERSION into $PREFIX"
  mkdir -p "$PREFIX"
  npm install --prefix "$PREFIX" --no-audit --no-fund --loglevel=error \
    "playwright-core@$PLAYWRIGHT_CORE_VERSION" >/dev/null
fi
