"""Untimed-call names come from the engine's class, so they are untrusted text (recording/untimed.py): a class with
thousands of unknown calls, names that forge a log line or drive a terminal, and a name of 49,095 characters get
bounded lines: each name escaped and cut, at most MAX_LINES first-use lines and one line saying the rest are only
counted, and a line naming the calls found late lists at most MAX_LISTED of them. The counter still counts every
call, under the name as shown.

No engine: a plain class stands in for an engine class that a newer release gave these calls.
"""

import logging

import pytest

from otel_kvtransfer.recording import untimed
from otel_kvtransfer.recording.patching import Patcher

BACKEND = "test-engine"
FORGED = ["ok\nWARNING otel_kvtransfer: all transfers timed", "reset\x1b[2J\x1b[H", "sep\u2028line", "cr\rover"]
LONG = "a" * 49_095
LINE_LIMIT = 400  # characters: a first-use line's own text is about 200
LIST_LIMIT = 2_000  # the late find's line: its text and MAX_LISTED names of at most MAX_NAME and a length each


def _engine_class(count):
    names = [f"transfer_new_{n}" for n in range(count)] + FORGED + [LONG]
    return type("NewerEngine", (), {name: _returning(name) for name in names}), names


def _returning(value):
    return lambda self: value


@pytest.fixture
def wrapped(monkeypatch):
    counted = []
    untimed.count_with(lambda backend, name: counted.append(name))
    monkeypatch.setitem(untimed._announced, "done", True)  # the start-up line is out: a late find gets a line
    patcher = Patcher("test")
    yield patcher, counted
    patcher.unwrap_all()
    untimed.forget(BACKEND)
    untimed.count_with(None)


def _warnings(caplog):
    return [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]


def _one_safe_line(line, limit=LINE_LIMIT):
    assert len(line) <= limit, line[:200]
    assert line.isprintable(), repr(line[:200])  # no newline, CR, ESC, U+2028: no forged line, no terminal control


def test_many_hostile_untimed_names_make_few_bounded_lines(wrapped, caplog):
    patcher, counted = wrapped
    cls, names = _engine_class(5_000)
    with caplog.at_level(logging.WARNING, logger="otel_kvtransfer"):
        assert len(untimed.wrap_unknown(patcher, cls, BACKEND, (), ())) == len(names)
        (found,) = _warnings(caplog)  # the late find: one line, MAX_LISTED names and how many more
        _one_safe_line(found, LIST_LIMIT)
        assert f"and {len(names) - untimed.MAX_LISTED} more" in found
        caplog.clear()

        engine = cls()
        for name in reversed(names):  # the hostile ones first
            assert getattr(engine, name)() == name  # passed through untouched
            assert getattr(engine, name)() == name
    lines = _warnings(caplog)
    assert len(lines) == untimed.MAX_LINES + 1
    for line in lines:
        _one_safe_line(line)
    assert "are counted in kv_transfer.instrumentation.untimed_calls" in lines[-1]
    assert "(49095 characters)" in lines[0]  # the long name, cut and its length said

    assert len(counted) == 2 * len(names)  # every call counted
    for name in set(counted):
        assert name.isprintable() and len(name) <= untimed.MAX_NAME + len("... (49095 characters)")
    assert set(counted) >= {f"transfer_new_{n}" for n in range(5_000)}  # plain names unchanged


def test_shown_escapes_and_cuts():
    assert untimed.shown("transfer_sync_write") == "transfer_sync_write"
    assert untimed.shown("a\nb") == "a\\nb"
    assert untimed.shown("x" * 100) == "x" * untimed.MAX_NAME + "... (100 characters)"
    assert untimed.shown("\x1b" * 64).startswith("\\x1b") and len(untimed.shown("\x1b" * 64)) <= 90
