"""An engine process in `OTEL_KVTRANSFER_BUILDER=process` mode, for tests/test_builder_process.py: real Mooncake
writes to a receiver process, in steps the test names, each step's outcome printed as one JSON line.

    python builder_process_app.py STEP [STEP ...]
    steps: many-fds (hold ~1,100 descriptors first), send:N (N 4,096 B writes in requests of one write each), open (one write in a request that never
    ends), fork (a forked child makes one), flush, interrupt-helper, kill-helper, uninstrument
"""

import json
import os
import signal
import sys
import time

import numpy as np
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from otel_kvtransfer import KVTransferInstrumentor
from otel_kvtransfer import integration as kvt
from otel_kvtransfer.demo.loopback import Receiver, open_engine

SIZE = 4096


def main(steps):
    provider = TracerProvider()  # this process's own SDK: its flush must reach the helper
    trace.set_tracer_provider(provider)
    instrumentor = KVTransferInstrumentor()
    instrumentor.instrument()
    link = instrumentor._link  # pylint: disable=protected-access
    print(json.dumps({"step": "start", "pid": os.getpid(), "helper": link and link.pid()}), flush=True)
    receiver = Receiver(1 << 20, env={"MC_FORCE_TCP": "1"})
    engine = open_engine()
    buffer = np.full(1 << 20, 5, dtype=np.uint8)
    assert engine.register_memory(buffer.ctypes.data, buffer.nbytes) == 0
    room = 1000
    try:
        for step in steps:
            name, _, arg = step.partition(":")
            outcome = {"step": step}
            if name == "send":
                codes = []
                for _ in range(int(arg)):
                    kvt.begin_request(room, backend="mooncake", framework="test")
                    with kvt.transfer_scope(room):
                        codes.append(engine.transfer_sync_write(receiver.session, buffer.ctypes.data,
                                                                receiver.base_address, SIZE))
                    kvt.end_request(room)
                    room += 1
                outcome["return_codes"] = sorted(set(codes))
            elif name == "open":
                kvt.begin_request(room, backend="mooncake", framework="test")
                with kvt.transfer_scope(room):
                    outcome["return_codes"] = [engine.transfer_sync_write(
                        receiver.session, buffer.ctypes.data, receiver.base_address, SIZE)]
                room += 1
            elif name == "flush":
                started = time.monotonic()
                outcome["flushed"] = provider.force_flush(30000)
                outcome["seconds"] = round(time.monotonic() - started, 3)
            elif name == "many-fds":  # what a big engine holds: the pipe's descriptors land above 1,024
                import resource  # pylint: disable=import-outside-toplevel

                soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
                wanted = 1200 if hard == resource.RLIM_INFINITY else min(hard, 1200)
                resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
                held = [os.open(os.devnull, os.O_RDONLY) for _ in range(wanted - 64)]
                outcome["highest_fd"] = max(held)
            elif name == "fork":  # a child forked with the instrumentation on makes writes of its own
                read_end, write_end = os.pipe()
                child = os.fork()
                if child == 0:  # an engine does not survive a fork: the child opens its own
                    os.close(read_end)
                    own = open_engine()
                    mine = np.full(SIZE, 6, dtype=np.uint8)
                    assert own.register_memory(mine.ctypes.data, mine.nbytes) == 0
                    kvt.begin_request(room + 500, backend="mooncake", framework="test")
                    with kvt.transfer_scope(room + 500):
                        rc = own.transfer_sync_write(receiver.session, mine.ctypes.data, receiver.base_address,
                                                     SIZE)
                    kvt.end_request(room + 500)
                    report = {"rc": rc, "flushed": provider.force_flush(30000), "helper": link.pid()}
                    os.write(write_end, json.dumps(report).encode())
                    os._exit(0)  # pylint: disable=protected-access
                os.close(write_end)
                with os.fdopen(read_end) as answer:
                    outcome["child"] = json.loads(answer.read() or "{}")
                os.waitpid(child, 0)
            elif name == "interrupt-helper":  # what a terminal's Ctrl-C sends the whole process group
                os.kill(link.pid(), signal.SIGINT)
                outcome["interrupted"] = link.pid()
            elif name == "kill-helper":
                pid = link.pid()
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)  # reaped here: it is gone before the next frame
                outcome["killed"] = pid
            elif name == "uninstrument":
                helper = link.pid()
                instrumentor.uninstrument()
                outcome["helper_exited"] = _gone(helper)
            outcome["helper"] = link.pid()
            print(json.dumps(outcome), flush=True)
    finally:
        receiver.stop()


def _gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
        return handle.read().split(") ", 1)[1].startswith("Z")  # ended, waiting to be reaped


if __name__ == "__main__":
    main(sys.argv[1:])
