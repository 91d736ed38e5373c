"""The Mooncake async wrappers where Python code runs inside them, on both paths (compiled and Python).

Stand-in originals on the real TransferEngine class make each case happen when the test says: an id handed out
again while the wait that freed it is still running, a batch id whose hashing waits on another engine, lengths
and answers that run code of their own, an interrupt in the middle. The Python wrapper is the reference: each case
asserts what it does, and the compiled path must do the same, without ever reading an object it does not own.
"""

import importlib

import pytest

from otel_kvtransfer import config
from otel_kvtransfer.recording import clock, integration, records
from otel_kvtransfer.recording.recorder import RECORDER, Sink

_ASYNC_CALLS = ("batch_transfer_async_write", "get_batch_transfer_status", "transfer_check_status")


class _Recording(Sink):
    """The real recorder, started on its own, keeping what it is handed."""

    def __init__(self):
        self.drops, self.records = {}, []
        self.take = self.records.append
        RECORDER.start(config.load(), self)

    def count_drops(self, reason, amount):
        self.drops[reason] = self.drops.get(reason, 0) + amount

    def settle(self):
        RECORDER.drain()
        return self


class _Engine:
    """Stands in for a TransferEngine (the wrappers keep the last engine's forms by a weak reference)."""

    def __init__(self, name):
        self.name = name


@pytest.fixture
def mooncake_class(hot_path, monkeypatch):
    """(the real TransferEngine class with stand-in originals, the instrumented backend, the recording, the
    stand-ins' state): `state["submit"]` and `state["wait"]` say what the next calls do."""
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "tcp")
    if RECORDER.active:
        RECORDER.stop()
    recording = _Recording()
    backend = importlib.import_module("otel_kvtransfer.engines.mooncake")
    try:
        modules = [importlib.import_module(name) for name in backend.modules()]
    except ImportError as error:
        pytest.skip(f"the Mooncake engine is not installed here ({error})")
    engine_class = modules[0].TransferEngine
    originals = {name: vars(engine_class)[name] for name in _ASYNC_CALLS}
    state = {"ids": iter(range(1001, 2000)), "submit": None, "wait": None, "check": None}

    def submit(self, peer, *args):
        chosen = state["submit"]
        return next(state["ids"]) if chosen is None else chosen(self, peer)

    def wait(self, ids):
        chosen = state["wait"]
        return 0 if chosen is None else chosen(self, ids)

    def check(self, batch_id):
        chosen = state["check"]
        return 1 if chosen is None else chosen(self, batch_id)

    engine_class.batch_transfer_async_write = submit
    engine_class.get_batch_transfer_status = wait
    engine_class.transfer_check_status = check
    try:
        assert backend.instrument() is True
        for name, made in (("batch_transfer_async_write", "Submission"), ("get_batch_transfer_status", "BatchWait")):
            assert (type(vars(engine_class)[name]).__name__ == made) is (hot_path == "compiled")
        yield engine_class, backend, recording, state
    finally:
        backend.uninstrument()
        for name, entry in originals.items():
            setattr(engine_class, name, entry)
        RECORDER.stop()


def _primed(engine_class, engine, recording):
    """`engine` after one send made and let go: the wrappers now know it (the first call on an engine after
    another goes the Python way on both paths, to learn its forms; the compiled path takes the calls after it)."""
    from otel_kvtransfer.engines import mooncake

    assert engine_class.get_batch_transfer_status(engine, [_write(engine_class, engine, "primer:1")]) == 0
    assert mooncake._last_engine[0][0]() is engine
    recording.settle().records.clear()
    return engine


def _write(engine_class, engine, peer, lengths=(4096,)):
    return engine_class.batch_transfer_async_write(engine, peer, [1] * len(lengths), [2] * len(lengths),
                                                   list(lengths))


def _sends(recording):
    """{peer: (bytes, error type, end)} of every async send recorded, raw or in a scope."""
    found = {}
    for record in recording.settle().records:
        if record[records.KIND] == records.RAW_ASYNC:
            start, end, _, _ = records.async_times(record)
            found[record[records.ASYNC_PEER]] = (record[records.ASYNC_BYTES], record[records.ASYNC_ERROR], end)
        elif record[records.KIND] == records.SEND:
            for call in record[records.SEND_CALLS]:
                found[call[records.CALL_PEER]] = (call[records.CALL_BYTES], call[records.CALL_ERROR],
                                                  call[records.CALL_END])
    return found


def _pending():
    from otel_kvtransfer.engines import mooncake

    return mooncake._pending


@pytest.mark.parametrize("scoped", (False, True), ids=("raw", "scoped"))
@pytest.mark.parametrize("wait_call", ("get_batch_transfer_status", "transfer_check_status"))
def test_an_id_given_out_again_during_its_wait_loses_neither_send(mooncake_class, scoped, wait_call):
    """Mooncake frees a batch id inside the wait that sees it end and may hand it to another thread's submission
    before that wait returns: the earlier send ends with that wait (by the later submission's posting at the
    latest), the later one stays pending until its own wait, and nothing is overwritten or counted twice."""
    engine_class, _, recording, state = mooncake_class
    engine = _primed(engine_class, _Engine("a"), recording)
    reused = {}

    def submit_again(self, peer):  # the next submission gets the id just freed
        return reused.get("id") or next(state["ids"])

    def freeing_wait(self, ids):
        reused["id"] = ids[0] if isinstance(ids, list) else ids
        state["wait"] = state["check"] = None
        with integration.transfer_scope(8) if scoped else _nothing():
            reused["again"] = _write(engine_class, engine, "later:1", (512,))
        reused["posted"] = clock.now_ns()
        return 0 if wait_call == "get_batch_transfer_status" else 1

    state["submit"] = submit_again
    with integration.transfer_scope(7) if scoped else _nothing():
        first = _write(engine_class, engine, "earlier:1", (4096,))
    state["wait"] = state["check"] = freeing_wait
    waited = getattr(engine_class, wait_call)(engine, [first] if wait_call == "get_batch_transfer_status" else first)
    assert waited == (0 if wait_call == "get_batch_transfer_status" else 1)
    assert reused["again"] == first  # the same id, given out again
    sends = _sends(recording)
    assert set(sends) == {"earlier:1"}
    nbytes, error, end = sends["earlier:1"]
    assert (nbytes, error) == (4096, None) and end <= reused["posted"]
    assert len(_pending().entries) == 1 and not _pending().superseded
    state["submit"] = None
    assert engine_class.get_batch_transfer_status(engine, [first]) == 0
    assert set(_sends(recording)) == {"earlier:1", "later:1"} and _sends(recording)["later:1"][:2] == (512, None)
    assert not _pending().entries and recording.drops == {}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_an_id_whose_hashing_waits_on_another_engine(mooncake_class):
    """While one engine's wait ends its sends, hashing an id waits on another engine: the other wait's wrapper
    runs in the middle of the first's. Both engines' sends end, each under its own engine (a wrapper that kept
    the first engine's id as a borrowed reference read it after the other wait had replaced and freed it)."""
    engine_class, _, recording, state = mooncake_class
    second, first = _Engine("b"), _primed(engine_class, _Engine("a"), recording)

    class WaitingId(int):
        def __hash__(self):
            engine_class.get_batch_transfer_status(second, [other])
            return int.__hash__(self)

    with integration.transfer_scope(5):
        mine = _write(engine_class, first, "first:1", (100,))
    other = _write(engine_class, second, "second:1", (200,))
    last = _write(engine_class, first, "first:2", (300,))
    assert engine_class.get_batch_transfer_status(first, [WaitingId(mine), last]) == 0
    sends = _sends(recording)
    assert {peer: send[:2] for peer, send in sends.items()} == {
        "first:1": (100, None), "second:1": (200, None), "first:2": (300, None)}
    assert not _pending().entries and recording.drops == {}


def test_lengths_that_change_their_list_while_summed(mooncake_class):
    """An item's own addition empties the list being summed: counted as sum() counts it, nothing read from the
    list's old storage (the compiled sum held it across that call)."""
    engine_class, _, recording, state = mooncake_class
    engine = _primed(engine_class, _Engine("a"), recording)
    lengths = [1000, 0, 0, 0]

    class Shrinking(int):
        def __radd__(self, total):
            lengths.clear()
            return int(self) + total

    lengths[1] = Shrinking(24)
    lengths[2:] = [Shrinking(8), 5]
    batch = engine_class.batch_transfer_async_write(engine, "shrinking:1", [1] * 4, [2] * 4, lengths)
    assert engine_class.get_batch_transfer_status(engine, [batch]) == 0
    assert _sends(recording)["shrinking:1"][:2] == (1024, None)


def test_an_interrupt_in_the_wrappers_own_code_reaches_the_caller(mooncake_class):
    """Ctrl-C landing in the wrapper's own work is the caller's, as everywhere in Python: raised in place of the
    engine's answer, never swallowed or counted as the wrapper's error."""
    engine_class, _, recording, state = mooncake_class
    engine = _primed(engine_class, _Engine("a"), recording)

    class Interrupting(int):
        def __radd__(self, total):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        engine_class.batch_transfer_async_write(engine, "interrupted:1", [1, 1], [2, 2], [5, Interrupting(3)])

    class InterruptingAnswer(int):
        def __eq__(self, other):
            raise KeyboardInterrupt

        __hash__ = int.__hash__

    batch = _write(engine_class, engine, "waited:1")
    state["wait"] = lambda self, ids: InterruptingAnswer(0)
    with pytest.raises(KeyboardInterrupt):
        engine_class.get_batch_transfer_status(engine, [batch])
    recording.settle()
    assert "wrapper_error" not in recording.drops


def test_answers_no_real_engine_gives_end_sends_as_the_python_wrapper_does(mooncake_class):
    """A wait answering None (no real engine does) ends its sends as failed; a wait whose id empties the list
    while it is hashed still ends every send the list named; an id whose comparison raises is the wrapper's own
    error, counted, and the engine's answer returned."""
    engine_class, _, recording, state = mooncake_class
    engine = _primed(engine_class, _Engine("a"), recording)
    batch = _write(engine_class, engine, "none:1")
    state["wait"] = lambda self, ids: None
    assert engine_class.get_batch_transfer_status(engine, [batch]) is None
    state["wait"] = None
    assert _sends(recording)["none:1"][:2] == (4096, "transfer_failed")

    ids = []

    class Clearing(int):
        def __hash__(self):
            ids.clear()
            return int.__hash__(self)

    ids.extend([Clearing(_write(engine_class, engine, "cleared:1")), _write(engine_class, engine, "cleared:2")])
    assert engine_class.get_batch_transfer_status(engine, ids) == 0
    sends = _sends(recording)
    assert sends["cleared:1"][:2] == (4096, None) and sends["cleared:2"][:2] == (4096, None)
    assert not _pending().entries

    class Unequal(int):
        def __eq__(self, other):
            raise ValueError("no comparing this one")

        __hash__ = int.__hash__

    batch = _write(engine_class, engine, "unequal:1")
    assert engine_class.get_batch_transfer_status(engine, [Unequal(batch)]) == 0
    recording.settle()
    assert recording.drops == {"wrapper_error": 1}
    assert "unequal:1" not in _sends(recording) and len(_pending().entries) == 1

