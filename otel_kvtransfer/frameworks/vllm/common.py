"""What the vLLM connector patches share: names, the one Patcher, bounded id maps, the model name."""

from otel_kvtransfer import semconv
from otel_kvtransfer.recording.patching import Patcher
from otel_kvtransfer.wiring import startup

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
    attributes.update(rank_attributes(worker))
    return attributes


_RANKS = "_otel_kvt_ranks"  # set on a connector worker: its rank attributes, read once
# vLLM's kv_role -> the role the start-up line names (a kv_both engine serves either side, request by request).
_ROLES = {"kv_producer": semconv.ROLE_PREFILL, "kv_consumer": semconv.ROLE_DECODE, "kv_both": "prefill and decode"}


def _int(value):
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def rank_attributes(worker) -> dict:
    """The connector worker's rank as vLLM knows it: `kv_transfer.tp_rank` = its tensor-parallel rank (what it
    tells its peers as its tp rank), `kv_transfer.dp_rank` = its data-parallel rank when vLLM runs more than one.
    Read once per worker; the first read names the process's role and rank in the start-up line."""
    ranks = getattr(worker, _RANKS, None)
    if ranks is None:
        ranks = {}
        tp_rank = _int(getattr(worker, "tp_rank", None))
        if tp_rank is not None:
            ranks[semconv.TP_RANK] = tp_rank
        config = getattr(worker, "vllm_config", None)
        parallel = getattr(config, "parallel_config", None)
        if (_int(getattr(parallel, "data_parallel_size", 1)) or 1) > 1:
            dp_rank = _int(getattr(worker, "dp_rank", None))
            dp_rank = dp_rank if dp_rank is not None else _int(getattr(parallel, "data_parallel_rank", None))
            if dp_rank is not None:
                ranks[semconv.DP_RANK] = dp_rank
        setattr(worker, _RANKS, ranks)
        role = _ROLES.get(str(getattr(getattr(config, "kv_transfer_config", None), "kv_role", "")))
        startup.role_known(FRAMEWORK, role, ranks)
    return ranks


def learn_ranks(instance, args, kwargs, token, result, error) -> None:
    """After a connector worker's __init__: its rank, and the process's start-up line."""
    if error is None:
        rank_attributes(instance)


def bind(names, args, kwargs) -> dict:
    """The named parameters of a call, from positional and keyword arguments alike."""
    params = dict(zip(names, args))
    params.update((k, v) for k, v in kwargs.items() if k in names)
    return params


def has_blocks(block_ids) -> bool:
    """vLLM block ids come per KV-cache group: [[...], [...]]; empty groups move nothing."""
    return any(len(group) > 0 for group in (block_ids or ()))
