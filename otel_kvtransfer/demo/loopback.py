"""Real Mooncake engines on 127.0.0.1: a receiver process and a sender, for the demo, the tests and bench/.

`open_engine()` initialises a TransferEngine over TCP with the P2P handshake and turns the usual set-up
failures (wheel missing, libibverbs missing) into one message that names the fix. `Receiver` runs an engine
with a registered buffer in a spawned process and answers checksum requests, so a test can prove the bytes
arrived; given a span file, it is also an instrumented decode engine that records `kv_transfer.receive` spans
when told a room's KV is expected and when it has arrived. Security note: Mooncake's handshake listener binds all
interfaces even when initialised with 127.0.0.1.
"""

import hashlib
import multiprocessing
import os
from typing import Callable, Optional

LOOPBACK = "127.0.0.1"


class MooncakeUnavailable(RuntimeError):
    """The Mooncake engine cannot be loaded here; the message says how to fix it."""


def _load_engine_class():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        text = str(exc)
        if "libibverbs" in text or "libnuma" in text or "libnl" in text:
            raise MooncakeUnavailable(
                f"the Mooncake engine needs system libraries ({text}); install them with "
                "`apt-get install -y libibverbs1 libnuma1`") from exc
        raise MooncakeUnavailable(
            f"the Mooncake engine is not installed ({text}); install it with "
            "`pip install 'otel_kvtransfer[mooncake-cpu]'` (CPU hosts) or `pip install mooncake-transfer-engine` "
            "(GPU hosts)") from exc
    return TransferEngine


def open_engine():
    """A TransferEngine initialised on 127.0.0.1 over TCP with the P2P handshake."""
    os.environ.setdefault("MC_FORCE_TCP", "1")
    engine = _load_engine_class()()
    rc = engine.initialize(LOOPBACK, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise MooncakeUnavailable(f"TransferEngine.initialize on {LOOPBACK} returned {rc}")
    return engine


def session_of(engine) -> str:
    return f"{LOOPBACK}:{engine.get_rpc_port()}"


def digest(data) -> str:
    return hashlib.blake2b(memoryview(data).cast("B"), digest_size=16).hexdigest()


def _decode_side_tracing(span_file: str, service_name: str):
    """Instrument this receiver as a decode engine writing its spans to `span_file`; returns the provider."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from otel_kvtransfer.building.file_exporter import OtlpJsonFileSpanExporter
    from otel_kvtransfer.wiring.instrumentor import KVTransferInstrumentor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OtlpJsonFileSpanExporter(span_file)))
    KVTransferInstrumentor().instrument(tracer_provider=provider)
    return provider


def _receiver_main(conn, size: int, env: dict, span_file: Optional[str], service_name: str) -> None:
    os.environ.update(env)
    import numpy as np

    from otel_kvtransfer.engines.mooncake import BACKEND

    provider = _decode_side_tracing(span_file, service_name) if span_file else None
    try:
        engine = open_engine()
        buffer = np.zeros(size, dtype=np.uint8)
        buffer.fill(0)  # fault the pages in now, as a real engine's pinned KV pool is: not during the first transfer
        rc = engine.register_memory(buffer.ctypes.data, buffer.nbytes)
        if rc != 0:
            raise MooncakeUnavailable(f"register_memory returned {rc}")
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", session_of(engine), buffer.ctypes.data, size))
    serve_requests(conn, buffer, BACKEND, provider)


def serve_requests(conn, buffer, backend: str, provider, extra=None) -> None:
    """A receiver child's message loop, until "stop" or the parent goes away: checksums and fills of its buffer,
    and the decode side's receive spans. `extra` maps more message names to functions giving the reply."""
    from otel_kvtransfer.recording import integration

    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message[0] == "digest":
            _, offset, length = message
            conn.send(digest(buffer[offset:offset + length]))
        elif message[0] == "fill":
            buffer[:] = message[1]
            conn.send("ok")
        elif message[0] == "receive_begin":  # the decode engine asks for a room's KV
            integration.begin_receive(message[1], backend=backend, expected_bytes=message[2])
            conn.send("ok")
        elif message[0] == "receive_end":  # ... and sees it arrive (or fail)
            integration.end_receive(message[1], error_type=message[2])
            conn.send("ok")
        elif extra and message[0] in extra:
            conn.send(extra[message[0]]())
        elif message[0] == "stop":
            if provider is not None:
                provider.shutdown()
            conn.send("bye")
            return


class ReceiverProcess:
    """A decode engine with `size` registered bytes in its own (spawned) process, driven over a pipe.

    `main` runs in the child: it answers ("ready", session, ...) once its buffer is registered, then serves the
    messages below. Subclasses name the engine (`main`, `unavailable`) and read the rest of the ready reply.
    """

    # The child's entry point: main(conn, size, env, span_file, service_name).
    main: Optional[Callable[..., None]] = None
    unavailable = RuntimeError  # raised when the child does not come up

    def __init__(self, size: int, env: Optional[dict] = None, start_timeout_s: float = 60.0,
                 span_file: Optional[str] = None, service_name: str = "kv-decode"):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=type(self).main, args=(child, size, dict(env or {}), span_file,
                                                                 service_name), daemon=True)
        self.process.start()
        child.close()
        if not self._conn.poll(start_timeout_s):
            self.kill()
            raise self.unavailable(f"the receiver process did not start within {start_timeout_s:.0f} s")
        reply = self._conn.recv()
        if reply[0] != "ready":
            self.kill()
            raise self.unavailable(f"the receiver process failed: {reply[1]}")
        self._ready(reply)

    def _ready(self, reply) -> None:
        _, self.session, self.base_address, self.size = reply

    @property
    def pid(self) -> Optional[int]:
        return self.process.pid

    def _ask(self, message, timeout_s: float = 30.0):
        self._conn.send(message)
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"the receiver (pid {self.pid}) did not answer {message[0]!r}")
        return self._conn.recv()

    def digest(self, offset: int, length: int) -> str:
        return self._ask(("digest", offset, length))

    def fill(self, value: int) -> None:
        self._ask(("fill", value))

    def begin_receive(self, room: int, expected_bytes: Optional[int] = None) -> None:
        self._ask(("receive_begin", room, expected_bytes))

    def end_receive(self, room: int, error_type: Optional[str] = None) -> None:
        self._ask(("receive_end", room, error_type))

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process.is_alive():
            try:
                self._ask(("stop",), timeout_s)
            except (OSError, EOFError, TimeoutError):
                pass
            self.process.join(timeout_s)
        self.kill()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)
        self._conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
        return False


class Receiver(ReceiverProcess):
    """A Mooncake engine with `size` registered bytes in its own (spawned) process on 127.0.0.1."""

    main = staticmethod(_receiver_main)
    unavailable = MooncakeUnavailable
