"""How the offline tools scale with the sends of ONE request: 1,000 to 100,000 disjoint sends.

Each size is a generated OTLP-JSON file (one request span without aggregates, so the tools compute busy time from
the children; sends 1 us long, 1 us apart, so none overlap and merging them shrinks nothing). For each size it
measures `summarize` (read + figures) and `timeline` (two passes, HTML page and Perfetto JSON, no PNG) in this
process, and counts the merges of the request's kept intervals and how many intervals they sorted (the
operation count the test asserts: O(log n) merges, O(n) intervals sorted). Figures go to
bench/results-tools-scale.json and are printed as a table.

    python bench/tools_scale.py [--sizes 1000,4096,8192,20000,50000,100000] [--out bench/results-tools-scale.json]
"""

import argparse
import contextlib
import io
import json
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from otel_kvtransfer.building import aggregate
from otel_kvtransfer.cli import main as cli_main
from otel_kvtransfer.tools.reading import load

T0 = 1_700_000_000_000_000_000
BATCH = 512


def write_file(path: str, sends: int) -> None:
    head = ('{"resourceSpans":[{"resource":{"attributes":[{"key":"service.name","value":{"stringValue":"prefill"}}]},'
            '"scopeSpans":[{"scope":{"name":"otel_kvtransfer"},"spans":[')
    tail = "]}]}]}\n"

    def span(span_id, parent, name, start, end, attrs):
        parent_text = f',"parentSpanId":"{parent:016x}"' if parent else ""
        attributes = ",".join('{"key":"%s","value":{"%s":"%s"}}' % a for a in attrs)
        return (f'{{"traceId":"{1:032x}","spanId":"{span_id:016x}"{parent_text},"name":"{name}","kind":3,'
                f'"startTimeUnixNano":"{start}","endTimeUnixNano":"{end}","attributes":[{attributes}],"status":{{}}}}')

    key = ("kv_transfer.request_key", "stringValue", "big")
    items = [span(10 + i, 1, "kv_transfer.send", T0 + 2000 * i, T0 + 2000 * i + 1000,
                  [key, ("kv_transfer.bytes", "intValue", "4096"), ("kv_transfer.payload", "stringValue", "kv")])
             for i in range(sends)]
    items.append(span(1, 0, "kv_transfer.request", T0, T0 + 2000 * sends, [key]))
    with open(path, "w", encoding="utf-8") as handle:
        for i in range(0, len(items), BATCH):
            handle.write(head + ",".join(items[i:i + BATCH]) + tail)


def measure(sends: int, folder: str) -> dict:
    path = os.path.join(folder, f"sends-{sends}.jsonl")
    write_file(path, sends)
    merges = []
    real = aggregate.RequestAggregate.compact

    def counting(self):
        merges.append(len(self.sends) + len(self.compute))
        real(self)

    aggregate.RequestAggregate.compact = counting
    try:
        start = time.process_time()
        (request,) = load(path).requests
        figures = request.figures()
        summarize_s = time.process_time() - start
    finally:
        aggregate.RequestAggregate.compact = real
    assert figures["transfer_count"] == sends
    start = time.process_time()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = cli_main(["timeline", path, "--no-png", "--html", os.path.join(folder, "t.html"),
                         "--perfetto", os.path.join(folder, "t.json")])
    timeline_s = time.process_time() - start
    return {"sends": sends, "file_bytes": os.path.getsize(path), "summarize_cpu_s": round(summarize_s, 3),
            "summarize_cpu_us_per_send": round(summarize_s / sends * 1e6, 1), "merges": len(merges),
            "intervals_sorted_by_merges": sum(merges), "timeline_rc": code, "timeline_cpu_s": round(timeline_s, 3),
            "busy_s": figures["busy_s"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,4096,8192,20000,50000,100000")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                      "results-tools-scale.json"))
    args = parser.parse_args()
    sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvt-tools-scale-") as folder:
        for sends in sizes:
            rows.append(measure(sends, folder))
            row = rows[-1]
            print(f"{row['sends']:>7} sends  summarize {row['summarize_cpu_s']:>7.2f} CPU s "
                  f"({row['summarize_cpu_us_per_send']:.0f} us/send)  merges {row['merges']} "
                  f"({row['intervals_sorted_by_merges']} intervals)  timeline {row['timeline_cpu_s']:>7.2f} CPU s",
                  flush=True)
    result = {"what": "one request with N disjoint sends: CPU seconds of summarize and timeline (HTML + Perfetto)",
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
              "measured_at_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "rows": rows}
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=2)
        handle.write("\n")
    print(f"figures: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
