"""Every write and read kind of Mooncake 0.3.14 (the CUDA 13 build), made for real to a receiver process, for
tests/engines/test_mooncake_cuda13.py. Runs in the 0.3.14 virtualenv (scripts/setup-mooncake-cuda13.sh), whose CUDA
driver is a stand-in (every driver call answers CUDA_ERROR_NO_DEVICE): the engine, its TCP transport and the bytes are
real; the `*_on_cuda` calls, which need a CUDA stream, fail as they would on a host without a GPU.

    python mooncake_cuda13_app.py MODE OUT_JSON      MODE: thread (in-memory SDK in this process, the pipeline
                                                     from OTEL_KVTRANSFER_PIPELINE) | process (the builder process,
                                                     its SDK from `helper_setup` below)

Each call runs under a marker span of its own (the raw send's parent), so the test finds the call's send by its
parent. The app asserts nothing: it writes what it did (each call: its kind, op, exact bytes and descriptors, the
NIC it named or its engine's, return code or exception, the times around submit and polls), what arrived (the
receiver's whole buffer and the local read buffer against a model of every copy), and, in thread mode, the spans and
metric points it recorded; the test judges.
"""

import json
import os
import sys
import time

import numpy as np
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_kvtransfer import KVTransferInstrumentor
from otel_kvtransfer import integration as kvt
from otel_kvtransfer.demo.loopback import LOOPBACK, Receiver, digest
from otel_kvtransfer.engines import mooncake as instrumented
from otel_kvtransfer.recording.clock import now_ns

SIZE = 32 << 20
DEAD = "127.0.0.1:1"  # nothing listens there
DEVICE = "lo"  # the one device the main engine is initialised with (TCP takes any name)


class Copies:
    """A model of one buffer: what it must hold after the copies made into it."""

    def __init__(self, size):
        self.image = np.zeros(size, dtype=np.uint8)
        self.next = 0

    def take(self, length, align=64):
        """A fresh region of `length` bytes (never written before)."""
        offset = self.next
        self.next = (offset + length + align - 1) // align * align + align  # a gap of zeros between regions
        assert self.next <= len(self.image), "the model ran out of room"
        return offset


def main(mode, out_path):
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ["MC_FORCE_TCP"] = "1"
    os.environ["MC_TRANSFER_TIMEOUT"] = "5"  # the dead peer's calls end within it
    exporter = reader = provider = None
    if mode == "thread":
        exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        meter_provider = MeterProvider(metric_readers=[reader])
        KVTransferInstrumentor().instrument(tracer_provider=provider, meter_provider=meter_provider)
    else:  # the builder process builds the spans; this process's own SDK only parents them
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
        metrics.set_meter_provider(MeterProvider(metric_readers=[InMemoryMetricReader()]))
        KVTransferInstrumentor().instrument()
    tracer = provider.get_tracer("mooncake-cuda13-app")

    from mooncake.engine import TransferEngine  # imported after instrument(): patched as it loads

    receiver = Receiver(SIZE, env={"MC_FORCE_TCP": "1", "MC_LOG_LEVEL": "ERROR"})
    try:
        result = _run(TransferEngine, receiver, tracer)
        result["configured_devices"] = list(instrumented.configured_devices())
        result["receiver_pid"] = receiver.pid
    finally:
        receiver.stop()
    provider.force_flush()
    if mode == "thread":
        result["spans"] = [_span(s) for s in exporter.get_finished_spans()]
        result["metrics"] = _points(reader)
    with open(out_path, "w", encoding="utf-8") as handle:
        json.dump(result, handle)


def _open(engine_class, devices):
    engine = engine_class()
    rc = engine.initialize(LOOPBACK, "P2PHANDSHAKE", "tcp", devices)
    assert rc == 0, f"initialize returned {rc}"
    return engine


def _run(engine_class, receiver, tracer):
    engine = _open(engine_class, DEVICE)
    source = np.random.default_rng(14).integers(0, 256, SIZE, dtype=np.uint8)
    sink = np.zeros(SIZE, dtype=np.uint8)  # where reads land
    assert engine.register_memory(source.ctypes.data, source.nbytes) == 0
    assert engine.register_memory(sink.ctypes.data, sink.nbytes) == 0
    src, dst, local = source.ctypes.data, receiver.base_address, sink.ctypes.data
    remote_model, local_model = Copies(SIZE), Copies(SIZE)
    session = receiver.session
    calls = []

    def call(kind, op, expected_bytes, descriptors, nic, copies, make, polls=None):
        """Run `make()` under a marker span, record what it did; `copies`: (from, to, length) offsets in bytes of
        (source -> receiver) for a write, (receiver -> sink) for a read; applied to the models only when the call
        reports success."""
        entry = {"kind": kind, "op": op, "bytes": expected_bytes, "descriptors": descriptors, "nic": nic,
                 "copies": copies}
        with tracer.start_as_current_span(kind) as marker:
            entry["marker"] = format(marker.get_span_context().span_id, "016x")
            entry["submitted"] = now_ns()
            try:
                answer = make()
            except Exception as error:  # what the engine raised is part of the record
                entry["raised"] = type(error).__qualname__
                answer = None
            entry["returned"] = now_ns()
            if polls is not None and "raised" not in entry:
                entry["polls"], answer = polls(answer)
                entry["observed"] = now_ns()
        entry["answer"] = answer if isinstance(answer, (int, bool)) or answer is None else str(answer)
        ok = "raised" not in entry and answer in (0, "ScatterTransferCompletionStatus.COMPLETED")
        entry["ok"] = ok
        if ok:
            for frm, to, length in copies:
                if op == "write":
                    remote_model.image[to:to + length] = source[frm:frm + length]
                else:
                    local_model.image[to:to + length] = remote_model.image[frm:frm + length]
        entry["arrived"] = ok and all(
            (receiver.digest(to, length) == digest(source[frm:frm + length])) if op == "write"
            else digest(sink[to:to + length]) == receiver.digest(frm, length) for frm, to, length in copies)
        calls.append(entry)
        return answer

    def write_regions(lengths):
        out, at = [], 0
        for n in lengths:
            out.append((at, remote_model.take(n), n))
            at += n + 4096
        return out

    def read_regions(written, lengths):
        """Reads of parts of what was written: (receiver offset, sink offset, length)."""
        return [(to, local_model.take(n), n) for (_, to, _), n in zip(written, lengths)]

    u64 = np.uint64

    def arrays(copies, base_from, base_to):
        return (np.array([base_from + c[0] for c in copies], dtype=u64),
                np.array([base_to + c[1] for c in copies], dtype=u64),
                np.array([c[2] for c in copies], dtype=u64))

    def wait_batch(batch_id):
        polls = [(now_ns(), None)]
        status = engine.get_batch_transfer_status([batch_id])
        return polls, status

    def poll_check(batch_id):
        polls, status = [], 0
        deadline = time.monotonic() + 30
        while status == 0 and time.monotonic() < deadline:
            before = now_ns()
            status = engine.transfer_check_status(batch_id)
            polls.append((before, status))
        return polls, 0 if status == 1 else status

    def scatter_args(copies_by_base, local_bases, remote_bases, local_start, remote_start):
        """A scatter call's arguments after the endpoint: each base with what is left of its buffer."""
        return (list(local_bases), [local_start + SIZE - lb for lb in local_bases],
                list(remote_bases), [remote_start + SIZE - rb for rb in remote_bases],
                [[c[0] for c in cs] for cs in copies_by_base], [[c[1] for c in cs] for cs in copies_by_base],
                [[c[2] for c in cs] for cs in copies_by_base])

    def poll_drain(ticket):
        """drain(0) until it answers an end: each COMPLETION_UNKNOWN is a poll that saw it unfinished."""
        polls = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            before = now_ns()
            status = ticket.drain(0)
            polls.append((before, status.name))
            if status.name != "COMPLETION_UNKNOWN":
                break
            time.sleep(0.0005)
        return polls, str(ticket.status)

    def drain(ticket):
        before = now_ns()
        status = str(ticket.drain(30_000))
        return [(before, "drain")], status if (str(ticket.status), ticket.drained) == (status, True) else "changed"

    # --- writes -----------------------------------------------------------------------------------------------
    c = write_regions([123457])[0]
    call("transfer_sync_write nic_hint positional", "write", c[2], 1, "mlx5_hinted", [c],
         lambda: engine.transfer_sync_write(session, src + c[0], dst + c[1], c[2], "", "mlx5_hinted"))
    c = write_regions([3001])[0]
    call("transfer_sync_write", "write", c[2], 1, DEVICE, [c],  # the common call (sglang's, vLLM's): the hot path
         lambda: engine.transfer_sync_write(session, src + c[0], dst + c[1], c[2]))
    c = write_regions([3002])[0]

    def in_a_request(key=77):
        kvt.begin_request(key, backend=instrumented.BACKEND, framework="test",
                          parent=trace.set_span_in_context(trace.get_current_span()))
        with kvt.transfer_scope(key):
            rc = engine.transfer_sync_write(session, src + c[0], dst + c[1], c[2])
        kvt.end_request(key)
        return rc

    call("transfer_sync_write in a transfer scope", "write", c[2], 1, DEVICE, [c], in_a_request)
    calls[-1]["request_key"] = "77"
    cs = write_regions([4096, 1, 65536, 777])
    call("batch_transfer_sync_write nic_hint keyword", "write", sum(x[2] for x in cs), 4, "mlx5_kw", cs,
         lambda: engine.batch_transfer_sync_write(session, [src + x[0] for x in cs], [dst + x[1] for x in cs],
                                                  [x[2] for x in cs], nic_hint="mlx5_kw"))
    cs = write_regions([8192, 3, 100000, 4095, 1 << 20])
    b, p, n = arrays(cs, src, dst)
    call("batch_transfer_sync_write_arrays", "write", int(n.sum()), 5, DEVICE, cs,
         lambda: engine.batch_transfer_sync_write_arrays(session, b, p, n))
    n[:] = 0  # the caller reuses its arrays: the send keeps the bytes of its own call
    cs = write_regions([65536, 4 << 20])
    b, p, n = arrays(cs, src, dst)
    call("batch_transfer_async_write_arrays get_batch_transfer_status", "write", int(n.sum()), 2, DEVICE, cs,
         lambda: engine.batch_transfer_async_write_arrays(session, b, p, n), polls=wait_batch)
    cs = write_regions([2 << 20, 17])
    b, p, n = arrays(cs, src, dst)
    call("batch_transfer_async_write_arrays transfer_check_status nic_hint", "write", int(n.sum()), 2, "mlx5_async",
         cs, lambda: engine.batch_transfer_async_write_arrays(session, b, p, n, nic_hint="mlx5_async"),
         polls=poll_check)

    def pages_call(kind, op, nic, src_pages, dst_pages, field_rows, base_src, base_dst, make):
        """field_rows: the table's (src offset, src stride, dst offset, dst stride, length) rows, offsets from
        base_src (this process's buffer) and base_dst (the receiver's); a read moves dst into src."""
        moved = [(so + sp * ss, do + dp * ds, ln) for so, ss, do, ds, ln in field_rows
                 for sp, dp in zip(src_pages, dst_pages)]
        copies = moved if op == "write" else [(d, s_, ln) for s_, d, ln in moved]
        table = np.array([[base_src + so, ss, base_dst + do, ds, ln] for so, ss, do, ds, ln in field_rows],
                         dtype=np.int64)
        return call(kind, op, sum(x[2] for x in copies), len(copies), nic, copies,
                    lambda: make(np.array(src_pages, dtype=np.int64), np.array(dst_pages, dtype=np.int64), table))

    base = remote_model.take(1 << 20)  # a region of pages on the receiver
    pages_call("batch_transfer_sync_write_pages", "write", DEVICE, [0, 2, 5, 3], [1, 0, 4, 6],
               [(0, 8192, base, 16384, 4096), (600000, 2048, base + 8192, 16384, 1000), (900000, 64, base + 12288,
                                                                                          16384, 7)],
               src, dst, lambda s_, d_, f_: engine.batch_transfer_sync_write_pages(session, s_, d_, f_))
    base = remote_model.take(1 << 20)
    pages_call("batch_transfer_sync_write_pages max_batch_size nic_hint", "write", "mlx5_pages", [7, 1, 0],
               [0, 1, 2], [(0, 4096, base, 65536, 4096), (300000, 512, base + 32768, 65536, 333)], src, dst,
               lambda s_, d_, f_: engine.batch_transfer_sync_write_pages(session, s_, d_, f_, 2, "", "mlx5_pages"))

    def scatter_call(kind, op, by_base, local_bases, remote_bases, method, polls=None):
        """by_base: per base pair, copies (offset in its local base, offset in its remote base, length)."""
        args = scatter_args(by_base, local_bases, remote_bases, src if op == "write" else local, dst)
        if op == "write":
            copies = [(lb - src + c[0], rb - dst + c[1], c[2])
                      for lb, rb, cs_ in zip(local_bases, remote_bases, by_base) for c in cs_]
        else:
            copies = [(rb - dst + c[1], lb - local + c[0], c[2])
                      for lb, rb, cs_ in zip(local_bases, remote_bases, by_base) for c in cs_]
        return call(kind, op, sum(c[2] for c in copies), len(copies), DEVICE, copies,
                    lambda: method(session, *args), polls=polls)

    def scatter_writes(lengths_by_base):
        """Two source bases, each with fresh receiver regions for its copies."""
        local_bases, remote_bases, by_base = [src, src + (2 << 20)], [], []
        for lengths in lengths_by_base:
            remote_base = remote_model.take(sum(lengths) + 64 * len(lengths) + 64)
            remote_bases.append(dst + remote_base)
            at, cs_ = 64, []
            for i, length in enumerate(lengths):
                cs_.append((i * 10000, at, length))
                at += length + 64
            by_base.append(cs_)
        return by_base, local_bases, remote_bases

    for kind, polls in (("submit_scatter_write drain", drain), ("submit_scatter_write drain(0) polls", poll_drain)):
        by_base, lb_, rb_ = scatter_writes([[1000, 65536, 3], [4 << 20, 5]])
        scatter_call(kind, "write", by_base, lb_, rb_, engine.submit_scatter_write, polls=polls)
    # A ticket its caller drops without draining it: no send can end; the same bytes again to the same place, so
    # the receiver holds the same whatever the engine did with them.
    again = calls[-1]
    ticket_args = scatter_args([[c] for c in again["copies"][:2]], [src, src], [dst, dst], src, dst)
    entry = {"kind": "submit_scatter_write dropped undrained", "op": "write", "copies": []}
    with tracer.start_as_current_span(entry["kind"]) as marker:
        entry["marker"] = format(marker.get_span_context().span_id, "016x")
        entry["answer"] = type(engine.submit_scatter_write(session, *ticket_args)).__name__
    calls.append(entry)


    def refilled_before_drain(method):
        """The caller refills its length lists for its next call before it drains this one's ticket."""
        def submit(*arguments):
            ticket = method(*arguments)
            for lengths in arguments[-1]:
                lengths[:] = [1] * len(lengths)
            return ticket
        return submit

    by_base, lb_, rb_ = scatter_writes([[4096], [4096]])
    scatter_call("submit_scatter_write refilled before drain", "write", by_base, lb_, rb_,
                 refilled_before_drain(engine.submit_scatter_write), polls=drain)
    by_base, lb_, rb_ = scatter_writes([[4096, 12345], [777]])
    scatter_call("scatter_transfer_sync_write_with_ticket", "write", by_base, lb_, rb_,
                 lambda *a: str(engine.scatter_transfer_sync_write_with_ticket(*a).status))

    c = (0, remote_model.take(4096), 4096)
    call("transfer_write_on_cuda", "write", 4096, 1, DEVICE, [],
         lambda: engine.transfer_write_on_cuda(session, src + c[0], dst + c[1], c[2]))
    call("batch_transfer_write_on_cuda nic_hint", "write", 300, 2, "mlx5_cuda", [],
         lambda: engine.batch_transfer_write_on_cuda(session, [src, src + 100], [dst, dst + 100], [100, 200], 0, "",
                                                     "mlx5_cuda"))

    # --- reads: of what the writes above put on the receiver ----------------------------------------------------
    written = [x for e in calls if e.get("ok") and e["op"] == "write" for x in _copies_of(e)]
    assert len(written) >= 12, "too few writes to read back"
    c = read_regions(written[:1], [5000])
    call("transfer_sync_read nic_hint", "read", 5000, 1, "mlx5_read", c,
         lambda: engine.transfer_sync_read(session, local + c[0][1], dst + c[0][0], 5000, nic_hint="mlx5_read"))
    cs = read_regions(written[1:4], [4096, 1, 30000])
    p, b, n = arrays(cs, dst, local)  # reads take the local (sink) addresses first, then the receiver's
    call("batch_transfer_sync_read_arrays", "read", int(n.sum()), 3, DEVICE, cs,
         lambda: engine.batch_transfer_sync_read_arrays(session, b, p, n))
    cs = read_regions(written[4:6], [8192, 100])
    p, b, n = arrays(cs, dst, local)
    call("batch_transfer_async_read_arrays", "read", int(n.sum()), 2, DEVICE, cs,
         lambda: engine.batch_transfer_async_read_arrays(session, b, p, n), polls=wait_batch)
    # pages read back from the first pages write's region: page i of each field
    first_pages = next(e for e in calls if e["kind"] == "batch_transfer_sync_write_pages")
    region = min(x[1] for x in _copies_of(first_pages))
    sink_base = local_model.take(1 << 18)
    pages_call("batch_transfer_sync_read_pages", "read", DEVICE, [0, 1], [3, 0],
               [(sink_base, 4096, region, 16384, 4096), (sink_base + 65536, 1000, region + 8192, 16384, 1000)],
               local, dst, lambda s_, d_, f_: engine.batch_transfer_sync_read_pages(session, s_, d_, f_))
    for kind, method in (("submit_scatter_read drain", lambda *a: engine.submit_scatter_read(*a)),
                         ("scatter_transfer_sync_read_with_ticket",
                          lambda *a: str(engine.scatter_transfer_sync_read_with_ticket(*a).status))):
        sources = [x for x in written if x[2] >= 1000][:3]
        local_base = local_model.take(1 << 16)
        remote_base = min(x[1] for x in sources)
        by_base = [[(i * 4096, x[1] - remote_base, 1000) for i, x in enumerate(sources)]]
        scatter_call(kind, "read", by_base, [local + local_base], [dst + remote_base], method,
                     polls=drain if "drain" in kind else None)
        local_model.take(1 << 16)
    call("transfer_read_on_cuda", "read", 64, 1, DEVICE, [],
         lambda: engine.transfer_read_on_cuda(session, local, dst, 64))

    # --- failures: a peer that is not there ---------------------------------------------------------------------
    b, p, n = np.array([src], dtype=u64), np.array([0], dtype=u64), np.array([4096], dtype=u64)
    call("dead batch_transfer_sync_write_arrays", "write", 4096, 1, DEVICE, [],
         lambda: engine.batch_transfer_sync_write_arrays(DEAD, b, p, n))
    call("dead submit_scatter_write drain", "write", 48, 2, DEVICE, [],
         lambda: engine.submit_scatter_write(DEAD, [src], [SIZE], [0], [SIZE], [[0, 64]], [[0, 64]], [[16, 32]]),
         polls=drain)
    call("dead transfer_sync_write nic_hint", "write", 16, 1, "mlx5_dead", [],
         lambda: engine.transfer_sync_write(DEAD, src, 0, 16, "", "mlx5_dead"))

    # An engine with two devices: no one NIC to name.
    two = _open(engine_class, "lo, eth0")
    assert two.register_memory(source.ctypes.data, source.nbytes) == 0
    cs = write_regions([2048])
    b, p, n = arrays(cs, src, dst)
    call("two devices batch_transfer_sync_write_arrays", "write", 2048, 1, None, cs,
         lambda: two.batch_transfer_sync_write_arrays(session, b, p, n))

    return {
        "calls": calls,
        "receiver_whole": receiver.digest(0, SIZE) == digest(remote_model.image),
        "sink_whole": digest(sink) == digest(local_model.image),
        "bytes_in_receiver": int(np.count_nonzero(remote_model.image)),
    }


def _copies_of(entry):
    return entry.get("copies", [])


def _span(span):
    return {"name": span.name, "span_id": format(span.context.span_id, "016x"),
            "parent": format(span.parent.span_id, "016x") if span.parent else None,
            "start": span.start_time, "end": span.end_time, "status": span.status.status_code.name,
            "attributes": {k: (list(v) if isinstance(v, tuple) else v) for k, v in span.attributes.items()},
            "events": [e.name for e in span.events]}


def _points(reader):
    found = {}
    data = reader.get_metrics_data()
    for resource_metrics in (data.resource_metrics if data else []):
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                for point in metric.data.data_points:
                    value = point.value if hasattr(point, "value") else point.count
                    found.setdefault(metric.name, []).append({"attributes": dict(point.attributes), "value": value})
    return found


# --- the builder process's SDK (OTEL_KVTRANSFER_HELPER_SETUP=mooncake_cuda13_app:helper_setup) --------------------

def helper_setup():
    """The helper's SDK: spans to $KVT_TEST_SPAN_FILE, and at its exit the failure counts with their attributes to
    $KVT_TEST_METRICS_DIR/<pid>.json."""
    import atexit

    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from otel_kvtransfer.building.file_exporter import OtlpJsonFileSpanExporter

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(OtlpJsonFileSpanExporter(os.environ["KVT_TEST_SPAN_FILE"])))
    reader = InMemoryMetricReader()
    trace.set_tracer_provider(provider)
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))

    def write_points():
        path = os.path.join(os.environ["KVT_TEST_METRICS_DIR"], f"{os.getpid()}.json")
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(_points(reader), handle)

    atexit.register(write_points)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
