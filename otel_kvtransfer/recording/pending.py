"""Asynchronous engine submissions waiting for their completion to be observed.

An async transfer is one `kv_transfer.send` from its submission until the engine reports it done or failed, so
its duration is the real transfer time. At submission the engine module stores what the call knows (and the
transfer scope or context current on the submitting thread); at completion it hands the finished call to the
builder. The table is bounded (`max_pending_async`): a submission beyond it, or still pending at uninstrument,
is counted as dropped, never lost silently.
"""

from typing import TYPE_CHECKING, Any, Final, Hashable, Iterable, Iterator, Optional, Union

from otel_kvtransfer.recording import inflight, integration, records
from otel_kvtransfer.recording.clock import now_ns
from otel_kvtransfer.recording.recorder import RECORDER

if TYPE_CHECKING:
    from opentelemetry.context import Context

# What a submission keeps until its completion: (start_ns, bytes, descriptors, peer, form, info, context,
# posted_ns), `form` the `records.call_form` of its op, protocol, backend and extra. An engine's wrapper may put
# an entry in `entries` itself (one Python frame less per submission) where `submit` would: outside any transfer
# scope (`integration.ENTERED` 0) and with room in the table.
ENTRY_START: Final = 0
ENTRY_PEER: Final = 3
ENTRY_INFO: Final = 5
_Entry = tuple[int, Union[int, Iterable[int]], int, Any, records.Form, Optional[records.Info], "Optional[Context]",
               Optional[int]]


class PendingTransfers:
    def __init__(self, backend: str) -> None:
        self.backend = backend
        # handle -> what its submission knew. Public for the engines' wrappers to test (`if entries:`) before
        # anything else on each poll: a dict's truth costs no Python call, len() of this table one frame.
        self.entries: dict[Hashable, _Entry] = {}
        # handle -> when a poll last saw it still running; public for the compiled wait, which pops it as `ended`
        self.running_seen: dict[Hashable, int] = {}
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
        form = records.call_form(op, protocol, self.backend, extra, "transfer_failed")
        self.entries[handle] = (start_ns, nbytes, descriptors, peer, form, info, context or None, posted_ns)

    def seen_running(self, handle: Hashable) -> None:
        """A poll saw the transfer unfinished: its end, when a later poll sees it, lies after this moment."""
        if handle in self.entries:
            self.running_seen[handle] = now_ns()

    def in_flight(self) -> Iterator[tuple[Hashable, inflight.Item]]:
        """(handle, (start_ns, key, peer, nbytes, backend)) of every submission still pending (inflight.py)."""
        for handle, entry in list(self.entries.items()):
            info, peer = entry[ENTRY_INFO], entry[ENTRY_PEER]
            yield handle, (entry[ENTRY_START], info[records.INFO_KEY] if info else None,
                           peer if isinstance(peer, str) else None, entry[1], self.backend)

    def complete(self, handle: Hashable, return_code: Any, error_type: Optional[str]) -> bool:
        """The submission ended (error_type None: success); False when it was not pending. Its end was seen by
        a poll: the true end lies between the previous poll that saw it running (or its start) and now, and
        the send says how wide that window is (`kv_transfer.end_uncertainty_s`)."""
        entry = self.entries.pop(handle, None)
        if entry is None:
            return False
        seen = self.running_seen
        self.ended(entry, now_ns(), seen.pop(handle, None) if seen else None, return_code, error_type)
        return True

    def complete_all(self, handles: Iterable[Hashable], return_code: Any, error_type: Optional[str]) -> None:
        """`complete` of each of `handles` still pending, all ended now (one wait saw them end). A wait that
        blocked until they ended is no poll that saw them running: they may have ended before it began, so each
        one's window still reaches back to the last poll that did, or to its start."""
        entries, seen, end = self.entries, self.running_seen, now_ns()
        for handle in handles:
            entry = entries.pop(handle, None)
            if entry is not None:
                self.ended(entry, end, seen.pop(handle, None) if seen else None, return_code, error_type)

    def ended(self, entry: _Entry, end: int, running_seen: Optional[int], return_code: Any,
              error_type: Optional[str]) -> None:
        """The send of a submission that ended at `end`, last seen running at `running_seen` (None: never). The
        compiled wait (`_async_compiled.BatchWait`) calls it for an entry of a transfer scope."""
        start, nbytes, descriptors, peer, form, info, context, posted = entry
        if info is not None:
            extra = form[records.FORM_EXTRA]
            own = records.async_figures(start, end, start if running_seen is None else running_seen, posted)
            call = records.call(start, end, nbytes, descriptors, form[records.FORM_OP], peer,
                                form[records.FORM_PROTOCOL], return_code, error_type, self.backend,
                                {**extra, **own} if extra else own)
            RECORDER.record(records.send(info, [call], context))
            return
        # records.raw_async(...), written out: one record, no call in between
        rec = (records.RAW_ASYNC, start, end - start, nbytes, descriptors, peer, return_code, error_type, form,
               context, None if running_seen is None else running_seen - start,
               None if posted is None else posted - start)
        queue = RECORDER.queue
        if len(queue) < RECORDER.capacity and not RECORDER.idle:
            queue.append(rec)  # Recorder.record's common case, as its contract allows
        else:
            RECORDER.record(rec)

    def forget(self, handle: Hashable) -> None:
        """The handle was released without its completion being observed: counted as dropped."""
        self.running_seen.pop(handle, None)
        if self.entries.pop(handle, None) is not None:
            RECORDER.drop("async_released")

    def abandon(self) -> None:
        """Uninstrument: completions of what is pending will never be observed; count them."""
        if self.entries:
            RECORDER.drop("async_uninstrumented", len(self.entries))
        self.entries.clear()
        self.running_seen.clear()
