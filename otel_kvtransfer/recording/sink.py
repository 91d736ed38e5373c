"""Where the recorder's thread delivers records (`Sink`), and how a failure of ours there is reported once.

A sink is the builder in this process (`building.in_process`) or the link to the builder process
(`offloading.link`); the recorder knows only this interface.
"""

import logging
import math

from otel_kvtransfer.recording.records import Record

_logger = logging.getLogger(__name__)

_OWN_ERRORS_LOGGED: set[tuple[str, str]] = set()


def log_own_error(what: str, exc: BaseException) -> None:
    """The first failure of each kind, with what failed, at WARNING (the drop counter says how many); the rest
    at debug, with the traceback."""
    kind = (what, type(exc).__name__)
    if kind not in _OWN_ERRORS_LOGGED and len(_OWN_ERRORS_LOGGED) < 64:
        _OWN_ERRORS_LOGGED.add(kind)
        _logger.warning("otel_kvtransfer: %s failed (%s: %s); counted as builder_error", what, type(exc).__name__,
                        str(exc)[:200], exc_info=True)
    else:
        _logger.debug("otel_kvtransfer: %s failed", what, exc_info=True)


class Sink:
    """With `batched`, each drain's records come in one list to `take_batch` (the link: its writes are bounded);
    otherwise one at a time to `take`, so that a drain's deadline is read between records. All of it runs on the
    recorder's thread, but `after_fork_in_child` (the child's only thread, at fork)."""

    batched = False

    def take(self, rec: Record) -> None:
        raise NotImplementedError

    def take_batch(self, batch: list[Record]) -> None:
        raise NotImplementedError

    def tick(self) -> None:
        """After each drain: the builder's periodic work (eviction, stuck reports)."""

    def count_drops(self, reason: str, count: int) -> None:
        """The records the recorder dropped since the last drain, by reason."""

    def after_fork_in_child(self) -> None:
        """A forked child starts with nothing of its parent's."""

    def end_at_exit(self, deadline: float = math.inf) -> int:
        """The exit drain's last step, within its bound: end what is still open (ended by the process's exit)
        until `deadline` (time.monotonic()); how many it could not end by then (counted as flush_timeout)."""
        return 0

    def export_wait_s(self) -> float:
        """Seconds the builder here has waited for room in the export queues so far (what a slow exporter costs
        it): the exit drain's line says whether that is what took its time."""
        return 0.0

    def release_held(self) -> None:
        """A flush's last step: what has ended but is held back (peer waits watched for late KV) goes out now."""
