#!/usr/bin/env bash
# Install the PostgreSQL server from Debian packages, only when neither the system nor
# the test extra (pgserver) provides initdb.
# Idempotent and quiet: the tests start throwaway servers with initdb and pg_ctl.
set -euo pipefail

have_initdb() {
  command -v initdb >/dev/null 2>&1 && return 0
  compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null
}

if have_initdb; then
  exit 0
fi
# The test extra's pgserver wheel carries the server binaries (Linux x86_64, Python < 3.13).
if [ "$(uname -sm)" = "Linux x86_64" ] &&
   python -c 'import sys; sys.exit(sys.version_info >= (3, 13))'; then
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq >/dev/null
$SUDO apt-get install -y -qq --no-install-recommends postgresql >/dev/null

if ! have_initdb; then
  echo "PostgreSQL was installed but initdb is still missing" >&2
  exit 1
fi
