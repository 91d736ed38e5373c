"""OTEL_KVTRANSFER_BUILDER=process with the real Mooncake engine: an engine process (tests/apps/
builder_process_app.py) makes real writes to a receiver process on 127.0.0.1 while a helper process builds the
spans and metrics (its SDK from tests/apps/builder_process_setup.py). Asserted: the same spans and bytes as
in-process, flush semantics across the two processes, nothing lost uncounted when the helper dies, and the helper
ending with the engine."""

import json
import logging
import os
import subprocess
import sys

import pytest
from support.parts import mooncake_importable, require_part
from support.paths import APPS, ROOT  # ROOT: this checkout's package, in every process

from otel_kvtransfer import KVTransferInstrumentor, config, semconv
from otel_kvtransfer.offloading import wire
from otel_kvtransfer.tools.spanfile import read_spans

SIZE = 4096


def _run(tmp_path, *steps, cwd=None, **extra_env):
    require_part(mooncake_importable(), "the Mooncake engine")
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update({
        "OTEL_KVTRANSFER_BUILDER": "process",
        "OTEL_KVTRANSFER_HELPER_SETUP": "builder_process_setup:setup",
        "KVT_TEST_SPAN_FILE": str(tmp_path / "spans.jsonl"),
        "KVT_TEST_METRICS_DIR": str(metrics_dir),
        "MC_FORCE_TCP": "1",
        "MC_LOG_LEVEL": "ERROR",
        "PYTHONPATH": os.pathsep.join(p for p in [APPS, ROOT, env.get("PYTHONPATH", "")] if p),
    })
    env.update(extra_env)
    # In a session of its own: the app signals its own process group in some tests.
    result = subprocess.run([sys.executable, os.path.join(APPS, "builder_process_app.py"), *steps], env=env,
                            cwd=cwd, capture_output=True, text=True, timeout=240, check=False,
                            start_new_session=True)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    outcomes = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    totals = [json.loads(p.read_text()) for p in metrics_dir.iterdir()]
    return outcomes, totals, result.stderr


def _sends(tmp_path):
    path = tmp_path / "spans.jsonl"
    return [s for s in read_spans(str(path)) if s.name == semconv.SPAN_SEND] if path.exists() else []


def test_spans_built_by_the_helper_have_the_exact_bytes_and_flush_waits_for_them(tmp_path):
    outcomes, totals, _ = _run(tmp_path, "send:40", "flush", "send:10")
    assert outcomes[0]["helper"] is None  # nothing recorded yet: no helper
    assert outcomes[1]["return_codes"] == [0]
    assert outcomes[2]["helper"] not in (None, outcomes[0]["pid"])
    assert outcomes[2]["flushed"] is True
    sends = _sends(tmp_path)
    assert len(sends) == 50 and {s.attributes[semconv.BYTES] for s in sends} == {SIZE}
    # Each send sits under its own request, keyed by its room; the request spans carry the bytes.
    requests = [s for s in read_spans(str(tmp_path / "spans.jsonl")) if s.name == semconv.SPAN_REQUEST]
    assert sorted(int(r.attributes[semconv.REQUEST_KEY]) for r in requests) == list(range(1000, 1050))
    by_id = {r.span_id: r for r in requests}
    assert all(by_id[s.parent_span_id].attributes[semconv.REQUEST_KEY] == s.attributes[semconv.REQUEST_KEY]
               for s in sends)
    assert totals == [{"sizes": 50, "dropped": {}}]


def test_flush_returns_only_after_the_helper_exported(tmp_path):
    # After force_flush() returns True the helper's exporter has written every span: the file holds them while
    # the engine still runs (the app does nothing between the flush and the kill).
    outcomes, _, _ = _run(tmp_path, "send:25", "flush", "kill-helper")
    assert outcomes[2]["flushed"] is True
    assert len(_sends(tmp_path)) == 25  # the killed helper exported nothing after the flush


def test_a_helper_killed_between_frames_loses_nothing_and_a_fresh_one_takes_over(tmp_path):
    # Drains only when flushed: the 15 writes after the kill travel in one frame, which finds the helper dead
    # before any of it was written, and goes to a fresh one.
    outcomes, totals, _ = _run(tmp_path, "send:20", "flush", "kill-helper", "send:15", "flush", "send:5", "flush",
                               "local-drops", OTEL_KVTRANSFER_FLUSH_INTERVAL_MS="60000")
    killed = outcomes[3]["killed"]
    assert outcomes[4]["return_codes"] == [0] and outcomes[6]["return_codes"] == [0]  # the engine never noticed
    assert outcomes[5]["flushed"] is True and outcomes[7]["flushed"] is True
    assert outcomes[5]["helper"] not in (None, killed) and outcomes[7]["helper"] == outcomes[5]["helper"]
    assert len(_sends(tmp_path)) == 40
    assert totals == [{"sizes": 20, "dropped": {}}]  # the fresh helper's; the killed one wrote none
    assert outcomes[8]["local_drops"] == {}


def test_a_helper_killed_with_a_frame_it_never_read_counts_exactly_that_frame(tmp_path):
    # The helper is stopped, so the 15 writes' frame waits unread in its socket when it is killed.
    outcomes, totals, stderr = _run(tmp_path, "send:20", "flush", "stop-helper", "send:15", "drain", "kill-helper",
                                    "send:5", "flush", "local-drops", OTEL_KVTRANSFER_FLUSH_INTERVAL_MS="60000")
    assert outcomes[7]["return_codes"] == [0] and outcomes[8]["flushed"] is True
    assert outcomes[8]["helper"] not in (None, outcomes[6]["killed"])
    # The first helper built the 20 before it stopped, the fresh one the last 5; the frame the dead one never read
    # is counted by the fresh one: 15 requests of 3 records each (begin, send, end).
    assert len(_sends(tmp_path)) == 25
    assert totals == [{"sizes": 5, "dropped": {"builder_process": 45}}]
    assert outcomes[9]["local_drops"] == {}
    assert "counted as dropped (builder_process)" in stderr


def test_an_engine_holding_over_a_thousand_descriptors(tmp_path):
    # select() cannot watch a descriptor above 1,023; the link's pipe must still work there.
    outcomes, totals, _ = _run(tmp_path, "many-fds", "send:5", "flush")
    if outcomes[1]["highest_fd"] < 1024:
        pytest.skip("the descriptor limit here keeps descriptors below 1,024")
    assert outcomes[3]["flushed"] is True
    assert len(_sends(tmp_path)) == 5 and totals == [{"sizes": 5, "dropped": {}}]


def test_a_forked_child_starts_its_own_helper(tmp_path):
    outcomes, _, _ = _run(tmp_path, "send:3", "flush", "fork", "send:2", "flush")
    child = outcomes[3]["child"]
    assert child["rc"] == 0 and child["flushed"] is True
    assert child["helper"] not in (None, outcomes[2]["helper"])  # its own, not the parent's
    assert outcomes[5]["flushed"] is True and outcomes[5]["helper"] == outcomes[2]["helper"]  # the parent's is fine
    keys = sorted(int(s.attributes[semconv.REQUEST_KEY]) for s in _sends(tmp_path))
    assert keys == [1000, 1001, 1002, 1003, 1004, 1503]


def test_an_interrupted_helper_waits_for_its_engine(tmp_path):
    # Ctrl-C reaches the helper and the engine together; the helper keeps building until the engine is done.
    outcomes, totals, stderr = _run(tmp_path, "send:5", "flush", "interrupt-helper", "send:5", "flush")
    assert outcomes[3]["interrupted"] == outcomes[2]["helper"] == outcomes[5]["helper"]
    assert outcomes[5]["flushed"] is True
    assert len(_sends(tmp_path)) == 10 and totals == [{"sizes": 10, "dropped": {}}]
    assert "KeyboardInterrupt" not in stderr


def test_uninstrument_ends_the_helper(tmp_path):
    outcomes, totals, stderr = _run(tmp_path, "send:3", "flush", "send:4", "open", "uninstrument", "send:2")
    # uninstrument returned once the helper had exported and closed its end, not after its wait ran out ...
    assert "is still exporting" not in stderr, stderr[-2000:]
    # ... and the helper's process ends (the kernel marks it ended a moment after it closed its files)
    assert outcomes[5]["helper_exited"] is True
    # uninstrument delivered the 5 still queued; the writes after it are not recorded
    assert len(_sends(tmp_path)) == 8
    # The request still open at uninstrument was ended by the helper, as evicted, and counted.
    spans = read_spans(str(tmp_path / "spans.jsonl"))
    evicted = [s for s in spans if s.name == semconv.SPAN_REQUEST and s.attributes.get(semconv.REQUEST_KEY) == "1007"]
    assert len(evicted) == 1 and evicted[0].status_code == "ERROR"
    assert totals == [{"sizes": 8, "dropped": {"request_evicted": 1}}]


def test_a_helper_that_cannot_set_up_its_sdk_says_so_in_one_line_and_the_engine_goes_on(tmp_path):
    # Drains only on flush and uninstrument: no record but the requests' (no in-flight scan) is handed over.
    outcomes, totals, stderr = _run(tmp_path, "send:5", "flush", "send:2", "uninstrument", "local-drops",
                                    OTEL_KVTRANSFER_HELPER_SETUP="no_such_module:setup",
                                    OTEL_KVTRANSFER_FLUSH_INTERVAL_MS="60000")
    assert outcomes[1]["return_codes"] == [0] and outcomes[3]["return_codes"] == [0]
    assert outcomes[2]["flushed"] is False
    assert totals == [] and not _sends(tmp_path)
    # No helper could carry them: every record (7 requests x 3) is counted in the engine's own metrics, once.
    assert outcomes[5]["local_drops"] == {"builder_process": 21}
    said = [line for line in stderr.splitlines() if "could not set up the SDK" in line]
    assert said and all("No module named 'no_such_module'" in line for line in said)
    assert "Traceback" not in stderr
    assert "counted as dropped (builder_process)" in stderr


def test_prometheus_metrics_keep_the_builder_in_process(monkeypatch, caplog):
    # A Prometheus exporter serves this process's port: a helper could not serve it too.
    monkeypatch.setenv(config.BUILDER, "process")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "prometheus")
    instrumentor = KVTransferInstrumentor()
    with caplog.at_level(logging.WARNING, logger="otel_kvtransfer.wiring.instrumentor"):
        instrumentor.instrument()
    try:
        assert instrumentor._link is None
        assert any("OTEL_METRICS_EXPORTER includes prometheus" in r.getMessage() for r in caplog.records)
    finally:
        instrumentor.uninstrument()


def test_an_unknown_builder_value_is_one_warning_and_the_default(monkeypatch, caplog):
    monkeypatch.setenv(config.BUILDER, "elsewhere")
    with caplog.at_level(logging.WARNING, logger="otel_kvtransfer.config"):
        assert config.load().builder == config.Settings.builder
    assert len(caplog.records) == 1 and "OTEL_KVTRANSFER_BUILDER" in caplog.records[0].getMessage()


def test_contexts_travel_as_span_contexts_and_values_keep_their_types():
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

    from otel_kvtransfer.recording import records as r

    parent = SpanContext(0xABC, 0xDEF, True, TraceFlags(1), TraceState([("k", "v")]))
    context = trace.set_span_in_context(NonRecordingSpan(parent))
    numpy = pytest.importorskip("numpy")
    records = [r.raw_call((1, 2, [numpy.int64(7), 9], 2, "write", "p", None, 0, None, "mooncake", None), context),
               (r.BEGIN_REQUEST, 5, 10, "prefill", "mooncake", None, {"n": numpy.float32(1.5)}, None)]
    frame = wire.encode((wire.BATCH, records, {}), len(records), 7)
    assert wire.HEADER.unpack(frame[:wire.HEADER.size]) == (len(frame) - wire.HEADER.size, 2, 7)
    (kind, back, drops), unknown = wire.decode(frame[wire.HEADER.size:])
    assert (kind, drops, unknown) == (wire.BATCH, {}, ())
    carried = trace.get_current_span(back[0][r.RAW_CONTEXT]).get_span_context()
    assert (carried.trace_id, carried.span_id, carried.is_remote, int(carried.trace_flags)) == (0xABC, 0xDEF, True, 1)
    assert carried.trace_state.get("k") == "v"
    lengths = back[0][r.RAW_CALL_FIELDS][r.CALL_BYTES]
    assert lengths == [7, 9] and type(lengths[0]) is numpy.int64  # as the in-process builder would see it
    assert back[1][r.REQ_ATTRIBUTES] == {"n": 1.5}
    # What pickle cannot carry travels as a plain value instead of failing the whole frame; contexts still travel
    # as span contexts, and an empty one (a raw call with no span current) as None.
    odd = (r.BEGIN_REQUEST, 6, 10, "prefill", "mooncake", None, {"lock": __import__("threading").Lock()}, context)
    empty = (r.SEND, None, [], trace.set_span_in_context(trace.INVALID_SPAN), None, None)
    frame = wire.encode((wire.BATCH, [odd, empty], {}), 2, 8)
    back = wire.decode(frame[wire.HEADER.size:])[0][1]
    assert back[0][r.REQ_ATTRIBUTES]["lock"].startswith("<unlocked")
    assert trace.get_current_span(back[0][r.REQ_PARENT]).get_span_context().span_id == 0xDEF
    assert back[1][r.SEND_CONTEXT] is None


def test_a_process_that_never_transfers_starts_no_helper(tmp_path):
    """The once-a-second in-flight scan sends nothing while nothing is in flight: an engine's processes that
    never transfer (sglang's tokenizer, detokenizer, resource tracker) start no builder process."""
    import subprocess

    script = (
        "import os, time\n"
        "from otel_kvtransfer import KVTransferInstrumentor\n"
        "from otel_kvtransfer.recording.recorder import RECORDER\n"
        "KVTransferInstrumentor().instrument()\n"
        "deadline = time.monotonic() + 30\n"
        "while RECORDER.watcher.scans < 3 and time.monotonic() < deadline:  # three scans of nothing in flight\n"
        "    time.sleep(0.05)\n"
        "kids = [p for p in os.listdir('/proc') if p.isdigit() and os.path.exists(f'/proc/{p}/stat')\n"
        "        and open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[1] == str(os.getpid())]\n"
        "print('scans', RECORDER.watcher.scans, 'children', len(kids), RECORDER.pending())\n")
    env = dict(os.environ, OTEL_KVTRANSFER_BUILDER="process", OTEL_KVTRANSFER_FLUSH_INTERVAL_MS="100",
               OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60,
                         check=True)
    words = out.stdout.split()
    assert words[0] == "scans" and int(words[1]) >= 3, out.stdout + out.stderr[-2000:]
    assert words[2:] == ["children", "0", "0"], out.stdout + out.stderr[-2000:]
