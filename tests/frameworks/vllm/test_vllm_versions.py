"""The version policy (otel_kvtransfer.wiring.activation + otel_kvtransfer.wiring.targets) and the wrappers' own guards.

Runs in the main project venv, where vLLM is not installed. A release that renamed something is made here as a
module of our own (named as such): no real vLLM release has broken a target yet, and the policy must be tested
before one does. The real releases go through the same checks in test_vllm_connector_paths.py (0.32.0 and
0.33.0 classes) and test_version_canary.py (the newest wheels' source).
"""

import ast
import asyncio
import logging
import sys
import types

import pytest

from otel_kvtransfer.frameworks import vllm as vllm_framework
from otel_kvtransfer.frameworks.vllm import mooncake as vllm_mooncake
from otel_kvtransfer.frameworks.vllm import nixl as vllm_nixl
from otel_kvtransfer.frameworks.vllm import trace_context as vllm_trace_context
from otel_kvtransfer.recording.patching import FrameworkSpec, Patch, Patcher, is_ours
from otel_kvtransfer.wiring.activation import LazyPatcher
from otel_kvtransfer.wiring.targets import Target, missing, missing_in_source

LOGGER = "otel_kvtransfer.wiring.activation"


@pytest.mark.parametrize("version,tested,newer", [
    ("0.32.0", True, False), ("0.32.7", True, False), ("0.33.0", True, False), ("0.33.2rc1", True, False),
    ("0.34.0", True, False), ("0.35.0", False, True), ("1.0.0", False, True), ("0.31.9", False, False),
    ("", False, False), (None, False, False), ("garbage", False, False),
])
def test_declared_range_and_newer_releases(version, tested, newer):
    assert vllm_framework.is_supported(version) is tested
    assert vllm_framework.HOOKS.is_newer(version) is newer


# A stand-in release: one module with the class a wrapper patches (our own code, named as such).
class _Worker:
    def __init__(self):
        self.sent = set()

    def send(self, session, payload):
        return (session, payload)


def _release(name, worker_class):
    module = types.ModuleType(name)
    module.Worker = worker_class
    sys.modules[name] = module
    return module


def _hooks(module_names, version):
    patcher = Patcher("stand-in")

    def wrapper(wrapped, instance, args, kwargs):
        return wrapped(*args, **kwargs)

    def patch(module):
        patcher.wrap(module.Worker, "send", wrapper)

    targets = {name: [Target(name, "Worker", "send", ("session", "payload"), ("sent",))] for name in module_names}
    spec = FrameworkSpec("standin", ("standin",), ">=0.32, <0.34", tuple(Patch(n, patch) for n in module_names),
                         targets=lambda: targets)
    hooks = LazyPatcher(spec, patcher)
    hooks.installed_version = lambda: version
    return hooks, patcher


def test_a_newer_release_that_passes_the_check_is_instrumented_and_said_once(caplog):
    module = _release("kvt_standin_newer", _Worker)
    hooks, patcher = _hooks(["kvt_standin_newer"], "0.35.1")
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert hooks.instrument() is True
            hooks.uninstrument()
            assert hooks.instrument() is True
        assert is_ours(module.Worker.__dict__["send"])
        said = [r.getMessage() for r in caplog.records if "newer than the tested range" in r.getMessage()]
        assert len(said) == 1 and "0.35.1" in said[0] and ">=0.32, <0.34" in said[0]
    finally:
        hooks.uninstrument()
        sys.modules.pop("kvt_standin_newer", None)
    assert patcher.patched() == []


@pytest.mark.parametrize("version", ["0.33.0", "0.40.0"])
def test_a_release_missing_a_target_is_named_and_nothing_of_the_framework_is_patched(caplog, version):
    """The first module passes and is patched; the second lacks `Worker.send(payload)`: one warning names it,
    and the first module's patch is undone too (in the range or past it)."""
    good = _release("kvt_standin_good", _Worker)
    # the same class, with `send`'s second parameter renamed
    _release("kvt_standin_renamed", type("Worker", (_Worker,), {"send": lambda self, session, data: None}))
    hooks, patcher = _hooks(["kvt_standin_good", "kvt_standin_renamed"], version)
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert hooks.instrument() is False
            assert hooks.instrument() is False
        warnings = [r.getMessage() for r in caplog.records if "lacks what its instrumentation needs" in r.getMessage()]
        assert len(warnings) == 1
        assert "kvt_standin_renamed: Worker.send(payload)" in warnings[0]
        assert patcher.patched() == [] and not is_ours(good.Worker.__dict__["send"])
        assert hooks.blocked.startswith("kvt_standin_renamed")
    finally:
        hooks.uninstrument()
        for name in ("kvt_standin_good", "kvt_standin_renamed"):
            sys.modules.pop(name, None)


def test_a_release_below_the_range_warns_once_and_patches_nothing(caplog):
    _release("kvt_standin_old", _Worker)
    hooks, patcher = _hooks(["kvt_standin_old"], "0.31.0")
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert hooks.instrument() is False
            assert hooks.instrument() is False
        assert len([r for r in caplog.records if "outside the supported range" in r.getMessage()]) == 1
        assert patcher.patched() == []
    finally:
        sys.modules.pop("kvt_standin_old", None)


def test_runtime_check_reads_fields_annotations_and_self_assignments():
    module = _release("kvt_standin_fields", _Worker)
    try:
        assert missing(module, [Target("kvt_standin_fields", "Worker", "send", ("session",), ("sent",))]) == []
        assert missing(module, [Target("kvt_standin_fields", "Worker", attrs=("renamed_in_a_release",))]) == [
            "Worker.renamed_in_a_release"]
        assert missing(module, [Target("kvt_standin_fields", "Gone", "send")]) == ["Gone"]
    finally:
        sys.modules.pop("kvt_standin_fields", None)


SOURCE = '''
from .base import Base

class Worker(Base):
    flag: bool = False

    def __init__(self):
        self.finished_sending_reqs = set()

    async def _send_blocks(self, remote_session, src_ptrs, dst_ptrs, lengths):
        self.count += 1
'''
BASE = '''
class Base:
    def start_load_kv(self, metadata):
        self.pending: dict = {}
'''


def test_source_check_follows_bases_and_names_what_is_missing():
    trees = {"pkg.worker": ast.parse(SOURCE), "pkg.base": ast.parse(BASE)}
    tree_of = trees.get
    ok = [Target("pkg.worker", "Worker", "_send_blocks", ("remote_session", "src_ptrs"), ("finished_sending_reqs",
                                                                                       "count", "flag", "pending")),
          Target("pkg.worker", "Worker", "start_load_kv", ("metadata",))]
    assert missing_in_source(tree_of, ok) == []
    broken = [Target("pkg.worker", "Worker", "_send_blocks", ("src", "remote_session"), ("finished",)),
              Target("pkg.worker", "Worker", "fetch_finished"), Target("pkg.worker", "Gone")]
    assert missing_in_source(tree_of, broken) == [
        "Worker._send_blocks(src)", "Worker.finished", "Worker.fetch_finished", "Gone"]


# --- every read of vLLM's state inside the wrapper's own guard ------------------------------------------------


class _Renamed:
    """A vLLM worker of a patch release that renamed `finished_sending_reqs` (a stand-in: no release did yet)."""

    def __init__(self):
        self.finished_sends = {"p1"}


def test_mooncake_fetch_sending_survives_a_renamed_attribute(telemetry):
    async def fetch():
        return {"p1"}

    result = asyncio.run(vllm_mooncake._fetch_sending_wrapper(fetch, _Renamed(), (), {}))
    assert result == {"p1"}  # vLLM's own answer, unchanged; before, AttributeError in vLLM's sender loop
    drops = {p.attributes.get("kv_transfer.drop_reason"): p.value
             for p in telemetry.metrics().get("kv_transfer.instrumentation.dropped", [])}
    assert drops.get("wrapper_error") == 1


def test_nixl_reap_expired_survives_an_unexpected_argument(telemetry):
    calls = []

    def reap(done_sending):
        calls.append(done_sending)
        return "reaped"

    # a release that passes something else than a set of request ids
    assert vllm_nixl._reap_expired_wrapper(reap, object(), (7,), {}) == "reaped"
    assert calls == [7]  # called exactly once, with its argument; before, TypeError before vLLM's call
    drops = {p.attributes.get("kv_transfer.drop_reason"): p.value
             for p in telemetry.metrics().get("kv_transfer.instrumentation.dropped", [])}
    assert drops.get("wrapper_error") == 1


def test_vllm_targets_name_every_wrapped_method():
    """targets.py is what the gate and the canary check: it lists every method patch() wraps."""
    from otel_kvtransfer.frameworks.vllm import targets

    wrapped = set()
    for source in (vllm_mooncake, vllm_nixl, vllm_trace_context):
        for node in ast.walk(ast.parse(open(source.__file__, encoding="utf-8").read())):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "wrap" and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant)):
                wrapped.add(node.args[1].value)
    declared = {t.method for t in targets.ALL if t.method}
    assert wrapped <= declared, wrapped - declared
