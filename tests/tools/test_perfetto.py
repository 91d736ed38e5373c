"""`timeline --perfetto`: Chrome trace-event JSON that Perfetto and chrome://tracing load.

Checked against the trace-event format: complete events (ph X) with ts, dur, pid, tid; metadata events (ph M)
naming every process and thread; no two events of one thread overlap; each duration is its span's duration."""

import json
import numbers

import pytest
from support.span_files import demo_span_file, synthetic_records, write_jsonl
from test_timeline import overlapping_sends

from otel_kvtransfer import semconv as sc
from otel_kvtransfer.cli import main as cli_main
from otel_kvtransfer.tools.lanes import pack
from otel_kvtransfer.tools.perfetto import trace_events
from otel_kvtransfer.tools.spanfile import read_spans


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
    by_id = {e["args"]["span_id"]: e for e in complete if e["cat"] != "tail"}
    assert len(by_id) == len(spans)
    for span in spans:
        event = by_id[span.span_id]
        assert abs(event["dur"] * 1000 - span.duration_ns) < 0.5
        assert abs(event["ts"] * 1000 - (span.start_time_unix_nano - origin)) < 0.5
        assert event["args"]["span.name"] == span.name


def _perfetto(tmp_path, src, *extra):
    out = tmp_path / "trace.json"
    assert cli_main(["timeline", str(src), "--no-html", "--no-png", "--perfetto", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_demo_perfetto_json_validates(tmp_path):
    src = demo_span_file()
    data = _perfetto(tmp_path, src)
    complete = validate_trace_events(data)
    spans = [s for s in read_spans(src) if s.name.startswith("kv_transfer.")]
    _check_durations(spans, complete, data["otherData"]["origin_unix_nano"])
    names = {e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert all(any(str(s.resource.get("service.name")) in n for n in names) for s in spans)
    lanes = {e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"requests", "compute", "tail", "receive"} <= {lane.split(" · ")[0] for lane in lanes}
    # One tail slice per request, with the figures its request span states, in the request's own process.
    requests = {s.attributes[sc.REQUEST_KEY]: s for s in spans if s.name == sc.SPAN_REQUEST}
    tails = [e for e in complete if e["cat"] == "tail"]
    assert sorted(e["args"][sc.REQUEST_KEY] for e in tails) == sorted(requests)
    pid_of_span = {e["args"]["span_id"]: e["pid"] for e in complete if e["cat"] != "tail"}
    for event in tails:
        span = requests[event["args"][sc.REQUEST_KEY]]
        for key in (sc.TAIL_S, sc.TAIL_BUSY_S, sc.TAIL_QUEUED_S):
            assert event["args"][key] == span.attributes[key]
        assert event["pid"] == pid_of_span[span.span_id]
        if span.attributes[sc.TAIL_S] > 0:  # on the one clock of the request's process: exact to the ns
            assert event["args"]["last_byte_unix_nano"] - event["args"]["compute_end_unix_nano"] == \
                round(span.attributes[sc.TAIL_S] * 1e9)
    assert any(lane.startswith("dest 0") for lane in lanes) and any(lane.startswith("dest 1") for lane in lanes)


def test_overlapping_requests_get_their_own_threads(tmp_path):
    src = write_jsonl(tmp_path / "s.jsonl", synthetic_records(requests=30, fail_key="1003"))
    data = _perfetto(tmp_path, src)
    complete = validate_trace_events(data)
    _check_durations(read_spans(src), complete, data["otherData"]["origin_unix_nano"])
    failed = [e for e in complete if e["args"].get("status") == "ERROR"]
    assert failed and all(e.get("cname") == "terrible" for e in failed)
    assert {e["cat"] for e in complete if e["args"].get("span.name") == sc.SPAN_SEND} == {"kv", "aux"}


def test_five_thousand_overlapping_sends_pack_into_as_many_threads(tmp_path):
    spans = read_spans(write_jsonl(tmp_path / "o.jsonl", overlapping_sends(5000)))
    complete = validate_trace_events(trace_events(spans))
    assert len({e["tid"] for e in complete if e["args"]["span.name"] == sc.SPAN_SEND}) == 5000


def test_key_filter_limits_the_trace(tmp_path):
    data = _perfetto(tmp_path, write_jsonl(tmp_path / "s.jsonl", synthetic_records(requests=4)), "--key", "1001")
    complete = validate_trace_events(data)
    assert complete and {e["args"].get(sc.REQUEST_KEY) for e in complete} == {"1001"}


def test_pack_uses_the_fewest_rows_and_the_lowest_free_row():
    items = [(0, 10), (1, 3), (2, 4), (3, 5), (4, 6), (10, 11), (11, 12)]
    rows = pack(items, lambda i: i[0], lambda i: i[1])
    # Greatest overlap is 3 ([0,10), [2,4), [3,5) at t=3.5), so 3 rows; a freed row is reused lowest first.
    assert rows == [0, 1, 2, 1, 2, 0, 0]
    for row in set(rows):
        mine = sorted(i for i, r in zip(items, rows) if r == row)
        assert all(a[1] <= b[0] for a, b in zip(mine, mine[1:]))


def test_tail_slice_of_a_known_request(tmp_path):
    from test_summarize import MS, T, known_request

    data = _perfetto(tmp_path, write_jsonl(tmp_path / "k.jsonl", known_request()))
    complete = validate_trace_events(data)
    (tail,) = [e for e in complete if e["cat"] == "tail"]
    origin = data["otherData"]["origin_unix_nano"]
    # By hand: compute ends at 12 ms, the last byte leaves at 21 ms, [15, 20) ms moved nothing.
    assert tail["name"] == "tail 9.00 ms (queued 5.00 ms)"
    assert tail["ts"] == (T + 12 * MS - origin) / 1000 and tail["dur"] == 9000
    assert (tail["args"][sc.TAIL_S], tail["args"][sc.TAIL_BUSY_S], tail["args"][sc.TAIL_QUEUED_S]) == \
        pytest.approx((0.009, 0.004, 0.005), abs=1e-12)
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in data["traceEvents"] if e["name"] == "thread_name"}
    assert threads[(tail["pid"], tail["tid"])] == "tail"
    request = next(e for e in complete if e["args"].get("span.name") == sc.SPAN_REQUEST)
    assert tail["pid"] == request["pid"]  # the initiator's process, not the peer's
    assert "clocks of different hosts may disagree" in data["otherData"]["note"]


def test_no_tail_slice_without_compute(tmp_path):
    from test_summarize import known_request

    records = [r for r in known_request() if r["name"] != sc.SPAN_COMPUTE]
    complete = validate_trace_events(_perfetto(tmp_path, write_jsonl(tmp_path / "nc.jsonl", records)))
    assert complete and not [e for e in complete if e["cat"] == "tail"]
