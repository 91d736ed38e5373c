"""A real KV transfer workload for the observability tests: two Mooncake engines on 127.0.0.1, instrumented.

Run as a script by tests/deployments/test_prometheus_dashboard.py and tests/deployments/test_trace_store.py (never
imported by pytest):

    python tests/support/observability/workload.py metrics --seconds 6 --linger 60
        prefill engine (this process) pushes rooms to a decode engine (a spawned process) for ~6 s; each process
        serves the package's metrics (prefill on --metrics-port, decode on --decode-metrics-port) at
        127.0.0.1:<port>/metrics in the Collector's exposition (`exposition`) until stdin closes or
        --linger seconds pass.
    python tests/support/observability/workload.py traces --protocol grpc --endpoint 127.0.0.1:4317 --project p
        a few rooms; both engines export their spans over OTLP (gRPC or HTTP/protobuf) to that endpoint.

Protocol on stdout: one line `READY {json}` when serving / about to run, one line `DONE {json}` with a summary.
The workload plays the serving framework through the integration API (framework name `test_workload`, a model
name on every request and receive), the way frameworks/ packages do; the engines are real Mooncake engines.
Every room: decode begins to receive, prefill opens the request, pushes 3 chunks x 2 destinations (replica
factor 2) of KV, each chunk one `batch_transfer_sync_write` of DESCRIPTORS blocks (so descriptors per transfer
is more than one), plus one aux payload (a single `batch_transfer_async_write`, waited on with
`get_batch_transfer_status`, so it has a post time), while a "forward pass" of the next chunk
runs on another thread (real compute overlap), then ends the request; decode ends its receive. The KV chunks are
4 MiB (>= 1 MiB: kv_transfer.peer.throughput counts them) and the compute is recorded, so the request tail and its
queued part have data too. Every 4th room has
one failing transfer (a destination outside the peer's registered memory: Mooncake answers -1 at once). One room is
opened and never ended, so the TTL evicts it and the instrumentation's dropped counter moves. In metrics mode
OTEL_KVTRANSFER_STUCK_S is 0.5 s, so that room (and slower receives) are reported stuck while open; the
workload's set-up step towards the decode for each room (announcing it) is a `kv_transfer.connect`, and room
LATE_INDEX ends while its aux send is in flight, so that send completes late.
"""

import argparse
import json
import multiprocessing
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from time import time_ns

TESTS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `support` is in it
ROOT = os.path.dirname(TESTS)
for path in (ROOT, TESTS):
    if path not in sys.path:
        sys.path.insert(0, path)

from support.observability.parts import mooncake_tcp_engine

LOOPBACK = "127.0.0.1"
CHUNK_BYTES = 4 << 20
CHUNKS = 3
REPLICAS = 2
AUX_BYTES = 64 << 10
DESCRIPTORS = 4  # blocks per KV chunk (one batch call)
MIN_ROOMS = 4
LATE_INDEX = 1  # metrics mode: this room ends before its aux send's completion is seen (a late completion)
BACKEND = "mooncake"
FRAMEWORK = "test_workload"
MODEL = "tiny-test-model"
RECV_BYTES = REPLICAS * CHUNKS * CHUNK_BYTES + AUX_BYTES


def _providers(args, service_name, instance_id, with_metrics_reader):
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes = {"service.name": service_name, "service.instance.id": instance_id}
    if args.project:
        attributes["openinference.project.name"] = args.project  # Phoenix files spans under this project
    resource = Resource.create(attributes)
    tracer_provider = TracerProvider(resource=resource)
    if args.mode == "traces":
        if args.protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            exporter = OTLPSpanExporter(endpoint=f"http://{args.endpoint}", insecure=True, timeout=10)
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            exporter = OTLPSpanExporter(endpoint=f"http://{args.endpoint}/v1/traces", timeout=10)
        tracer_provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=200))
    reader = InMemoryMetricReader() if with_metrics_reader else None
    meter_provider = MeterProvider(resource=resource, metric_readers=[reader] if reader else [])
    from otel_kvtransfer import KVTransferInstrumentor

    KVTransferInstrumentor().instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)
    return tracer_provider, meter_provider, reader


def _decode_main(conn, args_dict):
    """The decode engine: a registered buffer, and kv_transfer.receive spans when told about rooms."""
    import numpy as np

    args = argparse.Namespace(**args_dict)
    # A receive sees no activity between its begin and its end: the short TTL the prefill side uses (to evict its
    # forgotten room) would evict receives of a slow room here. Decode evicts nothing in this workload.
    os.environ["OTEL_KVTRANSFER_REQUEST_TTL_S"] = "120"
    tracer_provider, meter_provider, reader = _providers(args, "kvt-decode", "decode-0", args.mode == "metrics")
    from otel_kvtransfer import integration

    endpoint = None
    if reader is not None:
        from support.observability.exposition import ScrapeEndpoint

        endpoint = ScrapeEndpoint(reader, port=args.decode_metrics_port)
    engine = mooncake_tcp_engine(LOOPBACK)
    buffer = np.zeros(RECV_BYTES, dtype=np.uint8)
    rc = engine.register_memory(buffer.ctypes.data, buffer.nbytes)
    conn.send((engine.get_rpc_port(), buffer.ctypes.data, rc))
    deadline = time.monotonic() + args.linger + 120
    while time.monotonic() < deadline:
        if not conn.poll(1.0):
            continue
        message = conn.recv()
        if message[0] == "begin":
            # the room waited for "memory" from its announcement until this receiver asked for its KV (the pipe)
            wait_s = max(time.time_ns() - message[3], 0) / 1e9
            integration.begin_receive(message[1], backend=BACKEND, framework=FRAMEWORK, expected_bytes=message[2],
                                      attributes={"gen_ai.request.model": MODEL,
                                                  "kv_transfer.allocation_wait_s": wait_s})
        elif message[0] == "end":
            verdict = message[3]  # what a framework's integrity check said of the KV, after the receive ended
            integration.end_receive(message[1], error_type=message[2], outcome_pending=verdict is not None)
            if verdict is not None:
                integration.receive_outcome(message[1], attributes={"kv_transfer.integrity": verdict})
        elif message[0] == "stop":
            break
    # every receive span ended -> its metrics are in the reader; keep serving them until told to exit
    tracer_provider.force_flush(10_000)
    conn.send("stopped")
    if endpoint is not None and conn.poll(args.linger + 30):
        conn.recv()
    if endpoint is not None:
        endpoint.close()
    tracer_provider.shutdown()
    meter_provider.shutdown()


def _forward_pass(size=192):
    import numpy as np

    start = time_ns()
    a = np.random.default_rng(0).random((size, size))
    for _ in range(6):
        a = a @ a
        a /= a.max()
    return start, time_ns()


def run(args) -> dict:
    import numpy as np

    tracer_provider, meter_provider, reader = _providers(args, "kvt-prefill", "prefill-0", args.mode == "metrics")
    from otel_kvtransfer import integration

    endpoint = None
    if args.mode == "metrics":
        from support.observability.exposition import ScrapeEndpoint

        endpoint = ScrapeEndpoint(reader, port=args.metrics_port)

    ctx = multiprocessing.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    decode = ctx.Process(target=_decode_main, args=(child_conn, vars(args)), daemon=True)
    decode.start()
    summary = {"decode_pid": decode.pid, "rooms": [], "failed_rooms": [], "transfers": 0, "failed_transfers": 0,
               "bytes": 0, "descriptors": 0, "late_transfers": 0, "set_ups": 0, "mismatched_rooms": []}
    try:
        if not parent_conn.poll(60):
            raise RuntimeError("decode engine did not start within 60 s")
        port, remote, rc = parent_conn.recv()
        if rc != 0:
            raise RuntimeError(f"decode register_memory returned {rc}")
        session = f"{LOOPBACK}:{port}"
        engine = mooncake_tcp_engine(LOOPBACK)
        source = np.random.default_rng(1).integers(0, 255, RECV_BYTES, dtype=np.uint8)
        rc = engine.register_memory(source.ctypes.data, source.nbytes)
        if rc != 0:
            raise RuntimeError(f"prefill register_memory returned {rc}")
        print("READY " + json.dumps({"metrics_port": endpoint.port if endpoint else None, "pid": os.getpid(),
                                     "decode_pid": decode.pid}),
              flush=True)

        # A room the engine forgets: the TTL (OTEL_KVTRANSFER_REQUEST_TTL_S) evicts it -> dropped counter.
        stale_room = args.room_base + 999_999
        integration.begin_request(stale_room, backend=BACKEND, framework=FRAMEWORK,
                                  attributes={"gen_ai.request.model": MODEL})

        pool = ThreadPoolExecutor(1, thread_name_prefix="forward")
        stop_at = time.monotonic() + args.seconds
        index = 0
        # metrics mode: --seconds of rooms, and at least MIN_ROOMS (one of which fails) however slow the machine is
        while (args.mode == "metrics" and (time.monotonic() < stop_at or index < MIN_ROOMS)) or \
                (args.mode == "traces" and index < args.rooms):
            room = args.room_base + index
            fail = index % 4 == 3
            integration.begin_request(room, backend=BACKEND, framework=FRAMEWORK,
                                      attributes={"gen_ai.request.model": MODEL})
            set_up_start = time_ns()
            parent_conn.send(("begin", room, REPLICAS * CHUNKS * CHUNK_BYTES + AUX_BYTES, time_ns()))
            if args.mode == "metrics":  # the framework's own step towards the decode: announcing the room
                integration.record_connect("announce_room", set_up_start, backend=BACKEND, framework=FRAMEWORK,
                                           address=LOOPBACK, port=port, key=room)
                summary["set_ups"] += 1
            compute = pool.submit(_forward_pass)
            error = None
            for chunk in range(CHUNKS):
                # the forward pass of this chunk ran (or runs) while the previous chunk's KV is on the wire
                start_ns, end_ns = compute.result(timeout=30)
                integration.record_compute([room], start_ns, end_ns, chunk_index=chunk)
                if chunk + 1 < CHUNKS:
                    compute = pool.submit(_forward_pass)
                for dest in range(REPLICAS):
                    offset = (dest * CHUNKS + chunk) * CHUNK_BYTES
                    target = remote + offset
                    if fail and chunk == CHUNKS - 1 and dest == REPLICAS - 1:
                        target = remote + (1 << 40)  # outside every registered buffer of the peer
                    block = CHUNK_BYTES // DESCRIPTORS
                    with integration.transfer_scope(room, chunk_index=chunk, payload="kv", destination_index=dest,
                                                    replica_factor=REPLICAS, is_last_chunk=chunk == CHUNKS - 1):
                        rc = engine.batch_transfer_sync_write(
                            session, [source.ctypes.data + offset + i * block for i in range(DESCRIPTORS)],
                            [target + i * block for i in range(DESCRIPTORS)], [block] * DESCRIPTORS)
                    summary["transfers"] += 1
                    summary["bytes"] += CHUNK_BYTES
                    summary["descriptors"] += DESCRIPTORS
                    if rc != 0:
                        summary["failed_transfers"] += 1
                        error = "transfer_failed"
            late = args.mode == "metrics" and index == LATE_INDEX
            with integration.transfer_scope(room, chunk_index=CHUNKS - 1, payload="aux", is_last_chunk=True):
                offset = REPLICAS * CHUNKS * CHUNK_BYTES
                # posted, then waited on: its span says how long the posting call took (kv_transfer.post_s)
                batch = engine.batch_transfer_async_write(session, [source.ctypes.data + offset], [remote + offset],
                                                          [AUX_BYTES])
                if late:  # the request ends while its aux is still in flight, as an aborted one's does
                    integration.end_request(room, error_type=error)
                rc = engine.get_batch_transfer_status([batch]) if batch and batch > 0 else -1
            summary["transfers"] += 1
            summary["bytes"] += AUX_BYTES
            summary["descriptors"] += 1
            if rc != 0:
                summary["failed_transfers"] += 1
                error = error or "transfer_failed"
            if late:
                summary["late_transfers"] += 1
            else:
                integration.end_request(room, error_type=error)
            verdict = None if error else "mismatch" if index % 4 == 1 else "verified"
            parent_conn.send(("end", room, error, verdict))
            summary["rooms"].append(room)
            if verdict == "mismatch":
                summary["mismatched_rooms"].append(room)
            if error:
                summary["failed_rooms"].append(room)
            index += 1
            time.sleep(args.pause)
        pool.shutdown(wait=True)
        # until the TTL has evicted the forgotten room and counted it (bounded; with no reader, nothing to wait
        # for), then deliver everything
        deadline = time.monotonic() + args.evict_wait
        while reader is not None and not _evicted(reader) and time.monotonic() < deadline:
            time.sleep(0.05)
        tracer_provider.force_flush(10_000)
        meter_provider.force_flush(10_000)
    finally:
        try:
            parent_conn.send(("stop",))
            if parent_conn.poll(30):
                parent_conn.recv()
        except (OSError, EOFError):
            pass
        if endpoint is None:
            _join(decode)
    print("DONE " + json.dumps(summary), flush=True)
    if endpoint is not None:
        # keep serving /metrics (here and in the decode process) until the test closes stdin or --linger passes
        done = threading.Event()
        threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
        done.wait(args.linger)
        endpoint.close()
        try:
            parent_conn.send(("exit",))
        except (OSError, EOFError):
            pass
        _join(decode)
    tracer_provider.shutdown()
    meter_provider.shutdown()
    return summary


def _evicted(reader) -> bool:
    """The dropped counter has counted an evicted request."""
    from otel_kvtransfer import semconv

    data = reader.get_metrics_data()
    for resource_metrics in (data.resource_metrics if data else []):
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                if metric.name == semconv.METRIC_DROPPED and any(
                        p.attributes.get(semconv.DROP_REASON) == "request_evicted" and p.value > 0
                        for p in metric.data.data_points):
                    return True
    return False


def _join(process) -> None:
    process.join(15)
    if process.is_alive():
        process.kill()
        process.join(5)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["metrics", "traces"])
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--rooms", type=int, default=4)
    parser.add_argument("--room-base", type=int, default=1000)
    parser.add_argument("--pause", type=float, default=0.05)
    parser.add_argument("--evict-wait", type=float, default=60.0,
                        help="at most this long for the TTL to evict the forgotten room (metrics mode)")
    parser.add_argument("--linger", type=float, default=60.0)
    parser.add_argument("--metrics-port", type=int, default=0)
    parser.add_argument("--decode-metrics-port", type=int, default=0)
    parser.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    parser.add_argument("--endpoint", default=None)
    parser.add_argument("--project", default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("MC_FORCE_TCP", "1")
    os.environ.setdefault("MC_TRANSFER_TIMEOUT", "5")
    os.environ.setdefault("OTEL_KVTRANSFER_REQUEST_TTL_S", "1.5")
    os.environ.setdefault("OTEL_KVTRANSFER_FLUSH_INTERVAL_MS", "100")
    if args.mode == "metrics":
        # the forgotten room (open until the TTL evicts it) and the slower receives are reported stuck, so the
        # kv_transfer.stuck counter has series for the dashboard; traces keep the default (no stuck events)
        os.environ.setdefault("OTEL_KVTRANSFER_STUCK_S", "0.5")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
