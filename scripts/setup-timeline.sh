#!/usr/bin/env bash
# Real parts for the timeline tests: Debian chromium renders the HTML timeline headless.
# Idempotent: installs nothing when chromium is already there. Pillow (the PNG) comes from pip with the package.
set -euo pipefail

if command -v chromium >/dev/null 2>&1; then
    echo "setup-timeline: chromium present: $(chromium --version 2>/dev/null || echo unknown)"
else
    export DEBIAN_FRONTEND=noninteractive
    SUDO=""
    if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
    $SUDO apt-get update
    $SUDO apt-get install -y --no-install-recommends chromium fonts-dejavu-core
    echo "setup-timeline: installed $(chromium --version 2>/dev/null || echo chromium)"
fi
