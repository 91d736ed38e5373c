"""What is open now, and what has been open too long: the `kv_transfer.inflight` gauges and stuck reports.

The builder keeps the open request and peer spans; the engine process reports its open sends (sync calls inside
the engine, async submissions not yet seen to end) in INFLIGHT records (`inflight.py`). An item open longer than
OTEL_KVTRANSFER_STUCK_S is reported once, while it is still open: one WARNING line (kind, request key, peer, bytes
when known, age), the counter `kv_transfer.stuck` and the span event `kv_transfer.stuck` on its request or peer
span. Many items stuck at once (a frozen peer under load) log their first MAX_LINES one by one and the rest in one
summary line per scan (how many, the oldest, by kind and peer), so the log stays readable; every item is still
counted and gets its event. Keys and peer names come from clients and peers: each is printed as one bounded line
with control and format characters escaped (`printable.one_line`), so none can forge a line. The gauges are
observed at collection time from the builder's last snapshot, so they cost nothing per transfer.
"""

import logging
import threading
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Deque, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple, Union

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation

from otel_kvtransfer import semconv
from otel_kvtransfer.building.printable import as_text, one_line
from otel_kvtransfer.recording.clock import now_ns
from otel_kvtransfer.version import __version__

if TYPE_CHECKING:
    from otel_kvtransfer.building.builder_part import BuiltSpan
    from otel_kvtransfer.building.open_spans import OpenPeer, OpenRequest

_logger = logging.getLogger(__name__)
KINDS = (semconv.INFLIGHT_SEND, semconv.INFLIGHT_REQUEST, semconv.INFLIGHT_PEER, semconv.INFLIGHT_CONNECT)
_BY_PROVIDER: "weakref.WeakKeyDictionary[MeterProvider, StuckReporter]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
MAX_LINES = 5  # stuck items logged one by one per scan; the rest go into one summary line
MAX_GROUPS = 8  # (kind, peer) groups named in a summary line
# An item that just became stuck: (kind, key, peer, nbytes, age_s, backend, role, its span or None).
Stuck = Tuple[str, Any, Any, Optional[int], float, Optional[str], Optional[str], Optional["BuiltSpan"]]
Snapshot = Dict[str, Tuple[int, Optional[int]]]  # kind -> (open count, oldest start_ns or None)
Opened = Tuple[int, Any, Union["OpenRequest", "OpenPeer"]]  # (start_ns, key, its state in the builder's table)


class StuckReporter:
    def __init__(self, meter_provider: Optional[MeterProvider] = None) -> None:
        meter = metrics.get_meter(semconv.INSTRUMENTATION_NAME, __version__, meter_provider)
        self._counter = meter.create_counter(semconv.METRIC_STUCK, unit="{item}",
                                             description="Transfers, requests and peer waits open longer than "
                                                         "OTEL_KVTRANSFER_STUCK_S, counted once each")
        meter.create_observable_gauge(semconv.METRIC_INFLIGHT, callbacks=[self._counts], unit="{item}",
                                      description="Transfers, requests and peer waits open now")
        meter.create_observable_gauge(semconv.METRIC_INFLIGHT_OLDEST_AGE, callbacks=[self._ages], unit="s",
                                      description="Age of the oldest transfer, request or peer wait open now")
        self.snapshot: Snapshot = {}  # replaced whole by the builder

    def _counts(self, _options: CallbackOptions) -> List[Observation]:
        return [Observation(count, {semconv.INFLIGHT_KIND: kind}) for kind, (count, _) in self.snapshot.items()]

    def _ages(self, _options: CallbackOptions) -> List[Observation]:
        now = now_ns()  # the records' clock: ages are monotonic measures
        return [Observation(max(now - oldest, 0) / 1e9 if oldest is not None else 0.0,
                            {semconv.INFLIGHT_KIND: kind}) for kind, (_, oldest) in self.snapshot.items()]

    def stuck(self, kind: str, key: Any, peer: Any, nbytes: Optional[int], age_s: float, backend: Optional[str] = None,
              role: Optional[str] = None, span: Optional["BuiltSpan"] = None) -> None:
        self.report([(kind, key, peer, nbytes, age_s, backend, role, span)])

    def report(self, items: Iterable[Stuck]) -> None:
        """The items of one scan that just became stuck: (kind, key, peer, nbytes, age_s, backend, role, span)
        each. Each is counted and gets its span event; the first MAX_LINES get a line each, the rest one line."""
        counts: Dict[Tuple[str, Optional[str], Optional[str]], int]  # (kind, backend, role) -> items
        groups: Dict[Tuple[str, Optional[str]], int]  # (kind, peer) -> items beyond the lines
        counts, logged, rest, oldest, groups = {}, 0, 0, 0.0, {}
        at_ns = now_ns()  # on the spans' clock
        for kind, key, peer, nbytes, age_s, backend, role, span in items:
            oldest = max(oldest, age_s)
            if logged < MAX_LINES:
                _logger.warning("otel_kvtransfer: a %s open for %.0f s is stuck: request key %s, peer %s, bytes %s",
                                kind, age_s, _shown(key), _shown(peer), _shown(nbytes))
                logged += 1
            else:
                rest += 1
                group = (kind, None if peer is None else one_line(peer))
                if group in groups or len(groups) < MAX_GROUPS:
                    groups[group] = groups.get(group, 0) + 1
            series = (kind, backend or None, role or None)
            counts[series] = counts.get(series, 0) + 1
            if span is not None:
                attributes = {semconv.STUCK_AGE_S: float(age_s), semconv.INFLIGHT_KIND: kind}
                if peer is not None:
                    attributes[semconv.SERVER_ADDRESS] = as_text(peer)[:256]
                if nbytes is not None:
                    attributes[semconv.BYTES] = int(nbytes)
                span.add_event(semconv.EVENT_STUCK, attributes, at_ns)
        for (kind, backend, role), count in counts.items():  # one add per label set, not per item
            labels = {semconv.INFLIGHT_KIND: kind}
            if backend:
                labels[semconv.BACKEND] = backend
            if role:
                labels[semconv.ROLE] = role
            self._counter.add(count, labels)
        if rest:
            named = sum(groups.values())
            shown = ", ".join(f"{kind} to {peer}: {count}" if peer is not None else f"{kind}: {count}"
                              for (kind, peer), count in sorted(groups.items(), key=lambda item: -item[1]))
            _logger.warning("otel_kvtransfer: %d items became stuck in this scan, %d more than the lines above (the "
                            "oldest open for %.0f s); those by kind and peer: %s%s", logged + rest, rest, oldest,
                            shown, f", others: {rest - named}" if rest > named else "")


def _shown(value: Any) -> str:
    """A value for the log line (a request key a client chose, a peer's own name): one line, control and format
    characters escaped, bounded; never the engine's whole object."""
    return "unknown" if value is None else one_line(value)


def reporter_for(meter_provider: Optional[MeterProvider]) -> StuckReporter:
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

    def __init__(self, reporter: StuckReporter, stuck_s: float) -> None:
        self.reporter = reporter
        self._stuck_ns = int(stuck_s * 1e9)
        # kind -> its open items, in the order they opened
        self._young: Dict[str, Deque[Opened]] = {semconv.INFLIGHT_REQUEST: deque(), semconv.INFLIGHT_PEER: deque()}
        self._old: Dict[str, Deque[Opened]] = {semconv.INFLIGHT_REQUEST: deque(), semconv.INFLIGHT_PEER: deque()}
        self._sends: Tuple[int, Optional[int]] = (0, None)
        # (open, oldest start) of set-up calls, once the engine process reported any
        self._connects: Optional[Tuple[int, Optional[int]]] = None

    def opened(self, kind: str, key: Any, state: Union["OpenRequest", "OpenPeer"], start_ns: int) -> None:
        self._young[kind].append((start_ns, key, state))

    def sends(self, rec: Tuple[Any, ...], find_request: Callable[[Any], Optional["OpenRequest"]]) -> None:
        """An INFLIGHT record from the engine process: its open sends and set-up calls, and those that just
        became stuck."""
        _, at_ns, count, oldest, stuck, connects = rec
        self._sends = (count, oldest)
        if connects[0] or self._connects is not None:
            self._connects = connects
        if stuck:
            self.reporter.report(self._stuck_sends(stuck, at_ns, find_request))

    @staticmethod
    def _stuck_sends(stuck: Iterable[Tuple[Any, ...]], at_ns: int,
                     find_request: Callable[[Any], Optional["OpenRequest"]]) -> Iterator[Stuck]:
        for start_ns, key, peer, nbytes, backend, kind in stuck:
            if nbytes is not None and type(nbytes) is not int:  # a batch's lengths, as the engine was given them
                nbytes = int(sum(nbytes))
            state = find_request(key) if key is not None else None
            yield (kind, key, peer, nbytes, (at_ns - start_ns) / 1e9, backend,
                   state.labels.get(semconv.ROLE) if state is not None else None,
                   state.span if state is not None else None)

    def tick(self, tables: Mapping[str, Mapping[Any, Any]],
             describe: Callable[[str, Any], Tuple[Any, Optional[int], Optional[str], Optional[str]]]) -> None:
        """`tables`: kind -> the builder's open table (key -> state); `describe(kind, state)` -> (peer, nbytes,
        backend, role) for the report."""
        now = now_ns()  # the records' clock: ages are monotonic measures
        threshold = now - self._stuck_ns
        snapshot: Snapshot = {semconv.INFLIGHT_SEND: self._sends}
        if self._connects is not None:
            snapshot[semconv.INFLIGHT_CONNECT] = self._connects
        stuck: List[Stuck] = []
        for kind, table in tables.items():
            young, old = self._young[kind], self._old[kind]
            while young and young[0][0] <= threshold:
                item = young.popleft()
                start_ns, key, state = item
                if table.get(key) is state:
                    old.append(item)
                    peer, nbytes, backend, role = describe(kind, state)
                    stuck.append((kind, key, peer, nbytes, (now - start_ns) / 1e9, backend, role, state.span))
            oldest = None
            for queue in (old, young):
                while queue and table.get(queue[0][1]) is not queue[0][2]:  # ended since: forget it
                    queue.popleft()
                if queue and (oldest is None or queue[0][0] < oldest):
                    oldest = queue[0][0]
            snapshot[kind] = (len(table), oldest)
        self.reporter.snapshot = snapshot
        if stuck:
            self.reporter.report(stuck)

    def reset(self) -> None:
        for queue in list(self._young.values()) + list(self._old.values()):
            queue.clear()
        self._sends = (0, None)
        self._connects = None
