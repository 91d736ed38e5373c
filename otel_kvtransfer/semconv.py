"""The names of the design contract (docs/telemetry.md) in one place: spans, attributes, metrics.

Every other module takes its names from here, so a rename is one edit and a typo is an ImportError. Names that
belong to one engine or framework (its backend value, its id attributes) live in that engine's module or that
framework's package, not here.
"""

INSTRUMENTATION_NAME = "otel_kvtransfer"

# Span names.
SPAN_REQUEST = "kv_transfer.request"
SPAN_SEND = "kv_transfer.send"
SPAN_COMPUTE = "kv_transfer.compute"
SPAN_RECEIVE = "kv_transfer.receive"  # the peer's wait in a push (decode)
SPAN_SERVE = "kv_transfer.serve"  # the peer's wait in a pull (prefill)
SPAN_CONNECT = "kv_transfer.connect"  # an explicit set-up call before transfers to a peer (NIXL: add_remote_agent)
CONNECT_OPERATION = "kv_transfer.connect.operation"  # the engine's set-up call: add_remote_agent, make_connection
CONNECT_OUTCOME = "kv_transfer.connect.outcome"
OUTCOME_OK, OUTCOME_ERROR = "ok", "error"

# kv_transfer.* attributes.
REQUEST_KEY = "kv_transfer.request_key"
BOOTSTRAP_ROOM = "kv_transfer.bootstrap_room"  # kept on the spans of frameworks whose key is a bootstrap room
ROLE = "kv_transfer.role"
BACKEND = "kv_transfer.backend"
FRAMEWORK = "kv_transfer.framework"
PROTOCOL = "kv_transfer.protocol"
BYTES = "kv_transfer.bytes"
LOGICAL_BYTES = "kv_transfer.logical_bytes"
EXPECTED_BYTES = "kv_transfer.expected_bytes"
TRANSFER_COUNT = "kv_transfer.transfer_count"
CHUNK_COUNT = "kv_transfer.chunk_count"
REPLICA_FACTOR = "kv_transfer.replica_factor"
BUSY_S = "kv_transfer.busy_s"
THROUGHPUT = "kv_transfer.throughput"
COMPUTE_OVERLAP_S = "kv_transfer.compute_overlap_s"
COMPUTE_OVERLAP_RATIO = "kv_transfer.compute_overlap_ratio"
# The tail: what the first decode step waited for after the request's compute ended (initiator side, one clock).
TAIL_S = "kv_transfer.tail_s"
TAIL_BUSY_S = "kv_transfer.tail_busy_s"
TAIL_QUEUED_S = "kv_transfer.tail_queued_s"
# Whose clock a compute span's times are on: the device's timing events around the forward, or the host's clock
# around its launch (a CPU forward; a device whose events could not be read).
COMPUTE_CLOCK = "kv_transfer.compute.clock"
CLOCK_DEVICE, CLOCK_HOST = "device", "host"
# How late an observed end can be: time since the previous poll that saw the send unfinished.
END_UNCERTAINTY_S = "kv_transfer.end_uncertainty_s"
# Post vs wire: the time inside the call that posted a send (NIXL's transfer(), Mooncake's async submit); the rest
# of the send is the wire (and the engine's queues).
POST_S = "kv_transfer.post_s"
# Set-up hidden in a transfer: the first send to a peer of an engine that connects inside its first call.
FIRST_TO_PEER = "kv_transfer.first_to_peer"
# The local device (NIC) a send went out on, where known: the one the caller named for the call, else the engine's
# only configured device. Also on kv_transfer.failures (a host has few NICs).
NIC = "kv_transfer.nic"
# Integrity: the framework's own check of the KV a receiver got (sglang's KV checksum), on its receive span; a
# mismatch adds the event with the framework's two digests, as it prints them.
INTEGRITY = "kv_transfer.integrity"
INTEGRITY_VERIFIED, INTEGRITY_MISMATCH = "verified", "mismatch"
EVENT_INTEGRITY_MISMATCH = "kv_transfer.integrity_mismatch"
INTEGRITY_EXPECTED_DIGEST = "kv_transfer.integrity.expected_digest"
INTEGRITY_COMPUTED_DIGEST = "kv_transfer.integrity.computed_digest"
# Allocation wait: on the receiving side of a push, from the request's admission until its KV memory was reserved
# and it asked for its KV (the receive span's start).
ALLOCATION_WAIT_S = "kv_transfer.allocation_wait_s"
# Late completion: a send that ended after its request had concluded (span event on the send).
EVENT_LATE_COMPLETION = "kv_transfer.late_completion"
AFTER_REQUEST_END_S = "kv_transfer.after_request_end_s"
DESCRIPTOR_COUNT = "kv_transfer.descriptor_count"
ENGINE_CALLS = "kv_transfer.engine_calls"
PAYLOAD = "kv_transfer.payload"
OP = "kv_transfer.op"
CHUNK_INDEX = "kv_transfer.chunk_index"
IS_LAST_CHUNK = "kv_transfer.is_last_chunk"
PREFIX_EARLY_SEND = "kv_transfer.prefix_early_send"
DESTINATION_INDEX = "kv_transfer.destination_index"
RETURN_CODE = "kv_transfer.return_code"
NOTIFICATION = "kv_transfer.notification"
EVICTED = "kv_transfer.evicted"
# What ended a span the request's own end never did: the process ending with it still open (ERROR too).
ENDED_BY = "kv_transfer.ended_by"
DROP_REASON = "kv_transfer.drop_reason"
# Ranks (production shapes): this engine's own rank as its framework knows it, and a send's destination's.
TP_RANK = "kv_transfer.tp_rank"
DP_RANK = "kv_transfer.dp_rank"  # only under data-parallel attention
PEER_RANK = "kv_transfer.peer_rank"
RANK_ATTRIBUTES = (TP_RANK, DP_RANK)  # request-level: the builder repeats them on the request's sends and compute

# Standard keys.
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
NETWORK_TRANSPORT = "network.transport"
NETWORK_IO_DIRECTION = "network.io.direction"
ERROR_TYPE = "error.type"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"

# network.transport takes only the well-known values of the semantic conventions; anything else an engine
# reports (rdma, efa, nvlink, ucx, ...) goes to kv_transfer.protocol.
WELL_KNOWN_TRANSPORTS = frozenset({"tcp", "udp", "pipe", "unix", "quic"})

# Values.
BACKEND_MOONCAKE = "mooncake"  # kv_transfer.backend of each transfer engine (its spec's name)
BACKEND_NIXL = "nixl"
ROLE_PREFILL = "prefill"
ROLE_DECODE = "decode"
PAYLOAD_KV = "kv"
PAYLOAD_AUX = "aux"
PAYLOAD_STATE = "state"
# Bytes that move through the same engines but are not a request's KV: their sends
# belong to no request; only the per-send metrics count them, under their payload label.
PAYLOAD_ENCODER_CACHE = "encoder_cache"  # vLLM's encoder-cache (EC) connectors: multimodal encoder outputs
PAYLOAD_EXPERT_WEIGHTS = "expert_weights"  # vLLM's EPLB: MoE expert weights moved between ranks
PAYLOAD_OFFLOAD = "offload"  # KV moved between a device and a storage tier (SGLang HiCache, vLLM's offloading)
NON_KV_PAYLOADS = frozenset({PAYLOAD_ENCODER_CACHE, PAYLOAD_EXPERT_WEIGHTS, PAYLOAD_OFFLOAD})
OP_WRITE = "write"
OP_READ = "read"
DIRECTION_TRANSMIT = "transmit"
DIRECTION_RECEIVE = "receive"
DIRECTION_OF_OP = {OP_WRITE: DIRECTION_TRANSMIT, OP_READ: DIRECTION_RECEIVE}
EVICTED_ERROR = "evicted"
ENDED_BY_PROCESS_EXIT = "process_exit"  # kv_transfer.ended_by, and error.type, of what was open at exit

# Metrics.
METRIC_DURATION = "kv_transfer.duration"
METRIC_SIZE = "kv_transfer.size"
METRIC_THROUGHPUT = "kv_transfer.throughput"
METRIC_FAILURES = "kv_transfer.failures"
METRIC_DESCRIPTORS = "kv_transfer.descriptors"  # not in the contract's table: asked for by the dashboards
METRIC_REQUEST_DURATION = "kv_transfer.request.duration"
METRIC_REQUEST_SIZE = "kv_transfer.request.size"
METRIC_REQUEST_THROUGHPUT = "kv_transfer.request.throughput"
METRIC_REQUEST_COMPUTE_OVERLAP = "kv_transfer.request.compute_overlap"
METRIC_RECEIVE_DURATION = "kv_transfer.receive.duration"
METRIC_REQUEST_TAIL = "kv_transfer.request.tail"
METRIC_REQUEST_TAIL_QUEUED = "kv_transfer.request.tail_queued"
METRIC_PEER_THROUGHPUT = "kv_transfer.peer.throughput"  # with kv_transfer.peer.busy_time, the metrics with a peer
METRIC_POST_DURATION = "kv_transfer.post.duration"
METRIC_LATE_COMPLETIONS = "kv_transfer.late_completions"
METRIC_PEER_BUSY_TIME = "kv_transfer.peer.busy_time"  # per peer, as kv_transfer.peer.throughput
METRIC_BUSY_TIME = "kv_transfer.busy_time"  # per backend and role, over all peers
METRIC_CONNECT_DURATION = "kv_transfer.connect.duration"  # per backend, framework and outcome
METRIC_INTEGRITY_MISMATCHES = "kv_transfer.integrity_mismatches"  # per backend and framework
METRIC_RECEIVE_ALLOCATION_WAIT = "kv_transfer.receive.allocation_wait"  # per backend and framework
PEER_THROUGHPUT_MIN_BYTES = 1 << 20  # sends below this say more about latency than about the link
PEER_OTHER = "other"  # server.address of every peer beyond the per-process cap
METRIC_INFLIGHT = "kv_transfer.inflight"
METRIC_INFLIGHT_OLDEST_AGE = "kv_transfer.inflight.oldest_age"
METRIC_STUCK = "kv_transfer.stuck"
INFLIGHT_KIND = "kv_transfer.inflight.kind"
INFLIGHT_SEND, INFLIGHT_REQUEST, INFLIGHT_PEER, INFLIGHT_CONNECT = "send", "request", "peer", "connect"
EVENT_STUCK = "kv_transfer.stuck"
STUCK_AGE_S = "kv_transfer.stuck.age_s"
METRIC_DROPPED = "kv_transfer.instrumentation.dropped"
DROPPED_DESCRIPTION = "Records the instrumentation had to drop (queue full, evicted requests, own errors)"
# Calls of an engine class that are neither timed nor known to move no bytes (a newer release's call): counted.
METRIC_UNTIMED_CALLS = "kv_transfer.instrumentation.untimed_calls"
UNTIMED_CALLS_DESCRIPTION = "Calls of an engine class this package does not time; bytes they move are in no span"
CODE_FUNCTION_NAME = "code.function.name"

# Attributes a metric point may carry: low cardinality only (docs/telemetry.md).
METRIC_ATTRIBUTES = (BACKEND, FRAMEWORK, ROLE, PAYLOAD, ERROR_TYPE, REPLICA_FACTOR, GEN_AI_REQUEST_MODEL)
