"""Asynchronous engine submissions waiting for their completion to be observed.

An async transfer is one `kv_transfer.send` from its submission until the engine reports it done or failed, so
its duration is the real transfer time. At submission the engine module stores what the call knows (and the
transfer scope or context current on the submitting thread); at completion it hands the finished call to the
builder. The table is bounded (`max_pending_async`): a submission beyond it, or still pending at uninstrument,
is counted as dropped, never lost silently.
"""

from typing import TYPE_CHECKING, Any, Hashable, Iterable, Iterator, Optional, Union

from otel_kvtransfer import semconv
from otel_kvtransfer.recording import inflight, integration, records
from otel_kvtransfer.recording.clock import now_ns
from otel_kvtransfer.recording.recorder import RECORDER

if TYPE_CHECKING:
    from opentelemetry.context import Context

# What a submission keeps until its completion: (start_ns, bytes, descriptors, op, peer, protocol, extra, info,
# context, posted_ns)
_Entry = tuple[int, Union[int, Iterable[int]], int, str, Any, Optional[str], Optional[records.Attributes],
               Optional[records.Info], "Optional[Context]", Optional[int]]


class PendingTransfers:
    def __init__(self, backend: str) -> None:
        self.backend = backend
        # handle -> what its submission knew. Public for the engines' wrappers to test (`if entries:`) before
        # anything else on each poll: a dict's truth costs no Python call, len() of this table one frame.
        self.entries: dict[Hashable, _Entry] = {}
        self._running_seen: dict[Hashable, int] = {}  # handle -> when a poll last saw it still running
        inflight.register_pending(self)

    def __len__(self) -> int:
        return len(self.entries)

    def submit(self, handle: Hashable, start_ns: int, nbytes: Union[int, Iterable[int]], descriptors: int, op: str,
               peer: Any, protocol: Optional[str], extra: Optional[records.Attributes] = None,
               scope: Optional[integration.TransferScope] = None, posted_ns: Optional[int] = None) -> None:
        """`scope`: the transfer scope the submission belongs to, when the engine module knows it better than the
        submitting thread does (a NIXL handle made in a scope, posted from another thread); else this thread's.
        `posted_ns`: when the posting call returned (the send then says how long posting took)."""
        if len(self.entries) >= RECORDER.settings.max_pending_async:
            RECORDER.drop("async_pending_full")
            return
        if scope is None and integration.ENTERED[0]:  # current_scope(), read only while some thread is in one
            scope = integration.THREAD.scope
        if scope is None:
            info, context = None, integration.capture_context()
        else:
            info, context = scope.info, scope.context
            if info is None:  # a payload scope (no request): its labels on the send
                extra = scope.label(extra)
        self.entries[handle] = (start_ns, nbytes, descriptors, op, peer, protocol, extra, info, context, posted_ns)

    def seen_running(self, handle: Hashable) -> None:
        """A poll saw the transfer unfinished: its end, when a later poll sees it, lies after this moment."""
        if handle in self.entries:
            self._running_seen[handle] = now_ns()

    def seen_running_all(self, handles: Iterable[Hashable]) -> None:
        """`seen_running` of each of `handles`, at one moment."""
        now, entries, seen = now_ns(), self.entries, self._running_seen
        for handle in handles:
            if handle in entries:
                seen[handle] = now

    def in_flight(self) -> Iterator[tuple[Hashable, inflight.Item]]:
        """(handle, (start_ns, key, peer, nbytes, backend)) of every submission still pending (inflight.py)."""
        for handle, entry in list(self.entries.items()):
            info = entry[7]
            yield handle, (entry[0], info[records.INFO_KEY] if info else None, entry[4] if isinstance(entry[4], str)
                           else None, entry[1], self.backend)

    def complete(self, handle: Hashable, return_code: Any, error_type: Optional[str]) -> bool:
        """The submission ended (error_type None: success); False when it was not pending. Its end was seen by
        a poll: the true end lies between the previous poll that saw it running (or its start) and now, and
        the send says how wide that window is (`kv_transfer.end_uncertainty_s`)."""
        entry = self.entries.pop(handle, None)
        if entry is None:
            return False
        start, nbytes, descriptors, op, peer, protocol, extra, info, context, posted = entry
        end = now_ns()
        own = {semconv.END_UNCERTAINTY_S: (end - self._running_seen.pop(handle, start)) / 1e9}
        if posted is not None:
            own[semconv.POST_S] = (min(posted, end) - start) / 1e9
        extra = {**extra, **own} if extra else own
        if info is not None:
            call = records.call(start, end, nbytes, descriptors, op, peer, protocol, return_code, error_type,
                                self.backend, extra)
            RECORDER.record(records.send(info, [call], context))
        else:  # records.raw_call(records.call(...), context), written out: one record, no call in between
            RECORDER.record((records.RAW_CALL, start, end, nbytes, descriptors, op, peer, protocol, return_code,
                             error_type, self.backend, extra, context or None))
        return True

    def forget(self, handle: Hashable) -> None:
        """The handle was released without its completion being observed: counted as dropped."""
        self._running_seen.pop(handle, None)
        if self.entries.pop(handle, None) is not None:
            RECORDER.drop("async_released")

    def abandon(self) -> None:
        """Uninstrument: completions of what is pending will never be observed; count them."""
        if self.entries:
            RECORDER.drop("async_uninstrumented", len(self.entries))
        self.entries.clear()
        self._running_seen.clear()
