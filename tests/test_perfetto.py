"""`timeline --perfetto`: Chrome trace-event JSON that Perfetto and chrome://tracing load.

Checked against the trace-event format: complete events (ph X) with ts, dur, pid, tid; metadata events (ph M)
naming every process and thread; no two events of one thread overlap; each duration is its span's duration."""

import json
import numbers

import pytest
from test_spanfile_reader import demo_span_file, synthetic_records, write_jsonl

from otel_kvtransfer import semconv as sc
from otel_kvtransfer.perfetto import trace_events
from otel_kvtransfer.report_cli import main as report_main
from otel_kvtransfer.spanfile_reader import read_spans


@pytest.fixture(scope="session")
def demo_spans():
    return demo_span_file()


def validate_trace_events(data: dict) -> list:
    """Assert `data` is valid trace-event JSON (object form); returns its complete events."""
    assert isinstance(data, dict) and isinstance(data["traceEvents"], list)
    assert data.get("displayTimeUnit", "ms") in ("ms", "ns")
    named_processes, named_threads, complete = set(), set(), []
    for event in data["traceEvents"]:
        assert isinstance(event, dict)
        assert event["ph"] in ("X", "M"), event
        assert isinstance(event["name"], str) and event["name"]
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int)
        if event["ph"] == "M":
            assert event["name"] in ("process_name", "thread_name", "process_sort_index", "thread_sort_index")
            assert isinstance(event["args"], dict)
            if event["name"] == "process_name":
                named_processes.add(event["pid"])
            if event["name"] == "thread_name":
                named_threads.add((event["pid"], event["tid"]))
            continue
        for key in ("ts", "dur"):
            assert isinstance(event[key], numbers.Real) and not isinstance(event[key], bool)
        assert event["ts"] >= 0 and event["dur"] >= 0
        assert isinstance(event.get("args", {}), dict)
        json.dumps(event["args"])  # plain JSON values only
        complete.append(event)
    for event in complete:
        assert event["pid"] in named_processes
        assert (event["pid"], event["tid"]) in named_threads
    # Events of one thread never overlap (so they nest trivially).
    by_thread = {}
    for event in complete:
        by_thread.setdefault((event["pid"], event["tid"]), []).append(event)
    for events in by_thread.values():
        events.sort(key=lambda e: e["ts"])
        for a, b in zip(events, events[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (a, b)
    return complete


def _check_durations(spans, complete, origin):
    by_id = {e["args"]["span_id"]: e for e in complete}
    assert len(by_id) == len(spans)
    for span in spans:
        event = by_id[span.span_id]
        assert abs(event["dur"] * 1000 - span.duration_ns) < 0.5
        assert abs(event["ts"] * 1000 - (span.start_time_unix_nano - origin)) < 0.5
        assert event["args"]["span.name"] == span.name


def test_demo_perfetto_json_validates(tmp_path, demo_spans):
    out = tmp_path / "trace.json"
    assert report_main(["timeline", demo_spans, "--no-html", "--no-png", "--perfetto", str(out)]) == 0
    data = json.loads(out.read_text())
    complete = validate_trace_events(data)
    spans = read_spans(demo_spans)
    _check_durations(spans, complete, data["otherData"]["origin_unix_nano"])
    # Processes = engines: the prefill engine and each decode engine; threads = lanes.
    names = {e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    services = {s.resource.get("service.name") for s in spans}
    assert all(any(str(svc) in n for n in names) for svc in services)
    lanes = {e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"requests", "compute", "receive"} <= {lane.split(" · ")[0] for lane in lanes}
    assert any(lane.startswith("dest 0") for lane in lanes) and any(lane.startswith("dest 1") for lane in lanes)


def test_overlapping_requests_get_their_own_threads(tmp_path):
    records = synthetic_records(requests=30, fail_room=1003)
    spans = read_spans(write_jsonl(tmp_path / "s.jsonl", records))
    data = trace_events(spans)
    complete = validate_trace_events(data)
    _check_durations(spans, complete, data["otherData"]["origin_unix_nano"])
    failed = [e for e in complete if e["args"]["status"] == "ERROR"]
    assert failed and all(e.get("cname") == "terrible" for e in failed)
    sends = [e for e in complete if e["args"]["span.name"] == sc.SPAN_SEND]
    assert {e["cat"] for e in sends} == {"kv", "aux"}


def test_room_filter_limits_the_trace(tmp_path):
    src = write_jsonl(tmp_path / "s.jsonl", synthetic_records(requests=4))
    out = tmp_path / "t.json"
    assert report_main(["timeline", src, "--no-html", "--no-png", "--room", "1001", "--perfetto", str(out)]) == 0
    complete = validate_trace_events(json.loads(out.read_text()))
    assert complete and {e["args"].get(sc.BOOTSTRAP_ROOM) for e in complete} <= {1001, None}
