"""Settings read from OTEL_KVTRANSFER_* environment variables.

Garbage never stops the engine: a value that does not parse, or lies outside its range, is logged once and the
default is used instead. The ranges bound memory: at ~540 B a queued record, the largest queue is ~140 MiB.
"""

import logging
import math
import os
from dataclasses import dataclass
from typing import Callable, Tuple, TypeVar

_logger = logging.getLogger(__name__)

QUEUE_SIZE = "OTEL_KVTRANSFER_QUEUE_SIZE"
FLUSH_INTERVAL_MS = "OTEL_KVTRANSFER_FLUSH_INTERVAL_MS"
REQUEST_TTL_S = "OTEL_KVTRANSFER_REQUEST_TTL_S"
MAX_OPEN_REQUESTS = "OTEL_KVTRANSFER_MAX_OPEN_REQUESTS"
MAX_PENDING_ASYNC = "OTEL_KVTRANSFER_MAX_PENDING_ASYNC"
BUILDER = "OTEL_KVTRANSFER_BUILDER"
# Where spans are built: a helper process, the engine process's own thread, or (auto) the helper when it can set
# up the same SDK as this process (builder_choice).
BUILDERS = ("auto", "process", "thread")
MAX_PEERS = "OTEL_KVTRANSFER_MAX_PEERS"
STUCK_S = "OTEL_KVTRANSFER_STUCK_S"
PIPELINE = "OTEL_KVTRANSFER_PIPELINE"
LATE_WATCH_S = "OTEL_KVTRANSFER_LATE_WATCH_S"
HOT_PATH = "OTEL_KVTRANSFER_HOT_PATH"
# The engines' hottest wrappers (an async send's submission and wait): compiled where the package was built with
# its C extension (engines/mooncake/compiled.py), or the Python wrappers, which every call falls back to either way.
HOT_PATHS = ("compiled", "python")
PIPELINES = ("direct", "sdk")  # how: spans and metric points built directly, or through the SDK tracer/instruments


@dataclass(frozen=True)
class Settings:
    queue_size: int = 65536  # transfer records waiting for the span builder
    flush_interval_s: float = 0.2  # how often the background thread turns records into spans
    request_ttl_s: float = 600.0  # a request open this long without activity is ended and counted as evicted
    max_open_requests: int = 65536  # open request + peer spans; beyond it the least recently active is evicted
    max_pending_async: int = 16384  # async submissions waiting for their completion to be observed
    builder: str = "auto"  # one of BUILDERS
    pipeline: str = "direct"  # one of PIPELINES
    max_peers: int = 64  # distinct peers on kv_transfer.peer.throughput per process; the rest are `other`
    stuck_s: float = 30.0  # an open transfer, request or peer wait older than this is reported as stuck
    late_watch_s: float = 30.0  # a peer wait that ended with an error waits this long for late KV before export
    hot_path: str = "compiled"  # one of HOT_PATHS


_Number = TypeVar("_Number", int, float)


def _read(name: str, parse: Callable[[str], _Number], default: _Number, low: _Number, high: _Number) -> _Number:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = parse(raw.strip())
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError("not a finite number")
        if not low <= value <= high:
            raise ValueError(f"outside [{low}, {high}]")
    except (ValueError, OverflowError) as exc:
        _logger.warning("otel_kvtransfer: ignoring %s=%r (%s); using %r", name, raw[:64], exc, default)
        return default
    return value


def _read_choice(name: str, choices: Tuple[str, ...], default: str) -> str:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value not in choices:
        _logger.warning("otel_kvtransfer: ignoring %s=%r (one of %s); using %r", name, raw[:64], ", ".join(choices),
                        default)
        return default
    return value


def load() -> Settings:
    return Settings(
        queue_size=_read(QUEUE_SIZE, int, Settings.queue_size, 1, 1 << 18),
        flush_interval_s=_read(FLUSH_INTERVAL_MS, float, Settings.flush_interval_s * 1000, 1, 60_000) / 1000,
        request_ttl_s=_read(REQUEST_TTL_S, float, Settings.request_ttl_s, 0.001, 86_400 * 7),
        max_open_requests=_read(MAX_OPEN_REQUESTS, int, Settings.max_open_requests, 1, 1 << 20),
        max_pending_async=_read(MAX_PENDING_ASYNC, int, Settings.max_pending_async, 1, 1 << 20),
        builder=_read_choice(BUILDER, BUILDERS, Settings.builder),
        pipeline=_read_choice(PIPELINE, PIPELINES, Settings.pipeline),
        max_peers=_read(MAX_PEERS, int, Settings.max_peers, 1, 1 << 16),
        stuck_s=_read(STUCK_S, float, Settings.stuck_s, 0.01, 86_400 * 7),
        late_watch_s=_read(LATE_WATCH_S, float, Settings.late_watch_s, 0, 3600),
        hot_path=_read_choice(HOT_PATH, HOT_PATHS, Settings.hot_path),
    )
