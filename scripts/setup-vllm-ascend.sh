#!/usr/bin/env bash
# The source of vllm-ascend (vLLM's Ascend NPU plugin) that tests/frameworks/vllm_ascend/ runs its connectors from
# (idempotent; fast when current). Its newest release, 0.23.0.post1, is published as an sdist only (its wheels stop
# at 0.23.0), so the sdist is fetched with pip (pinned version and sha256, `--require-hashes`), never built or
# installed: pip only runs its metadata step, in a small build virtualenv of its own (setuptools, setuptools-scm;
# SOC_VERSION names an Ascend chip because setup.py asks `npu-smi` otherwise). Kept: the package's Python files and
# its PKG-INFO (so `importlib.metadata` finds the release), not its entry points (a vLLM that saw them would load
# the NPU platform).
# Location: $KVT_VLLM_ASCEND_SRC, default ${XDG_CACHE_HOME:-$HOME/.cache}/otel-kvtransfer/vllm-ascend/<version>/src.
# Prints that folder on its last line.
set -euo pipefail

VERSION="0.23.0.post1"
SHA256="a3b9f4a5dd7aa50c37e03d1f35937c4ae5aeacc49b734cac74d59ce5757738e1"
PYTHON="${PYTHON:-python3}"
HOME_DIR="${XDG_CACHE_HOME:-$HOME/.cache}/otel-kvtransfer/vllm-ascend"
SRC="${KVT_VLLM_ASCEND_SRC:-$HOME_DIR/$VERSION/src}"

if [ -f "$SRC/.complete" ] && [ "$(cat "$SRC/.complete")" = "$VERSION $SHA256" ]; then
  echo "$SRC"
  exit 0
fi

echo "setup-vllm-ascend: fetching vllm-ascend $VERSION (sdist) ..." >&2
BUILD_VENV="$HOME_DIR/build-venv"
if ! "$BUILD_VENV/bin/python" -c 'import setuptools, setuptools_scm' >/dev/null 2>&1; then
  rm -rf "$BUILD_VENV"
  "$PYTHON" -m venv "$BUILD_VENV"
  "$BUILD_VENV/bin/python" -m pip install -q --disable-pip-version-check "setuptools>=64" "setuptools-scm>=8" \
    wheel packaging >&2
fi
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
echo "vllm-ascend==$VERSION --hash=sha256:$SHA256" > "$WORK/requirements.txt"
SOC_VERSION="${SOC_VERSION:-ascend910b1}" "$BUILD_VENV/bin/python" -m pip download -q --disable-pip-version-check \
  --no-deps --no-binary :all: --no-build-isolation --require-hashes -r "$WORK/requirements.txt" -d "$WORK/dl" >&2
ARCHIVE="$WORK/dl/vllm_ascend-$VERSION.tar.gz"
echo "$SHA256  $ARCHIVE" | sha256sum -c --quiet -
tar -xzf "$ARCHIVE" -C "$WORK"
UNPACKED="$WORK/vllm_ascend-$VERSION"
rm -rf "$SRC"
mkdir -p "$SRC/vllm_ascend.egg-info"
cp "$UNPACKED/PKG-INFO" "$SRC/vllm_ascend.egg-info/PKG-INFO"
(cd "$UNPACKED" && find vllm_ascend -name '*.py' -print0 | xargs -0 cp --parents -t "$SRC")
echo "$VERSION $SHA256" > "$SRC/.complete"
echo "$SRC"
