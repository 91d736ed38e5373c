"""SGLang HiCache's NIXL storage backend moving KV pages to and from a storage tier, instrumented, for
tests/frameworks/sglang/test_sglang_hicache_offload.py. Prints one JSON object: what moved, and the spans and metric
points made.

    python sglang_hicache_app.py STORAGE_DIR

Real: sglang's own `MHATokenToKVPool` (the device pool, here on the CPU), its `MHATokenToKVPoolHost` (the host tier,
page-first layout, not pinned: there is no device to pin for) and `HiCacheNixl` with NIXL's POSIX plugin writing
files under STORAGE_DIR: `batch_set_v1` (host pages to storage), then `batch_get_v1` (storage into other host pages),
the bytes compared page by page. Nothing is stood in. Beside it, one KV request through the integration API over
a real Mooncake pair, so the request metrics have something of their own to count.
"""

import json
import os
import sys

import numpy as np
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_kvtransfer import KVTransferInstrumentor
from otel_kvtransfer import integration as kvt

PAGE, PAGES, HEADS, HEAD_DIM, LAYERS = 4, 3, 2, 64, 2


def _value(v):
    return v if isinstance(v, (bool, int, float, str)) else str(v)


def main(storage_dir: str) -> dict:
    exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    meter_provider = MeterProvider(metric_readers=[reader])
    instrumentor = KVTransferInstrumentor()
    instrumentor.instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)

    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.storage.nixl.hicache_nixl import HiCacheNixl

    device = MHATokenToKVPool(256, PAGE, torch.bfloat16, HEADS, HEAD_DIM, LAYERS, "cpu", False, start_layer=0,
                              end_layer=LAYERS, enable_alt_stream=False)
    host = MHATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, "page_first",
                                pin_memory=False, device_capacity_tokens=device.size, start_layer=device.start_layer,
                                end_layer=device.end_layer, write_back_staging=device.hicache_write_back_staging)
    config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                  is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                  model_name="tiny-llama",
                                  extra_config={"use_direct_io": False, "l3_cleaner_enabled": False})
    storage = HiCacheNixl(config, file_path=storage_dir)
    storage.register_mem_pool_host(host)

    raw = host.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    keys = [f"page-{i}" for i in range(PAGES)]
    written = torch.arange(PAGE, (PAGES + 1) * PAGE, dtype=torch.int64)  # host pages 1..PAGES
    read_into = torch.arange((PAGES + 2) * PAGE, (2 * PAGES + 2) * PAGE, dtype=torch.int64)
    set_ok = storage.batch_set_v1(keys, written)
    get_ok = storage.batch_get_v1(keys, read_into)
    def page(index):  # its bytes: random bytes read as bfloat16 hold NaNs, which never equal themselves
        return host.get_data_page(int(index), flat=True).contiguous().view(torch.uint8)

    same = [bool(torch.equal(page(written[i * PAGE]), page(read_into[i * PAGE]))) for i in range(PAGES)]
    untouched = page(read_into[-1] + 1)  # past what was read: never written, so no copy of the written pages
    page_bytes = host.get_data_page(int(written[0]), flat=True).numel() * host.dtype.itemsize

    kv = _kv_request()
    tracer_provider.force_flush()
    spans = [{"name": s.name, "attributes": {k: _value(v) for k, v in s.attributes.items()},
              "parent": s.parent.span_id if s.parent else None} for s in exporter.get_finished_spans()]
    points = []
    data = reader.get_metrics_data()
    for resource in (data.resource_metrics if data else []):
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    entry = {"name": metric.name, "attributes": dict(point.attributes)}
                    if hasattr(point, "count"):
                        entry.update(count=point.count, sum=point.sum)
                    else:
                        entry["value"] = point.value
                    points.append(entry)
    return {"set": set_ok, "get": get_ok, "same": same,
            "untouched_differs": not torch.equal(untouched, page(written[0])), "page_bytes": page_bytes, "pages": PAGES,
            "files": sum(len(files) for _, _, files in os.walk(storage_dir)), "kv": kv, "spans": spans,
            "metrics": points}


def _kv_request() -> dict:
    """One request's KV, 1 MiB, over a real Mooncake pair on 127.0.0.1."""
    from otel_kvtransfer.demo.loopback import Receiver, open_engine

    receiver = Receiver(2 << 20, env={"MC_FORCE_TCP": "1"})
    try:
        engine = open_engine()
        source = np.full(1 << 20, 7, dtype=np.uint8)
        assert engine.register_memory(source.ctypes.data, source.nbytes) == 0
        kvt.begin_request(42, backend="mooncake", framework="sglang")
        with kvt.transfer_scope(42, chunk_index=0, payload="kv", is_last_chunk=True):
            rc = engine.transfer_sync_write(receiver.session, source.ctypes.data, receiver.base_address,
                                            source.nbytes)
        kvt.end_request(42)
        return {"rc": rc, "bytes": source.nbytes}
    finally:
        receiver.stop()


if __name__ == "__main__":
    result = main(sys.argv[1])
    print(json.dumps(result), flush=True)
    os._exit(0)  # NIXL agents may crash the interpreter's own shutdown (VLLM-ON-CPU.md): everything is out
