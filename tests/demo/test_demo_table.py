"""The demo's table: the tail columns (tail, of which queued) are the request spans' own figures, and a request
without them (compute unknown) shows "-"."""

import json
import os

import pytest
from support.span_files import demo_span_file

from otel_kvtransfer import semconv as sc
from otel_kvtransfer.demo import GIB, format_table, link_figure
from otel_kvtransfer.tools.spanfile import read_spans


def _columns(table: str) -> tuple:
    """(header names, rows as lists of cells) of the table's request rows (cells never hold a space)."""
    lines = table.splitlines()
    names = lines[0].replace("wire MiB", "wire_MiB").replace("logical MiB", "logical_MiB").replace(
        " GiB/s", "_GiB/s").replace("tail ms", "tail_ms").replace("queued ms", "queued_ms").replace(
        "busy ms", "busy_ms").split()
    # a row has a cell under every header and starts with two counts (room, chunks): the notes below the table
    # (one starts with a count of requests) do not
    rows = [cells for cells in (line.split() for line in lines[2:])
            if len(cells) == len(names) and cells[0].isdigit() and cells[1].isdigit()]
    return names, rows


def test_tail_columns_show_the_figures_and_a_dash_without_them():
    row = {"room": 7, "chunks": 3, "transfers": 8, "wire_bytes": 2 << 20, "logical_bytes": 1 << 20,
           "busy_s": 0.01, "true_gib_s": 1.0, "legacy_gib_s": 9.0, "enqueue_to_done_gib_s": 0.5,
           "overlap_ratio": 0.5, "tail_s": 0.01234, "tail_queued_s": 0.00049}
    bare = {**row, "room": 8, "tail_s": None, "tail_queued_s": None}
    names, rows = _columns(format_table([row, bare], link_figure([GIB], [])))
    assert names[-2:] == ["tail_ms", "queued_ms"]
    assert rows[0][-2:] == ["12.3", "0.5"] and rows[1][-2:] == ["-", "-"]


def test_the_demo_table_shows_each_requests_tail_as_its_span_states_it():
    path = demo_span_file()
    folder = os.path.dirname(path)
    spans = {s.attributes[sc.REQUEST_KEY]: s.attributes for s in read_spans(path) if s.name == sc.SPAN_REQUEST}
    with open(os.path.join(folder, "results.json"), encoding="utf-8") as handle:
        results = json.load(handle)
    with open(os.path.join(folder, "table.txt"), encoding="utf-8") as handle:
        names, rows = _columns(handle.read())
    assert len(rows) == len(results["requests"]) == len(spans) >= 3
    for result, cells in zip(results["requests"], rows):
        attrs = spans[str(result["room"])]
        assert result["tail_s"] == attrs[sc.TAIL_S] and result["tail_queued_s"] == attrs[sc.TAIL_QUEUED_S]
        assert attrs[sc.TAIL_QUEUED_S] <= attrs[sc.TAIL_S]
        cell = dict(zip(names, cells))
        assert float(cell["tail_ms"]) == pytest.approx(attrs[sc.TAIL_S] * 1e3, abs=0.05)
        assert float(cell["queued_ms"]) == pytest.approx(attrs[sc.TAIL_QUEUED_S] * 1e3, abs=0.05)
