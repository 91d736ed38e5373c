"""`OtlpJsonFileSpanExporter`: spans to an OTLP-JSON file, the format `otel-kvtransfer summarize|timeline` read.

Each export batch is one line holding one `ExportTraceServiceRequest` in OTLP's JSON encoding (what the
Collector's file exporter writes): the SDK's own OTLP encoder builds the protobuf message, `json_format` turns it
into JSON, and trace and span ids are written as hex as OTLP/JSON requires. Lines are appended with O_APPEND and
one write() per batch, so several processes (and forked children, which reopen the file) can share one file.

    OTEL_TRACES_EXPORTER=kvtransfer_file OTEL_KVTRANSFER_SPAN_FILE=spans.jsonl opentelemetry-instrument python app.py

or in code: `BatchSpanProcessor(OtlpJsonFileSpanExporter("spans.jsonl"))`.

A span file must never hurt the process that writes it, and what it loses is never silent:

* the file I/O runs on one daemon thread of the exporter's own; an export waits for it at most
  `write_timeout_s`, so a hung mount holds that thread only, never the engine's exit;
* the path is opened with O_NOFOLLOW and O_NONBLOCK and must be a regular file: a symlink planted at the path
  (a shared folder) is refused, a FIFO or a device is refused instead of blocking;
* a failed write (no folder, a directory, a full disk, the file-size limit) is one ERROR line per cause naming
  the path and the OS error, its spans are counted in kv_transfer.instrumentation.dropped with
  kv_transfer.drop_reason = `span_file`, and `force_flush()` returns False;
* a span is counted only if it is not written: a write that outlasts `write_timeout_s` (a slow disk) ends its
  export (FAILURE) but is counted only when it fails, or when it still has not returned at shutdown; while it
  is pending, the batches that come fail at once and are counted (they are not written), and until a write
  ends in time again no export waits for its write (the next line is handed over as the last one lands), so a
  flush or an exit through a BatchSpanProcessor never waits on a slow disk batch after batch; `force_flush()`
  waits for a pending write at most its own timeout and returns False while it is pending;
* a line never continues a torn one: when the file does not end with a newline (a full disk, a crash) the next
  line starts with one, so the reader skips only the torn line. The look at the file's end and the write are made
  under an exclusive advisory lock (flock) that every writer of the file takes: another process's append in
  progress shows a size whose last byte is inside its line (the kernel grows the file page by page), which read
  without the lock took for a torn line and left an empty line after it. A lock not had within LOCK_WAIT_S (a
  writer stopped while holding it) is done without;
* a file renamed or removed under it (log rotation) is noticed at the next batch, which goes to a new file at
  the path;
* no line is longer than MAX_LINE, the reader's limit: a batch that would be is split, and a span that alone
  would be is dropped, counted;
* a span the OTLP encoder cannot encode (a time outside fixed64 fails the encoding of its whole batch) is left
  out alone, counted; the rest of its batch is written.
"""

import base64
import errno
import json
import logging
import os
import queue
import stat
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, cast

try:
    import fcntl
except ImportError:  # not a POSIX system: no lock, the look at the file's end may see another append in progress
    fcntl = None  # type: ignore[assignment]

from google.protobuf import json_format
from opentelemetry import metrics
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.metrics import Counter, MeterProvider
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_kvtransfer import semconv

ENV_SPAN_FILE = "OTEL_KVTRANSFER_SPAN_FILE"
DROP_REASON = "span_file"
# The longest line the writer writes and the reader reads (one limit, so every written line reads back). It also
# bounds what reading one line may cost (docs/tools.md); a batch longer than this is split over several lines.
MAX_LINE = 16 << 20
LOCK_WAIT_S = 1.0  # how long a write waits for another writer's lock on the file before it goes on without
_LOG = logging.getLogger(__name__)

# Causes logged once per exporter, whatever is written between (a span that cannot be encoded is about that span).
_SAID_ONCE = frozenset({"unencodable"})

# Fields that hold ids: bytes in protobuf (base64 in proto3 JSON), hex strings in OTLP/JSON.
ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def _spans_of(request: Dict[str, Any]) -> Iterator[Dict[str, Any]]:
    """Every span and link dict of an OTLP-JSON export request, tolerating any shape (non-dicts are skipped)."""
    for resource_spans in _list(request.get("resourceSpans")):
        for scope_spans in _list(resource_spans.get("scopeSpans") if isinstance(resource_spans, dict) else None):
            for span in _list(scope_spans.get("spans") if isinstance(scope_spans, dict) else None):
                if isinstance(span, dict):
                    yield span
                    yield from (link for link in _list(span.get("links")) if isinstance(link, dict))


def _list(value: Any) -> List[Any]:
    return value if isinstance(value, list) else []


def ids_to_hex(request: Dict[str, Any]) -> Dict[str, Any]:
    """proto3 JSON (base64 ids) -> OTLP/JSON (hex ids), in place."""
    for item in _spans_of(request):
        for key in ID_FIELDS:
            if isinstance(item.get(key), str):
                item[key] = base64.b64decode(item[key]).hex()
    return request


def ids_from_hex(request: Dict[str, Any]) -> Dict[str, Any]:
    """OTLP/JSON (hex ids) -> proto3 JSON (base64 ids), in place, so `json_format` can parse it. A value that is
    not hex of an id's length is left alone (it may be base64 already; the parser judges it)."""
    for item in _spans_of(request):
        for key in ID_FIELDS:
            value = item.get(key)
            if isinstance(value, str) and len(value) in (16, 32):
                try:
                    item[key] = base64.b64encode(bytes.fromhex(value)).decode("ascii")
                except ValueError:
                    pass
    return request


def encode_line(spans: Sequence[ReadableSpan]) -> str:
    """One OTLP-JSON line (with its newline) for a batch of finished spans."""
    message = encode_spans(spans)
    request = json_format.MessageToDict(message, use_integers_for_enums=True)
    return json.dumps(ids_to_hex(request), separators=(",", ":")) + "\n"


def encode_lines(spans: Sequence[ReadableSpan],
                 limit: int = MAX_LINE) -> Tuple[List[Tuple[bytes, int]], List[ReadableSpan], List[ReadableSpan]]:
    """(lines, spans too big, spans that do not encode): the batch as lines of at most `limit` bytes, halved until
    each fits; a span whose line alone is over the limit cannot be written and is returned apart. A batch the
    encoder refuses (one span with a time outside OTLP's fixed64 fails all of it) is halved too, down to the spans
    that alone do not encode: only those are left out."""
    lines: List[Tuple[bytes, int]]  # (line, spans in it)
    too_big: List[ReadableSpan]
    unencodable: List[ReadableSpan]
    lines, too_big, unencodable, todo = [], [], [], [list(spans)]
    while todo:
        batch = todo.pop()
        try:
            data = encode_line(batch).encode("ascii")  # json.dumps escapes all non-ASCII
        except Exception:
            if len(batch) == 1:
                unencodable.append(batch[0])
            else:
                half = len(batch) // 2
                todo += [batch[half:], batch[:half]]  # popped first half first: file order kept
            continue
        if len(data) <= limit:
            lines.append((data, len(batch)))
        elif len(batch) == 1:
            too_big.append(batch[0])
        else:
            half = len(batch) // 2
            todo += [batch[half:], batch[:half]]
    return lines, too_big, unencodable


class _Failure(Exception):
    """A write that failed: `cause` names it once per kind (what is logged), `detail` says what happened."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(detail)
        self.cause, self.detail = cause, detail


class _Job:
    """One line for the writer thread. `late`: its export stopped waiting for it, so its outcome is settled where
    it ends (the writer thread counts a failure) or at shutdown; `done` is set once it is settled."""

    __slots__ = ("data", "count", "failure", "done", "late", "settled", "handed")

    def __init__(self, data: bytes, count: int) -> None:
        self.data, self.count = data, count
        self.handed = time.monotonic()
        self.failure: Optional[_Failure] = None
        self.done = threading.Event()
        self.late = self.settled = False


_PENDING = _Failure("pending", "the write is still in progress")  # not a loss: settled when the write ends


class _FileWriter:
    """Owns the descriptor; runs only on the exporter's writer thread."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd: Optional[int] = None
        self.identity: Optional[Tuple[int, int]] = None  # (st_dev, st_ino) of the open file

    def close(self) -> None:
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
        self.fd = self.identity = None

    def _open(self) -> None:
        # O_RDWR: the last byte is read back to tell a torn line (pread needs a readable descriptor).
        flags = os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _Failure("symlink", "is a symbolic link (refused: O_NOFOLLOW)") from None
            if exc.errno == errno.ENXIO:  # O_NONBLOCK on a FIFO nobody reads
                raise _Failure("not_regular", "is a FIFO, not a regular file") from None
            raise _Failure(f"open:{exc.errno}", f"cannot open: {exc.strerror or exc}") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise _Failure("not_regular", "is not a regular file (a FIFO, device or socket would block)")
        self.fd, self.identity = fd, (info.st_dev, info.st_ino)

    def _rotated(self) -> bool:
        """True when the path no longer names the open file (renamed or removed: rotation)."""
        try:
            info = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return True
        return (info.st_dev, info.st_ino) != self.identity

    def _ends_torn(self) -> bool:  # (the file is open: write() opened it, the casts say so)
        size = os.fstat(cast(int, self.fd)).st_size
        return size > 0 and os.pread(cast(int, self.fd), 1, size - 1) != b"\n"

    def write(self, data: bytes) -> None:
        if self.fd is not None and self._rotated():
            self.close()
        if self.fd is None:
            self._open()
        fd = cast(int, self.fd)  # (opened above)
        locked = _lock(fd)  # no other writer's append in progress while the end is looked at
        try:
            if self._ends_torn():  # never continue a torn line: this line starts on a line of its own
                data = b"\n" + data
            view = memoryview(data)
            while view:  # one write() per batch keeps lines of concurrent processes whole
                view = view[os.write(fd, view):]
        except OSError as exc:
            if locked:
                _unlock(fd)  # before a close: the number may be another file's right after
                locked = False
            if exc.errno in (errno.EBADF, errno.ESTALE):
                self.close()
            raise _Failure(f"write:{exc.errno}", f"write failed: {exc.strerror or exc}") from None
        finally:
            if locked:
                _unlock(fd)


def _lock(fd: int) -> bool:
    """The file's exclusive advisory lock, waited for at most LOCK_WAIT_S; False without it (no lock on this
    system or filesystem, or another writer held it all that time)."""
    if fcntl is None:
        return False
    give_up = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:  # another writer's append: microseconds, as a rule
            if time.monotonic() >= give_up:
                return False
            time.sleep(0.001)
        except OSError:  # a filesystem without locks
            return False


def _unlock(fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError:  # closed after a failed write: the lock went with it
        pass


class OtlpJsonFileSpanExporter(SpanExporter):
    """Appends each export batch to `path` (default: $OTEL_KVTRANSFER_SPAN_FILE) as one OTLP-JSON line.

    With neither, it says so in one logged line and every export fails: a missing setting must not stop the
    process it was configured into (`opentelemetry-instrument` would print a traceback for an exception).
    `meter_provider` receives the drop count (default: the global one, looked up when a drop happens)."""

    def __init__(self, path: Optional[str] = None, meter_provider: Optional[MeterProvider] = None,
                 write_timeout_s: float = 5.0) -> None:
        path = path or os.environ.get(ENV_SPAN_FILE)
        if not path:
            _LOG.error("kvtransfer_file span exporter: no file to write: set %s=PATH; no spans will be written",
                       ENV_SPAN_FILE)
        self.path = os.fspath(path) if path else None
        self.write_timeout_s = write_timeout_s
        self._meter_provider = meter_provider
        self._counter: Optional[Counter] = None
        self._lock = threading.Lock()
        self._logged = {"no_path"} if self.path is None else set()  # causes logged, until a write succeeds again
        self._failed = False  # a batch was lost since the last force_flush
        self._start()

    # ---- the writer thread
    def _start(self) -> None:
        self._pid = os.getpid()
        self._jobs: "queue.Queue[Optional[_Job]]" = queue.Queue()  # None: the thread ends
        self._stuck: Optional[_Job] = None  # a write that outlasted its wait: until it ends, writes fail at once
        self._slow = False  # a write outlasted its wait: exports hand their line over without waiting, until a
        # write ends within write_timeout_s again (a flush through a BatchSpanProcessor exports batch after batch)
        self._thread: Optional[threading.Thread] = None

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, args=(self._jobs,), daemon=True,
                                            name="kvtransfer-span-file")
            self._thread.start()

    def _run(self, jobs: "queue.Queue[Optional[_Job]]") -> None:
        writer = _FileWriter(cast(str, self.path))  # (an exporter with no path never starts its writer)
        while True:
            job = jobs.get()
            if job is None:
                writer.close()
                return
            failure = None
            try:
                writer.write(job.data)
            except _Failure as failed:
                failure = failed
            except Exception as exc:  # anything else is a failed write too
                failure = _Failure(f"error:{type(exc).__name__}", f"write failed: {exc}")
            with self._lock:  # against the waiter giving up on it at this moment, and against shutdown
                job.failure = failure
                if time.monotonic() - job.handed <= self.write_timeout_s:
                    self._slow = False  # the disk answers in time again
                if job.late and not job.settled:
                    job.settled = True
                    if failure is not None:
                        self._drop(job.count, failure)
                job.done.set()

    def _write(self, data: bytes, count: int) -> Optional[_Failure]:
        """Hand one line to the writer thread and wait for it, at most write_timeout_s: None once written, the
        failure to count, or _PENDING when it outlasted the wait (settled when it ends: not counted here)."""
        if self._pid != os.getpid():  # a forked child: no writer thread, a lock another thread may have held
            self._lock = threading.Lock()
            self._start()
        with self._lock:
            self._ensure_thread()
            if self._stuck is not None:
                if not self._stuck.done.is_set():  # fail at once: one timeout is all an exit waits for
                    return _Failure("stuck", "an earlier write has not returned (a slow or hung filesystem?)")
                self._stuck = None
            job = _Job(data, count)
            if self._slow:  # the last write outlasted its wait: this one is not waited for, it is settled late
                job.late = True
                self._stuck = job
            self._jobs.put(job)
            if job.late:
                return _PENDING
        if not job.done.wait(self.write_timeout_s):
            with self._lock:
                if not job.done.is_set():
                    job.late = True
                    self._stuck, self._slow = job, True
                    self._log_once(_Failure("timeout", f"write did not return within {self.write_timeout_s:g} s "
                                                       "(a slow or hung filesystem?); its spans are counted if "
                                                       "it fails or has not returned at shutdown"))
                    return _PENDING
        return job.failure

    # ---- accounting
    def _log_once(self, failure: _Failure) -> None:
        if failure.cause not in self._logged:
            self._logged.add(failure.cause)
            _LOG.error("kvtransfer_file span exporter: %s: %s; spans not written are dropped and counted "
                       "(kv_transfer.drop_reason=%s)", self.path, failure.detail, DROP_REASON)

    def _drop(self, count: int, failure: _Failure) -> None:
        self._failed = True
        self._log_once(failure)
        try:
            if self._counter is None:
                meter = metrics.get_meter(semconv.INSTRUMENTATION_NAME, meter_provider=self._meter_provider)
                self._counter = meter.create_counter(semconv.METRIC_DROPPED, unit="{record}",
                                                     description=semconv.DROPPED_DESCRIPTION)
            self._counter.add(count, {semconv.DROP_REASON: DROP_REASON})
        except Exception:  # counting must not turn a failure into a raise
            _LOG.debug("kvtransfer_file span exporter: could not count dropped spans", exc_info=True)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        if self.path is None:  # said once, at construction; every lost span is still counted
            self._drop(len(spans), _Failure("no_path", "no file to write"))
            return SpanExportResult.FAILURE
        ok = True
        try:
            lines, too_big, unencodable = encode_lines(spans)
        except Exception as exc:  # an exporter reports failure, never raises
            self._drop(len(spans), _Failure("encode", f"cannot encode spans: {exc}"))
            return SpanExportResult.FAILURE
        if unencodable:  # the rest of their batch is written
            ok = False
            self._drop(len(unencodable), _Failure("unencodable", "a span the OTLP encoder cannot encode (a time "
                                                                 "outside what OTLP carries) is left out"))
        if too_big:
            ok = False
            self._drop(len(too_big), _Failure("too_big", f"a span alone encodes to over {MAX_LINE >> 20} MiB, "
                                                         "the longest line a span file may hold"))
        for data, count in lines:
            failure = self._write(data, count)
            if failure is None:
                self._logged &= _SAID_ONCE  # a write that works again: its failures are news again
            else:
                ok = False
                if failure is not _PENDING:  # a pending write is counted where it ends, only if it fails
                    self._drop(count, failure)
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def shutdown(self, timeout_millis: float = 30000) -> None:
        if self._pid != os.getpid() or self._thread is None:
            return
        self._jobs.put(None)
        # a writer stuck in a hung filesystem is left behind (a daemon thread): the exit does not wait for it
        self._thread.join(min(self.write_timeout_s, max(timeout_millis, 0) / 1000))
        with self._lock:  # a write still pending now is taken as lost: counted once (its line may yet land)
            stuck = self._stuck
            if stuck is not None and not stuck.done.is_set() and not stuck.settled:
                stuck.settled = True
                self._drop(stuck.count, _Failure("shutdown", "a write had not returned at shutdown"))

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """False when a batch was lost since the last call, or a write is still pending: that one is waited
        for, at most `timeout_millis` (every other export already waited for its write)."""
        stuck = self._stuck
        if stuck is not None:
            stuck.done.wait(max(timeout_millis, 0) / 1000)
        with self._lock:
            failed, self._failed = self._failed, False
            pending = stuck is not None and not stuck.done.is_set()
        return not (failed or pending)
