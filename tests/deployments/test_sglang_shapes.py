"""Production shapes on one real sglang PD deployment: six servers, each under `opentelemetry-instrument`, two
sglang-routers in PD mode, real requests, Mooncake over TCP and NIXL (UCX over TCP and shared memory), all in one
private network namespace (tests/sglang_serving/deployment.py). One deployment serves every shape at once, so the
suite pays one start:

| servers                                   | requests reach them            | the shape                       |
|-------------------------------------------|--------------------------------|---------------------------------|
| prefill (TP1) -> decode (TP1)             | router "router"                | the pair; sglang's tracing      |
| prefill (TP1) -> decode-tp2 (TP2)         | straight, as a router sends    | MHA head slices per decode rank |
| prefill-tp2 (TP2) -> decode, decode-tp2   | router "router-decodes" (r-r)  | prefill TP2 -> TP1 and -> TP2;  |
|                                           |                                | two decodes behind a router     |
| mla-prefill (TP1) -> mla-decode-tp2 (TP2) | straight                       | MLA over NIXL: the same KV to   |
|                                           |                                | both ranks; a cached prefix     |

Every server runs with sglang's own tracing (`--enable-trace`) and OTEL_KVTRANSFER_BUILDER=process; the pair's
prefill sends its aux over ZMQ/TCP (SGLANG_MOONCAKE_SEND_AUX_TCP=1). Each shape is checked against the truth
computed from the model's config and the prompt's token count: KV bytes between each prefill rank and each
decode rank (head slices for MHA, the whole latent to every rank for MLA), replica factor and logical bytes,
which decode rank each send went to (its Mooncake port, read from the namespace's listening sockets), the
destination index rule, a receive on every decode rank expecting exactly what reached it, one trace per
request when the client sends a trace context, and sglang's own byte count (`--enable-metrics`) beside ours.

Stand-ins, for what cannot run on this CPU-only machine (tests/sglang_serving/pythonpath): the import-only
`sgl_kernel`; the test-only sglang plugin (host page indices; NIXL's KV pool declared DRAM, what it is here; for
the MLA servers, sglang's own MLA attention dispatch in place of the GPU/AMX kernels it has none of on CPU; the KV
pool and the transfers stay sglang's); for TP2, an NCCL library path that does not load (sglang then uses gloo)
and one core per rank. NIXL carries the MLA shape because sglang 0.5.23's NIXL head-slice path (MHA, decode TP >
prefill TP) refuses KV in host memory, and host memory is all this machine has; the head slices go over Mooncake.
"""

import json
import os
import re
import shutil
import tempfile

import pytest
from support import sglang_runs
from support.parts import IN_CI
from support.sglang_runs import COMPUTE, RECEIVE, REQUEST, SEND, Run
from support.waiting import wait_until
from vllm_serving.harness import prometheus_value  # sums a sample over its label sets, whoever exposes it

TRACEPARENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
AUX_TCP = {"SGLANG_MOONCAKE_SEND_AUX_TCP": "1"}


def _layout():
    from sglang_serving import deployment as dep

    s, r = dep.Server, dep.Router
    servers = [
        s("prefill", env=AUX_TCP), s("decode"),
        s("prefill-tp2", "prefill", port=30002, bootstrap_port=8999, tp=2),
        s("decode-tp2", "decode", port=30003, tp=2),
        s("mla-prefill", "prefill", port=30004, bootstrap_port=9000, model_dir=dep.MLA_MODEL_DIR, env=dep.MLA_ENV,
          backend="nixl"),
        s("mla-decode-tp2", "decode", port=30005, tp=2, model_dir=dep.MLA_MODEL_DIR, env=dep.MLA_ENV,
          backend="nixl"),
    ]
    routers = [r("router", dep.ROUTER_PORT, ["prefill"], ["decode"]),
               r("router-decodes", 8001, ["prefill-tp2"], ["decode", "decode-tp2"],
                 ["--prefill-policy", "round_robin", "--decode-policy", "round_robin"])]
    return servers, routers


def _traceparent(n: int) -> str:
    return f"00-{n:032x}-00f067aa0ba902b7-01"


class Shapes:
    """The requests each shape was sent and their answers, sent once the deployment is up; the pair's own
    (traced) run, whose spans are read for every shape."""

    def __init__(self, deployment):
        from sglang_serving import deployment as dep

        self.deployment = deployment
        self.by_shape = {}
        traced = dep.prompts(2, 200, 8, repeat_every=0, seed=3, rid_prefix="traced")
        traced[1]["traceparent"] = f"00-{TRACEPARENT_TRACE_ID}-00f067aa0ba902b7-01"  # a client that traces
        self.traced = Run(deployment, traced, deployment.generate(traced))
        self._direct("tp1_to_tp2", "prefill", "decode-tp2", dep.prompts(1, 300, 4, seed=5, rid_prefix="tp1-tp2"),
                     room=5_000_000)
        # a prompt and a shorter one, then the first again once it is in the prefill's radix cache (its cached
        # prefix is sent early): the byte formula at two lengths and the early send, over NIXL
        mla = dep.prompts(1, 300, 4, seed=6, rid_prefix="mla-tp2") + dep.prompts(1, 130, 4, seed=11,
                                                                                 rid_prefix="mla-tp2-short")
        self._direct("mla_to_tp2", "mla-prefill", "mla-decode-tp2", mla, room=6_000_000)
        repeat = [dict(mla[0], rid="mla-tp2-repeat")]
        self._direct("mla_to_tp2", "mla-prefill", "mla-decode-tp2", repeat, room=6_000_010)
        behind = dep.prompts(2, 260, 4, repeat_every=0, seed=7, rid_prefix="two-decodes")
        self.by_shape["tp2_to_two_decodes"] = (behind, deployment.generate(behind, router="router-decodes"))
        self.listening = _listening(deployment)

    def _direct(self, shape, prefill, decode, requests, room):
        for n, request in enumerate(requests):
            request["room"] = room + n
            request["traceparent"] = _traceparent(room + n)
        answers = self.deployment.generate_on(prefill, decode, requests)
        assert all(a["prefill"] == 200 and a["decode"] == 200 for a in answers), answers
        sent, answered = self.by_shape.get(shape, ([], []))
        self.by_shape[shape] = (sent + requests, answered + answers)

    def requests(self, shape):
        return self.by_shape[shape][0]


def _listening(deployment):
    """{(server, rank): listening TCP ports} of every scheduler process, read inside the namespace (`ss`): an
    account of where each rank's Mooncake engine takes writes that owes nothing to our spans."""
    code, out, err = deployment.run_in_namespace(["ss", "-Hltnp"], timeout=30)
    assert code == 0, err
    owner = {}
    for name in deployment.servers:
        for pid in deployment.server_pids(name):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as handle:
                    title = handle.read().split(b"\0")[0].decode(errors="replace")
            except OSError:
                continue
            if title.startswith("sglang::scheduler"):
                rank = re.search(r"_TP(\d+)", title)
                owner[pid] = (name, int(rank.group(1)) if rank else 0)
    ports = {}
    for line in out.splitlines():
        local = line.split()[3]
        for pid in re.findall(r"pid=(\d+)", line):
            if int(pid) in owner:
                ports.setdefault(owner[int(pid)], set()).add(int(local.rsplit(":", 1)[1]))
    return ports


SGLANG_TOTAL_MB = "sglang:kv_transfer_total_mb"


def _sglang_metrics(deployment):
    """{prefill server: (sum, count) of sglang's own kv_transfer_total_mb histogram}, over all its label sets;
    each exposition is kept beside the span files."""
    found = {}
    for name, server in deployment.servers.items():
        if server.role != "prefill":
            continue
        text = deployment.metrics_text(name)
        with open(os.path.join(deployment.workdir, f"sglang-metrics-{name}.txt"), "w", encoding="utf-8") as out:
            out.write(text)
        found[name] = (prometheus_value(text, SGLANG_TOTAL_MB + "_sum"),
                       prometheus_value(text, SGLANG_TOTAL_MB + "_count"))
    return found


def _keep_cpu_seconds(deployment):
    """What each server has cost so far (start-up and its requests), in CPU seconds of its process tree, kept
    beside the span files: docs/sglang.md's CI cost per shape comes from it."""
    import psutil

    spent = {}
    for name in deployment.servers:
        total = 0.0
        for pid in deployment.server_pids(name):
            try:
                times = psutil.Process(pid).cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += times.user + times.system
        spent[name] = round(total, 1)
    with open(os.path.join(deployment.workdir, "cpu-seconds.json"), "w", encoding="utf-8") as out:
        json.dump(spent, out, indent=1)


def _wait_for_every_span(run, shapes):
    """Until every request of every shape has a request span from each rank of the prefill that served it and a
    receive on each decode rank, under sglang's spans. Each rank's spans come from a builder process of its own,
    exporting on its own schedule: one rank's request span says nothing of its neighbour's."""
    servers = shapes.deployment.servers
    served = [(run.requests, "prefill"), (shapes.requests("tp2_to_two_decodes"), "prefill-tp2"),
              (shapes.requests("tp1_to_tp2"), "prefill"), (shapes.requests("mla_to_tp2"), "mla-prefill")]
    wanted = {(r["rid"], rank) for requests, prefill in served for r in requests
              for rank in range(servers[prefill].tp)}
    wanted_rooms = {r["room"] for shape in ("tp1_to_tp2", "mla_to_tp2") for r in shapes.requests(shape)}

    def complete():
        run.spans = run.read_spans()
        have = {(s.attributes.get("sglang.rid"), s.attributes.get("kv_transfer.tp_rank", 0))
                for s in run.named(REQUEST)}
        rooms = [s.attributes.get("kv_transfer.bootstrap_room") for s in run.named(RECEIVE)]
        ids = {s.span_id for _, s in run.spans}
        parents = all(s.parent_span_id in ids for s in run.named(REQUEST) + run.named(RECEIVE))
        return wanted <= have and all(rooms.count(room) == 2 for room in wanted_rooms) and parents

    wait_until(complete, 120, "every shape's request spans (each prefill rank's) and receive spans, under "
               "sglang's spans", interval_s=1.0)


@pytest.fixture(scope="module")
def shapes():
    sglang_runs.require_parts("mooncake")
    from sglang_serving import deployment as dep

    base = tempfile.mkdtemp(prefix="kvt-sglang-shapes-")
    servers, routers = _layout()
    # process.pid / parent_pid on every span tell which process built it
    builder = {"OTEL_KVTRANSFER_BUILDER": "process", "OTEL_EXPERIMENTAL_RESOURCE_DETECTORS": "otel,process"}
    # --sleep-on-idle: nine schedulers that busy-poll when idle take most of two cores, and Mooncake's own threads
    # starve: a first transfer to a new peer then fails ("Session ... failed") instead of taking a second or two.
    # Idle, each now waits for its next message (up to 1 s): requests take longer, the bytes are the same.
    deployment = dep.Deployment(os.path.join(base, "shapes"), enable_trace=True, extra_env=builder,
                                servers=servers, routers=routers, server_flags=["--enable-metrics", "--sleep-on-idle"])
    try:
        deployment.start()
        shapes = Shapes(deployment)
        _wait_for_every_span(shapes.traced, shapes)
        shapes.sglang_metrics = _sglang_metrics(deployment)
        _keep_cpu_seconds(deployment)
        yield shapes
    finally:
        deployment.stop()
        if not IN_CI and os.environ.get("KVT_KEEP_SERVING_OUTPUT") != "1":
            shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def traced_run(shapes):
    return shapes.traced


# --- the truth, from the model's config --------------------------------------------------------------------------


def _config(server):
    from sglang_serving import deployment as dep

    return dep.model_config(server.model_dir or dep.MODEL_DIR)


def _sends_of(run, room):
    return [(name, s) for name, s in run.spans if s.name == SEND and s.attributes.get("kv_transfer.bootstrap_room")
            == room]


def _receives_of(run, room):
    return [(name, s) for name, s in run.spans if s.name == RECEIVE
            and s.attributes.get("kv_transfer.bootstrap_room") == room]


def _room_of(run, rid):
    rooms = {s.attributes["kv_transfer.bootstrap_room"] for s in run.named(REQUEST)
             if s.attributes.get("sglang.rid") == rid}
    assert len(rooms) == 1, (rid, rooms)
    return rooms.pop()


def _check_shape(shapes, room, tokens, prefill, decode):
    """One request of a shape against the truth: every (prefill rank, decode rank) pair's KV bytes, one aux per
    pair, each send to the rank it names (that rank's own listening port), destination indexes by peer rank,
    a receive on every decode rank expecting exactly what its sends carried, request spans per prefill rank."""
    from sglang_serving import deployment as dep

    run = shapes.traced
    p_server, d_server = run.deployment.servers[prefill], run.deployment.servers[decode]
    config = _config(p_server)
    sends = _sends_of(run, room)
    receives = _receives_of(run, room)
    assert {name for name, _ in sends} == {prefill} and {name for name, _ in receives} == {decode}
    assert sorted(s.attributes["kv_transfer.tp_rank"] for _, s in receives) == list(range(d_server.tp))
    for p_rank in range(p_server.tp):
        (request,) = [s for s in run.named(REQUEST, prefill) if s.attributes["kv_transfer.bootstrap_room"] == room
                      and s.attributes["kv_transfer.tp_rank"] == p_rank]
        mine = [s for _, s in sends if s.attributes["kv_transfer.tp_rank"] == p_rank]
        assert all(s.parent_span_id == request.span_id and not s.is_error for s in mine)
        peers = sorted({s.attributes["kv_transfer.peer_rank"] for s in mine})
        for send in mine:
            attrs = send.attributes
            assert attrs["kv_transfer.destination_index"] == peers.index(attrs["kv_transfer.peer_rank"])
            assert attrs["kv_transfer.backend"] == run.deployment.backend_of(prefill)
            if attrs["kv_transfer.backend"] == "nixl":  # the decode rank's own agent, one per rank
                assert attrs["nixl.remote_agent"] and attrs["kv_transfer.protocol"] == "ucx", attrs
            elif attrs["kv_transfer.payload"] == "kv":  # the aux of the pair's prefill goes over ZMQ/TCP
                assert attrs["server.port"] in shapes.listening[(decode, attrs["kv_transfer.peer_rank"])], attrs
        if run.deployment.backend_of(prefill) == "nixl":
            agents = {s.attributes["kv_transfer.peer_rank"]: s.attributes["nixl.remote_agent"] for s in mine}
            assert len(set(agents.values())) == len(agents) == len(peers), agents
        for d_rank in range(d_server.tp):
            truth = dep.kv_bytes_between(tokens, config, p_server.tp, p_rank, d_server.tp, d_rank)
            to_rank = [s.attributes for s in mine if s.attributes["kv_transfer.peer_rank"] == d_rank]
            kv = sum(a["kv_transfer.bytes"] for a in to_rank if a["kv_transfer.payload"] == "kv")
            aux = [a for a in to_rank if a["kv_transfer.payload"] == "aux"]
            assert kv == truth, (p_rank, d_rank, kv, truth)
            assert len(aux) == (1 if truth else 0) and all(a["kv_transfer.bytes"] > 0 for a in aux)
        logical = sum(s.attributes["kv_transfer.bytes"] for s in mine) // (len(peers) if "kv_lora_rank" in config
                                                                           else 1)
        assert request.attributes["kv_transfer.bytes"] == sum(s.attributes["kv_transfer.bytes"] for s in mine)
        assert request.attributes["kv_transfer.logical_bytes"] == logical
        assert request.attributes["kv_transfer.replica_factor"] == (len(peers) if "kv_lora_rank" in config else 1)
    for _, receive in receives:
        rank = receive.attributes["kv_transfer.tp_rank"]
        arrived = sum(s.attributes["kv_transfer.bytes"] for _, s in sends if s.attributes["kv_transfer.peer_rank"]
                      == rank)
        assert receive.attributes["kv_transfer.expected_bytes"] == arrived and not receive.is_error
    return sends, receives


# --- the shapes ------------------------------------------------------------------------------------------------


def test_prefill_tp1_to_decode_tp2_sends_each_rank_its_heads_in_one_trace(shapes):
    (request,) = shapes.requests("tp1_to_tp2")
    sends, receives = _check_shape(shapes, request["room"], len(request["input_ids"]), "prefill", "decode-tp2")
    assert {s.attributes["kv_transfer.peer_rank"] for _, s in sends} == {0, 1}
    # the client's trace context: the prefill's request, its sends and both decode ranks' receives in one trace
    assert {s.trace_id for _, s in sends + receives} == {request["traceparent"][3:35]}


def test_mla_over_nixl_to_decode_tp2_sends_the_same_kv_to_both_ranks(shapes):
    """sglang's NIXL manager posts real NIXL writes of the whole latent KV to each decode rank: every send is one of
    its handles under its request (no bare NIXL send), replica factor 2, each rank's bytes by the formula at two
    prompt lengths, compute spans, one trace per request with the client's context."""
    run = shapes.traced
    for request in shapes.requests("mla_to_tp2"):
        sends, receives = _check_shape(shapes, request["room"], len(request["input_ids"]), "mla-prefill",
                                       "mla-decode-tp2")
        (top,) = [s for s in run.named(REQUEST, "mla-prefill")
                  if s.attributes["kv_transfer.bootstrap_room"] == request["room"]]
        attrs = top.attributes
        assert not top.is_error and attrs["kv_transfer.request_key"] == str(request["room"])
        assert attrs["kv_transfer.replica_factor"] == 2 and attrs["kv_transfer.bytes"] == 2 * attrs[
            "kv_transfer.logical_bytes"]
        assert attrs["kv_transfer.transfer_count"] == len(sends)
        for _, send in sends:
            a = send.attributes
            assert a["kv_transfer.op"] == "write" and a["kv_transfer.descriptor_count"] > 0
            assert top.start_time_unix_nano <= send.start_time_unix_nano <= send.end_time_unix_nano \
                <= top.end_time_unix_nano
        for rank in (0, 1):
            kv = [s.attributes for _, s in sends if s.attributes["kv_transfer.peer_rank"] == rank
                  and s.attributes["kv_transfer.payload"] == "kv"]
            assert [a["kv_transfer.is_last_chunk"] for a in kv].count(True) == 1
        assert run.children(top, COMPUTE) and 0.0 <= attrs["kv_transfer.compute_overlap_ratio"] <= 1.0
        assert {s.trace_id for _, s in sends + receives} == {request["traceparent"][3:35]}


def test_mla_over_nixl_makes_no_bare_sends_and_no_orphan_traces(shapes):
    """Every NIXL handle sglang posted belongs to a request, and its warm-up requests (room 0) leave no span."""
    run = shapes.traced
    tops = {(s.trace_id, s.span_id) for s in run.named(REQUEST, "mla-prefill")}
    assert len(tops) == len(shapes.requests("mla_to_tp2"))
    for send in run.named(SEND, "mla-prefill") + run.named(COMPUTE, "mla-prefill"):
        assert (send.trace_id, send.parent_span_id) in tops, send.attributes
    ours = [s for name, s in run.spans if name.startswith("mla-") and s.name.startswith("kv_transfer.")]
    assert not [s for s in ours if s.attributes.get("kv_transfer.request_key") == "0"]


def test_mla_over_nixl_a_repeated_prompt_sends_its_cached_prefix_early(shapes):
    first, _, repeat = shapes.requests("mla_to_tp2")
    assert first["input_ids"] == repeat["input_ids"]
    for request, early in ((first, False), (repeat, True)):
        kv = sorted((s.attributes for _, s in _sends_of(shapes.traced, request["room"])
                     if s.attributes["kv_transfer.payload"] == "kv" and s.attributes["kv_transfer.peer_rank"] == 0),
                    key=lambda a: a["kv_transfer.chunk_index"])
        if early:  # chunk 0 is the cached prefix, sent early; the rest follows
            assert kv[0]["kv_transfer.chunk_index"] == 0 and kv[0]["kv_transfer.prefix_early_send"] is True, kv
            assert len({a["kv_transfer.chunk_index"] for a in kv}) >= 2
        else:
            assert not any(a["kv_transfer.prefix_early_send"] for a in kv), kv


def test_prefill_tp2_behind_a_router_reaches_both_decodes_and_each_request_names_its_own(shapes):
    """Round robin over two decodes (TP1 and TP2): one request each. Each request's sends go to the server that
    got it (its receives are in that server's span file; its KV sends to that server's ranks' ports), each
    prefill rank has its own request span, and with no client trace context each side's ranks share one trace."""
    requests, results = shapes.by_shape["tp2_to_two_decodes"]
    assert [r["tokens"] for r in results] == [r["max_new_tokens"] for r in requests]
    got = {}
    for request in requests:
        room = _room_of(shapes.traced, request["rid"])
        (decode,) = {name for name, _ in _receives_of(shapes.traced, room)}
        got[request["rid"]] = decode
        sends, receives = _check_shape(shapes, room, len(request["input_ids"]), "prefill-tp2", decode)
        tops = [s for s in shapes.traced.named(REQUEST, "prefill-tp2")
                if s.attributes["kv_transfer.bootstrap_room"] == room]
        assert len({s.trace_id for s in tops}) == 1 and len({s.trace_id for _, s in receives}) == 1
    assert sorted(got.values()) == ["decode", "decode-tp2"], got


def test_every_tp2_rank_says_it_is_on_with_its_rank(shapes):
    """One start-up line per scheduler with a KV manager, naming its role and rank, in its server's log."""
    for name, server in shapes.traced.deployment.servers.items():
        said = sorted(next(part for part in line.split("; ") if part.startswith("role "))
                      for line in _startup_lines(shapes.traced.deployment, name) if "; role " in line)
        assert said == [f"role {server.role}, kv_transfer.tp_rank {rank} (sglang)" for rank in range(server.tp)], \
            (name, said)


def test_sglang_counts_the_same_kv_bytes_as_the_sends_in_every_shape(shapes):
    """sglang's own figure beside ours: its kv_transfer_total_mb (per concluded request and sending rank: KV pages x
    item lengths x its replica factor, in MiB, aux left out) sums to the KV bytes of our sends on that server, and
    it counted one transfer per request span we made (the hostile-rid test below runs later, outside the
    snapshot)."""
    run = shapes.traced
    for name, (total_mb, count) in shapes.sglang_metrics.items():
        kv = sum(s.attributes["kv_transfer.bytes"] for n, s in run.spans if n == name and s.name == SEND
                 and s.attributes["kv_transfer.payload"] == "kv")
        requests = [s for s in run.named(REQUEST, name) if not s.is_error]
        assert kv > 0 and total_mb * 2 ** 20 == pytest.approx(kv, rel=1e-9), (name, total_mb, kv)
        assert count == len(requests), (name, count, len(requests))


# --- sglang's own tracing on: our spans under sglang's request spans; aux over TCP --------------------------


def test_with_sglang_tracing_our_spans_are_children_of_sglang_request_spans(traced_run):
    for request in traced_run.requests:
        span = traced_run.request_of(request["rid"])
        parents = [s for _, s in traced_run.spans if s.span_id == span.parent_span_id
                   and s.trace_id == span.trace_id]
        assert len(parents) == 1, "the request span's parent is not in the trace"
        parent = parents[0]
        assert not parent.name.startswith("kv_transfer."), parent.name
        assert parent.attributes.get("rid") == request["rid"], parent.attributes
        room = span.attributes["kv_transfer.bootstrap_room"]
        assert parent.attributes.get("bootstrap_room") == hex(room)
        receive = traced_run.receive_of(room)
        decode_parent = [s for _, s in traced_run.spans if s.span_id == receive.parent_span_id]
        assert len(decode_parent) == 1 and not decode_parent[0].name.startswith("kv_transfer.")
        # the trace shows both: sglang's spans and ours
        names = {s.name for _, s in traced_run.spans if s.trace_id == span.trace_id}
        assert {REQUEST, SEND, COMPUTE} <= names and any(not n.startswith("kv_transfer.") for n in names)
        if request.get("traceparent"):  # the client's trace holds prefill and decode, sglang's spans and ours
            assert span.trace_id == receive.trace_id == TRACEPARENT_TRACE_ID
        else:  # no caller context: sglang roots each side's request span in a trace of its own
            assert span.trace_id != receive.trace_id


def test_aux_over_tcp_gives_an_aux_send_with_its_bytes(traced_run):
    from sglang_serving import deployment as dep

    config = dep.model_config()
    for request in traced_run.requests:
        span = traced_run.request_of(request["rid"])
        assert not span.is_error
        sends = traced_run.children(span, SEND)
        aux = [s for s in sends if s.attributes["kv_transfer.payload"] == "aux"]
        kv = [s for s in sends if s.attributes["kv_transfer.payload"] == "kv"]
        assert len(aux) >= 1 and not any(s.is_error for s in sends)
        assert all(a.attributes["kv_transfer.protocol" if "kv_transfer.protocol" in a.attributes
                                else "network.transport"] == "tcp" for a in aux)
        assert sum(s.attributes["kv_transfer.bytes"] for s in kv) == dep.expected_kv_bytes(
            len(request["input_ids"]), config)
        assert sum(a.attributes["kv_transfer.bytes"] for a in aux) > 0
        assert span.attributes["kv_transfer.bytes"] == sum(s.attributes["kv_transfer.bytes"] for s in sends)


def test_with_a_builder_process_every_kv_span_is_built_outside_the_engine(traced_run):
    """OTEL_KVTRANSFER_BUILDER=process on real servers: each sglang process that transfers KV started one helper;
    every kv_transfer span was built by a helper of the same server (it has that server's environment), none by
    an sglang process, and sglang's own spans by sglang's processes (the test above checks that ours still sit
    under them). A helper is not in its server's process tree: a starter forks it and ends, so a supervisor that
    kills the server's tree leaves it to export what it holds."""
    import psutil

    def helpers_of(service):
        found = set()
        for proc in psutil.process_iter(["cmdline"]):
            try:
                if "otel_kvtransfer.offloading.helper_process" in " ".join(proc.info["cmdline"] or ()) \
                        and proc.environ().get("OTEL_SERVICE_NAME") == service:
                    found.add(proc.pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return found

    for name in traced_run.deployment.servers:
        tree = set(traced_run.deployment.server_pids(name))
        helpers = helpers_of(f"sglang-{name}")
        assert helpers, f"no builder process of the {name} server"
        assert not helpers & tree  # out of the server's tree
        ours = [s for r, s in traced_run.spans if r == name and s.name.startswith("kv_transfer.")]
        sglang_own = [s for r, s in traced_run.spans if r == name and not s.name.startswith("kv_transfer.")]
        assert ours and sglang_own
        assert {s.resource["process.pid"] for s in ours} <= helpers
        assert {s.resource["process.pid"] for s in sglang_own} <= tree


# --- ranks and the start-up line, on the real servers ----------------------------------------------------------


def _startup_lines(deployment, name):
    with open(deployment.log_path(name), encoding="utf-8", errors="replace") as handle:
        return [line.rstrip("\n") for line in handle if "otel_kvtransfer: on (" in line]


def test_each_servers_log_says_the_instrumentation_is_on_with_its_role_and_rank(traced_run):
    """sglang's scheduler prints the start-up line through sglang's own root logging config when its KV manager
    is built (the pair is TP1: one scheduler per server, rank 0); the other processes say they have no role,
    later."""
    for role in ("prefill", "decode"):
        lines = _startup_lines(traced_run.deployment, role)
        with_role = [line for line in lines if "; role " in line]
        assert len(with_role) == 1, lines
        (line,) = with_role
        assert line.startswith("[")  # sglang's own log format: "[time prefix] message"
        assert f"; role {role}, kv_transfer.tp_rank 0 (sglang); " in line
        assert "patched: sglang 0.5.23" in line and "engines: mooncake " in line
        assert "; builder: process; " in line  # OTEL_KVTRANSFER_BUILDER=process in this deployment
        assert "; spans: kvtransfer_file (" in line and "; metrics: none (" in line


def test_no_send_of_these_requests_completes_after_its_request_ended(shapes):
    """Every request here ends once its KV has left: no server's log reports a late completion (the WARNING a
    send completing after its request's end writes; tests/engines/test_nixl_late_completion.py makes one)."""
    assert shapes.traced.spans and all(shapes.requests(shape) for shape in shapes.by_shape)  # all were served
    for name in shapes.deployment.servers:
        with open(shapes.deployment.log_path(name), encoding="utf-8", errors="replace") as handle:
            late = [line for line in handle if "kv_transfer.late_completion" in line]
        assert late == [], (name, late[:3])


def test_the_first_mooncake_send_of_each_process_to_each_peer_and_only_it_says_it_set_the_peer_up(shapes):
    """Mooncake opens a peer's segment inside its first transfer to it: per engine process (here each has a
    builder process of its own, whose pid its spans carry) and peer, the earliest send is marked
    `first_to_peer`, no other."""
    by_peer = {}
    for name, span in shapes.traced.spans:
        if span.name == SEND and span.attributes.get("kv_transfer.backend") == "mooncake":
            peer = (name, span.resource.get("process.pid"), span.attributes.get("server.address"),
                    span.attributes.get("server.port"))
            by_peer.setdefault(peer, []).append(span)
    assert len({peer[:2] for peer in by_peer}) == 3  # prefill and both prefill-tp2 ranks (decodes send nothing)
    for peer, sends in by_peer.items():
        marked = [s for s in sends if s.attributes.get("kv_transfer.first_to_peer") is True]
        assert marked == [min(sends, key=lambda s: s.start_time_unix_nano)], (peer, len(sends), len(marked))


def test_every_span_kind_carries_the_rank_and_every_send_its_peers(traced_run):
    """On the pair (TP1 to TP1): rank 0 everywhere, one destination; the other shapes' ranks are checked above."""
    kinds = {}
    rooms = {traced_run.request_of(r["rid"]).attributes["kv_transfer.bootstrap_room"] for r in traced_run.requests}
    for name, span in traced_run.spans:
        if span.attributes.get("kv_transfer.bootstrap_room") in rooms:
            kinds.setdefault(span.name, []).append(span)
            assert span.attributes.get("kv_transfer.tp_rank") == 0, (name, span.name, dict(span.attributes))
            assert "kv_transfer.dp_rank" not in span.attributes  # no data-parallel attention here
    assert {REQUEST, SEND, RECEIVE} <= set(kinds), sorted(kinds)
    computes = [s for _, s in traced_run.spans if s.name == COMPUTE and s.attributes.get("kv_transfer.request_key")
                in {str(room) for room in rooms}]
    assert computes and all(s.attributes.get("kv_transfer.tp_rank") == 0 for s in computes)
    for send in kinds[SEND]:
        assert send.attributes["kv_transfer.peer_rank"] == 0
        assert send.attributes["kv_transfer.destination_index"] == 0


# --- a client's hostile rid, on the same deployment --------------------------------------------------------------

HOSTILE_RID = "\ud800"  # what the JSON escape "\ud800" in a client's body decodes to: a lone surrogate


def test_a_hostile_rid_leaves_every_other_requests_spans_whole(traced_run):
    """A client controls `rid` (the package puts it on the request span as `sglang.rid`). One request with a lone
    surrogate for its rid, sent at the same moment as two normal ones straight to both servers as the router sends
    them (tests/support/pd_direct_client.py: a client that reaches the servers sends any rid). sglang 0.5.23 parses
    a body with orjson, which refuses a lone surrogate: both servers answer 400 before a request exists, so nothing
    of it may be made; a release that admits it must show the rid repaired (U+FFFD). Either way the other
    requests' spans arrive whole. (The repair itself, and the whole OTLP batches it saves, are shown through the
    real OTLP/HTTP and gRPC exporters in test_encoder_validity.py.)"""
    from sglang_serving import deployment as dep

    requests = dep.prompts(3, 120, 4, repeat_every=0, seed=21, rid_prefix="calm")
    for n, request in enumerate(requests):
        request["room"] = 7_000_000 + n
    hostile = requests[1]
    hostile["rid"] = HOSTILE_RID
    answers = {a["room"]: a for a in traced_run.deployment.generate_on("prefill", "decode", requests)}
    for request in requests:
        if request is not hostile:
            assert answers[request["room"]]["prefill"] == 200 and answers[request["room"]]["decode"] == 200, answers
    admitted = answers[hostile["room"]]["prefill"] == 200
    if not admitted:
        assert all(str(answers[hostile["room"]][role]).startswith("400") for role in ("prefill", "decode")), answers
    expected = [r for r in requests if r is not hostile or admitted]
    wanted_rids = {"\ufffd" if r is hostile else r["rid"] for r in expected}

    def arrived():
        spans = sglang_runs.Run(traced_run.deployment, [], []).read_spans()
        rids = {s.attributes.get("sglang.rid") for _, s in spans if s.name == REQUEST}
        rooms = {s.attributes.get("kv_transfer.bootstrap_room") for _, s in spans if s.name == RECEIVE}
        return spans if wanted_rids <= rids and {r["room"] for r in expected} <= rooms else None

    spans = wait_until(arrived, 120, "the normal requests' request and receive spans in the span files",
                       interval_s=1.0)  # the exporters write every 0.5 s
    for request in expected:
        rid = "\ufffd" if request is hostile else request["rid"]
        (top,) = [s for _, s in spans if s.name == REQUEST and s.attributes.get("sglang.rid") == rid]
        sends = [s for _, s in spans if s.name == SEND and s.parent_span_id == top.span_id]
        assert sends and all(s.attributes["kv_transfer.bootstrap_room"] == request["room"] for s in sends)
    if not admitted:  # nothing half-made of a request that never existed
        assert not [s for _, s in spans if s.attributes.get("kv_transfer.bootstrap_room") == hostile["room"]]

