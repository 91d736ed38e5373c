"""Real Mooncake sends of known shapes over two links, written to a span file for the link model. Run by
tests/tools/test_link_model.py (never imported by pytest):

    unshare -rn python tests/support/observability/links.py --outer-netns NETNS --out DIR

The namespaces, veth links and receivers are those of tests/support/observability/peers.py (its receiver mode, its
helpers): a slow peer behind a `tc` token bucket and a fast one without. Each link's own rate is the median of
plain, uninstrumented 4 MiB writes before and after the instrumented sends (as the machine was around them). The
sends, instrumented, with the span file exporter writing DIR/spans.jsonl:
- to the slow peer, requests of one send each of 128 KiB to 2 MiB (sizes vary, so fixed cost and bandwidth part);
- to the fast peer, requests of one write each of 64 KiB to 4 MiB in one descriptor, and of 1 MiB in 16 or 256
  descriptors (descriptor counts vary apart from bytes), and requests of 256 descriptors of 64 B each (16 KiB:
  their time is the descriptors') and of single 4 KiB writes (their time is the call's fixed cost).
DIR/facts.json then says what was sent and each link's measured rate.

Protocol on stdout: one line `RESULT {json}` (the facts), or `ERROR <one line>`.
"""

import argparse
import json
import os
import statistics
import sys
import time

TESTS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `support` is in it
ROOT = os.path.dirname(TESTS)
for _path in (ROOT, TESTS):
    if _path not in sys.path:
        sys.path.insert(0, _path)

SLOW_RATE = "50mbit"  # 6.25 MB/s
BUFFER = 4 << 20  # each receiver's registered buffer (tests/support/observability/peers.py)
SLOW_SIZES = (128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20)
FAST_SIZES = (64 << 10, 256 << 10, 1 << 20, 4 << 20)
FAST_SPLITS = (16, 256)  # 1 MiB in this many descriptors
REPEATS = 3
TINY_DESCRIPTORS, TINY_BYTES = 256, 64  # a request whose time is its descriptors'
SMALL_BYTES = 4 << 10  # a request whose time is the call's fixed cost


def _plain_times(engine, session: str, source, remote: int) -> list:
    """Seconds of three plain 4 MiB writes, after one that opens the segment (when it is not open yet)."""
    engine.transfer_sync_write(session, source.ctypes.data, remote, BUFFER)
    times = []
    for _ in range(3):
        began = time.perf_counter()
        rc = engine.transfer_sync_write(session, source.ctypes.data, remote, BUFFER)
        times.append(time.perf_counter() - began)
        if rc != 0:
            raise RuntimeError(f"plain write returned {rc}")
    return times


def _request(engine, session: str, key: str, source, remote: int, blocks) -> int:
    """One request of one write of `blocks` [(offset, length)] (one descriptor each); its return code."""
    from otel_kvtransfer import integration

    integration.begin_request(key, backend="mooncake", framework="test_links")
    with integration.transfer_scope(key, payload="kv", is_last_chunk=True):
        if len(blocks) == 1:
            rc = engine.transfer_sync_write(session, source.ctypes.data + blocks[0][0], remote + blocks[0][0],
                                            blocks[0][1])
        else:
            rc = engine.batch_transfer_sync_write(session, [source.ctypes.data + o for o, _ in blocks],
                                                  [remote + o for o, _ in blocks], [n for _, n in blocks])
    integration.end_request(key, error_type=None if rc == 0 else "transfer_failed")
    return rc


def run(args) -> dict:
    import numpy as np
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from otel_kvtransfer import KVTransferInstrumentor
    from otel_kvtransfer.building.file_exporter import OtlpJsonFileSpanExporter
    from support.observability.parts import mooncake_tcp_engine
    from support.observability.peers import _ip, _start_receiver, _stop

    _ip("link", "set", "lo", "up")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, TESTS])}
    receivers, provider = [], None
    try:
        for index, (role, rate) in enumerate((("fast", None), ("slow", SLOW_RATE))):
            proc, address, ready = _start_receiver(index, rate, env)
            receivers.append({"proc": proc, "role": role, "address": address, "port": ready["port"],
                              "buffer": ready["buffer"], "session": f"{address}:{ready['port']}"})
        fast, slow = receivers
        engine = mooncake_tcp_engine("127.0.0.1")
        source = np.random.default_rng(2).integers(0, 255, BUFFER, dtype=np.uint8)
        if engine.register_memory(source.ctypes.data, source.nbytes) != 0:
            raise RuntimeError("sender register_memory failed")
        plain = {peer["address"]: _plain_times(engine, peer["session"], source, peer["buffer"])
                 for peer in receivers}
        provider = TracerProvider(resource=Resource.create({"service.name": "kvt-links"}))
        provider.add_span_processor(BatchSpanProcessor(OtlpJsonFileSpanExporter(os.path.join(args.out,
                                                                                             "spans.jsonl"))))
        instrumentor = KVTransferInstrumentor()
        instrumentor.instrument(tracer_provider=provider)
        failed, kinds = 0, {}
        for repeat in range(REPEATS):
            for size in SLOW_SIZES:
                key = f"slow-{size}-{repeat}"
                kinds[key] = "slow"
                failed += _request(engine, slow["session"], key, source, slow["buffer"], [(0, size)]) != 0
            for size in FAST_SIZES:
                key = f"fast-{size}-{repeat}"
                kinds[key] = "fast"
                failed += _request(engine, fast["session"], key, source, fast["buffer"], [(0, size)]) != 0
            for split in FAST_SPLITS:
                block = (1 << 20) // split
                key = f"split-{split}-{repeat}"
                kinds[key] = "split"
                failed += _request(engine, fast["session"], key, source, fast["buffer"],
                                   [(i * block, block) for i in range(split)]) != 0
            key = f"tiny-{repeat}"
            kinds[key] = "descriptors"
            failed += _request(engine, fast["session"], key, source, fast["buffer"],
                               [(i * 4096, TINY_BYTES) for i in range(TINY_DESCRIPTORS)]) != 0
            key = f"small-{repeat}"
            kinds[key] = "fixed"
            failed += _request(engine, fast["session"], key, source, fast["buffer"], [(0, SMALL_BYTES)]) != 0
        provider.force_flush(30_000)
        instrumentor.uninstrument()
        for peer in receivers:  # the link's rate before and after the sends, as the machine was around them
            plain[peer["address"]] += _plain_times(engine, peer["session"], source, peer["buffer"])
        measured = {address: BUFFER / statistics.median(times) for address, times in plain.items()}
        facts = {"measured_rate": measured, "plain_write_s": plain, "kinds": kinds, "failed": failed,
                 "peers": {peer["role"]: {"address": peer["address"], "port": peer["port"]} for peer in receivers}}
        with open(os.path.join(args.out, "facts.json"), "w", encoding="utf-8") as handle:
            json.dump(facts, handle)
        return facts
    finally:
        if provider is not None:
            provider.shutdown()
        for peer in receivers:
            _stop(peer["proc"])


def main(argv=None) -> int:
    from support.observability.peers import answer

    parser = argparse.ArgumentParser()
    parser.add_argument("--outer-netns", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    os.environ.setdefault("MC_FORCE_TCP", "1")
    os.environ.setdefault("MC_TRANSFER_TIMEOUT", "5")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    return answer(run, args)


if __name__ == "__main__":
    sys.exit(main())
