"""The device check: compute on the device's clock, and NIXL VRAM-to-VRAM writes, on one GPU.

Made for a machine with one GPU and no network, with only the image's torch and what the run carries: the
repository, the OpenTelemetry wheels and one NIXL build, fetched beforehand into an ignored folder of the
checkout (`bash bench/device_wheels.sh`, bench/README.md). Unpacked into a temporary folder; nothing installed.

    python bench/gpu_check.py --wheels bench/device_wheels --out gpu_check.json

(a) Compute: a forward-like workload (matmuls on a side stream, launched as sglang's overlap scheduler launches
    a forward: behind the scheduler's stream, two batches in flight) through the package's own sglang
    `run_batch` wrapper. Each batch's `kv_transfer.compute` span is compared with reference timing events the
    workload records around its own kernels (`torch.cuda.Event.elapsed_time`): durations of batches that queued
    behind the previous one (their start is the previous one's end), spacing of every batch's end from the
    first's (the anchors and their drift over the whole run), and where the host saw each forward end.
(b) NIXL: writes of a GPU buffer into another process's GPU buffer (UCX, CUDA IPC) between two NIXL agents; one
    process with two agents when the second process cannot reach the first's memory. Every write is a
    `kv_transfer.send` with its exact bytes and descriptors; the destination's bytes equal the source's; no send
    is faster than the device's own device-to-device copy of the same size.

One JSON file holds every figure and check. Exit status: 0 every check passed, or no device (one line says so and
nothing is measured); 1 a check failed; 2 bad arguments or wheels that cannot be used.
`--nixl-memory DRAM` runs (b) on host memory, with or without a device (what the test suite runs on CPU).
"""

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import zipfile
from types import SimpleNamespace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMISE_NS = 50_000  # the device clock's promise: a compute span within 50 us of the device's own times
FORWARD_BOUND_S = 60.0  # a forward the host never sees end within this is a failed check, not a hang


# --- what the run carries -------------------------------------------------------------------------------------

def wheel_fits_this_python(name: str) -> bool:
    """A wheel built for another CPython (cp312 on 3.11) would not load: left out, and said so."""
    parts = name[:-4].split("-")
    if len(parts) < 5:
        return False
    abi, minor = parts[-2], sys.version_info.minor

    def fits(tag: str) -> bool:
        if tag.startswith("py"):
            return tag.startswith("py3")
        version = tag[3:] if tag.startswith("cp3") else ""
        if not version.isdigit():
            return False
        return int(version) == minor or (abi == "abi3" and int(version) <= minor)

    return any(fits(tag) for tag in parts[-3].split("."))


def unpack_wheels(folder: str, target: str) -> dict:
    """Every usable wheel of `folder` unpacked into `target` (its purelib/platlib data too), which goes first on
    sys.path. Member names are untrusted: an absolute one, or one with a `..`, is left out, and nothing lands
    outside `target`."""
    used, skipped = [], []
    root = os.path.realpath(target)
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".whl"):
            continue
        if not wheel_fits_this_python(name):
            skipped.append(name)
            continue
        with zipfile.ZipFile(os.path.join(folder, name)) as wheel:
            for member in wheel.infolist():
                parts = member.filename.split("/")
                if member.filename.startswith("/") or ".." in parts:
                    continue
                if parts[0].endswith(".data"):
                    if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                        continue  # scripts, headers, data: not needed to import
                    parts = parts[2:]
                path = os.path.realpath(os.path.join(target, *parts))
                if not path.startswith(root + os.sep) or member.is_dir():
                    continue
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with wheel.open(member) as src, open(path, "wb") as dst:
                    dst.write(src.read())
                mode = (member.external_attr >> 16) & 0o777
                os.chmod(path, mode or 0o644)
        used.append(name)
    sys.path.insert(0, target)
    return {"unpacked": used, "left_out_for_another_python": skipped}


# --- (a) compute on the device's clock ------------------------------------------------------------------------

class ForwardLike:
    """Shaped as sglang's Scheduler where the run_batch wrapper reads it (a prefill scheduler on "cuda", its
    `forward_stream`), doing what sglang's run_batch does under the overlap scheduler: the forward enqueued on
    `forward_stream` behind the scheduler's stream, and the call returns at once."""

    def __init__(self, torch, size: int, matmuls: int):
        self.torch = torch
        self.disaggregation_mode = SimpleNamespace(name="PREFILL")
        self.device = "cuda"
        self.forward_stream = torch.cuda.Stream()
        self.a = torch.randn(size, size, device="cuda", dtype=torch.float16)
        self.b = torch.randn(size, size, device="cuda", dtype=torch.float16)
        self.c = torch.empty(size, size, device="cuda", dtype=torch.float16)
        self.matmuls = matmuls

    def run_batch(self, batch):
        torch = self.torch
        self.forward_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.forward_stream):
            batch.ref_start.record()
            for _ in range(self.matmuls):
                torch.mm(self.a, self.b, out=self.c)
            batch.ref_end.record()
        return batch


def _quantiles(values) -> dict:
    if not values:
        return {}
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "p90": ordered[int(0.9 * (len(ordered) - 1))],
            "max": ordered[-1], "min": ordered[0], "count": len(ordered)}


def compute_check(torch, seconds: float, size: int, matmuls: int) -> dict:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from otel_kvtransfer import integration, semconv
    from otel_kvtransfer.frameworks.sglang import prefill
    from otel_kvtransfer.recording import device_clock
    from otel_kvtransfer.recording.clock import now_ns
    from otel_kvtransfer.wiring.instrumentor import KVTransferInstrumentor

    provider, exporter = TracerProvider(), InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    instrumentor = KVTransferInstrumentor()
    instrumentor.instrument(tracer_provider=provider, meter_provider=MeterProvider(metric_readers=[reader]),
                            skip_dep_check=True)
    try:
        prefill.patch_scheduler(SimpleNamespace(Scheduler=ForwardLike))  # the wrapper sglang's Scheduler gets
        sched = ForwardLike(torch, size, matmuls)
        schedule = torch.cuda.Stream()
        torch.cuda.synchronize()
        batches, room = [], 1 << 40
        deadline = time.monotonic() + seconds
        with torch.cuda.stream(schedule):  # sglang runs its loop inside its schedule stream
            while time.monotonic() < deadline or len(batches) < 3:
                k = len(batches)
                integration.begin_request(room + k, backend="gpu_check", framework="sglang")
                batch = SimpleNamespace(reqs=[SimpleNamespace(bootstrap_room=room + k)],
                                        ref_start=torch.cuda.Event(enable_timing=True),
                                        ref_end=torch.cuda.Event(enable_timing=True))
                start = now_ns()
                sched.run_batch(batch)
                batch.launch = (start, now_ns())
                batches.append(batch)
                if k:  # two in flight: the previous batch's result is processed now
                    _finish(batches[k - 1], room + k - 1, integration, now_ns)
            _finish(batches[-1], room + len(batches) - 1, integration, now_ns)
        torch.cuda.synchronize()
        clock = device_clock.for_device("cuda")
        stats = clock.stats() if clock is not None else {}
        provider.force_flush()
        spans = {int(s.attributes[semconv.REQUEST_KEY]): s for s in exporter.get_finished_spans()
                 if s.name == semconv.SPAN_COMPUTE}
        return _compare(batches, spans, room, stats, semconv)
    finally:
        instrumentor.uninstrument()


def _finish(batch, key, integration, now_ns) -> None:
    """Spin until the host sees the forward end (a non-blocking query, as often as it can), then end its request:
    the request's end records its compute, on the device's clock, before its end."""
    deadline = time.monotonic() + FORWARD_BOUND_S
    while not batch.ref_end.query():
        if time.monotonic() > deadline:
            raise TimeoutError(f"a forward did not end in {FORWARD_BOUND_S:g} s")
    batch.seen = now_ns()
    integration.end_request(key)


def _compare(batches, spans, room, stats, semconv) -> dict:
    clocks = sorted({s.attributes.get(semconv.COMPUTE_CLOCK) for s in spans.values()})
    first = batches[0]
    first_span = spans.get(room)
    queued_duration_errors, idle_launch_gaps, spacing_errors, seen_minus_end = [], [], [], []
    for k, batch in enumerate(batches):
        span = spans.get(room + k)
        if span is None or first_span is None:
            continue
        device_ns = batch.ref_start.elapsed_time(batch.ref_end) * 1e6
        if span.start_time > batch.launch[1]:  # the stream was busy at launch: the start is the previous end
            queued_duration_errors.append(abs((span.end_time - span.start_time) - device_ns))
        else:  # an idle stream: the interval begins at the launch, before the first kernel
            idle_launch_gaps.append((span.end_time - span.start_time) - device_ns)
        spacing_ns = first.ref_end.elapsed_time(batch.ref_end) * 1e6
        spacing_errors.append(abs((span.end_time - first_span.end_time) - spacing_ns))
        seen_minus_end.append(batch.seen - span.end_time)
    launch = [b.launch[1] - b.launch[0] for b in batches]
    device = [b.ref_start.elapsed_time(b.ref_end) * 1e6 for b in batches]
    checks = [
        _check("a compute span for every batch", len(spans) == len(batches), f"{len(spans)} of {len(batches)}"),
        _check("every compute span on the device's clock", clocks == [semconv.CLOCK_DEVICE], str(clocks)),
        _check("durations of queued batches within 50 us of elapsed_time",
               bool(queued_duration_errors) and max(queued_duration_errors) <= PROMISE_NS,
               _quantiles(queued_duration_errors)),
        # Two ends, each within the promise of the truth (through anchors taken apart): 2 x 50 us between them.
        _check("each end's spacing from the first within 2 x 50 us of elapsed_time",
               bool(spacing_errors) and max(spacing_errors) <= 2 * PROMISE_NS, _quantiles(spacing_errors)),
        _check("the host saw the median forward end within 50 us of its span's end",
               bool(seen_minus_end) and -PROMISE_NS <= statistics.median(seen_minus_end) <= PROMISE_NS,
               _quantiles(seen_minus_end)),
    ]
    return {"batches": len(batches), "launch_ns": _quantiles(launch), "device_forward_ns": _quantiles(device),
            "queued_duration_error_ns": _quantiles(queued_duration_errors),
            "idle_batches_launch_gap_ns": _quantiles(idle_launch_gaps),
            "spacing_error_ns": _quantiles(spacing_errors), "host_seen_minus_span_end_ns": _quantiles(seen_minus_end),
            "device_clock": stats, "checks": checks}


def _check(name: str, ok: bool, detail) -> dict:
    return {"check": name, "ok": bool(ok), "detail": detail}


# --- (b) NIXL writes ------------------------------------------------------------------------------------------

def _buffer(memory: str, nbytes: int, fill: bool):
    """(keep-alive object, address, device id) of `nbytes` of `memory` (VRAM: a torch CUDA tensor)."""
    if memory == "VRAM":
        import torch

        tensor = (torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda") if fill
                  else torch.zeros(nbytes, dtype=torch.uint8, device="cuda"))
        torch.cuda.synchronize()
        return tensor, tensor.data_ptr(), torch.cuda.current_device()
    import numpy as np

    array = (np.random.default_rng(7).integers(0, 256, nbytes, dtype=np.uint8) if fill
             else np.zeros(nbytes, dtype=np.uint8))
    return array, array.ctypes.data, 0


def _digest(buffer) -> str:
    data = buffer.cpu().numpy() if hasattr(buffer, "cpu") else buffer
    return hashlib.blake2b(data.tobytes(), digest_size=16).hexdigest()


def _agent(name: str):
    import nixl._api as api

    return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))


def _target(conn, memory: str, nbytes: int) -> None:
    """The destination agent, in a process of its own: its buffer's address and metadata out, digests on ask."""
    try:
        buffer, address, device = _buffer(memory, nbytes, fill=False)
        agent = _agent(f"gpu-check-target-{os.getpid()}")
        agent.register_memory(agent.get_reg_descs([(address, nbytes, device, "")], memory))
        conn.send(("ready", agent.get_agent_metadata(), address, device))
        while True:
            ask = conn.recv()
            if ask == "digest":
                if memory == "VRAM":
                    import torch

                    torch.cuda.synchronize()
                conn.send(_digest(buffer))
            else:
                break
    except Exception:
        conn.send(("error", traceback.format_exc()[-2000:]))
    conn.close()
    os._exit(0)  # NIXL/UCX teardown at interpreter exit can crash after a transfer


class _SameProcessTarget:
    """The destination agent in this process (where CUDA IPC is refused between two processes)."""

    def __init__(self, memory, nbytes):
        self.buffer, address, device = _buffer(memory, nbytes, fill=False)
        self.agent = _agent(f"gpu-check-target-local-{os.getpid()}")
        self.agent.register_memory(self.agent.get_reg_descs([(address, nbytes, device, "")], memory))
        self.ready = (self.agent.get_agent_metadata(), address, device)
        self.memory = memory

    def digest(self):
        if self.memory == "VRAM":
            import torch

            torch.cuda.synchronize()
        return _digest(self.buffer)


def _copy_bandwidth(memory: str, nbytes: int) -> float:
    """Bytes per second of the best of 5 device-to-device (VRAM) or host (DRAM) copies of `nbytes`."""
    best = None
    if memory == "VRAM":
        import torch

        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        for _ in range(6):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
            best = seconds if best is None else min(best, seconds)
    else:
        import numpy as np

        src, dst = np.ones(nbytes, dtype=np.uint8), np.empty(nbytes, dtype=np.uint8)
        for _ in range(6):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            seconds = time.perf_counter() - t0
            best = seconds if best is None else min(best, seconds)
    return nbytes / best


def nixl_check(memory: str, nbytes: int, writes: int, blocks: int) -> dict:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from otel_kvtransfer import semconv
    from otel_kvtransfer.wiring.instrumentor import KVTransferInstrumentor

    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # UCX's TCP transport listens where it may; CUDA IPC needs none
    provider, exporter = TracerProvider(), InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentor = KVTransferInstrumentor()
    instrumentor.instrument(tracer_provider=provider,
                            meter_provider=MeterProvider(metric_readers=[InMemoryMetricReader()]),
                            skip_dep_check=True)
    out = {"memory": memory, "bytes_per_write": nbytes, "writes": writes, "descriptors_per_write": blocks}
    child = None
    try:
        source, src_address, src_device = _buffer(memory, nbytes, fill=True)
        initiator = _agent(f"gpu-check-initiator-{os.getpid()}")
        initiator.register_memory(initiator.get_reg_descs([(src_address, nbytes, src_device, "")], memory))
        target, child, reason = _start_target(memory, nbytes)
        out["processes"] = 1 if isinstance(target, _SameProcessTarget) else 2
        if reason:
            out["one_process_because"] = reason
        try:
            states = _write(initiator, target, memory, nbytes, writes, blocks, src_address, src_device)
        except Exception:
            if out["processes"] == 1:
                raise
            out["one_process_because"] = "writes to the other process failed: " + traceback.format_exc()[-800:]
            _stop(child)
            child, target, out["processes"] = None, _SameProcessTarget(memory, nbytes), 1
            states = _write(initiator, target, memory, nbytes, writes, blocks, src_address, src_device)
        out["states"] = sorted(set(states))
        expected, received = _digest(source), _ask_digest(target)
        provider.force_flush()
        sends = [s for s in exporter.get_finished_spans() if s.name == semconv.SPAN_SEND]
        reference = _copy_bandwidth(memory, nbytes)
        rates = [s.attributes.get(semconv.THROUGHPUT, 0.0) for s in sends]
        out.update({
            "send_spans": len(sends),
            "send_bytes": sorted({s.attributes.get(semconv.BYTES) for s in sends}),
            "send_descriptors": sorted({s.attributes.get(semconv.DESCRIPTOR_COUNT) for s in sends}),
            "send_throughput_bytes_per_s": _quantiles(rates),
            "copy_bandwidth_bytes_per_s": reference,
        })
        out["checks"] = [
            _check("every write DONE", out["states"] == ["DONE"], out["states"]),
            _check("one send span per write", len(sends) == writes, len(sends)),
            _check("each send's bytes and descriptors exact",
                   out["send_bytes"] == [nbytes] and out["send_descriptors"] == [blocks],
                   {"bytes": out["send_bytes"], "descriptors": out["send_descriptors"]}),
            _check("the destination's bytes equal the source's", expected == received,
                   {"source": expected, "destination": received}),
            _check("no send faster than the device's own copy", bool(rates) and max(rates) < reference,
                   {"fastest_send": max(rates) if rates else None, "copy": reference}),
        ]
        return out
    finally:
        _stop(child)
        instrumentor.uninstrument()


def _start_target(memory, nbytes):
    """(target, child process or None, why one process): the destination in a spawned process when it starts."""
    ctx = mp.get_context("spawn")
    parent, there = ctx.Pipe()
    child = ctx.Process(target=_target, args=(there, memory, nbytes), daemon=True)
    child.start()
    child.kvt_conn = parent
    if parent.poll(120):
        message = parent.recv()
        if message[0] == "ready":
            return SimpleNamespace(ready=message[1:], conn=parent), child, None
        reason = message[1]
    else:
        reason = "the second process did not start in 120 s"
    _stop(child)
    return _SameProcessTarget(memory, nbytes), None, reason


def _stop(child) -> None:
    if child is None:
        return
    try:
        child.kvt_conn.send("exit")
    except Exception:
        pass
    child.join(5)
    if child.is_alive():
        os.kill(child.pid, 9)
        child.join(5)


def _ask_digest(target) -> str:
    if isinstance(target, _SameProcessTarget):
        return target.digest()
    target.conn.send("digest")
    if not target.conn.poll(120):
        return "no answer"
    return target.conn.recv()


def _write(initiator, target, memory, nbytes, writes, blocks, src_address, src_device) -> list:
    metadata, dst_address, dst_device = target.ready
    peer = initiator.add_remote_agent(metadata)
    block = nbytes // blocks
    sizes = [block] * (blocks - 1) + [nbytes - block * (blocks - 1)]
    offsets = [i * block for i in range(blocks)]
    local = initiator.get_xfer_descs([(src_address + o, n, src_device) for o, n in zip(offsets, sizes)], memory)
    remote = initiator.get_xfer_descs([(dst_address + o, n, dst_device) for o, n in zip(offsets, sizes)], memory)
    states = []
    for _ in range(writes):
        handle = initiator.initialize_xfer("WRITE", local, remote, peer)
        state = initiator.transfer(handle)
        deadline = time.monotonic() + 60
        while state == "PROC" and time.monotonic() < deadline:
            state = initiator.check_xfer_state(handle)
        initiator.release_xfer_handle(handle)
        if state == "ERR":
            raise RuntimeError("a NIXL write ended in ERR")
        states.append(state)
    return states


# --- the run --------------------------------------------------------------------------------------------------

def _torch_device():
    """(torch, None) with a CUDA device, else (None or torch, the reason there is none)."""
    try:
        import torch
    except Exception as exc:
        return None, f"no torch here ({type(exc).__name__})"
    try:
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return torch, None
    except Exception as exc:
        return torch, f"torch {torch.__version__} cannot reach CUDA ({type(exc).__name__})"
    return torch, f"torch {torch.__version__}, CUDA not available"


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("a positive integer")
    return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_check.json", help="the JSON result (gpu_check.json)")
    parser.add_argument("--wheels", metavar="DIR", help="wheels to unpack and import first (bench/device_wheels)")
    parser.add_argument("--seconds", type=float, default=3.0, help="how long (a) launches batches (3)")
    parser.add_argument("--size", type=_positive, default=4096, help="(a) matmul size, fp16 (4096)")
    parser.add_argument("--matmuls", type=_positive, default=8, help="(a) matmuls per batch (8)")
    parser.add_argument("--nixl-mib", type=_positive, default=256, help="(b) bytes per write, MiB (256)")
    parser.add_argument("--nixl-writes", type=_positive, default=20, help="(b) writes (20)")
    parser.add_argument("--nixl-descriptors", type=_positive, default=64, help="(b) descriptors per write (64)")
    parser.add_argument("--nixl-memory", choices=("VRAM", "DRAM"), default="VRAM",
                        help="(b) on GPU memory (default), or on host memory, which runs without a device too")
    parser.add_argument("--skip-nixl", action="store_true")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return 2 if exc.code else 0
    if not 0 < args.seconds <= 600:
        print("gpu_check: --seconds must be in (0, 600]", file=sys.stderr)
        return 2
    result = {"check": "gpu_check", "python": platform.python_version(), "machine": platform.machine()}
    torch, missing = _torch_device()
    nixl_on_host = args.nixl_memory == "DRAM" and not args.skip_nixl
    if missing is not None and not nixl_on_host:
        print(f"gpu_check: no device ({missing}): nothing measured")
        result.update(status="no_device", reason=missing)
        return _write_result(args.out, result, 0)
    sys.path.insert(0, REPO)
    if args.wheels:
        if not os.path.isdir(args.wheels):
            print(f"gpu_check: --wheels {args.wheels[:200]!r} is not a folder", file=sys.stderr)
            return 2
        result["wheels"] = unpack_wheels(args.wheels, tempfile.mkdtemp(prefix="kvt-gpu-check-"))
    if torch is not None and missing is None:
        result["device"] = {"name": torch.cuda.get_device_name(0), "torch": torch.__version__,
                            "cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None)}
    else:
        result["device"] = None
        result["no_device"] = missing
    checks = []
    if missing is None:
        result["compute"] = _guarded(lambda: compute_check(torch, args.seconds, args.size, args.matmuls))
        checks += result["compute"].get("checks", [])
    if not args.skip_nixl:
        result["nixl"] = _guarded(lambda: nixl_check(args.nixl_memory, args.nixl_mib << 20, args.nixl_writes,
                                                      args.nixl_descriptors))
        checks += result["nixl"].get("checks", [])
    failed = [c["check"] for c in checks if not c["ok"]]
    errors = [part for part in ("compute", "nixl") if "error" in result.get(part, {})]
    ok = not failed and not errors
    result["status"] = "ok" if ok else "failed"
    for check in checks:
        print(f"gpu_check: {'ok ' if check['ok'] else 'FAILED'} {check['check']}")
    for part in errors:
        print(f"gpu_check: FAILED {part}: {result[part]['error'].strip().splitlines()[-1][:300]}")
    if missing is not None:
        print(f"gpu_check: no device ({missing}): only the NIXL writes on host memory were run")
    return _write_result(args.out, result, 0 if ok else 1)


def _guarded(part) -> dict:
    try:
        return part()
    except Exception:
        return {"error": traceback.format_exc()[-4000:]}


def _write_result(path: str, result: dict, code: int) -> int:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=1, default=str)
    sys.stdout.flush()
    sys.stderr.flush()
    if "nixl" in result:
        os._exit(code)  # NIXL/UCX teardown at interpreter exit can crash after a transfer: everything is written
    return code


if __name__ == "__main__":
    sys.exit(main())
