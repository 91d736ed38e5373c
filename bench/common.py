"""What every benchmark shares: the machine description, RSS, the SDK pipeline, stand-in engines, naive wrapper.

The pipeline is the production shape: an SDK TracerProvider whose spans go to a BatchSpanProcessor with a no-op
exporter that counts what reaches it, and a MeterProvider with an in-memory reader (the aggregation work happens
when a point is recorded, as with any reader). `KVTransferInstrumentor` attaches its own processors to them.
"""

import json
import os
import platform
import shutil
import statistics
import sys
import time
from importlib import metadata

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake logs every connection at INFO
os.environ.setdefault("MC_FORCE_TCP", "1")

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind

from otel_kvtransfer import semconv

# The tests' readers of what the instrumentation recorded: one copy for both.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from support.telemetry import dropped_by_reason, metric_points, transfers_in_metrics  # noqa: E402

PACKAGES = ["otel_kvtransfer", "opentelemetry-api", "opentelemetry-sdk", "opentelemetry-instrumentation", "wrapt",
            "mooncake-transfer-engine-non-cuda", "numpy"]


def machine() -> dict:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_kib = 0
    try:
        with open("/proc/meminfo", encoding="utf-8") as handle:
            mem_kib = int(handle.readline().split()[1])
    except (OSError, ValueError, IndexError):
        pass
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "nproc": os.cpu_count(),
        "cpu_model": cpu,
        "memory_gib": round(mem_kib / 2**20, 1),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "packages": versions,
    }


def rss_bytes() -> int:
    with open("/proc/self/status", encoding="utf-8") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def median(values):
    return statistics.median(values) if values else float("nan")


def quantile(values, q):
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class CountingExporter(SpanExporter):
    """A no-op exporter that only counts the spans reaching it."""

    def __init__(self):
        self.count = 0

    def export(self, spans):
        self.count += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass


class Pipeline:
    """TracerProvider -> BatchSpanProcessor(no-op exporter); MeterProvider with an in-memory reader."""

    def __init__(self, max_queue_size=8192, max_export_batch_size=512, schedule_delay_millis=100, metrics="on"):
        self.exporter = CountingExporter()
        self.tracer_provider = TracerProvider(shutdown_on_exit=False)
        self.tracer_provider.add_span_processor(BatchSpanProcessor(
            self.exporter, max_queue_size=max_queue_size, max_export_batch_size=max_export_batch_size,
            schedule_delay_millis=schedule_delay_millis))
        self.reader = InMemoryMetricReader()
        if metrics == "no_exemplars":  # the SDK's exemplar filter off: what exemplars cost
            from opentelemetry.sdk.metrics._internal.exemplar import (
                AlwaysOffExemplarFilter,
            )

            self.meter_provider = MeterProvider(metric_readers=[self.reader], shutdown_on_exit=False,
                                                exemplar_filter=AlwaysOffExemplarFilter())
        elif metrics == "no_reader":  # nothing reads the metrics: the SDK still takes each measurement
            self.meter_provider = MeterProvider(metric_readers=[], shutdown_on_exit=False)
        else:
            self.meter_provider = MeterProvider(metric_readers=[self.reader], shutdown_on_exit=False)

    def metric_points(self) -> dict:
        return metric_points(self.reader)

    def transfers_in_metrics(self) -> int:
        return transfers_in_metrics(self.reader)

    def dropped(self) -> dict:
        return dropped_by_reason(self.reader)

    def shutdown(self):
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


# --- stand-in engines --------------------------------------------------------------------------------------------

def _no_op_write(self, target_hostname, buffer, peer_buffer_address, length):
    return 0


class PlainStandIn:
    """A zero-cost stand-in for TransferEngine.transfer_sync_write: same signature, does nothing, returns 0.

    Used only to separate the wrapper's own cost from the network noise of a real loopback transfer; every figure
    measured on it is labelled 'stand-in'."""

    transfer_sync_write = _no_op_write


class WrappedStandIn:
    """The same no-op method, wrapped by the package's own Mooncake hot-path function (`mooncake._sync`)."""

    transfer_sync_write = _no_op_write


class NaiveStandIn:
    """The same no-op method, wrapped by `Naive.wrapper` (SDK span + histogram records on the calling thread)."""

    transfer_sync_write = _no_op_write


def wrap_stand_ins(naive):
    """Wrap the stand-in classes once: ours with the package's own hot-path function, the naive one with `naive`."""
    import wrapt

    from otel_kvtransfer.engines import mooncake

    if WrappedStandIn.__dict__["transfer_sync_write"] is _no_op_write:
        WrappedStandIn.transfer_sync_write = mooncake._sync(_no_op_write, mooncake.WRITE, False)
    if not hasattr(NaiveStandIn.__dict__["transfer_sync_write"], "__wrapped__"):
        wrapt.wrap_function_wrapper(NaiveStandIn, "transfer_sync_write", naive)


def instrument_stand_ins():
    """The package instrumented as the calling-thread benches measure it (hot_path.py, wrapper_floor.py): the
    recorder on with no exporter behind it, the stand-ins wrapped. The caller sets the OTEL_KVTRANSFER_* variables
    first, and uninstruments the returned instrumentor at the end."""
    from otel_kvtransfer import KVTransferInstrumentor

    instrumentor = KVTransferInstrumentor()
    instrumentor.instrument(tracer_provider=TracerProvider(shutdown_on_exit=False))
    wrap_stand_ins(lambda wrapped, instance, a, kw: wrapped(*a, **kw))
    return instrumentor


def register_transport(engine, transport="tcp"):
    """What the package's initialize() wrapper notes for a real engine, for a stand-in that has no initialize."""
    from otel_kvtransfer.engines import mooncake

    if hasattr(mooncake, "_engines"):  # (transport, the engine's one device): no device, as initialize("", ...)
        mooncake._engines[id(engine)] = (transport, None)
    else:  # a checkout from before kv_transfer.nic (--tree): the transport alone
        mooncake._transports[id(engine)] = transport


# --- the naive reference instrumentation ----------------------------------------------------------------------

class Naive:
    """What a straightforward on-thread instrumentation does per transfer: an SDK span with the same attributes,
    three histogram records (duration, size, throughput), all on the engine thread. The reference point."""

    def __init__(self, pipeline: Pipeline):
        self.tracer = pipeline.tracer_provider.get_tracer("naive-reference")
        meter = pipeline.meter_provider.get_meter("naive-reference")
        self.duration = meter.create_histogram("naive.duration", unit="s")
        self.size = meter.create_histogram("naive.size", unit="By")
        self.throughput = meter.create_histogram("naive.throughput", unit="By/s")

    def wrapper(self, wrapped, instance, args, kwargs):
        tracer = self.tracer
        with tracer.start_as_current_span(semconv.SPAN_SEND, kind=SpanKind.CLIENT) as span:
            start = time.time_ns()
            rc = wrapped(*args, **kwargs)
            elapsed = max(time.time_ns() - start, 1)
            nbytes = int(args[3])
            host, _, port = str(args[0]).rpartition(":")
            throughput = nbytes * 1e9 / elapsed
            span.set_attributes({
                semconv.BYTES: nbytes, semconv.DESCRIPTOR_COUNT: 1, semconv.ENGINE_CALLS: 1,
                semconv.OP: semconv.OP_WRITE, semconv.THROUGHPUT: throughput,
                semconv.NETWORK_IO_DIRECTION: semconv.DIRECTION_TRANSMIT, semconv.NETWORK_TRANSPORT: "tcp",
                semconv.SERVER_ADDRESS: host, semconv.SERVER_PORT: int(port) if port.isdigit() else 0,
                semconv.BACKEND: "mooncake"})
            labels = {semconv.BACKEND: "mooncake"}
            self.duration.record(elapsed / 1e9, labels)
            self.size.record(nbytes, labels)
            self.throughput.record(throughput, labels)
        return rc


# --- the builder process's pipeline (OTEL_KVTRANSFER_HELPER_SETUP=common:helper_setup) ----------------------

HELPER_TOTALS_DIR = "KVT_BENCH_HELPER_TOTALS_DIR"


def helper_setup():
    """In a builder process: the same Pipeline as the engine process's, set globally; when the helper ends it
    writes its metric totals to $KVT_BENCH_HELPER_TOTALS_DIR/<pid>.json (nothing else could read them)."""
    import atexit

    from opentelemetry import metrics, trace

    pipeline = Pipeline()
    trace.set_tracer_provider(pipeline.tracer_provider)
    metrics.set_meter_provider(pipeline.meter_provider)
    atexit.register(_write_helper_totals, pipeline)


def _write_helper_totals(pipeline):
    points = pipeline.metric_points().get(semconv.METRIC_SIZE, [])
    totals = {"transfers_in_metrics": sum(p.count for p in points),
              "exemplars": sum(len(p.exemplars) for p in points)}
    write_json(os.path.join(os.environ[HELPER_TOTALS_DIR], f"{os.getpid()}.json"), totals)


PRIVATE_NET_ENV = "KVT_BENCH_PRIVATE_NET"


def in_private_network() -> None:
    """Run this script again inside a network namespace of its own with only loopback up, unless it already is:
    Mooncake's handshake listener binds all interfaces even when initialised with 127.0.0.1."""
    if os.environ.get(PRIVATE_NET_ENV) == "1":
        return
    if not (shutil.which("unshare") and shutil.which("ip")):
        print("bench: needs unshare (util-linux) and ip (iproute2) for a private network namespace", file=sys.stderr)
        sys.exit(2)
    env = dict(os.environ, **{PRIVATE_NET_ENV: "1"})
    os.execvpe("unshare", ["unshare", "-rn", "sh", "-c", 'ip link set lo up && exec "$0" "$@"', sys.executable,
                           *sys.argv], env)


def write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, sort_keys=False)
        handle.write("\n")


def stop_all(*parts) -> None:
    """Stop each part that was started (None: it never was), in order, every one even when one before it fails;
    the first failure is raised once all were tried."""
    failure = None
    for part in parts:
        if part is None:
            continue
        try:
            part.stop()
        except Exception as exc:
            failure = failure or exc
    if failure is not None:
        raise failure


def emit_json(result: dict, out=None) -> None:
    """A benchmark's result on stdout, and in `out` when given (--out)."""
    text = json.dumps(result, indent=2)
    if out:
        with open(out, "w", encoding="utf-8") as handle:
            handle.write(text)
    print(text)


def append_result(path: str, result: dict) -> None:
    """Append one run to the JSON list kept in `path`; a missing or unreadable file starts a new list."""
    runs = []
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as handle:
                runs = json.load(handle)
        except (OSError, ValueError):
            runs = []
    runs = (runs if isinstance(runs, list) else []) + [result]
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(runs, handle, indent=1)
    print(f"appended to {path}")


def main_wrapper(run):
    """`python bench/X.py [--quick] [--out FILE]`: run one benchmark and write (or print) its JSON."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run, not for quoting)")
    parser.add_argument("--out", help="write the JSON result here (default: print it)")
    args = parser.parse_args()
    result = run(quick=args.quick)
    if args.out:
        write_json(args.out, result)
    else:
        print(json.dumps(result, indent=2))
