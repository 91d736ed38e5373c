"""`otel-kvtransfer timeline`: the HTML page rendered by real headless Chromium (and hostile span files that
must not run script in it), the PNG drawn by Pillow, caps on lanes and picture size, filters, pagination, and bad
input as one line on stderr with exit code 2 and no output file left behind."""

import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest
from support.parts import require_part
from support.span_files import demo_span_file, span_record, synthetic_records, write_jsonl, write_otlp

from otel_kvtransfer import semconv as sc
from otel_kvtransfer.cli import main as cli_main
from otel_kvtransfer.tools.spanfile import read_spans
from otel_kvtransfer.tools.timeline.block import MAX_ROWS
from otel_kvtransfer.tools.timeline.page import CONTENT_SECURITY_POLICY
from otel_kvtransfer.tools.timeline.png import MAX_PNG_HEIGHT

PIL = pytest.importorskip("PIL.Image")

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars"]


def _chromium():
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _run_chromium(args, timeout=90):
    """Run headless Chromium once with a fresh profile; kill its whole process group if it hangs."""
    require_part(_chromium() is not None, "Debian chromium (bash scripts/setup-timeline.sh)")
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
    assert cli_main(["timeline", str(src), "--html", str(html_path), "--png", str(png_path), *extra]) == 0
    return html_path, png_path


def test_demo_timeline_renders_in_headless_chromium(tmp_path):
    src = demo_span_file()
    html_path, _png_path = _timeline(tmp_path, src)
    spans = read_spans(src)
    keys = {s.attributes[sc.REQUEST_KEY] for s in spans if s.name == sc.SPAN_REQUEST}
    sends = [s for s in spans if s.name == sc.SPAN_SEND]
    shot = tmp_path / "shot.png"
    rc, _out, err = _run_chromium(["--window-size=1280,1600", f"--screenshot={shot}", html_path.as_uri()])
    assert rc == 0, err[-2000:]
    with PIL.open(shot) as image:
        assert image.size == (1280, 1600)
        colors = image.convert("RGB").getcolors(1 << 20)
    assert colors and len(colors) > 50, "the screenshot is (nearly) blank"
    assert any(c == (0x4E, 0x79, 0xA7) and n > 200 for n, c in colors), "no kv transfer bar was painted"
    rc, dom, err = _run_chromium(["--dump-dom", html_path.as_uri()])
    assert rc == 0, err[-2000:]
    assert 'data-ready="1"' in dom, "the page's own script did not run under its policy"
    assert sorted(re.findall(r'<section class="request[^"]*" data-key="([^"]*)"', dom)) == sorted(keys)
    assert len(re.findall(r'<rect [^>]*class="send payload-', dom)) == len(sends)
    assert "page 1 of 1" in dom and re.search(r'class="lane-label"[^>]*>dest 0', dom)


HOSTILE = ["\"><script>document.title='PWNED'</script>", "<img src=x onerror=\"document.title='PWNED'\">",
           "'><svg onload=document.title='PWNED'>"]


def hostile_records():
    """A request whose every free-text value (payload, key, peer, error, service name, lane labels) is a payload
    that runs script if written unescaped into an HTML text node or attribute."""
    records = []
    for number, payload in enumerate(HOSTILE):
        trace, req = f"{number + 1:032x}", f"{number + 1:016x}"
        ident = {sc.REQUEST_KEY: payload, sc.FRAMEWORK: payload, sc.BACKEND: payload}
        resource = {"service.name": payload, "service.instance.id": payload}
        attrs = {**ident, sc.BYTES: 4096, sc.PAYLOAD: payload, sc.CHUNK_INDEX: 0, sc.DESTINATION_INDEX: 0,
                 sc.SERVER_ADDRESS: payload, sc.SERVER_PORT: 1, sc.ERROR_TYPE: payload}
        t = 1_700_000_000_000_000_000 + number * 10_000_000
        records.append(span_record(sc.SPAN_SEND, trace, f"{number + 1:015x}a", req, t, t + 1_000_000, attrs,
                                   resource=resource, status="ERROR", kind="CLIENT", description=payload))
        records.append(span_record(sc.SPAN_COMPUTE, trace, f"{number + 1:015x}b", req, t, t + 2_000_000,
                                   {sc.REQUEST_KEY: payload}, resource=resource))
        records.append(span_record(sc.SPAN_REQUEST, trace, req, None, t, t + 3_000_000,
                                   {**ident, sc.ERROR_TYPE: payload}, resource=resource, status="ERROR"))
        records.append(span_record(sc.SPAN_RECEIVE, trace, f"{number + 1:015x}c", None, t, t + 3_000_000,
                                   {sc.REQUEST_KEY: payload}, resource=resource))
    return records


@pytest.mark.parametrize("fmt", ["jsonl", "otlp"])
def test_hostile_span_file_runs_no_script_in_chromium(tmp_path, fmt):
    write = write_jsonl if fmt == "jsonl" else write_otlp
    src = write(tmp_path / f"hostile.{fmt}", hostile_records())
    html_path, _png = _timeline(tmp_path, src)
    page = html_path.read_text()
    # Escaped in text and attributes: no tag from the file survives.
    assert "<script>document" not in page and "<img src=x" not in page and "<svg onload" not in page
    assert page.count("<script>") == 1
    rc, dom, err = _run_chromium(["--dump-dom", html_path.as_uri()])
    assert rc == 0, err[-2000:]
    assert "PWNED" not in re.search(r"<title>(.*?)</title>", dom, re.S).group(1)
    assert 'data-ready="1"' in dom  # the page's own script still runs (allowed by its hash)
    assert "&lt;script&gt;document.title" in dom  # the value is shown, as text


def test_policy_forbids_inline_script_but_the_pages_own():
    policy = dict(part.strip().split(" ", 1) for part in CONTENT_SECURITY_POLICY.split(";"))
    assert policy["default-src"] == "'none'"
    assert re.fullmatch(r"'sha256-[A-Za-z0-9+/]{43}='", policy["script-src"])
    assert "unsafe-inline" not in CONTENT_SECURITY_POLICY and "unsafe-eval" not in CONTENT_SECURITY_POLICY


def test_header_shows_key_framework_busy_true_throughput_and_overlap(tmp_path):
    html_path, _png = _timeline(tmp_path, write_jsonl(tmp_path / "s.jsonl", synthetic_records(requests=2)))
    page = html_path.read_text()
    titles = re.findall(r'class="req-title">([^<]*)<', page)
    assert [t.split("  ·  ")[:2] for t in titles] == [["key 1000", "sglang/mooncake"], ["key 1001", "sglang/mooncake"]]
    for text in re.findall(r'class="req-figures">([^<]*)<', page):
        assert "busy " in text and "true " in text and "overlap " in text
    assert not re.search(r'(src|href)\s*=\s*"(https?:)?//', page) and "<link" not in page


def test_serve_spans_get_a_peer_lane(tmp_path):
    records = synthetic_records(requests=1)
    for record in records:
        if record["name"] == sc.SPAN_RECEIVE:
            record["name"] = sc.SPAN_SERVE
    html_path, _png = _timeline(tmp_path, write_jsonl(tmp_path / "s.jsonl", records))
    assert re.search(r'class="lane-label"[^>]*>serve decode<', html_path.read_text())


def overlapping_sends(count):
    """One request with `count` sends that all overlap (each starts 1 us after the previous, lasts 1 s)."""
    trace, req, t = "ab" * 16, "cd" * 8, 1_700_000_000_000_000_000
    records = [span_record(sc.SPAN_SEND, trace, f"{i + 1:016x}", req, t + i * 1000, t + i * 1000 + 10**9,
                           {sc.REQUEST_KEY: "big", sc.BYTES: 1 << 20, sc.PAYLOAD: "kv", sc.DESTINATION_INDEX: 0},
                           kind="CLIENT") for i in range(count)]
    records.append(span_record(sc.SPAN_REQUEST, trace, req, None, t, t + 2 * 10**9, {sc.REQUEST_KEY: "big"}))
    return records


def test_a_sends_post_part_is_drawn_in_proportion_and_hostile_post_times_draw_none(tmp_path):
    trace, req, t = "ab" * 16, "cd" * 8, 1_700_000_000_000_000_000
    posts = [0.25, 2.0, -1.0, "0.5", True, [0.5], None]  # of 1 s sends: a quarter; over-long; then nonsense
    records = []
    for i, post in enumerate(posts):
        attrs = {sc.REQUEST_KEY: "posted", sc.BYTES: 1 << 20, sc.PAYLOAD: "kv", sc.DESTINATION_INDEX: i}
        if post is not None:
            attrs[sc.POST_S] = post
        records.append(span_record(sc.SPAN_SEND, trace, f"{i + 1:016x}", req, t, t + 10**9, attrs, kind="CLIENT"))
    records.append(span_record(sc.SPAN_REQUEST, trace, req, None, t, t + 10**9, {sc.REQUEST_KEY: "posted"}))
    html_path, _png = _timeline(tmp_path, write_jsonl(tmp_path / "p.jsonl", records))
    page = html_path.read_text()
    sends = [float(w) for w in re.findall(r'<rect [^>]*width="([0-9.]+)"[^>]*class="send payload-kv', page)]
    posted = [float(w) for w in re.findall(r'<rect [^>]*width="([0-9.]+)"[^>]*class="send-post"', page)]
    assert len(sends) == len(posts) and len(set(sends)) == 1
    # a quarter of the bar, then the whole bar (a post longer than its send is capped); the rest draw none
    assert posted == [pytest.approx(sends[0] / 4, abs=0.1), pytest.approx(sends[0], abs=0.1)]
    assert "posting 250 ms (25% of the send), the rest on the wire" in page


def test_overlapping_sends_are_capped_with_a_more_row(tmp_path):
    count = 5000  # every send drawn: the rows, not the sends drawn per request, are the bound here
    html_path, png_path = _timeline(tmp_path, write_jsonl(tmp_path / "o.jsonl", overlapping_sends(count)),
                                    "--max-sends-per-request", "0")
    page = html_path.read_text()
    assert len(re.findall(r'<rect [^>]*class="send payload-kv', page)) == MAX_ROWS
    assert f"+{count - MAX_ROWS} more overlapping" in page
    with PIL.open(png_path) as image:
        assert image.size[1] <= MAX_PNG_HEIGHT
    assert html_path.stat().st_size < 2 << 20


def test_thousand_requests_are_paginated_and_the_png_bounded(tmp_path):
    html_path, png_path = _timeline(tmp_path, write_jsonl(tmp_path / "big.jsonl", synthetic_records(requests=1000)),
                                    "--page-size", "25", "--png-requests", "1000")
    page = html_path.read_text()
    sections = re.findall(r'<section class="request[^"]*"[^>]*>', page)
    assert len(sections) == 1000 and sum(1 for s in sections if " hidden" not in s) == 25
    assert 'class="overview-title">1000 requests' in page
    with PIL.open(png_path) as image:
        assert image.size[1] <= MAX_PNG_HEIGHT


def test_max_requests_caps_the_page(tmp_path, capsys):
    html_path, _png = _timeline(tmp_path, write_jsonl(tmp_path / "s.jsonl", synthetic_records(requests=30)),
                                "--max-requests", "10")
    assert len(re.findall(r"<section class=\"request", html_path.read_text())) == 10
    assert "drawing the first 10 of 30 requests" in capsys.readouterr().out


def test_filters_by_key_and_time_window(tmp_path, capsys):
    src = write_jsonl(tmp_path / "s.jsonl", synthetic_records(requests=6))
    html_path, _png = _timeline(tmp_path, src, "--key", "1002", "--room", "1004")
    assert re.findall(r'<section class="request[^"]*" data-key="(\d+)"', html_path.read_text()) == ["1002", "1004"]
    requests = [s for s in read_spans(src) if s.name == sc.SPAN_REQUEST]
    origin = min(r.start_time_unix_nano for r in requests)
    since = (requests[2].start_time_unix_nano - origin) / 1e9 + 1e-6
    html_path, _png = _timeline(tmp_path, src, "--since", f"{since:.9f}", "--until", f"{since + 1e-6:.9f}")
    keys = re.findall(r'data-key="(\d+)"', html_path.read_text())
    lo, hi = origin + int(since * 1e9), origin + int((since + 1e-6) * 1e9)
    assert keys == [r.attributes[sc.REQUEST_KEY] for r in requests
                    if r.end_time_unix_nano >= lo and r.start_time_unix_nano <= hi]
    assert 1 <= len(keys) < 6 and "filtered" in capsys.readouterr().out


def test_png_marks_failures_and_payloads(tmp_path):
    src = write_jsonl(tmp_path / "s.jsonl", synthetic_records(requests=3, fail_key="1001"))
    _html, png_path = _timeline(tmp_path, src, "--no-html")
    with PIL.open(png_path) as image:
        pixels = {color for _count, color in image.convert("RGB").getcolors(1 << 20)}
    assert (0xE1, 0x57, 0x59) in pixels  # the failed transfer is outlined red
    assert (0xF2, 0x8E, 0x2B) in pixels  # aux payload colour


@pytest.mark.parametrize("content, expect", [
    (b"", "empty"),
    (b'{"name": "kv_transfer.send", "trace_id": "ab', ":1: "),
    (b'{"hello": 1}\n', ":1: not a span"),
    (b'{"name":"kv_transfer.send","trace_id":"' + b"ab" * 16 + b'","span_id":"' + b"cd" * 8
     + b'","start_time_unix_nano":1,"end_time_unix_nano":2,"attributes":{"kv_transfer.bootstrap_room":NaN}}\n',
     ":1: NaN"),
    (b'{"name":"x","trace_id":"' + b"ab" * 16 + b'","span_id":"' + b"cd" * 8
     + b'","start_time_unix_nano":1,"end_time_unix_nano":2,"attributes":{"k":"\\udc00"}}\n', "surrogate"),
], ids=["empty", "cut", "foreign", "nan room", "lone surrogate"])
def test_bad_input_is_one_line_exit_2_and_no_file(tmp_path, content, expect):
    src = tmp_path / "bad.jsonl"
    src.write_bytes(content)
    proc = subprocess.run([sys.executable, "-m", "otel_kvtransfer", "timeline", str(src), "--perfetto",
                           str(tmp_path / "bad.json")], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and expect in lines[0] and str(src) in lines[0], proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]


def test_failed_render_leaves_no_partial_file(tmp_path, capsys):
    src = write_jsonl(tmp_path / "s.jsonl", synthetic_records(requests=1))
    assert cli_main(["timeline", src, "--html", str(tmp_path / "no" / "dir.html"), "--no-png"]) == 2
    assert "cannot write" in capsys.readouterr().err
    target = tmp_path / "t.html"
    assert cli_main(["timeline", src, "--html", str(target), "--png", str(tmp_path / "no" / "x.png")]) == 2
    leftovers = [name for name in os.listdir(tmp_path) if name.endswith(".tmp")]
    assert not leftovers


# --------------------------------------------------------------------------------------------------- the tail


def _tail_rects(page):
    """(attributes of the tail rect, [(start, end) of each queued gap]) of every block, in page order."""
    out = []
    for section in re.findall(r'<section class="request.*?</section>', page, re.S):
        tail = re.search(r'<rect ([^>]*)class="tail"([^>]*)>', section)
        attrs = dict(re.findall(r'data-([a-z-]+)="([^"]*)"', tail.group(0))) if tail else None
        if tail:
            attrs["x"] = float(re.search(r' x="([^"]*)"', tail.group(0)).group(1))
            attrs["w"] = float(re.search(r' width="([^"]*)"', tail.group(0)).group(1))
        gaps = [(int(a), int(b)) for a, b in
                re.findall(r'class="tail-queued" data-start-ns="(\d+)" data-end-ns="(\d+)"', section)]
        labels = re.findall(r'class="tail-label">([^<]*)<', section)
        out.append((attrs, gaps, labels, section))
    return out


def _pixels(png_path, rgb) -> int:
    with PIL.open(png_path) as image:
        return {c: n for n, c in image.convert("RGB").getcolors(1 << 20)}.get(rgb, 0)


def test_tail_is_marked_with_its_figures_and_queued_gaps(tmp_path):
    from test_summarize import MS, T, known_request

    html_path, png_path = _timeline(tmp_path, write_jsonl(tmp_path / "k.jsonl", known_request()))
    ((attrs, gaps, labels, section),) = _tail_rects(html_path.read_text())
    # By hand (test_summarize.known_request): compute ends at 12 ms, the last byte leaves at 21 ms; sends are
    # busy over [12, 15) and [20, 21), so nothing moved over [15, 20).
    assert (int(attrs["compute-end-ns"]), int(attrs["last-byte-ns"])) == (T + 12 * MS, T + 21 * MS)
    assert (float(attrs["tail-s"]), float(attrs["tail-busy-s"]), float(attrs["tail-queued-s"])) == \
        pytest.approx((0.009, 0.004, 0.005), abs=1e-12)
    assert gaps == [(T + 15 * MS, T + 20 * MS)] and attrs["queued-gaps"] == "1"
    assert labels == ["tail 9.00 ms (queued 5.00 ms)"]
    assert re.search(r'class="lane-label">tail<', section) and 'class="tail-band"' in section
    # The mark starts where the compute bar ends and is as wide as 9 of the block's 25 ms.
    compute = re.search(r'<rect x="([^"]*)" y="[^"]*" width="([^"]*)"[^>]*class="compute"', section)
    assert attrs["x"] == pytest.approx(float(compute.group(1)) + float(compute.group(2)), abs=0.11)
    plot_w = 1200 - 170 - 20
    assert attrs["w"] == pytest.approx(plot_w * 9 / 25, abs=0.11)
    # The queued shading (202 x 10 pixels here) and the band are drawn, beyond the legend's 13 x 13 swatches.
    assert _pixels(png_path, (0xE8, 0xA2, 0x02)) > 1500 and _pixels(png_path, (0xFB, 0xEC, 0xC6)) > 1500


def test_no_tail_mark_without_compute_and_zero_tail_said(tmp_path):
    from test_summarize import MS, T, known_request

    records = [r for r in known_request() if r["name"] != sc.SPAN_COMPUTE]
    html_path, png_path = _timeline(tmp_path, write_jsonl(tmp_path / "nc.jsonl", records))
    ((attrs, gaps, labels, section),) = _tail_rects(html_path.read_text())
    assert attrs is None and not gaps and not labels and 'class="tail-band"' not in section
    assert _pixels(png_path, (0xE8, 0xA2, 0x02)) <= 13 * 13 and _pixels(png_path, (0xFB, 0xEC, 0xC6)) <= 13 * 13
    records = known_request()
    for record in records:
        if record["name"] == sc.SPAN_COMPUTE:
            record["end_time_unix_nano"] = T + 30 * MS  # compute outlasts every send
    html_path, _png = _timeline(tmp_path, write_jsonl(tmp_path / "z.jsonl", records))
    ((attrs, gaps, labels, _section),) = _tail_rects(html_path.read_text())
    assert float(attrs["tail-s"]) == 0.0 and not gaps
    assert labels == ["tail 0: the last byte left before compute ended"]


def test_tail_with_many_queued_gaps_is_bounded(tmp_path):
    from otel_kvtransfer.tools.timeline.block import MAX_TAIL_GAPS

    trace, req, t, count = "ab" * 16, "cd" * 8, 1_700_000_000_000_000_000, 1000
    # Compute ends at t; then 1 us sends every 2 us: 1000 gaps of 1 us, a tail of 2 ms, half of it queued.
    records = [span_record(sc.SPAN_SEND, trace, f"{i + 1:016x}", req, t + 2000 * i + 1000, t + 2000 * i + 2000,
                           {sc.REQUEST_KEY: "gappy", sc.BYTES: 4096, sc.PAYLOAD: "kv"}, kind="CLIENT")
               for i in range(count)]
    records.append(span_record(sc.SPAN_COMPUTE, trace, "ee" * 8, req, t - 1_000_000, t, {sc.REQUEST_KEY: "gappy"}))
    records.append(span_record(sc.SPAN_REQUEST, trace, req, None, t - 1_000_000, t + 2000 * count,
                               {sc.REQUEST_KEY: "gappy"}))
    html_path, _png = _timeline(tmp_path, write_jsonl(tmp_path / "g.jsonl", records))
    ((attrs, gaps, labels, _section),) = _tail_rects(html_path.read_text())
    assert attrs["queued-gaps"] == str(count) and len(gaps) == MAX_TAIL_GAPS
    assert float(attrs["tail-s"]) == pytest.approx(0.002, abs=1e-12)
    assert float(attrs["tail-queued-s"]) == pytest.approx(0.001, abs=1e-12)
    assert labels == ["tail 2.00 ms (queued 1.00 ms)"]


def test_demo_timeline_marks_every_requests_tail_as_its_span_states_it(tmp_path):
    src = demo_span_file()
    html_path, _png = _timeline(tmp_path, src)
    spans = {s.attributes[sc.REQUEST_KEY]: s.attributes for s in read_spans(src) if s.name == sc.SPAN_REQUEST}
    blocks = _tail_rects(html_path.read_text())
    assert len(blocks) == len(spans)
    for attrs, _gaps, labels, section in blocks:
        key = re.search(r'data-key="([^"]*)"', section).group(1)
        assert float(attrs["tail-s"]) == spans[key][sc.TAIL_S]
        assert float(attrs["tail-queued-s"]) == spans[key][sc.TAIL_QUEUED_S]
        assert len(labels) == 1 and labels[0].startswith("tail ")
