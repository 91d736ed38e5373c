"""OTLP in the tests: our fixed-shape span encoder installed in the exporters, and trace receivers on 127.0.0.1."""

import contextlib
import importlib
import threading
from concurrent import futures
from http.server import ThreadingHTTPServer

import pytest

from otel_kvtransfer.building import span_encoding


@contextlib.contextmanager
def accelerated():
    """The encoder installed for the duration, as `span_encoding.accelerate()` installs it; the exporters' own
    restored after."""
    # The exporter modules must be imported for accelerate() to find them (a deployment has imported its own).
    for name in span_encoding.EXPORTER_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # the minimum-versions job has the HTTP exporter only
            pass
    span_encoding.accelerate()
    try:
        yield
    finally:
        span_encoding.restore()


@contextlib.contextmanager
def http_receiver(handler):
    """`handler` (a BaseHTTPRequestHandler class) serving on 127.0.0.1 from a thread of its own: yields the port."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def grpc_receiver():
    """An OTLP/gRPC trace service on 127.0.0.1: yields (the port, the list of requests it received, in order)."""
    grpc = pytest.importorskip("grpc")
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received = []

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # grpc has parsed it with opentelemetry-proto's message
            received.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port, received
    finally:
        server.stop(0)
