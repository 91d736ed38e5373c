"""The fixtures the tests share: instrumented in-memory telemetry, a meter provider with an in-memory reader, a
real Mooncake engine and receiver on 127.0.0.1, and each path of the async wrappers. The helpers themselves live in
tests/support/ (parts, telemetry, console, ...)."""

import os

import pytest
from support import compiled_module
from support.parts import mooncake_importable, require_part
from support.telemetry import Telemetry, in_memory_metrics

compiled_module.load_chosen()  # a sanitizer build of the compiled part, when scripts/stress-compiled.sh names one
# Mooncake logs every connection at INFO; the tests only need its errors.
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


@pytest.fixture
def telemetry():
    t = Telemetry().instrument()
    yield t
    t.uninstrument()


@pytest.fixture(params=("compiled", "python"))
def hot_path(request, monkeypatch):
    """Each of the two paths the async wrappers have (otel_kvtransfer/engines/mooncake/compiled.py): whatever
    instruments after this fixture makes its wrappers on it. Ask for it before the fixture that instruments."""
    from otel_kvtransfer import config
    from otel_kvtransfer.engines.mooncake import compiled

    if request.param == "compiled":
        require_part(compiled.available(), "the package's compiled part (pip install -e . with a C compiler)")
    monkeypatch.setenv(config.HOT_PATH, request.param)
    return request.param


@pytest.fixture
def meter():
    """(MeterProvider, InMemoryMetricReader) for one test, not instrumented (support.telemetry.in_memory_metrics):
    for a test that hands the provider to the part it checks itself. Shut down after the test."""
    provider, reader = in_memory_metrics(shutdown_on_exit=False)
    yield provider, reader
    provider.shutdown()


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
