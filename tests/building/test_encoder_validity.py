"""What leaves the process through the span pipelines is valid OTLP for every value, and the same in both.

Hostile values a client or framework controls (a lone surrogate in a request id or an error type, an integer
beyond int64, 40 attributes of 1,000 characters under the provider's span limits, an empty key) go through the
real builder in the direct pipeline (our fixed-shape encoder inside the OTLP exporters) and in the SDK pipeline
(the SDK's tracer and encoder); the spans travel through the real OTLP/HTTP and OTLP/gRPC exporters to receivers on
127.0.0.1 that parse every request with opentelemetry-proto, as a collector does (HTTP answers 400 to a request
it cannot parse). Both pipelines get the same sequential ids, so their spans compare field by field.
"""

from http.server import BaseHTTPRequestHandler

import pytest
from google.protobuf.message import DecodeError
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support import otlp
from support.telemetry import in_memory_metrics
from test_builder import begin_peer, begin_request, call, compute, end_peer, end_request, info, send
from test_span_encoding import Sequential

from otel_kvtransfer import config, registry, semconv
from otel_kvtransfer.building import span_encoding
from otel_kvtransfer.building.attachment import Attachment, new_builder
from otel_kvtransfer.building.direct_spans import KVSpan

BAD = "\ud800"  # what json.loads makes of the escaped "\ud800" a client may send
REPAIRED = "\ufffd"
RID = "sglang.rid"
REQUESTS = 300  # normal requests around the hostile one
HOSTILE = 7_777


@pytest.fixture(autouse=True)
def _accelerated():
    with otlp.accelerated():
        yield


def _normal_request(key, at):
    return [begin_request(key, at, attributes={RID: f"rid-{key}"}),
            send(info(key, 0, attrs={RID: f"rid-{key}"}), [call(at + 10, at + 20, 4096)]),
            compute([key], at, at + 15, 0),
            end_request(key, at + 30)]


def _hostile_records():
    """Normal requests around one whose every client-controlled string holds a lone surrogate: its rid, a
    framework attribute's key and value, its send's error type (from the engine call), its end's error type
    (from the integration API), and a peer wait's attribute."""
    recs = []
    for n in range(REQUESTS // 2):
        recs += _normal_request(n, 1_000 + n * 100)
    bad = {RID: "r" + BAD, "fw.note" + BAD: "\udc80x", "fw.pair": "\ud83d\ude00"}
    recs += [begin_request(HOSTILE, 50_000, attributes=bad),
             send(info(HOSTILE, 0, attrs={RID: "r" + BAD}), [call(50_010, 50_020, 64, rc=-1, error="boom" + BAD)]),
             send(info(HOSTILE, 1, attrs={RID: "r" + BAD}), [], error="scope" + BAD, scope_span=(50_030, 50_040)),
             compute([HOSTILE], 50_000, 50_015, 0),
             begin_peer(HOSTILE + 1, 50_000, attributes={"fw.peer": BAD}),
             end_peer(HOSTILE + 1, 50_100, error="gone" + BAD),
             end_request(HOSTILE, 50_200, error="client_error" + BAD)]
    for n in range(REQUESTS // 2, REQUESTS):
        recs += _normal_request(n, 60_000 + n * 100)
    return recs


def _build(pipeline, processor, recs, limits=None):
    """Feed `recs` to a real builder on `pipeline` whose provider ends spans into `processor`."""
    provider = TracerProvider(id_generator=Sequential(), span_limits=limits)
    provider.add_span_processor(processor)
    attachment = Attachment(in_memory_metrics()[0], pipeline)
    attachment.attach(provider.get_tracer(semconv.INSTRUMENTATION_NAME, "0.1.0"), provider, flush_first=False)
    drops = []
    builder = new_builder(attachment, config.Settings(), registry.load(registry.ENGINES),
                          on_drop=lambda reason, n: drops.append(reason))
    for rec in recs:
        builder.handle(rec)
    builder.release_held()  # what the recorder's drain does on a flush: the peer wait ended in error goes out too
    flushed = provider.force_flush()
    attachment.detach()
    provider.shutdown()
    assert drops == []
    return flushed


def _in_memory(pipeline, recs, limits=None):
    exporter = InMemorySpanExporter()
    _build(pipeline, SimpleSpanProcessor(exporter), recs, limits)
    spans = exporter.get_finished_spans()
    return [s for s in spans if s.context.trace_flags.sampled]


def _spans(requests):
    return sorted((span for request in requests for rs in request.resource_spans for ss in rs.scope_spans
                   for span in ss.spans), key=lambda span: span.span_id)


def _strings(span):
    """Every attribute (key, string value) of a decoded span, its events' and its status message."""
    out = [(kv.key, kv.value.string_value) for kv in span.attributes]
    out += [(kv.key, kv.value.string_value) for event in span.events for kv in event.attributes]
    return out + [("status", span.status.message)]


def _wire(spans, direct):
    """The bytes the OTLP exporters would send for these spans, parsed back as a receiver parses them."""
    message = span_encoding.AcceleratedEncoder(encode_spans, as_message=False)(spans) if direct else encode_spans(spans)
    return ExportTraceServiceRequest.FromString(message.SerializeToString())


def test_hostile_strings_are_repaired_the_same_in_both_pipelines():
    direct = _in_memory("direct", _hostile_records())
    sdk = _in_memory("sdk", _hostile_records())
    assert len(direct) == len(sdk) == REQUESTS * 3 + 5 and all(type(s) is KVSpan for s in direct)
    ours, theirs = _spans([_wire(direct, True)]), _spans([_wire(sdk, False)])  # each parses
    assert ours == theirs
    hostile = [s for s in ours if any(k == semconv.REQUEST_KEY and v in (str(HOSTILE), str(HOSTILE + 1))
                                      for k, v in _strings(s))]
    assert len(hostile) == 5  # request, 2 sends, compute, peer wait
    strings = dict(kv for s in hostile for kv in _strings(s))
    # each repaired, none dropped: the SDK encoder would have dropped these attributes, and failed the batch on
    # the status messages
    assert strings[RID] == "r" + REPAIRED
    assert strings["fw.note" + REPAIRED] == REPAIRED + "x"
    assert strings["fw.pair"] == "\U0001f600"  # a valid pair is its character, as a JSON decoder makes it
    assert strings["fw.peer"] == REPAIRED
    request = next(s for s in hostile if s.name == semconv.SPAN_REQUEST)
    sends = [s for s in hostile if s.name == semconv.SPAN_SEND]
    assert request.status.message == "client_error" + REPAIRED
    assert sorted(s.status.message for s in sends) == ["boom" + REPAIRED, "scope" + REPAIRED]
    assert sorted(dict(_strings(s))[semconv.ERROR_TYPE] for s in sends) == ["boom" + REPAIRED, "scope" + REPAIRED]


# --- through the real exporters ------------------------------------------------------------------------------------

class _Collector(BaseHTTPRequestHandler):
    """Parses every OTLP/HTTP request as a collector does: 400 to what does not parse."""

    parsed, rejected = [], []

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        try:
            _Collector.parsed.append(ExportTraceServiceRequest.FromString(body))
            code = 200
        except DecodeError:
            _Collector.rejected.append(len(body))
            code = 400
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def _through_http(pipeline):
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    _Collector.parsed, _Collector.rejected = [], []
    with otlp.http_receiver(_Collector) as port:
        exporter = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{port}/v1/traces", timeout=10)
        flushed = _build(pipeline, BatchSpanProcessor(exporter, max_export_batch_size=512), _hostile_records())
    return flushed, list(_Collector.parsed), list(_Collector.rejected)


def _through_grpc(pipeline):
    pytest.importorskip("grpc")
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    with otlp.grpc_receiver() as (port, parsed):  # grpc parses each request with opentelemetry-proto's message
        exporter = OTLPSpanExporter(endpoint=f"127.0.0.1:{port}", insecure=True, timeout=10)
        flushed = _build(pipeline, BatchSpanProcessor(exporter, max_export_batch_size=512), _hostile_records())
    return flushed, parsed, []


@pytest.mark.parametrize("transport", [_through_http, _through_grpc], ids=["http", "grpc"])
def test_one_hostile_request_loses_no_other_requests_spans_through_the_real_exporters(transport):
    received = {}
    for pipeline in ("direct", "sdk"):
        flushed, parsed, rejected = transport(pipeline)
        assert rejected == [] and flushed is True, pipeline
        spans = _spans(parsed)
        assert len(spans) == REQUESTS * 3 + 5, pipeline  # every request's spans, the hostile one's too
        rids = {dict(_strings(s)).get(RID) for s in spans if s.name == semconv.SPAN_REQUEST}
        assert rids == {f"rid-{n}" for n in range(REQUESTS)} | {"r" + REPAIRED}, pipeline
        received[pipeline] = spans
    assert received["direct"] == received["sdk"]


# --- span limits -----------------------------------------------------------------------------------------------

def _wide_records():
    """A request with 40 framework attributes of 1,000 characters and an empty key, its send with the same."""
    wide = {f"fw.a{n:02d}": chr(ord("a") + n % 26) * 1_000 for n in range(40)}
    wide[""] = "empty key"
    return [begin_request(5, 1_000, attributes=wide),
            send(info(5, 0, attrs=wide), [call(1_010, 1_020, 4096)]),
            send(info(5, 1), [call(1_030, 1_040, 4096, error="e" * 20)]),
            end_request(5, 2_000)]


@pytest.mark.parametrize("env", [
    {"OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": "8", "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT": "16"},
    {"OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT": "8"},
    {"OTEL_ATTRIBUTE_COUNT_LIMIT": "3"},
    {},
], ids=["length-and-count", "span-length", "global-count", "defaults"])
def test_the_direct_pipeline_applies_the_providers_span_limits_as_the_sdk_does(env, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    direct = _in_memory("direct", _wide_records())  # each provider resolves its limits from the environment
    sdk = _in_memory("sdk", _wide_records())
    assert len(direct) == len(sdk) == 3
    for mine, theirs in zip(sorted(direct, key=lambda s: s.context.span_id),
                            sorted(sdk, key=lambda s: s.context.span_id)):
        assert list(mine.attributes.items()) == list(theirs.attributes.items()), mine.name
        assert mine.dropped_attributes == theirs.dropped_attributes, mine.name
        assert "" not in mine.attributes
    limits = SpanLimits()
    request = next(s for s in direct if s.name == semconv.SPAN_REQUEST)
    assert len(request.attributes) <= limits.max_span_attributes
    if limits.max_span_attribute_length is not None:
        assert max(len(v) for v in request.attributes.values() if isinstance(v, str)) <= 8
    assert _spans([_wire(direct, True)]) == _spans([_wire(sdk, False)])  # dropped_attributes_count included


def test_limits_given_to_the_provider_apply_as_well():
    limits = SpanLimits(max_span_attributes=5, max_span_attribute_length=3)
    direct = _in_memory("direct", _wide_records(), limits)
    sdk = _in_memory("sdk", _wide_records(), limits)
    assert [dict(s.attributes) for s in direct] == [dict(s.attributes) for s in sdk]
    assert all(len(s.attributes) <= 5 for s in direct)
    assert _spans([_wire(direct, True)]) == _spans([_wire(sdk, False)])


# --- integers beyond int64 -----------------------------------------------------------------------------------------

def test_integers_beyond_int64_are_dropped_as_the_sdk_encoder_drops_them():
    numbers = {"fw.big": 2**64 + 5, "fw.huge": 2**200, "fw.low": -(2**63) - 1, "fw.max": 2**63 - 1,
               "fw.min": -(2**63), "fw.uint": 2**63}
    recs = [begin_request(9, 1_000, attributes=numbers), send(info(9, 0, attrs=numbers), [call(1_010, 1_020, 8)]),
            end_request(9, 2_000)]
    direct, sdk = _in_memory("direct", recs), _in_memory("sdk", recs)
    ours, theirs = _spans([_wire(direct, True)]), _spans([_wire(sdk, False)])
    assert ours == theirs
    for span in ours:
        ints = {kv.key: kv.value.int_value for kv in span.attributes if kv.key.startswith("fw.")}
        assert ints == {"fw.max": 2**63 - 1, "fw.min": -(2**63)}, span.name


def test_equal_values_of_other_types_under_one_key_keep_their_own_type():
    """True == 1 and hash alike: the cache of encoded pairs must not hand one's bytes to the other."""
    recs = []
    for n, value in enumerate((True, 1, False, 0, True, 1)):
        recs += [begin_request(n, 1_000, attributes={"fw.flag": value}), end_request(n, 2_000)]
    direct, sdk = _in_memory("direct", recs), _in_memory("sdk", recs)
    ours, theirs = _spans([_wire(direct, True)]), _spans([_wire(sdk, False)])
    assert ours == theirs
    kinds = [kv.value.WhichOneof("value") for span in ours for kv in span.attributes if kv.key == "fw.flag"]
    assert kinds == ["bool_value", "int_value"] * 3


# --- the encoder's cache -----------------------------------------------------------------------------------------

def _cached_bytes(pieces) -> int:
    pairs = sum(len(pair) for table in (pieces.strings, pieces.ints, pieces.bools) for by_value in table.values()
                for pair in by_value.values())
    return pairs + sum(len(entry[1]) for entry in pieces.statics.values())


def test_the_encoders_cache_is_bounded_by_bytes():
    pieces = span_encoding._Pieces()
    recs = []
    for n in range(160):  # 160 requests, each with its own 256 KB attribute: 40 MiB of distinct values
        value = f"{n:06d}" + "v" * (256 * 1024)
        recs += [begin_request(n, 1_000, attributes={"fw.blob": value}),
                 send(info(n, 0, attrs={"fw.blob": value}), [call(1_010, 1_020, 8)]), end_request(n, 2_000)]
    spans = _in_memory("direct", recs)
    for start in range(0, len(spans), 30):
        batch = spans[start:start + 30]
        encoded = span_encoding.encode_request(batch, pieces)
        assert _spans([ExportTraceServiceRequest.FromString(encoded)]) == _spans([encode_spans(batch)])
    assert _cached_bytes(pieces) <= 16 << 20  # of 40 MiB that went through: pairs and static parts, each bounded
    # and the common values still come from the cache
    assert any(pieces.strings.values()) or any(pieces.ints.values())


# --- events on open spans, and the SDK attribute the limits are read from -----------------------------------------

def _with_event(spans_of, limits):
    """A request span opened, given an event (a stuck report's shape) with a hostile value, and closed."""
    from opentelemetry.trace import SpanKind

    exporter = InMemorySpanExporter()
    provider = TracerProvider(id_generator=Sequential(), span_limits=limits)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    spans = spans_of(provider.get_tracer(semconv.INSTRUMENTATION_NAME, "0.1.0"))
    span = spans.open(semconv.SPAN_REQUEST, None, SpanKind.INTERNAL, {semconv.REQUEST_KEY: "k" + BAD}, 1_000)
    for n in range(3):
        span.add_event(semconv.EVENT_STUCK, {semconv.SERVER_ADDRESS: "peer" + BAD, "fw.n": n, "fw.long": "x" * 50},
                       2_000 + n)
    span.set_attribute(semconv.ERROR_TYPE, "late" + BAD)
    spans.close(span, 3_000)
    return exporter.get_finished_spans()


def test_events_on_open_spans_are_bounded_and_repaired_as_the_sdk_keeps_them():
    from otel_kvtransfer.building.direct_spans import DirectSpans
    from otel_kvtransfer.building.sdk_spans import SdkSpans

    limits = SpanLimits(max_events=2, max_event_attributes=2, max_attribute_length=10)
    (direct,), (sdk,) = _with_event(DirectSpans, limits), _with_event(SdkSpans, limits)
    assert [(e.name, e.timestamp, dict(e.attributes), e.dropped_attributes) for e in direct.events] == \
        [(e.name, e.timestamp, dict(e.attributes), e.dropped_attributes) for e in sdk.events]
    assert direct.dropped_events == sdk.dropped_events == 1
    assert dict(direct.attributes) == dict(sdk.attributes) == {semconv.REQUEST_KEY: "k" + REPAIRED,
                                                              semconv.ERROR_TYPE: "late" + REPAIRED}
    assert _spans([_wire([direct], True)]) == _spans([_wire([sdk], False)])


def test_the_sdk_tracer_keeps_its_providers_span_limits():
    """Canary: the direct pipeline reads the limits from the tracer's private `_span_limits` (the provider's)."""
    limits = SpanLimits(max_span_attributes=3)
    tracer = TracerProvider(span_limits=limits).get_tracer("canary")
    assert tracer._span_limits is limits


@pytest.mark.parametrize("pipeline", ["direct", "sdk"])
def test_a_hostile_str_key_still_stitches_both_sides_into_one_trace(pipeline):
    """The synthetic parent hashes the key as it came (stitching: surrogatepass, the same on both sides); only the
    attribute is repaired, identically on both sides."""
    key = "transfer-" + BAD
    recs = [begin_request(key, 1_000), send(info(key, 0), [call(1_010, 1_020, 8)]), end_request(key, 2_000),
            begin_peer(key, 900), end_peer(key, 2_100)]
    spans = _in_memory(pipeline, recs)
    decoded = _spans([_wire(spans, pipeline == "direct")])
    assert len(decoded) == 3 and len({s.trace_id for s in decoded}) == 1
    assert {dict(_strings(s))[semconv.REQUEST_KEY] for s in decoded} == {"transfer-" + REPAIRED}
