"""A STAND-IN for torch.cuda (no GPU on these machines): streams whose work runs later than its launch.

Shaped as much of torch.cuda as the device clock and a forward use: `is_available()`, `current_stream()`,
`stream(s)` (a context manager), `Stream(device=None, priority=0)` with `wait_stream` / `wait_event` /
`device_index`, `Event(enable_timing=...)` with `record(stream)`, `query()`, `elapsed_time(other)` (ms, signed) and
`synchronize()`. Each stream runs what is enqueued on it, in order, on a thread of its own, as a GPU stream runs
on the device: `launch(seconds=..., gate=...)` enqueues a stand-in kernel that occupies its stream for that long
(or until the gate opens), so an event recorded after it completes when the kernel has run, not when it was
launched. An event recorded on an idle stream completes at once, as on a GPU.

The device has a clock of its own, unrelated to the host's: its origin is offset by `offset_s` and it runs
`drift_ppm` fast, so converting its times needs an anchor. Every event and kernel keeps the truth beside its
device time: the records' clock (otel_kvtransfer's clock.now_ns) read at the same instant, for tests to compare
what the instrumentation made of it.
"""

import contextlib
import threading
import time
from collections import deque

from otel_kvtransfer.recording import clock


class StandInCuda:
    def __init__(self, offset_s: float = 7_777.0, drift_ppm: float = 0.0):
        self._origin = time.monotonic_ns()
        self._offset = int(offset_s * 1e9)
        self._rate = 1.0 + drift_ppm * 1e-6
        self._cv = threading.Condition()  # one for the device: queues, events, kernels
        self._local = threading.local()
        self._streams = []
        self._closed = False
        self.default_stream = self.Stream()

    # --- torch.cuda's shape -------------------------------------------------------------------------------------
    def is_available(self) -> bool:
        return True

    def current_stream(self, device=None):
        return getattr(self._local, "stream", None) or self.default_stream

    @contextlib.contextmanager
    def stream(self, stream):
        previous = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield stream
        finally:
            self._local.stream = previous

    def Stream(self, device=None, priority=0):  # noqa: N802 - torch.cuda's name
        stream = _Stream(self)
        self._streams.append(stream)
        return stream

    def Event(self, enable_timing=False, blocking=False, interprocess=False):  # noqa: N802
        return _Event(self, enable_timing)

    # --- the stand-in's own -------------------------------------------------------------------------------------
    def launch(self, seconds: float = 0.0, gate=None, stream=None) -> "Kernel":
        """A kernel on `stream` (the current one by default): runs `seconds`, after `gate` (a threading.Event)
        opens if one is given. Returns at once, as a launch does."""
        kernel = Kernel(seconds, gate)
        (stream or self.current_stream())._enqueue(("kernel", kernel))
        return kernel

    def now(self):
        """(device time, records' clock) of one instant."""
        mono = time.monotonic_ns()
        return int((mono - self._origin) * self._rate) + self._offset, mono + clock.BASE

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()


class Kernel:
    def __init__(self, seconds, gate):
        self.seconds = seconds
        self.gate = gate
        self.started_at = None  # records' clock, when the stream began running it
        self.ended_at = None

    def run(self, device) -> None:
        self.started_at = device.now()[1]
        if self.gate is not None:
            while not self.gate.wait(0.05):
                if device._closed:
                    return
        if self.seconds:
            time.sleep(self.seconds)
        self.ended_at = device.now()[1]


class _Stream:
    device_index = 0
    device = "cuda:0"

    def __init__(self, device: StandInCuda):
        self._device = device
        self._queue = deque()
        self._busy = False
        self._thread = None

    def _enqueue(self, op) -> None:
        with self._device._cv:
            self._queue.append(op)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="standin-cuda-stream", daemon=True)
                self._thread.start()
            self._device._cv.notify_all()

    def _idle(self) -> bool:
        return not self._busy and not self._queue

    def _run(self) -> None:
        device = self._device
        while True:
            with device._cv:
                while not self._queue and not device._closed:
                    self._busy = False
                    device._cv.wait()
                if device._closed:
                    return
                kind, item = self._queue.popleft()
                self._busy = True
                if kind == "record":  # back-to-back records complete at one instant, as on a GPU
                    stamp = device.now()
                    item._stamp(stamp)
                    while self._queue and self._queue[0][0] == "record":
                        self._queue.popleft()[1]._stamp(stamp)
                    continue
                if kind == "wait":
                    while not item._done and not device._closed:
                        device._cv.wait()
                    continue
            item.run(device)  # a kernel: outside the lock, as long as it takes

    def wait_event(self, event) -> None:
        self._enqueue(("wait", event))

    def wait_stream(self, other) -> None:
        event = self._device.Event()
        event.record(other)
        self.wait_event(event)

    def query(self) -> bool:
        with self._device._cv:
            return self._idle()


class _Event:
    def __init__(self, device: StandInCuda, timing: bool):
        self._device = device
        self._timing = timing
        self._recorded = False
        self._done = False
        self.device_ns = None
        self.at = None  # the records' clock when it completed: the truth tests compare against

    def _stamp(self, stamp=None) -> None:  # under the device's lock
        self.device_ns, self.at = stamp or self._device.now()
        self._done = True
        self._device._cv.notify_all()

    def record(self, stream=None) -> None:
        stream = stream or self._device.current_stream()
        with self._device._cv:
            self._recorded, self._done = True, False
            if stream._idle():
                self._stamp()  # nothing ahead of it on its stream: done at once
                return
        stream._enqueue(("record", self))

    def query(self) -> bool:
        with self._device._cv:
            return self._done or not self._recorded

    def synchronize(self) -> None:
        with self._device._cv:
            while self._recorded and not self._done:
                self._device._cv.wait()

    def elapsed_time(self, end) -> float:
        if not (self._timing and end._timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        with self._device._cv:
            if not (self._done and end._done):
                raise RuntimeError("CUDA error: device not ready")
            return (end.device_ns - self.device_ns) / 1e6
