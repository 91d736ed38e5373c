"""The async wrappers under stress, on the real Mooncake engine: the gate the compiled path stays the default behind.

Native code runs on the engine's threads, so the bar is CPython's own: nothing it borrows may be freed under it
while it runs Python code. Each run here gives every place where it does the chance: several engines in one
process (the wrappers are per class, so every engine shares them), several threads per engine, sends raw and in
transfer scopes, batch ids whose hashing waits on another engine, a queue small enough to be full and a recorder
that sleeps between drains, a pending table small enough to overflow, and a thread switch after almost every
bytecode. With `--interrupts`, KeyboardInterrupt lands inside the wrappers' own work: from a length being summed
(the submission raises it in place of the id) and from an id being hashed (the wait raises it; its sends stay
pending until uninstrument counts them). Then it checks the books: every batch id a submission handed back is a
send span or a counted drop, exactly.

Run by scripts/stress-compiled.sh, inside a private network namespace (Mooncake's handshake binds every interface),
once per hot path, with the compiled part built with AddressSanitizer and UndefinedBehaviorSanitizer and an
allocator that frees for real. `--module` loads that build in place of the installed one. One line on stdout:
`stress: <hot path>: <calls> calls, <spans> spans + <drops> drops ...`; exit 1 when the books do not balance.
"""

import argparse
import os
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: support
from support import compiled_module  # noqa: E402


class _Counting:
    """A span exporter that counts the send spans of engine calls and their bytes (a scope left by an exception
    before any call is a failed send of no call: not one of the books' calls)."""

    def __init__(self):
        self.sends = 0
        self.bytes = 0
        self.lock = threading.Lock()

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        from otel_kvtransfer import semconv

        with self.lock:
            for span in spans:
                if span.name == semconv.SPAN_SEND and span.attributes.get(semconv.ENGINE_CALLS, 1) > 0:
                    self.sends += 1
                    self.bytes += span.attributes.get(semconv.BYTES, 0)
        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass

    def force_flush(self, timeout_millis=30000):
        return True


class _WaitingId(int):
    """A batch id whose hash first waits on another engine (an empty wait: the engine's call, our wrapper around
    it, and a thread switch, in the middle of a wait's loop over its ids)."""

    other = None

    def __hash__(self):
        other = type(self).other
        if other is not None:
            other.get_batch_transfer_status([])
        return int.__hash__(self)

    def __eq__(self, value):
        return int(self) == value


class _InterruptingLength(int):
    """A length whose addition is interrupted (Ctrl-C landing while the wrapper sums the lengths)."""

    def __radd__(self, total):
        raise KeyboardInterrupt


class _InterruptingId(int):
    """A batch id whose hashing is interrupted (Ctrl-C landing while the wait's wrapper ends its sends)."""

    def __hash__(self):
        raise KeyboardInterrupt

    def __eq__(self, value):
        return int(self) == value


class _no_scope:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Books:
    def __init__(self):
        self.lock = threading.Lock()
        self.calls = 0
        self.bytes = 0
        self.interrupted_submissions = 0
        self.interrupts = 0
        self.failures = []

    def add(self, **counts):
        with self.lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)


def _worker(index, engine, others, source, receiver, deadline, books, rounds, interrupts):
    from otel_kvtransfer import integration

    rng = random.Random(index)
    size = 4096
    for round_index in range(rounds):
        if time.monotonic() > deadline:
            return
        count = rng.choice((1, 2, 4, 16))
        offset = ((index * 37 + round_index) % 1024) * size  # within the receiver's 8 MiB
        lengths = [size] * count
        sources = [source + offset] * count
        targets = [receiver.base_address + offset] * count
        scoped = rng.random() < 0.5
        if interrupts and rng.random() < 0.02:
            lengths[-1] = _InterruptingLength(size)
        # The interrupt is caught inside the scope: a scope left by an exception is a failed send of its own,
        # no engine call's, and would blur the books.
        with integration.transfer_scope(index * 1_000_000 + round_index) if scoped else _no_scope():
            try:
                submitted = engine.batch_transfer_async_write(receiver.session, sources, targets, lengths)
            except KeyboardInterrupt:
                submitted = None
        if submitted is None:
            books.add(interrupted_submissions=1, interrupts=1)
            continue
        if not submitted or submitted < 0:
            books.failures.append(f"submission refused: {submitted!r}")
            continue
        books.add(calls=1, bytes=size * count)
        ids = [submitted]
        chance = rng.random()
        if interrupts and chance < 0.005:
            ids = [_InterruptingId(submitted)]
        elif chance < 0.25:  # hashing it waits on another engine
            _WaitingId.other = rng.choice(others)
            ids = [_WaitingId(submitted)]
        try:
            rc = engine.get_batch_transfer_status(ids)
        except KeyboardInterrupt:
            books.add(interrupts=1)
            continue
        if rc != 0:
            books.failures.append(f"batch {submitted} ended with {rc!r}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--threads", type=int, default=3, help="per engine")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--rounds", type=int, default=4000, help="at most, per thread")
    parser.add_argument("--interrupts", action="store_true", help="KeyboardInterrupt inside the wrappers' work")
    parser.add_argument("--module", help="the compiled part to load in place of the installed one")
    args = parser.parse_args(argv)
    if not (1 <= args.engines <= 8 and 1 <= args.threads <= 16 and 0 < args.seconds <= 120):
        parser.error("engines 1-8, threads 1-16, seconds up to 120")
    if args.module:
        compiled_module.load(args.module)

    import numpy as np
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from support.telemetry import dropped_by_reason, in_memory_metrics

    from otel_kvtransfer import KVTransferInstrumentor
    from otel_kvtransfer.demo.loopback import Receiver, open_engine
    from otel_kvtransfer.engines.mooncake import compiled

    hot_path = os.environ.get("OTEL_KVTRANSFER_HOT_PATH", "compiled")
    if hot_path == "compiled" and not compiled.available():
        print("stress: the compiled part is not built here (pip install -e . with a C compiler)")
        return 1
    receiver = Receiver(8 << 20, env={"MC_FORCE_TCP": "1", "MC_TRANSFER_TIMEOUT": "5"})
    exporter = _Counting()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    meter_provider, reader = in_memory_metrics()
    instrumentor = KVTransferInstrumentor()
    books = _Books()
    try:
        engines, buffers = [], []
        for _ in range(args.engines):
            engine = open_engine()
            buffer = np.zeros(8 << 20, dtype=np.uint8)
            if engine.register_memory(buffer.ctypes.data, buffer.nbytes) != 0:
                print("stress: register_memory failed")
                return 1
            engines.append(engine)
            buffers.append(buffer)
        instrumentor.instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)
        sys.setswitchinterval(1e-6)  # a thread switch wherever the interpreter may make one
        deadline = time.monotonic() + args.seconds
        threads = []
        for e, engine in enumerate(engines):
            others = [other for other in engines if other is not engine] or [engine]
            for t in range(args.threads):
                threads.append(threading.Thread(
                    target=_worker, name=f"stress-{e}-{t}",
                    args=(e * args.threads + t, engine, others, buffers[e].ctypes.data, receiver, deadline, books,
                          args.rounds, args.interrupts)))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(args.seconds + 60)
        sys.setswitchinterval(0.005)
        alive = [thread.name for thread in threads if thread.is_alive()]
        if alive:
            print(f"stress: {len(alive)} workers still running after the deadline: {', '.join(alive[:4])}")
            return 1
        tracer_provider.force_flush()
        instrumentor.uninstrument()  # what is still pending is counted now (async_uninstrumented)
        tracer_provider.force_flush()
        drops = dropped_by_reason(reader)
    finally:
        receiver.stop()
    # what was dropped of the sends (a request evicted for never being ended is no send: the scopes here have no
    # request begun or ended)
    dropped = {reason: count for reason, count in drops.items() if not reason.startswith("request_")}
    balanced = exporter.sends + sum(dropped.values()) == books.calls
    print(f"stress: {hot_path}: {args.engines} engines x {args.threads} threads, {books.calls} calls, "
          f"{exporter.sends} spans + {sum(dropped.values())} drops {dict(sorted(dropped.items()))}, "
          f"{books.interrupts} interrupts ({books.interrupted_submissions} in submissions), "
          f"{len(books.failures)} engine failures: {'balanced' if balanced else 'NOT BALANCED'}")
    for failure in books.failures[:5]:
        print(f"stress:   {failure}")
    return 0 if balanced and books.calls > 0 and not books.failures else 1


if __name__ == "__main__":
    sys.exit(main())
