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
# The compiled part reads these positions (engines/mooncake/compiled.py, `layout()`).
ENTRY_START: Final = 0
ENTRY_BYTES: Final = 1
ENTRY_DESCRIPTORS: Final = 2
ENTRY_PEER: Final = 3
ENTRY_FORM: Final = 4
ENTRY_INFO: Final = 5
ENTRY_CONTEXT: Final = 6
ENTRY_POSTED: Final = 7
ENTRY_SIZE: Final = 8
# The entry's type, its one declaration: a wrapper that writes an entry out annotates it with this.
Entry = tuple[int, Union[int, Iterable[int]], int, Any, records.Form, Optional[records.Info], "Optional[Context]",
              Optional[int]]


class PendingTransfers:
    def __init__(self, backend: str) -> None:
        self.backend = backend
        # handle -> what its submission knew. Public for the engines' wrappers to test (`if entries:`) before
        # anything else on each poll: a dict's truth costs no Python call, len() of this table one frame.
        self.entries: dict[Hashable, Entry] = {}
        # handle -> when a poll last saw it still running; public for the compiled wait, which pops it as `ended`
        self.running_seen: dict[Hashable, int] = {}
        # handle -> earlier entries, oldest first, of a handle the engine gave out again while it was still here
        # (`reused`), each waiting for the wait that freed it to return (`reclaim`); `aside` counts them all
        self.superseded: dict[Hashable, list[Entry]] = {}
        self.aside = 0
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
        entry: Entry = (start_ns, nbytes, descriptors, peer, form, info, context or None, posted_ns)
        earlier = self.entries.setdefault(handle, entry)
        if earlier is not entry:
            self.reused(handle, earlier, entry)

    def reused(self, handle: Hashable, earlier: Entry, entry: Entry) -> None:
        """The engine gave out `handle` again while its `earlier` submission was still in the table: Mooncake
        frees a batch id inside the wait that sees it end, and may hand it to another thread's submission before
        that wait returns. `entry` takes the handle; the earlier send is kept aside for its wait (`reclaim`), not
        overwritten. Bounded with the table: past `max_pending_async` kept aside, the earlier one is counted
        dropped (`async_pending_full`). The compiled submission calls it too."""
        self.entries[handle] = entry
        if self.aside >= RECORDER.settings.max_pending_async:
            RECORDER.drop("async_pending_full")
            return
        self.superseded.setdefault(handle, []).append(earlier)
        self.aside += 1

    def reclaim(self, handle: Hashable, entry: Entry, end: int, return_code: Any,
                error_type: Optional[str]) -> None:
        """A wait that began before `entry` was posted found it under its handle: not its send (the handle was
        given out again during the wait). `entry` goes back; the wait's own send is the oldest kept aside under
        the handle, if any, and it ended before the handle was given out again: by `entry`'s posting at the
        latest. The compiled wait calls it too."""
        self.entries[handle] = entry
        aside = self.superseded.get(handle)
        if not aside:
            return
        earlier = aside.pop(0)
        self.aside -= 1
        if not aside:
            del self.superseded[handle]
        posted = entry[ENTRY_POSTED]
        self.ended(earlier, end if posted is None else min(end, posted), None, return_code, error_type)

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
        for handle, aside in list(self.superseded.items()):
            for entry in list(aside):
                info, peer = entry[ENTRY_INFO], entry[ENTRY_PEER]
                yield handle, (entry[ENTRY_START], info[records.INFO_KEY] if info else None,
                               peer if isinstance(peer, str) else None, entry[1], self.backend)

    def complete(self, handle: Hashable, return_code: Any, error_type: Optional[str],
                 called: Optional[int] = None) -> bool:
        """The submission ended (error_type None: success); False when it was not pending. Its end was seen by
        a poll: the true end lies between the previous poll that saw it running (or its start) and now, and
        the send says how wide that window is (`kv_transfer.end_uncertainty_s`). `called`: when the poll began
        (an entry posted after it is not the poll's: `reclaim`)."""
        entry = self.entries.pop(handle, None)
        if entry is None:
            return False
        if called is not None and _posted_after(entry, called):
            self.reclaim(handle, entry, now_ns(), return_code, error_type)
            return True
        seen = self.running_seen
        self.ended(entry, now_ns(), seen.pop(handle, None) if seen else None, return_code, error_type)
        return True

    def complete_all(self, handles: Iterable[Hashable], return_code: Any, error_type: Optional[str],
                     called: Optional[int] = None) -> None:
        """`complete` of each of `handles` still pending, all ended now (one wait saw them end). A wait that
        blocked until they ended is no poll that saw them running: they may have ended before it began, so each
        one's window still reaches back to the last poll that did, or to its start."""
        entries, seen, end = self.entries, self.running_seen, now_ns()
        for handle in handles:
            entry = entries.pop(handle, None)
            if entry is None:
                continue
            if called is not None and _posted_after(entry, called):
                self.reclaim(handle, entry, end, return_code, error_type)
            else:
                self.ended(entry, end, seen.pop(handle, None) if seen else None, return_code, error_type)

    def ended(self, entry: Entry, end: int, running_seen: Optional[int], return_code: Any,
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
        rec: records.RawAsync = (records.RAW_ASYNC, start, end - start, nbytes, descriptors, peer, return_code,
                                 error_type, form, context, None if running_seen is None else running_seen - start,
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
        if self.entries or self.aside:
            RECORDER.drop("async_uninstrumented", len(self.entries) + self.aside)
        self.entries.clear()
        self.running_seen.clear()
        self.superseded.clear()
        self.aside = 0


def _posted_after(entry: Entry, called: int) -> bool:
    """Whether `entry` was posted after a wait that began at `called`: then it is no send of that wait's."""
    posted = entry[ENTRY_POSTED]
    return posted is not None and posted > called
