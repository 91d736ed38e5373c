"""A send's shared attributes (its shape) are cached per request: every field of the transfer's description that
its attributes carry must tell two shapes apart, or a send takes another's value. Sends of one request that differ
only in their replica factor (1, 2, 1, 4) keep their own."""

from otel_kvtransfer import integration as kvt
from otel_kvtransfer import semconv
from otel_kvtransfer.building import send_attributes
from otel_kvtransfer.recording import records as r
from otel_kvtransfer.recording.clock import now_ns

KEY = 5_100_000
FACTORS = (1, 2, 1, 4)


def _call(nbytes):
    now = now_ns()
    return r.call(now, now + 1_000, nbytes, 1, semconv.OP_WRITE, "127.0.0.1:1", "tcp", 0, None, "test-engine")


def test_sends_of_one_request_keep_their_own_replica_factor(telemetry):
    kvt.begin_request(KEY, backend="test-engine")
    for chunk, factor in enumerate(FACTORS):
        with kvt.transfer_scope(KEY, chunk_index=chunk, replica_factor=factor):
            kvt.deliver(_call(8))
    kvt.end_request(KEY)
    sends = sorted(telemetry.spans(semconv.SPAN_SEND), key=lambda s: s.attributes[semconv.CHUNK_INDEX])
    assert [s.attributes[semconv.REPLICA_FACTOR] for s in sends] == list(FACTORS)
    (request,) = telemetry.spans(semconv.SPAN_REQUEST)
    assert request.attributes[semconv.REPLICA_FACTOR] == max(FACTORS)


def test_one_shape_cache_tells_every_field_of_the_description_apart():
    """The same, on the attribute function itself with one cache: each field of the info in turn."""
    base = dict(chunk_index=0, payload=semconv.PAYLOAD_KV, destination_index=0, replica_factor=1,
                is_last_chunk=False, prefix_early_send=False, attributes=None)
    variants = [("replica_factor", semconv.REPLICA_FACTOR, (1, 2, 1, 4)),
                ("destination_index", semconv.DESTINATION_INDEX, (0, 1, 0, 3)),
                ("payload", semconv.PAYLOAD, (semconv.PAYLOAD_KV, semconv.PAYLOAD_AUX, semconv.PAYLOAD_KV)),
                ("is_last_chunk", semconv.IS_LAST_CHUNK, (False, True, False)),
                ("prefix_early_send", semconv.PREFIX_EARLY_SEND, (False, True, False))]
    for field, attribute, values in variants:
        cache = {}
        seen = []
        for value in values:
            info = r.info(KEY, *{**base, field: value}.values())
            figures = send_attributes.measure_call(_call(8), None)
            seen.append(send_attributes.attributes(figures, info, None, cache, {})[attribute])
        assert seen == list(values), field
