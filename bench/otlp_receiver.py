"""An OTLP receiver for the cost benchmarks, in a process of its own (its CPU is not the engine's).

Binds 127.0.0.1 only and accepts OTLP/HTTP protobuf (POST /v1/traces, /v1/metrics) and OTLP/gRPC (TraceService,
MetricsService). It counts the spans it receives by name and keeps the metric points the way a backend reads
them: a cumulative stream is (resource, scope, metric, attributes, start time) and only its latest point counts
(a builder process that starts again begins new streams, with a new start time); delta points add up.

    python bench/otlp_receiver.py
    first stdout line: {"http_port": N, "grpc_port": N, "pid": N}
    stdin, one command a line: `count` -> one JSON line of what arrived so far; `exit` (or end of input) -> stops

Everything it receives is untrusted: bodies are bounded, a body that does not parse is answered 400 (gRPC:
INVALID_ARGUMENT) and counted as rejected, and names, streams and attribute values are bounded in number and size.
`ReceiverProcess` starts one and talks to it.
"""

import gzip
import io
import json
import os
import subprocess
import sys
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MAX_BODY = 32 << 20  # bytes of one request, before and after decompression
MAX_NAMES = 1000  # distinct span names kept; the rest counted under OTHER
MAX_STREAMS = 100_000  # metric streams kept; points of further streams are rejected
MAX_TEXT = 200  # characters of a name or attribute value kept
OTHER = "(other)"
LOOPBACK = "127.0.0.1"


def _text(value) -> str:
    return str(value)[:MAX_TEXT]


def _any_value(value):
    which = value.WhichOneof("value")
    return _text(getattr(value, which)) if which in ("string_value", "int_value", "double_value",
                                                      "bool_value") else f"<{which}>"


def _attributes(key_values) -> tuple:
    return tuple(sorted((_text(kv.key), _any_value(kv.value)) for kv in key_values))


class Store:
    """What arrived: span counts by name, the metric streams' latest (cumulative) or summed (delta) points."""

    def __init__(self):
        self._lock = threading.Lock()
        self.spans = {}
        self.requests = {"traces": 0, "metrics": 0, "rejected": 0}
        self.streams = {}  # (resource, scope, metric, attributes, start) -> [time, kind, count, sum, value]

    def rejected(self) -> None:
        with self._lock:
            self.requests["rejected"] += 1

    def traces(self, request) -> None:
        counts = {}
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    name = span.name
                    counts[name] = counts.get(name, 0) + 1
        with self._lock:
            self.requests["traces"] += 1
            for name, n in counts.items():
                name = _text(name)
                if name not in self.spans and len(self.spans) >= MAX_NAMES:
                    name = OTHER
                self.spans[name] = self.spans.get(name, 0) + n

    def metrics(self, request) -> None:
        with self._lock:
            self.requests["metrics"] += 1
            for resource_metrics in request.resource_metrics:
                resource = _attributes(resource_metrics.resource.attributes)
                for scope_metrics in resource_metrics.scope_metrics:
                    scope = _text(scope_metrics.scope.name)
                    for metric in scope_metrics.metrics:
                        self._metric(resource, scope, metric)

    def _metric(self, resource, scope, metric) -> None:
        kind = metric.WhichOneof("data")
        if kind not in ("histogram", "exponential_histogram", "sum", "gauge"):
            return
        data = getattr(metric, kind)
        delta = getattr(data, "aggregation_temporality", 2) == 1  # AGGREGATION_TEMPORALITY_DELTA
        name = _text(metric.name)
        for point in data.data_points:
            key = (resource, scope, name, _attributes(point.attributes), point.start_time_unix_nano)
            if kind in ("sum", "gauge"):
                value = point.as_int if point.WhichOneof("value") == "as_int" else point.as_double
                figures = [point.time_unix_nano, kind, 0, 0.0, value]
            else:
                figures = [point.time_unix_nano, kind, point.count, point.sum, 0]
            held = self.streams.get(key)
            if held is None:
                if len(self.streams) >= MAX_STREAMS:
                    self.requests["rejected"] += 1
                    continue
                self.streams[key] = figures
            elif delta and kind != "gauge":
                held[0], held[2], held[3], held[4] = (max(held[0], figures[0]), held[2] + figures[2],
                                                      held[3] + figures[3], held[4] + figures[4])
            elif figures[0] >= held[0]:
                self.streams[key] = figures

    def summary(self) -> dict:
        """Spans by name; per metric: total count and sum (histograms) or value (sums, gauges) over its streams,
        the number of streams, and per attribute set (streams of every resource and start time added)."""
        with self._lock:
            metrics = {}
            for (_, _, name, attributes, _), (_, kind, count, total, value) in self.streams.items():
                entry = metrics.setdefault(name, {"kind": kind, "count": 0, "sum": 0.0, "value": 0, "streams": 0,
                                                  "by_attributes": {}})
                entry["count"] += count
                entry["sum"] += total
                entry["value"] += value
                entry["streams"] += 1
                label = json.dumps(dict(attributes), sort_keys=True)
                by = entry["by_attributes"]
                by[label] = by.get(label, 0) + (count if kind in ("histogram", "exponential_histogram") else value)
            return {"spans": dict(self.spans), "requests": dict(self.requests), "metrics": metrics}


def _decompressed(body: bytes, encoding: str) -> bytes:
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding == "gzip":
        with gzip.GzipFile(fileobj=io.BytesIO(body)) as handle:
            out = handle.read(MAX_BODY + 1)
    elif encoding == "deflate":
        out = zlib.decompressobj().decompress(body, MAX_BODY + 1)
    else:
        raise ValueError(f"content encoding {encoding[:40]!r}")
    if len(out) > MAX_BODY:
        raise ValueError("body too large")
    return out


def serve(store: Store):
    """Both servers on 127.0.0.1 (ports chosen by the kernel): (http server, grpc server, grpc port)."""
    import grpc
    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as mpb
    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc as mgrpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tpb
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tgrpc

    routes = {"/v1/traces": (tpb.ExportTraceServiceRequest, store.traces,
                             tpb.ExportTraceServiceResponse().SerializeToString()),
              "/v1/metrics": (mpb.ExportMetricsServiceRequest, store.metrics,
                              mpb.ExportMetricsServiceResponse().SerializeToString())}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as a collector does: the exporter reuses its connection

        def do_POST(self):
            route = routes.get(self.path.split("?", 1)[0])
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                length = -1
            if not 0 <= length <= MAX_BODY:
                store.rejected()
                self._answer(413 if length > MAX_BODY else 411, b"")
                self.close_connection = True
                return
            body = self.rfile.read(length)
            if route is None:
                store.rejected()
                self._answer(404, b"")
                return
            message, ingest, response = route
            try:
                ingest(message.FromString(_decompressed(body, self.headers.get("Content-Encoding", ""))))
            except Exception:
                store.rejected()
                self._answer(400, b"")
                return
            self._answer(200, response)

        def _answer(self, code: int, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    http = ThreadingHTTPServer((LOOPBACK, 0), Handler)
    http.daemon_threads = True
    threading.Thread(target=http.serve_forever, name="otlp-http", daemon=True).start()

    def unary(ingest, response):
        def export(request, context):
            try:
                ingest(request)
            except Exception:
                store.rejected()
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad request")
            return response
        return export

    class Traces(tgrpc.TraceServiceServicer):
        Export = staticmethod(unary(store.traces, tpb.ExportTraceServiceResponse()))

    class Metrics(mgrpc.MetricsServiceServicer):
        Export = staticmethod(unary(store.metrics, mpb.ExportMetricsServiceResponse()))

    server = grpc.server(ThreadPoolExecutor(max_workers=4),
                         options=[("grpc.max_receive_message_length", MAX_BODY)])
    tgrpc.add_TraceServiceServicer_to_server(Traces(), server)
    mgrpc.add_MetricsServiceServicer_to_server(Metrics(), server)
    grpc_port = server.add_insecure_port(f"{LOOPBACK}:0")
    if not grpc_port:
        raise OSError(f"could not bind gRPC on {LOOPBACK}")
    server.start()
    return http, server, grpc_port


def main() -> None:
    store = Store()
    try:
        http, grpc_server, grpc_port = serve(store)
    except (OSError, ImportError, RuntimeError) as exc:
        print(f"otlp_receiver: could not start ({type(exc).__name__}: {str(exc)[:200]})", file=sys.stderr)
        sys.exit(2)
    print(json.dumps({"http_port": http.server_address[1], "grpc_port": grpc_port, "pid": os.getpid()}),
          flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "count":
            print(json.dumps(store.summary()), flush=True)
        elif command == "exit":
            break
    grpc_server.stop(0)
    http.shutdown()


class ReceiverProcess:
    """Starts bench/otlp_receiver.py as a child process, asks it for counts, stops it (by its PID if need be)."""

    def __init__(self, python: str = sys.executable):
        self.proc = subprocess.Popen(
            [python, os.path.abspath(__file__)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        try:
            ports = json.loads(line)
        except ValueError:
            self.stop()
            raise RuntimeError("the OTLP receiver did not start") from None
        self.pid, self.http_port, self.grpc_port = ports["pid"], ports["http_port"], ports["grpc_port"]

    def endpoint(self, protocol: str) -> str:
        return f"http://{LOOPBACK}:{self.grpc_port if protocol == 'grpc' else self.http_port}"

    def counts(self) -> dict:
        self.proc.stdin.write("count\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("exit\n")
                self.proc.stdin.flush()
            except OSError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # this very process, by its PID
                self.proc.wait(10)


if __name__ == "__main__":
    main()
