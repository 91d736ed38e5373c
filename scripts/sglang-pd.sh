#!/usr/bin/env bash
# A real, instrumented sglang PD deployment on this one machine: prefill server + decode server (both under
# `opentelemetry-instrument`, spans to OTLP-JSON span files), sglang-router in PD mode, a tiny config-only Llama
# with dummy weights, Mooncake over TCP, all inside one private network namespace (loopback only). It sends N real
# streaming requests through the router (every second one repeats the prompt before it, so its cached prefix is
# sent early), stops everything, and writes the span files, a per-request summary and a timeline picture with
# compute lanes.
#
#   bash scripts/sglang-pd.sh [--out DIR] [--requests N] [--tokens T] [--max-new-tokens M]
#
# Same recipe as the serving tests (tests/sglang_serving/deployment.py, with its stand-ins for what a CPU-only
# machine lacks: an import-only sgl_kernel and a test plugin). Needs root (unshare --net), util-linux and iproute2
# (bash scripts/setup-observability.sh installs them), and 1-3 minutes for the servers to start.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$ROOT/out/sglang-pd"
ARGS=()
while [ "$#" -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --requests|--tokens|--max-new-tokens|--repeat-every) ARGS+=("$1" "$2"); shift 2 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "sglang-pd: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
for tool in unshare nsenter ip; do
  command -v "$tool" >/dev/null || { echo "sglang-pd: $tool missing (bash scripts/setup-observability.sh)" >&2; exit 1; }
done
PY="$(bash "$ROOT/scripts/setup.sh" | tail -n 1)"
BIN="$(dirname "$PY")"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
rm -f "$OUT"/spans-*.jsonl "$OUT/spans.jsonl"
cd "$ROOT"
"$PY" tests/sglang_serving/deployment.py run --out "$OUT" "${ARGS[@]}"
cat "$OUT/spans-prefill.jsonl" "$OUT/spans-decode.jsonl" > "$OUT/spans.jsonl"
"$BIN/otel-kvtransfer" summarize "$OUT/spans.jsonl"
"$BIN/otel-kvtransfer" timeline "$OUT/spans.jsonl" --png "$OUT/timeline.png" --html "$OUT/timeline.html"
echo "sglang-pd: span files $OUT/spans-prefill.jsonl, $OUT/spans-decode.jsonl; timeline $OUT/timeline.png"
