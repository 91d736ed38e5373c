"""What the vLLM connector patches share: names, the one Patcher, bounded id maps, the model name."""

from otel_kvtransfer import semconv
from otel_kvtransfer.recording.patching import Patcher

FRAMEWORK = "vllm"
REQUEST_ID = "vllm.request_id"  # vLLM's own (engine-internal) id of the request on this side

patcher = Patcher(FRAMEWORK)

# Failure kinds (error.type) the connectors report.
TRANSFER_FAILED = "transfer_failed"
EXPIRED = "expired"  # the producer freed the KV before the consumer read / acknowledged it
PEER_DROPPED = "peer_dropped"  # the producer finished a pull without a result for the request (vLLM >= 0.33)

# Span attributes of vLLM >= 0.33's new paths.
RESEND = "kv_transfer.resend"  # a send that answers a pull sent again (Mooncake: after a LAYOUT_MISS)
REHANDSHAKE = "kv_transfer.rehandshake"  # a request whose read waits for a new handshake (NIXL: remote re-registered)

_MAX_TRACKED = 65536  # requests in flight per process; beyond that the oldest are forgotten


class BoundedMap(dict):
    """A dict that forgets its oldest entries beyond a bound (requests whose end was never seen)."""

    def __init__(self, limit: int = _MAX_TRACKED):
        super().__init__()
        self.limit = limit

    def __setitem__(self, key, value):
        if key not in self and len(self) >= self.limit:
            self.pop(next(iter(self)), None)
        super().__setitem__(key, value)


def model_name(worker):
    """The served model name (what clients put in "model"), else the model path; None when unknown."""
    try:
        model_config = worker.vllm_config.model_config
        name = getattr(model_config, "served_model_name", None) or model_config.model
        if isinstance(name, (list, tuple)):
            name = name[0] if name else None
        return str(name)[:256] if name else None
    except Exception:
        return None


def request_attributes(worker, request_id, with_model: bool) -> dict:
    attributes = {REQUEST_ID: str(request_id)[:256]}
    model = model_name(worker) if with_model else None
    if model:
        attributes[semconv.GEN_AI_REQUEST_MODEL] = model
    return attributes


def bind(names, args, kwargs) -> dict:
    """The named parameters of a call, from positional and keyword arguments alike."""
    params = dict(zip(names, args))
    params.update((k, v) for k, v in kwargs.items() if k in names)
    return params


def has_blocks(block_ids) -> bool:
    """vLLM block ids come per KV-cache group: [[...], [...]]; empty groups move nothing."""
    return any(len(group) > 0 for group in (block_ids or ()))
