"""An interrupt (KeyboardInterrupt) that lands inside a transfer scope's `__enter__` leaves the thread as it was:
the scope is not attached to it, so the thread's later raw engine calls are still exported and counted.

Real parts: the Mooncake engine of the test process writing to a receiver process over TCP on 127.0.0.1. The
interrupt is a stand-in for Ctrl-C arriving at that exact bytecode: the scopes' depth lock is replaced by one whose
first acquire raises KeyboardInterrupt (a signal cannot be aimed at one bytecode in a test).
"""

import threading

import pytest

from otel_kvtransfer import integration as kvt
from otel_kvtransfer import semconv
from otel_kvtransfer.demo.loopback import digest
from otel_kvtransfer.recording import integration

ROOM = 881001


class _InterruptedOnce:
    """A lock whose first acquire is interrupted, as a KeyboardInterrupt arriving while `with` acquires it."""

    def __init__(self):
        self._lock = threading.Lock()
        self.interrupted = False

    def __enter__(self):
        if not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt
        return self._lock.__enter__()

    def __exit__(self, *exc):
        return self._lock.__exit__(*exc)


def _write(engine, receiver, nbytes):
    assert engine.engine.transfer_sync_write(receiver.session, engine.base, receiver.base_address, nbytes) == 0
    assert receiver.digest(0, nbytes) == digest(engine.source[:nbytes])


def test_an_interrupt_inside_enter_leaves_no_scope_on_the_thread(telemetry, engine, receiver, monkeypatch):
    lock = _InterruptedOnce()
    monkeypatch.setattr(integration, "_DEPTH_LOCK", lock)
    scope = kvt.transfer_scope(ROOM, chunk_index=0, is_last_chunk=True)
    with pytest.raises(KeyboardInterrupt):
        with scope:
            pytest.fail("the body must not run: __enter__ was interrupted")
    assert lock.interrupted
    assert integration.current_scope() is None and integration.THREAD.saved == []

    # A raw engine call of this thread is its own send, exported and counted.
    _write(engine, receiver, 54321)
    (send,) = telemetry.spans(semconv.SPAN_SEND)
    assert send.attributes[semconv.BYTES] == 54321
    assert semconv.REQUEST_KEY not in send.attributes
    (duration,) = telemetry.metrics()[semconv.METRIC_DURATION]
    assert duration.count == 1

    # The interrupted scope itself still works: entered again, its one engine call is one send of the request.
    with scope:
        _write(engine, receiver, 4321)
    assert integration.current_scope() is None
    sends = telemetry.spans(semconv.SPAN_SEND)
    assert [(s.attributes[semconv.BYTES], s.attributes.get(semconv.REQUEST_KEY)) for s in sends] == [
        (54321, None), (4321, str(ROOM))]
