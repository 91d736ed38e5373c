"""Mooncake 0.3.14, the CUDA 13 build (the only build of that release), for real: every write and read kind it has
(8-byte integer arrays, sync and async; pages x fields tables; scatter lists with their tickets; `nic_hint` on the
classic calls; the CUDA stream's calls) between two OS processes over TCP on 127.0.0.1, in a network namespace of
their own. The bytes are checked at the receiver (its whole buffer against a model of every copy made) and in the
spans (exact bytes, descriptors, op, NIC, and the observed ends of tickets and async batches), through both span
pipelines and the builder process; a user's script under `opentelemetry-instrument` exports one send per write.

They run in a virtualenv of their own: only `mooncake-transfer-engine-cuda13==0.3.14`, this package with `.[auto]`,
numpy and pytest (`bash scripts/setup-mooncake-cuda13.sh` builds it; KVT_MC14_PYTHON names its python). STAND-IN: the
CUDA driver. A CPU machine has none, so `libcuda.so.1` there is built at set-up with one function per driver call
the engine imports, each answering CUDA_ERROR_NO_DEVICE; the engine, its transport, the CUDA runtime library and
every byte moved are real. The `*_on_cuda` calls need a CUDA stream: here they fail as on a host without a GPU
(real), and their success path runs around a stand-in original on the real class (as the backend contract does).
With CI=true a missing virtualenv fails these tests instead of skipping them.
"""

import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from support import cuda13_venvs, netns
from support.instrumented_app import spans_when
from support.parts import require_part
from support.paths import APPS, ROOT, TESTS
from support.telemetry import in_memory_metrics
from support.waiting import wait_until

from otel_kvtransfer import semconv
from otel_kvtransfer.engines import mooncake

IN_MC14 = "KVT_IN_MC14"  # set when this file runs inside the 0.3.14 virtualenv
RUN_TIMEOUT_S = 300
DEAD_PORT = 1  # the apps' peer that is not there


def mc14_python() -> str:
    return cuda13_venvs.python_of(cuda13_venvs.MC14)


def mc14_ready(python: str) -> bool:
    return cuda13_venvs.ready(python, "import importlib.metadata as m, mooncake.engine, numpy, otel_kvtransfer, "
                                      "pytest, opentelemetry.distro\n"
                                      "assert m.version('mooncake-transfer-engine-cuda13') == '0.3.14'")


@pytest.fixture(scope="module")
def mc14():
    """(python, environment) of the 0.3.14 virtualenv: no OTEL_* of this process, the venv's library path, this
    checkout's package first."""
    python = mc14_python()
    require_part(mc14_ready(python), f"the Mooncake 0.3.14 (CUDA 13 build) virtualenv at {python} "
                                     "(run `bash scripts/setup-mooncake-cuda13.sh`, or set KVT_MC14_PYTHON)")
    netns.require_tools()
    return python, netns.with_pythonpath(cuda13_venvs.engine_env(python), APPS, ROOT)


def _in_mc14(mc14, test_name: str) -> None:
    """This file's test `test_name`, run by pytest inside the 0.3.14 virtualenv (no network: imports only)."""
    python, env = mc14
    done = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", test_name],
                          cwd=ROOT, env=dict(env, **{IN_MC14: "1"}), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-2000:]


def test_only_the_cuda_driver_is_a_stand_in(mc14):
    """The engine library loads the stand-in for libcuda.so.1 alone: the CUDA runtime is NVIDIA's own (its wheel),
    every other library the engine links is the system's or the wheel's, and the stand-in defines exactly the
    driver calls the package's libraries import."""
    require_part(all(shutil.which(tool) for tool in ("ldd", "nm")), "ldd and nm (binutils)")
    python, env = mc14
    engine = subprocess.run([python, "-c", "import mooncake.engine as m; print(m.__file__)"], env=env,
                            capture_output=True, text=True, timeout=120, check=True).stdout.strip()
    standin = os.path.join(os.path.dirname(os.path.dirname(python)), "standin-driver")
    linked = {}
    for line in subprocess.run(["ldd", engine], env=env, capture_output=True, text=True, timeout=60,
                               check=True).stdout.splitlines():
        name, _, where = line.strip().partition(" => ")
        linked[name] = where.split(" (")[0]
    assert "not found" not in " ".join(linked.values()), linked
    assert os.path.dirname(linked["libcuda.so.1"]) == standin
    assert linked["libcudart.so.13"].endswith(os.path.join("nvidia", "cu13", "lib", "libcudart.so.13"))
    assert [n for n, where in linked.items() if where.startswith(standin)] == ["libcuda.so.1"]

    def symbols(*options, path):
        out = subprocess.run(["nm", "-D", *options, path], capture_output=True, text=True, timeout=60,
                             check=True).stdout
        return {line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()}

    # every library of the package (the engine and the store and allocators it may load beside it)
    libraries = glob.glob(os.path.join(os.path.dirname(engine), "*.so"))
    imported = {s for library in libraries for s in symbols("--undefined-only", path=library)
                if re.match(r"^cu[A-Z]", s)}
    assert engine in libraries and len(imported) > 10
    assert symbols("--defined-only", path=os.path.join(standin, "libcuda.so.1")) == imported


# --- what the wrappers read, against the real 0.3.14 module ---------------------------------------------------------

_PROBE = r"""
import inspect, json, re, sys
import mooncake.engine as m
engine = m.TransferEngine
def parameters(method):
    doc = (method.__doc__ or "").splitlines()[0]
    inside = doc[doc.index("(") + 1:doc.rindex(")")]
    names = [re.split(r"[:=]", p.strip())[0].strip() for p in re.split(r",(?![^\[]*\])", inside)]
    return names[1:], doc.rsplit("->", 1)[1].strip()
calls = {}
for name in dir(engine):
    value = getattr(engine, name)
    if not name.startswith("_") and callable(value) and not isinstance(value, type):
        calls[name] = parameters(value)
ticket = m.ScatterTransferTicket
print(json.dumps({
    "calls": calls,
    "support_cuda": bool(m.SUPPORT_CUDA),
    "statuses": {k: int(v) for k, v in m.ScatterTransferCompletionStatus.__members__.items()},
    "ticket": {name: type(ticket.__dict__[name]).__name__ for name in ("drain", "status", "drained")},
    "drain": parameters(ticket.drain),
}))
"""


def _probe(mc14) -> dict:
    python, env = mc14
    done = subprocess.run([python, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_every_wrapped_call_has_the_signature_its_wrapper_reads(mc14):
    """The positions the wrappers read (the peer, the lengths or table, `nic_hint`), the calls' answers, the ticket's
    statuses, read from the real 0.3.14 engine's own signatures: the `*_on_cuda` calls, which cannot succeed here,
    are held to their signature this way. And no public call is left that is neither timed nor known quiet."""
    found = _probe(mc14)
    calls = found["calls"]
    classic = ("target_hostname", "buffer", "peer_buffer_address", "length")
    batch = ("target_hostname", "buffers", "peer_buffer_addresses", "lengths")
    for name, (_op, is_batch) in {**mooncake.SYNC_METHODS, **mooncake.ASYNC_METHODS,
                                  **mooncake.CUDA_STREAM_METHODS}.items():
        assert tuple(calls[name][0][:4]) == (batch if is_batch else classic), name
    for name in mooncake.ARRAY_METHODS:
        assert tuple(calls[name][0][:4]) == batch and calls[name][1] == "int", name
    for name in mooncake.PAGE_METHODS:
        assert tuple(calls[name][0][:5]) == ("target_hostname", "src_pages", "dst_pages", "fields", "max_batch_size")
    for name, at in mooncake.NIC_HINT_AT.items():
        assert calls[name][0].index("nic_hint") == at, name
    assert found["support_cuda"] and all(calls[name][1] == "None" for name in mooncake.CUDA_STREAM_METHODS)
    for name in mooncake.SCATTER_METHODS:
        parameters, answer = calls[name]
        assert parameters == ["endpoint", "local_base_addresses", "local_capacities", "remote_base_addresses",
                              "remote_capacities", "local_offsets", "remote_offsets", "lengths"], name
        assert len(parameters) == mooncake._SCATTER_ARGUMENTS and "nic_hint" not in parameters
        assert answer == "mooncake.engine.ScatterTransferTicket", name
    assert found["statuses"] == {"COMPLETED": mooncake.SCATTER_COMPLETED, "FAILED_DRAINED": mooncake.SCATTER_FAILED,
                                 "COMPLETION_UNKNOWN": mooncake.SCATTER_UNKNOWN}
    assert found["ticket"] == {"drain": "instancemethod", "status": "property", "drained": "property"}
    assert found["drain"][1] == "mooncake.engine.ScatterTransferCompletionStatus"
    assert len(calls["initialize"][0]) == 4 and len(calls["initialize_ext"][0]) == 5  # the device list: the 4th
    assert sorted(set(calls) - mooncake.timed_calls() - mooncake.QUIET_CALLS) == []
    assert mooncake.timed_calls() <= set(calls)  # every call timed is one 0.3.14 has


def test_the_backend_contract_holds_on_the_0_3_14_classes(mc14):
    """tests/project/test_backend_contract.py's Mooncake cases on 0.3.14's own classes (TransferEngine with every new
    call, ScatterTransferTicket's drain and properties): patched and restored exactly, answers and exceptions through
    unchanged, the wrappers' own failures counted."""
    python, env = mc14
    done = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           os.path.join(TESTS, "project", "test_backend_contract.py"), "-k", "mooncake"],
                          cwd=ROOT, env=dict(env, KVT_CONTRACT_IN_PROCESS="1"), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    passed = re.search(r"(\d+) passed", done.stdout)
    # the contract, the hot path's record, the declared builds: all of them ran there, none skipped
    assert passed and int(passed.group(1)) >= 3 and "skipped" not in done.stdout, done.stdout[-2000:]


def test_a_call_queued_on_a_cuda_stream_is_a_send_of_no_duration(mc14):
    """STAND-IN original: a `*_on_cuda` call succeeds only with a GPU (it queues the transfer on a CUDA stream).
    Around a stand-in that returns as the real call does once it has queued, on the real 0.3.14 class: the send is
    the moment it was queued, exact bytes and descriptors, its time inside the call as post_s, no speed claimed."""
    if not os.environ.get(IN_MC14):
        _in_mc14(mc14, "test_a_call_queued_on_a_cuda_stream_is_a_send_of_no_duration")
        return
    import time

    from mooncake.engine import TransferEngine
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from otel_kvtransfer import KVTransferInstrumentor

    names = ("transfer_write_on_cuda", "batch_transfer_read_on_cuda")
    originals = {name: TransferEngine.__dict__[name] for name in names}

    def queued(self, *args, **kwargs):  # what the real call does on a GPU: queue, return None
        time.sleep(0.002)

    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentor = KVTransferInstrumentor()
    try:
        for name in names:
            setattr(TransferEngine, name, queued)
        instrumentor.instrument(tracer_provider=provider, meter_provider=in_memory_metrics()[0])
        engine = object()  # never initialised: nothing binds, nothing is sent
        before = time.monotonic_ns()
        assert TransferEngine.transfer_write_on_cuda(engine, "127.0.0.1:7", 1, 2, 4096) is None
        assert TransferEngine.batch_transfer_read_on_cuda(engine, "127.0.0.1:7", [1, 2], [3, 4], [10, 20], 0, "",
                                                          "mlx5_3") is None
        provider.force_flush()
    finally:
        instrumentor.uninstrument()
        for name, entry in originals.items():
            setattr(TransferEngine, name, entry)
    assert all(TransferEngine.__dict__[name] is entry for name, entry in originals.items())
    write, read = exporter.get_finished_spans()
    for span, nbytes, descriptors, op in ((write, 4096, 1, "write"), (read, 30, 2, "read")):
        assert span.start_time == span.end_time >= before
        assert (span.attributes[semconv.BYTES], span.attributes[semconv.DESCRIPTOR_COUNT],
                span.attributes[semconv.OP]) == (nbytes, descriptors, op)
        assert span.attributes[semconv.POST_S] >= 0.002
        assert semconv.THROUGHPUT not in span.attributes and semconv.ERROR_TYPE not in span.attributes
    assert semconv.NIC not in write.attributes and read.attributes[semconv.NIC] == "mlx5_3"


# --- every kind, for real, between two processes ---------------------------------------------------------------------

def _run_app(mc14, tmp_path, mode: str, extra_env: dict) -> dict:
    python, env = mc14
    out = tmp_path / "out.json"
    done = netns.run([python, os.path.join(APPS, "mooncake_cuda13_app.py"), mode, str(out)],
                     dict(env, **extra_env), RUN_TIMEOUT_S, cwd=str(tmp_path))
    assert done.returncode == 0 and out.exists(), done.stderr[-4000:]
    return json.loads(out.read_text())


def _spans_by_parent(spans) -> dict:
    """Each call's sends, by its marker span: a raw send is the marker's child; a send in a transfer scope is its
    request's, and that request the marker's child."""
    by_parent = {}
    requests = {s["span_id"]: s["parent"] for s in spans if s["name"] == semconv.SPAN_REQUEST}
    for span in spans:
        if span["name"] == semconv.SPAN_SEND:
            by_parent.setdefault(requests.get(span["parent"], span["parent"]), []).append(span)
    return by_parent


def _check_every_kind(result: dict, spans: list) -> None:
    """Each call made exactly one send, with what the call moved; what arrived is what the copies made."""
    assert result["receiver_whole"] and result["sink_whole"]  # every byte where the model puts it, and no other
    written = sum(c["bytes"] for c in result["calls"] if c.get("ok") and c["op"] == "write")
    assert written > 8 << 20 and written * 0.98 < result["bytes_in_receiver"] <= written  # 1/256 of them are zeros
    assert result["configured_devices"] == ["lo", "eth0"]
    sends = _spans_by_parent(spans)
    kinds = [c["kind"] for c in result["calls"]]
    for kind in ("transfer_sync_write", "transfer_sync_write in a transfer scope",
                 "batch_transfer_sync_write_arrays", "batch_transfer_async_read_arrays",
                 "batch_transfer_sync_read_pages", "submit_scatter_read drain",
                 "scatter_transfer_sync_read_with_ticket", "submit_scatter_write drain(0) polls",
                 "submit_scatter_write refilled before drain", "transfer_read_on_cuda"):
        assert kind in kinds
    for call in result["calls"]:
        kind = call["kind"]
        found = sends.get(call["marker"], [])
        if kind == "submit_scatter_write dropped undrained":  # no end was ever seen: no send (counted as dropped)
            assert found == [], kind
            continue
        assert len(found) == 1, (kind, found)
        span = found[0]
        attrs = span["attributes"]
        assert attrs.get(semconv.REQUEST_KEY) == call.get("request_key"), kind
        assert (attrs[semconv.BYTES], attrs[semconv.DESCRIPTOR_COUNT], attrs[semconv.OP], attrs.get(semconv.NIC)) == (
            call["bytes"], call["descriptors"], call["op"], call["nic"]), kind
        assert attrs[semconv.ENGINE_CALLS] == 1 and attrs[semconv.BACKEND] == mooncake.BACKEND
        assert attrs[semconv.PROTOCOL] == "tcp"
        assert (attrs[semconv.SERVER_PORT] == DEAD_PORT) == kind.startswith("dead ")
        assert call["submitted"] <= span["start"] <= span["end"], kind
        failed = span["status"] == "ERROR"
        assert failed == (not call["ok"]), kind
        if call.get("raised"):
            assert attrs[semconv.ERROR_TYPE] == call["raised"]
        elif failed:
            assert attrs[semconv.ERROR_TYPE] == "transfer_failed" and attrs[semconv.RETURN_CODE] == -1, kind
        else:
            assert call["arrived"], kind
        if call.get("polls") is None:  # a sync call (a sync scatter's ticket had drained): its own interval
            assert span["end"] <= call["returned"], kind
            assert semconv.END_UNCERTAINTY_S not in attrs and semconv.POST_S not in attrs, kind
            continue
        # Ended when a poll saw the end: no later than the last poll, and the window it names reaches back at most
        # to the last poll that saw it running (or to the submission).
        assert span["end"] <= call["observed"], kind
        running = [before for before, status in call["polls"] if status in (0, "COMPLETION_UNKNOWN")]
        window_start = running[-1] if running else call["submitted"]
        assert 0 < attrs[semconv.END_UNCERTAINTY_S] * 1e9 <= call["observed"] - window_start, kind
        assert 0 < attrs[semconv.POST_S] * 1e9 <= call["returned"] - call["submitted"], kind
    polled = next(c for c in result["calls"] if c["kind"] == "submit_scatter_write drain(0) polls")
    assert len(polled["polls"]) >= 1


def _failures(points: list) -> dict:
    return {(p["attributes"].get(semconv.ERROR_TYPE), p["attributes"].get(semconv.NIC)): p["value"] for p in points}


# What failed, by (error.type, kv_transfer.nic): the dead peer's calls on the engine's one device or the NIC the
# caller named, and the CUDA stream's calls (no GPU here).
EXPECTED_FAILURES = {("transfer_failed", "lo"): 2, ("transfer_failed", "mlx5_dead"): 1, ("RuntimeError", "lo"): 2,
                     ("RuntimeError", "mlx5_cuda"): 1}


@pytest.mark.parametrize("pipeline", ("direct", "sdk"))
def test_every_write_and_read_kind_is_one_send_with_its_exact_bytes(mc14, tmp_path, pipeline):
    result = _run_app(mc14, tmp_path, "thread", {"OTEL_KVTRANSFER_PIPELINE": pipeline})
    _check_every_kind(result, result["spans"])
    points = result["metrics"]
    assert _failures(points[semconv.METRIC_FAILURES]) == EXPECTED_FAILURES
    sends = sum(1 for s in result["spans"] if s["name"] == semconv.SPAN_SEND)
    assert sum(p["value"] for p in points[semconv.METRIC_SIZE]) == sends
    posted = [c for c in result["calls"] if c.get("polls") is not None]
    assert sum(p["value"] for p in points[semconv.METRIC_POST_DURATION]) == len(posted)
    assert {p["attributes"][semconv.DROP_REASON]: p["value"] for p in points[semconv.METRIC_DROPPED]} == {
        "async_released": 1}  # the ticket dropped undrained


def test_the_builder_process_builds_the_same_sends_and_counts_failures_by_nic(mc14, tmp_path):
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    span_file = tmp_path / "spans.jsonl"
    result = _run_app(mc14, tmp_path, "process", {
        "OTEL_KVTRANSFER_BUILDER": "process", "OTEL_KVTRANSFER_HELPER_SETUP": "mooncake_cuda13_app:helper_setup",
        "KVT_TEST_SPAN_FILE": str(span_file), "KVT_TEST_METRICS_DIR": str(metrics_dir)})
    expected = sum(1 for c in result["calls"] if c["kind"] != "submit_scatter_write dropped undrained")
    read = spans_when(str(span_file), expected + 1)  # and the request span of the scoped call
    spans = [{"name": s.name, "span_id": s.span_id, "parent": s.parent_span_id, "start": s.start_time_unix_nano,
              "end": s.end_time_unix_nano, "status": s.status_code, "attributes": s.attributes} for s in read]
    _check_every_kind(result, spans)
    totals = wait_until(lambda: glob.glob(str(metrics_dir / "*.json")), 30, "the helper's metric totals at its exit")
    (points,) = [json.loads(open(path, encoding="utf-8").read()) for path in totals]
    assert _failures(points[semconv.METRIC_FAILURES]) == EXPECTED_FAILURES


def test_a_user_script_under_opentelemetry_instrument_exports_one_send_per_write(mc14, tmp_path):
    """The virtualenv holds only the CUDA 13 build and `.[auto]`: `opentelemetry-instrument` loads the
    instrumentation there (the build is one of `instruments-any`), and a script that knows nothing of OpenTelemetry,
    with OTEL_TRACES_EXPORTER=kvtransfer_file, gets one send per write call of every kind, with its bytes."""
    python, env = mc14
    user_env = {k: v for k, v in env.items() if k != "PYTHONPATH"}  # as a user runs it: the installed package
    span_file, out = tmp_path / "spans.jsonl", tmp_path / "out.json"
    user_env.update({"OTEL_TRACES_EXPORTER": "kvtransfer_file", "OTEL_KVTRANSFER_SPAN_FILE": str(span_file),
                     "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none"})
    instrument = os.path.join(os.path.dirname(python), "opentelemetry-instrument")
    done = netns.run([instrument, python, os.path.join(APPS, "mooncake_cuda13_user_app.py"), str(out)], user_env,
                     RUN_TIMEOUT_S, cwd=str(tmp_path))
    assert done.returncode == 0 and out.exists(), done.stderr[-4000:]
    calls = json.loads(out.read_text())
    assert len(calls) == 14 and len({c["bytes"] for c in calls}) == 14
    assert all(c["arrived"] for c in calls if not c["call"].endswith("_on_cuda"))
    sends = [s for s in spans_when(str(span_file), len(calls)) if s.name == semconv.SPAN_SEND]
    made = sorted((c["bytes"], c["descriptors"], c.get("raised")) for c in calls)
    exported = sorted((s.attributes[semconv.BYTES], s.attributes[semconv.DESCRIPTOR_COUNT],
                       s.attributes.get(semconv.ERROR_TYPE)) for s in sends)
    assert exported == made


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
