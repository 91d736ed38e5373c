"""SGLang PD disaggregation (Mooncake and NIXL): per-transfer, request, compute and decode-receive records.

`KVTransferInstrumentor` calls `instrument()` / `uninstrument()`. Nothing of sglang is imported here: each
sglang module is patched when it is imported (wrapt post-import hooks), so `opentelemetry-instrument python -m
sglang.launch_server ...` pays nothing at start-up and the spawned scheduler processes are patched when they load
their disaggregation code. On an sglang outside `SUPPORTED` a warning is logged once and nothing is patched.

What is wrapped, and why there (sglang 0.5.23):
- common.py here: names, the one Patcher, poll states and failure kinds both sides share.
- prefill.py here: the Mooncake or NIXL manager's transfer worker (chunk dequeue, one transfer scope per
  (chunk x destination x payload) around `send_kvcache*` / `maybe_send_extra` / `send_aux`; a NIXL handle
  posted inside one becomes a send of that request when the worker sees it complete), the sender
  (request begin, conclusion through `update_status`), the scheduler's early cached-prefix send and its
  batch execution (compute intervals).
- decode.py here: the Mooncake or NIXL receiver (`send_metadata` opens `kv_transfer.receive`, `poll` /
  `abort` end it; `DecodePreallocQueue._create_receiver_and_enqueue` tells which Req, hence which sglang span,
  it serves).
- bootstrap.py here: the decode's set-up steps towards a prefill (its parallel-info and bootstrap-info queries,
  its KV-layout registration), each a `kv_transfer.connect`.
- integrity.py here: the decode's KV checksum verdict on the receive span (called from decode.py's patch).
- client_ids.py here: the client's request id (`sglang.rid`) of each room the prefill sends, for its sends (the
  attempts of a request a router retries share it, each with a new room).
- hicache.py here: HiCache's NIXL storage backend, its transfers labelled `offload`.
- plugin.py here: the `sglang.srt.plugins` entry point.
"""

from otel_kvtransfer.frameworks.sglang.common import FRAMEWORK, patcher
from otel_kvtransfer.frameworks.sglang.hicache import MODULE as HICACHE_MODULE
from otel_kvtransfer.recording.patching import FrameworkSpec, Patch, deferred
from otel_kvtransfer.wiring.activation import LazyPatcher

_SG = "sglang.srt.disaggregation"

SPEC = FrameworkSpec(
    name=FRAMEWORK,
    distributions=("sglang",),
    supported=">=0.5.23, <0.6",  # the releases whose disaggregation internals these wrappers were written against
    patches=(
        Patch(f"{_SG}.common.utils", deferred(__name__, "prefill.patch_common_utils")),
        Patch(f"{_SG}.common.conn", deferred(__name__, "prefill.patch_common_conn")),
        Patch(f"{_SG}.mooncake.conn", deferred(__name__, "prefill.patch_mooncake_conn")),
        Patch(f"{_SG}.nixl.conn", deferred(__name__, "prefill.patch_nixl_conn")),
        Patch(f"{_SG}.prefill", deferred(__name__, "prefill.patch_prefill")),
        Patch("sglang.srt.managers.scheduler", deferred(__name__, "prefill.patch_scheduler")),
        Patch(f"{_SG}.common.conn", deferred(__name__, "decode.patch_common_conn")),
        Patch(f"{_SG}.common.conn", deferred(__name__, "bootstrap.patch_common_conn")),
        Patch(f"{_SG}.mooncake.conn", deferred(__name__, "decode.patch_mooncake_conn")),
        Patch(f"{_SG}.nixl.conn", deferred(__name__, "decode.patch_nixl_conn")),
        Patch(f"{_SG}.decode", deferred(__name__, "decode.patch_decode")),
        Patch(f"{_SG}.decode", deferred(__name__, "bootstrap.patch_decode")),
        Patch(HICACHE_MODULE, deferred(__name__, "hicache.patch_hicache_nixl")),
    ),
    forget=deferred(__name__, "prefill.forget_rooms"),  # the rooms the prefill side tracks
)

# The views of the spec the rest of the package, its tests and its docs use.
HOOKS = LazyPatcher(SPEC, patcher)
SUPPORTED, DISTRIBUTIONS = SPEC.supported, SPEC.distributions
is_supported = HOOKS.is_supported
instrument = HOOKS.instrument  # patch sglang now or when its modules are imported; False on an unsupported one
uninstrument = HOOKS.uninstrument
modules = HOOKS.modules  # what instrument() patches, as each is imported

__all__ = ["FRAMEWORK", "SPEC", "SUPPORTED", "DISTRIBUTIONS", "HOOKS", "instrument", "uninstrument", "is_supported",
           "modules", "patcher"]
