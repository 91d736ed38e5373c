"""What the prefill and decode hooks of sglang share: names, the one Patcher, the transfer backend behind each
sglang class, sglang's poll states, failure kinds, and sglang's own request span when its tracing is on."""

from typing import Any, Dict, Optional

from otel_kvtransfer import semconv
from otel_kvtransfer.recording.patching import Patcher
from otel_kvtransfer.wiring import startup

FRAMEWORK = "sglang"
RID = "sglang.rid"
MOONCAKE, NIXL = semconv.BACKEND_MOONCAKE, semconv.BACKEND_NIXL  # the engines' names, not their modules

patcher = Patcher(FRAMEWORK)
classes: Dict[str, type] = {}  # "chunk" -> sglang's TransferKVChunk, filled as modules are patched
# "manager" | "sender" | "receiver" -> {sglang class: the transfer engine behind it}: the Common* methods we wrap
# serve every backend, and only the backends registered here are instrumented.
_backends: Dict[str, Dict[type, str]] = {}
_poll_names: Dict[Any, str] = {}  # KVPoll.Success -> "Success", KVPoll.Failed -> "Failed"


def register(kind: str, cls, backend: str) -> None:
    _backends.setdefault(kind, {})[cls] = backend


def backend_of(obj, kind: str) -> Optional[str]:
    """The transfer engine behind an sglang manager / sender / receiver; None for a backend we do not know."""
    for cls, backend in _backends.get(kind, {}).items():
        if isinstance(obj, cls):
            return backend
    return None


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


_RANKS = "_otel_kvt_ranks"  # set on a KV manager: its rank attributes, read once


def rank_attributes(mgr) -> dict:
    """This engine's rank as sglang's KV manager knows it: `kv_transfer.tp_rank` = `kv_args.engine_rank` (what
    sglang sends its peers as this rank's tp rank), `kv_transfer.dp_rank` = the attention DP rank under
    data-parallel attention. Read once per manager; the first read names the process's role and rank in the
    start-up line."""
    ranks = getattr(mgr, _RANKS, None)
    if ranks is None:
        ranks = {}
        rank = getattr(getattr(mgr, "kv_args", None), "engine_rank", None)
        if isinstance(rank, int) and not isinstance(rank, bool):
            ranks[semconv.TP_RANK] = rank
        if (getattr(mgr, "attn_dp_size", 1) or 1) > 1 and isinstance(getattr(mgr, "attn_dp_rank", None), int):
            ranks[semconv.DP_RANK] = mgr.attn_dp_rank
        setattr(mgr, _RANKS, ranks)
        mode: Any = getattr(getattr(mgr, "disaggregation_mode", None), "name", None)
        role = {"PREFILL": semconv.ROLE_PREFILL, "DECODE": semconv.ROLE_DECODE}.get(mode)
        device = getattr(getattr(mgr, "kv_args", None), "ib_device", None)  # --disaggregation-ib-device
        startup.role_known(FRAMEWORK, role, ranks, {"--disaggregation-ib-device": device} if device else None)
    return ranks


# How each backend's KVArgsRegisterInfo (manager.decode_kv_args_table[session]) names the decode rank.
_PEER_RANK_FIELDS = ("dst_tp_rank", "decode_tp_rank")


def peer_rank(mgr, session):
    """The destination's tp rank as its decode manager registered it (its engine_rank), or None."""
    info = (getattr(mgr, "decode_kv_args_table", None) or {}).get(session)
    for name in _PEER_RANK_FIELDS:
        rank = getattr(info, name, None)
        if isinstance(rank, int) and not isinstance(rank, bool):
            return rank
    return None


def is_instance(obj, kind: str) -> bool:
    return backend_of(obj, kind) is not None


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


__all__ = ["MOONCAKE", "NIXL", "FRAMEWORK", "RID", "patcher", "classes", "register", "backend_of",
           "learn_poll_states", "poll_name", "room_attributes", "rank_attributes", "peer_rank", "is_instance",
           "error_type_of", "sglang_parent"]
