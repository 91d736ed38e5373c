"""Busy time and overlap arithmetic, and the room-derived synthetic parent of DESIGN."""

from hashlib import blake2b

from opentelemetry import trace

from otel_kvtransfer import intervals
from otel_kvtransfer.stitching import room_parent_context, room_span_id, room_trace_id


def test_union_merges_overlapping_and_touching_intervals():
    assert intervals.union([(5, 7), (0, 2), (1, 3), (3, 4), (10, 12)]) == [(0, 4), (5, 7), (10, 12)]
    assert intervals.union([]) == []
    assert intervals.length(intervals.union([(0, 10), (2, 3), (20, 25)])) == 15


def test_intersection_of_two_unions():
    busy = intervals.union([(0, 10), (20, 30)])
    compute = intervals.union([(5, 25)])
    assert intervals.intersection_length(busy, compute) == 10
    assert intervals.intersection_length(busy, []) == 0
    assert intervals.intersection_length([(0, 100)], [(10, 20), (30, 40)]) == 20


def test_room_ids_follow_the_design_formula():
    room = 123456789
    key = room.to_bytes(8, "big")
    assert room_trace_id(room) == int.from_bytes(
        blake2b(key, digest_size=16, person=b"kv_transfer").digest(), "big")
    assert room_span_id(room) == int.from_bytes(
        blake2b(key, digest_size=8, person=b"kv_transfer.req").digest(), "big")
    parent = trace.get_current_span(room_parent_context(room)).get_span_context()
    assert (parent.trace_id, parent.span_id) == (room_trace_id(room), room_span_id(room))
    assert parent.is_remote and parent.trace_flags.sampled
    assert room_trace_id(room) != room_trace_id(room + 1)
