"""The vLLM framework package without servers: the version gate and the plugin entry point (the version policy
itself: test_vllm_versions.py).

These run in the main project venv, where vLLM is not installed: the gate is driven through
`installed_version` (the distribution lookup), and the patches are post-import hooks, so nothing of vLLM is
imported. The real connectors are exercised by tests/deployments/test_vllm_serving.py.
"""

import logging

import pytest

from otel_kvtransfer.frameworks import vllm as vllm_framework


@pytest.mark.parametrize("version,supported", [
    ("0.32.0", True), ("0.32.7", True), ("0.32.1rc1", True), ("0.33.0", True), ("0.34.0", True), ("0.35.0", False),
    ("0.31.9", False), ("1.0.0", False), ("", False), (None, False), ("garbage", False),
])
def test_version_gate(version, supported):
    assert vllm_framework.is_supported(version) is supported


def test_unsupported_version_warns_once_and_patches_nothing(monkeypatch, caplog):
    monkeypatch.setattr(vllm_framework.HOOKS, "installed_version", lambda: "0.31.0")
    monkeypatch.setattr(vllm_framework.HOOKS, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="otel_kvtransfer.wiring.activation"):
        assert vllm_framework.instrument() is False
        assert vllm_framework.instrument() is False
    warnings = [r for r in caplog.records if "outside the supported range" in r.getMessage()]
    assert len(warnings) == 1
    assert "0.31.0" in warnings[0].getMessage()
    assert "vllm" in warnings[0].getMessage()
    assert vllm_framework.patcher.patched() == []


def test_no_vllm_installed_is_silently_not_instrumented(monkeypatch, caplog):
    monkeypatch.setattr(vllm_framework.HOOKS, "installed_version", lambda: None)
    with caplog.at_level(logging.WARNING):
        assert vllm_framework.instrument() is False
    assert not caplog.records


def test_supported_version_hooks_without_importing_vllm(monkeypatch):
    import sys

    monkeypatch.setattr(vllm_framework.HOOKS, "installed_version", lambda: "0.32.0")
    try:
        assert vllm_framework.instrument() is True
        assert not any(name == "vllm" or name.startswith("vllm.") for name in sys.modules)
    finally:
        vllm_framework.uninstrument()
    assert vllm_framework.patcher.patched() == []


def test_plugin_entry_point_is_declared():
    from importlib.metadata import entry_points

    (entry,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "kv_transfer"]
    assert entry.value == "otel_kvtransfer.frameworks.vllm.plugin:activate"
    assert callable(entry.load())
