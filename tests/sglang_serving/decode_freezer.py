"""Freeze a decode server the moment it awaits a prompt's KV, run inside the deployment's namespace.

    python decode_freezer.py DECODE_URL MIN_TOKENS TIMEOUT_S PID [PID ...]

It reads the decode's own load (sglang's `/v1/loads`: the scheduler's queues, published as it runs) every 20 ms
and prints `watching` once it has read it. As soon as a request sits in the decode's transfer queue with at least
MIN_TOKENS tokens of KV slots in use (sglang's health checks hold one or two), the decode has queued for the prefill
where to write; its ZMQ I/O thread sends that within milliseconds, and GRACE_S later it stops every PID (SIGSTOP):
from then on the prefill needs nothing more from the decode until its forward ends (over a second for the prompts
it is used with) and its send starts. A freeze at the very moment the decode queued it could keep the message in
the frozen process. It prints one JSON line {"frozen": true, ...}; past TIMEOUT_S it stops nothing, prints
{"frozen": false, "last": ...} and exits 1. Its requests go to 127.0.0.1 only, one at a time.
"""

import json
import os
import signal
import sys
import time
import urllib.request

GRACE_S = 0.3  # the decode's message on its way out: milliseconds; the prefill's forward after it: seconds

def main() -> int:
    url, min_tokens, timeout_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    pids = [int(pid) for pid in sys.argv[4:]]
    deadline, last, polls = time.monotonic() + timeout_s, None, 0
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/v1/loads?include=core,disagg", timeout=5) as answer:
                loads = json.loads(answer.read(1 << 20))
        except (OSError, ValueError) as exc:
            last = repr(exc)[:300]
            time.sleep(0.02)
            continue
        load = (loads.get("loads") or [{}])[0]
        disagg = load.get("disaggregation") or {}
        last = {"transfer": disagg.get("decode_transfer_queue_reqs"), "used": load.get("num_used_tokens")}
        polls += 1
        if polls == 1:
            print("watching", flush=True)
        if (last["transfer"] or 0) >= 1 and (last["used"] or 0) >= min_tokens:
            time.sleep(GRACE_S)
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            print(json.dumps({"frozen": True, "polls": polls, "load": last}), flush=True)
            return 0
        time.sleep(0.02)
    if polls == 0:
        print("watching", flush=True)  # whoever waits for it learns the outcome from the line after
    print(json.dumps({"frozen": False, "polls": polls, "last": last}), flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
