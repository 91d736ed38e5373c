"""A client's hostile rid on a real SGLang PD deployment loses nobody's telemetry.

sglang's /generate takes `rid` from the JSON body: the escaped `"\\ud800"` decodes to a lone surrogate, pydantic
keeps it, and the package puts it on the prefill's request span as `sglang.rid`. Here a real prefill + decode pair
(both under `opentelemetry-instrument`, the default direct pipeline, Mooncake over TCP, one private network
namespace: tests/sglang_serving/deployment.py) exports its spans with the real OTLP/HTTP exporter to a receiver in
the namespace that parses every request with opentelemetry-proto and answers 400 to what does not parse, as a
collector does (tests/support/otlp_http_sink.py), and to span files. Six normal requests and the hostile one are
sent at once, straight to both servers as sglang's router sends them (tests/support/pd_direct_client.py: the
router is a separate program with its own JSON parser; a client that reaches the servers sends any rid).

Expected: no OTLP request rejected; every normal request's spans arrive (prefill's request span with its rid and
its sends, decode's receive); and where the servers admit the hostile request, its span carries its rid repaired
(U+FFFD), over OTLP and in the span file alike. sglang 0.5.23 as installed here parses a body with orjson, which
refuses a lone surrogate: both servers answer 400 before a request exists, and the test asserts that and that
nothing of it was made (the repair itself, and the loss of whole OTLP/HTTP batches it prevents, are shown for
every string a span takes in tests/test_encoder_validity.py, through the same real exporters).

The stand-ins are the serving tests' (tests/sglang_serving/pythonpath: an import-only sgl_kernel and a test plugin
keeping sglang off pinned CUDA memory); everything else is real.
"""

import glob
import json
import os
import shutil
import sys
import tempfile
import time

import pytest
from conftest import IN_CI
from support import sglang_runs
from support.sglang_runs import RECEIVE, REQUEST, SEND

HERE = os.path.dirname(os.path.abspath(__file__))
SINK = os.path.join(HERE, "support", "otlp_http_sink.py")
CLIENT = os.path.join(HERE, "support", "pd_direct_client.py")
SINK_PORT = 4318  # inside the deployment's own namespace: nothing else listens there
HOSTILE_RID = "\ud800"
REPAIRED_RID = "\ufffd"
NORMAL = 6
WAIT_S = 180.0


def _deployment_class():
    from sglang_serving import deployment as dep

    class WithSink(dep.Deployment):
        """The serving tests' deployment, its OTLP spans going to the receiver above over OTLP/HTTP."""

        def _start_namespace(self):
            super()._start_namespace()
            self._start("otlp-sink", [sys.executable, SINK, str(SINK_PORT), self.sink_dir])
            dep.wait_for(lambda: self._healthy("otlp-sink", f"http://127.0.0.1:{SINK_PORT}/health"), 60, 0.5,
                         what="the OTLP/HTTP receiver up")

    return dep, WithSink


@pytest.fixture(scope="module")
def hostile_run():
    sglang_runs.require_parts("mooncake")
    dep, with_sink = _deployment_class()
    base = tempfile.mkdtemp(prefix="kvt-sglang-hostile-")
    deployment = with_sink(base, exporters=["otlp", "kvtransfer_file"],
                           extra_env={"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                                      "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{SINK_PORT}"})
    deployment.sink_dir = os.path.join(base, "otlp")
    try:
        deployment.start()
        requests = dep.prompts(NORMAL + 1, 120, 4, repeat_every=0, seed=21, rid_prefix="calm")
        for n, request in enumerate(requests):
            request["room"] = 7_000_000 + n
        requests[NORMAL // 2]["rid"] = HOSTILE_RID  # in the middle of the others, sent at the same moment
        code, out, err = deployment.run_in_namespace(
            [sys.executable, CLIENT, f"http://127.0.0.1:{dep.PREFILL_PORT}/generate",
             f"http://127.0.0.1:{dep.DECODE_PORT}/generate",
             str(dep.BOOTSTRAP_PORT)], timeout=600, input_text=json.dumps(requests))
        assert code == 0, err[-2000:]
        answers = json.loads(out)
        yield deployment, requests, answers
    finally:
        deployment.stop()
        if not IN_CI and os.environ.get("KVT_KEEP_SERVING_OUTPUT") != "1":
            shutil.rmtree(base, ignore_errors=True)


def _received(sink_dir):
    """(spans the receiver parsed, as (name, attributes, span_id, parent_span_id), bodies it rejected)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    spans = []
    for path in sorted(glob.glob(os.path.join(sink_dir, "ok-*.pb"))):
        with open(path, "rb") as handle:
            request = ExportTraceServiceRequest.FromString(handle.read())
        for rs in request.resource_spans:
            for ss in rs.scope_spans:
                for span in ss.spans:
                    attrs = {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in span.attributes
                             if kv.value.WhichOneof("value")}
                    spans.append((span.name, attrs, span.span_id, span.parent_span_id))
    return spans, glob.glob(os.path.join(sink_dir, "rejected-*.pb"))


def _complete(spans, requests) -> bool:
    rids = {attrs.get("sglang.rid") for name, attrs, _, _ in spans if name == REQUEST}
    rooms = {attrs.get("kv_transfer.bootstrap_room") for name, attrs, _, _ in spans if name == RECEIVE}
    wanted = {r["rid"] if r["rid"] != HOSTILE_RID else REPAIRED_RID for r in requests}
    return wanted <= rids and {r["room"] for r in requests} <= rooms


def _spans_of_room(spans, room):
    return [s for s in spans if s[1].get("kv_transfer.bootstrap_room") == room]


def test_a_hostile_rid_loses_no_other_requests_spans_and_arrives_repaired(hostile_run):
    deployment, requests, answers = hostile_run
    hostile = requests[NORMAL // 2]
    normal = [a for r, a in zip(requests, answers) if r is not hostile]
    assert all(a["prefill"] == 200 and a["decode"] == 200 for a in normal), answers
    hostile_answer = answers[NORMAL // 2]
    # sglang 0.5.23's server parses a body with orjson, which refuses a lone surrogate: 400 from both servers
    # before any request exists. A release that keeps it (stdlib json does, and pydantic after it) admits it.
    admitted = hostile_answer["prefill"] == 200
    if not admitted:
        assert str(hostile_answer["prefill"]).startswith("400") and str(hostile_answer["decode"]).startswith("400")
    run = sglang_runs.Run(deployment, [], [])
    expected = [r for r in requests if r is not hostile or admitted]

    def hostile_in_file():
        return [s for _, s in run.read_spans() if s.name == REQUEST
                and s.attributes.get("kv_transfer.bootstrap_room") == hostile["room"]]

    deadline = time.monotonic() + WAIT_S  # the exporters batch every 0.5 s; bounded wait for the last batch
    spans, rejected = _received(deployment.sink_dir)
    while not (_complete(spans, expected) and (hostile_in_file() or not admitted)) and not rejected \
            and time.monotonic() < deadline:
        time.sleep(1.0)
        spans, rejected = _received(deployment.sink_dir)
    assert rejected == [], f"{len(rejected)} OTLP requests the receiver could not parse"
    by_rid = {}
    for name, attrs, span_id, _ in spans:
        if name == REQUEST:
            by_rid.setdefault(attrs.get("sglang.rid"), []).append(span_id)
    for request in expected:
        rid = REPAIRED_RID if request is hostile else request["rid"]
        assert len(by_rid.get(rid, ())) == 1, (rid, sorted(map(ascii, by_rid)))
        sends = [s for s in spans if s[0] == SEND and s[3] == by_rid[rid][0]]
        assert sends and all(s[1].get("kv_transfer.bootstrap_room") == request["room"] for s in sends), rid
        receives = [s for s in _spans_of_room(spans, request["room"]) if s[0] == RECEIVE]
        assert len(receives) == 1, (rid, request["room"])
    if admitted:  # and the span file (the package's own exporter) holds the same repaired value
        assert [s.attributes.get("sglang.rid") for s in hostile_in_file()] == [REPAIRED_RID]
    else:  # nothing half-made of a request that never existed
        assert _spans_of_room(spans, hostile["room"]) == [] and hostile_in_file() == []
