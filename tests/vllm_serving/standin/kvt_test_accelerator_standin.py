"""TEST-ONLY stand-in (never shipped): `torch.accelerator.current_device_index()` answers 0 on a CPU-only torch.

vLLM 0.32's `MooncakeConnectorWorker.__init__` asks torch for the current accelerator index, which raises
"Cannot access accelerator device when none is available" on a machine without a GPU. The index only picks the
device the Mooncake sender threads bind to; on CPU there is none to pick, so 0 is as good as any. This module is
loaded by vLLM's own plugin loader (group `vllm.general_plugins`, declared by the dist-info folder beside it) in
every vLLM process, because the tests put this folder on PYTHONPATH. It changes nothing when an accelerator
exists.
"""

_state = {"patched": False}


def activate() -> None:
    import torch  # pylint: disable=import-outside-toplevel

    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None or _state["patched"] or accelerator.is_available():
        return
    accelerator.current_device_index = lambda: 0
    _state["patched"] = True
