"""One engine of bench/collector_fleet.py's fleet: a prefill process (this one) pushing KV to a decode process it
spawns, both real Mooncake engines over TCP on 127.0.0.1, both instrumented as a deployment is.

Each process sets its SDK up from OTEL_* through the distro's configurator (what `opentelemetry-instrument` does:
OTLP exporters to the agent) and calls `instrument()` with no providers, so the package decides where to build as
it would in a deployment (its default: a helper process). Every room has the shape of the observability tests'
workload (tests/support/observability/workload.py): the decode begins to receive, the prefill opens the request,
runs a forward pass per chunk on another thread (real compute, recorded), pushes each chunk's KV to REPLICAS
destinations (one `batch_transfer_sync_write` of DESCRIPTORS blocks each) and one aux payload (an async batch,
waited on), ends the request; the decode ends its receive. Rooms are paced at --rooms-per-s (0: as fast as they go).

    stdout: READY {json}  warmed up (helpers started, first exports acknowledged); waits for `go` on stdin
            RAN {json}    --seconds of rooms done and flushed (every span exported and acknowledged), with the
                          spans made and each thread's CPU over the run; waits for `exit` (or end of input)
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

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for path in (ROOT, os.path.join(ROOT, "tests")):
    if path not in sys.path:
        sys.path.insert(0, path)

LOOPBACK = "127.0.0.1"
CHUNKS = 3
REPLICAS = 2
DESCRIPTORS = 4
AUX_BYTES = 64 << 10
BACKEND = "mooncake"
FRAMEWORK = "fleet_bench"
MODEL = "tiny-test-model"
WARM_UP_ROOMS = 3
SPANS_PER_ROOM_PREFILL = 1 + CHUNKS * REPLICAS + 1 + CHUNKS  # request, kv sends, aux send, computes
SPANS_PER_ROOM_DECODE = 1  # receive
OURS_PREFIX = "otel-kvtransfer-"  # the package's recorder thread
SDK_PREFIXES = ("Otel",)  # the SDK's batch span processor and periodic metric reader threads
MAX_NATIVE_NAMES = 32


def _instrument(service: str, instance: str):
    """The SDK from OTEL_*, as opentelemetry-instrument sets it up, then the package on the global providers."""
    os.environ["OTEL_SERVICE_NAME"] = service
    os.environ["OTEL_RESOURCE_ATTRIBUTES"] = f"service.instance.id={instance}"
    from opentelemetry.distro import OpenTelemetryConfigurator

    OpenTelemetryConfigurator().configure()
    from otel_kvtransfer import KVTransferInstrumentor

    instrumentor = KVTransferInstrumentor()
    instrumentor.instrument()
    return instrumentor


def _helper_pid(instrumentor):
    link = getattr(instrumentor, "_link", None)  # the helper's link, where the package builds in a helper
    return link.pid() if link is not None else None


def _flush() -> None:
    """Every span built, exported and acknowledged (with a helper: its flush too), and the metrics."""
    from opentelemetry import metrics, trace

    trace.get_tracer_provider().force_flush(30_000)
    meter_provider = metrics.get_meter_provider()
    if hasattr(meter_provider, "force_flush"):
        meter_provider.force_flush(30_000)


class ThreadClock:
    """CPU per thread of this process (/proc/self/task/<tid>/schedstat, ns), filed under an owner."""

    def __init__(self, roles: dict):
        self._roles = roles  # native tid -> owner, for the threads this program itself runs
        self._start_process = time.process_time_ns()
        self._start = self._read()

    @staticmethod
    def _read() -> dict:
        found = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/schedstat", encoding="ascii") as handle:
                    ns = int(handle.read().split()[0])
                with open(f"/proc/self/task/{tid}/comm", encoding="ascii", errors="replace") as handle:
                    comm = handle.read().strip()[:32]
            except (OSError, ValueError, IndexError):
                continue
            found[int(tid)] = (comm, ns)
        return found

    def stop(self) -> dict:
        """Seconds of CPU since the start by owner; `native` (threads Python did not start: Mooncake's, gRPC's
        core) also by thread name; `ended` is what threads that ended in between used."""
        end, process_ns = self._read(), time.process_time_ns() - self._start_process
        python = {t.native_id: t.name for t in threading.enumerate()}
        owners = {"engine_calling": 0, "engine_compute": 0, "recorder": 0, "sdk": 0, "native": 0,
                  "other_python": 0, "ended": 0}
        native_by_name: dict = {}
        live = 0
        for tid, (comm, ns) in end.items():
            used = ns - self._start.get(tid, (comm, 0))[1]
            live += used
            name = python.get(tid)
            if tid in self._roles:
                owner = self._roles[tid]
            elif name is None:
                owner = "native"
                if comm in native_by_name or len(native_by_name) < MAX_NATIVE_NAMES:
                    native_by_name[comm] = native_by_name.get(comm, 0) + used
            elif name.startswith(OURS_PREFIX):
                owner = "recorder"
            elif name.startswith(SDK_PREFIXES):
                owner = "sdk"
            else:
                owner = "other_python"
            owners[owner] += used
        owners["ended"] = max(process_ns - live, 0)
        result = {k: round(v / 1e9, 4) for k, v in owners.items()}
        result["process"] = round(process_ns / 1e9, 4)
        result["native_by_name"] = {k: round(v / 1e9, 4) for k, v in sorted(native_by_name.items())}
        return result


def _decode_main(conn, index: int, buffer_bytes: int) -> None:
    """The decode engine: a registered buffer, and a kv_transfer.receive span per room it is told about."""
    import numpy as np

    os.environ["OTEL_KVTRANSFER_REQUEST_TTL_S"] = "120"  # a receive sees no activity until its end
    instrumentor = _instrument("kvt-fleet-decode", f"decode-{index}")
    from support.observability.parts import mooncake_tcp_engine

    from otel_kvtransfer import integration

    engine = mooncake_tcp_engine(LOOPBACK)
    buffer = np.zeros(buffer_bytes, dtype=np.uint8)
    conn.send((engine.get_rpc_port(), buffer.ctypes.data, engine.register_memory(buffer.ctypes.data, buffer.nbytes)))
    clock = None
    while True:
        if not conn.poll(300):
            break
        message = conn.recv()
        if message[0] == "begin":
            integration.begin_receive(message[1], backend=BACKEND, framework=FRAMEWORK, expected_bytes=message[2],
                                      attributes={"gen_ai.request.model": MODEL})
        elif message[0] == "end":
            integration.end_receive(message[1], error_type=message[2])
        elif message[0] == "start":
            clock = ThreadClock({threading.get_native_id(): "engine_calling"})
        elif message[0] == "flush":
            _flush()
            conn.send((_helper_pid(instrumentor), clock.stop() if clock is not None else None))
        else:
            break


def _forward_pass(size: int = 96):
    import numpy as np

    start = time_ns()
    a = np.random.default_rng(0).random((size, size))
    for _ in range(4):
        a = a @ a
        a /= a.max()
    return start, time_ns()


class PrefillEngine:
    """The prefill side: a Mooncake engine, its source buffer, the decode's buffer as destination."""

    def __init__(self, conn, chunk_bytes: int):
        import numpy as np
        from support.observability.parts import mooncake_tcp_engine

        port, self.remote, rc = conn.recv()
        if rc != 0:
            raise RuntimeError(f"decode register_memory returned {rc}")
        self.conn, self.chunk = conn, chunk_bytes
        self.session = f"{LOOPBACK}:{port}"
        self.engine = mooncake_tcp_engine(LOOPBACK)
        size = REPLICAS * CHUNKS * chunk_bytes + AUX_BYTES
        self.source = np.random.default_rng(1).integers(0, 255, size, dtype=np.uint8)
        if self.engine.register_memory(self.source.ctypes.data, self.source.nbytes) != 0:
            raise RuntimeError("prefill register_memory failed")
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="forward")
        self.compute_tid = self.pool.submit(threading.get_native_id).result()
        self.failed = 0

    def room(self, room: int) -> None:
        from otel_kvtransfer import integration

        base = self.source.ctypes.data
        integration.begin_request(room, backend=BACKEND, framework=FRAMEWORK,
                                  attributes={"gen_ai.request.model": MODEL})
        self.conn.send(("begin", room, REPLICAS * CHUNKS * self.chunk + AUX_BYTES))
        compute = self.pool.submit(_forward_pass)
        error = None
        block = self.chunk // DESCRIPTORS
        for chunk in range(CHUNKS):
            start_ns, end_ns = compute.result(timeout=30)
            integration.record_compute([room], start_ns, end_ns, chunk_index=chunk)
            if chunk + 1 < CHUNKS:
                compute = self.pool.submit(_forward_pass)  # the next chunk's pass, while this one's KV moves
            for dest in range(REPLICAS):
                offset = (dest * CHUNKS + chunk) * self.chunk
                with integration.transfer_scope(room, chunk_index=chunk, payload="kv", destination_index=dest,
                                                replica_factor=REPLICAS, is_last_chunk=chunk == CHUNKS - 1):
                    rc = self.engine.batch_transfer_sync_write(
                        self.session, [base + offset + i * block for i in range(DESCRIPTORS)],
                        [self.remote + offset + i * block for i in range(DESCRIPTORS)], [block] * DESCRIPTORS)
                if rc != 0:
                    self.failed += 1
                    error = "transfer_failed"
        offset = REPLICAS * CHUNKS * self.chunk
        with integration.transfer_scope(room, chunk_index=CHUNKS - 1, payload="aux", is_last_chunk=True):
            batch = self.engine.batch_transfer_async_write(self.session, [base + offset], [self.remote + offset],
                                                           [AUX_BYTES])
            rc = self.engine.get_batch_transfer_status([batch]) if batch and batch > 0 else -1
        if rc != 0:
            self.failed += 1
            error = error or "transfer_failed"
        integration.end_request(room, error_type=error)
        self.conn.send(("end", room, error))

    def bytes_per_room(self) -> int:
        return REPLICAS * CHUNKS * self.chunk + AUX_BYTES


def _line(kind: str, data: dict) -> None:
    print(f"{kind} {json.dumps(data)}", flush=True)


def _wait_for(word: str) -> bool:
    """True when `word` arrives on stdin; False at end of input."""
    for line in sys.stdin:
        if line.strip() == word:
            return True
    return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rooms-per-s", type=float, default=20.0)
    parser.add_argument("--chunk-kib", type=int, default=1024)
    args = parser.parse_args()
    os.environ.setdefault("MC_FORCE_TCP", "1")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    chunk = max(args.chunk_kib, 4) << 10
    instrumentor = _instrument("kvt-fleet-prefill", f"prefill-{args.index}")
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    decode = ctx.Process(target=_decode_main, args=(child, args.index, REPLICAS * CHUNKS * chunk + AUX_BYTES),
                         daemon=True)
    decode.start()
    try:
        if not conn.poll(120):
            raise RuntimeError("the decode engine did not start within 120 s")
        prefill = PrefillEngine(conn, chunk)
        room_base = (args.index + 1) * 10_000_000
        for room in range(WARM_UP_ROOMS):  # helpers start, connections open, first exports: before the clock
            prefill.room(room_base + room)
        conn.send(("flush",))
        _flush()
        decode_helper, _ = conn.recv()
        _line("READY", {"pid": os.getpid(), "decode_pid": decode.pid, "helper_pid": _helper_pid(instrumentor),
                        "decode_helper_pid": decode_helper})
        if not _wait_for("go"):
            return 0
        conn.send(("start",))
        clock = ThreadClock({threading.get_native_id(): "engine_calling", prefill.compute_tid: "engine_compute"})
        start = time.monotonic()
        stop_at = start + args.seconds
        period = 1.0 / args.rooms_per_s if args.rooms_per_s > 0 else 0.0
        due, rooms, failed_before = start, 0, prefill.failed
        while time.monotonic() < stop_at:
            prefill.room(room_base + WARM_UP_ROOMS + rooms)
            rooms += 1
            if period:
                due += period
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(min(wait, max(stop_at - time.monotonic(), 0)))
                else:
                    due = time.monotonic()  # behind: no burst to catch up
        ran_s = time.monotonic() - start
        conn.send(("flush",))
        _flush()
        threads = clock.stop()
        decode_helper, decode_threads = conn.recv()
        _line("RAN", {"rooms": rooms, "seconds": round(ran_s, 3), "flushed_s": round(time.monotonic() - start, 3),
                      "spans_made": rooms * (SPANS_PER_ROOM_PREFILL + SPANS_PER_ROOM_DECODE),
                      "bytes": rooms * prefill.bytes_per_room(), "failed_transfers": prefill.failed - failed_before,
                      "threads": threads, "decode_threads": decode_threads,
                      "helper_pid": _helper_pid(instrumentor), "decode_helper_pid": decode_helper})
        _wait_for("exit")
    finally:
        try:
            conn.send(("stop",))
        except (OSError, EOFError):
            pass
        decode.join(15)
        if decode.is_alive():
            decode.kill()  # the decode process this one spawned, by its PID
            decode.join(5)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as exc:  # one line for the orchestrator, which shows it
        print(f"fleet_engine: {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr)
        sys.exit(1)
