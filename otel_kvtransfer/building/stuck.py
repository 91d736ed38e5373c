"""What is open now, and what has been open too long: the `kv_transfer.inflight` gauges and stuck reports.

The builder keeps the open request and peer spans; the engine process reports its open sends (sync calls inside
the engine, async submissions not yet seen to end) in INFLIGHT records (`inflight.py`). An item open longer than
OTEL_KVTRANSFER_STUCK_S is reported once, while it is still open: one WARNING line (kind, request key, peer, bytes
when known, age), the counter `kv_transfer.stuck` and the span event `kv_transfer.stuck` on its request or peer
span. The gauges are observed at collection time from the builder's last snapshot, so they cost nothing per
transfer.
"""

import logging
import threading
import time
import weakref
from collections import deque

from opentelemetry import metrics
from opentelemetry.metrics import Observation

from otel_kvtransfer import semconv
from otel_kvtransfer.version import __version__

_logger = logging.getLogger(__name__)
KINDS = (semconv.INFLIGHT_SEND, semconv.INFLIGHT_REQUEST, semconv.INFLIGHT_PEER)
_BY_PROVIDER = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


class StuckReporter:
    def __init__(self, meter_provider=None):
        meter = metrics.get_meter(semconv.INSTRUMENTATION_NAME, __version__, meter_provider)
        self._counter = meter.create_counter(semconv.METRIC_STUCK, unit="{item}",
                                             description="Transfers, requests and peer waits open longer than "
                                                         "OTEL_KVTRANSFER_STUCK_S, counted once each")
        meter.create_observable_gauge(semconv.METRIC_INFLIGHT, callbacks=[self._counts], unit="{item}",
                                      description="Transfers, requests and peer waits open now")
        meter.create_observable_gauge(semconv.METRIC_INFLIGHT_OLDEST_AGE, callbacks=[self._ages], unit="s",
                                      description="Age of the oldest transfer, request or peer wait open now")
        self.snapshot = {}  # kind -> (open count, oldest start_ns or None); replaced whole by the builder

    def _counts(self, _options):
        return [Observation(count, {semconv.INFLIGHT_KIND: kind}) for kind, (count, _) in self.snapshot.items()]

    def _ages(self, _options):
        now = time.time_ns()
        return [Observation(max(now - oldest, 0) / 1e9 if oldest is not None else 0.0,
                            {semconv.INFLIGHT_KIND: kind}) for kind, (_, oldest) in self.snapshot.items()]

    def stuck(self, kind, key, peer, nbytes, age_s, backend=None, role=None, span=None) -> None:
        _logger.warning("otel_kvtransfer: a %s open for %.0f s is stuck: request key %s, peer %s, bytes %s", kind,
                        age_s, _shown(key), _shown(peer), _shown(nbytes))
        labels = {semconv.INFLIGHT_KIND: kind}
        if backend:
            labels[semconv.BACKEND] = backend
        if role:
            labels[semconv.ROLE] = role
        self._counter.add(1, labels)
        if span is not None:
            attributes = {semconv.STUCK_AGE_S: float(age_s), semconv.INFLIGHT_KIND: kind}
            if peer is not None:
                attributes[semconv.SERVER_ADDRESS] = str(peer)[:256]
            if nbytes is not None:
                attributes[semconv.BYTES] = int(nbytes)
            span.add_event(semconv.EVENT_STUCK, attributes, time.time_ns())


def _shown(value) -> str:
    """A value for the log line: bounded, one line, never the engine's whole object."""
    if value is None:
        return "unknown"
    text = str(value)
    return (text[:120] + "...") if len(text) > 120 else text.replace("\n", " ")


def reporter_for(meter_provider) -> StuckReporter:
    """One reporter per MeterProvider (its instruments outlive uninstrument, as SDK instruments do)."""
    provider = meter_provider or metrics.get_meter_provider()
    with _LOCK:
        try:
            found = _BY_PROVIDER.get(provider)
        except TypeError:
            return StuckReporter(provider)
        if found is None:
            found = _BY_PROVIDER[provider] = StuckReporter(provider)
        return found


class OpenWatch:
    """The builder's side: its open requests and peer waits in the order they opened, so each tick finds the
    ones that just became stuck, and the oldest still open, in O(what changed), not O(open)."""

    def __init__(self, reporter: StuckReporter, stuck_s: float):
        self.reporter = reporter
        self._stuck_ns = int(stuck_s * 1e9)
        self._young = {semconv.INFLIGHT_REQUEST: deque(), semconv.INFLIGHT_PEER: deque()}
        self._old = {semconv.INFLIGHT_REQUEST: deque(), semconv.INFLIGHT_PEER: deque()}
        self._sends = (0, None)

    def opened(self, kind: str, key, state, start_ns: int) -> None:
        self._young[kind].append((start_ns, key, state))

    def sends(self, rec, find_request) -> None:
        """An INFLIGHT record from the engine process: its open sends, and those that just became stuck."""
        _, at_ns, count, oldest, stuck = rec
        self._sends = (count, oldest)
        for start_ns, key, peer, nbytes, backend in stuck:
            state = find_request(key) if key is not None else None
            self.reporter.stuck(semconv.INFLIGHT_SEND, key, peer, nbytes, (at_ns - start_ns) / 1e9, backend,
                                state.labels.get(semconv.ROLE) if state is not None else None,
                                state.span if state is not None else None)

    def tick(self, tables: dict, describe) -> None:
        """`tables`: kind -> the builder's open table (key -> state); `describe(kind, state)` -> (peer, nbytes,
        backend, role) for the report."""
        now = time.time_ns()
        threshold = now - self._stuck_ns
        snapshot = {semconv.INFLIGHT_SEND: self._sends}
        for kind, table in tables.items():
            young, old = self._young[kind], self._old[kind]
            while young and young[0][0] <= threshold:
                item = young.popleft()
                start_ns, key, state = item
                if table.get(key) is state:
                    old.append(item)
                    peer, nbytes, backend, role = describe(kind, state)
                    self.reporter.stuck(kind, key, peer, nbytes, (now - start_ns) / 1e9, backend, role, state.span)
            oldest = None
            for queue in (old, young):
                while queue and table.get(queue[0][1]) is not queue[0][2]:  # ended since: forget it
                    queue.popleft()
                if queue and (oldest is None or queue[0][0] < oldest):
                    oldest = queue[0][0]
            snapshot[kind] = (len(table), oldest)
        self.reporter.snapshot = snapshot

    def reset(self) -> None:
        for queue in list(self._young.values()) + list(self._old.values()):
            queue.clear()
        self._sends = (0, None)
