#!/usr/bin/env bash
# Debian's Chromium for the browser test (tests/test_tensorboard_view.py), installed only when no
# Chromium is on the PATH. Without it that one test skips and says why.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
    exit 0
fi
as_root=()
if [ "$(id -u)" != 0 ]; then
    as_root=(sudo)
fi
${as_root[@]+"${as_root[@]}"} apt-get update -qq
${as_root[@]+"${as_root[@]}"} env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium
