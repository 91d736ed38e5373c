"""The tools on odd inputs and outputs: pipes, stdin, FIFOs, a byte-order mark, torn lines, hostile lines,
values that used to raise, output names that are symlinks or devices, the umask; and the cost of one request
with very many disjoint sends (counted in operations, never timed)."""

import json
import os
import stat
import subprocess
import sys

import pytest
from support.paths import ROOT as REPO
from support.span_files import otlp_request, synthetic_records, write_otlp
from test_tools_sizes import T0, _span, _write_batches

from otel_kvtransfer.building import aggregate
from otel_kvtransfer.cli import main as cli_main
from otel_kvtransfer.tools import source as source_module
from otel_kvtransfer.tools import spanfile
from otel_kvtransfer.tools.requests import RequestSet


def _cli(*args, stdin=None, shell=None, cwd=None, umask=None):
    env = dict(os.environ, PYTHONPATH=REPO)
    if shell is not None:
        cmd = ["bash", "-c", shell]
    else:
        cmd = [sys.executable, "-m", "otel_kvtransfer", *args]
    return subprocess.run(cmd, input=stdin, capture_output=True, timeout=180, check=False, cwd=cwd, env=env,
                          preexec_fn=(lambda: os.umask(umask)) if umask is not None else None)


def _file(tmp_path, requests=3):
    return write_otlp(tmp_path / "s.jsonl", synthetic_records(requests=requests), per_line=5)


def _keys(stdout: bytes) -> list:
    return [row["request_key"] for row in json.loads(stdout)["requests"]]


# --------------------------------------------------------------------------------------------------- sources


def test_stdin_a_pipe_and_process_substitution_read_like_the_file(tmp_path):
    path = _file(tmp_path)
    expected = _keys(_cli("summarize", path, "--json").stdout)
    assert expected == ["1000", "1001", "1002"]
    data = open(path, "rb").read()
    assert _keys(_cli("summarize", "-", "--json", stdin=data).stdout) == expected
    assert _keys(_cli(shell=f"cat {path} | {sys.executable} -m otel_kvtransfer summarize /dev/stdin --json")
                 .stdout) == expected
    # the timeline reads twice: a pipe is spooled once, so the second pass is not "empty"
    proc = _cli(shell=f"{sys.executable} -m otel_kvtransfer timeline <(cat {path}) --no-png --html t.html",
                cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "t.html").read_text().count('<section class="request') == 3
    proc = _cli("timeline", "-", "--no-png", stdin=data, cwd=tmp_path)  # default name for a stream
    assert proc.returncode == 0 and (tmp_path / "timeline.timeline.html").exists(), proc.stderr


def test_a_fifo_nobody_writes_to_is_one_clear_line(tmp_path, monkeypatch, capsys):
    fifo = tmp_path / "spans.fifo"
    os.mkfifo(fifo)
    monkeypatch.setattr(source_module, "FIFO_WAIT_S", 1.5)
    assert cli_main(["summarize", str(fifo)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 2 and "waiting for a writer" in err[0], err
    assert "nobody wrote to" in err[1] and str(fifo) in err[1]


def test_a_byte_order_mark_is_ignored(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + open(_file(tmp_path), "rb").read())
    proc = _cli("summarize", str(path), "--json")
    assert proc.returncode == 0 and _keys(proc.stdout) == ["1000", "1001", "1002"], proc.stderr


def test_a_torn_line_is_skipped_and_named_in_one_line(tmp_path):
    """What the old writer left after a full disk: a partial line with the next batch run into it."""
    records = len(synthetic_records(requests=4))
    lines = open(_file(tmp_path, requests=4), "rb").read().split(b"\n")[:-1]
    torn = lines[1][: len(lines[1]) // 2] + lines[2]  # line 2 of the torn file: half of a batch, then a whole one
    path = tmp_path / "torn.jsonl"
    path.write_bytes(b"\n".join([lines[0], torn] + lines[3:]) + b"\n" + lines[-1][:100])
    proc = _cli("summarize", str(path), "--json")
    assert proc.returncode == 0, proc.stderr
    err = [line for line in proc.stderr.decode().splitlines() if line.strip()]
    last = len(lines)  # the cut tail's line number: lines[0], torn, lines[3:], then it
    assert len(err) == 1 and f"skipped 2 torn lines (2, {last})" in err[0], err
    spans = json.loads(proc.stdout)["span_count"]
    assert spans == records - 10  # every span but the 5 + 5 of the two batches that were torn


def test_a_file_that_is_not_a_span_file_is_still_one_line_and_exit_2(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(b'{"resourceSpans": [ cut\n{"also": broken\n')
    proc = _cli("summarize", str(path))
    err = [line for line in proc.stderr.decode().splitlines() if line.strip()]
    assert proc.returncode == 2 and len(err) == 1 and "no line of the file is a whole span line" in err[0], err


# --------------------------------------------------------------------------------------------------- hostile


def test_nan_in_any_attribute_is_one_line_and_no_output(tmp_path):
    data = otlp_request(synthetic_records(requests=1))
    data["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"].append(
        {"key": "app.ratio", "value": {"doubleValue": "NaN"}})
    path = tmp_path / "nan.jsonl"
    path.write_text(json.dumps(data) + "\n")
    proc = _cli("timeline", str(path), "--html", "o.html", "--png", "o.png", "--perfetto", "o.json", cwd=tmp_path)
    err = [line for line in proc.stderr.decode().splitlines() if line.strip()]
    assert proc.returncode == 2 and len(err) == 1 and "app.ratio" in err[0], err
    assert sorted(os.listdir(tmp_path)) == ["nan.jsonl"]  # no output, not even a temporary one


@pytest.mark.parametrize("option", [["--since", "1e300"], ["--until=-1e300"]])
def test_huge_windows_are_one_line_and_exit_2(tmp_path, option):
    proc = _cli("summarize", _file(tmp_path), *option)
    err = [line for line in proc.stderr.decode().splitlines() if line.strip()]
    assert proc.returncode == 2 and len(err) == 1 and "outside" in err[0] and b"Traceback" not in proc.stderr


def test_a_line_of_empty_objects_is_refused_before_decoding(tmp_path):
    path = tmp_path / "objects.jsonl"
    path.write_bytes(b'{"resourceSpans":[' + b"{}," * (4 << 20) + b"{}]}\n")  # 12 MiB, 4 M objects
    proc = _cli("summarize", str(path))
    err = [line for line in proc.stderr.decode().splitlines() if line.strip()]
    assert proc.returncode == 2 and len(err) == 1 and "denser than any span exporter writes" in err[0], err


def test_the_attribute_memo_keeps_no_long_value(tmp_path):
    records = synthetic_records(requests=1)
    for number, record in enumerate(records):
        record["attributes"]["app.blob"] = f"{number}" + "x" * 100_000
    spans = spanfile.read_spans(write_otlp(tmp_path / "long.jsonl", records, per_line=4))
    assert {len(s.attributes["app.blob"]) for s in spans} >= {100_001}
    assert all(not isinstance(key[3], str) or len(key[3]) <= 256 for key in spanfile._KEY_VALUES)
    assert len(spanfile._KEY_VALUES) <= spanfile._KEY_VALUES_MAX


# --------------------------------------------------------------------------------------------------- outputs


def test_an_output_symlink_is_written_through_not_replaced(tmp_path):
    path = _file(tmp_path)
    target = tmp_path / "real.html"
    target.write_text("old")
    (tmp_path / "link.html").symlink_to(target)
    proc = _cli("timeline", path, "--no-png", "--html", str(tmp_path / "link.html"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "link.html").is_symlink() and "<!DOCTYPE html>" in target.read_text()
    # a symlink to a device (what /dev/stdout is): written through, to this process's stdout pipe
    (tmp_path / "out.json").symlink_to("/dev/stdout")
    proc = _cli("timeline", path, "--no-png", "--no-html", "--perfetto", str(tmp_path / "out.json"))
    assert proc.returncode == 0 and (tmp_path / "out.json").is_symlink(), proc.stderr
    trace = json.loads(proc.stdout.split(b"\n", 1)[0])
    assert len([e for e in trace["traceEvents"] if e["ph"] == "X"]) > 10


@pytest.mark.parametrize("umask, mode", [(0o077, 0o600), (0o022, 0o644)])
def test_outputs_respect_the_umask(tmp_path, umask, mode):
    path = _file(tmp_path)
    proc = _cli("timeline", path, "--html", "a.html", "--png", "a.png", "--perfetto", "a.json", cwd=tmp_path,
                umask=umask)
    assert proc.returncode == 0, proc.stderr
    for name in ("a.html", "a.png", "a.json"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == mode, name


# --------------------------------------------------------------------------------------------------- scale


def test_disjoint_sends_are_merged_a_logarithmic_number_of_times(monkeypatch):
    """20,000 disjoint sends in one request: each merge of the kept intervals sorts them all, so merging every
    time the list is over a fixed size costs O(n^2); the number of merges and the intervals they sort must stay
    O(log n) and O(n)."""
    merged = []
    real = aggregate.RequestAggregate.compact

    def counting(self):
        merged.append(len(self.sends) + len(self.compute))
        real(self)

    monkeypatch.setattr(aggregate.RequestAggregate, "compact", counting)
    sends = 20_000
    batches = []
    _write = [_span(1, 10 + i, 1, "kv_transfer.send", 3, T0 + i * 2000, T0 + i * 2000 + 1000,
                    {"kv_transfer.request_key": "big", "kv_transfer.bytes": 4096}) for i in range(sends)]
    batches.extend(_write)
    collected = RequestSet()
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"kvt-disjoint-{os.getpid()}.jsonl")
    try:
        _write_batches(path, batches)
        for span in spanfile.iter_spans(path):
            collected.add(span)
    finally:
        os.unlink(path)
    (request,) = collected.finish()
    figures = request.figures()
    assert figures["transfer_count"] == sends and figures["busy_s"] == pytest.approx(sends * 1e-6)
    assert len(merged) <= 3 and sum(merged) <= 2 * sends, merged


@pytest.mark.parametrize("where", ["resource", "span"])
def test_a_list_longer_than_the_reader_accepts_is_refused_before_parsing(tmp_path, where):
    data = otlp_request(synthetic_records(requests=1)[:1])
    owner = data["resourceSpans"][0]
    owner = owner["resource"] if where == "resource" else owner["scopeSpans"][0]["spans"][0]
    owner["attributes"] = [{"key": f"k{i}", "value": {"intValue": "1"}} for i in range(spanfile.MAX_ITEMS + 1)]
    path = tmp_path / "many.jsonl"
    path.write_text(json.dumps(data) + "\n")
    with pytest.raises(spanfile.SpanFileError) as info:
        spanfile.read_spans(path)
    assert info.value.line == 1 and f"{spanfile.MAX_ITEMS + 1} items, more than the reader accepts" in str(info.value)


# --------------------------------------------------------------------------------------------------- left out


def _stderr_lines(proc) -> list:
    """The lines on stderr but progress (which a loaded machine may show for a read of over a second)."""
    lines = proc.stderr.decode().replace("\r", "\n").splitlines()
    return [line for line in lines if line.strip() and not line.startswith(("reading ", "drawing "))]


def test_a_span_that_ends_before_it_starts_is_skipped_and_counted_in_one_line(tmp_path):
    """The wall clock stepped back an hour while a send was open: its span ends before it starts. That span is
    left out and said in one line; the rest of the file (the other spans of its line too) is summarized and
    drawn."""
    records = synthetic_records(requests=3)
    sends = [number for number, record in enumerate(records) if record["name"] == "kv_transfer.send"]
    back = records[sends[1]]
    back["end_time_unix_nano"] = back["start_time_unix_nano"] - 3600 * 10**9
    path = write_otlp(tmp_path / "back.jsonl", records, per_line=5)
    proc = _cli("summarize", path, "--json")
    assert proc.returncode == 0, proc.stderr
    err = _stderr_lines(proc)
    line = sends[1] // 5 + 1
    assert len(err) == 1 and f"skipped 1 span that ends before it starts (line {line})" in err[0], err
    summary = json.loads(proc.stdout)
    assert summary["span_count"] == len(records) - 1 and summary["request_count"] == 3
    assert summary["left_out"]["spans_ending_before_they_start"] == 1
    first = summary["requests"][0]
    assert first["send_spans"] == sum(1 for r in records if r["name"] == "kv_transfer.send"
                                      and r["trace_id"] == back["trace_id"]) - 1
    proc = _cli("timeline", path, "--html", "t.html", "--png", "t.png", "--perfetto", "t.json", cwd=tmp_path)
    assert proc.returncode == 0 and len(_stderr_lines(proc)) == 1, proc.stderr
    assert (tmp_path / "t.html").read_text().count('<section class="request') == 3
    trace = json.loads((tmp_path / "t.json").read_text())
    assert all(e["dur"] >= 0 for e in trace["traceEvents"] if e["ph"] == "X")
    assert back["span_id"] not in {e["args"].get("span_id") for e in trace["traceEvents"] if e["ph"] == "X"}


def test_a_file_of_only_backwards_spans_is_one_line_and_exit_2(tmp_path):
    records = synthetic_records(requests=1)
    for record in records:
        record["end_time_unix_nano"] = record["start_time_unix_nano"] - 1
    proc = _cli("summarize", write_otlp(tmp_path / "back.jsonl", records, per_line=4))
    err = _stderr_lines(proc)
    assert proc.returncode == 2 and len(err) == 1 and b"Traceback" not in proc.stderr, err
    assert f"every span ({len(records)}) ends before it starts" in err[0], err


def test_spans_sharing_one_id_are_one_span_and_the_repeats_said_in_one_line(tmp_path):
    """20,000 request spans of one trace with one span id: one span (the first) and 19,999 repeats said on
    stderr, not "1 requests" with nothing said."""
    path = tmp_path / "same-id.jsonl"
    _write_batches(path, (_span(1, 1, 0, "kv_transfer.request", 1, T0 + i, T0 + i + 1000,
                                {"kv_transfer.request_key": str(i)}) for i in range(20_000)))
    proc = _cli("summarize", str(path), "--json")
    assert proc.returncode == 0, proc.stderr
    err = _stderr_lines(proc)
    assert len(err) == 1 and "left out 19999 spans repeating the trace and span id" in err[0], err
    assert "lines 1, 2, " in err[0] and err[0].endswith("each id counts once, as first read")
    summary = json.loads(proc.stdout)
    assert summary["span_count"] == 1 and summary["request_count"] == 1
    assert summary["left_out"]["repeated_span_ids"] == 19_999
    assert _keys(proc.stdout) == ["0"]  # the first read, not the last


def test_a_batch_written_twice_is_summarized_and_drawn_as_written_once(tmp_path):
    """What a retrying exporter leaves: a line repeated. Every figure (bytes, transfers, the throughput
    distribution) and the whole page are those of the file without the repeat."""
    lines = open(_file(tmp_path, requests=4), "rb").read().split(b"\n")[:-1]
    once, twice = tmp_path / "once", tmp_path / "twice"
    once.mkdir()
    twice.mkdir()
    (once / "s.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (twice / "s.jsonl").write_bytes(b"\n".join(lines[:3] + lines[1:3] + lines[3:]) + b"\n")
    expected = _cli("summarize", "s.jsonl", "--json", cwd=once)
    proc = _cli("summarize", "s.jsonl", "--json", cwd=twice)
    assert proc.returncode == expected.returncode == 0, proc.stderr
    err = _stderr_lines(proc)
    assert len(err) == 1 and "left out 10 spans repeating the trace and span id" in err[0], err
    assert "(lines 4, 5)" in err[0], err
    summary, alone = json.loads(proc.stdout), json.loads(expected.stdout)
    assert summary.pop("left_out") == {"torn_lines": 0, "spans_ending_before_they_start": 0, "repeated_span_ids": 10,
                                       "foreign_attributes": 0}
    assert alone.pop("left_out")["repeated_span_ids"] == 0
    assert summary == alone
    for folder in (once, twice):
        done = _cli("timeline", "s.jsonl", "--html", "t.html", "--png", "t.png", "--perfetto", "t.json", cwd=folder)
        assert done.returncode == 0, done.stderr
    for name in ("t.html", "t.png", "t.json"):
        assert (once / name).read_bytes() == (twice / name).read_bytes(), name
