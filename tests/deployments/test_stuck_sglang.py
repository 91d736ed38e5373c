"""Stuck while it is stuck, on the real SGLang PD deployment: the decode server's scheduler is frozen (SIGSTOP)
while a long prompt's KV is on its way, and the prefill server reports its request and its send stuck while the
decode stays frozen; once the decode goes on (SIGCONT) the request completes and its request span carries the
reports as `kv_transfer.stuck` events. Then, on the same deployment, a request aborted while its KV is on its way:
a second long prompt, the decode frozen again once its send hangs, the request aborted at the prefill through
sglang's `/abort_request` (what a client that gives up triggers there), the decode let go on: the send still
completes, after its request ended, and says so (the `kv_transfer.late_completion` event on it, the
`kv_transfer.late_completions` counter, one WARNING line), while the first request, which waited on the same
frozen decode without an abort, reports nothing late.

Real parts: prefill + decode servers under `opentelemetry-instrument`, sglang-router, a real streaming /generate
request, Mooncake over TCP, all in one private network namespace (tests/sglang_serving/deployment.py and its
stand-ins: an import-only `sgl_kernel` and a test-only sglang plugin, for what cannot run on this CPU machine).
The prefill server runs with OTEL_KVTRANSFER_STUCK_S=2 and the console metric exporter every 500 ms (its output
goes to the prefill log, as the WARNING lines do). The model is the serving tests' tiny Llama with more layers and
KV heads (20 KiB of KV per token), so the 4000-token prompt's 78 MiB of KV is far more than the loopback
sockets buffer (the prefill's engine call cannot finish while the decode is frozen), and its prefill computes
for seconds (the window in which the test freezes the decode: once the decode awaits the KV, before the
prefill's send starts).

A deployment of its own (no Phoenix, no Prometheus): freezing the session-wide one would stall the other
serving tests' requests. Here it costs one server start (1-3 minutes) and under a minute for the request: 3.5-4.5
minutes in all on a shared 2-core machine, and under a minute more for the aborted request.
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from support import sglang_runs
from support.console import console_json_objects, console_points
from support.waiting import wait_until

HERE = os.path.dirname(os.path.abspath(__file__))
STUCK_S = 2
TOKENS = 4000
FROZEN_MAX_S = 90  # bounded: the stuck lines come within STUCK_S + the 1 s scan once the send hangs
# Inside the namespace: freezes the decode the moment it awaits a prompt's KV (decode_freezer.py says how it knows).
FREEZER = os.path.join(os.path.dirname(HERE), "sglang_serving", "decode_freezer.py")
RID = "kvt-stuck-0"


def _model(dest: str) -> str:
    """The serving tests' tiny Llama with 20 layers and 4 KV heads: 20 x 2 x 4 x 64 x 2 B = 20 KiB per token."""
    from sglang_serving import deployment as dep

    config = dict(dep.model_config(), num_hidden_layers=20, num_key_value_heads=4)
    os.makedirs(dest, exist_ok=True)
    with open(os.path.join(dest, "config.json"), "w", encoding="utf-8") as handle:
        json.dump(config, handle)
    return dest


def _read(path: str) -> str:
    with open(path, "rb") as handle:
        return handle.read().decode("utf-8", "replace")


class _Tail:
    """A growing log read from where the last read stopped (the console exporter makes it megabytes)."""

    def __init__(self, path: str):
        self.path, self.offset, self.seen = path, 0, ""

    def read(self) -> str:
        """The whole lines added since the last call."""
        with open(self.path, "rb") as handle:
            handle.seek(self.offset)
            data = handle.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        return data[:end].decode("utf-8", "replace")


def _scheduler_pids(deployment) -> list:
    """The decode server's scheduler process(es): the one that holds the KV manager and the Mooncake engine."""
    import psutil

    found = []
    for pid in deployment.server_pids("decode"):
        try:
            proc = psutil.Process(pid)
            if "scheduler" in (proc.name() + " " + " ".join(proc.cmdline())):
                found.append(pid)
        except psutil.Error:
            continue
    return found


def _freeze_when_awaiting_kv(deployment, pids, start_request, timeout_s=300) -> dict:
    """Start the request (`start_request()`) and freeze `pids`, the decode's scheduler, once the decode holds the
    prompt's KV slots and has told the prefill where to write them (decode_freezer.py). Earlier, a frozen decode
    never tells it (the prefill never schedules the prompt, and no send starts); later, the prefill's send may be
    over already (sglang logs the prompt's batch after it queued the send, and 78 MiB crosses the loopback in tens
    of ms). From that moment the prefill computes the prompt for seconds, and only then sends: its send always
    hangs."""
    argv = deployment.nsenter + [sys.executable, FREEZER, deployment.servers["decode"].url, str(TOKENS // 2),
                                 str(timeout_s), *(str(pid) for pid in pids)]
    freezer = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        watching = freezer.stdout.readline()  # it read the decode's load once: the request may go
        assert watching.strip() == "watching", f"the decode freezer did not start: {watching!r}"
        start_request()
        out, _ = freezer.communicate(timeout=timeout_s + 60)
    finally:
        if freezer.poll() is None:
            freezer.kill()
            freezer.wait()
    result = json.loads(out.strip().splitlines()[-1])
    assert result["frozen"], f"the decode never awaited the prompt's KV: {result}"
    return result


def _signal_all(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def _prefill_spans(path: str) -> list:
    spans = []
    if os.path.exists(path):
        for line in _read(path).splitlines():
            try:
                for rs in json.loads(line)["resourceSpans"]:
                    for ss in rs["scopeSpans"]:
                        spans.extend(ss["spans"])
            except (ValueError, KeyError):
                continue  # a line still being written
    return spans


def _attributes(item) -> dict:
    return {a["key"]: next(iter(a["value"].values())) for a in item.get("attributes", [])}


def _request_span(path: str, rid: str = RID):
    found = [s for s in _prefill_spans(path) if s["name"] == "kv_transfer.request"
             and _attributes(s).get("sglang.rid") == rid]
    return found[0] if len(found) == 1 else None


@pytest.fixture(scope="module")
def frozen_run(tmp_path_factory):
    sglang_runs.require_parts("mooncake", "psutil")
    from sglang_serving import deployment as dep

    workdir = str(tmp_path_factory.mktemp("sglang-stuck"))
    deployment = dep.Deployment(
        workdir, model_dir=_model(os.path.join(workdir, "model")),
        server_flags=["--max-total-tokens", "8192", "--sleep-on-idle"],  # an idle scheduler busy-polls a core
        prefill_env={"OTEL_KVTRANSFER_STUCK_S": str(STUCK_S), "OTEL_METRICS_EXPORTER": "console",
                     "OTEL_METRIC_EXPORT_INTERVAL": "500"})
    frozen, run = [], {"started": time.monotonic()}
    try:
        deployment.start()
        run["up_s"] = time.monotonic() - run["started"]
        run["kv_bytes"] = dep.expected_kv_bytes(TOKENS, dep.model_config(deployment.model_dir))
        log = deployment.log_path("prefill")
        tail = _Tail(log)
        tail.read()  # what the warm-up printed
        (request,) = dep.prompts(1, TOKENS, 4, repeat_every=0, rid_prefix="kvt-stuck")
        answer = {}

        def generate():
            try:
                answer["results"] = deployment.generate([request])
            except Exception as exc:  # asserted on below
                answer["error"] = repr(exc)[:2000]

        client = threading.Thread(target=generate, daemon=True)
        seen = {"text": "", "send": False, "request": False}

        def read():
            new = tail.read()
            seen["text"] = (seen["text"] + new)[-400_000:]
            for kind in ("send", "request"):
                seen[kind] = seen[kind] or f"otel_kvtransfer: a {kind} open for" in new

        frozen = wait_until(lambda: _scheduler_pids(deployment), 60, "the decode's scheduler process")
        _freeze_when_awaiting_kv(deployment, frozen, client.start)
        frozen_at = time.monotonic()
        read()  # up to the freeze (and the few ms since: no send can have started in them)
        run["frozen_at_offset"] = tail.offset  # the log from here on was written while the decode was frozen
        run["send_reported_before_freeze"] = seen["send"]

        def reported():
            read()
            return seen["send"] and seen["request"]

        try:
            wait_until(reported, FROZEN_MAX_S, "the prefill's stuck lines")
        except AssertionError as exc:
            if _request_span(deployment.span_file("prefill")) is not None:  # the prompt was computed faster
                raise AssertionError(f"{exc}: the prefill's request had ended, its KV sent before the decode was "
                                     "frozen") from exc
            raise
        since = {"text": ""}

        def exported():  # a metric export after the lines, still frozen: both counters and the send's age
            since["text"] += tail.read()
            objects = console_json_objects(since["text"])
            kinds = {a.get("kv_transfer.inflight.kind") for a, _ in console_points(objects, "kv_transfer.stuck")}
            ages = [v for a, v in console_points(objects, "kv_transfer.inflight.oldest_age")
                    if a.get("kv_transfer.inflight.kind") == "send"]
            return {"send", "request"} <= kinds and bool(ages) and max(ages) >= STUCK_S

        wait_until(exported, FROZEN_MAX_S, "a metric export showing the stuck counters")
        tail.read()
        with open(log, "rb") as handle:
            whole = handle.read(tail.offset)
        run["log_while_frozen"] = whole.decode("utf-8", "replace")
        run["log_since_freeze"] = whole[run["frozen_at_offset"]:].decode("utf-8", "replace")
        run["frozen_s"] = time.monotonic() - frozen_at
        run["answered_while_frozen"] = "results" in answer or "error" in answer
        _signal_all(frozen, signal.SIGCONT)
        frozen = []
        client.join(600)
        run["answer"] = answer
        run["request"] = wait_until(lambda: _request_span(deployment.span_file("prefill")), 60,
                                    "the request span in the prefill's span file")
        run["log"] = _read(log)
        run["total_s"] = time.monotonic() - run["started"]
        run["deployment"] = deployment
        yield run
    finally:
        _signal_all(frozen, signal.SIGCONT)  # a frozen process would never see the SIGTERM that stops it
        deployment.stop()


@pytest.fixture(scope="module")
def aborted_run(frozen_run):
    """The same deployment, a second long prompt: the decode frozen while its KV is on its way, the request
    aborted at the prefill (sglang's /abort_request, as a client that gives up triggers it) while its send hangs,
    then the decode let go on, so the send completes after its request ended."""
    from sglang_serving import deployment as dep

    deployment = frozen_run["deployment"]
    log = deployment.log_path("prefill")
    tail = _Tail(log)
    tail.read()  # the first request's part of the log
    run = {"log_before": _read(log)[:tail.offset]}
    # Another prompt than the first request's: a cached prefix would make its prefill too quick to freeze in.
    (request,) = dep.prompts(1, TOKENS, 4, repeat_every=0, seed=8, rid_prefix="kvt-late")
    answer, frozen = {}, []

    def generate():
        try:
            answer["results"] = deployment.generate([request])
        except Exception as exc:  # the abort answers the client with an error: expected
            answer["error"] = repr(exc)[:2000]

    client = threading.Thread(target=generate, daemon=True)
    seen = {"text": ""}

    def read():
        seen["text"] = (seen["text"] + tail.read())[-400_000:]
        return seen["text"]

    def send_stuck():
        return re.search(r"otel_kvtransfer: a send open for \d+ s is stuck: request key (\S+),", read())

    try:
        frozen = wait_until(lambda: _scheduler_pids(deployment), 60, "the decode's scheduler process")
        _freeze_when_awaiting_kv(deployment, frozen, client.start)
        read()
        seen["text"] = ""  # a send reported from here on hangs on the frozen decode
        run["room"] = wait_until(send_stuck, FROZEN_MAX_S, "the second request's send to hang").group(1)
        prefill, decode = deployment.servers["prefill"], deployment.servers["decode"]
        abort = json.dumps({"rid": request["rid"]})
        run["abort_status"] = deployment.client("post", f"{prefill.url}/abort_request", abort)["status"]
        run["request"] = wait_until(lambda: _request_span(deployment.span_file("prefill"), request["rid"]), 60,
                                    "the aborted request's span in the prefill's span file")
        run["send_open_at_abort"] = not _room_sends(deployment.span_file("prefill"), run["room"])
        _signal_all(frozen, signal.SIGCONT)
        frozen = []
        run["sends"] = wait_until(lambda: _room_sends(deployment.span_file("prefill"), run["room"], KV_PAYLOAD), 120,
                                  "the aborted request's KV send to complete")
        # The decode learns of the abort from the prefill, or not: abort it there too, so the client's request
        # ends whatever the decode made of it.
        deployment.client("post", f"{decode.url}/abort_request", abort)
        client.join(120)
        run["client_ended"] = not client.is_alive()
        run["log"] = ""

        def reported():  # the late send's WARNING line and a metric export that counts it
            run["log"] = _read(log)[len(run["log_before"]):]
            return _late_lines(run["log"], run["room"]) and console_points(
                console_json_objects(run["log"]), "kv_transfer.late_completions")

        wait_until(reported, 60, "the late send's WARNING line and its count")
        run["kv_bytes"], run["span_file"] = frozen_run["kv_bytes"], deployment.span_file("prefill")
        yield run
    finally:
        _signal_all(frozen, signal.SIGCONT)


KV_PAYLOAD = "kv"


def _room_sends(path: str, room: str, payload: str = None) -> list:
    return [s for s in _prefill_spans(path) if s["name"] == "kv_transfer.send"
            and str(_attributes(s).get("kv_transfer.request_key")) == room
            and (payload is None or _attributes(s).get("kv_transfer.payload") == payload)]


def _late_lines(text: str, room: str) -> str:
    """The late-completion lines of one request: `a mooncake send of request <room> to <peer> completed ...`."""
    pattern = re.compile(rf"send of request {re.escape(room)}( to \S+)? completed ")
    return "\n".join(line for line in text.splitlines()
                     if pattern.search(line) and "kv_transfer.late_completion" in line)


def _stuck_lines(text: str, kind: str, room: str) -> list:
    """The stuck lines of one request (a health-check request slowed by the shared CPU may be reported too)."""
    return [line for line in text.splitlines() if re.search(rf"otel_kvtransfer: a {kind} open for \d+ s is stuck: "
                                                            rf"request key {room},", line)]


def test_the_prefill_reports_its_request_and_send_stuck_while_the_decode_is_frozen(frozen_run):
    assert not frozen_run["answered_while_frozen"]  # the request really waited on the frozen decode
    room = str(_attributes(frozen_run["request"])["kv_transfer.request_key"])
    text = frozen_run["log_while_frozen"]
    # The request is open longer than STUCK_S whatever the decode does (the prefill computes for seconds here);
    # its send hangs only because the decode is frozen, so its line comes after the freeze.
    assert len(_stuck_lines(text, "request", room)) == 1
    assert not frozen_run["send_reported_before_freeze"]
    (send_line,) = _stuck_lines(frozen_run["log_since_freeze"], "send", room)
    # The send names the decode's Mooncake session on 127.0.0.1 and its bytes: the prompt's whole KV.
    assert "peer 127.0.0.1:" in send_line
    assert int(re.search(r"bytes (\d+)", send_line).group(1)) == frozen_run["kv_bytes"]
    stuck = {a["kv_transfer.inflight.kind"]: (a, v) for a, v in
             console_points(console_json_objects(text), "kv_transfer.stuck")}
    for kind in ("request", "send"):
        labels, value = stuck[kind]
        assert value == 1
        assert labels["kv_transfer.backend"] == "mooncake" and labels["kv_transfer.role"] == "prefill"
    inflight = [v for a, v in console_points(console_json_objects(text), "kv_transfer.inflight.oldest_age")
                if a["kv_transfer.inflight.kind"] == "send"]
    assert max(inflight) >= STUCK_S


def test_once_the_decode_goes_on_the_request_completes_and_its_span_carries_the_reports(frozen_run):
    answer = frozen_run["answer"]
    assert "error" not in answer, answer.get("error")
    (result,) = answer["results"]
    assert result["rid"] == RID and result["tokens"] == 4
    request = frozen_run["request"]
    assert request.get("status", {}).get("code") in (None, 0, 1, "STATUS_CODE_UNSET", "STATUS_CODE_OK")
    events = [_attributes(e) for e in request.get("events", []) if e["name"] == "kv_transfer.stuck"]
    assert sorted(e["kv_transfer.inflight.kind"] for e in events) == ["request", "send"]
    (send_event,) = [e for e in events if e["kv_transfer.inflight.kind"] == "send"]
    assert str(send_event["server.address"]).startswith("127.0.0.1:") and send_event["kv_transfer.stuck.age_s"] >= 1
    # Reported once: no second line after the decode went on.
    room = str(_attributes(request)["kv_transfer.request_key"])
    assert len(_stuck_lines(frozen_run["log"], "send", room)) == len(_stuck_lines(frozen_run["log"], "request",
                                                                                  room)) == 1


def _late_events(span) -> list:
    return [_attributes(e) for e in span.get("events", []) if e["name"] == "kv_transfer.late_completion"]


def test_a_send_that_completes_after_its_request_was_aborted_says_how_late_it_was(aborted_run):
    assert aborted_run["abort_status"] == 200
    request = aborted_run["request"]
    assert request["status"].get("code") in (2, "STATUS_CODE_ERROR")
    assert _attributes(request)["error.type"] == "aborted"
    assert aborted_run["send_open_at_abort"]  # the request ended while its send still hung on the frozen decode
    (send,) = aborted_run["sends"]
    attributes = _attributes(send)
    # Its bytes still landed: the whole prompt's KV, sent OK, under the ended request's span.
    assert int(attributes["kv_transfer.bytes"]) == aborted_run["kv_bytes"]
    assert send["status"].get("code") in (None, 0, 1, "STATUS_CODE_UNSET", "STATUS_CODE_OK")
    assert send["traceId"] == request["traceId"] and send["parentSpanId"] == request["spanId"]
    (event,) = _late_events(send)
    late_s = (int(send["endTimeUnixNano"]) - int(request["endTimeUnixNano"])) / 1e9
    assert late_s > 0 and abs(event["kv_transfer.after_request_end_s"] - late_s) < 1e-6


def test_the_late_send_logs_one_warning_and_counts_once_and_only_after_the_abort(aborted_run, frozen_run):
    room = aborted_run["room"]
    print(_late_lines(aborted_run["log"], room))  # the line an operator reads, kept in the test's output
    (line,) = _late_lines(aborted_run["log"], room).splitlines()
    assert f"send of request {room} to 127.0.0.1:" in line  # the peer it went to: the decode's session
    assert "kv_transfer.late_completion" not in frozen_run["log"]
    # The KV send counts once, with its labels (a later aux send of the room may be late too, counted apart).
    late = [(a, v) for a, v in console_points(console_json_objects(aborted_run["log"]), "kv_transfer.late_completions")
            if a.get("kv_transfer.payload") == "kv"]
    assert late and max(v for _, v in late) == 1
    labels = late[-1][0]
    assert (labels["kv_transfer.backend"], labels["kv_transfer.framework"],
            labels["kv_transfer.role"]) == ("mooncake", "sglang", "prefill")
    # The first request waited on the same frozen decode but ended after its sends: nothing late, no point.
    assert not console_points(console_json_objects(aborted_run["log_before"]), "kv_transfer.late_completions")
    assert not any(_late_events(s) for s in _prefill_spans(aborted_run["span_file"])
                   if str(_attributes(s).get("kv_transfer.request_key")) != room)
    assert aborted_run["client_ended"]
