"""SGLang HiCache's NIXL storage backend: KV pages moved between the host pool and a storage tier (files through
NIXL's POSIX, GDS or 3FS plugins, objects through its OBJ plugin). Not a request's KV transfer: each of its NIXL
transfers is a `kv_transfer.send` of no request with `kv_transfer.payload` = `offload` and
`kv_transfer.framework` = `sglang`, so the request figures, the per-peer throughput and the tail stay the PD
transfers'; the per-send metrics keep the label. Recognised by the class that makes the engine call.

`HiCacheNixl._xfer_and_wait` (sglang 0.5.23, srt/mem_cache/storage/nixl/hicache_nixl.py) is the one place its
reads and writes reach NIXL: `initialize_xfer` (host descriptors to storage descriptors, READ or WRITE) and
`transfer`, then its own poll to DONE and the release. It runs inside a payload scope; the NIXL engine module
times the handle. A release without that method keeps everything else; its transfers then show as raw sends.
"""

from otel_kvtransfer import semconv
from otel_kvtransfer.frameworks.sglang import common
from otel_kvtransfer.recording import integration
from otel_kvtransfer.recording.patching import active

MODULE = "sglang.srt.mem_cache.storage.nixl.hicache_nixl"
ENTRY = ("HiCacheNixl", "_xfer_and_wait")


def _offload(wrapped, instance, args, kwargs):
    if not active():
        return wrapped(*args, **kwargs)
    with integration.payload_scope(semconv.PAYLOAD_OFFLOAD, framework=common.FRAMEWORK):
        return wrapped(*args, **kwargs)


def patch_hicache_nixl(module) -> None:
    cls = getattr(module, ENTRY[0], None)
    if isinstance(cls, type):
        common.patcher.wrap(cls, ENTRY[1], _offload)
