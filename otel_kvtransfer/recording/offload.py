"""`OTEL_KVTRANSFER_BUILDER=process`: spans and metrics are built in a helper process, not in the engine's.

In-process, building a span and its histogram points costs the engine process ~140-220 us of CPU per transfer
on a slow core, nearly all of it inside the OpenTelemetry SDK (bench/RESULTS.md), and holds the GIL the engine's
own threads need. With this mode the engine process keeps only the hot path and, on the recorder's thread, one
pickled frame per drain written to a socket; the helper (`helper_process`) reads the frames and runs the same
builder and metrics processor on an SDK it sets up from the same OTEL_* variables.

The helper starts with the first frame, so a process that records nothing (sglang's tokenizer, say) never starts
one. It runs in a session of its own and ends on end-of-file from its engine. Every record is counted exactly once:
- built by the helper, which acknowledges every frame it has handled;
- or, when the helper is alive but not reading (busy, or its collector slow) and the socket is full, dropped
  here before it is written;
- or, when the helper died, lost with the frames it never acknowledged (every acknowledgement it sent is read
  first). The socket (MSG_NOSIGNAL) never raises SIGPIPE in an engine that restored SIGPIPE's default action.
A live helper is never given up for being slow. A dead one is replaced: at once when it had acknowledged
something, else after a backoff that doubles up to RESTART_BACKOFF_MAX_S; never a permanent give-up. Drops travel
in the next frame to a live helper; what no helper can take is counted in this process's own MeterProvider
(`builder_process`), so drops always reach an exporter. Every helper given up is reaped.
Flushing the engine's TracerProvider drains the queue and waits for the helper to flush its providers. At exit
the helper gets end-of-file, exports what it holds and ends by itself; the engine waits at most EXIT_WAIT_S for
it and never kills it. A forked child starts its own helper.
"""

import atexit
import errno
import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Callable, Optional

from opentelemetry.sdk.trace import SpanProcessor

from otel_kvtransfer import semconv
from otel_kvtransfer.recording import wire

_logger = logging.getLogger(__name__)

HELPER_ENV = "OTEL_KVTRANSFER_HELPER"  # set in the helper's environment: never instrument the helper itself
SETUP_ENV = "OTEL_KVTRANSFER_HELPER_SETUP"  # module:function that sets up the helper's SDK instead of OTEL_*
WRITE_WAIT_S = 1.0  # how long the recorder's thread waits for room in the socket before it drops a batch
EXIT_WAIT_S = 5.0
RESTART_BACKOFF_MAX_S = 60.0
SEND_BUFFER = 4 << 20  # room for bursts while the helper builds (the kernel caps it at net.core.wmem_max)
DROP_REASON = "builder_process"
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)
_ACKS_READ = 1 << 16
_GONE = (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF)

# The helper's import path: the working directory off it (-P; on 3.10, where `-c` puts it first, removed), and
# the directory this package was imported from at its end (an engine run from a checkout finds it there).
SAFE_PATH = ("import sys\n"
             "if sys.path and sys.path[0] == '':\n    del sys.path[0]\n"
             "if sys.argv[1] not in sys.path:\n    sys.path.append(sys.argv[1])\n")
_BOOTSTRAP = SAFE_PATH + "from otel_kvtransfer.building.helper_process import main\nmain()\n"


def unavailable_reason() -> Optional[str]:
    """Why this process cannot hand its records to a helper, or None when it can."""
    if not sys.executable:
        return "this interpreter does not know its own executable (embedded Python)"
    exporters = {name.strip().lower() for name in os.environ.get("OTEL_METRICS_EXPORTER", "").split(",")}
    if "prometheus" in exporters:
        return ("OTEL_METRICS_EXPORTER includes prometheus, whose port is this process's; "
                "the helper could not serve the same port")
    return None


def _ready(fd: int, events: int, timeout_s: float) -> int:
    """poll(), not select(): an engine process may hold more than select()'s 1,024 descriptors."""
    poller = select.poll()
    poller.register(fd, events)
    ready = poller.poll(max(timeout_s, 0) * 1000)
    return ready[0][1] if ready else 0


def _helper_command() -> list:
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe_path, "-c", _BOOTSTRAP, package_parent]


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


def _own_drop_counter() -> Callable[[str, int], None]:
    """kv_transfer.instrumentation.dropped in this process's global MeterProvider."""
    from opentelemetry import metrics  # pylint: disable=import-outside-toplevel

    from otel_kvtransfer.version import __version__  # pylint: disable=import-outside-toplevel

    counter = metrics.get_meter(semconv.INSTRUMENTATION_NAME, __version__).create_counter(
        semconv.METRIC_DROPPED, unit="{record}", description=semconv.DROPPED_DESCRIPTION)
    return lambda reason, n: counter.add(n, {semconv.DROP_REASON: reason})


class HelperLink:
    """The engine side of the socket: numbered frames out, the helper's acknowledgements back.

    `count_dropped(reason, n)` counts in this process what no helper can carry (default: a counter on the global
    MeterProvider, made when first needed). All state is under one lock; nothing here waits longer than
    WRITE_WAIT_S on the recorder's thread, a flush's own timeout, or EXIT_WAIT_S at close.
    """

    def __init__(self, count_dropped: Optional[Callable[[str, int], None]] = None):
        self._count_dropped = count_dropped
        self._lock = threading.Lock()
        self._proc: Optional[subprocess.Popen] = None
        self._sock: Optional[socket.socket] = None
        self._generation = 0  # bumped whenever the helper changes: a flush waits on one helper only
        self._tail = None  # the unwritten rest of a frame begun (frames never interleave)
        self._ack_buffer = b""
        self._unacked = deque()  # (sequence, records, drops) of the frames the helper has not acknowledged
        self._flushed = 0  # the latest FLUSH sequence the helper has flushed for
        self._acked = False  # the current helper has acknowledged a frame: it works
        self._drops = {}  # drop counts to carry in the next frame
        self._sequence = 0
        self._closed = False
        self._forgotten = []  # helpers given up (or a parent's, seen from a forked child), until reaped
        self._failures = 0  # helpers in a row that ended without acknowledging anything
        self._next_start = 0.0
        self._logged = False  # one warning per episode (a loss, a stall, no helper), until a helper answers again

    # --- recorder callbacks (the recorder's thread) --------------------------------------------------------
    def send_batch(self, batch: list) -> None:
        with self._lock:
            drops, self._drops = self._drops, {}
            self._send((wire.BATCH, batch, drops), len(batch), drops, WRITE_WAIT_S)

    def add_drops(self, reason: str, count: int) -> None:
        with self._lock:
            self._drops[reason] = self._drops.get(reason, 0) + count

    def tick(self) -> None:
        if self._drops:
            self.send_batch([])
        elif self._tail is not None or self._forgotten:
            with self._lock:
                self._pump()

    # --- flush, end, close ----------------------------------------------------------------------------------
    def flush(self, timeout_s: float) -> bool:
        """Ask the helper to flush its providers; True once it says it has, within `timeout_s`. Other callers
        (the recorder's thread) are never held up for longer than one slice of the wait. A helper that ends
        before it has flushed is replaced, and the fresh one asked (with the drops the loss left)."""
        deadline = time.monotonic() + timeout_s
        while True:
            asked = self._ask_flush(deadline)
            if asked is None:
                return False
            flushed = self._await_flushed(*asked, deadline)
            if flushed is not None:
                return flushed

    def _ask_flush(self, deadline: float):
        """(sequence, generation) of a FLUSH frame sent after every frame begun before it and the drops not yet
        carried, or None when none could go before `deadline`."""
        while True:
            with self._lock:
                self._pump()
                if self._tail is None:
                    if self._drops:
                        drops, self._drops = self._drops, {}
                        self._send((wire.BATCH, [], drops), 0, drops, 0)
                    if self._tail is None:
                        sequence = self._send((wire.FLUSH,), 0, {}, 0)
                        return None if sequence is None else (sequence, self._generation)
                fd = self._sock.fileno()
            if not self._wait(fd, select.POLLOUT, deadline):
                return None

    def _await_flushed(self, sequence: int, generation: int, deadline: float) -> Optional[bool]:
        """True once that helper has flushed, False at `deadline`, None when it ended first."""
        while True:
            with self._lock:
                if self._generation == generation:
                    self._pump()
                if self._generation != generation:
                    return None
                if self._flushed >= sequence:
                    return True
                fd = self._sock.fileno()
            if not self._wait(fd, select.POLLIN | (select.POLLOUT if self._tail is not None else 0), deadline):
                return False

    @staticmethod
    def _wait(fd: int, events: int, deadline: float) -> bool:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        _ready(fd, events, min(left, 0.05))  # a slice: the descriptor may change under another thread
        return True

    def end_open(self) -> None:
        """uninstrument(): the helper ends what it holds open as evicted, as the in-process builder does."""
        with self._lock:
            if self._proc is not None:
                self._send((wire.END_OPEN,), 0, {}, WRITE_WAIT_S)

    def close(self, wait_s: float = EXIT_WAIT_S) -> None:
        """End-of-file to the helper (it exports what it holds, then exits); wait for it at most `wait_s`."""
        deadline = time.monotonic() + wait_s
        self.tick()  # the drops not yet carried
        with self._lock:
            self._closed = True
            self._pump()
            if self._proc is None:
                self._count_here(0, self._take_drops(), "the engine is ending")
                return
            proc, sock = self._proc, self._sock
            if self._tail is not None:
                self._push_tail(deadline)
            try:
                sock.shutdown(socket.SHUT_WR)  # end-of-file: the helper handles what it has, exports, and ends
            except OSError:
                pass
            while self._sock is sock and _ready(sock.fileno(), select.POLLIN, deadline - time.monotonic()):
                self._read_acks(ending=True)
            self._closed_helper(proc, deadline)

    def _closed_helper(self, proc, deadline) -> None:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            _logger.warning("otel_kvtransfer: the builder process (pid %d) is still exporting; it ends by itself",
                            proc.pid)
            self._forgotten.append(proc)
            self._unacked.clear()  # still working on them: not lost
        self._forget_helper()
        # What a helper that ended did not acknowledge was lost with it: counted here, no helper is left.
        lost = list(self._unacked)
        self._unacked.clear()
        drops = self._take_drops()
        for _, _, carried in lost:
            for reason, count in carried.items():
                drops[reason] = drops.get(reason, 0) + count
        self._count_here(sum(records for _, records, _ in lost), drops,
                         f"the builder process ended (exit code {proc.returncode})")

    def after_fork_in_child(self) -> None:
        # The parent's socket is the parent's: close this process's copy only (the parent's helper still sees
        # end-of-file when the parent closes), and let this process start its own helper on its first frame.
        self._lock = threading.Lock()
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        if self._proc is not None:
            self._forgotten.append(self._proc)
        self._proc, self._tail, self._ack_buffer = None, None, b""
        self._generation += 1
        self._unacked.clear()  # the parent's frames: the parent counts them
        self._drops = {}
        self._failures, self._next_start, self._acked, self._logged = 0, 0.0, False, False

    def pid(self) -> Optional[int]:
        proc = self._proc
        return proc.pid if proc is not None else None

    # --- the socket (callers hold self._lock) ----------------------------------------------------------------
    def _send(self, payload: tuple, records: int, drops: dict, wait_s: float) -> Optional[int]:
        """One frame; its sequence, or None when no helper took it (its records and drops counted here)."""
        if self._closed:  # after close(): a few last calls of an ending process, nobody left to build them
            self._count_here(records, drops, "the engine is ending")
            return None
        self._pump()
        deadline = time.monotonic() + wait_s
        if self._tail is not None and not self._push_tail(deadline) and self._proc is not None:
            # Alive but not reading (busy, or its exporter slow): this frame does not go; a dead one is replaced.
            self._count_here(records, drops, f"the builder process (pid {self._proc.pid}) is not reading")
            return None
        self._sequence += 1
        frame = wire.encode(payload, records, self._sequence)
        for _ in range(2):  # a helper found dead on the first write: the frame goes to a fresh one
            if not self._ensure_started():
                break
            try:
                written = self._sock.send(frame, _NOSIGNAL)
            except BlockingIOError:
                written = 0
            except OSError as exc:
                if exc.errno not in _GONE:
                    raise
                self._lost()
                continue
            self._unacked.append((self._sequence, records, drops))
            if written < len(frame):
                self._tail = memoryview(frame)[written:]
                self._push_tail(deadline)
            return self._sequence
        for reason, count in self._take_drops().items():  # those a lost helper left: nobody else carries them
            drops = dict(drops)
            drops[reason] = drops.get(reason, 0) + count
        self._count_here(records, drops, "no builder process is running")
        return None

    def _push_tail(self, deadline: float) -> bool:
        """The rest of the frame begun, waiting for room until `deadline`; True once it is all written."""
        while self._tail is not None:
            try:
                written = self._sock.send(self._tail, _NOSIGNAL)
            except BlockingIOError:
                written = 0
            except OSError as exc:
                if exc.errno not in _GONE:
                    raise
                self._lost()
                return False
            self._tail = self._tail[written:] if written < len(self._tail) else None
            if self._tail is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                if _ready(self._sock.fileno(), select.POLLOUT | select.POLLIN, left) & select.POLLIN:
                    self._read_acks()  # the helper may be waiting for us to read its acknowledgements
                    if self._sock is None:
                        return False
        return True

    def _pump(self) -> None:
        """Without waiting: the acknowledgements that came back (a helper that ended is noticed here), the rest
        of a frame begun, helpers given up that have ended (reaped)."""
        if self._sock is not None:
            self._read_acks()
        if self._tail is not None and self._sock is not None:
            self._push_tail(0)
        if self._forgotten:
            self._forgotten = [p for p in self._forgotten if p.poll() is None]

    def _read_acks(self, ending: bool = False) -> None:
        while self._sock is not None:
            try:
                chunk = self._sock.recv(_ACKS_READ)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:  # the helper ended (every acknowledgement it sent came before this)
                if not ending:
                    self._lost()
                else:
                    self._forget_socket()
                return
            self._take_acks(chunk)
            if len(chunk) < _ACKS_READ:
                return

    def _take_acks(self, chunk: bytes) -> None:
        buffer = self._ack_buffer + chunk
        whole = len(buffer) - len(buffer) % wire.ACK.size
        acknowledged = 0
        for offset in range(0, whole, wire.ACK.size):
            value = wire.ACK.unpack_from(buffer, offset)[0]
            if value & wire.FLUSHED:
                self._flushed = max(self._flushed, value & ~wire.FLUSHED)
            else:
                acknowledged = value
        self._ack_buffer = buffer[whole:]
        if acknowledged:
            unacked = self._unacked
            while unacked and unacked[0][0] <= acknowledged:
                unacked.popleft()
            if not self._acked:
                self._acked, self._failures, self._logged = True, 0, False

    def _lost(self) -> None:
        """The helper ended: read every acknowledgement it sent, then what it never acknowledged is lost (carried
        as drops by the next frame), and the next start is scheduled."""
        proc = self._proc
        self._read_acks(ending=True)
        self._forget_socket()
        lost = list(self._unacked)
        self._unacked.clear()
        records = 0
        for _, count, carried in lost:
            records += count
            for reason, dropped in carried.items():
                self._drops[reason] = self._drops.get(reason, 0) + dropped
        if records:
            self._drops[DROP_REASON] = self._drops.get(DROP_REASON, 0) + records
        if self._acked:
            self._failures, delay = 0, 0.0
        else:
            self._failures += 1
            delay = min(2.0 ** (self._failures - 1), RESTART_BACKOFF_MAX_S)
        self._next_start = time.monotonic() + delay
        code = proc.poll() if proc is not None else None
        self._forget_helper()
        if proc is not None and code is None:
            self._forgotten.append(proc)  # reaped by a later pump
        if not self._logged:
            self._logged = True
            lost_part = (f" without building {records} records; they are counted as dropped ({DROP_REASON})"
                         if records else "")
            _logger.warning("otel_kvtransfer: the builder process (pid %s) ended (exit code %s)%s; a fresh one "
                            "starts %s", getattr(proc, "pid", "?"), code, lost_part,
                            "now" if delay == 0 else f"in {delay:g} s")

    def _forget_socket(self) -> None:
        sock, self._sock = self._sock, None
        self._tail, self._ack_buffer = None, b""
        if sock is not None:
            sock.close()

    def _forget_helper(self) -> None:
        self._forget_socket()
        self._proc, self._acked = None, False
        self._generation += 1

    def _ensure_started(self) -> bool:
        if self._proc is not None:
            return True
        now = time.monotonic()
        if now < self._next_start:
            return False
        mine = theirs = None
        try:
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                mine.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
            except OSError:
                pass
            # In a session of its own: a group signal meant for the engine (Ctrl-C, a stop) does not end it.
            # stdout and stderr are the engine's own (a console exporter prints where the engine prints).
            self._proc = subprocess.Popen(  # pylint: disable=consider-using-with
                _helper_command(), stdin=theirs.fileno(), env=_helper_environment(), close_fds=True,
                start_new_session=True)
        except OSError:
            if mine is not None:
                mine.close()
            self._failures += 1
            self._next_start = now + min(2.0 ** (self._failures - 1), RESTART_BACKOFF_MAX_S)
            _logger.warning("otel_kvtransfer: could not start the builder process", exc_info=True)
            return False
        finally:
            if theirs is not None:
                theirs.close()
        mine.setblocking(False)
        self._sock, self._tail, self._ack_buffer, self._acked = mine, None, b"", False
        self._generation += 1
        return True

    # --- what no helper can carry ----------------------------------------------------------------------------
    def _take_drops(self) -> dict:
        drops, self._drops = self._drops, {}
        return drops

    def _count_here(self, records: int, drops: dict, why: str) -> None:
        """Counted in this process's own metrics: no helper can carry them now."""
        if records:
            drops = dict(drops)
            drops[DROP_REASON] = drops.get(DROP_REASON, 0) + records
        if not drops:
            return
        if self._count_dropped is None:
            self._count_dropped = _own_drop_counter()
        for reason, count in drops.items():
            try:
                self._count_dropped(reason, count)
            except Exception:  # pylint: disable=broad-except
                _logger.debug("otel_kvtransfer could not count drops", exc_info=True)
        if not self._logged:
            self._logged = True
            _logger.warning("otel_kvtransfer: %s; %d records are counted as dropped (%s) in this process's own "
                            "metrics, and what follows until a helper takes records again",
                            why, sum(drops.values()), ", ".join(sorted(drops)))


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
