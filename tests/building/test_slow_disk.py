"""A slow disk under the span file exporter: a span is counted as lost only if it is not written.

A write that outlasts the exporter's write timeout ends its export, but its line still lands when the disk
answers; before, its spans were counted as dropped all the same (written and counted). Now such a write is
settled where it ends: counted only if it fails, or if it still has not returned when the exporter shuts down.
The batches that come while it is pending are not written (they fail at once, so an exit never waits on the
disk twice) and are counted. `force_flush()` waits for the pending write at most its own timeout.

The slow disk is real where the machine allows: an ext4 image loop-mounted in a private mount namespace and
frozen with fsfreeze, so the exporter's write() blocks in the kernel until the test thaws it. The other cases use
a stand-in, a write that returns only when the test lets it (and then fails, for the late failure).
"""

import errno
import json
import os
import shutil
import subprocess
import sys
import threading

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExportResult
from support.parts import require_part
from support.paths import ROOT as REPO
from support.telemetry import dropped_by_reason, in_memory_metrics

from otel_kvtransfer import semconv as sc
from otel_kvtransfer.building import file_exporter as fe
from otel_kvtransfer.tools.spanfile import read_spans


def _spans(count, key):
    tracer = TracerProvider().get_tracer("otel_kvtransfer")
    out = []
    for number in range(count):
        span = tracer.start_span(sc.SPAN_SEND, attributes={sc.REQUEST_KEY: f"{key}-{number}", sc.BYTES: 4096})
        span.end()
        out.append(span)
    return out


class _GatedDisk:
    """Stand-in for a slow disk: the writer thread's write() waits until `answer` is set, then writes (or fails
    with `error`)."""

    def __init__(self, monkeypatch):
        self.answer = threading.Event()
        self.entered = threading.Event()
        self.error = None
        real_write = os.write

        def write(fd, data):
            if threading.current_thread().name == "kvtransfer-span-file":
                self.entered.set()
                assert self.answer.wait(60)
                if self.error is not None:
                    raise OSError(self.error, os.strerror(self.error))
            return real_write(fd, data)

        monkeypatch.setattr(fe.os, "write", write)


def _exporter(path):
    provider, reader = in_memory_metrics()
    exporter = fe.OtlpJsonFileSpanExporter(str(path), meter_provider=provider, write_timeout_s=0.3)
    return exporter, reader


def test_a_write_that_lands_after_its_timeout_is_not_counted(tmp_path, monkeypatch):
    disk = _GatedDisk(monkeypatch)
    path = tmp_path / "spans.jsonl"
    exporter, reader = _exporter(path)
    assert exporter.export(_spans(2, "late")) == SpanExportResult.FAILURE  # outlasted its wait: pending
    assert exporter.export(_spans(3, "meanwhile")) == SpanExportResult.FAILURE  # not written: counted at once
    assert exporter.force_flush(timeout_millis=100) is False  # the write is still pending
    disk.answer.set()
    assert exporter.force_flush(timeout_millis=30000) is True  # it landed, and nothing was lost since
    exporter.shutdown()
    written = sorted(s.attributes[sc.REQUEST_KEY] for s in read_spans(path))
    assert written == ["late-0", "late-1"]
    assert dropped_by_reason(reader) == {fe.DROP_REASON: 3}  # exactly the spans not written (before: 5, the late 2 too)


def test_a_write_that_fails_after_its_timeout_is_counted_when_it_fails(tmp_path, monkeypatch):
    disk = _GatedDisk(monkeypatch)
    disk.error = errno.ENOSPC
    path = tmp_path / "spans.jsonl"
    exporter, reader = _exporter(path)
    assert exporter.export(_spans(2, "late")) == SpanExportResult.FAILURE
    assert dropped_by_reason(reader) == {}  # not yet known to be lost
    disk.answer.set()
    assert exporter.force_flush(timeout_millis=30000) is False  # it failed: lost since the last flush
    assert dropped_by_reason(reader) == {fe.DROP_REASON: 2}
    exporter.shutdown()
    assert not path.exists() or path.read_bytes() == b""  # nothing of it was written


def test_a_write_still_pending_at_shutdown_is_counted_once(tmp_path, monkeypatch):
    disk = _GatedDisk(monkeypatch)
    exporter, reader = _exporter(tmp_path / "spans.jsonl")
    assert exporter.export(_spans(2, "late")) == SpanExportResult.FAILURE
    exporter.shutdown(timeout_millis=100)  # returns with the write still in the kernel's hands
    assert dropped_by_reason(reader) == {fe.DROP_REASON: 2}
    disk.error = errno.EIO
    disk.answer.set()  # it ends afterwards, failed: settled already, not counted again
    assert exporter.force_flush(timeout_millis=30000) is False
    assert dropped_by_reason(reader) == {fe.DROP_REASON: 2}


class _PerWriteDisk:
    """Stand-in for a slow disk, one write at a time: each of the writer thread's write() calls waits for a
    permit the test gives (`answer_one`); every wait an export makes on its write is recorded."""

    def __init__(self, monkeypatch):
        self.permits = threading.Semaphore(0)
        self.waits = []  # (spans in the line, timeout) of every wait an export made on its write
        real_write = os.write

        def write(fd, data):
            if threading.current_thread().name == "kvtransfer-span-file":
                assert self.permits.acquire(timeout=60)
            return real_write(fd, data)

        monkeypatch.setattr(fe.os, "write", write)
        waits, real_init = self.waits, fe._Job.__init__

        class _Done(threading.Event):
            def __init__(self, count):
                super().__init__()
                self.count = count

            def wait(self, timeout=None):
                if threading.current_thread().name != "kvtransfer-span-file":
                    waits.append((self.count, timeout))
                return super().wait(timeout)

        def init(job, data, count):
            real_init(job, data, count)
            job.done = _Done(count)

        monkeypatch.setattr(fe._Job, "__init__", init)

    def answer_one(self):
        self.permits.release()


def test_after_a_write_outlasted_its_wait_exports_do_not_wait_on_the_slow_disk(tmp_path, monkeypatch):
    """A flush through a BatchSpanProcessor exports batch after batch: on a disk slower than the write timeout,
    each export used to wait that timeout again (108.7 s for one flush of 6,932 spans on 6 s writes). Once one
    write outlasted its wait, the next line is handed over without waiting, until a write ends in time again."""
    disk = _PerWriteDisk(monkeypatch)
    path = tmp_path / "spans.jsonl"
    exporter, reader = _exporter(path)
    assert exporter.export(_spans(2, "first")) == SpanExportResult.FAILURE  # waited its timeout: pending
    assert disk.waits == [(2, 0.3)]
    disk.answer_one()
    assert exporter.force_flush(timeout_millis=30000) is True  # it landed
    assert exporter.export(_spans(3, "second")) == SpanExportResult.FAILURE  # handed over, not waited for
    assert exporter.export(_spans(4, "meanwhile")) == SpanExportResult.FAILURE  # the writer is busy: not written
    assert all(count == 2 for count, _ in disk.waits)  # no export waited on the 3's write, nor on any other
    disk.answer_one()
    assert exporter.force_flush(timeout_millis=30000) is False  # the 4 were lost since the last flush
    exporter.shutdown()
    written = sorted(s.attributes[sc.REQUEST_KEY] for s in read_spans(path))
    assert written == ["first-0", "first-1", "second-0", "second-1", "second-2"]
    assert dropped_by_reason(reader) == {fe.DROP_REASON: 4}  # exactly the spans not written


# --- a real frozen filesystem ---------------------------------------------------------------------------------

_FROZEN_DISK = r"""
import json, os, subprocess, sys, threading
sys.path.insert(0, sys.argv[3])
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from otel_kvtransfer import semconv as sc
from otel_kvtransfer.building import file_exporter as fe

image, mount = sys.argv[1], sys.argv[2]

def spans(count, key):
    tracer = TracerProvider().get_tracer("otel_kvtransfer")
    out = []
    for number in range(count):
        span = tracer.start_span(sc.SPAN_SEND, attributes={sc.REQUEST_KEY: f"{key}-{number}"})
        span.end()
        out.append(span)
    return out

def thaw():
    subprocess.run(["fsfreeze", "-u", mount], capture_output=True)

subprocess.run(["mount", "-o", "loop", image, mount], check=True)
result = {}
try:
    reader = InMemoryMetricReader()
    exporter = fe.OtlpJsonFileSpanExporter(os.path.join(mount, "spans.jsonl"),
                                           meter_provider=MeterProvider(metric_readers=[reader]),
                                           write_timeout_s=0.5)
    result["first"] = exporter.export(spans(1, "first")).name  # the file is open and written
    subprocess.run(["fsfreeze", "-f", mount], check=True)
    watchdog = threading.Timer(60, thaw)  # never leave it frozen, whatever happens below
    watchdog.start()
    result["late"] = exporter.export(spans(2, "late")).name  # write() blocks in the frozen filesystem
    result["meanwhile"] = exporter.export(spans(3, "meanwhile")).name
    result["flush_frozen"] = exporter.force_flush(timeout_millis=200)
    thaw()
    result["flush_thawed"] = exporter.force_flush(timeout_millis=30000)
    watchdog.cancel()
    exporter.shutdown()
    dropped = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                for point in metric.data.data_points:
                    dropped[point.attributes[sc.DROP_REASON]] = point.value
    result["dropped"] = dropped
    with open(os.path.join(mount, "spans.jsonl"), "rb") as handle:
        result["file"] = handle.read().decode()
finally:
    thaw()
    subprocess.run(["umount", mount], capture_output=True)
print("RESULT " + json.dumps(result), flush=True)
"""


def _can_freeze() -> bool:
    return (os.geteuid() == 0 and all(shutil.which(tool) for tool in ("unshare", "mount", "mkfs.ext4", "fsfreeze"))
            and os.path.exists("/dev/loop-control"))


def test_a_frozen_filesystem_counts_only_the_spans_it_never_wrote(tmp_path):
    require_part(_can_freeze(), "root, loop devices, unshare, mkfs.ext4 and fsfreeze (a real slow disk)")
    image, mount = tmp_path / "disk.img", tmp_path / "mnt"
    mount.mkdir()
    with open(image, "wb") as handle:
        handle.truncate(16 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True, timeout=60)
    script = tmp_path / "frozen.py"
    script.write_text(_FROZEN_DISK)
    # A mount namespace of its own: the mount is gone with the process, whatever becomes of it.
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, str(script),
                           str(image), str(mount), REPO], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert result["first"] == "SUCCESS" and result["late"] == "FAILURE" and result["meanwhile"] == "FAILURE"
    assert result["flush_frozen"] is False and result["flush_thawed"] is True
    path = tmp_path / "copy.jsonl"
    path.write_text(result["file"])
    written = sorted(s.attributes[sc.REQUEST_KEY] for s in read_spans(path))
    # The late write landed once the disk answered and is not counted; only the 3 never written are.
    assert written == ["first-0", "late-0", "late-1"]
    assert result["dropped"] == {fe.DROP_REASON: 3}
