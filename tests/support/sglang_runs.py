"""What a real SGLang PD deployment (tests/sglang_serving/deployment.py) was asked and what its servers wrote:
the requests, their answers, and the spans of both span files, with the look-ups the tests assert through.
"""

import importlib.util
import os
import shutil
import time

from support.parts import require_part

REQUEST, SEND, COMPUTE, RECEIVE = ("kv_transfer.request", "kv_transfer.send", "kv_transfer.compute",
                                   "kv_transfer.receive")


def require_parts(*modules: str) -> None:
    """sglang's server, sglang-router and `modules` (the transfer engine, ...), and the namespace tools the
    deployment runs in."""
    have = {name: importlib.util.find_spec(name) is not None for name in ("sglang", "sglang_router", "uvicorn",
                                                                           *modules)}
    require_part(all(have.values()), f"sglang server, sglang-router, {', '.join(modules)} ({have})")
    require_part(all(shutil.which(t) for t in ("unshare", "nsenter", "ip")),
                 "unshare/nsenter (util-linux) and ip (iproute2)")


class Run:
    """The requests sent to one deployment, their answers, and the spans its servers wrote, as (server name, span);
    the pair's servers are called by their roles, "prefill" and "decode"."""

    def __init__(self, deployment, requests, results):
        self.deployment = deployment
        self.requests = requests
        self.results = results
        self.spans = []

    def read_spans(self):
        from otel_kvtransfer.tools.spanfile import read_spans

        spans = []
        for name in self.deployment.servers:
            path = self.deployment.span_file(name)
            if os.path.exists(path):
                spans += [(name, s) for s in read_spans(path)]
        return spans

    def wait_for_spans(self, timeout_s=60.0, receives_per_request=1):
        """Until every request has its request span and a receive on each of its decode ranks, and with sglang's
        tracing on, their parents (sglang's request spans end later, when the request finishes; the exporters
        batch every 0.5 s)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.spans = self.read_spans()
            tops = [s for _, s in self.spans if s.name in (REQUEST, RECEIVE)]
            rids = {s.attributes.get("sglang.rid") for s in tops if s.name == REQUEST}
            receives = sum(1 for s in tops if s.name == RECEIVE)
            ids = {s.span_id for _, s in self.spans}
            parents = not self.deployment.enable_trace or all(s.parent_span_id in ids for s in tops)
            if (all(r["rid"] in rids for r in self.requests) and receives >= receives_per_request * len(
                    self.requests) and parents) \
                    or time.monotonic() > deadline:
                return self
            time.sleep(1)

    def named(self, name, role=None):
        return [s for r, s in self.spans if s.name == name and (role is None or r == role)]

    def request_of(self, rid):
        found = [s for s in self.named(REQUEST) if s.attributes.get("sglang.rid") == rid]
        assert len(found) == 1, (rid, len(found))
        return found[0]

    def children(self, span, name):
        return [s for _, s in self.spans if s.name == name and s.parent_span_id == span.span_id
                and s.trace_id == span.trace_id]

    def receive_of(self, room):
        found = [s for s in self.named(RECEIVE) if s.attributes.get("kv_transfer.bootstrap_room") == room]
        assert len(found) == 1, (room, len(found))
        return found[0]
