"""The records the hot path hands to the span builder: their kinds and named field positions.

A record is a plain tuple (the cheapest thing to build on an engine thread, and to pickle to the builder
process); this module is the one place that says what each position means, and each kind's constructor sits
next to its positions. Producers build records with those constructors (through `integration`, `pending` and
the engine modules); only the builder reads them. The backend (and, for framework records, the framework)
travels in every record, so the core never assumes an engine.
"""

from typing import TYPE_CHECKING, Any, Final, Iterable, Optional, Union

from otel_kvtransfer.semconv import END_UNCERTAINTY_S, POST_S

if TYPE_CHECKING:
    from opentelemetry.context import Context

# The types the annotations name: a record is a tuple whose positions this module names, so a tuple of anything
# to the type checker; a call and a transfer scope's info likewise.
Record = tuple[Any, ...]
Call = tuple[Any, ...]  # CALL_* below
Info = tuple[Any, ...]  # INFO_* below
Key = Union[int, str]  # a request key: an int (a bootstrap room) or a str (a transfer id)
Attributes = dict[str, Any]  # span attributes a framework or an engine adds
ScopeTimes = tuple[Optional[int], int]  # (enter_ns, exit_ns) of a transfer scope (enter_ns set by its first entry)

# Kinds: field 0 of every record.
SEND = 1  # one actual transfer: one engine call, or a transfer scope's engine calls
BEGIN_REQUEST = 2  # the initiator's request span opens
END_REQUEST = 3
COMPUTE = 4  # a compute interval serving some requests
BEGIN_PEER = 5  # the peer's waiting span (receive for a push, serve for a pull) opens
END_PEER = 6
INFLIGHT = 7  # what the engine process is transferring right now (inflight.py)
CONNECT = 8  # one explicit set-up call towards a peer (NIXL's add_remote_agent, make_connection)
LATE_ARRIVAL = 9  # the peer saw KV of a wait of its that had already ended (a read of KV it had freed)
RAW_CALL = 10  # one engine call outside any transfer scope: a send of its own, in one flat tuple
PEER_OUTCOME = 11  # what the peer found out about its KV after its wait ended (a framework's integrity check)
RAW_MONOTONIC: Final = 12  # a RAW_CALL whose two times are `time.monotonic_ns()` as the engine thread read them
RAW_ASYNC: Final = 13  # an async submission outside any scope, ended: a RAW_CALL whose own attributes are times
KIND = 0

# The constructors below are plain functions that return the tuple, in the order of the positions above them:
# no validation (the integration API bounds framework input before it gets here), no keyword-only overhead.

# SEND: (SEND, info, calls, context, scope_error, scope_times)
SEND_INFO = 1  # a transfer-scope info tuple (below), or None for a raw engine call
SEND_CALLS = 2  # list of call tuples (below)
SEND_CONTEXT = 3  # the context a raw engine call is parented to (None inside a scope)
SEND_ERROR = 4  # error.type the scope itself set, or None
SEND_SCOPE_TIMES = 5  # (enter_ns, exit_ns) of the scope, or None: the send's time when it made no engine call


def send(info: Optional[Info], calls: list[Call], context: "Optional[Context]" = None, error: Optional[str] = None,
         scope_times: Optional[ScopeTimes] = None) -> Record:
    return (SEND, info, calls, context, error, scope_times)


# Transfer-scope info: what a framework says a transfer is for.
INFO_KEY = 0  # request key: int (a bootstrap room) or str
INFO_CHUNK = 1
INFO_PAYLOAD = 2
INFO_DESTINATION = 3
INFO_REPLICA = 4
INFO_IS_LAST = 5
INFO_EARLY = 6
INFO_ATTRIBUTES = 7  # dict of extra span attributes (framework ids), or None


def info(key: Key, chunk: int, payload: str, destination: int, replica: int, is_last: bool, early: bool,
         attributes: Optional[Attributes]) -> Info:
    return (key, chunk, payload, destination, replica, is_last, early, attributes)


# One engine call, as an engine wrapper times it. `call` below is the one definition of its shape, and
# `raw_call` of a call made outside any transfer scope. An engine's hot path may write either out instead of
# calling it (a call is one more Python frame per transfer: engines/mooncake/sync.py's wrapper does);
# tests/project/test_backend_contract.py checks that what it writes is what these build.
CALL_START = 0  # clock.now_ns(): every time in a record is on the records' clock (clock.py)
CALL_END = 1
CALL_BYTES = 2  # an int, or the list of lengths the engine was given (summed on the builder thread)
CALL_DESCRIPTORS = 3
CALL_OP = 4  # semconv.OP_WRITE | OP_READ
CALL_PEER = 5  # the engine's own peer name, parsed later by the engine's peer_attributes()
CALL_PROTOCOL = 6  # the engine's protocol name (tcp, rdma, ucx, ...) or None
CALL_RETURN_CODE = 7
CALL_ERROR = 8  # error.type, or None on success
CALL_BACKEND = 9  # kv_transfer.backend of the engine that made the call
CALL_EXTRA = 10  # dict of extra send attributes from the engine (e.g. a notification), or None


def call(start: int, end: int, nbytes: Union[int, Iterable[int]], descriptors: int, op: str, peer: Any,
         protocol: Optional[str], return_code: Any, error: Optional[str], backend: str,
         extra: Optional[Attributes] = None) -> Call:
    return (start, end, nbytes, descriptors, op, peer, protocol, return_code, error, backend, extra)


# RAW_CALL: (RAW_CALL, <the call's fields, CALL_START to CALL_EXTRA>, context). The same send as
# send(None, [call], context), built as one tuple instead of two and a list: engine threads make one per
# transfer, and each container allocated there is one more object for the cyclic GC to count and, while queued,
# to traverse.
# An empty context (no span current, the common case) is stored as None: a tuple of plain values is one the GC
# stops tracking at its first collection, so a queue of them costs the later, larger collections nothing.
RAW_CONTEXT = CALL_EXTRA + 2  # the context the call is parented to, or None
RAW_CALL_FIELDS = slice(1, RAW_CONTEXT)  # rec[RAW_CALL_FIELDS] is the call tuple


def raw_call(call: Call, context: "Optional[Context]") -> Record:
    return (RAW_CALL, *call, context or None)


# RAW_MONOTONIC: (RAW_MONOTONIC, start, end, bytes, descriptors, peer, return code, form, context): one engine call
# outside any transfer scope as an engine's common sync call writes it, only what changes from call to call in
# fields of its own. Its two times are `time.monotonic_ns()` as the engine thread read them, not yet on the records'
# clock (the builder adds clock.BASE: the builder process has its engine's): two big-integer additions a call
# saved. What the calls of one engine and op share (op, protocol, backend, extra, and the error type of a return
# code other than 0) is one constant tuple, its `form`, the same object in every such record: pickle sends it once
# per batch and a reference to it after, where five fields a record cost the recorder's thread a tenth of its work.
MONO_START = 1
MONO_END = 2
MONO_BYTES = 3
MONO_DESCRIPTORS = 4
MONO_PEER = 5
MONO_RETURN_CODE = 6
MONO_FORM = 7
MONO_CONTEXT = 8  # as RAW_CONTEXT: None when no span was current

FORM_OP: Final = 0  # Final: a checker reads each position's own type through them
FORM_PROTOCOL: Final = 1
FORM_BACKEND: Final = 2
FORM_EXTRA: Final = 3
FORM_FAILED: Final = 4  # error.type of a call whose return code is not 0
Form = tuple[str, Optional[str], str, Optional[Attributes], str]


def call_form(op: str, protocol: Optional[str], backend: str, extra: Optional[Attributes], failed: str) -> Form:
    return (op, protocol, backend, extra, failed)


# The record's type, its one declaration: a hot path that writes the tuple out annotates it with this, so the
# checker holds what it writes to the positions above (no cost when it runs: a local's annotation is not evaluated).
RawMonotonic = tuple[int, int, int, int, int, Any, Any, Form, "Optional[Context]"]


def raw_monotonic(start: int, end: int, nbytes: int, descriptors: int, peer: Any, return_code: Any, form: Form,
                  context: "Optional[Context]") -> RawMonotonic:
    return (RAW_MONOTONIC, start, end, nbytes, descriptors, peer, return_code, form, context or None)


def monotonic_call(rec: Record, offset: int) -> Call:
    """The `call` a RAW_MONOTONIC record holds, its times moved by `offset` (clock.BASE: onto the records' clock)."""
    form, return_code = rec[MONO_FORM], rec[MONO_RETURN_CODE]
    return (rec[MONO_START] + offset, rec[MONO_END] + offset, rec[MONO_BYTES], rec[MONO_DESCRIPTORS], form[FORM_OP],
            rec[MONO_PEER], form[FORM_PROTOCOL], return_code, None if return_code == 0 else form[FORM_FAILED],
            form[FORM_BACKEND], form[FORM_EXTRA])


# RAW_ASYNC: (RAW_ASYNC, start, duration, bytes, descriptors, peer, return code, error, form, context, seen running,
# post): an async submission outside any transfer scope, ended when its completion was seen; `start` on the records'
# clock, the other times in ns from it. The submission's own two figures travel as times, not yet as the attributes
# they become (the builder makes them: no dict per transfer on the engine's threads): `kv_transfer.end_uncertainty_s`
# from when a poll last saw it running (`seen_running`; None: no poll did, its whole send) to its end,
# `kv_transfer.post_s` the time inside the submitting call (`post`, None when unknown). Times from the start are
# small numbers: pickle writes each in a few bytes where a time on the records' clock takes eight and a conversion
# (a third of what the recorder's thread spends pickling an async send).
ASYNC_START = 1
ASYNC_DURATION = 2
ASYNC_BYTES = 3
ASYNC_DESCRIPTORS = 4
ASYNC_PEER = 5
ASYNC_RETURN_CODE = 6
ASYNC_ERROR = 7
ASYNC_FORM = 8  # its call_form: its error is ASYNC_ERROR, not FORM_FAILED (a poll says how it failed)
ASYNC_CONTEXT = 9
ASYNC_SEEN_RUNNING = 10
ASYNC_POST = 11
ASYNC_SIZE = 12  # the record's length (the compiled wait builds it: engines/mooncake/compiled.py, `layout()`)
# The record's type, its one declaration (as RawMonotonic's): recording/pending.py writes it out.
RawAsync = tuple[int, int, int, Union[int, Iterable[int]], int, Any, Any, Optional[str], Form, "Optional[Context]",
                 Optional[int], Optional[int]]


def raw_async(start: int, duration: int, nbytes: Union[int, Iterable[int]], descriptors: int, peer: Any,
              return_code: Any, error: Optional[str], form: Form, context: "Optional[Context]",
              seen_running: Optional[int], post: Optional[int]) -> RawAsync:
    return (RAW_ASYNC, start, duration, nbytes, descriptors, peer, return_code, error, form, context or None,
            seen_running, post)


def async_figures(start: int, end: int, window: int, posted: Optional[int]) -> Attributes:
    """An ended submission's own attributes: how wide the window its end lies in, how long posting took."""
    own: Attributes = {END_UNCERTAINTY_S: (end - window) / 1e9}
    if posted is not None:
        own[POST_S] = (min(posted, end) - start) / 1e9
    return own


def async_times(rec: Record) -> tuple[int, int, int, Optional[int]]:
    """(start, end, window start, posted) of a RAW_ASYNC record, each on the records' clock (posted: None when
    unknown)."""
    start, seen, post = rec[ASYNC_START], rec[ASYNC_SEEN_RUNNING], rec[ASYNC_POST]
    return (start, start + rec[ASYNC_DURATION], start if seen is None else start + seen,
            None if post is None else start + post)


def async_call(rec: Record) -> Call:
    """The `call` a RAW_ASYNC record holds, its own attributes (`async_figures`) added to its form's extra."""
    form = rec[ASYNC_FORM]
    start, end, window, posted = async_times(rec)
    own, extra = async_figures(start, end, window, posted), form[FORM_EXTRA]
    return (start, end, rec[ASYNC_BYTES], rec[ASYNC_DESCRIPTORS], form[FORM_OP], rec[ASYNC_PEER], form[FORM_PROTOCOL],
            rec[ASYNC_RETURN_CODE], rec[ASYNC_ERROR], form[FORM_BACKEND], {**extra, **own} if extra else own)


# BEGIN_REQUEST: (BEGIN_REQUEST, key, start_ns, role, backend, framework, attributes, parent)
# BEGIN_PEER:    (BEGIN_PEER, key, start_ns, span_name, role, backend, framework, attributes, parent)
KEY = 1
TIME = 2
REQ_ROLE = 3
REQ_BACKEND = 4
REQ_FRAMEWORK = 5
REQ_ATTRIBUTES = 6  # dict: framework ids, gen_ai.request.model, expected bytes ...; or None
REQ_PARENT = 7  # a real parent context (the engine's own request span), or None
PEER_SPAN_NAME = 3  # the name of the peer's waiting span: semconv.SPAN_RECEIVE or SPAN_SERVE
PEER_ROLE = 4
PEER_BACKEND = 5
PEER_FRAMEWORK = 6
PEER_ATTRIBUTES = 7
PEER_PARENT = 8


def begin_request(key: Key, start_ns: int, role: str, backend: str, framework: Optional[str],
                  attributes: Optional[Attributes], parent: "Optional[Context]") -> Record:
    return (BEGIN_REQUEST, key, start_ns, role, backend, framework, attributes, parent)


def begin_peer(key: Key, start_ns: int, span_name: str, role: str, backend: str, framework: Optional[str],
               attributes: Optional[Attributes], parent: "Optional[Context]") -> Record:
    return (BEGIN_PEER, key, start_ns, span_name, role, backend, framework, attributes, parent)


# END_REQUEST / END_PEER: (kind, key, end_ns, error_type); END_PEER also (..., outcome_pending)
END_ERROR = 3
END_PENDING = 4  # the peer will say more of this wait (PEER_OUTCOME): its span waits for that before export


def end_request(key: Key, end_ns: int, error: Optional[str] = None) -> Record:
    return (END_REQUEST, key, end_ns, error)


def end_peer(key: Key, end_ns: int, error: Optional[str] = None, pending: bool = False) -> Record:
    return (END_PEER, key, end_ns, error, pending)


# PEER_OUTCOME: (PEER_OUTCOME, key, at_ns, attributes, events): attributes for the peer's span (or None), events
# a tuple of (name, attributes) put on it at at_ns (or None)
OUTCOME_ATTRIBUTES = 3
OUTCOME_EVENTS = 4


def peer_outcome(key: Key, at_ns: int, attributes: Optional[Attributes],
                 events: Optional[tuple[tuple[str, Attributes], ...]]) -> Record:
    return (PEER_OUTCOME, key, at_ns, attributes, events)


# LATE_ARRIVAL: (LATE_ARRIVAL, key, at_ns, backend)
LATE_BACKEND = 3


def late_arrival(key: Key, at_ns: int, backend: str) -> Record:
    return (LATE_ARRIVAL, key, at_ns, backend)


# INFLIGHT: (INFLIGHT, now_ns, open sends, oldest send's start_ns or None, [(start_ns, key, peer, nbytes, backend,
# kind), ...], (open set-up calls, oldest one's start_ns or None)) where the list holds the open sends and set-up
# calls (kind semconv.INFLIGHT_SEND or INFLIGHT_CONNECT) that just became stuck (each reported once)
INFLIGHT_AT = 1
INFLIGHT_COUNT = 2
INFLIGHT_OLDEST = 3
INFLIGHT_STUCK = 4
INFLIGHT_CONNECTS = 5


def inflight(now_ns: int, count: int, oldest: Optional[int], stuck: list[tuple[Any, ...]],
             connects: tuple[int, Optional[int]] = (0, None)) -> Record:
    return (INFLIGHT, now_ns, count, oldest, stuck, connects)


# COMPUTE: (COMPUTE, keys, start_ns, end_ns, chunk_index, clock)
COMPUTE_KEYS = 1
COMPUTE_START = 2
COMPUTE_END = 3
COMPUTE_CHUNK = 4
COMPUTE_CLOCK = 5  # semconv.CLOCK_DEVICE: the times come from the device's timing events; CLOCK_HOST or None: host


def compute(keys: tuple[Key, ...], start_ns: int, end_ns: int, chunk: Optional[int] = None,
            clock: Optional[str] = None) -> Record:
    return (COMPUTE, keys, start_ns, end_ns, chunk, clock)


# CONNECT: (CONNECT, start_ns, end_ns, backend, operation, peer, error, key, context, attributes): `key` the request
# key of the transfer scope the call ran in (its span's parent), else None and `context` the current one (as a raw
# send's); `attributes` what a framework says of it (its name, the peer's address), or None
CONNECT_START = 1
CONNECT_END = 2
CONNECT_BACKEND = 3
CONNECT_OPERATION = 4
CONNECT_PEER = 5  # the engine's own peer name, parsed by the engine's peer_attributes(), or None
CONNECT_ERROR = 6
CONNECT_KEY = 7
CONNECT_CONTEXT = 8
CONNECT_ATTRIBUTES = 9


def connect(start: int, end: int, backend: str, operation: str, peer: Optional[str], error: Optional[str],
            key: Optional[Key], context: "Optional[Context]", attributes: Optional[Attributes] = None) -> Record:
    return (CONNECT, start, end, backend, operation, peer, error, key, context, attributes)

