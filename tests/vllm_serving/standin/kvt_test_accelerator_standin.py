"""TEST-ONLY stand-in (never shipped): `torch.accelerator.current_device_index()` answers 0 on a CPU-only torch.

vLLM 0.32's `MooncakeConnectorWorker.__init__` asks torch for the current accelerator index, which raises
"Cannot access accelerator device when none is available" on a machine without a GPU. The index only picks the
device the Mooncake sender threads bind to; on CPU there is none to pick, so 0 is as good as any. This module is
loaded by vLLM's own plugin loader (group `vllm.general_plugins`, declared by the dist-info folder beside it) in
every vLLM process, because the tests put this folder on PYTHONPATH. It changes nothing when an accelerator
exists.

Second stand-in, for this machine kind: vLLM 0.32's CPU attention picks its AMX kernel for bf16 when torch says
AMX tiles are usable, and on these virtual machines that kernel dies with SIGILL (the decode worker, at its first
step on KV loaded from the prefill side: `cpu_attention_with_kv_cache`) although the CPU flags list AMX. Telling
vLLM that AMX is not there makes it take its AVX-512 kernel; the KV cache and its bytes per block are the same.
`KVT_TEST_KEEP_AMX=1` keeps AMX (on a host where it works).
"""

import os

_state = {"patched": False}


def activate() -> None:
    import torch

    if os.environ.get("KVT_TEST_KEEP_AMX") != "1" and hasattr(getattr(torch, "cpu", None), "_is_amx_tile_supported"):
        torch.cpu._is_amx_tile_supported = lambda: False
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None or _state["patched"] or accelerator.is_available():
        return
    accelerator.current_device_index = lambda: 0
    _state["patched"] = True
