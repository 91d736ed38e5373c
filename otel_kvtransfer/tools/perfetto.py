"""Chrome trace-event JSON from span files, for the Perfetto UI (ui.perfetto.dev) and chrome://tracing.

Processes are the engines/ranks that emitted the spans (one per resource: service name, instance id, pid); threads
are lanes: ``requests``, ``compute``, ``tail``, one per transfer destination, ``receive`` / ``serve``. Every span
becomes one complete event (``ph: "X"``) with ``ts`` and ``dur`` in microseconds, measured from the earliest span
(``otherData.origin_unix_nano``), so durations are the span durations to the nanosecond. The trace-event format
wants the events of one thread to nest, and concurrent requests overlap, so each lane is packed (`lanes.pack`, as
the timeline packs its rows) into as many threads as it needs (``dest 0 · 2``).

A request whose tail is known (`Request.tail_mark`) gets a slice of its own in the ``tail`` lane of its process,
from the end of its last compute to its last byte (0 long when the last byte left before compute ended), named
``tail X ms (queued Y ms)`` with the figures in its args. Spans of several processes share one time axis; clocks
of different hosts may disagree (the note in ``otherData`` says so).

    otel-kvtransfer timeline spans.jsonl --perfetto trace.json   # then open trace.json in ui.perfetto.dev
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Tuple

from otel_kvtransfer import semconv as sc
from otel_kvtransfer.tools.lanes import pack
from otel_kvtransfer.tools.requests import PEER_SPANS, TailMark, engine_label
from otel_kvtransfer.tools.spanfile import Span
from otel_kvtransfer.tools.text import fmt_ms

__all__ = ["trace_events", "lane_of", "request_spans", "tail_marks", "TAIL_LANE"]

TAIL_LANE = "tail"
_TAIL_SORT = (1, 1)  # after compute, before the destinations


class TailSlice(NamedTuple):
    """A request's tail as the trace shows it: packed like a span (start/end), drawn in its process's tail lane."""

    start_time_unix_nano: int
    end_time_unix_nano: int
    resource: dict
    trace_id: str
    key: Optional[str]
    mark: TailMark


def lane_of(span: Span) -> tuple:
    """(sort key, lane name) of a span."""
    if span.name == sc.SPAN_REQUEST:
        return (0, 0), "requests"
    if span.name == sc.SPAN_COMPUTE:
        return (1, 0), "compute"
    if span.name == sc.SPAN_SEND:
        dest = span.attr(sc.DESTINATION_INDEX)
        peer, port = span.attr(sc.SERVER_ADDRESS), span.attr(sc.SERVER_PORT)
        where = f" {peer}:{port}" if peer is not None and port is not None else ""
        if dest is not None:
            return (2, dest), f"dest {dest}{where}"
        return (2, 1 << 64), f"send{where}"
    if span.name in PEER_SPANS:
        return (3, 0), span.name.rsplit(".", 1)[-1]
    return (4, 0), span.name


def _event_name(span: Span) -> str:
    chunk = span.attr(sc.CHUNK_INDEX)
    if span.name == sc.SPAN_SEND:
        payload = span.attr(sc.PAYLOAD) or "send"
        return f"{payload} chunk {chunk}" if chunk is not None else str(payload)
    if span.name == sc.SPAN_COMPUTE:
        return f"compute chunk {chunk}" if chunk is not None else "compute"
    key = span.attr(sc.REQUEST_KEY, span.attr(sc.BOOTSTRAP_ROOM))
    if key is not None:
        return f"{span.name.rsplit('.', 1)[-1]} {key}"
    return span.name


def _process_key(resource: dict) -> tuple:
    return tuple(sorted((str(k), str(v)) for k, v in resource.items()))


def request_spans(requests) -> list:
    """The spans of `requests` (children attached), each once: request spans, sends, computes, peers."""
    out = {}
    for request in requests:
        for span in ([request.span] if request.span else []) + request.sends + request.computes + request.peers:
            out[(span.trace_id, span.span_id)] = span
    return list(out.values())


def tail_marks(requests) -> list:
    """The tail slices of `requests` (children attached) whose tail is known, in their initiator's process."""
    out = []
    for request in requests:
        mark = request.tail_mark()
        if mark is None:
            continue
        owner = request.span or request.sends[0]
        end = max(mark.last_byte_ns, mark.compute_end_ns)
        out.append(TailSlice(mark.compute_end_ns, end, owner.resource, owner.trace_id, request.key, mark))
    return out


def trace_events(spans: Iterable[Span], origin_ns: Optional[int] = None, tails: Iterable[TailSlice] = (),
                 not_drawn: int = 0) -> dict:
    """The trace-event JSON object for `spans`, and the `tails` (`tail_marks`) in lanes of their own;
    `not_drawn` (children of very large requests left out, `--max-sends-per-request`) is said in `otherData`."""
    spans = sorted(spans, key=lambda s: (s.start_time_unix_nano, -s.end_time_unix_nano))
    if origin_ns is None:
        origin_ns = min((s.start_time_unix_nano for s in spans), default=0)

    tails = sorted(tails, key=lambda t: (t.start_time_unix_nano, t.end_time_unix_nano))
    pid_of, events = _processes([*spans, *tails])
    span: Any  # a Span or a TailSlice

    # Lanes, each packed into non-overlapping tracks (threads).
    lanes: Dict[tuple, List[Any]] = {}
    for span in spans:
        sort_key, lane = lane_of(span)
        lanes.setdefault((pid_of[_process_key(span.resource)], sort_key, lane), []).append(span)
    for tail in tails:
        lanes.setdefault((pid_of[_process_key(tail.resource)], _TAIL_SORT, TAIL_LANE), []).append(tail)
    next_tid: Dict[int, int] = {}
    for (pid, _sort_key, lane), members in sorted(lanes.items(), key=lambda kv: kv[0][:2]):
        rows = pack(members, lambda s: s.start_time_unix_nano, lambda s: s.end_time_unix_nano)
        first = next_tid.get(pid, 1)
        next_tid[pid] = first + max(rows, default=0) + 1
        for number in range(max(rows, default=0) + 1):
            name = lane if number == 0 else f"{lane} · {number + 1}"
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": first + number,
                           "args": {"name": name}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": first + number,
                           "args": {"sort_index": first + number}})
        for span, row in zip(members, rows):
            make = _tail_event if isinstance(span, TailSlice) else _event
            events.append(make(span, pid, first + row, origin_ns))
    other = {"origin_unix_nano": origin_ns, "generator": "otel_kvtransfer",
             "note": "ts/dur in microseconds after origin_unix_nano; spans of different processes share "
                     "this axis, and clocks of different hosts may disagree"}
    if not_drawn:
        other["spans_not_drawn"] = not_drawn
        other["spans_not_drawn_note"] = ("of requests with more sends or computes than --max-sends-per-request, "
                                         "only the first by start are here")
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def _processes(spans: List[Any]) -> Tuple[Dict[Tuple[Any, ...], int], List[dict]]:
    """(process key -> pid, the processes' metadata events): one process per resource; the OS pid when it is
    unique, else a small number."""
    resources: Dict[Tuple[Any, ...], dict] = {}
    for span in spans:
        resources.setdefault(_process_key(span.resource), span.resource)
    os_pids = [r.get("process.pid") for r in resources.values()]
    use_os_pid = all(isinstance(p, int) and 0 < p < 1 << 31 for p in os_pids) and len(set(os_pids)) == len(os_pids)
    pid_of, events = {}, []
    for index, (key, resource) in enumerate(sorted(resources.items(), key=lambda kv: engine_label(kv[1]))):
        pid = resource["process.pid"] if use_os_pid else index + 1
        pid_of[key] = pid
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"name": engine_label(resource)}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"sort_index": index}})
    return pid_of, events


def _event(span: Span, pid: int, tid: int, origin_ns: int) -> dict:
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
        "tid": tid,
        "args": args,
    }
    if span.is_error:
        event["cname"] = "terrible"
    return event


def _tail_event(tail: TailSlice, pid: int, tid: int, origin_ns: int) -> dict:
    mark = tail.mark
    name = (f"tail {fmt_ms(mark.tail_s)} (queued {fmt_ms(mark.tail_queued_s)})" if mark.tail_s > 0
            else "tail 0 (last byte before compute end)")
    return {
        "name": name,
        "cat": TAIL_LANE,
        "ph": "X",
        "ts": (tail.start_time_unix_nano - origin_ns) / 1000.0,
        "dur": (tail.end_time_unix_nano - tail.start_time_unix_nano) / 1000.0,
        "pid": pid,
        "tid": tid,
        "args": {sc.REQUEST_KEY: tail.key, "trace_id": tail.trace_id, sc.TAIL_S: mark.tail_s,
                 sc.TAIL_BUSY_S: mark.tail_busy_s, sc.TAIL_QUEUED_S: mark.tail_queued_s,
                 "compute_end_unix_nano": mark.compute_end_ns, "last_byte_unix_nano": mark.last_byte_ns},
    }
