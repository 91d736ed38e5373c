"""The link's drops (engine process, the recorder's thread): carried to a live helper in its next frame, or, when
no helper can carry them, counted in this process's own MeterProvider, so drops always reach an exporter."""

import logging
from typing import Callable, Dict, Optional

from otel_kvtransfer.building.attachment import drop_counter

_logger = logging.getLogger(__name__)

DROP_REASON = "builder_process"  # records a helper was given, or would have been, and never built


class DropTally:
    """`count_dropped(reason, n)` counts in this process (default: a counter on the global MeterProvider, made
    when first needed). The link's lock guards it."""

    def __init__(self, count_dropped: Optional[Callable[[str, int], None]] = None, hushed: bool = False) -> None:
        self._count_dropped = count_dropped
        self.pending: Dict[str, int] = {}  # reason -> count: to carry in the next frame
        self.logged = False  # one warning per episode (a loss, a stall, no helper), until a helper answers again
        self.quiet = 0  # records counted without a word while helpers are still being tried
        self.hushed = hushed  # a fallback may still take over: what a failed start costs is told in one line later

    def add(self, reason: str, count: int) -> None:
        self.pending[reason] = self.pending.get(reason, 0) + count

    def take(self) -> Dict[str, int]:
        drops, self.pending = self.pending, {}
        return drops

    def count_here(self, records: int, drops: Dict[str, int], why: Optional[str]) -> None:
        """Counted in this process's own metrics: no helper can carry them now (`why`: for the episode's one
        warning line; None: counted without a word)."""
        if records:
            drops = dict(drops)
            drops[DROP_REASON] = drops.get(DROP_REASON, 0) + records
        if not drops:
            return
        if self._count_dropped is None:
            self._count_dropped = drop_counter(None)  # the global MeterProvider
        for reason, count in drops.items():
            try:
                self._count_dropped(reason, count)
            except Exception:
                _logger.debug("otel_kvtransfer could not count drops", exc_info=True)
        if why is not None and not self.logged:
            self.logged = True
            _logger.warning("otel_kvtransfer: %s; %d records are counted as dropped (%s) in this process's own "
                            "metrics, and what follows until a helper takes records again",
                            why, sum(drops.values()), ", ".join(sorted(drops)))
