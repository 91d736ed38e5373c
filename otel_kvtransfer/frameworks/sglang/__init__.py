"""SGLang PD disaggregation (Mooncake backend): per-transfer, request, compute and decode-receive records.

`KVTransferInstrumentor` calls `instrument()` / `uninstrument()`. Nothing of sglang is imported here: each
sglang module is patched when it is imported (wrapt post-import hooks), so `opentelemetry-instrument python -m
sglang.launch_server ...` pays nothing at start-up and the spawned scheduler processes are patched when they load
their disaggregation code. On an sglang outside `SUPPORTED` a warning is logged once and nothing is patched.

What is wrapped, and why there (sglang 0.5.23):
- common.py here: names, the one Patcher, poll states and failure kinds both sides share.
- prefill.py here: the Mooncake manager's transfer worker (chunk dequeue, one transfer scope per
  (chunk x destination x payload) around `send_kvcache*` / `maybe_send_extra` / `send_aux`), the sender
  (request begin, conclusion through `update_status`), the scheduler's early cached-prefix send and its
  batch execution (compute intervals).
- decode.py here: `MooncakeKVReceiver` (`send_metadata` opens `kv_transfer.receive`, `poll` / `abort` end it;
  `DecodePreallocQueue._create_receiver_and_enqueue` tells which Req, hence which sglang span, it serves).
- plugin.py here: the `sglang.srt.plugins` entry point.
"""

import logging
from typing import Optional, Tuple

from otel_kvtransfer.frameworks.sglang.common import FRAMEWORK, patcher
from otel_kvtransfer.patching import own_error

_logger = logging.getLogger(__name__)

# The sglang releases whose disaggregation internals these wrappers were written against.
SUPPORTED = ">=0.5.23, <0.6"
_MIN: Tuple[int, ...] = (0, 5, 23)
_BELOW: Tuple[int, ...] = (0, 6)

_state = {"on": False, "hooks": False, "warned": False}


def _version_tuple(text: str) -> Tuple[int, ...]:
    parts = []
    for piece in text.split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if digits == "":
            break
        parts.append(int(digits))
        if digits != piece:
            break
    return tuple(parts)


def installed_version() -> Optional[str]:
    try:
        from importlib.metadata import version  # pylint: disable=import-outside-toplevel

        return version("sglang")
    except Exception:  # pylint: disable=broad-except
        return None


def is_supported(text: Optional[str]) -> bool:
    if not text:
        return False
    v = _version_tuple(text)
    return _MIN <= v < _BELOW


def _patches():
    from otel_kvtransfer.frameworks.sglang import decode, prefill  # pylint: disable=import-outside-toplevel

    return {
        "sglang.srt.disaggregation.common.utils": prefill.patch_common_utils,
        "sglang.srt.disaggregation.common.conn": prefill.patch_common_conn,
        "sglang.srt.disaggregation.mooncake.conn": prefill.patch_mooncake_conn,
        "sglang.srt.disaggregation.prefill": prefill.patch_prefill,
        "sglang.srt.managers.scheduler": prefill.patch_scheduler,
        "sglang.srt.disaggregation.common.conn#decode": decode.patch_common_conn,
        "sglang.srt.disaggregation.mooncake.conn#decode": decode.patch_mooncake_conn,
        "sglang.srt.disaggregation.decode": decode.patch_decode,
    }


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
    """Patch sglang now or when its modules are imported; False (and one warning) on an unsupported sglang."""
    version = installed_version()
    if version is None:
        return False
    if not is_supported(version):
        if not _state["warned"]:
            _state["warned"] = True
            _logger.warning(
                "otel_kvtransfer: sglang %s is outside the supported range %s; sglang is not instrumented",
                version,
                SUPPORTED,
            )
        return False
    if _state["on"]:
        return True
    _state["on"] = True
    import wrapt  # pylint: disable=import-outside-toplevel

    for key, patch in _patches().items():
        module_name = key.split("#", 1)[0]
        # Runs at once when the module is already imported; otherwise when it is. wrapt keeps hooks forever,
        # so they are registered once per process and consult _state["on"].
        if not _state["hooks"]:
            wrapt.register_post_import_hook(_hook(key, patch), module_name)
        else:
            import sys  # pylint: disable=import-outside-toplevel

            module = sys.modules.get(module_name)
            if module is not None:
                _hook(key, patch)(module)
    _state["hooks"] = True
    return True


def uninstrument() -> None:
    if not _state["on"]:
        return
    _state["on"] = False
    from otel_kvtransfer.frameworks.sglang import prefill  # pylint: disable=import-outside-toplevel

    patcher.unwrap_all()
    prefill.forget_rooms()


__all__ = ["FRAMEWORK", "SUPPORTED", "instrument", "uninstrument", "is_supported", "installed_version"]
