"""`OTEL_KVTRANSFER_BUILDER=process`: spans and metrics are built in a helper process, not in the engine's.

In-process, building a span and its four histogram points costs the engine process ~140-220 us of CPU per
transfer on a slow core, nearly all of it inside the OpenTelemetry SDK (bench/RESULTS.md), and holds the GIL the
engine's own threads need. With this mode the engine process keeps only the hot path and, on the recorder's thread, one
pickled frame per drain written to a pipe; `python -m otel_kvtransfer.helper_process` reads the frames and runs
the same builder and metrics processor on an SDK it sets up from the same OTEL_* variables.

The helper starts with the first frame, so a process that records nothing (sglang's tokenizer, say) never
starts one. Nothing is lost silently: a frame the helper cannot take within WRITE_TIMEOUT_S (hung or dead helper)
is counted as dropped (`builder_process`) and the link starts a fresh helper for what follows, at most MAX_STARTS
times per process. Flushing the engine's TracerProvider drains the queue and waits for the helper to flush its own.
At exit the helper gets end-of-file, exports what it holds and ends by itself; the engine waits at most
EXIT_WAIT_S for it and never kills it. A forked child starts its own helper.
"""

import atexit
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Optional

from opentelemetry.sdk.trace import SpanProcessor

from otel_kvtransfer import wire

_logger = logging.getLogger(__name__)

HELPER_ENV = "OTEL_KVTRANSFER_HELPER"  # set in the helper's environment: never instrument the helper itself
SETUP_ENV = "OTEL_KVTRANSFER_HELPER_SETUP"  # module:function that sets up the helper's SDK instead of OTEL_*
WRITE_TIMEOUT_S = 10.0
EXIT_WAIT_S = 5.0
MAX_STARTS = 3
DROP_REASON = "builder_process"


def unavailable_reason() -> Optional[str]:
    """Why this process cannot hand its records to a helper, or None when it can."""
    if not sys.executable:
        return "this interpreter does not know its own executable (embedded Python)"
    exporters = {name.strip().lower() for name in os.environ.get("OTEL_METRICS_EXPORTER", "").split(",")}
    if "prometheus" in exporters:
        return ("OTEL_METRICS_EXPORTER includes prometheus, whose port is this process's; "
                "the helper could not serve the same port")
    return None


def _ready(fd: int, event: int, timeout_s: float) -> bool:
    """poll(), not select(): an engine process may hold more than select()'s 1,024 descriptors."""
    poller = select.poll()
    poller.register(fd, event)
    return bool(poller.poll(max(timeout_s, 0) * 1000))


def _helper_environment() -> dict:
    """The engine's environment minus opentelemetry-instrument's sitecustomize: the helper instruments nothing."""
    env = dict(os.environ)
    env[HELPER_ENV] = "1"
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
             if p and not (os.path.basename(p.rstrip(os.sep)) == "auto_instrumentation"
                           and os.path.exists(os.path.join(p, "sitecustomize.py")))]
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    else:
        env.pop("PYTHONPATH", None)
    return env


class HelperLink:
    """The engine side of the pipe: numbered frames out, the helper's acknowledgements back.

    The helper acknowledges every frame once it has handled it. Records in frames not yet acknowledged when a
    helper is given up (dead, or stalled) are counted as dropped: a frame still in the pipe's buffer of a helper
    that died is lost, and counted, never delivered twice.
    """

    def __init__(self):
        self._proc: Optional[subprocess.Popen] = None
        self._acks: Optional[int] = None  # read end of the helper's acknowledgement pipe
        self._ack_buffer = b""
        self._unacked = deque()  # (sequence, records, drops) of the frames the helper has not acknowledged
        self._starts = 0
        self._lock = threading.Lock()  # one frame at a time: the recorder's thread and flush() both write
        self._drops = {}
        self._sequence = 0
        self._closed = False
        self._forgotten = []  # helpers given up, or a parent's seen from a forked child: referenced until they end
        self._lost_logged = False

    # --- recorder callbacks (the recorder's thread) --------------------------------------------------------
    def send_batch(self, batch: list) -> None:
        drops, self._drops = self._drops, {}
        with self._lock:
            self._send(wire.BATCH, (wire.records_out(batch), drops), len(batch), drops)

    def add_drops(self, reason: str, count: int) -> None:
        self._drops[reason] = self._drops.get(reason, 0) + count

    def tick(self) -> None:
        if self._drops:
            self.send_batch([])

    # --- flush, end, close ----------------------------------------------------------------------------------
    def flush(self, timeout_s: float) -> bool:
        """Ask the helper to flush its providers; True once it says it has, within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            sequence = self._send(wire.FLUSH, (), 0, {}, deadline)
            return sequence is not None and self._read_acks(sequence, deadline)

    def end_open(self) -> None:
        """uninstrument(): the helper ends what it holds open as evicted, as the in-process builder does."""
        with self._lock:
            if self._proc is not None:
                self._send(wire.END_OPEN, (), 0, {})

    def close(self, wait_s: float = EXIT_WAIT_S) -> None:
        """End-of-file to the helper (it exports what it holds, then exits); wait for it at most `wait_s`."""
        self.tick()  # the drops not yet carried
        with self._lock:
            self._closed = True
            proc = self._proc
            if proc is None:
                return
            try:
                proc.stdin.close()  # end-of-file: the helper handles what is in the pipe, then ends
            except OSError:
                pass
            try:
                proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                _logger.warning("otel_kvtransfer: the builder process (pid %d) is still exporting after %ss; "
                                "it ends by itself", proc.pid, wait_s)
                self._forgotten.append(proc)
                self._unacked.clear()  # still working on them: not lost
            else:
                self._read_acks(None, time.monotonic(), give_up_at_end=False)
            # What a helper that ended did not acknowledge was lost with it; nobody is left to count it.
            lost = sum(records for _, records, _ in self._unacked)
            if lost:
                _logger.warning("otel_kvtransfer: the builder process ended (exit code %s) without building %d "
                                "records", proc.returncode, lost)
            self._unacked.clear()
            self._proc = None
            self._close_acks()

    def after_fork_in_child(self) -> None:
        # The parent's pipe ends are the parent's: close our copies (so its helper still sees end-of-file when
        # the parent closes), and let this process start its own helper on its first frame.
        self._lock = threading.Lock()
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                proc.stdin.close()  # this process's copy of the descriptor only
            except OSError:
                pass
            self._forgotten.append(proc)
        self._close_acks()
        self._unacked.clear()  # the parent's frames: the parent counts them
        self._starts = 0
        self._drops = {}

    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    # --- the pipe (callers hold self._lock) ------------------------------------------------------------------
    def _send(self, kind: str, body: tuple, records: int, drops: dict, deadline: Optional[float] = None):
        """Frame `kind` with the next sequence number; its sequence, or None when it could not go (counted)."""
        if self._closed:  # after close(): a few last calls of an ending process, nobody left to build them
            if records:
                self.add_drops(DROP_REASON, records)
            return None
        self._sequence += 1
        sequence = self._sequence
        frame = wire.encode((kind, sequence) + body)
        if self._write(frame, deadline or time.monotonic() + WRITE_TIMEOUT_S):
            self._unacked.append((sequence, records, drops))
            self._read_acks(None, time.monotonic())  # what has come back so far, without waiting
            return sequence
        self._count_lost([(sequence, records, drops)])
        return None

    def _count_lost(self, frames) -> None:
        """Records (and the drops they carried) that no helper will build: counted, carried by the next frame."""
        records = 0
        for _, count, drops in frames:
            records += count
            for reason, dropped in drops.items():
                self.add_drops(reason, dropped)
        if records:
            self.add_drops(DROP_REASON, records)
            if not self._lost_logged:
                self._lost_logged = True
                _logger.warning("otel_kvtransfer: the builder process did not take %d records; they are counted "
                                "as dropped (%s) and a fresh helper (at most %d per process) takes what follows",
                                records, DROP_REASON, MAX_STARTS)

    def _ensure_started(self) -> bool:
        if self._proc is not None:
            return True
        if self._starts >= MAX_STARTS:
            return False
        self._forgotten = [p for p in self._forgotten if p.poll() is None]  # reap helpers given up that ended
        self._starts += 1
        acks, ack_end = os.pipe()
        try:
            # stdout and stderr are the engine's own (a console exporter prints where the engine prints).
            self._proc = subprocess.Popen(  # pylint: disable=consider-using-with
                [sys.executable, "-m", "otel_kvtransfer.helper_process", str(ack_end)],
                stdin=subprocess.PIPE, env=_helper_environment(), close_fds=True, pass_fds=(ack_end,))
        except OSError:
            os.close(acks)
            _logger.warning("otel_kvtransfer: could not start the builder process", exc_info=True)
            return False
        finally:
            os.close(ack_end)
        self._acks, self._ack_buffer = acks, b""
        os.set_blocking(self._proc.stdin.fileno(), False)
        return True

    def _write(self, frame: bytes, deadline: float) -> bool:
        """The whole frame, or False (and this helper is given up) when it could not go before `deadline`."""
        if not self._ensure_started():
            return False
        fd = self._proc.stdin.fileno()
        view = memoryview(frame)
        try:
            while view:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                if _ready(fd, select.POLLOUT, left):
                    try:
                        view = view[os.write(fd, view):]
                    except BlockingIOError:
                        pass
            return True
        except (OSError, TimeoutError, ValueError):
            self._give_up()
            return False

    def _read_acks(self, until: Optional[int], deadline: float, give_up_at_end: bool = True) -> bool:
        """Take the acknowledgements that have come back; with `until`, wait (to `deadline`) for that frame's.
        True when `until` is acknowledged (or not asked for). A helper that closed its end is given up, unless
        it is ending because we closed ours."""
        while True:
            if until is not None and (not self._unacked or self._unacked[0][0] > until):
                return True
            if self._acks is None:
                return until is None
            if not _ready(self._acks, select.POLLIN, deadline - time.monotonic()):
                return until is None
            chunk = os.read(self._acks, 4096)
            if not chunk:  # the helper ended
                if give_up_at_end:
                    self._give_up()
                return until is None
            self._ack_buffer += chunk
            whole = len(self._ack_buffer) - len(self._ack_buffer) % wire.ACK.size
            for offset in range(0, whole, wire.ACK.size):
                acknowledged = wire.ACK.unpack_from(self._ack_buffer, offset)[0]
                while self._unacked and self._unacked[0][0] <= acknowledged:
                    self._unacked.popleft()
            self._ack_buffer = self._ack_buffer[whole:]
            if until is None and not _ready(self._acks, select.POLLIN, 0):
                return True

    def _give_up(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass
            self._forgotten.append(proc)
        self._close_acks()
        lost, self._unacked = list(self._unacked), deque()
        self._count_lost(lost)

    def _close_acks(self) -> None:
        acks, self._acks = self._acks, None
        if acks is not None:
            os.close(acks)


class HelperFlushProcessor(SpanProcessor):
    """On the engine's TracerProvider: its flush and shutdown also deliver to, and flush, the helper."""

    def __init__(self, recorder, link: HelperLink):
        self._recorder = recorder
        self._link = link

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        deadline = time.monotonic() + timeout_millis / 1000
        if not self._recorder.drain(timeout_millis / 1000):
            return False
        return self._link.flush(max(deadline - time.monotonic(), 0.001))

    def shutdown(self) -> None:
        self._recorder.final_drain()
        self._link.close()


def register_exit(link: HelperLink) -> None:
    """Close the link at exit after the recorder's final drain (registered before it: atexit runs last first)."""
    atexit.register(link.close)


def unregister_exit(link: HelperLink) -> None:
    atexit.unregister(link.close)
