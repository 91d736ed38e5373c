"""sglang's KV checksum on the decode (`--disaggregation-enable-kv-checksum`): its verdict on the receive span.

The prefill digests each request's KV (Adler-32 over the pages it sends) into the aux metadata; the decode digests
the same pages of its own pool when the request enters a batch (`_verify_kv_checksums`), long after the receive
ended (the request may wait for a batch slot), and drops a request whose digests differ. So:

- a receive that ends in Success on a decode that verifies ends with its outcome pending (`awaits_verdict`): the
  builder keeps its span until the verdict comes (`integration.receive_outcome`), and exports it then;
- at the commit of the transfer to its request (`_commit_transfer_to_req`) sglang knows whether it will verify
  (a prefill of another layout is admitted unverified): if not, the span goes as it is;
- the verification: `kv_transfer.integrity` = `verified` | `mismatch` on the receive span; a mismatch adds the
  event `kv_transfer.integrity_mismatch` with sglang's expected and computed digests (the latter as sglang's own
  log line prints it), is counted (`kv_transfer.integrity_mismatches`, from the span) and is one WARNING line
  here, naming the request and the prefill it came from.

sglang drops the request on every decode rank when any rank's digest differs; a rank whose own digest matched
names no computed digest (sglang's message says the mismatch was on a peer rank).
"""

import logging
import re
import threading
import time
from typing import Any, Dict

from otel_kvtransfer import semconv
from otel_kvtransfer.building.printable import one_line
from otel_kvtransfer.frameworks.sglang import common
from otel_kvtransfer.recording import integration
from otel_kvtransfer.recording.patching import observe_call

_logger = logging.getLogger(__name__)

_VERIFIES = "_otel_kvt_verifies"  # set on a decode KV manager whose prealloc queue built a checksum computer
PENDING = "_otel_kvt_verdict_pending"  # set on a receiver whose receive ended awaiting sglang's verdict
_tls = threading.local()  # .mismatches: {id(req): sglang's message}, while _verify_kv_checksums runs
# sglang's mismatch message: "KV checksum mismatch req=... bootstrap_room=... expected=0x.. got=0x.."
_DIGESTS = re.compile(r"expected=(0x[0-9a-fA-F]{1,32}) got=(0x[0-9a-fA-F]{1,32})")


def awaits_verdict(receiver) -> bool:
    """Will sglang verify the KV this receiver got? Its decode verifies, and its manager compares digests with
    this receiver's prefill (not with one whose digest covers other bytes)."""
    mgr = receiver.kv_mgr
    if not getattr(mgr, _VERIFIES, False):
        return False
    check = getattr(mgr, "should_verify_kv_checksum", None)
    return bool(check is None or check(receiver.bootstrap_addr))


def _on_prealloc_init(instance, args, kwargs, token, result, error) -> None:
    if getattr(getattr(instance, "scheduler", None), "kv_checksum_computer", None) is not None:
        setattr(instance.kv_manager, _VERIFIES, True)


def _on_commit(instance, args, kwargs, token, result, error) -> None:
    """After sglang took the transfer's digest: a receive awaiting a verdict that will never come goes now."""
    decode_req = args[0] if args else kwargs.get("decode_req")
    receiver = getattr(decode_req, "kv_receiver", None)
    if receiver is None or not getattr(receiver, PENDING, False):
        return
    if not getattr(decode_req.req, "expected_kv_checksum", 0):
        setattr(receiver, PENDING, False)
        integration.receive_outcome(receiver.bootstrap_room)


def _before_verify(instance, args, kwargs):
    """The requests sglang is about to verify, with the digest each expects (it zeroes it once verified)."""
    batch = args[0] if args else kwargs.get("batch")
    if getattr(instance, "kv_checksum_computer", None) is None:
        return None
    _tls.mismatches = {}
    return [(req, req.expected_kv_checksum) for req in getattr(batch, "reqs", ()) if
            getattr(req, "expected_kv_checksum", 0)]


def _after_verify(instance, args, kwargs, candidates, result, error) -> None:
    mismatches, _tls.mismatches = getattr(_tls, "mismatches", None) or {}, None
    for req, expected in candidates or ():
        message = mismatches.get(id(req))
        if message is None and getattr(req, "expected_kv_checksum", None):
            continue  # skipped (sglang verifies only what it can compare): no verdict
        if message is None:
            integration.receive_outcome(req.bootstrap_room,
                                        attributes={semconv.INTEGRITY: semconv.INTEGRITY_VERIFIED})
            continue
        _mismatch(req, expected, message)


def _mismatch(req, expected: int, message: str) -> None:
    found = _DIGESTS.search(message)
    digests = {semconv.INTEGRITY_EXPECTED_DIGEST: f"{int(expected):#x}"}
    if found is not None:
        digests[semconv.INTEGRITY_COMPUTED_DIGEST] = found.group(2)
    host, port = getattr(req, "bootstrap_host", None), getattr(req, "bootstrap_port", None)
    event: Dict[str, Any] = dict(digests)
    if host is not None:
        event[semconv.SERVER_ADDRESS] = str(host)[:256]
    if isinstance(port, int) and not isinstance(port, bool):
        event[semconv.SERVER_PORT] = port
    integration.receive_outcome(req.bootstrap_room, attributes={semconv.INTEGRITY: semconv.INTEGRITY_MISMATCH},
                                events=((semconv.EVENT_INTEGRITY_MISMATCH, event),))
    LINES.mismatch(req.bootstrap_room, getattr(req, "rid", None), f"{host}:{port}",
                   digests[semconv.INTEGRITY_EXPECTED_DIGEST], digests.get(semconv.INTEGRITY_COMPUTED_DIGEST))


def _on_mismatch(instance, args, kwargs) -> None:
    """sglang drops a request for a mismatch: remember its message for the verification's end."""
    mismatches = getattr(_tls, "mismatches", None)
    if mismatches is None:
        return
    req = args[0] if args else kwargs.get("req")
    message = args[1] if len(args) > 1 else kwargs.get("msg")
    mismatches[id(req)] = str(message)[:512]


class MismatchLines:
    """The WARNING lines: one per mismatch, at most `limit` a minute; past that, how many went unsaid is in the
    next line (a bad link corrupting every request must not double the log sglang already writes)."""

    def __init__(self, limit: int = 20, window_s: float = 60.0, clock=time.monotonic):
        self._limit, self._window_s, self._clock = limit, window_s, clock
        self._lock = threading.Lock()
        self._window_start, self._logged, self._unsaid = None, 0, 0

    def mismatch(self, room, rid, peer, expected, computed) -> None:
        with self._lock:
            now = self._clock()
            if self._window_start is None or now - self._window_start >= self._window_s:
                self._window_start, self._logged = now, 0
            if self._logged >= self._limit:
                self._unsaid += 1
                return
            self._logged += 1
            unsaid, self._unsaid = self._unsaid, 0
        more = f"; {unsaid} more mismatches not logged before this one" if unsaid else ""
        got = "as expected on this rank (a peer rank's differed)" if computed is None else one_line(computed, 40)
        _logger.warning("otel_kvtransfer: sglang's KV checksum rejected the KV of request %s (rid %s) from prefill "
                        "%s: expected %s, computed %s; sglang drops the request (kv_transfer.integrity_mismatch)%s",
                        one_line(room, 64), one_line(rid, 128), one_line(peer, 128), one_line(expected, 40), got,
                        more)


LINES = MismatchLines()

_prealloc_init_wrapper = observe_call("prealloc queue init", after=_on_prealloc_init)
_commit_wrapper = observe_call("commit transfer", after=_on_commit)
_verify_wrapper = observe_call("verify kv checksums", _before_verify, _after_verify, on_raise=True)
_mismatch_wrapper = observe_call("kv checksum mismatch", _on_mismatch)


def patch_decode(module) -> None:
    """sglang.srt.disaggregation.decode: the prealloc queue (is checksum on?), the transfer queue's commit, the
    scheduler mixin's verification and its mismatch handler. A release without them: nothing of this is wrapped
    (its receives end as before)."""
    mixin = getattr(module, "SchedulerDisaggregationDecodeMixin", None)
    if mixin is None or "_verify_kv_checksums" not in vars(mixin):
        return
    common.patcher.wrap(module.DecodePreallocQueue, "__init__", _prealloc_init_wrapper)
    common.patcher.wrap(module.DecodeTransferQueue, "_commit_transfer_to_req", _commit_wrapper)
    common.patcher.wrap(mixin, "_verify_kv_checksums", _verify_wrapper)
    common.patcher.wrap(mixin, "_handle_kv_checksum_mismatch", _mismatch_wrapper)
