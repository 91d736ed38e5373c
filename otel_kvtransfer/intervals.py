"""Interval arithmetic for busy time and compute overlap: unions and intersections of [start, end) pairs."""

from typing import Iterable, List, Tuple

Interval = Tuple[int, int]


def union(intervals: Iterable[Interval]) -> List[Interval]:
    """Merge overlapping or touching intervals into a sorted disjoint list."""
    merged: List[Interval] = []
    for start, end in sorted(intervals):
        if end < start:
            start, end = end, start
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def length(disjoint: Iterable[Interval]) -> int:
    return sum(end - start for start, end in disjoint)


def intersection_length(a: List[Interval], b: List[Interval]) -> int:
    """Total length shared by two sorted disjoint lists (as `union` returns them)."""
    total, i, j = 0, 0, 0
    while i < len(a) and j < len(b):
        lo = max(a[i][0], b[j][0])
        hi = min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total
