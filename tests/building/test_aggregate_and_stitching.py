"""The aggregate rules (busy time, throughput, logical bytes, overlap, quantiles) against hand-computed values,
and the stitching formula of the design contract ("Trace stitching", docs/telemetry.md) written out independently
here."""

import hashlib
import math

import pytest
from opentelemetry.trace import get_current_span

from otel_kvtransfer.building import aggregate
from otel_kvtransfer.building.aggregate import RequestAggregate
from otel_kvtransfer.building.stitching import is_synthetic, key_parent_context, key_span_id, key_trace_id

# --- aggregate ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("intervals, merged", [
    ([], []),
    ([(5, 10)], [(5, 10)]),
    ([(5, 10), (0, 3)], [(0, 3), (5, 10)]),  # sorted
    ([(0, 5), (5, 8)], [(0, 8)]),  # touching merge
    ([(0, 10), (2, 3), (4, 12)], [(0, 12)]),  # contained and overlapping
    ([(10, 0)], [(0, 10)]),  # a reversed pair is put right
    ([(0, 1), (0, 1)], [(0, 1)]),
])
def test_union(intervals, merged):
    assert aggregate.union(intervals) == merged


def test_length_and_intersection():
    a = aggregate.union([(0, 10), (20, 30)])
    b = aggregate.union([(5, 25), (28, 40)])
    assert aggregate.length(a) == 20
    assert aggregate.length(b) == 32
    # shared: [5,10) + [20,25) + [28,30) = 5 + 5 + 2
    assert aggregate.intersection_length(a, b) == 12
    assert aggregate.intersection_length(b, a) == 12
    assert aggregate.intersection_length(a, []) == 0
    assert aggregate.intersection_length([(0, 5)], [(5, 9)]) == 0  # touching shares nothing


def test_throughput_and_logical_share():
    assert aggregate.throughput(1_000, 2_000) == 5e8
    assert aggregate.throughput(1_000, 0) == 0.0
    assert aggregate.throughput(1_000, -5) == 0.0
    assert aggregate.logical_share(900, 3) == 300
    assert aggregate.logical_share(900, None) == 900
    assert aggregate.logical_share(900, 0) == 900  # no replica factor below 1


@pytest.mark.parametrize("values, q, expected", [
    ([1, 2, 3, 4], 0.5, 2.5),
    ([1, 2, 3, 4], 0.0, 1),
    ([1, 2, 3, 4], 1.0, 4),
    ([1, 2, 3, 4], 0.9, 3.7),  # pos 2.7: 3 + 0.7 * (4 - 3)
    ([10], 0.99, 10),
    ([0, 10], 2.0, 10),  # q clamped
    ([0, 10], -1.0, 0),
])
def test_quantile_interpolates_between_ranks(values, q, expected):
    assert aggregate.quantile(values, q) == pytest.approx(expected)


def test_quantile_of_nothing_is_nan():
    assert math.isnan(aggregate.quantile([], 0.5))


def test_request_aggregate_figures():
    agg = RequestAggregate()
    agg.add_send(1_000, 3_000, 1_000, replica_factor=2, chunk_index=0)
    agg.add_send(2_000, 5_000, 3_000, replica_factor=2, chunk_index=1)
    agg.add_send(8_000, 9_000, 9, replica_factor=3, chunk_index=1)
    assert agg.figures() == {
        "bytes": 4_009, "logical_bytes": 500 + 1_500 + 3, "transfer_count": 3, "chunk_count": 2,
        "replica_factor": 3, "busy_ns": 4_000 + 1_000, "throughput": 4_009 * 1e9 / 5_000,
    }
    agg.add_compute(0, 2_500)
    agg.add_compute(4_500, 8_500)
    figures = agg.figures()
    assert (figures["overlap_ns"], figures["overlap_ratio"]) == (1_500 + 500 + 500, 0.5)


def test_request_aggregate_without_sends():
    agg = RequestAggregate()
    assert agg.figures() == {"bytes": 0, "logical_bytes": 0, "transfer_count": 0, "chunk_count": 0,
                             "replica_factor": 1, "busy_ns": 0, "throughput": 0.0}
    agg.add_compute(0, 10)
    assert (agg.figures()["overlap_ns"], agg.figures()["overlap_ratio"]) == (0, 0.0)


# --- stitching ------------------------------------------------------------------------------------------------------


def design_ids(data: bytes):
    """The design contract's formula, verbatim."""
    trace_id = int.from_bytes(hashlib.blake2b(data, digest_size=16, person=b"kv_transfer").digest(), "big")
    span_id = int.from_bytes(hashlib.blake2b(data, digest_size=8, person=b"kv_transfer.req").digest(), "big")
    return trace_id, span_id


@pytest.mark.parametrize("room", [0, 1, 42, 2**32 + 7, 2**63 - 1, 2**64 - 1])
def test_int_keys_follow_the_design_formula(room):
    assert (key_trace_id(room), key_span_id(room)) == design_ids(room.to_bytes(8, "big"))


def test_known_values_do_not_drift():
    """Both sides of a deployment may run different versions: the ids of a key must never change."""
    assert (f"{key_trace_id(42):032x}", f"{key_span_id(42):016x}") == (
        "1ac689b71e2ef4d7fca3e3535c82ab41", "77261da3d80f8f14")
    assert f"{key_trace_id('xfer-7f3a'):032x}" == "a5efa5da66f34d19a7692688d2bb505d"


@pytest.mark.parametrize("key", ["", "xfer-7f3a", "cmpl-\u00e9\u4e2d", "x" * 300])
def test_str_keys_hash_their_utf8_bytes_with_the_same_parameters(key):
    assert (key_trace_id(key), key_span_id(key)) == design_ids(key.encode("utf-8"))


def test_an_int_key_and_its_decimal_string_are_different_traces():
    assert key_trace_id(7) != key_trace_id("7")


def test_the_synthetic_parent_is_remote_unsampled_and_marked():
    parent = get_current_span(key_parent_context(99)).get_span_context()
    assert (parent.trace_id, parent.span_id) == design_ids((99).to_bytes(8, "big"))
    assert parent.is_remote
    assert not parent.trace_flags.sampled  # it must never decide sampling
    assert is_synthetic(parent)
