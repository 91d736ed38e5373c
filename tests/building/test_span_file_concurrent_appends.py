"""A span file shared by several processes (building/file_exporter.py): a writer never takes another writer's
append in progress for a torn line.

How it was found: forked children appending to one file once left an empty line (11 lines for 10). The kernel
grows a file page by page during one write(), so a writer that looked at the file's last byte while another
process's line was half copied saw a byte inside that line, took it for a torn line and started its own line with
a newline: an empty line once the other append completed. Every writer of the file now looks and writes under the
file's exclusive advisory lock.

Here the other writer is this test, on a descriptor of its own (flock locks belong to an open file, so one process
shows it): it holds the lock with half its line written while the exporter exports.
"""

import fcntl
import json
import os
import threading
import time

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExportResult

from otel_kvtransfer.building.file_exporter import OtlpJsonFileSpanExporter

OTHER_LINE = b'{"resourceSpans":[]}\n'
WRITES = 400  # per forked writer: without the lock, 10 to 20 of 1,600 lines came with an empty line


def test_a_write_waits_for_another_writers_append_in_progress(tmp_path):
    path = tmp_path / "spans.jsonl"
    path.write_bytes(OTHER_LINE)
    other = os.open(path, os.O_WRONLY | os.O_APPEND)
    fcntl.flock(other, fcntl.LOCK_EX)
    os.write(other, OTHER_LINE[:10])  # another process's line, half written: the file ends inside it
    span = TracerProvider().get_tracer("t").start_span("kv_transfer.send")
    span.end()
    exporter = OtlpJsonFileSpanExporter(str(path))
    result = []
    writer = threading.Thread(target=lambda: result.append(exporter.export([span])))
    writer.start()
    try:
        time.sleep(0.2)  # the other append stays half done this long: the elapsed time IS the scenario
        os.write(other, OTHER_LINE[10:])
    finally:
        fcntl.flock(other, fcntl.LOCK_UN)
        os.close(other)
    writer.join(30)
    exporter.shutdown()
    assert result == [SpanExportResult.SUCCESS]
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b"" and len(lines) == 4, lines  # three lines, none empty
    assert lines[:2] == [OTHER_LINE.rstrip(b"\n")] * 2  # the other writer's line whole
    assert json.loads(lines[2])["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["name"] == "kv_transfer.send"


def test_forked_writers_leave_no_empty_line(tmp_path):
    """The race itself: four processes appending lines of about 3 KB (most cross a page boundary of the file)."""
    path = tmp_path / "spans.jsonl"
    exporter = OtlpJsonFileSpanExporter(str(path))
    provider = TracerProvider()
    children = []
    for _ in range(4):
        pid = os.fork()
        if pid == 0:  # a child: its own writer thread and descriptor, as a forked engine worker has
            code = 1
            try:
                for n in range(WRITES):
                    span = provider.get_tracer("t").start_span("kv_transfer.send",
                                                               attributes={"pad": "x" * 3000, "n": n})
                    span.end()
                    if exporter.export([span]) is not SpanExportResult.SUCCESS:
                        break
                else:
                    code = 0
            finally:
                os._exit(code)
        children.append(pid)
    for pid in children:
        assert os.waitpid(pid, 0)[1] == 0
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b""
    assert sum(1 for line in lines[:-1] if not line) == 0
    assert len(lines) - 1 == 4 * WRITES

