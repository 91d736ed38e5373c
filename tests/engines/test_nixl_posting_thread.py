"""NIXL handles made inside a transfer scope and posted from another thread still belong to their request.

Open vLLM work moves NIXL posting off the thread that prepares the reads: to a reader thread that submits the
READs the model thread prepared, or to a background receiver that also polls them. Attribution must not depend on
the post happening inside the scoped call: the NIXL engine module keeps the scope current where a handle is made
(`make_prepped_xfer` / `initialize_xfer`) and uses it when the handle is posted on a thread outside any scope.

Real parts: two NIXL agents over UCX (TCP on the loopback device), the receiver in a process of its own
(otel_kvtransfer.demo.nixl_loopback); the threads are plain Python threads doing what those vLLM threads do with
the handles (post, poll, release). The scenarios run in ONE child process (this file run as a script) that writes
what it saw and leaves with os._exit (tests/support/nixl_agents.py says why).
"""

import os
import queue
import sys
import threading

import pytest
from support import nixl_agents
from support.nixl_agents import Initiator, result_of, spans_named

BLOCK = 1 << 20
BLOCKS = 64
SIZE = BLOCK * BLOCKS  # all of it, written to a frozen peer over TCP, cannot finish inside transfer()
SCENARIOS = {}


def scenario(function):
    SCENARIOS[function.__name__] = function
    return function


# --- the child process -----------------------------------------------------------------------------------------




class PostingThread:
    """A thread that owns posting (and, if asked, polling and releasing) of the handles handed to it, as vLLM's
    reader thread or background receiver does. `post(handle)` returns the state transfer() answered there."""

    def __init__(self, init):
        self.init = init
        self.jobs = queue.Queue()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while True:
            job = self.jobs.get()
            if job is None:
                return
            work, done = job
            try:
                done.put(work())
            except Exception as error:  # the test fails on it, with its name
                done.put(f"raised {type(error).__name__}: {error}")

    def run(self, work):
        done = queue.Queue()
        self.jobs.put((work, done))
        return done.get(timeout=120)

    def post(self, handle):
        return self.run(lambda: self.init.agent.transfer(handle))

    def post_poll_release(self, handle):
        def work():
            state = self.init.wait(handle)
            self.init.agent.release_xfer_handle(handle)
            return state

        return self.run(work)

    def stop(self):
        self.jobs.put(None)
        self.thread.join(30)


def _seen(tel) -> dict:
    spans = [{"name": s.name, "span_id": s.context.span_id, "parent": s.parent.span_id if s.parent else None,
              "trace_id": s.context.trace_id, "attributes": dict(s.attributes), "ok": s.status.is_ok}
             for s in tel.spans()]
    metrics = {name: [{"attributes": dict(p.attributes), "value": getattr(p, "value", None),
                       "count": getattr(p, "count", None)} for p in points]
               for name, points in tel.metrics().items()}
    return {"spans": spans, "metrics": metrics}


def _telemetry():
    from support.telemetry import Telemetry

    return Telemetry().instrument()


@scenario
def posted_elsewhere(receiver):
    """Three requests, each handle made in its request's scope on this (the "model") thread:
    - p-read: a READ of 3 blocks, posted by the reader thread, polled to its end here;
    - p-frozen: a WRITE of every block to the frozen peer, posted by the reader thread (still in flight when
      transfer() returns there: the pending path), polled to its end here once the peer runs again;
    - p-owned: a prepared READ of 5 blocks that the background thread posts, polls and releases itself."""
    from otel_kvtransfer import integration as kvt

    tel = _telemetry()
    poster = None
    try:
        init = Initiator(receiver, SIZE, BLOCK)
        assert init.write_all() == "DONE"  # connected before anything is measured
        receiver.fill(5)
        for key in ("p-read", "p-frozen", "p-owned"):
            kvt.begin_request(key, backend="nixl", framework="test", role="decode")
        poster = PostingThread(init)
        out = {}

        local, remote = init.descs(3)
        with kvt.transfer_scope("p-read", is_last_chunk=True):
            read = init.agent.initialize_xfer("READ", local, remote, init.peer)
        out["read_posted"] = poster.post(read)
        out["read_final"] = init.wait(read, post=False)
        init.agent.release_xfer_handle(read)
        out["read_back"] = bool((init.buffer[:3 * BLOCK] == 5).all())

        local, remote = init.descs()
        with kvt.transfer_scope("p-frozen", destination_index=1, is_last_chunk=True):
            frozen = init.agent.initialize_xfer("WRITE", local, remote, init.peer)
        with nixl_agents.frozen(receiver):
            out["frozen_posted"] = poster.post(frozen)
        out["frozen_final"] = init.wait(frozen, post=False, timeout_s=120)
        init.agent.release_xfer_handle(frozen)

        local_list = init.agent.prep_xfer_dlist("NIXL_INIT_AGENT", init.local_blocks(), "DRAM")
        remote_list = init.agent.prep_xfer_dlist(init.peer, init.remote_blocks(), "DRAM")
        chosen = [2, 3, 4, 5, 6]
        with kvt.transfer_scope("p-owned", is_last_chunk=True):
            owned = init.agent.make_prepped_xfer("READ", local_list, chosen, remote_list, chosen)
        out["owned_final"] = poster.post_poll_release(owned)

        for key in ("p-read", "p-frozen", "p-owned"):
            kvt.end_request(key)
        return dict(_seen(tel), **out)
    finally:
        if poster is not None:
            poster.stop()
        tel.uninstrument()


@scenario
def posting_scope_wins(receiver):
    """A handle made in request a's scope, posted inside request b's scope on another thread: the posting
    thread's scope decides, as it does when both are on one thread."""
    from otel_kvtransfer import integration as kvt

    tel = _telemetry()
    poster = None
    try:
        init = Initiator(receiver, SIZE, BLOCK)
        kvt.begin_request("a", backend="nixl", framework="test", role="decode")
        kvt.begin_request("b", backend="nixl", framework="test", role="decode")
        local, remote = init.descs(2)
        with kvt.transfer_scope("a"):
            handle = init.agent.initialize_xfer("READ", local, remote, init.peer)
        poster = PostingThread(init)

        def post_in_b():
            with kvt.transfer_scope("b"):
                state = init.wait(handle)
            init.agent.release_xfer_handle(handle)
            return state

        state = poster.run(post_in_b)
        kvt.end_request("a")
        kvt.end_request("b")
        return dict(_seen(tel), state=state)
    finally:
        if poster is not None:
            poster.stop()
        tel.uninstrument()


@scenario
def payload_posted_elsewhere(receiver):
    """A handle made in a payload scope (traffic that is not KV), posted and polled on another thread: a send of
    no request, still labelled with its payload and framework."""
    from otel_kvtransfer import integration as kvt

    tel = _telemetry()
    poster = None
    try:
        init = Initiator(receiver, SIZE, BLOCK)
        local, remote = init.descs(4)
        with kvt.payload_scope("encoder_cache", framework="vllm"):
            handle = init.agent.initialize_xfer("READ", local, remote, init.peer)
        poster = PostingThread(init)
        state = poster.post_poll_release(handle)
        return dict(_seen(tel), state=state)
    finally:
        if poster is not None:
            poster.stop()
        tel.uninstrument()


def _child(out_path: str) -> None:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # UCX's TCP transport listens on every device it may use
    os.environ.setdefault("UCX_TLS", "tcp,self")  # over shared memory a frozen peer would not hold a post back
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    nixl_agents.run_with_receiver(out_path, SIZE, SCENARIOS)


# --- the tests -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return nixl_agents.loopback_outcomes(__file__, tmp_path_factory, "nixl_posting")


def _of(result, name, key) -> list:
    return [s for s in spans_named(result, name) if s["attributes"].get("kv_transfer.request_key") == key]


def test_handles_posted_on_another_thread_are_sends_of_the_request_they_were_made_for(outcomes):
    result = result_of(outcomes, "posted_elsewhere")
    assert result["read_final"] == "DONE" and result["read_back"]
    assert result["frozen_posted"] == "PROC" and result["frozen_final"] == "DONE"  # the pending path, for sure
    assert result["owned_final"] == "DONE"
    expected = {"p-read": (3 * BLOCK, 3, "read", 0), "p-frozen": (SIZE, BLOCKS, "write", 1),
                "p-owned": (5 * BLOCK, 5, "read", 0)}
    for key, (nbytes, descriptors, op, destination) in expected.items():
        (request,) = _of(result, "kv_transfer.request", key)
        (send,) = _of(result, "kv_transfer.send", key)
        assert send["parent"] == request["span_id"] and send["trace_id"] == request["trace_id"]
        assert send["ok"]
        attrs = send["attributes"]
        assert (attrs["kv_transfer.bytes"], attrs["kv_transfer.descriptor_count"], attrs["kv_transfer.op"],
                attrs["kv_transfer.destination_index"]) == (nbytes, descriptors, op, destination)
        assert attrs["kv_transfer.backend"] == "nixl" and attrs["kv_transfer.payload"] == "kv"
        assert request["attributes"]["kv_transfer.bytes"] == nbytes
        assert request["attributes"]["kv_transfer.transfer_count"] == 1
    # the send the frozen peer held back was seen to end by a poll: its window says so
    (frozen,) = _of(result, "kv_transfer.send", "p-frozen")
    assert frozen["attributes"]["kv_transfer.end_uncertainty_s"] >= 0
    # nothing became a raw send: the only send outside the three requests is the connecting write
    raw = [s for s in spans_named(result, "kv_transfer.send") if "kv_transfer.request_key" not in s["attributes"]]
    assert [s["attributes"]["kv_transfer.bytes"] for s in raw] == [SIZE]
    assert not result["metrics"].get("kv_transfer.instrumentation.dropped")


def test_the_posting_threads_own_scope_decides_over_the_one_the_handle_was_made_in(outcomes):
    result = result_of(outcomes, "posting_scope_wins")
    assert result["state"] == "DONE"
    assert _of(result, "kv_transfer.send", "a") == []
    (send,) = _of(result, "kv_transfer.send", "b")
    assert send["attributes"]["kv_transfer.bytes"] == 2 * BLOCK


def test_a_payload_handle_posted_on_another_thread_keeps_its_label_and_no_request(outcomes):
    result = result_of(outcomes, "payload_posted_elsewhere")
    assert result["state"] == "DONE"
    (send,) = spans_named(result, "kv_transfer.send")
    attrs = send["attributes"]
    assert attrs["kv_transfer.payload"] == "encoder_cache" and attrs["kv_transfer.framework"] == "vllm"
    assert attrs["kv_transfer.bytes"] == 4 * BLOCK and "kv_transfer.request_key" not in attrs
    assert spans_named(result, "kv_transfer.request") == []
    sizes = result["metrics"]["kv_transfer.size"]
    assert [(p["attributes"].get("kv_transfer.payload"), p["count"]) for p in sizes] == [("encoder_cache", 1)]


if __name__ == "__main__":
    _child(sys.argv[1])
