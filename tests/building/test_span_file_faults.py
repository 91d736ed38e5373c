"""The span file exporter under faults: every lost batch is logged once per cause, counted as dropped
(`span_file`) and seen by `force_flush()`; a torn line never swallows the next; a FIFO, a symlink or a hung
filesystem never holds the process; rotation starts a new file; every line it writes, its own reader reads."""

import errno
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExportResult
from support.paths import ROOT as REPO
from support.telemetry import dropped_by_reason, in_memory_metrics

from otel_kvtransfer import semconv as sc
from otel_kvtransfer.building import file_exporter as fe
from otel_kvtransfer.tools import spanfile
from otel_kvtransfer.tools.spanfile import Skipped, iter_spans, read_spans


def _spans(count, key="k", attr_bytes=0):
    provider = TracerProvider()
    tracer = provider.get_tracer("otel_kvtransfer")
    out = []
    for number in range(count):
        attrs = {sc.REQUEST_KEY: f"{key}-{number}", sc.BYTES: 4096}
        if attr_bytes:
            attrs["app.blob"] = "x" * attr_bytes
        span = tracer.start_span(sc.SPAN_SEND, attributes=attrs)
        span.end()
        out.append(span)
    return out


class _Counted:
    """An exporter with its own meter provider, reading back kv_transfer.instrumentation.dropped by reason."""

    def __init__(self, path, **kwargs):
        provider, self.reader = in_memory_metrics()
        self.exporter = fe.OtlpJsonFileSpanExporter(str(path), meter_provider=provider, **kwargs)

    def dropped(self) -> dict:
        return dropped_by_reason(self.reader)


def _errors(caplog):
    return [r for r in caplog.records if r.name == fe.__name__ and r.levelno >= logging.ERROR]


@pytest.mark.parametrize("case", ["no folder", "a directory"])
def test_a_path_that_cannot_be_written_is_logged_once_counted_and_flush_is_false(tmp_path, caplog, case):
    path = tmp_path / "no" / "such" / "spans.jsonl" if case == "no folder" else tmp_path
    counted = _Counted(path)
    for _ in range(3):
        assert counted.exporter.export(_spans(4)) == SpanExportResult.FAILURE
    errors = _errors(caplog)
    assert len(errors) == 1, [r.getMessage() for r in errors]  # one line per cause, not per batch
    message = errors[0].getMessage()
    assert str(path) in message and ("No such file" in message or "directory" in message), message
    assert counted.dropped() == {fe.DROP_REASON: 12}
    assert counted.exporter.force_flush() is False
    assert counted.exporter.force_flush() is True  # nothing lost since the last flush
    counted.exporter.shutdown()


def _child(code: str, *prefix) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([*prefix, sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=120, check=False, cwd=REPO)


_TEARING_CHILD = """
    import logging, resource, signal, sys
    sys.path[:0] = ["tests", "tests/building"]  # support/, and this module
    from test_span_file_faults import _Counted, _spans
    from otel_kvtransfer.building import file_exporter as fe
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(message)s")
    path, limit = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0
    counted = _Counted(path)
    ok = counted.exporter.export(_spans(3, "before"))
    {fault}
    failed = [counted.exporter.export(_spans(50, "lost")) for _ in range(2)]
    flush = counted.exporter.force_flush()
    {heal}
    after = counted.exporter.export(_spans(3, "after"))
    counted.exporter.shutdown()
    print(ok.name, [f.name for f in failed], flush, after.name, counted.dropped())
"""


def _check_torn(path, proc, cause, logged=None):
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout.split()
    assert out[:2] == ["SUCCESS", "['FAILURE',"] and out[3:5] == ["False", "SUCCESS"], proc.stdout
    assert "{'span_file': 100}" in proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 1 and (logged or path) in errors[0] and cause in errors[0], proc.stderr
    raw = open(path, "rb").read()
    lines = raw.split(b"\n")
    assert len(lines) == 4 and lines[-1] == b""  # good, torn, good, and the final newline
    skipped = Skipped()
    spans = list(iter_spans(path, skipped=skipped))
    assert sorted(s.attributes[sc.REQUEST_KEY] for s in spans) == [
        "after-0", "after-1", "after-2", "before-0", "before-1", "before-2"]
    assert (skipped.count, skipped.lines) == (1, [2])


def test_the_file_size_limit_tears_a_line_and_the_next_batch_starts_a_new_one(tmp_path):
    """RLIMIT_FSIZE in a child: the write stops part-way (a real short write, then EFBIG); once the limit is
    lifted, the next line starts with a newline of its own, so only the torn line is lost."""
    path = str(tmp_path / "spans.jsonl")
    code = _TEARING_CHILD.format(
        fault="signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n    "
              "resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))",
        heal="resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))")
    first = _child("""
        import sys; sys.path[:0] = ["tests", "tests/building"]  # support/, and this module
        from test_span_file_faults import _spans
        from otel_kvtransfer.building.file_exporter import encode_line
        print(len(encode_line(_spans(3, "before"))))
    """)
    limit = int(first.stdout) + 3000  # room for the first line and part of the next
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), path, str(limit)], capture_output=True,
                          text=True, timeout=120, check=False, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=REPO))
    _check_torn(path, proc, "too large")


def test_a_full_disk_tears_a_line_and_the_next_batch_starts_a_new_one(tmp_path):
    """A real full filesystem: a 64 KiB tmpfs, mounted in a private mount namespace (root only)."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("a private tmpfs needs root and unshare (util-linux); the file-size test covers the rest")
    mount = tmp_path / "small"
    mount.mkdir()
    path = str(mount / "spans.jsonl")
    code = _TEARING_CHILD.format(
        fault="open(path + '.fill', 'wb').write(b'f' * (64 * 1024 - 12 * 1024))",  # leaves ~ part of a line
        heal="import os; os.remove(path + '.fill')")
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(code))
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        pytest.skip("no private mount namespace here (unshare -m refused)")
    shell = (f"mount -t tmpfs -o size=64k tmpfs {mount} && {sys.executable} {script} {path} && "
             f"cp {path} {tmp_path}/copy.jsonl")
    proc = subprocess.run(["unshare", "-m", "sh", "-c", shell], capture_output=True, text=True, timeout=120,
                          check=False, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stderr[-2000:]
    _check_torn(str(tmp_path / "copy.jsonl"), proc, "No space left", logged=path)


def test_a_fifo_is_refused_at_once_and_never_holds_the_process(tmp_path):
    """A FIFO nobody reads would block open() forever; a process exporting to one through the batch processor
    (the engine's thread mode) exits promptly, having said why."""
    fifo = tmp_path / "spans.fifo"
    os.mkfifo(fifo)
    code = f"""
        import logging, sys
        sys.path.insert(0, "tests")
        logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(message)s")
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from otel_kvtransfer.building.file_exporter import OtlpJsonFileSpanExporter
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(OtlpJsonFileSpanExporter({str(fifo)!r})))
        for _ in range(10):
            provider.get_tracer("t").start_span("kv_transfer.send").end()
        print("flushed", provider.force_flush())
        provider.shutdown()
        print("exited")
    """
    start = time.monotonic()
    proc = _child(code)
    assert proc.returncode == 0 and "exited" in proc.stdout, proc.stderr[-2000:]
    assert time.monotonic() - start < 60  # a bound on a hang, not a speed figure: it used to never return
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 1 and "FIFO" in errors[0] and str(fifo) in errors[0], proc.stderr


def test_a_symlink_at_the_path_is_refused(tmp_path, caplog):
    target = tmp_path / "victim.txt"
    target.write_text("keep me\n")
    link = tmp_path / "spans.jsonl"
    link.symlink_to(target)
    counted = _Counted(link)
    assert counted.exporter.export(_spans(2)) == SpanExportResult.FAILURE
    assert target.read_text() == "keep me\n"
    assert "symbolic link" in _errors(caplog)[0].getMessage()
    assert counted.dropped() == {fe.DROP_REASON: 2}


def test_a_hung_filesystem_holds_only_the_writer_thread(tmp_path, monkeypatch, caplog):
    """Stand-in: a write() that never returns, as on a hung NFS mount (no such mount can be made here)."""
    release = threading.Event()
    real_write = os.write

    def hung_write(fd, data):
        if threading.current_thread().name == "kvtransfer-span-file":
            release.wait(30)
        return real_write(fd, data)

    monkeypatch.setattr(fe.os, "write", hung_write)
    counted = _Counted(tmp_path / "spans.jsonl", write_timeout_s=0.5)
    assert counted.exporter.export(_spans(2)) == SpanExportResult.FAILURE  # waited its timeout
    assert counted.exporter.export(_spans(3)) == SpanExportResult.FAILURE  # and fails at once while stuck
    assert counted.dropped() == {fe.DROP_REASON: 3}  # the stuck write may still land: not counted yet
    assert len(_errors(caplog)) == 2  # "did not return", then "has not returned": two causes
    counted.exporter.shutdown()  # returns with the writer still stuck (a daemon thread)
    assert counted.dropped() == {fe.DROP_REASON: 5}  # ... at shutdown it has not: counted then
    assert counted.exporter.force_flush(timeout_millis=100) is False
    release.set()


def test_a_rotated_file_is_noticed_and_a_new_one_started(tmp_path):
    path = tmp_path / "spans.jsonl"
    exporter = fe.OtlpJsonFileSpanExporter(str(path))
    assert exporter.export(_spans(2, "old")) == SpanExportResult.SUCCESS
    os.rename(path, tmp_path / "spans.jsonl.1")  # what logrotate does (then `create`, or nothing)
    assert exporter.export(_spans(3, "new")) == SpanExportResult.SUCCESS
    exporter.shutdown()
    assert sorted(s.attributes[sc.REQUEST_KEY] for s in read_spans(path)) == ["new-0", "new-1", "new-2"]
    assert len(read_spans(tmp_path / "spans.jsonl.1")) == 2


def test_every_line_the_writer_writes_its_reader_reads(tmp_path):
    """512 spans of 40 KB attributes encode to about 20 MiB, over the one-line limit: the batch is split into
    lines the reader accepts, and a span too big for any line is dropped and counted, not written."""
    assert spanfile.MAX_LINE == fe.MAX_LINE
    path = tmp_path / "big.jsonl"
    counted = _Counted(path)
    assert counted.exporter.export(_spans(512, attr_bytes=40_000)) == SpanExportResult.SUCCESS
    sizes = [len(line) for line in path.read_bytes().split(b"\n")[:-1]]
    assert len(sizes) >= 2 and max(sizes) < fe.MAX_LINE
    spans = read_spans(path)
    assert len(spans) == 512 and len({s.attributes[sc.REQUEST_KEY] for s in spans}) == 512
    assert counted.exporter.export(_spans(1, "huge", attr_bytes=fe.MAX_LINE)) == SpanExportResult.FAILURE
    assert counted.dropped() == {fe.DROP_REASON: 1}
    assert len(read_spans(path)) == 512


def test_errno_of_a_directory_open_names_it(tmp_path, caplog):
    counted = _Counted(tmp_path)
    counted.exporter.export(_spans(1))
    assert errno.errorcode[errno.EISDIR] and "Is a directory" in _errors(caplog)[0].getMessage()


def test_no_path_counts_every_lost_span(monkeypatch, caplog):
    monkeypatch.delenv(fe.ENV_SPAN_FILE, raising=False)
    counted = _Counted("")
    assert counted.exporter.export(_spans(3)) == SpanExportResult.FAILURE
    assert len(_errors(caplog)) == 1 and fe.ENV_SPAN_FILE in _errors(caplog)[0].getMessage()  # said once
    assert counted.dropped() == {fe.DROP_REASON: 3} and counted.exporter.force_flush() is False
