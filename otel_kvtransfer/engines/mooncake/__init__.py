"""The Mooncake transfer engine (`mooncake.engine.TransferEngine`): time each transfer call, count its bytes.

Sync calls are one transfer each (`sync.py`). An async submission is one transfer from submit until its
completion is observed through `transfer_check_status` or `get_batch_transfer_status` (`submissions.py`), so its
duration is the real transfer time; the time inside the submitting call is its `kv_transfer.post_s`. Each
wrapper is a plain function set on the pybind class (the cheapest call path Python has); instrument() patches at
once when `mooncake.engine` is already imported, else when it is.

Mooncake 0.3.14 adds calls that take the same transfers in other shapes, each timed with the same record
(`shapes.py`): 8-byte integer arrays (`*_arrays`, sync and async), a pages x fields table the engine expands itself
(`*_pages`), and scatter lists (`scatter.py`: `submit_scatter_*`, `scatter_transfer_sync_*_with_ticket`), whose
`ScatterTransferTicket` ends the send when its `drain()` (or its `status`, `drained`) shows the end, as an async
batch's poll does. Every CUDA build also has the `*_on_cuda` calls, which only queue a transfer on the caller's
CUDA stream (`shapes.on_stream`).

`kv_transfer.nic`: the local device the caller named for the call (`nic_hint`, 0.3.14), else the one device the
engine was initialised with (`forms.py`); `configured_devices()` lists every device given to initialize() in this
process.

The wing: `methods` (which calls, how they take their arguments), `forms` (what each engine's sends carry),
`calls` (what the wrappers share), `sync`, `submissions`, `shapes`, `scatter`, and `compiled` with the C part
beside it (`_async_compiled.c`, its `.pyi`), the compiled twin of the common submission and wait.
"""

from types import ModuleType

from otel_kvtransfer.engines.mooncake import calls, compiled, forms, scatter, shapes, submissions, sync
from otel_kvtransfer.engines.mooncake.methods import (
    ARRAY_METHODS,
    ASYNC_METHODS,
    BACKEND,
    COMPLETION_CALLS,
    CUDA_STREAM_METHODS,
    NIC_HINT_AT,
    PAGE_METHODS,
    QUIET_CALLS,
    READ,
    SCATTER_ARGUMENTS,
    SCATTER_COMPLETED,
    SCATTER_FAILED,
    SCATTER_METHODS,
    SCATTER_UNKNOWN,
    SYNC_METHODS,
    WRITE,
    timed_calls,
)
from otel_kvtransfer.recording import untimed
from otel_kvtransfer.recording.patching import EngineSpec, Patch, Patcher
from otel_kvtransfer.wiring.lazy_patcher import LazyPatcher

__all__ = [
    "ARRAY_METHODS", "ASYNC_METHODS", "BACKEND", "COMPLETION_CALLS", "CUDA_STREAM_METHODS", "DISTRIBUTIONS", "HOOKS",
    "MODULE", "NIC_HINT_AT", "PAGE_METHODS", "QUIET_CALLS", "READ", "SCATTER_ARGUMENTS", "SCATTER_COMPLETED",
    "SCATTER_FAILED", "SCATTER_METHODS", "SCATTER_UNKNOWN", "SETUP_IN_FIRST_CALL", "SPEC", "SUPPORTED",
    "SYNC_METHODS", "WRITE", "compiled", "configured_devices", "instrument", "modules", "patcher",
    "peer_attributes", "timed_calls", "uninstrument",
]

patcher = Patcher(BACKEND)
peer_attributes = calls.peer_attributes
configured_devices = forms.configured_devices


def _patch(module: ModuleType) -> None:
    engine = module.TransferEngine
    for name, (op, batch) in SYNC_METHODS.items():
        patcher.replace(engine, name, lambda original, op=op, batch=batch, at=NIC_HINT_AT[name]:
                        sync.wrap(original, op, batch, at))
    for name, (op, batch) in ASYNC_METHODS.items():
        patcher.replace(engine, name, lambda original, op=op, batch=batch, at=NIC_HINT_AT[name]:
                        submissions.wrap(original, op, batch, at))
    # The newer shapes and the CUDA stream's calls: each patched where the build has it.
    for name, (op, is_async) in ARRAY_METHODS.items():
        if is_async:
            patcher.replace(engine, name, lambda original, op=op, at=NIC_HINT_AT[name]:
                            submissions.wrap(original, op, True, at, shapes.arrays_count))
        else:
            patcher.replace(engine, name, lambda original, op=op, at=NIC_HINT_AT[name]:
                            shapes.counted(original, op, shapes.arrays_count, at))
    for name, op in PAGE_METHODS.items():
        patcher.replace(engine, name, lambda original, op=op, at=NIC_HINT_AT[name]:
                        shapes.counted(original, op, shapes.pages_count, at))
    for name, (op, batch) in CUDA_STREAM_METHODS.items():
        patcher.replace(engine, name, lambda original, op=op, batch=batch: shapes.on_stream(original, op, batch))
    ticket = getattr(module, "ScatterTransferTicket", None)
    if ticket is not None and isinstance(ticket, type):
        scatter.patch_ticket(patcher, ticket)
        for name, (op, drained) in SCATTER_METHODS.items():
            patcher.replace(engine, name, lambda original, op=op, drained=drained:
                            scatter.scatter(original, op, drained))
    patcher.replace(engine, "transfer_check_status", submissions.check_status)
    patcher.replace(engine, "get_batch_transfer_status", submissions.batch_status)
    patcher.replace(engine, "initialize", forms.initialize_wrapper)
    patcher.replace(engine, "initialize_ext", forms.initialize_wrapper)
    untimed.wrap_unknown(patcher, engine, BACKEND, timed_calls(), QUIET_CALLS)


def _forget() -> None:
    untimed.forget(BACKEND)
    submissions.pending.abandon()  # completions that will now never be observed: counted, not silently lost
    scatter.forget()
    forms.forget()


# --- the engine-module interface ------------------------------------------------------------------------------

MODULE = "mooncake.engine"
SPEC = EngineSpec(
    name=BACKEND,
    # Every published build (each installs the same `mooncake` package): CUDA 12 (the plain name), CPU, CUDA 13, AWS
    # EFA (three), ROCm, Ascend NPU, Moore Threads MUSA, and TokenSpeed's fork (CUDA 13). One list: wiring/package.py
    # builds `instruments-any` from it.
    distributions=(
        "mooncake-transfer-engine",
        "mooncake-transfer-engine-non-cuda",
        "mooncake-transfer-engine-cuda13",
        "mooncake-transfer-engine-efa",
        "mooncake-transfer-engine-efa-cuda13",
        "mooncake-transfer-engine-efa-non-cuda",
        "mooncake-transfer-engine-rocm",
        "mooncake-transfer-engine-npu",
        "mooncake-transfer-engine-musa",
        "tokenspeed-mooncake",
    ),
    supported=">=0.3",  # the releases whose TransferEngine has the calls wrapped here (0.3.13 tested)
    patches=(Patch(MODULE, _patch),),  # now if `mooncake.engine` is imported, else as soon as it is
    prepare=forms.prepare,
    forget=_forget,
    setup_in_first_call=True,  # the first transfer to a segment opens it (its send says kv_transfer.first_to_peer)
    peer_attributes=peer_attributes,
)

# The views of the spec the rest of the package, its tests and its docs use.
HOOKS = LazyPatcher(SPEC, patcher)
DISTRIBUTIONS, SUPPORTED, SETUP_IN_FIRST_CALL = SPEC.distributions, SPEC.supported, SPEC.setup_in_first_call
instrument, uninstrument, modules = HOOKS.instrument, HOOKS.uninstrument, HOOKS.modules

# The wing's inner names under the names the tests and benchmarks knew before it was one (the same objects).
_sync, _async, _batch_status = sync.wrap, submissions.wrap, submissions.batch_status
_pending, _last_engine, _engines, _hinted, _hint_extra = (submissions.pending, forms.last_engine, forms.engines,
                                                          forms.hinted, forms.hint_extra)
_array_total, _pages_count, _scatter_count = shapes.array_total, shapes.pages_count, scatter.scatter_count
_SCATTER_ARGUMENTS = SCATTER_ARGUMENTS
