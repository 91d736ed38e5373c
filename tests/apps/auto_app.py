"""An application that knows nothing of OpenTelemetry: it moves bytes with Mooncake in itself and in a spawned
child. tests/wiring/test_auto_instrumentation.py runs it under `opentelemetry-instrument`."""

import multiprocessing
import sys

import numpy as np

from otel_kvtransfer.demo.loopback import Receiver, open_engine


def send(session, address, length, times):
    engine = open_engine()
    buf = np.full(length, 3, dtype=np.uint8)
    assert engine.register_memory(buf.ctypes.data, buf.nbytes) == 0
    for _ in range(times):
        assert engine.transfer_sync_write(session, buf.ctypes.data, address, length) == 0


def main():
    receiver = Receiver(1 << 20, env={"MC_FORCE_TCP": "1"})
    try:
        send(receiver.session, receiver.base_address, 1111, 3)
        ctx = multiprocessing.get_context("spawn")
        child = ctx.Process(target=send, args=(receiver.session, receiver.base_address, 2222, 2))
        child.start()
        child.join(120)
        return child.exitcode
    finally:
        receiver.stop()


if __name__ == "__main__":
    sys.exit(main())
