"""The sglang fixes that need no server: on sglang 0.5.23's real classes and methods, in-process.

- every method the package patches is really ours after instrument() and the very original after uninstrument()
  (sglang's functools.wraps-decorated `Scheduler.run_batch` included);
- staging back-pressure: sglang's real `MooncakeKVManager._do_staging_transfer` answering (-1, True) (buffer not
  ready, chunk re-queued) is no failed send and no failed request. Its staging strategy is a stand-in (the real
  one needs device staging buffers and a decode side with another TP size, which this CPU machine cannot run);
  the method under test, the queue and the chunk are sglang's own;
- warm-up / health requests (sglang's fake bootstrap host) make no compute record, whatever their room;
- with no OTEL_* exporter and no SDK, the sglang plugin says so in ONE line, with how to send the spans.
The end-to-end paths (aux over TCP, compute on a real server) are in test_sglang_serving.py and
test_sglang_shapes.py.
"""

import importlib.util
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from support import version_canary
from support.parts import require_part
from support.paths import ROOT

from otel_kvtransfer import integration


def _require_sglang():
    require_part(importlib.util.find_spec("sglang") is not None, "sglang 0.5.23 (bash scripts/setup.sh)")


# (module, class, attribute) of every patch: the canary's written-out list (version_canary.py), so a silently
# skipped one fails here and a renamed one there.
PATCHED = [(t.module, t.cls, t.method) for t in version_canary.SGLANG_TARGETS if t.method]

# Run apart: importing sglang's scheduler needs the CPU engine switch and the import-only sgl_kernel stand-in.
PATCH_CHECK = r"""
import importlib, json, os, sys
from opentelemetry.sdk.trace import TracerProvider
from otel_kvtransfer.wiring.instrumentor import KVTransferInstrumentor
from otel_kvtransfer.recording.patching import is_ours
targets = json.loads(sys.argv[1])
owners = [(getattr(importlib.import_module(m), c), a) for m, c, a in targets]
before = [o.__dict__.get(a) for o, a in owners]
had_wrapped = {f"{o.__name__}.{a}": hasattr(e, "__wrapped__") for (o, a), e in zip(owners, before)}
KVTransferInstrumentor().instrument(tracer_provider=TracerProvider())
wrapped = [is_ours(o.__dict__.get(a)) for o, a in owners]
KVTransferInstrumentor().uninstrument()
restored = [o.__dict__.get(a) is e for (o, a), e in zip(owners, before)]
print("RESULT " + json.dumps({"wrapped": wrapped, "restored": restored, "had_wrapped": had_wrapped}))
"""


def test_every_patched_method_is_wrapped_by_us_and_restored_on_the_real_classes():
    _require_sglang()
    import json

    stand_ins = os.path.join(ROOT, "tests", "sglang_serving", "pythonpath")
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "OTEL_TRACES_EXPORTER": "none",
           "PYTHONPATH": os.pathsep.join([stand_ins, ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", PATCH_CHECK, json.dumps(PATCHED)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    names = [f"{c}.{a}" for _, c, a in PATCHED]
    assert [n for n, ok in zip(names, result["wrapped"]) if not ok] == []
    assert [n for n, ok in zip(names, result["restored"]) if not ok] == []
    # the case the old "has __wrapped__" check got wrong: sglang's own decorator, before we touch it
    assert result["had_wrapped"]["Scheduler.run_batch"] is True


def _deferring_staging(mooncake_conn):
    """A real MooncakeKVManager (without an engine) whose staging buffer is never ready, and a room open on it."""
    manager = object.__new__(mooncake_conn.MooncakeKVManager)
    manager.transfer_infos = {}
    manager._staging_ctx = type("StagingCtx", (), {"watermark_cv": threading.Condition()})()

    class NeverReady:  # stand-in for PrefillStagingStrategy: check_ready as the real one answers "not yet"
        calls = 0

        def check_ready(self, req, page_start, num_pages):
            NeverReady.calls += 1
            return False, 0, 0, None, None

    return manager, NeverReady()


def test_staging_back_pressure_is_not_a_failed_send(telemetry):
    _require_sglang()
    from sglang.srt.disaggregation.common.utils import FastQueue, TransferKVChunk
    from sglang.srt.disaggregation.mooncake import conn as mooncake_conn

    room = 424242
    manager, strategy = _deferring_staging(mooncake_conn)
    integration.begin_request(room, backend="mooncake", framework="sglang")
    queue = FastQueue()
    chunk = TransferKVChunk(room=room, prefill_kv_indices=np.arange(4, dtype=np.int32), index_slice=slice(0, 4),
                            is_last_chunk=True, prefill_aux_index=0, state_indices=None)
    queue.put(chunk)
    got = queue.get()  # the worker's dequeue: this thread's current chunk
    req = type("TransferInfo", (), {"mooncake_session_id": "127.0.0.1:1", "room": room})()
    result = manager._do_staging_transfer(strategy, got, req, None, None, None, queue)
    assert result == (-1, True) and strategy.calls == 1
    assert queue.get() is chunk  # sglang re-queued it
    integration.end_request(room)
    spans = telemetry.spans()
    assert not [s for s in spans if s.name == "kv_transfer.send"]  # nothing moved, nothing failed
    (request,) = [s for s in spans if s.name == "kv_transfer.request"]
    assert request.status.is_ok and "error.type" not in request.attributes


def test_warm_up_requests_make_no_compute_whatever_their_room(telemetry):
    _require_sglang()
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    from otel_kvtransfer.frameworks.sglang import prefill

    class Req:
        def __init__(self, room, host):
            self.bootstrap_room, self.bootstrap_host = room, host

    class Batch:
        # room 0 is a valid room for a real request too (the router draws rooms at random)
        reqs = [Req(0, FAKE_BOOTSTRAP_HOST), Req(7, "127.0.0.1")]

    integration.begin_request(0, backend="mooncake", framework="sglang", start_ns=1_000)
    integration.begin_request(7, backend="mooncake", framework="sglang", start_ns=1_000)
    prefill.record_batch_compute(Batch(), 2_000, 3_000)
    integration.end_request(0, end_ns=9_000)
    integration.end_request(7, end_ns=9_000)
    computes = [s for s in telemetry.spans() if s.name == "kv_transfer.compute"]
    assert [s.attributes["kv_transfer.request_key"] for s in computes] == ["7"]


NO_EXPORTER = r"""
import logging
from otel_kvtransfer.frameworks.sglang import plugin
plugin.activate()
plugin.activate()  # sglang's loader may call it again: still one line
"""


@pytest.mark.parametrize("exporter", [None, "console"])
def test_plugin_with_no_exporter_says_where_spans_go_in_one_line(exporter):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    if exporter:
        env["OTEL_TRACES_EXPORTER"] = exporter
        env["OTEL_METRICS_EXPORTER"] = "none"
        env["OTEL_LOGS_EXPORTER"] = "none"
    proc = subprocess.run([sys.executable, "-c", NO_EXPORTER], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if "go nowhere" in line]
    if exporter:
        assert lines == []
    else:
        assert len(lines) == 1
        assert "OTEL_TRACES_EXPORTER=otlp" in lines[0] and "OTEL_TRACES_EXPORTER=kvtransfer_file" in lines[0]
