"""Compute on the device's clock through sglang's real prefill classes and real Mooncake sends (sglang_device_run).

The device is a STAND-IN (no GPU here; tests/support/standin_cuda.py), and with it the forward: sglang's
`run_batch` on a GPU returns once the forward is enqueued, and the stand-in's work completes later than that
launch, as a GPU's does. The run_batch wrapper, the device clock, the recorder, the builder, the span file and the
offline tools are the package's own; the KV moves through sglang's Mooncake sender to a decode process that checks
every byte. So the compute spans, the request's overlap and tail, and what `summarize` and `timeline` make of the
span file are computed from the device's events, and each differs from what the launch times would give.
"""

import importlib.util
import json

import pytest
from support.parts import require_part

from otel_kvtransfer import semconv as sc
from otel_kvtransfer.building.aggregate import intersection_length, tail, union
from otel_kvtransfer.cli import main as cli_main

PROMISE_NS = 50_000  # the device clock's accuracy (recording/device_clock.py)
KERNEL_S = 0.05


def _run(folder, **cfg):
    ok = importlib.util.find_spec("sglang") is not None and importlib.util.find_spec("mooncake") is not None
    require_part(ok, "sglang 0.5.23 and mooncake-transfer-engine-non-cuda")
    from support import sglang_device_run

    result = sglang_device_run.run(str(folder), kernel_s=KERNEL_S, **cfg)
    for prefill in result["prefills"]:
        assert "error" not in prefill, prefill["error"]
    assert len(result["prefills"]) == cfg.get("prefills", 1), result
    (decode,) = result["decodes"]
    assert "error" not in decode, decode.get("error")
    assert decode["status"] == "Success"
    assert decode["verified"]["bad_pages"] == 0 and decode["verified"]["aux_ok"]
    return result


def _named(spans, name):
    return sorted((s for s in spans if s["name"] == name), key=lambda s: s["start"])


def _check_rank(prefill, overlap: bool) -> dict:
    """The compute spans are the device's intervals; the request's figures are computed from them and differ
    from the launch's. Returns the intervals and figures for more checks."""
    assert prefill["status"] == "Success"
    assert prefill["dropped"] == {}
    spans, batches = prefill["spans"], prefill["batches"]
    computes = _named(spans, sc.SPAN_COMPUTE)
    assert len(computes) == len(batches) == 3
    assert {s["attributes"][sc.COMPUTE_CLOCK] for s in computes} == {sc.CLOCK_DEVICE}
    assert prefill["clock"]["compute_records_device"] == 3 and prefill["clock"]["anchors"] >= 1
    for i, (span, batch) in enumerate(zip(computes, batches)):
        (launch_start, launch_end), kernel_start, done_at = batch["launch"], batch["kernel_start"], batch["done_at"]
        assert abs(span["end"] - done_at) <= PROMISE_NS  # when the forward's work ended
        assert span["end"] - kernel_start >= KERNEL_S * 1e9 - PROMISE_NS
        # The start: the batch's stream free (the previous forward done under overlap) and the launch begun.
        previous = batches[i - 1]["done_at"] if i and overlap else 0
        assert max(previous, launch_start) - PROMISE_NS <= span["start"] <= max(previous, launch_end) + PROMISE_NS

    request = _named(spans, sc.SPAN_REQUEST)[0]
    ra = request["attributes"]
    busy = union((s["start"], s["end"]) for s in _named(spans, sc.SPAN_SEND))
    device = union((s["start"], s["end"]) for s in computes)
    launch = union(tuple(b["launch"]) for b in batches)
    figures = {"overlap_device": intersection_length(busy, device), "overlap_launch": intersection_length(busy, launch),
               "tail_device": tail(busy, device)["tail_ns"], "tail_launch": tail(busy, launch)["tail_ns"],
               "device": device, "launch": launch, "request": request,
               "computes": [(s["start"], s["end"]) for s in computes]}
    assert ra[sc.COMPUTE_OVERLAP_S] == pytest.approx(figures["overlap_device"] / 1e9, abs=1e-9)
    assert ra[sc.TAIL_S] == pytest.approx(figures["tail_device"] / 1e9, abs=1e-9)
    # The last chunk leaves once the last forward has run: both tails end at the last byte, and the launch's
    # starts when the launch returned, at least a forward earlier than the work ended.
    assert figures["tail_device"] > 0
    assert figures["tail_launch"] - figures["tail_device"] == device[-1][1] - launch[-1][1]
    assert device[-1][1] - launch[-1][1] >= KERNEL_S * 1e9 - PROMISE_NS
    return figures


def test_overlap_scheduler_figures_come_from_the_device_events(tmp_path, capsys):
    result = _run(tmp_path, overlap=True)
    (prefill,) = result["prefills"]
    figures = _check_rank(prefill, overlap=True)
    # Under overlap each chunk's KV moves while the next forward runs: the device's intervals hold every such
    # send, the launches (which return at once) none.
    assert figures["overlap_launch"] == 0 < figures["overlap_device"]
    request = figures["request"]

    span_file = result["cfg"]["span_files"][0]
    assert cli_main(["summarize", span_file, "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["requests"]
    assert row["compute_spans"] == 3
    assert row["tail_s"] == pytest.approx(figures["tail_device"] / 1e9, abs=1e-9)
    assert row["compute_overlap_s"] == pytest.approx(figures["overlap_device"] / 1e9, abs=1e-9)
    assert row["tail_s"] != pytest.approx(figures["tail_launch"] / 1e9, abs=1e-6)

    trace = tmp_path / "trace.json"
    assert cli_main(["timeline", span_file, "--no-png", "--html", str(tmp_path / "t.html"),
                     "--perfetto", str(trace)]) == 0
    capsys.readouterr()
    data = json.loads(trace.read_text())
    origin = data["otherData"]["origin_unix_nano"]
    drawn = sorted((round(e["ts"] * 1000) + origin, round((e["ts"] + e["dur"]) * 1000) + origin)
                   for e in data["traceEvents"] if e.get("ph") == "X" and e.get("cat") == sc.SPAN_COMPUTE)
    assert len(drawn) == 3
    for (a, b), (s, e) in zip(drawn, figures["computes"]):
        assert abs(a - s) <= 1000 and abs(b - e) <= 1000  # microsecond floats in the trace format
    (tail_event,) = [e for e in data["traceEvents"] if e.get("cat") == "tail"]
    assert tail_event["args"]["compute_end_unix_nano"] == figures["device"][-1][1]
    assert tail_event["args"][sc.TAIL_S] == pytest.approx(figures["tail_device"] / 1e9, abs=1e-9)
    assert request["attributes"][sc.TAIL_S] == tail_event["args"][sc.TAIL_S]


def test_normal_loop_on_two_prefill_ranks_each_with_its_own_resolver(tmp_path):
    # TP2: one process per rank, each with its own device clock; the normal loop runs the forward on the
    # scheduler's own stream (no forward_stream), and still returns before the work is done.
    result = _run(tmp_path, overlap=False, prefills=2)
    for prefill in result["prefills"]:
        _check_rank(prefill, overlap=False)
    keys = {s["attributes"][sc.TP_RANK] for p in result["prefills"] for s in _named(p["spans"], sc.SPAN_COMPUTE)}
    assert keys == {0, 1}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_without_a_device_the_forward_keeps_the_hosts_times(monkeypatch, device):
    # "cuda" too: this machine's torch has no CUDA device, so nothing changes either.
    require_part(importlib.util.find_spec("sglang") is not None, "sglang 0.5.23")
    import time
    from types import SimpleNamespace

    from sglang.srt.managers.scheduler import Scheduler
    from support.telemetry import Telemetry

    from otel_kvtransfer import integration
    from otel_kvtransfer.recording import device_clock

    now_ns = time.time_ns  # what the wrapper reads around a forward on the host, as before
    inside = []

    def run_batch(self, batch):  # a CPU forward: it runs inside the call
        inside.append(now_ns())
        time.sleep(0.02)
        inside.append(now_ns())
        return "result"

    monkeypatch.setattr(Scheduler, "run_batch", run_batch)  # before instrument(): the wrapper wraps it
    telemetry = Telemetry().instrument()
    try:
        sched = Scheduler.__new__(Scheduler)  # the real class, without the model it would load
        sched.disaggregation_mode = SimpleNamespace(name="PREFILL")
        sched.device = device
        batch = SimpleNamespace(reqs=[SimpleNamespace(bootstrap_room=31)])
        integration.begin_request(31, backend="mooncake")
        before = now_ns()
        assert sched.run_batch(batch) == "result"
        after = now_ns()
        integration.end_request(31)
        (span,) = telemetry.spans(sc.SPAN_COMPUTE)
        assert span.attributes[sc.COMPUTE_CLOCK] == sc.CLOCK_HOST
        assert before <= span.start_time <= inside[0] and inside[1] <= span.end_time <= after
        assert device_clock.for_device(device) is None
        assert telemetry.dropped() == {}
    finally:
        telemetry.uninstrument()
