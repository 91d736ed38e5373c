"""Request keys come from clients (a vLLM NIXL key is the client's `kv_transfer_params.remote_request_id`) and peer
names from the peers themselves: every WARNING line the builder writes about them (a late completion, a late
arrival at an ended peer wait, a stuck item, one by one or in a scan's summary) is one bounded line with control
and format characters escaped, so no value can forge a line of its own or drive the terminal that shows the log.

No engine: the SpanBuilder is fed records (tests/building/test_builder.py's harness) and the stuck reporter is given
items; tests/engines/test_nixl_peer_names.py does the same with a real NIXL peer whose agent name holds a newline.
"""

import pytest
from support.logs import warnings_logged
from test_builder import Harness, begin_peer, begin_request, call, end_peer, end_request, info, send

from otel_kvtransfer import semconv
from otel_kvtransfer.building.printable import one_line, printable
from otel_kvtransfer.building.stuck import MAX_LINES, StuckReporter
from otel_kvtransfer.recording import records as r
from otel_kvtransfer.recording.clock import now_ns

# Each forged value, and what its hostile part must read as in the line.
FORGED = {
    "newline": ("k1\n2026-01-01 00:00:00,000 CRITICAL root: disk full, shutting down", "k1\\x0a2026-01-01"),
    "escapes": ("k2\x1b[2J\x1b]0;owned\x07\x1b[31m", "k2\\x1b[2J\\x1b]0;owned\\x07\\x1b[31m"),
    "separators": ("k3\u2028CRITICAL\u2029x", "k3\\u2028CRITICAL\\u2029x"),
    "bidi": ("k4\u202egnp.exe\u2066x\u2069\u200f", "k4\\u202egnp.exe\\u2066x\\u2069\\u200f"),
    "other": ("k5\r\x00\x7f\x85\u200b\ufeff\U000e0041", "k5\\x0d\\x00\\x7f\\x85\\u200b\\ufeff\\U000e0041"),
}
LONG = "k6" + "\n" * 5 + "y" * 100_000


def _assert_one_safe_line(line: str) -> None:
    assert len(line.splitlines()) == 1 and line.isprintable(), repr(line[:300])
    assert len(line) < 1_000  # values are bounded: a 100 KB key is a few hundred characters of line


def test_the_one_escaping_rule():
    for value, shown in FORGED.values():
        assert printable(value).startswith(shown) and printable(value).isprintable()
    assert printable("plain key 42 ünïcödé 中文") == "plain key 42 ünïcödé 中文"  # printable text is left alone
    cut = one_line(LONG)
    assert cut.isprintable() and cut.startswith("k6\\x0a\\x0a") and cut.endswith(f"... ({len(LONG)} characters)")
    assert one_line(b"agent\nname") == "b'agent\\nname'"  # bytes as Python shows them: already one line


@pytest.mark.parametrize("case", sorted(FORGED) + ["long"])
def test_a_late_completion_line_escapes_the_key_and_the_peer(case):
    key, shown = FORGED[case] if case != "long" else (LONG, "k6\\x0a\\x0a")
    h = Harness()
    peer = f"{key}:4242"  # the test engine's peers are host:port
    h.feed(begin_request(key, 0), send(info(key, 0), [call(1_000, 2_000, 100, peer=peer)]), end_request(key, 5_000))
    with warnings_logged() as lines:
        h.feed(send(info(key, 1), [call(3_000, 9_000, 100, peer=peer)]))
    (line,) = lines
    _assert_one_safe_line(line)
    assert f"request {shown}" in line and f"to {shown}" in line and "completed 0.000 s after" in line


@pytest.mark.parametrize("case", sorted(FORGED) + ["long"])
@pytest.mark.parametrize("exported", [False, True], ids=["held", "exported"])
def test_a_late_arrival_line_escapes_the_key(case, exported):
    key, shown = FORGED[case] if case != "long" else (LONG, "k6\\x0a\\x0a")
    h = Harness(late_watch_s=30.0)
    end = now_ns()
    h.feed(begin_peer(key, end - 10**9, name=semconv.SPAN_SERVE, role=semconv.ROLE_PREFILL),
           end_peer(key, end, error="expired"))
    if exported:
        h.builder.release_held()  # its span left: the arrival is said in the log only
    arrival = tuple({r.KIND: r.LATE_ARRIVAL, r.KEY: key, r.TIME: end + 1_000, r.LATE_BACKEND: "eng\n\x1b[2J"}[i]
                    for i in range(4))
    with warnings_logged() as lines:
        h.feed(arrival)
    (line,) = lines
    _assert_one_safe_line(line)
    assert f"request {shown}" in line and line.startswith("otel_kvtransfer: eng\\x0a\\x1b[2J KV of request")
    assert ("exported already" in line) is exported


def test_stuck_lines_and_their_summary_escape_keys_and_peers():
    reporter = StuckReporter()
    values = [value for value, _ in FORGED.values()] + [LONG]
    items = [(semconv.INFLIGHT_SEND, value, value, 100, 31.0, "eng", "prefill", None) for value in values]
    items += [(semconv.INFLIGHT_SEND, "k7", peer, 100, 31.0, "eng", "prefill", None) for peer in values]
    with warnings_logged() as lines:
        reporter.report(items)
    assert len(lines) == MAX_LINES + 1  # a few one by one, the rest in the scan's summary line
    for line in lines:
        _assert_one_safe_line(line)
    for _value, shown in list(FORGED.values())[:MAX_LINES]:
        assert any(f"request key {shown}" in line and f"peer {shown}" in line for line in lines[:MAX_LINES])
    summary = lines[-1]
    assert f"{len(items) - MAX_LINES} more than the lines above" in summary
    assert "send to k1\\x0a2026-01-01" in summary and "send to k6\\x0a" in summary
