"""The span encoder's CPU per span: thread CPU time of `span_encoding.encode_request` over many built spans.

The spans are the ones tests/building/test_span_encoding.py builds through the real builder on the direct path (sends,
requests, peer waits of every shape it covers), repeated; encoding them is what the OTLP exporter's thread pays
per span. `--tree` imports the package (and that test module) from another checkout, to compare two commits:

    git worktree add /tmp/before <commit>
    for i in 1 2 3; do for tree in /tmp/before .; do python bench/encoder_cpu.py --tree $tree; done; done

Each line: the median and the lowest of the rounds, in us per span.
"""

import argparse
import json
import os
import statistics
import sys
import time

from trees import add_tree_option, use_tree


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_tree_option(parser)
    parser.add_argument("--copies", type=int, default=2000, help="how many times the test's spans are repeated")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if args.copies < 1 or args.rounds < 1:
        parser.error("--copies and --rounds must be at least 1")
    tree = use_tree(args.tree, "tests", os.path.join("tests", "building"))  # support/, and the test's folder
    import test_span_encoding

    from otel_kvtransfer.building import span_encoding

    built, _ = test_span_encoding._run("direct")
    spans = [span for span in built if type(span).__name__ == "KVSpan"] * args.copies
    per_span = []
    for _ in range(args.rounds):
        start = time.thread_time_ns()
        span_encoding.encode_request(spans)
        per_span.append((time.thread_time_ns() - start) / len(spans) / 1e3)
    print(json.dumps({"package": os.path.join(tree, "otel_kvtransfer"), "spans": len(spans),
                      "us_per_span": {"median": round(statistics.median(per_span), 3),
                                      "min": round(min(per_span), 3)}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
