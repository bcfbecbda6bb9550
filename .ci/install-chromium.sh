#!/usr/bin/env bash
# Install Chromium from Debian packages when no Chromium is on PATH, for the screenshot
# check of the docs site (tests/test_site_browser.py). Idempotent and quiet.
set -euo pipefail

have_chromium() {
  command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1
}

if have_chromium; then
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq >/dev/null
# fonts-dejavu-core: the pages' text needs a font; the package pulls in no desktop.
$SUDO apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null

if ! have_chromium; then
  echo "chromium was installed but is still not on PATH" >&2
  exit 1
fi
