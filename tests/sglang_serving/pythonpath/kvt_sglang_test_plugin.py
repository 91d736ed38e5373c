"""TEST-ONLY sglang plugin (entry point group `sglang.srt.plugins`), loaded by sglang in every process it serves
with (engine, scheduler, detokenizer), found through the dist-info folder beside it on PYTHONPATH.

1. Stand-in for what cannot run here: `MooncakeKVSender.supports_host_tensor_indices` is hard-coded True in
   sglang 0.5.23 and makes the sender stage page indices through pinned memory and a CUDA event; on this CPU-only
   machine it is set False, so sglang takes its plain host path.
2. Stand-in for what cannot run here (NIXL backend): sglang registers its KV pool with NIXL as VRAM, and UCX
   built without CUDA refuses VRAM ("VRAM memory is detected as host by UCX"). Before `NixlKVManager.__init__`
   runs, the KV buffers are declared DRAM (what they are on this machine).
3. Test plumbing: each process serves its OpenTelemetry Prometheus endpoint on a port of its own
   (OTEL_EXPORTER_PROMETHEUS_PORT=0, as sglang's processes share one environment); when
   KVT_TEST_PROMETHEUS_SD_DIR is set, this writes the port the process got as a Prometheus file_sd target, so the
   real Prometheus finds every engine process.
4. Stand-in for what cannot run here (MLA models, only when KVT_TEST_MLA_ON_TORCH_NATIVE=1): sglang 0.5.23's
   only CPU MLA attention (intel_amx) needs the real sgl_kernel, and its DeepSeek attention dispatch has no entry
   for torch_native, so it falls back to triton's choice: MHA for a fresh prefill, which reads the latent KV pool
   as if it held per-head K and V and fails. torch_native is routed to sglang's own MLA dispatch instead (the
   latent attention, computed by torch_native's SDPA); the KV pool, and the transfer that moves it, stay
   sglang's own.
5. Stand-in for what cannot run here (only when KVT_TEST_KV_CHECKSUM_ON_CPU=1): sglang's KV checksum
   (`--disaggregation-enable-kv-checksum`) digests the KV pages with a CUDA kernel (`KvChecksumComputer.compute`,
   sglang/srt/disaggregation/checksum.py, through kernels/ops/memory/adler32.py). That one method is replaced by
   the same digest computed on the host buffers: Adler-32 of the selected items of every buffer, buffer after
   buffer, each item `item_len` bytes at `ptr + index * item_len` (what the kernel computes block by block and
   combines in order), 1 when there is none. Everything around it (where the prefill stores the digest, the
   metadata row that carries it, the decode's verification, its drop of a mismatching request, sglang's test
   switch SGLANG_TEST_DISAGG_KV_CHECKSUM_MISMATCH_PROB) stays sglang's own.
"""

import json
import os
import sys

_MOONCAKE_CONN = "sglang.srt.disaggregation.mooncake.conn"
_NIXL_CONN = "sglang.srt.disaggregation.nixl.conn"
_MLA_DISPATCH = "sglang.srt.models.deepseek_common.attention_backend_handler"
_CHECKSUM = "sglang.srt.disaggregation.checksum"
_ROLES = {"run_scheduler_process": "scheduler", "run_detokenizer_process": "detokenizer",
          "run_data_parallel_controller_process": "dp_controller"}


def _host_indices_off(module) -> None:
    module.MooncakeKVSender.supports_host_tensor_indices = False


def _kv_pool_as_dram(module) -> None:
    import wrapt

    def init(wrapped, _instance, args, kwargs):
        kv_args = args[0] if args else kwargs["args"]
        kv_args.kv_data_mem_kinds = ["DRAM"] * len(kv_args.kv_data_ptrs)
        return wrapped(*args, **kwargs)

    wrapt.wrap_function_wrapper(module, "NixlKVManager.__init__", init)


def _mla_on_torch_native(module) -> None:
    module.AttentionBackendRegistry.register("torch_native", module._dispatch_mla_subtype)


def _adler32_on_host(self, kv_page_indices, state_indices=None) -> int:
    import ctypes
    import zlib

    selected = [(ptr, item_len, kv_page_indices) for ptr, item_len in zip(self._kv_data_ptrs, self._kv_item_lens)]
    if self._state_data_ptrs:
        selected += [(ptr, item_len, state_indices)
                     for ptr, item_len in zip(self._state_data_ptrs, self._state_item_lens)]
    digest = 1  # Adler-32 of nothing
    for ptr, item_len, indices in selected:
        for index in indices.tolist():
            digest = zlib.adler32(ctypes.string_at(ptr + index * item_len, item_len), digest)
    return digest


def _checksum_on_host(module) -> None:
    module.KvChecksumComputer.compute = _adler32_on_host


def _on_import(name, patch) -> None:
    if name in sys.modules:
        patch(sys.modules[name])
    else:
        import wrapt

        wrapt.register_post_import_hook(patch, name)


def _role() -> str:
    frame = sys._getframe(1)
    while frame is not None:
        role = _ROLES.get(frame.f_code.co_name)
        if role:
            return role
        frame = frame.f_back
    return "engine"


def _prometheus_port():
    """The port of the Prometheus HTTP server that OTEL_METRICS_EXPORTER=prometheus started in this process."""
    import gc
    from wsgiref.simple_server import WSGIServer

    # type(o), not isinstance(o): no __class__ look-up on lazy modules (torch warns on those)
    ports = [o.server_address[1] for o in gc.get_objects() if issubclass(type(o), WSGIServer)]
    return ports[0] if len(ports) == 1 else None


def _publish_metrics_target(directory: str) -> None:
    port = _prometheus_port()
    if port is None:
        return
    labels = {"pid": str(os.getpid()), "sglang_process": _role(),
              "service": os.environ.get("OTEL_SERVICE_NAME", "")}
    path = os.path.join(directory, f"{os.getpid()}.json")
    with open(path + ".tmp", "w", encoding="utf-8") as out:
        json.dump([{"targets": [f"127.0.0.1:{port}"], "labels": labels}], out)
    os.replace(path + ".tmp", path)  # Prometheus never reads a half-written file


def activate() -> None:
    _on_import(_MOONCAKE_CONN, _host_indices_off)
    _on_import(_NIXL_CONN, _kv_pool_as_dram)
    if os.environ.get("KVT_TEST_MLA_ON_TORCH_NATIVE") == "1":
        _on_import(_MLA_DISPATCH, _mla_on_torch_native)
    if os.environ.get("KVT_TEST_KV_CHECKSUM_ON_CPU") == "1":
        _on_import(_CHECKSUM, _checksum_on_host)
    directory = os.environ.get("KVT_TEST_PROMETHEUS_SD_DIR")
    if directory and os.path.isdir(directory):
        _publish_metrics_target(directory)
