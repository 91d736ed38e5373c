"""Traces of a real transfer workload, exported over OTLP gRPC and OTLP HTTP to a real trace store (Arize Phoenix,
its own venv), read back through the store's REST API and checked: span names, parent/child links, attributes,
and the prefill and decode spans of a room in one trace.

Phoenix's gRPC port binds every interface, so Phoenix runs in a network namespace of its own (`unshare --net`,
loopback up) and the workload and the read-back join it with `nsenter --net`: nothing listens or sends outside
127.0.0.1 of that namespace. Phoenix is stopped by its PID.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
from support import netns
from support.observability.parts import ROOT, SETUP, mooncake_available, phoenix_binary, start, stop, wait_until
from support.observability.workload import (
    AUX_BYTES,
    CHUNK_BYTES,
    CHUNKS,
    DESCRIPTORS,
    FRAMEWORK,
    MODEL,
    RECV_BYTES,
    REPLICAS,
)
from support.parts import require_part
from support.paths import TESTS

from otel_kvtransfer import semconv

WORKLOAD = os.path.join(TESTS, "support", "observability", "workload.py")
HTTP_PORT, GRPC_PORT = 6006, 4317  # inside Phoenix's own network namespace, where nothing else listens
ROOMS = 4

READBACK = r"""
import json, sys, urllib.parse, urllib.request
base, project, trace_ids = sys.argv[1], sys.argv[2], sys.argv[3:]
spans, cursor = [], None
for _ in range(50):
    params = [("limit", "1000")] + [("trace_id", t) for t in trace_ids] + ([("cursor", cursor)] if cursor else [])
    url = f"{base}/v1/projects/{project}/spans/otlpv1?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.loads(response.read().decode())
    spans += body["data"]
    cursor = body.get("next_cursor")
    if not cursor:
        break
print(json.dumps(spans))
"""


def _room_ids(room: int):
    key = room.to_bytes(8, "big")
    trace_id = hashlib.blake2b(key, digest_size=16, person=b"kv_transfer").hexdigest()
    span_id = hashlib.blake2b(key, digest_size=8, person=b"kv_transfer.req").hexdigest()
    return trace_id, span_id


def _value(any_value):
    for key in ("string_value", "bool_value", "int_value", "double_value"):
        if any_value.get(key) is not None:
            value = any_value[key]
            return int(value) if key == "int_value" else value
    return None


def _attributes(span):
    return {kv["key"]: _value(kv["value"]) for kv in span.get("attributes") or []}


def _netns_of(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


@pytest.fixture(scope="module")
def phoenix():
    binary = phoenix_binary()
    require_part(bool(binary), f"arize-phoenix in its own venv ({SETUP})")
    require_part(bool(shutil.which("unshare") and shutil.which("nsenter") and shutil.which("ip")),
                 "unshare/nsenter (util-linux) and ip (iproute2)")
    require_part(mooncake_available(), "mooncake-transfer-engine-non-cuda + libibverbs1 (bash scripts/setup.sh)")
    workdir = tempfile.mkdtemp(prefix="kvt-phoenix-")
    env = {**os.environ, "PHOENIX_WORKING_DIR": workdir, "PHOENIX_HOST": "127.0.0.1",
           "PHOENIX_PORT": str(HTTP_PORT), "PHOENIX_GRPC_PORT": str(GRPC_PORT),
           "PHOENIX_TELEMETRY_ENABLED": "false", "PHOENIX_ALLOW_EXTERNAL_RESOURCES": "false"}
    log = open(os.path.join(workdir, "phoenix.log"), "w", encoding="utf-8")
    # unshare without --fork: this very PID enters the new namespace and then becomes Phoenix.
    proc = start(netns.private_net([binary, "serve"]), env=env, stdout=log, stderr=log)
    try:
        own = _netns_of(os.getpid())
        wait_until(lambda: _netns_of(proc.pid) != own, 10, 0.05, what="phoenix in its own network namespace")
        nsenter = ["nsenter", f"--net=/proc/{proc.pid}/ns/net"]

        def healthy():
            if proc.poll() is not None:
                raise RuntimeError(f"phoenix exited with {proc.returncode}; see {log.name}")
            probe = subprocess.run(
                nsenter + [sys.executable, "-c", "import urllib.request as u; "
                           f"u.urlopen('http://127.0.0.1:{HTTP_PORT}/healthz', timeout=2)"],
                capture_output=True, timeout=15, check=False)
            return probe.returncode == 0

        # bounded, but generous: on a loaded 2-core machine Phoenix took over 90 s to answer
        wait_until(healthy, 240, 0.5, what="phoenix /healthz")
        yield {"nsenter": nsenter, "base": f"http://127.0.0.1:{HTTP_PORT}", "workdir": workdir}
    finally:
        stop(proc)
        log.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _run_workload(phoenix, protocol: str, room_base: int, project: str):
    endpoint = f"127.0.0.1:{GRPC_PORT if protocol == 'grpc' else HTTP_PORT}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, TESTS])}
    result = subprocess.run(
        phoenix["nsenter"] + [sys.executable, WORKLOAD, "traces", "--protocol", protocol, "--endpoint", endpoint,
                              "--project", project, "--rooms", str(ROOMS), "--room-base", str(room_base),
                              "--evict-wait", "0", "--pause", "0"],
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (line,) = [text for text in result.stdout.splitlines() if text.startswith("DONE ")]
    return json.loads(line[len("DONE "):])


def _read_back(phoenix, project: str, trace_ids, expected: int):
    def fetch():
        result = subprocess.run(
            phoenix["nsenter"] + [sys.executable, "-c", READBACK, phoenix["base"], project, *trace_ids],
            capture_output=True, text=True, timeout=30, check=False)
        if result.returncode != 0:
            return None
        spans = json.loads(result.stdout)
        return spans if len(spans) >= expected else None

    return wait_until(fetch, 30, 1.0, what=f"{expected} spans in Phoenix project {project}")


@pytest.mark.parametrize("protocol, room_base", [("grpc", 5000), ("http", 6000)])
def test_trace_store_holds_the_transfer_traces(phoenix, protocol, room_base):
    project = f"kvt-{protocol}"
    summary = _run_workload(phoenix, protocol, room_base, project)
    rooms = summary["rooms"]
    assert len(rooms) == ROOMS
    sends_per_room = CHUNKS * REPLICAS + 1
    ids = {room: _room_ids(room) for room in rooms}
    spans = _read_back(phoenix, project, [t for t, _ in ids.values()], ROOMS * (sends_per_room + CHUNKS + 2))

    by_trace = {}
    for span in spans:
        by_trace.setdefault(span["trace_id"], []).append(span)
    for room in rooms:
        trace_id, synthetic_parent = ids[room]
        trace = by_trace.get(trace_id, [])
        names = sorted(s["name"] for s in trace)
        assert names == sorted([semconv.SPAN_REQUEST, semconv.SPAN_RECEIVE] + [semconv.SPAN_SEND] * sends_per_room
                               + [semconv.SPAN_COMPUTE] * CHUNKS), (room, names)
        (request,) = [s for s in trace if s["name"] == semconv.SPAN_REQUEST]
        (receive,) = [s for s in trace if s["name"] == semconv.SPAN_RECEIVE]
        sends = [s for s in trace if s["name"] == semconv.SPAN_SEND]
        computes = [s for s in trace if s["name"] == semconv.SPAN_COMPUTE]

        # prefill and decode in one trace, both under the room's synthetic parent (DESIGN "Trace stitching")
        assert request["parent_span_id"] == synthetic_parent
        assert receive["parent_span_id"] == synthetic_parent
        for child in sends + computes:
            assert child["parent_span_id"] == request["span_id"]
        for send in sends:
            # (span kind is not asserted: Phoenix keeps OpenInference kinds, not the OTel kind CLIENT/INTERNAL)
            assert int(send["start_time_unix_nano"]) >= int(request["start_time_unix_nano"])
            assert int(send["end_time_unix_nano"]) <= int(request["end_time_unix_nano"])

        req = _attributes(request)
        assert req["kv_transfer.request_key"] == str(room)
        assert req["kv_transfer.role"] == "prefill" and req["kv_transfer.backend"] == "mooncake"
        assert req["kv_transfer.framework"] == FRAMEWORK and req["gen_ai.request.model"] == MODEL
        assert req["kv_transfer.transfer_count"] == sends_per_room
        assert req["kv_transfer.chunk_count"] == CHUNKS
        assert req["kv_transfer.replica_factor"] == REPLICAS
        assert req["kv_transfer.bytes"] == sum(_attributes(s)["kv_transfer.bytes"] for s in sends)
        assert req["kv_transfer.bytes"] == REPLICAS * CHUNKS * CHUNK_BYTES + AUX_BYTES
        assert req["kv_transfer.busy_s"] > 0 and req["kv_transfer.throughput"] > 0
        assert 0.0 <= req["kv_transfer.compute_overlap_ratio"] <= 1.0

        rec = _attributes(receive)
        assert rec["kv_transfer.role"] == "decode" and rec["kv_transfer.request_key"] == str(room)
        assert rec["kv_transfer.backend"] == "mooncake" and rec["kv_transfer.framework"] == FRAMEWORK
        assert rec["kv_transfer.expected_bytes"] == RECV_BYTES

        kv = [_attributes(s) for s in sends if _attributes(s)["kv_transfer.payload"] == "kv"]
        aux = [_attributes(s) for s in sends if _attributes(s)["kv_transfer.payload"] == "aux"]
        assert len(kv) == CHUNKS * REPLICAS and len(aux) == 1
        assert sorted((a["kv_transfer.chunk_index"], a["kv_transfer.destination_index"]) for a in kv) == \
            [(c, d) for c in range(CHUNKS) for d in range(REPLICAS)]
        for attrs in kv + aux:
            assert attrs["kv_transfer.request_key"] == str(room)
            assert attrs["kv_transfer.framework"] == FRAMEWORK and attrs["gen_ai.request.model"] == MODEL
            assert attrs["kv_transfer.op"] == "write"
            assert attrs["server.address"] == "127.0.0.1" and isinstance(attrs["server.port"], int)
            assert attrs["network.transport"] == "tcp"
            assert attrs["network.io.direction"] == "transmit"
            assert attrs["kv_transfer.engine_calls"] == 1
            assert attrs["kv_transfer.throughput"] >= 0
        assert all(a["kv_transfer.bytes"] == CHUNK_BYTES and a["kv_transfer.replica_factor"] == REPLICAS for a in kv)
        assert all(a["kv_transfer.descriptor_count"] == DESCRIPTORS for a in kv)  # one batch call of blocks
        assert aux[0]["kv_transfer.bytes"] == AUX_BYTES and aux[0]["kv_transfer.descriptor_count"] == 1
        assert [a["kv_transfer.is_last_chunk"] for a in kv].count(True) == REPLICAS

        failed = room in summary["failed_rooms"]
        errors = [s for s in sends if (s.get("status") or {}).get("code") == 2]
        if failed:
            assert errors and all(_attributes(s)["error.type"] for s in errors)
            assert (request.get("status") or {}).get("code") == 2 and req["error.type"]
            assert _attributes(errors[0])["kv_transfer.return_code"] != 0
        else:
            assert not errors and (request.get("status") or {}).get("code") != 2
