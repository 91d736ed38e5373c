"""Interval packing shared by the timeline (rows of a lane) and the Perfetto export (threads of a lane)."""

import heapq
from typing import Callable, List, Sequence, TypeVar

T = TypeVar("T")


def pack(items: Sequence[T], start: Callable[[T], int], end: Callable[[T], int]) -> List[int]:
    """The row of each item (items sorted by start) such that no two items of a row overlap, using as few rows
    as possible and the lowest free row first; O(n log n)."""
    rows: List[int] = []
    busy: list = []  # (end, row) of rows in use
    free: List[int] = []  # rows whose last item has ended
    count = 0
    for item in items:
        begin = start(item)
        while busy and busy[0][0] <= begin:
            heapq.heappush(free, heapq.heappop(busy)[1])
        if free:
            row = heapq.heappop(free)
        else:
            row, count = count, count + 1
        heapq.heappush(busy, (end(item), row))
        rows.append(row)
    return rows
