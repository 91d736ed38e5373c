"""`summarize --links` within bounds, whatever the file: the peers it shows (a few in the text, with one line
saying how many more; at most `links.PEERS_LISTED` in the JSON, every peer still fitted and counted), and the memory
its calls' request keys take (each key kept once; a call holds numbers, not a set of strings).

No engine: generated OTLP-JSON files and the link model's own call table (memory measured with tracemalloc,
asserted per call: a structural bound, never a time).
"""

import gc
import json
import os
import subprocess
import sys
import tracemalloc

from support.span_files import T0, span_record, write_otlp

import otel_kvtransfer
from otel_kvtransfer import semconv as sc
from otel_kvtransfer.tools import links
from otel_kvtransfer.tools.spanfile import Span

MS = 1_000_000
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(otel_kvtransfer.__file__)))


def _cli(*args):
    """The command, from the very package these tests import."""
    return subprocess.run([sys.executable, "-m", "otel_kvtransfer", *args], capture_output=True, timeout=300,
                          check=False, env=dict(os.environ, PYTHONPATH=PACKAGE_ROOT))


def _peer_sends(peers: int, per_peer: int = 6) -> list:
    """`per_peer` successful sends to each of `peers` peers, three sizes to each of two ports."""
    records = []
    for peer in range(peers):
        address = f"10.{peer // 62500}.{peer // 250 % 250}.{peer % 250}"
        for call in range(per_peer):
            start = T0 + (peer * per_peer + call) * 10 * MS
            nbytes = (call + 1) << 20
            records.append(span_record(sc.SPAN_SEND, f"{peer:032x}", f"{peer * per_peer + call + 1:016x}", None,
                                       start, start + (call + 1) * MS + peer, {
                                           sc.REQUEST_KEY: f"r{peer}-{call}", sc.BYTES: nbytes,
                                           sc.DESCRIPTOR_COUNT: 1, sc.SERVER_ADDRESS: address,
                                           sc.SERVER_PORT: 15000 + call % 2}, kind="CLIENT"))
    return records


def test_many_peers_show_a_few_rows_then_how_many_more(tmp_path):
    peers = 3 * links.PEERS_LISTED  # every peer with its own address and two ports
    path = write_otlp(tmp_path / "peers.jsonl", _peer_sends(peers), per_line=512)
    text = _cli("summarize", path, "--links")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.decode().splitlines()
    table = lines[lines.index(next(line for line in lines if line.startswith("---"))) + 1:]
    rows = table[:next(i for i, line in enumerate(table) if line.startswith("... "))]
    assert len(rows) == links.PEERS_SHOWN  # 50 of the 6,000 peers (address and port), not 6,000 rows
    assert all(line.lstrip().startswith("10.") for line in rows)
    assert f"... {2 * peers - links.PEERS_SHOWN} more peers not shown" in text.stdout.decode()
    assert f"{2 * peers - links.PEERS_LISTED} are fitted, their requests marked, but listed nowhere" \
        in text.stdout.decode()
    assert len(lines) < 100
    wider = _cli("summarize", path, "--links", "--limit", "0")  # all that are listed, and still the line
    assert wider.returncode == 0 and f"... {2 * peers - links.PEERS_LISTED} more peers" in wider.stdout.decode()
    model = json.loads(_cli("summarize", path, "--links", "--json").stdout)
    assert (model["peer_count"], len(model["peers"]), model["peers_not_listed"]) == (
        2 * peers, links.PEERS_LISTED, 2 * peers - links.PEERS_LISTED)
    # every request was marked by its peer's fit, listed or not (each peer's calls are all of one size per port)
    assert sum(kind["count"] for kind in model["requests"].values()) == 6 * peers


def _calls_of(calls: int, keys_per_call: int, distinct_keys: int):
    """`calls` engine calls to one peer, each shared by `keys_per_call` requests' sends (200-character keys drawn
    from `distinct_keys`), fed to the link model's call table."""
    table = links._Calls()
    attributes = {sc.SERVER_ADDRESS: "10.0.0.1", sc.SERVER_PORT: 15000, sc.BYTES: 4096, sc.DESCRIPTOR_COUNT: 1}
    for call in range(calls):
        start = T0 + call * 10 * MS
        for share in range(keys_per_call):
            key = f"{(call * keys_per_call + share) % distinct_keys:0200d}"
            table.add(Span(sc.SPAN_SEND, "0" * 32, f"{call * keys_per_call + share + 1:016x}", None, "CLIENT", start,
                           start + MS, attributes={**attributes, sc.REQUEST_KEY: key}))
    return table


def _traced(build):
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = build()
        gc.collect()
        return kept, tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def test_memory_follows_calls_not_the_keys_they_repeat():
    """2,000 calls shared by 64 requests each, from 640 keys: the keys are kept once, a call's share is numbers."""
    calls, held = _traced(lambda: _calls_of(2_000, 64, 640))
    keys_bytes = 640 * 300  # 640 strings of 200 characters, once each
    per_call = (held - keys_bytes) / 2_000
    assert per_call <= 64 * 8 + 300, per_call  # two 4-byte numbers per shared key, and the call itself
    assert len(calls.seconds) == 2_000 and len(calls.keys) == 640 and calls.keys_left_out == 0


def test_request_keys_past_the_bound_are_counted_not_kept(monkeypatch):
    """More distinct keys than the model keeps (its bound lowered to 5,000 here, to feed few spans): the first
    ones are kept and named, the rest counted; memory follows the bound, not the keys."""
    monkeypatch.setattr(links, "MAX_KEYS", 5_000)
    calls, held = _traced(lambda: _calls_of(500, 64, 1 << 30))  # 32,000 distinct 200-character keys
    assert len(calls.keys) == 5_000 and calls.keys_left_out == 32_000 - 5_000
    assert held <= 5_000 * 320 + 500 * (64 * 8 + 300)
