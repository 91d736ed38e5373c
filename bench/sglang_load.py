"""Open-loop load on the sglang router, run INSIDE the deployment's network namespace (stdlib only).

    sglang_load.py URL open RATE < REQUESTS_JSON    (requests as tests/sglang_serving/client.py takes them)
    sglang_load.py URL closed N < REQUESTS_JSON

open: request i leaves at i / RATE seconds, whether or not earlier ones have finished (a server that falls behind
shows it as growing TTFT instead of slowing the client down); each request on its own thread (at most
MAX_REQUESTS). closed: N threads, each sending the next request as soon as its previous one has finished, so N
requests are always in the deployment: with N above what one prefill step takes, the completion rate is the
highest rate the deployment sustains. Answers {"results": [{"rid", "offset_s", "ttft_s", "total_s", "tokens", "error"}],
"wall_s"}: offset_s is when it actually left, wall_s from the first send to the last answer.
"""

import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests",
                                "sglang_serving"))
from client import generate_one

MAX_REQUESTS = 500
MAX_RATE = 100.0
MAX_CONCURRENCY = 32


def run(url: str, mode: str, value: float, requests: list) -> dict:
    results = [None] * len(requests)
    start = time.perf_counter()

    def one(index: int, request: dict) -> None:
        offset = time.perf_counter() - start
        try:
            answer = generate_one(url, request)
            results[index] = {"rid": request["rid"], "offset_s": offset, "ttft_s": answer["ttft_s"],
                              "total_s": answer["total_s"], "tokens": answer["tokens"], "error": None}
        except Exception as exc:
            results[index] = {"rid": request["rid"], "offset_s": offset, "ttft_s": None, "total_s": None,
                              "tokens": 0, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}

    threads = []
    if mode == "closed":
        queue = list(enumerate(requests))[::-1]  # list.pop() is atomic under the GIL
        lock = threading.Lock()

        def worker() -> None:
            while True:
                with lock:
                    if not queue:
                        return
                    index, request = queue.pop()
                one(index, request)

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(int(value))]
        for thread in threads:
            thread.start()
    else:
        for index, request in enumerate(requests):
            delay = start + index / value - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            thread = threading.Thread(target=one, args=(index, request), daemon=True)
            thread.start()
            threads.append(thread)
    for thread in threads:
        thread.join(1800)  # generate_one's own socket time-out bounds each request
    return {"results": [r for r in results if r is not None], "wall_s": time.perf_counter() - start}


def main(argv) -> int:
    try:
        url, mode, value = argv[0], argv[1], float(argv[2])
        requests = json.load(sys.stdin)
        limit = MAX_RATE if mode == "open" else MAX_CONCURRENCY
        if not (mode in ("open", "closed") and 0 < value <= limit and isinstance(requests, list)
                and 1 <= len(requests) <= MAX_REQUESTS):
            raise ValueError(f"open RATE (0..{MAX_RATE}) or closed N (1..{MAX_CONCURRENCY}), "
                             f"1..{MAX_REQUESTS} requests")
    except (IndexError, ValueError) as exc:
        print(f"sglang_load: bad arguments ({str(exc)[:200]})", file=sys.stderr)
        return 2
    json.dump(run(url, mode, value, requests), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
