"""`otel-kvtransfer demo --engine nixl`, run as a user runs it: a subprocess moving real bytes between NIXL agents
(UCX on the loopback device) in separate processes, every byte verified, spans written and read back."""

import os
import subprocess
import sys

from support.parts import require_part

from otel_kvtransfer import semconv


def _nixl_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("nixl") is not None


def test_demo_over_nixl_verifies_bytes_and_writes_request_spans(tmp_path):
    require_part(_nixl_importable(), "NIXL (scripts/requirements-nixl.txt)")
    out = tmp_path / "demo"
    env = dict(os.environ, MC_LOG_LEVEL="ERROR")
    run = subprocess.run(
        [sys.executable, "-m", "otel_kvtransfer", "demo", "--engine", "nixl", "--requests", "2", "--fanout", "2",
         "--chunks", "512,128", "--prefix-tokens", "256", "--compute-us-per-token", "20", "--out-dir", str(out)],
        env=env, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "bytes verified on every decode engine: yes" in run.stdout
    from otel_kvtransfer.tools.spanfile import read_spans

    spans = read_spans(str(out / "spans.jsonl"))
    requests = [s for s in spans if s.name == semconv.SPAN_REQUEST]
    assert sorted(s.attributes[semconv.REQUEST_KEY] for s in requests) == ["1000", "1001"]
    tokens, bytes_per_token, aux = 256 + 512 + 128, 8192, 4096
    for request in requests:
        assert request.attributes[semconv.BACKEND] == "nixl"
        # every KV byte and the aux payload to each of the two destinations
        assert request.attributes[semconv.BYTES] == 2 * (tokens * bytes_per_token + aux)
        assert request.attributes[semconv.REPLICA_FACTOR] == 2
    receives = [s for s in spans if s.name == semconv.SPAN_RECEIVE]
    assert len(receives) == 4  # one per request and decode engine
