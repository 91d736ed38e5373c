"""A stand-in for `torch_npu` (Ascend's PyTorch backend, which loads only with Ascend's CANN driver and an NPU):
vllm-ascend's connector modules import it at module level, and one of them reads `torch.npu.Event` in a class body.
Nothing here runs on the paths the tests drive (KV in host memory, no NPU stream, no NPU kernel): it only lets the
release's own modules import on a CPU host, says that no NPU is available, and takes a thread's device selection as
a no-op. Each call that would need the device raises."""

import types

import torch


def _needs_an_npu(*args, **kwargs):
    raise RuntimeError("torch_npu stand-in: no NPU on this host")


class _DeviceObject:
    """torch.npu.Event / torch.npu.Stream: only their names are read where the tests run."""

    def __init__(self, *args, **kwargs):
        _needs_an_npu()


npu = types.ModuleType("torch.npu")
npu.Event = _DeviceObject  # type: ignore[attr-defined]
npu.Stream = _DeviceObject  # type: ignore[attr-defined]
# the truth here (others ask it: transformers)
npu.is_available = lambda: False  # type: ignore[attr-defined]
npu.device_count = lambda: 0  # type: ignore[attr-defined]
# Selecting the device a thread works on (vllm-ascend's executors do it for each worker): the host here, nothing to
# select.
npu.set_device = lambda device: None  # type: ignore[attr-defined]
npu.current_stream = _needs_an_npu  # type: ignore[attr-defined]
torch.npu = npu  # type: ignore[attr-defined]  # what the real torch_npu registers on import
