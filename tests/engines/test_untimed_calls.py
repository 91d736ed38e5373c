"""No silent blind spot: every public call of an engine class is timed, or known to move no bytes, or counted.

On the real Mooncake `TransferEngine` (0.3.13.post1, the CPU build) and the real NIXL `nixl_agent` (1.5.1), nothing
is left over. A real engine class given a call this package has never heard of (what a newer release brings): it is
wrapped only to count, `kv_transfer.instrumentation.untimed_calls` counts each use by backend and call name, one
WARNING names it on its first use (once per process), the start-up line names it, and the call's return value and
exception pass through untouched; uninstrument puts the class back exactly. Mooncake 0.3.14 (the CUDA 13 build) is
checked the same way in tests/engines/test_mooncake_cuda13.py.
"""

import logging
import os
import subprocess
import sys
import textwrap

import pytest
from support.parts import mooncake_importable, require_part
from support.paths import ROOT

from otel_kvtransfer import semconv
from otel_kvtransfer.recording import untimed


def _engine_class():
    require_part(mooncake_importable(), "the Mooncake engine (bash scripts/setup.sh)")
    import mooncake.engine

    return mooncake.engine.TransferEngine


def _nixl_agent_class():
    try:
        import nixl._api
    except ImportError:
        require_part(False, "NIXL (bash scripts/setup.sh)")
    return nixl._api.nixl_agent


def test_mooncake_0_3_13_has_no_call_left_over():
    from otel_kvtransfer.engines import mooncake

    engine = _engine_class()
    assert untimed.unknown_calls(engine, mooncake.timed_calls(), mooncake.QUIET_CALLS) == []
    # the lists name real calls: a timed or quiet name that no release has would hide nothing and mean nothing
    calls = set(untimed.public_calls(engine))
    assert {"transfer_sync_write", "batch_transfer_async_write", "transfer_check_status"} <= calls
    assert mooncake.QUIET_CALLS <= calls


def test_nixl_1_5_has_no_call_left_over():
    from otel_kvtransfer.engines import nixl

    agent = _nixl_agent_class()
    assert untimed.unknown_calls(agent, nixl.TIMED_CALLS, nixl.QUIET_CALLS) == []
    assert (nixl.TIMED_CALLS | nixl.QUIET_CALLS) <= set(untimed.public_calls(agent))


def _points(telemetry):
    return {(p.attributes[semconv.BACKEND], p.attributes[semconv.CODE_FUNCTION_NAME]): p.value
            for p in telemetry.metrics().get(semconv.METRIC_UNTIMED_CALLS, [])}


def test_an_unknown_call_on_the_real_engine_class_is_counted_named_and_passed_through(telemetry, caplog):
    engine_class = _engine_class()
    from otel_kvtransfer.engines import mooncake

    telemetry.uninstrument()  # the class gets its new call first, as a newer release would ship it

    def transfer_sync_write_turbo(self, session, length):
        if length < 0:
            raise ValueError("negative length")
        return ("moved", session, length)

    engine_class.transfer_sync_write_turbo = transfer_sync_write_turbo
    try:
        telemetry.instrument()
        assert untimed.found() == [("mooncake", ["transfer_sync_write_turbo"])]
        assert engine_class.__dict__["transfer_sync_write_turbo"] is not transfer_sync_write_turbo  # wrapped

        engine = engine_class()
        with caplog.at_level(logging.WARNING, logger="otel_kvtransfer"):
            assert engine.transfer_sync_write_turbo("127.0.0.1:1", 8) == ("moved", "127.0.0.1:1", 8)
            assert engine.transfer_sync_write_turbo("127.0.0.1:1", 16) == ("moved", "127.0.0.1:1", 16)
            with pytest.raises(ValueError, match="negative length") as raised:
                engine.transfer_sync_write_turbo("127.0.0.1:1", -1)
        assert raised.type is ValueError  # the engine's own exception, unchanged
        warnings = [r.getMessage() for r in caplog.records if "transfer_sync_write_turbo" in r.getMessage()]
        assert len(warnings) == 1 and "does not time" in warnings[0] and warnings[0].startswith("otel_kvtransfer")
        assert _points(telemetry) == {("mooncake", "transfer_sync_write_turbo"): 3}
        assert not telemetry.dropped()  # counting is not a wrapper error

        telemetry.uninstrument()
        assert engine_class.__dict__["transfer_sync_write_turbo"] is transfer_sync_write_turbo  # restored exactly
        assert untimed.found() == []
        assert mooncake.patcher.patched() == []
    finally:
        del engine_class.transfer_sync_write_turbo
        telemetry.instrument()


def test_an_unknown_static_call_on_the_real_nixl_agent_keeps_its_binding(telemetry):
    agent_class = _nixl_agent_class()
    telemetry.uninstrument()
    agent_class.describe_peer = staticmethod(lambda name: f"peer {name}")
    try:
        telemetry.instrument()
        import nixl  # noqa: F401  (already imported: patched now)

        assert ("nixl", ["describe_peer"]) in untimed.found()
        assert agent_class.describe_peer("a") == "peer a"  # called on the class: no instance slipped in
        assert _points(telemetry) == {("nixl", "describe_peer"): 1}
    finally:
        telemetry.uninstrument()
        del agent_class.describe_peer
        telemetry.instrument()


def test_the_start_up_line_names_the_untimed_call_and_the_engine_build():
    require_part(mooncake_importable(), "the Mooncake engine (bash scripts/setup.sh)")
    script = textwrap.dedent("""
        import mooncake.engine
        from opentelemetry.sdk.trace import TracerProvider
        from otel_kvtransfer.wiring import startup
        from otel_kvtransfer.wiring.instrumentor import KVTransferInstrumentor
        mooncake.engine.TransferEngine.batch_transfer_sync_write_v2 = lambda self, *a: 0
        KVTransferInstrumentor().instrument(tracer_provider=TracerProvider())
        startup.role_known("sglang", "prefill", {"kv_transfer.tp_rank": 0})
    """)
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("OTEL_TRACES_EXPORTER", None)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [text for text in proc.stderr.splitlines() if "otel_kvtransfer: on (" in text]
    assert "; untimed calls: mooncake batch_transfer_sync_write_v2(); " in line
    from importlib import metadata

    assert f"engines: mooncake {metadata.version('mooncake-transfer-engine-non-cuda')} " \
           "(mooncake-transfer-engine-non-cuda)" in line


def test_a_call_found_after_the_line_went_out_gets_a_line_of_its_own():
    """The line went out before the engine was imported (a framework named the role first): the engine's unknown
    call, found when the engine is imported and patched, is named in one WARNING then."""
    require_part(mooncake_importable(), "the Mooncake engine (bash scripts/setup.sh)")
    script = textwrap.dedent("""
        import sys
        from opentelemetry.sdk.trace import TracerProvider
        from otel_kvtransfer.wiring import startup
        from otel_kvtransfer.wiring.instrumentor import KVTransferInstrumentor
        assert "mooncake.engine" not in sys.modules
        KVTransferInstrumentor().instrument(tracer_provider=TracerProvider())
        startup.role_known("sglang", "prefill", {"kv_transfer.tp_rank": 0})
        import mooncake.engine  # patched as it is imported: the new call is found now
    """)
    # a new call can only be given to the class once it exists: a sitecustomize-free way is an import hook that
    # runs before ours (registered first, so it runs first)
    prelude = textwrap.dedent("""
        import wrapt
        def _add(module):
            module.TransferEngine.transfer_sync_write_later = lambda self, *a: 0
        wrapt.register_post_import_hook(_add, "mooncake.engine")
    """)
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("OTEL_TRACES_EXPORTER", None)
    proc = subprocess.run([sys.executable, "-c", prelude + script], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    (startup_line,) = [text for text in lines if "otel_kvtransfer: on (" in text]
    assert "untimed calls: none" in startup_line
    late = [text for text in lines if "calls this package does not time" in text]
    assert len(late) == 1 and late[0].endswith("mooncake calls this package does not time, counted in "
                                               "kv_transfer.instrumentation.untimed_calls: transfer_sync_write_later")
