"""What the recorder had to drop, by reason, until its thread reports it to the sink (which counts it in
`kv_transfer.instrumentation.dropped`). Any thread may drop; the first drop of each reason is logged."""

import logging
import threading
from typing import Optional

from otel_kvtransfer.recording.sink import Sink

_logger = logging.getLogger(__name__)


class DropCounts:
    def __init__(self) -> None:
        # Reentrant: a NIXL handle freed by the garbage collector may count a drop on a thread already counting one.
        self._lock = threading.RLock()
        self._pending: dict[str, int] = {}  # reason -> count, not reported yet
        self._logged: set[str] = set()

    def add(self, reason: str, count: int = 1) -> None:
        with self._lock:
            self._pending[reason] = self._pending.get(reason, 0) + count
        if reason not in self._logged:
            self._logged.add(reason)
            _logger.warning(
                "otel_kvtransfer dropped a record (%s); counted in kv_transfer.instrumentation.dropped, "
                "further drops are counted without logging", reason)

    def report(self, sink: Optional[Sink]) -> None:
        """Everything counted so far to `sink`; kept for later while there is none."""
        with self._lock:
            drops, self._pending = self._pending, {}
        if sink is None:
            with self._lock:
                for reason, count in drops.items():
                    self._pending[reason] = self._pending.get(reason, 0) + count
            return
        for reason, count in drops.items():
            try:
                sink.count_drops(reason, count)
            except Exception:
                _logger.debug("otel_kvtransfer could not count drops", exc_info=True)
