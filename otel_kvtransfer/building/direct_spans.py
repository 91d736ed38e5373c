"""Spans built directly from our records, without the SDK tracer's per-span machinery.

Our records are fixed in shape and their values were validated when they were made, so a span needs none of the
tracer's generic work (attribute validation into a BoundedAttributes, a lock per span, a processor call at start).
`DirectSpans` asks the provider's own sampler and id generator exactly as the SDK tracer would, builds a plain
`ReadableSpan` (`KVSpan`) once the span has ended, and hands it to the provider's span processors' `on_end`:
the user's exporters and processors receive a genuine ReadableSpan. What differs from the SDK path: processors'
`on_start` is not called for our spans (they are built after the transfer ended), and a span the sampler drops
is never built at all (the metrics count it all the same: they come from the records, not from spans). A span the
sampler records without sampling it (RECORD_ONLY) is built and handed to every processor's `on_end`, as the SDK
hands it (the SDK's exporting processors drop what is not sampled; a span-metrics processor counts it). With the
SDK's own metrics on (OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED), each of our spans is counted in
`otel.sdk.span.started` and, while open, `otel.sdk.span.live`, with the parent origin and sampling result the SDK
tracer would give it.
"""

import math
import random
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor, Tracer
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    Decision,
    ParentBased,
    Sampler,
    StaticSampler,
    TraceIdRatioBased,
)
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from otel_kvtransfer import sdk_internals
from otel_kvtransfer.building import span_handoff
from otel_kvtransfer.building.attribute_values import (
    bounded,
    bounded_events,
    clean_enough,
    limits_of,
    repaired,
    repaired_status,
    repaired_value,
)
from otel_kvtransfer.building.sampler import RecordUnsampledSampler
from otel_kvtransfer.building.stitching import is_synthetic

if TYPE_CHECKING:
    from opentelemetry.util.types import AttributeValue

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)
_RANDOM = getattr(TraceFlags, "RANDOM_TRACE_ID", 0)  # W3C level 2 flag, on SDKs that set it
_EMPTY_STATE = TraceState()
UNSET_STATUS = Status(StatusCode.UNSET)  # a status left unset: nothing in it to repair
_ROOT = Context()
_SEND_OWN_MAX = 16  # more entries than a send sets itself (send_attributes.PER_SEND)
_PROCESSORS = sdk_internals.PROCESSORS_ATTRIBUTE  # read for every span: a constant, not a call


class SendAttributes(dict[str, Any]):  # the builtin generic: a plain dict base at run time
    """A send span's attributes: its first `dynamic` entries are its own, the rest are `static`, a dict shared
    with the request's other sends of the same shape and never changed (the encoder and the metric tables cache
    what they derive from it)."""

    __slots__ = ("dynamic", "static")
    dynamic: int
    static: Dict[str, Any]


class KVSpan(ReadableSpan):
    """A ReadableSpan of this package's (the OTLP encoder recognises the type and encodes it in fixed shape)."""

    __slots__ = ()
    if TYPE_CHECKING:  # always given (DirectSpans._emit), where the SDK's ReadableSpan may lack them
        _context: SpanContext
        _attributes: Mapping[str, Any]


class OpenSpan:
    """A span that stays open across records (a request's or a peer's): what the builder sets on it until it
    ends. `context` is final from the start, so children can be parented to it at once."""

    __slots__ = ("name", "context", "parent", "kind", "start_time", "attributes", "status", "events", "recorded",
                 "counted_end")

    def __init__(self, name: str, context: SpanContext, parent: Optional[SpanContext], kind: SpanKind,
                 start_time: int, attributes: Dict[str, Any], recorded: Optional[bool] = None,
                 counted_end: Optional[Callable[[], None]] = None) -> None:
        self.name = name
        self.context = context
        self.parent = parent
        self.kind = kind
        self.start_time = start_time
        self.attributes = attributes
        self.status = UNSET_STATUS
        self.events: Tuple[Event, ...] = ()
        # Built at its end: sampled, or recorded only (RECORD_ONLY); None when the sampler dropped it.
        self.recorded = context.trace_flags.sampled if recorded is None else recorded
        self.counted_end = counted_end  # the SDK's own span metrics: called once it ended (otel.sdk.span.live)

    def get_span_context(self) -> SpanContext:
        return self.context

    def is_recording(self) -> bool:
        return True

    def set_attribute(self, key: str, value: Any) -> None:
        # As the SDK's BoundedAttributes: a key set again moves to the end (the order the limits cut by).
        attributes = self.attributes
        attributes.pop(key, None)
        attributes[key] = repaired_value(value)

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        for key, value in attributes.items():
            self.set_attribute(key, value)

    def set_status(self, status: Status) -> None:
        self.status = repaired_status(status)

    def add_event(self, name: str, attributes: Optional[Mapping[str, Any]] = None,
                  timestamp: Optional[int] = None) -> None:
        """An event on a span still open (a stuck report); rare, so no bound beyond the builder's own."""
        self.events = tuple(self.events) + (Event(name, attributes, timestamp),)


class _SpanMetrics(Protocol):
    """The SDK's own span metrics of a tracer (`sdk_internals.tracer_metrics`)."""

    def start_span(self, parent: Optional[SpanContext], decision: Decision, /) -> Callable[[], None]: ...


def _tuple_context() -> bool:
    """True when a SpanContext is the tuple (trace_id, span_id, is_remote, flags, state, is_valid) (the SDK canary
    test checks it on every release we allow): then reading it by index or unpacking skips its property calls."""
    probe = SpanContext(3, 5, True, TraceFlags(1), TraceState([("k", "v")]))
    try:
        return tuple(probe) == (3, 5, True, probe.trace_flags, probe.trace_state, True)
    except TypeError:
        return False


TUPLE_CONTEXT = _tuple_context()
_new_tuple = tuple.__new__


def _own_draw(ids: IdGenerator) -> Optional[Callable[[int], int]]:
    """`random.getrandbits` when `ids` is the SDK's RandomIdGenerator, whose ids are exactly that draw (the
    invalid 0 drawn again): the builder draws it itself, two method calls fewer per span, and asks the generator
    only for a 0. None for any other generator: asked for every id."""
    return random.getrandbits if TUPLE_CONTEXT and type(ids) is RandomIdGenerator else None


def _root_decision(sampler: Sampler) -> Optional[Callable[[int], bool]]:
    """For the standard samplers, a function trace_id -> sampled that decides a root span exactly as `sampler`
    would (with no trace state and no attributes of its own); None for any other sampler (it is asked)."""
    if isinstance(sampler, ParentBased):
        sampler = sdk_internals.parent_based_root(sampler)
    if sampler is ALWAYS_ON:
        return lambda trace_id: True
    if sampler is ALWAYS_OFF:
        return lambda trace_id: False
    if type(sampler) is TraceIdRatioBased:
        bound, limit = sampler.bound, TraceIdRatioBased.TRACE_ID_LIMIT
        return lambda trace_id: trace_id & limit < bound
    return None


def _inherits_from_local_parent(sampler: Sampler) -> bool:
    """True when a child of one of our own sampled (or unsampled) spans always gets its parent's decision under
    `sampler`, sampled or dropped, so the sampler need not be asked per child: the standard samplers."""
    if isinstance(sampler, ParentBased):
        sampled, not_sampled = sdk_internals.parent_based_local_parents(sampler)
        return sampled is ALWAYS_ON and not_sampled is ALWAYS_OFF
    if type(sampler) is StaticSampler:  # the same decision for parent and child; one to record only is asked
        return sampler.should_sample(None, 1, "").decision is not Decision.RECORD_ONLY
    return type(sampler) is TraceIdRatioBased  # decides on the trace id, which parent and child share


class _QueueRoom:
    """Back-pressure from the batch span processors' queues.

    The SDK's BatchSpanProcessor drops a span when its queue (2,048 by default) is full, with only a log line. The
    direct path can build faster than an exporter sends, so before a span it looks at every batch processor's
    queue (and lets the next spans through unlooked while the room it found leaves a margin): when one is full it
    waits, up to WAIT_S, for its worker to make room. Waiting holds the builder, so
    what cannot wait is counted where it queues (the recorder's queue, or the helper's socket). After WAIT_S (a
    hung exporter) the span is counted as dropped (`export_queue_full`) and not handed to that processor (the
    others get it), and so is every span that finds that queue still full, without waiting again, until it has
    room: a span counted is never exported by the processor it was counted for, even if its exporter makes room
    in between. No wait outlasts the deadline of the drain in progress (a flush's or the exit's own bound): a span
    whose wait that deadline ends is counted as `flush_timeout` instead and handed to no processor, as the records
    that drain leaves undelivered, and the exporter is not taken as hung.
    """

    WAIT_S = 5.0
    # A look at the queues lets the spans after it through without another, up to half the room it found (at
    # most SPANS_PER_LOOK): a look per span costs a visible share of building one, and the queue would fill only
    # if other spans poured into it faster than this builder does in the meantime.
    SPANS_PER_LOOK = 256

    def __init__(self, provider_processor: SpanProcessor) -> None:
        self._multi = provider_processor
        self._seen: Optional[Tuple[SpanProcessor, ...]] = None
        self._queues: List[List[Any]] = []  # [queue, its size, its batch processor, stalled, the span processor]
        self._unlooked = 0  # spans that may go before the next look at the queues
        # span -> None: to the processors looked at last (span_handoff)
        self.hand: Callable[[ReadableSpan], None] = provider_processor.on_end
        self.waited_s = 0.0  # time spent waiting for room so far (the exit drain's line says what took its time)
        self.on_drop: Callable[[str, int], None] = lambda reason, n: None  # the builder's drop counter, set by it
        # time.monotonic() by which the drain in progress must end: no wait for room outlasts it (the recorder's,
        # set by the attachment in the engine process; the builder process's frame loop has none).
        self.drain_deadline: Callable[[], float] = lambda: math.inf

    def _rescan(self, processors: Tuple[SpanProcessor, ...]) -> None:
        """The batch processors' queues, again whenever the provider's processor tuple changed."""
        self._seen, self._queues = processors, []
        self.hand = span_handoff.plan(self._multi, processors)
        for processor in processors:
            found = sdk_internals.batch_queue(processor)
            if found is not None:
                self._queues.append([*found, False, processor])  # False: not stalled

    def wait(self) -> Optional[Tuple[SpanProcessor, ...]]:
        """The processors not to hand the span to: () for none (the common case), those whose queue stayed full
        (counted); None for every one (the drain's deadline ended the wait: counted as flush_timeout)."""
        processors = getattr(self._multi, _PROCESSORS, ())
        if self._unlooked and processors is self._seen:
            self._unlooked -= 1
            return ()
        if processors is not self._seen:
            self._rescan(processors)
        room = self.SPANS_PER_LOOK * 2
        full: Tuple[SpanProcessor, ...] = ()
        for entry in self._queues:
            queue, size, inner, stalled, processor = entry
            if len(queue) < size:
                entry[3] = False
                room = min(room, size - len(queue))
                continue
            room = 0
            if not stalled:
                began = time.monotonic()
                deadline = began + self.WAIT_S
                awaken = sdk_internals.worker_awaken(inner)
                while len(queue) >= size and time.monotonic() < min(deadline, self.drain_deadline()):
                    if awaken is not None:
                        awaken.set()  # the worker exports at once instead of at its next scheduled time
                    time.sleep(0.001)
                self.waited_s += time.monotonic() - began
                if len(queue) < size:
                    continue
                if self.drain_deadline() < deadline:  # the flush's or exit's bound, not a hung exporter
                    self.on_drop("flush_timeout", 1)
                    self._unlooked = 0  # the queue is full: the next span looks again
                    return None
                entry[3] = True
            # Its exporter did not make room in WAIT_S (now, or at an earlier span): counted, not handed to it,
            # so that room it makes from here on cannot export the span as well.
            self.on_drop("export_queue_full", 1)
            full += (processor,)
        self._unlooked = max(room // 2 - 1, 0)
        return full


class DirectSpans:
    """Builds this package's spans for one SDK tracer (its provider's sampler, ids, resource, processors)."""

    def __init__(self, tracer: Tracer) -> None:
        self.room = _QueueRoom(tracer.span_processor)
        sampler = tracer.sampler
        while isinstance(sampler, RecordUnsampledSampler):  # the SDK path's wrapper: not needed here
            sampler = sampler.delegate
        self._sampler = sampler
        self._inherit = _inherits_from_local_parent(sampler)
        self._root = _root_decision(sampler)
        self._ids = tracer.id_generator
        self._draw = _own_draw(self._ids)
        self._random_flag = _RANDOM if _RANDOM and self._ids.is_trace_id_random() else 0
        self._tracer = tracer
        self._scope = sdk_internals.instrumentation_scope(tracer)
        self._enabled = sdk_internals.enabled_flag(tracer)
        # The provider's span limits, applied as the SDK's Span applies them (attribute_values).
        self._limits = limits_of(tracer)
        self._max_count = self._limits.max_span_attributes
        self._max_length = self._limits.max_span_attribute_length
        # id(a send shape's static attributes) -> (them, whether the limits leave them be)
        self._statics: Dict[int, Tuple[Dict[str, Any], bool]] = {}
        # The last decision the sampler was asked for said RECORD_ONLY: read (and reset) by the caller of _context.
        self._record_only = False
        self._span_metrics: Optional[_SpanMetrics] = sdk_internals.tracer_metrics(tracer)  # the SDK's own (None: off)

    @property
    def _processor(self) -> SpanProcessor:
        return self._tracer.span_processor

    @property
    def _resource(self) -> Resource:
        return self._tracer.resource

    # --- decisions --------------------------------------------------------------------------------------------
    def _context(self, name: str, parent: Optional[SpanContext], kind: SpanKind, attributes: Mapping[str, Any],
                 synthetic: bool = False) -> SpanContext:
        """A new span's context under `parent` (a SpanContext or None), sampled as the SDK tracer would."""
        if parent is not None and self._inherit and TUPLE_CONTEXT:
            # The common case, a child of one of our own open spans, read as the tuple it is (no property calls).
            trace_id, _, remote, parent_flags, state, valid = parent
            if valid and not remote:
                flags = _SAMPLED if parent_flags & 1 else _NOT_SAMPLED
                if parent_flags & _RANDOM:
                    flags = TraceFlags(flags | _RANDOM)
                if self._draw is not None:  # valid ids: the tuple a SpanContext is, without its checks
                    return _new_tuple(SpanContext, (trace_id, self._draw(64) or self._ids.generate_span_id(),
                                                    False, flags, state, True))
                return SpanContext(trace_id, self._ids.generate_span_id(), False, flags, state)
        if parent is not None and parent.is_valid:
            trace_id = parent.trace_id
            flags_random = int(parent.trace_flags) & _RANDOM
        else:
            parent = None
            trace_id = (self._draw(128) if self._draw is not None else 0) or self._ids.generate_trace_id()
            flags_random = self._random_flag
        if parent is not None and not parent.is_remote and self._inherit:
            flags = _SAMPLED if parent.trace_flags.sampled else _NOT_SAMPLED
            state = parent.trace_state
        elif (parent is None or synthetic) and self._root is not None:
            flags = _SAMPLED if self._root(trace_id) else _NOT_SAMPLED
            state = _EMPTY_STATE
        else:
            if parent is None or synthetic:
                # The synthetic stitching parent never decides: asked as a root with the same trace id.
                context = _ROOT
            else:
                context = trace.set_span_in_context(trace.NonRecordingSpan(parent), _ROOT)
            result = self._sampler.should_sample(context, trace_id, name, kind, attributes, ())
            flags = _SAMPLED if result.decision.is_sampled() else _NOT_SAMPLED  # type: ignore[no-untyped-call]  # SDK: untyped
            self._record_only = result.decision is Decision.RECORD_ONLY
            state = result.trace_state if result.trace_state is not None else _EMPTY_STATE
        if flags_random:
            flags = TraceFlags(flags | flags_random)
        if self._draw is not None:
            return _new_tuple(SpanContext, (trace_id, self._draw(64) or self._ids.generate_span_id(), False, flags,
                                            state, True))
        return SpanContext(trace_id, self._ids.generate_span_id(), False, flags, state)

    # --- spans ------------------------------------------------------------------------------------------------
    def open(self, name: str, parent: Optional[SpanContext], kind: SpanKind, attributes: Dict[str, Any],
             start_ns: int) -> OpenSpan:
        """A top span (request, peer) under `parent`: a real parent's span context, or the synthetic one."""
        synthetic = parent is not None and is_synthetic(parent)
        attributes = repaired(attributes)  # what a sampler sees too, as on the SDK path
        context = self._context(name, parent, kind, attributes, synthetic)
        recorded = bool(context.trace_flags & 1) or self._record_only
        self._record_only = False
        counted_end = self._count_started(parent, context, recorded) if self._span_metrics is not None else None
        return OpenSpan(name, context, parent if parent is not None and parent.is_valid else None, kind, start_ns,
                        attributes, recorded, counted_end)

    @staticmethod
    def context_of(span: OpenSpan) -> SpanContext:
        return span.context

    def close(self, span: OpenSpan, end_ns: int) -> None:
        if span.counted_end is not None:
            ended, span.counted_end = span.counted_end, None
            ended()
        if span.recorded:
            self._emit(span.name, span.context, span.parent, span.kind, span.attributes, span.status,
                       span.start_time, max(end_ns, span.start_time), span.events, span.context.trace_flags & 1)

    def child(self, name: str, parent: Optional[SpanContext], kind: SpanKind, attributes: Dict[str, Any],
              start_ns: int, end_ns: int, status: Status = UNSET_STATUS, synthetic: bool = False) -> SpanContext:
        """A span started and ended at once (a send, a compute interval) under `parent`; its context (for an
        exemplar). `synthetic`: the parent is the stitching one, which never decides sampling."""
        context = self._context(name, parent, kind, attributes, synthetic)
        if self._span_metrics is not None:
            self._count_started(parent, context, bool(context.trace_flags & 1) or self._record_only)()
        if context.trace_flags & 1:  # sampled
            self._emit(name, context, parent if parent is not None and parent.is_valid else None, kind,
                       attributes, status, start_ns, end_ns, ())
        elif self._record_only:  # recorded, not sampled: every processor gets it, the exporting ones drop it
            self._record_only = False
            self._emit(name, context, parent if parent is not None and parent.is_valid else None, kind,
                       attributes, status, start_ns, end_ns, (), False)
        return context

    def _count_started(self, parent: Optional[SpanContext], context: SpanContext,
                       recorded: bool) -> Callable[[], None]:
        """The SDK's own count of a span started (otel.sdk.span.started, and otel.sdk.span.live while it is
        open), as its tracer counts one: by parent origin and sampling result. Returns what ends it."""
        if self._enabled is not None and not self._enabled():  # a tracer switched off starts no span
            return _nothing
        decision = Decision.RECORD_AND_SAMPLE if context.trace_flags & 1 else \
            Decision.RECORD_ONLY if recorded else Decision.DROP
        return self._span_metrics.start_span(  # type: ignore[union-attr]  # called only while it is set
            parent if parent is not None and parent.is_valid else None, decision)

    def _emit(self, name: str, context: SpanContext, parent: Optional[SpanContext], kind: SpanKind,
              attributes: Mapping[str, Any], status: Status, start_ns: int, end_ns: int, events: Sequence[Event],
              sampled: int = True) -> None:  # sampled: a flag (trace_flags & 1) or a bool
        if self._enabled is not None and not self._enabled():  # the SDK's tracer configurator turned us off
            return
        if not sampled:  # recorded only: to every processor's on_end, as the SDK hands it (no
            # export queue takes it: no wait for room)
            self._processor.on_end(KVSpan(name, context, parent, self._resource, self._bounded(attributes),
                                          bounded_events(events, self._limits) if events else events, (), kind,
                                          None, repaired_status(status) if status is not UNSET_STATUS else status,
                                          start_ns, end_ns, self._scope))
            return
        skip = self.room.wait()
        if skip is None:
            return
        attributes = self._bounded(attributes)
        if events:
            events = bounded_events(events, self._limits)
        if status is not UNSET_STATUS:
            status = repaired_status(status)
        span = KVSpan(name, context, parent, self._resource, attributes, events, (), kind, None, status, start_ns,
                      end_ns, self._scope)
        if not skip:
            self.room.hand(span)
            return
        for processor in getattr(self._processor, _PROCESSORS, ()):
            if processor not in skip:
                processor.on_end(span)

    def _bounded(self, attributes: Mapping[str, Any]) -> "Mapping[str, AttributeValue]":
        """`attributes` as the SDK would keep them under the provider's limits: themselves when nothing is cut or
        cleaned. A send's own figures are plain numbers and a valid error type (send_attributes), so a send needs
        only its shared part judged, once per shape; anything else is checked whole."""
        if type(attributes) is SendAttributes:
            static = attributes.static
            seen = self._statics.get(id(static))
            if seen is None or seen[0] is not static:
                seen = self._judge(static)
            if seen[1]:
                return attributes
        max_count, max_length = self._max_count, self._max_length
        if (max_count is None or len(attributes) <= max_count) and clean_enough(attributes.items(), max_length):
            return attributes
        return bounded(attributes, max_count, max_length)

    def _judge(self, static: Dict[str, Any]) -> Tuple[Dict[str, Any], bool]:
        """(static, True when every send of this shape is kept whole: its part is clean, no length limit applies
        to its own error type, and its own figures cannot push it past the count limit)."""
        if len(self._statics) >= 4096:
            self._statics.clear()
        whole = (self._max_length is None and clean_enough(static.items(), None)
                 and (self._max_count is None or len(static) + _SEND_OWN_MAX <= self._max_count))
        seen = self._statics[id(static)] = (static, whole)
        return seen


def _nothing() -> None:
    pass


def span_context_of(context: Optional[Context]) -> Optional[SpanContext]:
    """The span context a Context (a raw call's current context, a real parent) holds, or None."""
    if context is None:
        return None
    span_context = trace.get_current_span(context).get_span_context()
    return span_context if span_context.is_valid else None


__all__ = ["DirectSpans", "KVSpan", "OpenSpan", "SpanKind", "UNSET_STATUS", "span_context_of"]
