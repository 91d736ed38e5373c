"""`otel-kvtransfer demo`: a prefill engine pushing KV to K decode engines through the real Mooncake engine.

Everything moves real bytes over TCP on 127.0.0.1: this process is the prefill engine; each decode engine is a
spawned process with a registered buffer. Per request (the seed scenario): the cached prefix is sent early as
chunk 0, then chunked prefill computes 8192 and 1655 tokens, and chunk i is sent while chunk i+1 is computed
(compute is simulated by sleeping, so the transfers have the CPU); the last chunk carries the aux payload. One
transfer worker sends each chunk to the K destinations one after another, as sglang does for MLA fan-out.

It prints, per request, what the spans say (wire and logical bytes, transfers, busy time, true throughput, compute
overlap, and the tail: the time from the end of the request's last compute to its last byte, and the part of it in
which none of its transfers moved bytes) beside the legacy figure that sglang computes (KV bytes x replicas / 2^30
over the time from the last chunk's enqueue to success), and the link figure measured in the same run: plain
(uninstrumented) writes shaped exactly like one request's sends (the same chunks, one descriptor per KV page),
several rounds before the requests and several after, the best round as the figure and all rounds as its spread. On
a shared machine a request can still run faster than every calibration round; the table then says so and by how
much, instead of calling the figure a ceiling.
"""

import argparse
import json
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple, Type

from otel_kvtransfer import semconv

GIB = float(1 << 30)
LINK_ROUNDS = 5  # calibration rounds before the requests, and again after them


@dataclass
class DemoConfig:
    requests: int = 6
    fanout: int = 2
    prefix_tokens: int = 2048
    chunk_tokens: List[int] = field(default_factory=lambda: [8192, 1655])
    bytes_per_token: int = 8192
    page_tokens: int = 64
    aux_bytes: int = 4096
    compute_us_per_token: float = 60.0
    out_dir: str = "kvtransfer-demo"
    otlp: bool = False
    console: bool = False
    engine: str = "mooncake"

    @property
    def request_tokens(self) -> int:
        return self.prefix_tokens + sum(self.chunk_tokens)

    @property
    def kv_bytes(self) -> int:
        return self.request_tokens * self.bytes_per_token


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DemoConfig()
    parser.add_argument("--engine", choices=("mooncake", "nixl"), default=d.engine,
                        help="transfer engine: Mooncake over TCP, or NIXL over UCX (default %(default)s)")
    parser.add_argument("--requests", type=int, default=d.requests, help="requests to run (default %(default)s)")
    parser.add_argument("--fanout", type=int, default=d.fanout,
                        help="decode engines receiving the same KV, the replica factor (default %(default)s)")
    parser.add_argument("--prefix-tokens", type=int, default=d.prefix_tokens,
                        help="cached prefix sent early as chunk 0; 0 disables it (default %(default)s)")
    parser.add_argument("--chunks", default=",".join(map(str, d.chunk_tokens)),
                        help="tokens of each prefill chunk (default %(default)s)")
    parser.add_argument("--bytes-per-token", type=int, default=d.bytes_per_token,
                        help="KV bytes per token over all layers (default %(default)s)")
    parser.add_argument("--page-tokens", type=int, default=d.page_tokens,
                        help="tokens per KV page, one descriptor each (default %(default)s)")
    parser.add_argument("--compute-us-per-token", type=float, default=d.compute_us_per_token,
                        help="simulated prefill compute per token (default %(default)s)")
    parser.add_argument("--out-dir", default=d.out_dir, help="where spans.jsonl and results go (default %(default)s)")
    parser.add_argument("--otlp", action="store_true",
                        help="also export spans and metrics over OTLP (OTEL_EXPORTER_OTLP_*)")
    parser.add_argument("--console", action="store_true", help="also print spans to the console")


def config_from_args(args) -> DemoConfig:
    try:
        chunks = [int(x) for x in str(args.chunks).split(",") if x.strip()]
    except ValueError:
        raise SystemExit("otel-kvtransfer demo: --chunks takes comma-separated token counts, "
                         f"not {args.chunks!r}") from None
    cfg = DemoConfig(
        requests=args.requests, fanout=args.fanout, prefix_tokens=args.prefix_tokens, chunk_tokens=chunks,
        bytes_per_token=args.bytes_per_token, page_tokens=args.page_tokens,
        compute_us_per_token=args.compute_us_per_token, out_dir=args.out_dir, otlp=args.otlp, console=args.console,
        engine=getattr(args, "engine", DemoConfig.engine))
    problems = []
    if cfg.requests < 1:
        problems.append("--requests must be at least 1")
    if not 1 <= cfg.fanout <= 8:
        problems.append("--fanout must be between 1 and 8")
    if cfg.prefix_tokens < 0 or not chunks or min(chunks) < 1:
        problems.append("--prefix-tokens must be >= 0 and every chunk >= 1 token")
    if cfg.bytes_per_token < 1 or cfg.page_tokens < 1:
        problems.append("--bytes-per-token and --page-tokens must be positive")
    if cfg.kv_bytes > (1 << 31):
        problems.append(f"one request would move {cfg.kv_bytes / GIB:.1f} GiB per destination; keep it under 2 GiB")
    if cfg.compute_us_per_token < 0:
        problems.append("--compute-us-per-token must be >= 0")
    if problems:
        raise SystemExit("otel-kvtransfer demo: " + "; ".join(problems))
    return cfg


def _setup_tracing(cfg: DemoConfig, span_file: str):
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    from otel_kvtransfer.building.file_exporter import OtlpJsonFileSpanExporter

    resource = Resource.create({"service.name": "kv-prefill"})
    tracer_provider = TracerProvider(resource=resource)
    tracer_provider.add_span_processor(BatchSpanProcessor(OtlpJsonFileSpanExporter(span_file)))
    readers = []
    if cfg.console:
        tracer_provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    if cfg.otlp:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    meter_provider = MeterProvider(resource=resource, metric_readers=readers)
    return tracer_provider, meter_provider


class _Destination:
    def __init__(self, receiver, index):
        self.receiver, self.index = receiver, index


def _pages(start_token: int, tokens: int, cfg: DemoConfig, src_base: int, dst_base: int):
    """Descriptors of one chunk: one per KV page (source, destination, length)."""
    srcs, dsts, lens = [], [], []
    token = start_token
    end = start_token + tokens
    while token < end:
        n = min(cfg.page_tokens, end - token)
        offset = token * cfg.bytes_per_token
        srcs.append(src_base + offset)
        dsts.append(dst_base + offset)
        lens.append(n * cfg.bytes_per_token)
        token += n
    return srcs, dsts, lens


def measure_link_capacity(engine, receiver, src_base: int, nbytes: int, rounds: int = 3) -> float:
    """Bytes per second of plain, uninstrumented writes of `nbytes` to one receiver (the best of `rounds`); used
    to open a connection before anything is timed."""
    from opentelemetry.instrumentation.utils import suppress_instrumentation

    descriptor = 4 << 20
    lens = [min(descriptor, nbytes - off) for off in range(0, nbytes, descriptor)]
    srcs = [src_base + off for off in range(0, nbytes, descriptor)]
    dsts = [receiver.base_address + off for off in range(0, nbytes, descriptor)]
    best = 0.0
    with suppress_instrumentation():
        for _ in range(rounds):
            start = time.perf_counter()
            rc = engine.batch_transfer_sync_write(receiver.session, srcs, dsts, lens)
            elapsed = time.perf_counter() - start
            if rc == 0 and elapsed > 0:
                best = max(best, nbytes / elapsed)
    return best


def link_round(engine, receiver, src_base: int, cfg: "DemoConfig") -> Optional[float]:
    """One calibration round shaped like one request's KV sends to one destination: each chunk one batch of
    one descriptor per page, as `run_request` sends it. Bytes over the summed time of the chunk writes (a
    request's busy time, when its sends do not overlap); None when a write failed."""
    from opentelemetry.instrumentation.utils import suppress_instrumentation

    chunks = ([cfg.prefix_tokens] if cfg.prefix_tokens else []) + list(cfg.chunk_tokens)
    token, nbytes, busy = 0, 0, 0.0
    with suppress_instrumentation():
        for tokens in chunks:
            srcs, dsts, lens = _pages(token, tokens, cfg, src_base, receiver.base_address)
            start = time.perf_counter()
            rc = engine.batch_transfer_sync_write(receiver.session, srcs, dsts, lens)
            busy += time.perf_counter() - start
            if rc != 0:
                return None
            nbytes += sum(lens)
            token += tokens
    return nbytes / busy if busy > 0 else None


def link_figure(before: List[Optional[float]], after: List[Optional[float]]) -> dict:
    """The link figure of a run: the best round, the spread of all rounds, and the rounds themselves (By/s)."""
    rounds = [r for r in before + after if r]
    return {"best_bytes_per_s": max(rounds, default=0.0), "worst_bytes_per_s": min(rounds, default=0.0),
            "rounds_before": before, "rounds_after": after,
            "what": "plain writes shaped like one request's KV sends to one destination (one descriptor per "
                    "page, one batch per chunk), bytes over the summed write time; best and spread of the rounds "
                    "measured before and after the requests"}


def _transfer_worker(work: "queue.Queue", result: Dict[str, Any], room, engine, src, destinations, cfg: DemoConfig,
                     kvt) -> None:
    """Like sglang's transfer worker: take a chunk, send it to each destination in turn."""
    aux_offset = cfg.kv_bytes  # aux lives after the KV in both buffers
    while True:
        item = work.get()
        if item is None:
            return
        index, start_token, tokens, is_last, early = item
        for dest in destinations:
            srcs, dsts, lens = _pages(start_token, tokens, cfg, src.ctypes.data, dest.receiver.base_address)
            with kvt.transfer_scope(room, chunk_index=index, payload="kv", destination_index=dest.index,
                                    replica_factor=len(destinations), is_last_chunk=is_last,
                                    prefix_early_send=early):
                rc = engine.batch_transfer_sync_write(dest.receiver.session, srcs, dsts, lens)
            if rc != 0:
                result["error"] = "transfer_failed"
            if is_last:
                with kvt.transfer_scope(room, chunk_index=index, payload="aux", destination_index=dest.index,
                                        replica_factor=len(destinations), is_last_chunk=True):
                    rc = engine.transfer_sync_write(dest.receiver.session, src.ctypes.data + aux_offset,
                                                    dest.receiver.base_address + aux_offset, cfg.aux_bytes)
                if rc != 0:
                    result["error"] = "aux_send_failed"
        if is_last:
            result["done_ns"] = time.time_ns()


def run_request(room, engine, src, destinations, cfg: DemoConfig, kvt, backend: str):
    """One request: early prefix send, chunked compute overlapping the previous chunk's send, aux on the last."""
    work: "queue.Queue" = queue.Queue()
    result: Dict[str, Any] = {"error": None}
    chunks = ([(cfg.prefix_tokens, True)] if cfg.prefix_tokens else []) + [(t, False) for t in cfg.chunk_tokens]

    for dest in destinations:
        dest.receiver.begin_receive(room, expected_bytes=cfg.kv_bytes + cfg.aux_bytes)
    started = time.time_ns()
    kvt.begin_request(room, backend=backend, start_ns=started)
    worker = threading.Thread(target=_transfer_worker, args=(work, result, room, engine, src, destinations, cfg, kvt),
                              name="transfer-worker", daemon=True)
    worker.start()
    token = 0
    last_enqueue_ns = started
    for index, (tokens, early) in enumerate(chunks):
        is_last = index == len(chunks) - 1
        if not early:  # the cached prefix needs no compute: it is sent at once
            compute_start = time.time_ns()
            time.sleep(tokens * cfg.compute_us_per_token / 1e6)
            kvt.record_compute([room], compute_start, time.time_ns(), chunk_index=index)
        last_enqueue_ns = time.time_ns()
        work.put((index, token, tokens, is_last, early))
        token += tokens
    work.put(None)
    worker.join()
    done = result.get("done_ns", time.time_ns())
    kvt.end_request(room, error_type=result["error"], end_ns=done)
    for dest in destinations:
        dest.receiver.end_receive(room, error_type=result["error"])
    # sglang's legacy figure: KV bytes x replicas (no aux) / 2^30 over last enqueue -> success.
    legacy_bytes = cfg.kv_bytes * len(destinations)
    return {
        "room": room,
        "legacy_gib_s": legacy_bytes / GIB / max((done - last_enqueue_ns) / 1e9, 1e-9),
        "enqueue_to_done_gib_s": legacy_bytes / GIB / max((done - started) / 1e9, 1e-9),
        "error": result["error"],
    }


def _request_spans(span_file: str) -> dict:
    """request key -> attributes of its kv_transfer.request span, read back from the span file."""
    from otel_kvtransfer.tools.spanfile import read_spans

    return {span.attributes[semconv.REQUEST_KEY]: span.attributes for span in read_spans(span_file)
            if span.name == semconv.SPAN_REQUEST}


def _ms(seconds: Optional[float]) -> str:
    """A tail figure in ms; '-' where the request span has none (its compute was not known)."""
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def format_table(rows, link) -> str:
    """The demo's table; `link` is `link_figure()`'s dict (or a bare By/s figure, for older callers)."""
    if not isinstance(link, dict):
        link = {"best_bytes_per_s": link, "worst_bytes_per_s": link, "rounds_before": [link], "rounds_after": []}
    head = (f"{'room':>6} {'chunks':>6} {'xfers':>5} {'wire MiB':>9} {'logical MiB':>11} {'busy ms':>8} "
            f"{'true GiB/s':>10} {'legacy GiB/s':>12} {'legacy/true':>11} {'enq->done GiB/s':>15} {'overlap':>7} "
            f"{'tail ms':>7} {'queued ms':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['room']:>6} {r['chunks']:>6} {r['transfers']:>5} {r['wire_bytes'] / 2**20:>9.1f} "
            f"{r['logical_bytes'] / 2**20:>11.1f} {r['busy_s'] * 1e3:>8.1f} {r['true_gib_s']:>10.2f} "
            f"{r['legacy_gib_s']:>12.2f} {r['legacy_gib_s'] / max(r['true_gib_s'], 1e-12):>10.1f}x "
            f"{r['enqueue_to_done_gib_s']:>15.2f} {r['overlap_ratio']:>7.0%} {_ms(r.get('tail_s')):>7} "
            f"{_ms(r.get('tail_queued_s')):>9}")
    best, worst = link["best_bytes_per_s"] / GIB, link["worst_bytes_per_s"] / GIB
    count = len([r for r in link["rounds_before"] + link["rounds_after"] if r])
    lines.append(f"link figure of this run: {best:.2f} GiB/s, the best of {count} rounds of plain writes shaped like "
                 f"one request's sends, before and after the requests (spread {worst:.2f} - {best:.2f} GiB/s)")
    faster = [r for r in rows if r["true_gib_s"] > best > 0]
    if faster:
        top = max(r["true_gib_s"] for r in faster)
        lines.append(f"{len(faster)} of {len(rows)} requests ran faster than every calibration round (up to "
                     f"{top:.2f} GiB/s, {top / best - 1:.0%} above): on a shared machine the link figure is a "
                     "measurement with the spread above, not a ceiling")
    return "\n".join(lines)


def run(cfg: DemoConfig, progress=sys.stderr) -> dict:
    import numpy as np

    from otel_kvtransfer.wiring.instrumentor import KVTransferInstrumentor

    Receiver, open_engine, backend = _engine_parts(cfg)
    # Mooncake logs every connection at INFO through glog; keep the demo's terminal for the demo's own output.
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.makedirs(cfg.out_dir, exist_ok=True)
    span_file = os.path.join(cfg.out_dir, "spans.jsonl")
    if os.path.exists(span_file):
        os.remove(span_file)
    size = cfg.kv_bytes + cfg.aux_bytes
    _announce(cfg, progress)
    tracer_provider, meter_provider = _setup_tracing(cfg, span_file)
    instrumentor = KVTransferInstrumentor()
    receivers = []
    try:
        for i in range(cfg.fanout):
            print(f"demo: starting decode engine {i + 1}/{cfg.fanout} ...", file=progress)
            receivers.append(Receiver(size, env={"MC_FORCE_TCP": "1"}, span_file=span_file,
                                      service_name=f"kv-decode-{i}"))
        engine = open_engine()
        src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
        if engine.register_memory(src.ctypes.data, src.nbytes) != 0:
            raise RuntimeError("register_memory failed for the prefill buffer")
        for receiver in receivers:  # open every connection before timing anything
            measure_link_capacity(engine, receiver, src.ctypes.data, 1 << 20, rounds=1)
        before = [link_round(engine, receivers[0], src.ctypes.data, cfg) for _ in range(LINK_ROUNDS)]
        instrumentor.instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)
        destinations = [_Destination(r, i) for i, r in enumerate(receivers)]
        legacy, verified = _run_requests(engine, src, destinations, cfg, backend, progress)
        after = [link_round(engine, receivers[0], src.ctypes.data, cfg) for _ in range(LINK_ROUNDS)]
        link = link_figure(before, after)
    finally:
        instrumentor.uninstrument()
        tracer_provider.shutdown()
        meter_provider.shutdown()
        for receiver in receivers:
            receiver.stop()
    return _summary(cfg, span_file, legacy, link, verified, progress)


def _run_requests(engine, src, destinations, cfg: DemoConfig, backend: str, progress) -> Tuple[list, bool]:
    """The demo's requests one after another, each one's bytes checked at every decode engine: (each request's
    own figures, whether every request's bytes arrived whole)."""
    from otel_kvtransfer.demo.loopback import digest
    from otel_kvtransfer.recording import integration as kvt

    legacy, expected, verified = [], digest(src), True
    receivers = [dest.receiver for dest in destinations]
    for n in range(cfg.requests):
        room = 1000 + n
        for receiver in receivers:  # wipe the decode buffers, so each request's bytes are checked on their own
            receiver.fill(0)
        legacy.append(run_request(room, engine, src, destinations, cfg, kvt, backend))
        ok = legacy[-1]["error"] is None and all(r.digest(0, src.nbytes) == expected for r in receivers)
        verified = verified and ok
        print(f"demo: request {n + 1}/{cfg.requests} (room {room}) done, bytes verified on "
              f"{len(receivers)} decode engine(s): {'yes' if ok else 'NO'}", file=progress)
    return legacy, verified


def _summary(cfg: DemoConfig, span_file: str, legacy: list, link: dict, verified: bool, progress) -> dict:
    """The run's results beside its request spans, written to results.json and table.txt in the output folder."""
    spans = _request_spans(span_file)
    rows = [_row(item, spans.get(str(item["room"]), {})) for item in legacy]
    summary = {"config": cfg.__dict__, "link_capacity_bytes_per_s": link["best_bytes_per_s"], "link": link,
               "bytes_verified": verified, "requests": rows, "span_file": span_file}
    with open(os.path.join(cfg.out_dir, "results.json"), "w", encoding="utf-8") as handle:
        json.dump(summary, handle, indent=2)
    table = format_table(rows, link)
    with open(os.path.join(cfg.out_dir, "table.txt"), "w", encoding="utf-8") as handle:
        handle.write(table + "\n")
    summary["table"] = table
    summary["next_steps"] = _timeline_pointer(span_file, progress)
    return summary


def _engine_parts(cfg: DemoConfig) -> Tuple[Type[Any], Callable[..., Any], str]:
    """(its receiver process's class, what opens it here, its backend name) of the engine the demo runs."""
    if cfg.engine == "nixl":
        from otel_kvtransfer.demo import nixl_loopback
        from otel_kvtransfer.engines.nixl import BACKEND as NIXL

        return nixl_loopback.Receiver, nixl_loopback.open_engine, NIXL
    from otel_kvtransfer.demo import loopback
    from otel_kvtransfer.engines.mooncake import BACKEND as MOONCAKE

    return loopback.Receiver, loopback.open_engine, MOONCAKE


def _announce(cfg: DemoConfig, progress) -> None:
    print(f"demo: {cfg.requests} requests of {cfg.request_tokens} tokens ({cfg.kv_bytes / 2**20:.0f} MiB KV), "
          f"fan-out {cfg.fanout}, over {'NIXL (UCX)' if cfg.engine == 'nixl' else 'Mooncake TCP'} on 127.0.0.1",
          file=progress)
    if cfg.engine == "nixl":
        print("demo: note: UCX is limited to the loopback device (UCX_NET_DEVICES=lo)", file=progress)
    else:
        print("demo: note: Mooncake's handshake listener binds all interfaces even when initialised with "
              "127.0.0.1", file=progress)


def _row(item: Dict[str, Any], attrs: Dict[str, Any]) -> Dict[str, Any]:
    """One request's row of the table: what the demo measured beside what its request span says."""
    return {
        "room": item["room"],
        "chunks": attrs.get("kv_transfer.chunk_count", 0),
        "transfers": attrs.get("kv_transfer.transfer_count", 0),
        "wire_bytes": attrs.get("kv_transfer.bytes", 0),
        "logical_bytes": attrs.get("kv_transfer.logical_bytes", 0),
        "busy_s": attrs.get("kv_transfer.busy_s", 0.0),
        "true_gib_s": attrs.get("kv_transfer.throughput", 0.0) / GIB,
        "overlap_ratio": attrs.get("kv_transfer.compute_overlap_ratio", 0.0),
        "tail_s": attrs.get(semconv.TAIL_S),
        "tail_queued_s": attrs.get(semconv.TAIL_QUEUED_S),
        "legacy_gib_s": item["legacy_gib_s"],
        "enqueue_to_done_gib_s": item["enqueue_to_done_gib_s"],
        "error": item["error"],
    }


def _timeline_pointer(span_file: str, progress) -> List[str]:
    """Render the timeline of this run beside the span file and say where it is."""
    try:
        from otel_kvtransfer.tools.timeline import timeline_from_file

        print("demo: rendering the timeline ...", file=progress)
        paths = timeline_from_file(span_file)
    except Exception as exc:
        return [f"timeline: not rendered ({exc}); try `otel-kvtransfer timeline {span_file}`"]
    return [f"timeline: {paths['html']} (picture: {paths['png']})",
            f"details: otel-kvtransfer summarize {span_file}"]
