"""What the prefill and decode hooks of sglang share: names, the one Patcher, sglang's poll states, failure
kinds, and sglang's own request span when its tracing is on."""

from otel_kvtransfer import semconv
from otel_kvtransfer.engines.mooncake import BACKEND
from otel_kvtransfer.patching import Patcher

FRAMEWORK = "sglang"
RID = "sglang.rid"

patcher = Patcher(FRAMEWORK)
classes = {}  # "chunk" | "manager" | "sender" | "receiver" -> the sglang class, filled as modules are patched
_poll_names = {}  # KVPoll.Success -> "Success", KVPoll.Failed -> "Failed"


def learn_poll_states(kv_poll) -> None:
    _poll_names.update({kv_poll.Success: "Success", kv_poll.Failed: "Failed"})


def poll_name(status):
    """"Success", "Failed", or None for any other state."""
    return _poll_names.get(status)


def room_attributes(room, rid=None) -> dict:
    attrs = {semconv.BOOTSTRAP_ROOM: room}
    if rid is not None:
        attrs[RID] = str(rid)[:256]
    return attrs


def is_instance(obj, name: str) -> bool:
    cls = classes.get(name)
    return cls is not None and isinstance(obj, cls)


_FAILURE_TYPES = (
    ("timed out", "bootstrap_timeout"),
    ("Aborted", "aborted"),
    ("is not alive", "decode_session_failed"),
    ("Failed to send kv chunk", "kv_send_failed"),
    ("Failed to send state", "state_send_failed"),
    ("Failed to send aux", "aux_send_failed"),
    ("layout", "state_layout_rejected"),
    ("Duplicate or cancelled", "bootstrap_failed"),
    ("Decode instance could be dead", "decode_session_failed"),
)


def error_type_of(reason) -> str:
    """A low-cardinality error.type from sglang's free-text failure reason."""
    text = str(reason or "")
    for needle, kind in _FAILURE_TYPES:
        if needle in text:
            return kind
    return "transfer_failed"


def sglang_parent(trace_ctx):
    """sglang's own request span context (`--enable-trace`), or None."""
    if trace_ctx is None or not getattr(trace_ctx, "tracing_enable", False):
        return None
    return getattr(trace_ctx, "root_span_context", None)


__all__ = ["BACKEND", "FRAMEWORK", "RID", "patcher", "classes", "learn_poll_states", "poll_name",
           "room_attributes", "is_instance", "error_type_of", "sglang_parent"]
