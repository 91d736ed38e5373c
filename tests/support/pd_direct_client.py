"""Requests sent straight to an SGLang PD pair, as its router sends them, run inside the deployment's namespace.

    python pd_direct_client.py PREFILL_GENERATE_URL DECODE_GENERATE_URL BOOTSTRAP_PORT < REQUESTS_JSON

requests: [{"rid", "input_ids", "max_new_tokens", "room", optional "traceparent"}], all sent at once (one thread
each); each is POSTed to both servers with bootstrap_host / bootstrap_port / bootstrap_room added, as sglang's
router does, so a client that reaches the servers can send any rid the JSON body holds. Prints
[{"room", "prefill", "decode"}]: each server's HTTP status: 200, or the code and the start of the answer's body,
or the error's name.
"""

import json
import sys
import threading
import urllib.error
import urllib.request


def _post(url: str, body: bytes, headers: dict) -> object:
    if not url.startswith("http://127.0.0.1:"):
        raise SystemExit(f"pd_direct_client: only http://127.0.0.1 URLs, not {url[:80]!r}")
    request = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as exc:
        return f"{exc.code} {exc.read()[:300].decode(errors='replace')}"
    except OSError as exc:
        return type(exc).__name__


def main(argv) -> int:
    prefill, decode, bootstrap_port = argv[0], argv[1], int(argv[2])
    answers, threads = [], []
    for item in json.load(sys.stdin):
        body = json.dumps({  # ensure_ascii: a lone surrogate travels as its escape, as a client's JSON would
            "rid": item["rid"], "input_ids": item["input_ids"], "stream": False,
            "sampling_params": {"max_new_tokens": item["max_new_tokens"], "temperature": 0, "ignore_eos": True},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port, "bootstrap_room": item["room"],
        }).encode()
        headers = {"Content-Type": "application/json"}
        if item.get("traceparent"):  # a caller's trace context (W3C), as a traced client would send it
            headers["traceparent"] = str(item["traceparent"])[:55]
        answer = {"room": item["room"]}
        answers.append(answer)
        for role, url in (("prefill", prefill), ("decode", decode)):
            thread = threading.Thread(target=lambda a=answer, r=role, u=url, b=body, h=headers:
                                      a.__setitem__(r, _post(u, b, h)))
            thread.start()
            threads.append(thread)
    for thread in threads:
        thread.join()
    json.dump(answers, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
