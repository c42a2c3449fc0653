#!/usr/bin/env bash
# Headless Chromium and its WebDriver (Debian's chromium, chromium-driver) for the status
# page's browser test. Idempotent: installs only what is missing. Needs root and apt-get.
set -Eeuo pipefail
export DEBIAN_FRONTEND=noninteractive

if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
  echo "browser: chromium and chromedriver present"
  exit 0
fi
[ "$(id -u)" = 0 ] || { echo "browser: need root to apt-get install chromium chromium-driver" >&2; exit 1; }
command -v apt-get >/dev/null || { echo "browser: apt-get not found; install chromium and chromedriver" >&2; exit 1; }
log="${TMPDIR:-/tmp}/dedupe-browser-apt.log"
echo "browser: apt-get install chromium chromium-driver (log: $log)"
timeout 300 apt-get update -qq >"$log" 2>&1
timeout 900 apt-get install -y -qq --no-install-recommends chromium chromium-driver >>"$log" 2>&1 \
  || { tail -n 30 "$log" >&2; exit 1; }
