"""HTTP client run INSIDE the deployment's network namespace (stdlib only; loopback addresses only).

    client.py ok URL                 -> {"ok": bool}    (a 200 answer within 5 s)
    client.py get URL PARAMS_JSON    -> the JSON body
    client.py text URL               -> {"text": the body} (a Prometheus exposition, say; at most 4 MiB)
    client.py post URL BODY_JSON     -> {"status": the HTTP status} (sglang's /abort_request, say)
    client.py generate URL < REQUESTS_JSON
        requests: [{"rid", "input_ids", "max_new_tokens", optional "traceparent"}]; sent one after another as
        streaming /generate calls;
        answers [{"rid", "ttft_s", "total_s", "tokens", "meta"}] (ttft_s: first streamed chunk with a token)
"""

import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request


def _loopback(url: str) -> str:
    if not url.startswith("http://127.0.0.1:"):
        raise SystemExit(f"client: only http://127.0.0.1 URLs, not {url[:80]!r}")
    return url


def ok(url: str) -> dict:
    try:
        with urllib.request.urlopen(_loopback(url), timeout=5) as response:
            return {"ok": response.status == 200}
    except (urllib.error.URLError, OSError):
        return {"ok": False}


def get(url: str, params: dict):
    if params:
        url += "?" + urllib.parse.urlencode(params, doseq=True)
    with urllib.request.urlopen(_loopback(url), timeout=20) as response:
        return json.loads(response.read().decode())


def post(url: str, body: str) -> dict:
    http = urllib.request.Request(_loopback(url), data=json.dumps(json.loads(body)).encode(),
                                  headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(http, timeout=20) as response:
            return {"status": response.status}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code}


def text(url: str) -> dict:
    with urllib.request.urlopen(_loopback(url), timeout=20) as response:
        return {"text": response.read(4 << 20).decode(errors="replace")}


ROUTER_WARMUP_S = 120  # how long a 503 from a router that is up but has no ready worker pair is retried


def generate_one(url: str, request: dict) -> dict:
    body = json.dumps({
        "rid": request["rid"], "input_ids": request["input_ids"], "stream": True,
        "sampling_params": {"max_new_tokens": request["max_new_tokens"], "temperature": 0, "ignore_eos": True},
    }).encode()
    headers = {"Content-Type": "application/json"}
    if request.get("traceparent"):  # a caller's trace context (W3C), as a traced client would send it
        headers["traceparent"] = str(request["traceparent"])[:55]
    http = urllib.request.Request(_loopback(url), data=body, headers=headers)
    deadline = time.monotonic() + ROUTER_WARMUP_S
    while True:
        start = time.perf_counter()
        try:
            response = urllib.request.urlopen(http, timeout=300)
            break
        except urllib.error.HTTPError as exc:
            # 503: the router answers /health before it has seen a healthy prefill/decode pair (bounded wait).
            if exc.code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(2.0)
    ttft, tokens, meta = None, 0, {}
    with response:
        for raw in response:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"request {request['rid']}: {str(chunk['error'])[:300]}")
            ids = chunk.get("output_ids") or []
            if ids and ttft is None:
                ttft = time.perf_counter() - start
            tokens = max(tokens, len(ids), int((chunk.get("meta_info") or {}).get("completion_tokens") or 0))
            meta = chunk.get("meta_info") or meta
    total = time.perf_counter() - start
    return {"rid": request["rid"], "ttft_s": ttft if ttft is not None else total, "total_s": total,
            "tokens": tokens, "meta": meta}


def main(argv) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    command, url = argv[0], argv[1]
    if command == "ok":
        answer = ok(url)
    elif command == "get":
        answer = get(url, json.loads(argv[2]) if len(argv) > 2 else {})
    elif command == "text":
        answer = text(url)
    elif command == "post":
        answer = post(url, argv[2] if len(argv) > 2 else "{}")
    elif command == "generate":
        answer = [generate_one(url, r) for r in json.load(sys.stdin)]
    else:
        print(f"client: unknown command {command!r}", file=sys.stderr)
        return 2
    json.dump(answer, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
