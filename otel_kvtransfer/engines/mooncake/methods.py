"""Which TransferEngine calls the Mooncake wing times, how each takes its arguments, and which it leaves alone.

Every table here is read when the engine class is patched (`__init__._patch`) and by the tests that hold the
tables to the real engine's signatures; nothing here runs per call.
"""

from typing import FrozenSet

from otel_kvtransfer import semconv

BACKEND = semconv.BACKEND_MOONCAKE  # the spec's name, a global because every call tuple carries it
WRITE, READ = semconv.OP_WRITE, semconv.OP_READ

# method -> (op, or None when the opcode argument decides; batch call?)
SYNC_METHODS = {
    "transfer_sync_write": (WRITE, False),
    "transfer_sync_read": (READ, False),
    "transfer_sync": (None, False),
    "batch_transfer_sync_write": (WRITE, True),
    "batch_transfer_sync_read": (READ, True),
    "batch_transfer_sync": (None, True),
}
ASYNC_METHODS = {
    "transfer_submit_write": (WRITE, False),
    "batch_transfer_async_write": (WRITE, True),
    "batch_transfer_async_read": (READ, True),
    "batch_transfer_async": (None, True),
}
# Every transfer method takes (target_hostname, buffer(s), peer address(es), length(s)[, opcode]).
LENGTH_KW = {False: "length", True: "lengths"}
# 0.3.14: the same (target_hostname, buffers, peer_buffer_addresses, lengths) as contiguous 8-byte integer arrays.
# method -> (op, async?)
ARRAY_METHODS = {
    "batch_transfer_sync_write_arrays": (WRITE, False),
    "batch_transfer_sync_read_arrays": (READ, False),
    "batch_transfer_async_write_arrays": (WRITE, True),
    "batch_transfer_async_read_arrays": (READ, True),
}
# 0.3.14: (target_hostname, src_pages, dst_pages, fields, max_batch_size): a pages x fields table, expanded inside
# the engine into one descriptor per (field, page). method -> op
PAGE_METHODS = {
    "batch_transfer_sync_write_pages": WRITE,
    "batch_transfer_sync_read_pages": READ,
}
# 0.3.14: (endpoint, local bases, local capacities, remote bases, remote capacities, local offsets, remote offsets,
# lengths), the last three a list per base; each answers a ScatterTransferTicket. method -> (op, drained on return?)
SCATTER_METHODS = {
    "submit_scatter_write": (WRITE, False),
    "submit_scatter_read": (READ, False),
    "scatter_transfer_sync_write_with_ticket": (WRITE, True),
    "scatter_transfer_sync_read_with_ticket": (READ, True),
}
SCATTER_ARGUMENTS = 8  # a scatter call takes eight and no nic_hint: `calls.call_of` finds none past them
# Every CUDA build (only where SUPPORT_CUDA): the classic arguments and a CUDA stream; the call queues the transfer
# on that stream and returns. method -> (op, batch call?)
CUDA_STREAM_METHODS = {
    "transfer_write_on_cuda": (WRITE, False),
    "transfer_read_on_cuda": (READ, False),
    "batch_transfer_write_on_cuda": (WRITE, True),
    "batch_transfer_read_on_cuda": (READ, True),
}
# Where a call takes `nic_hint` positionally (0.3.14; by keyword too): after `transport_hint`, which follows the
# lengths, or the opcode (and a sync call's `notify`), a pages call's `max_batch_size`, a CUDA call's stream.
# tests/engines/test_mooncake_cuda13.py checks every position against the signatures of the real 0.3.14 engine.
NIC_HINT_AT = {
    **dict.fromkeys(("transfer_sync_write", "transfer_sync_read", "batch_transfer_sync_write",
                     "batch_transfer_sync_read", "transfer_submit_write", "batch_transfer_async_write",
                     "batch_transfer_async_read", *ARRAY_METHODS), 5),
    "transfer_sync": 7, "batch_transfer_sync": 7, "batch_transfer_async": 6,
    **dict.fromkeys((*PAGE_METHODS, *CUDA_STREAM_METHODS), 6),
}
# ScatterTransferCompletionStatus values (0.3.14)
SCATTER_COMPLETED, SCATTER_FAILED, SCATTER_UNKNOWN = 0, -1, -2

COMPLETION_CALLS = frozenset({"transfer_check_status", "get_batch_transfer_status"})
# TransferEngine's calls that move no bytes: set-up, registration, the engine's own local buffer, queries,
# notifications, a reachability probe. Any public call neither here nor timed (timed_calls()) is counted as untimed.
QUIET_CALLS = frozenset({
    "initialize", "initialize_ext", "get_rpc_port", "get_local_topology", "get_engine", "get_engine_ptr",
    "register_memory", "unregister_memory", "batch_register_memory", "batch_unregister_memory",
    "allocate_managed_buffer", "free_managed_buffer", "get_first_buffer_address",
    "write_bytes_to_buffer", "read_bytes_from_buffer",  # copies within this process's own buffer
    "get_notifies", "send_probe", "warmup_efa_segment",
})


def timed_calls() -> FrozenSet[str]:
    """Every TransferEngine call the wing times or observes (a send, or the completion of one)."""
    return (frozenset(SYNC_METHODS) | frozenset(ASYNC_METHODS) | COMPLETION_CALLS | frozenset(ARRAY_METHODS)
            | frozenset(PAGE_METHODS) | frozenset(SCATTER_METHODS) | frozenset(CUDA_STREAM_METHODS))
