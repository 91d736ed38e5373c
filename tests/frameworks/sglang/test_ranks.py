"""Ranks on sglang 0.5.23's real PD classes (tests/support/sglang_harness.py: sglang's Mooncake managers in spawned
processes, real Mooncake TCP on 127.0.0.1, no servers): one prefill rank fanning the same MLA KV out to two decode
ranks, whose metadata reaches the prefill in the order [rank 1, rank 0] (the harness holds rank 0 back until the
prefill has rank 1's), so registration order and rank order disagree.

Asserted: every span kind carries the engine's own `kv_transfer.tp_rank`; every send its destination's
`kv_transfer.peer_rank`, and `kv_transfer.destination_index` is the position of that rank among the request's
destinations ordered by rank (not sglang's registration order); each receive's expected bytes are what reached it;
each harness process prints one start-up line naming its role and rank. The scenario runs once, as a subprocess
(python tests/support/sglang_harness.py), so its processes' stderr, where the start-up lines go, is read too. The other
shapes (prefill TP2 -> decode TP1 and TP2, MLA -> decode TP2, TP1 -> TP2 head slices) run on real servers in
test_sglang_shapes.py; registration order cannot be forced there, so it is held back here.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from support.parts import require_part
from support.paths import ROOT, TESTS

from otel_kvtransfer import semconv as sc

HARNESS = os.path.join(TESTS, "support", "sglang_harness.py")
# timeout_s bounds each process's wait for its peers (imports of sglang included): generous, as it only ends a
# hung run, and a loaded 2-core CI machine takes minutes where a quiet one takes seconds.
SCENARIO = {"mla": True, "decodes": 2, "chunks": [16, 16], "register_order": [1, 0], "timeout_s": 300.0}
RUN_TIMEOUT_S = 900  # two sglang imports in spawned processes take minutes on a loaded 2-core machine


def _run(scenario, prefills=1, decodes=1):
    ok = importlib.util.find_spec("sglang") is not None and importlib.util.find_spec("mooncake") is not None
    require_part(ok, "sglang 0.5.23 and mooncake-transfer-engine-non-cuda")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (TESTS, ROOT, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, HARNESS, json.dumps(scenario)], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, cwd=TESTS, env=env, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("HARNESS_RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("HARNESS_RESULT "):])
    assert len(result["prefills"]) == prefills and all("error" not in p for p in result["prefills"]), result
    assert len(result["decodes"]) == decodes and all("error" not in d for d in result["decodes"]), result["decodes"]
    assert all(p["status"] == "Success" for p in result["prefills"])
    assert all(d["status"] == "Success" and d["verified"]["bad_pages"] == 0 and d["verified"]["aux_ok"]
               for d in result["decodes"])
    result["stderr"] = proc.stderr
    return result


@pytest.fixture(scope="module")
def fanout():
    return _run(SCENARIO, decodes=2)


def _named(spans, name):
    return [s for s in spans if s["name"] == name]


def test_the_decode_ranks_registered_out_of_rank_order(fanout):
    # The premise of the rule's test: sglang lists rank 1 first for this room.
    assert fanout["prefill"]["registered_ranks"] == [1, 0]


def test_destination_index_is_the_peer_ranks_position_not_the_registration_order(fanout):
    sends = _named(fanout["prefill"]["spans"], sc.SPAN_SEND)
    assert len(sends) == 2 * 2 + 2  # kv of two chunks and one aux, to each of two ranks
    seen = set()
    for send in sends:
        attrs = send["attributes"]
        assert attrs[sc.PEER_RANK] in (0, 1)
        assert attrs[sc.DESTINATION_INDEX] == sorted((0, 1)).index(attrs[sc.PEER_RANK])
        seen.add((attrs[sc.PAYLOAD], attrs[sc.CHUNK_INDEX], attrs[sc.PEER_RANK]))
    assert seen == {("kv", c, r) for c in (0, 1) for r in (0, 1)} | {("aux", 1, r) for r in (0, 1)}


def test_each_send_goes_to_the_rank_it_names(fanout):
    # The peer rank is the rank that received: the send's peer port is that decode rank's Mooncake session.
    by_rank = {}
    for send in _named(fanout["prefill"]["spans"], sc.SPAN_SEND):
        attrs = send["attributes"]
        by_rank.setdefault(attrs[sc.PEER_RANK], set()).add((attrs[sc.SERVER_ADDRESS], attrs[sc.SERVER_PORT]))
    assert all(len(peers) == 1 for peers in by_rank.values()), by_rank
    assert by_rank[0] != by_rank[1]


def test_every_span_kind_carries_the_engines_own_tp_rank(fanout):
    spans = fanout["prefill"]["spans"]
    for name in (sc.SPAN_REQUEST, sc.SPAN_SEND, sc.SPAN_COMPUTE):
        found = _named(spans, name)
        assert found, name
        for span in found:
            assert span["attributes"][sc.TP_RANK] == 0, (name, span["attributes"])
            assert sc.DP_RANK not in span["attributes"]  # no data-parallel attention here
    for decode in fanout["decodes"]:
        (receive,) = _named(decode["spans"], sc.SPAN_RECEIVE)
        assert receive["attributes"][sc.TP_RANK] == decode["rank"]
        assert sc.DP_RANK not in receive["attributes"]


def test_each_receive_expects_exactly_what_its_rank_was_sent(fanout):
    sends = _named(fanout["prefill"]["spans"], sc.SPAN_SEND)
    for decode in fanout["decodes"]:
        (receive,) = _named(decode["spans"], sc.SPAN_RECEIVE)
        arrived = sum(s["attributes"][sc.BYTES] for s in sends if s["attributes"][sc.PEER_RANK] == decode["rank"])
        assert receive["attributes"][sc.EXPECTED_BYTES] == arrived


def _startup_lines(stderr):
    return [line for line in stderr.splitlines() if "otel_kvtransfer: on (" in line]


def test_each_process_prints_one_start_up_line_with_its_role_and_rank(fanout):
    lines = _startup_lines(fanout["stderr"])
    assert len(lines) == 3, lines  # the prefill process and the two decode processes, once each
    said = sorted(next(part for part in line.split("; ") if part.startswith("role ")) for line in lines)
    assert said == ["role decode, kv_transfer.tp_rank 0 (sglang)", "role decode, kv_transfer.tp_rank 1 (sglang)",
                    "role prefill, kv_transfer.tp_rank 0 (sglang)"]
    for line in lines:
        assert " INFO " in line and "patched: sglang 0.5.23" in line and "engines: mooncake " in line
        assert "builder: thread" in line  # a provider given to instrument(): spans built in process
        assert "spans: unset (InMemorySpanExporter)" in line and "metrics: unset (InMemoryMetricReader)" in line
