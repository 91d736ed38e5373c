"""Chrome trace-event JSON from span files, for the Perfetto UI (ui.perfetto.dev) and chrome://tracing.

Processes are the engines/ranks that emitted the spans (one per resource: service name, instance id, pid);
threads are lanes: ``requests``, ``compute``, one per transfer destination, ``receive``. Every span becomes one
complete event (``ph: "X"``) with ``ts`` and ``dur`` in microseconds, measured from the earliest span of the
file (``otherData.origin_unix_nano``), so durations are the span durations to the nanosecond. The trace-event
format wants the events of one thread to nest, and concurrent requests overlap, so each lane is packed into as
many threads as it needs (``dest 0 · 2``): no two events of one thread overlap at all.

    otel-kvtransfer timeline spans.jsonl --perfetto trace.json   # then open trace.json in ui.perfetto.dev
"""

from __future__ import annotations

import json
from typing import Iterable, Optional, Sequence

from otel_kvtransfer import semconv as sc
from otel_kvtransfer.spanfile_reader import Span
from otel_kvtransfer.summarize import engine_label

__all__ = ["trace_events", "write_perfetto", "lane_of"]


def lane_of(span: Span) -> tuple:
    """(sort key, lane name) of a span."""
    if span.name == sc.SPAN_REQUEST:
        return (0, 0), "requests"
    if span.name == sc.SPAN_COMPUTE:
        return (1, 0), "compute"
    if span.name == sc.SPAN_SEND:
        dest = span.attr(sc.DESTINATION_INDEX)
        peer = span.attr(sc.SERVER_ADDRESS)
        port = span.attr(sc.SERVER_PORT)
        where = f" {peer}:{port}" if peer is not None and port is not None else ""
        if isinstance(dest, int) and not isinstance(dest, bool):
            return (2, dest), f"dest {dest}{where}"
        return (2, 1 << 30), f"send{where}"
    if span.name == sc.SPAN_RECEIVE:
        return (3, 0), "receive"
    return (4, 0), span.name


def _event_name(span: Span) -> str:
    room = span.attr(sc.BOOTSTRAP_ROOM)
    if span.name == sc.SPAN_SEND:
        payload = span.attr(sc.PAYLOAD) or "send"
        chunk = span.attr(sc.CHUNK_INDEX)
        return f"{payload} chunk {chunk}" if chunk is not None else str(payload)
    if span.name == sc.SPAN_COMPUTE:
        chunk = span.attr(sc.CHUNK_INDEX)
        return f"compute chunk {chunk}" if chunk is not None else "compute"
    if span.name in (sc.SPAN_REQUEST, sc.SPAN_RECEIVE) and room is not None:
        return f"{span.name.split('.')[-1]} room {room}"
    return span.name


def _process_key(resource: dict) -> tuple:
    return tuple(sorted((str(k), str(v)) for k, v in resource.items()))


def trace_events(spans: Iterable[Span], origin_ns: Optional[int] = None) -> dict:
    """The trace-event JSON object for `spans`."""
    spans = sorted(spans, key=lambda s: (s.start_time_unix_nano, -s.end_time_unix_nano))
    if origin_ns is None:
        origin_ns = min((s.start_time_unix_nano for s in spans), default=0)

    # Processes: one per resource; the OS pid when it is unique, else a small number.
    resources = {}
    for span in spans:
        resources.setdefault(_process_key(span.resource), span.resource)
    os_pids = [r.get("process.pid") for r in resources.values()]
    use_os_pid = all(isinstance(p, int) and p > 0 for p in os_pids) and len(set(os_pids)) == len(os_pids)
    pid_of = {}
    events = []
    for index, (key, resource) in enumerate(sorted(resources.items(), key=lambda kv: engine_label(kv[1]))):
        pid = resource["process.pid"] if use_os_pid else index + 1
        pid_of[key] = pid
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"name": engine_label(resource)}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"sort_index": index}})

    # Lanes, each packed into non-overlapping tracks (threads).
    tracks = {}  # (pid, lane sort key, lane name) -> list of track end times
    placed = []
    for span in spans:
        pid = pid_of[_process_key(span.resource)]
        sort_key, lane = lane_of(span)
        ends = tracks.setdefault((pid, sort_key, lane), [])
        for number, end in enumerate(ends):
            if end <= span.start_time_unix_nano:
                ends[number] = span.end_time_unix_nano
                break
        else:
            number = len(ends)
            ends.append(span.end_time_unix_nano)
        placed.append((span, pid, sort_key, lane, number))

    tid_of = {}
    per_pid = {}
    for (pid, sort_key, lane), ends in sorted(tracks.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        for number in range(len(ends)):
            tid = per_pid.get(pid, 0) + 1
            per_pid[pid] = tid
            tid_of[(pid, lane, number)] = tid
            name = lane if number == 0 else f"{lane} · {number + 1}"
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"sort_index": tid}})

    for span, pid, _sort_key, lane, number in placed:
        args = {str(k): v for k, v in span.attributes.items()}
        args.update({
            "span.name": span.name,
            "trace_id": span.trace_id,
            "span_id": span.span_id,
            "parent_span_id": span.parent_span_id,
            "status": span.status_code,
            "duration_ns": span.duration_ns,
            "start_time_unix_nano": span.start_time_unix_nano,
        })
        if span.status_description:
            args["status.description"] = span.status_description
        event = {
            "name": _event_name(span),
            "cat": str(span.attr(sc.PAYLOAD) or span.name),
            "ph": "X",
            "ts": (span.start_time_unix_nano - origin_ns) / 1000.0,
            "dur": span.duration_ns / 1000.0,
            "pid": pid,
            "tid": tid_of[(pid, lane, number)],
            "args": args,
        }
        if span.is_error:
            event["cname"] = "terrible"
        events.append(event)

    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"origin_unix_nano": origin_ns, "generator": "otel_kvtransfer",
                      "note": "ts/dur in microseconds after origin_unix_nano"},
    }


def write_perfetto(spans: Sequence[Span], path: str, origin_ns: Optional[int] = None) -> dict:
    data = trace_events(spans, origin_ns)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, separators=(",", ":"), default=str)
        handle.write("\n")
    return data
