"""Every OTEL_KVTRANSFER_* setting: its range bounds memory; a value outside it, or garbage, falls back to the
default (once a queue of 67,108,864 records, ~34 GiB behind a stuck builder, was accepted).
Garbage of every kind is covered in test_recorder_delivery.py; here: the edges of each range."""

import pytest

from otel_kvtransfer import config

DEFAULTS = config.Settings()

# (variable, field, lowest accepted, highest accepted, a value just outside each end)
RANGES = [
    (config.QUEUE_SIZE, "queue_size", 1, 1 << 18, ["0", str((1 << 18) + 1), "67108864"]),
    (config.MAX_OPEN_REQUESTS, "max_open_requests", 1, 1 << 20, ["0", str((1 << 20) + 1), "200000000"]),
    (config.MAX_PENDING_ASYNC, "max_pending_async", 1, 1 << 20, ["0", str((1 << 20) + 1), str(1 << 24)]),
    (config.REQUEST_TTL_S, "request_ttl_s", 0.001, 86_400 * 7, ["0.0009", str(86_400 * 7 + 1), "inf", "-1"]),
]


@pytest.fixture(autouse=True)
def _no_settings(monkeypatch):
    """Each test starts from no OTEL_KVTRANSFER_* at all (a suite may run with some set, as CI's pass with the
    Python wrappers sets OTEL_KVTRANSFER_HOT_PATH)."""
    import os

    for name in [n for n in os.environ if n.startswith("OTEL_KVTRANSFER_")]:
        monkeypatch.delenv(name)


def test_the_hot_path_is_one_of_its_choices(monkeypatch, caplog):
    for raw, chosen in (("compiled", "compiled"), (" Python ", "python")):
        monkeypatch.setenv(config.HOT_PATH, raw)
        assert config.load().hot_path == chosen
    monkeypatch.setenv(config.HOT_PATH, "native")
    with caplog.at_level("WARNING", logger="otel_kvtransfer.config"):
        assert config.load() == DEFAULTS and DEFAULTS.hot_path == "compiled"
    (record,) = caplog.records
    assert config.HOT_PATH in record.getMessage() and "compiled, python" in record.getMessage()


@pytest.mark.parametrize("name, field, low, high, outside", RANGES, ids=[x[0] for x in RANGES])
def test_each_setting_accepts_its_range_and_rejects_beyond(monkeypatch, name, field, low, high, outside):
    for value in (low, high):
        monkeypatch.setenv(name, str(value))
        assert getattr(config.load(), field) == value
    for value in outside:
        monkeypatch.setenv(name, value)
        assert config.load() == DEFAULTS, value


def test_flush_interval_is_read_in_milliseconds(monkeypatch):
    for raw, seconds in (("1", 0.001), ("60000", 60.0), (" 250 ", 0.25)):
        monkeypatch.setenv(config.FLUSH_INTERVAL_MS, raw)
        assert config.load().flush_interval_s == seconds
    for raw in ("0.5", "60001", "-inf", "nan"):
        monkeypatch.setenv(config.FLUSH_INTERVAL_MS, raw)
        assert config.load() == DEFAULTS, raw


def test_the_largest_queue_is_bounded():
    """At ~540 B a queued record the largest accepted queue stays well under 1 GiB."""
    assert (1 << 18) * 540 < 1 << 30
    assert DEFAULTS.queue_size <= 1 << 18 and DEFAULTS.max_open_requests <= 1 << 20


def test_a_queue_of_67_million_records_is_refused(monkeypatch):
    monkeypatch.setenv(config.QUEUE_SIZE, "67108864")
    assert config.load().queue_size == DEFAULTS.queue_size == 65536


def test_a_rejected_value_is_logged_once_and_bounded(monkeypatch, caplog):
    monkeypatch.setenv(config.QUEUE_SIZE, "9" * 10_000)
    with caplog.at_level("WARNING", logger="otel_kvtransfer.config"):
        assert config.load() == DEFAULTS
    (record,) = caplog.records
    assert config.QUEUE_SIZE in record.getMessage()
    assert len(record.getMessage()) < 400  # the raw value is cut, not echoed whole


def test_unset_and_blank_mean_the_defaults(monkeypatch):
    for name, *_ in RANGES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(config.FLUSH_INTERVAL_MS, "   ")
    assert config.load() == DEFAULTS
