"""An engine process in `OTEL_KVTRANSFER_BUILDER=process` mode, for tests/offloading/test_builder_process.py: real
Mooncake writes to a receiver process, in steps the test names, each step's outcome printed as one JSON line.

    python builder_process_app.py STEP [STEP ...]
    steps: many-fds (hold ~1,100 descriptors first), send:N (N 4,096 B writes in requests of one write each),
    open (one write in a request that never ends), requests:N (N requests that make no transfer: records
    only, fast), main-class (one request whose attributes are of classes
    defined here, in __main__), fork (a forked child makes one), flush[:MS], drain (the recorder's, no flush),
    await-acks (until the helper's acknowledgements wait unread), interrupt-helper, stop-helper (SIGSTOP),
    cont-helper (SIGCONT), small-socket (the link's socket buffer made small),
    kill-helper (and reap it), kill-helper-nowait, signal-group (SIGINT and SIGTERM to this process group, and
    SIGTERM to the helper), sigpipe-default, sleep:S, hold / release (the helper's exporter blocks while held),
    zombies (this process's zombie children after a drain), local-drops (this process's own drop counts),
    uninstrument
"""

import enum
import json
import os
import select
import signal
import socket
import sys
import time

import numpy as np
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider

from otel_kvtransfer import KVTransferInstrumentor, semconv
from otel_kvtransfer import integration as kvt
from otel_kvtransfer.demo.loopback import Receiver, open_engine
from otel_kvtransfer.recording.recorder import RECORDER

SIZE = 4096


class Tag:  # a class only this process has: the helper's __main__ is not this module
    def __init__(self, name):
        self.name = name


class Tier(enum.IntEnum):
    GOLD = 3


def main(steps):
    provider = TracerProvider()  # this process's own SDK: its flush must reach the helper
    trace.set_tracer_provider(provider)
    reader = InMemoryMetricReader()  # what the link counts in this process (no helper could carry it)
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    instrumentor = KVTransferInstrumentor()
    instrumentor.instrument()
    link = instrumentor._link
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
            elif name == "requests":  # records without engine calls: enough of them to fill the helper's socket
                for _ in range(int(arg)):
                    kvt.begin_request(room, backend="mooncake", framework="test")
                    kvt.end_request(room)
                    room += 1
            elif name == "main-class":
                kvt.begin_request(room, backend="mooncake", framework="test",
                                  attributes={"test.tag": Tag("x"), "test.tier": Tier.GOLD})
                with kvt.transfer_scope(room):
                    outcome["return_codes"] = [engine.transfer_sync_write(
                        receiver.session, buffer.ctypes.data, receiver.base_address, SIZE)]
                kvt.end_request(room)
                room += 1
            elif name == "flush":
                started = time.monotonic()
                outcome["flushed"] = provider.force_flush(int(arg or 30000))
                outcome["seconds"] = round(time.monotonic() - started, 3)
            elif name == "drain":
                RECORDER.drain()
                channel = link.connection.channel
                outcome["frame_waiting"] = channel is not None and channel.tail is not None
            elif name == "await-acks":  # the helper has answered, and the link has not read it yet
                answers = link.connection.channel.sock
                outcome["acks_waiting"] = bool(select.select([answers], [], [], 10)[0])
            elif name == "sleep":
                time.sleep(float(arg))
            elif name == "hold":
                with open(os.environ["KVT_TEST_HOLD"], "w", encoding="ascii"):
                    pass
            elif name == "release":
                os.unlink(os.environ["KVT_TEST_HOLD"])
            elif name == "sigpipe-default":  # as a C++ host, or a CLI that wants quiet pipes, runs Python
                signal.signal(signal.SIGPIPE, signal.SIG_DFL)
            elif name == "signal-group":  # a terminal's Ctrl-C, a service manager's stop; this engine goes on
                seen = []
                signal.signal(signal.SIGINT, lambda signum, frame, seen=seen: seen.append(signum))
                signal.signal(signal.SIGTERM, lambda signum, frame, seen=seen: seen.append(signum))
                # What a group signal reaches: this process and its children in its group. Not the receiver,
                # which stands for a decode engine: in a deployment a process of its own, elsewhere.
                group = [pid for pid in _children() if pid != receiver.pid and _group(pid) == os.getpgid(0)]
                for signum in (signal.SIGINT, signal.SIGTERM):
                    for pid in group + [os.getpid()]:
                        os.kill(pid, signum)
                os.kill(link.pid(), signal.SIGTERM)  # and to the helper itself (a stop of every process of a unit)
                outcome["signalled"] = link.pid()
                outcome["seen"] = sorted(set(seen))
            elif name == "stop-helper":
                os.kill(link.pid(), signal.SIGSTOP)
            elif name == "small-socket":  # a few thousand records fill it (the link asks for megabytes)
                sock = link.connection.channel.sock
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)
            elif name == "cont-helper":
                os.kill(link.pid(), signal.SIGCONT)
            elif name == "kill-helper-nowait":  # the link must notice it on its own
                pid = outcome["killed"] = link.pid()
                os.kill(pid, signal.SIGKILL)
                _wait_gone(pid, link)  # every thread of it ended (its socket closed); not this process's child
            elif name == "zombies":
                RECORDER.drain()
                outcome["zombies"] = _children("Z")
            elif name == "local-drops":
                outcome["local_drops"] = _drops(reader)
            elif name == "many-fds":  # what a big engine holds: the pipe's descriptors land above 1,024
                import resource

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
                    os._exit(0)
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
                _wait_gone(pid, link)  # it is gone before the next frame
                outcome["killed"] = pid
            elif name == "uninstrument":
                helper = link.pid()
                instrumentor.uninstrument()
                outcome["helper_exited"] = helper is None or _ends(helper)
            outcome["helper"] = link.pid()
            print(json.dumps(outcome), flush=True)
    finally:
        receiver.stop()


def _children(state=None):
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii") as handle:
                    fields = handle.read().rsplit(") ", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid() and state in (None, fields[0]):
                found.append(int(entry))
    return found


def _group(pid):
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _drops(reader):
    totals = {}
    data = reader.get_metrics_data()
    for resource_metrics in (data.resource_metrics if data else []):
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                if metric.name == semconv.METRIC_DROPPED:
                    for point in metric.data.data_points:
                        reason = point.attributes[semconv.DROP_REASON]
                        totals[reason] = totals.get(reason, 0) + point.value
    return totals


def _wait_gone(pid, link, timeout_s=30.0):
    """Until the helper has ended and its end of the socket is closed (the kernel may release a dead process's
    files a moment after it is a zombie): what the link sees next is a helper that is gone."""
    poller = select.poll()
    poller.register(link.connection.channel.sock, select.POLLHUP)
    deadline = time.monotonic() + timeout_s
    while not (_gone(pid) and any(events & select.POLLHUP for _, events in poller.poll(0))):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the helper {pid} did not end within {timeout_s:g} s")
        time.sleep(0.01)


def _ends(pid, timeout_s=10.0):
    """The process ends (a zombie counts). Not `_gone()` at once: the kernel closes a process's files, and so
    tells its peer end-of-file, a moment before it marks the process ended."""
    try:
        handle = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        poller = select.poll()
        poller.register(handle, select.POLLIN)  # readable once every thread of it has exited
        return bool(poller.poll(timeout_s * 1000))
    finally:
        os.close(handle)


def _gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            return handle.read().split(") ", 1)[1].startswith("Z")  # ended, waiting to be reaped
    except OSError:  # reaped meanwhile (by whoever adopted it)
        return True


if __name__ == "__main__":
    main(sys.argv[1:])
