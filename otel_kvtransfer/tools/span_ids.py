"""The span identities a read has seen, to leave out a span that repeats one (a batch written twice by a retrying
exporter, or a writer that reuses ids): the first span of each (trace id, span id) is kept.

A span file of 10^6 spans must not cost a Python object per span, so each identity is kept as its 64-bit hash in
an open-addressing table of machine integers (16-32 bytes a span, against ~90 for a set of Python ints). Two
different identities with the same hash would make the second look like a repeat: with a hash seeded per process
that is about n^2 / 2^65 for n spans, 3 in 10^8 for a file of 10^6; such a span is counted and reported like any
repeat, never merged silently.
"""

from __future__ import annotations

from array import array

_EMPTY = 0
_MIN_SLOTS = 1 << 10


class SpanIds:
    """`seen(trace_id, span_id)`: True when that identity was given before, else remembers it."""

    def __init__(self):
        self._slots = array("q", [_EMPTY]) * _MIN_SLOTS
        self._mask = _MIN_SLOTS - 1
        self._used = 0

    def __len__(self) -> int:
        return self._used

    def seen(self, trace_id: str, span_id: str) -> bool:
        key = hash((trace_id, span_id)) or 1  # 0 marks an empty slot
        if self._find(key):
            return True
        if 2 * (self._used + 1) > len(self._slots):  # at most half full: probes stay short
            self._grow()
        self._insert(key)
        return False

    def _find(self, key: int) -> bool:
        slots, mask = self._slots, self._mask
        index = key & mask
        while True:
            value = slots[index]
            if value == key:
                return True
            if value == _EMPTY:
                return False
            index = (index + 1) & mask

    def _insert(self, key: int) -> None:
        slots, mask = self._slots, self._mask
        index = key & mask
        while slots[index] != _EMPTY:
            index = (index + 1) & mask
        slots[index] = key
        self._used += 1

    def _grow(self) -> None:
        old = self._slots
        self._slots = array("q", [_EMPTY]) * (2 * len(old))
        self._mask = len(self._slots) - 1
        self._used = 0
        for key in old:
            if key != _EMPTY:
                self._insert(key)
