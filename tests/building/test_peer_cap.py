"""OTEL_KVTRANSFER_MAX_PEERS above 2,000 holds: `kv_transfer.peer.throughput` keeps one series per peer up to the
setting (the other metrics' 2,000-series limit does not cut it short), then `other`, said once in the log. Under the
SDK pipeline the MeterProvider's own cardinality limit applies too, and a setting above it is said at start.

No engine: 2,500 distinct peers cannot be opened on one machine's loopback, so the calls are handed over the way an
engine module hands over the calls it timed (`integration.deliver` inside a transfer scope), naming the peers.
"""

import logging

import pytest
from support.telemetry import Telemetry

from otel_kvtransfer import config, semconv
from otel_kvtransfer import integration as kvt
from otel_kvtransfer.engines.mooncake import BACKEND
from otel_kvtransfer.recording import integration, records

PEERS = 2500
MiB = 1 << 20


def _send_to(peer: str, chunk: int, start: int) -> None:
    with kvt.transfer_scope(1, chunk_index=chunk, payload=semconv.PAYLOAD_KV):
        integration.deliver(records.call(start, start + 1_000_000, 2 * MiB, 1, semconv.OP_WRITE, peer, "tcp", 0,
                                         None, BACKEND))


def test_peer_series_follow_max_peers_above_two_thousand(monkeypatch, caplog):
    monkeypatch.setenv(config.MAX_PEERS, str(PEERS))
    caplog.set_level(logging.WARNING, logger="otel_kvtransfer")
    telemetry = Telemetry().instrument()
    try:
        kvt.begin_request(1, backend=BACKEND, framework="test", start_ns=1_000_000_000)
        for n in range(PEERS + 3):  # three peers past the cap
            _send_to(f"10.{n // 250}.{n % 250}.1:{7000 + n % 7}", n, 2_000_000_000 + n * 2_000_000)
        kvt.end_request(1, end_ns=20_000_000_000)
        points = telemetry.metrics()[semconv.METRIC_PEER_THROUGHPUT]
    finally:
        telemetry.uninstrument()
    labels = [dict(p.attributes) for p in points]
    assert not [a for a in labels if a.get("otel.metric.overflow")]
    named = [a for a in labels if a[semconv.SERVER_ADDRESS] != semconv.PEER_OTHER]
    assert len(named) == PEERS and len({(a[semconv.SERVER_ADDRESS], a[semconv.SERVER_PORT]) for a in named}) == PEERS
    (other,) = [p for p in points if dict(p.attributes)[semconv.SERVER_ADDRESS] == semconv.PEER_OTHER]
    assert other.count == 3
    assert sum(p.count for p in points) == PEERS + 3
    assert sum("OTEL_KVTRANSFER_MAX_PEERS" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("setting, said", [("2500", True), ("1999", False)])
def test_sdk_pipeline_says_when_its_cardinality_limit_is_below_the_setting(monkeypatch, caplog, setting, said):
    monkeypatch.setenv(config.MAX_PEERS, setting)
    monkeypatch.setenv(config.PIPELINE, "sdk")
    caplog.set_level(logging.WARNING, logger="otel_kvtransfer")
    telemetry = Telemetry().instrument()
    telemetry.uninstrument()
    lines = [r.getMessage() for r in caplog.records if "cardinality limit" in r.getMessage()]
    assert len(lines) == (1 if said else 0)
    if said:
        assert setting in lines[0] and "aggregation_cardinality_limit" in lines[0]
