"""Shared test helpers.

A test that needs a real part (the Mooncake wheel, sglang, Prometheus, Chromium, Phoenix, node) calls
`require_part(ok, what)`: locally a missing part skips the test with the fix in the reason; in CI (CI=true) it
fails the test, so a green CI always means the real parts ran.
"""

import json
import os

import pytest

# Mooncake logs every connection at INFO; the tests only need its errors.
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_part(ok: bool, what: str) -> None:
    if ok:
        return
    message = f"missing real part: {what} (run `bash scripts/setup.sh`)"
    if IN_CI:
        pytest.fail(message)
    pytest.skip(message)


def mooncake_importable() -> bool:
    try:
        import mooncake.engine  # noqa: F401  imported only to see that the engine loads
    except Exception:
        return False
    return True


class Telemetry:
    """An SDK TracerProvider with an in-memory exporter and an in-memory metric reader, instrumented."""

    def __init__(self, sampler=None):
        from opentelemetry.test.test_base import TestBase

        from otel_kvtransfer import KVTransferInstrumentor

        # opentelemetry-test-utils' providers: a SimpleSpanProcessor into an in-memory exporter, an in-memory
        # metric reader. Handed to instrument() explicitly: the global providers stay untouched.
        self.tracer_provider, self.exporter = TestBase.create_tracer_provider(**({"sampler": sampler} if sampler
                                                                                 else {}))
        self.meter_provider, self.reader = TestBase.create_meter_provider()
        self.instrumentor = KVTransferInstrumentor()

    def instrument(self):
        self.instrumentor.instrument(tracer_provider=self.tracer_provider, meter_provider=self.meter_provider)
        return self

    def uninstrument(self):
        self.instrumentor.uninstrument()

    def spans(self, name=None):
        self.tracer_provider.force_flush()
        spans = self.exporter.get_finished_spans()
        return [s for s in spans if name is None or s.name == name]

    def metrics(self):
        """{metric name: [data points]} of everything recorded so far."""
        self.tracer_provider.force_flush()
        return metric_points(self.reader)


def metric_points(reader) -> dict:
    """{metric name: [data points]} of one collection by an in-memory metric reader."""
    found = {}
    data = reader.get_metrics_data()
    for resource_metrics in (data.resource_metrics if data else []):
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                found.setdefault(metric.name, []).extend(metric.data.data_points)
    return found


@pytest.fixture
def telemetry():
    t = Telemetry().instrument()
    yield t
    t.uninstrument()


@pytest.fixture(scope="module")
def receiver():
    require_part(mooncake_importable(), "the Mooncake engine (mooncake-transfer-engine-non-cuda + libibverbs1)")
    from otel_kvtransfer.demo.loopback import Receiver

    r = Receiver(64 << 20, env={"MC_FORCE_TCP": "1", "MC_TRANSFER_TIMEOUT": "5"})
    yield r
    r.stop()


@pytest.fixture(scope="module")
def engine():
    require_part(mooncake_importable(), "the Mooncake engine (mooncake-transfer-engine-non-cuda + libibverbs1)")
    import numpy as np

    from otel_kvtransfer.demo.loopback import open_engine

    os.environ.setdefault("MC_TRANSFER_TIMEOUT", "5")
    e = open_engine()
    source = np.random.default_rng(1).integers(0, 256, 64 << 20, dtype=np.uint8)
    assert e.register_memory(source.ctypes.data, source.nbytes) == 0
    yield _Engine(e, source)


class _Engine:
    """The test process's engine with its registered source buffer."""

    def __init__(self, engine, source):
        self.engine = engine
        self.source = source
        self.base = source.ctypes.data


def console_json_objects(text: str) -> list:
    """Every JSON object that OpenTelemetry's console exporters printed in `text` (other output is skipped)."""
    decoder = json.JSONDecoder()
    found, index = [], 0
    while True:
        start = text.find("{", index)
        if start < 0:
            return found
        try:
            obj, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            index = start + 1
            continue
        found.append(obj)
        index = end


def console_points(objects: list, name: str) -> list:
    """(attributes, value) of every data point of metric `name` in console-exporter JSON `objects`, in order."""
    found = []
    for obj in objects:
        for rm in obj.get("resource_metrics", []):
            for sm in rm.get("scope_metrics", []):
                for metric in sm.get("metrics", []):
                    if metric["name"] == name:
                        found += [(p.get("attributes", {}), p.get("value")) for p in metric["data"]["data_points"]]
    return found
