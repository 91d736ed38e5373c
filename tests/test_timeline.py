"""`otel-kvtransfer timeline`: the HTML page rendered by real headless Chromium, the PNG drawn by Pillow, filters,
pagination for 1,000 requests, and bad input as one line on stderr with exit code 2."""

import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest
from conftest import require_part
from test_spanfile_reader import demo_span_file, synthetic_records, write_jsonl

from otel_kvtransfer import semconv as sc
from otel_kvtransfer.report_cli import main as report_main
from otel_kvtransfer.spanfile_reader import read_spans
from otel_kvtransfer.summarize import build_requests
from otel_kvtransfer.timeline import render_html, render_png

PIL = pytest.importorskip("PIL.Image")

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars"]


@pytest.fixture(scope="session")
def demo_spans():
    return demo_span_file()


def _chromium():
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _run_chromium(args, timeout=90):
    """Run headless Chromium once with a fresh profile; kill its whole process group if it hangs."""
    profile = tempfile.mkdtemp(prefix="kvt-chromium-")
    proc = subprocess.Popen([_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate(timeout=10)
        pytest.fail(f"chromium did not finish in {timeout} s")
    finally:
        try:
            os.killpg(proc.pid, 9)  # helpers (zygote, gpu) that outlived the browser, if any
        except ProcessLookupError:
            pass
        shutil.rmtree(profile, ignore_errors=True)
    return proc.returncode, out, err


def _timeline(tmp_path, src, *extra):
    html_path, png_path = tmp_path / "t.html", tmp_path / "t.png"
    rc = report_main(["timeline", str(src), "--html", str(html_path), "--png", str(png_path), *extra])
    assert rc == 0
    return html_path, png_path


def test_demo_timeline_renders_in_headless_chromium(tmp_path, demo_spans):
    require_part(_chromium() is not None, "Debian chromium (bash scripts/setup-timeline.sh)")
    html_path, _png_path = _timeline(tmp_path, demo_spans)
    spans = read_spans(demo_spans)
    requests = build_requests(spans)
    sends = [s for s in spans if s.name == sc.SPAN_SEND]

    # Screenshot of the expected size.
    shot = tmp_path / "shot.png"
    rc, _out, err = _run_chromium(["--window-size=1280,1600", f"--screenshot={shot}", html_path.as_uri()])
    assert rc == 0, err[-2000:]
    with PIL.open(shot) as image:
        assert image.size == (1280, 1600)
        colors = image.convert("RGB").getcolors(1 << 20)
    assert colors and len(colors) > 50, "the screenshot is (nearly) blank"
    kv_blue = (0x4E, 0x79, 0xA7)
    assert any(c == kv_blue and n > 200 for n, c in colors), "no kv transfer bar was painted"

    # The DOM after the page's script ran: the expected elements are there.
    rc, dom, err = _run_chromium(["--dump-dom", html_path.as_uri()])
    assert rc == 0, err[-2000:]
    assert 'data-ready="1"' in dom, "the page's script did not run to the end"
    sections = re.findall(r'<section class="request[^"]*" data-room="(\d*)"', dom)
    assert sorted(int(r) for r in sections) == sorted(r.room for r in requests)
    assert len(re.findall(r'<rect [^>]*class="send payload-', dom)) == len(sends)
    for request in requests:
        assert f"room {request.room}" in dom
    assert dom.count("busy ") >= len(requests) and "true " in dom and "overlap " in dom
    assert "page 1 of 1" in dom
    assert re.search(r'class="lane-label"[^>]*>compute<', dom)
    assert re.search(r'class="lane-label"[^>]*>dest 0', dom)


def test_demo_png_exists_with_sane_size(tmp_path, demo_spans):
    _html, png_path = _timeline(tmp_path, demo_spans)
    with PIL.open(png_path) as image:
        width, height = image.size
        assert image.format == "PNG"
        colors = image.convert("RGB").getcolors(1 << 20)
    assert 1000 <= width <= 1600
    assert 400 <= height <= 6000
    assert colors and len(colors) > 20


def test_header_shows_busy_true_throughput_and_overlap(tmp_path):
    src = write_jsonl(tmp_path / "s.jsonl", synthetic_records(requests=2))
    requests = build_requests(read_spans(src))
    page = render_html(requests)
    for request in requests:
        assert f"room {request.room}" in page
    assert page.count('class="req-figures"') == 2
    figures = re.findall(r'class="req-figures">([^<]*)<', page)
    for text in figures:
        assert "busy " in text and "true " in text and "overlap " in text
    # Self-contained: nothing fetched from anywhere.
    assert not re.search(r'(src|href)\s*=\s*"(https?:)?//', page)
    assert "<script src" not in page and "<link" not in page


def test_thousand_requests_are_paginated_not_a_wall(tmp_path):
    src = write_jsonl(tmp_path / "big.jsonl", synthetic_records(requests=1000))
    html_path, png_path = _timeline(tmp_path, src, "--page-size", "25")
    page = html_path.read_text()
    sections = re.findall(r'<section class="request[^"]*"[^>]*>', page)
    assert len(sections) == 1000
    assert sum(1 for s in sections if " hidden" not in s) == 25
    assert 'class="overview-title">1000 requests' in page
    with PIL.open(png_path) as image:
        assert image.size[1] < 3000  # the PNG shows the overview and a few blocks, not 1,000


def test_filters_by_room_and_time_window(tmp_path, capsys):
    records = synthetic_records(requests=6)
    src = write_jsonl(tmp_path / "s.jsonl", records)
    html_path, _png = _timeline(tmp_path, src, "--room", "1002", "--room", "1004")
    rooms = re.findall(r'<section class="request[^"]*" data-room="(\d+)"', html_path.read_text())
    assert rooms == ["1002", "1004"]
    requests = build_requests(read_spans(src))
    origin = requests[0].start_ns
    # A window that holds only the third request's start.
    since = (requests[2].start_ns - origin) / 1e9 + 1e-6
    until = since + 1e-6
    html_path, _png = _timeline(tmp_path, src, "--since", f"{since:.9f}", "--until", f"{until:.9f}")
    rooms = [int(r) for r in re.findall(r'data-room="(\d+)"', html_path.read_text())]
    expected = [r.room for r in requests if r.end_ns >= origin + int(since * 1e9)
                and r.start_ns <= origin + int(until * 1e9)]
    assert rooms == expected and 1 <= len(rooms) < 6
    assert "filtered" in capsys.readouterr().out


def test_png_is_drawn_without_a_browser(tmp_path):
    src = write_jsonl(tmp_path / "s.jsonl", synthetic_records(requests=3, fail_room=1001))
    requests = build_requests(read_spans(src))
    size = render_png(requests, str(tmp_path / "x.png"), max_requests=3)
    with PIL.open(tmp_path / "x.png") as image:
        assert image.size == size
        pixels = {color for _count, color in image.convert("RGB").getcolors(1 << 20)}
    assert (0xE1, 0x57, 0x59) in pixels  # the failed transfer is outlined red
    assert (0xF2, 0x8E, 0x2B) in pixels  # aux payload colour


@pytest.mark.parametrize("content, expect", [
    (b"", "empty"),
    (b'{"name": "kv_transfer.send", "trace_id": "ab', ":1: "),
    (b'{"hello": 1}\n', ":1: not a span"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, content, expect):
    src = tmp_path / "bad.jsonl"
    src.write_bytes(content)
    proc = subprocess.run([sys.executable, "-m", "otel_kvtransfer", "timeline", str(src)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and expect in lines[0] and str(src) in lines[0]
    assert not (tmp_path / "bad.timeline.html").exists()


def test_unwritable_output_is_exit_2(tmp_path, capsys):
    src = write_jsonl(tmp_path / "s.jsonl", synthetic_records(requests=1))
    rc = report_main(["timeline", src, "--html", str(tmp_path / "no" / "such" / "dir.html"), "--no-png"])
    assert rc == 2
    assert "cannot write" in capsys.readouterr().err
