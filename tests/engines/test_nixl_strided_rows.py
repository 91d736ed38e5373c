"""NIXL's strided descriptor rows (Nx5: address, length, device, stride, count), what vLLM 0.33's NIXL connector
prepares (it requires nixl >= 1.5.0 for them): a send's bytes and descriptors are those of the blocks the
transfer picked from the rows, by flat block index.

A real NIXL agent (UCX, loopback device only) writes between two of its own registered DRAM buffers (NIXL's
loopback mode: the remote side prepared under the agent's own name); the bytes are checked at the destination.
"""

import os
import time

import pytest
from support.parts import require_part

BLOCK = 4096


def _nixl():
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # UCX's TCP transport listens on every device it may use
    try:
        import nixl._api as api
    except Exception:
        return None
    return api


@pytest.fixture
def agent(telemetry):  # instrumented first: the NIXL engine module patches nixl when it is imported
    api = _nixl()
    require_part(api is not None, "NIXL (pip install --no-deps -r scripts/requirements-nixl.txt)")
    return api.nixl_agent(f"kvt-strided-{os.getpid()}", api.nixl_agent_config(backends=["UCX"]))


def test_strided_rows_count_the_picked_blocks(agent, telemetry):
    import numpy as np

    source = (np.arange(16 * BLOCK, dtype=np.uint32) % 251).astype(np.uint8)
    target = np.zeros_like(source)
    for buffer in (source, target):
        agent.register_memory(agent.get_reg_descs([(buffer.ctypes.data, buffer.nbytes, 0, "")], "DRAM"))

    def rows(base):  # 3 blocks of 4 KiB, 8 KiB apart; then 2 dense blocks of 1 KiB at 48 KiB
        return np.array([[base, BLOCK, 0, 2 * BLOCK, 3], [base + 12 * BLOCK, 1024, 0, 1024, 2]], dtype=np.uint64)

    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows(source.ctypes.data), mem_type="DRAM")
    remote = agent.prep_xfer_dlist(agent.name, rows(target.ctypes.data), mem_type="DRAM")
    picked = [0, 2, 4]  # flat block indices: row 0's first and third block, row 1's second
    handle = agent.make_prepped_xfer("WRITE", local, picked, remote, picked, b"strided")
    state, deadline = agent.transfer(handle), time.monotonic() + 30
    while state not in ("DONE", "ERR") and time.monotonic() < deadline:
        state = agent.check_xfer_state(handle)
    agent.release_xfer_handle(handle)
    assert state == "DONE"

    spans = [(0, BLOCK), (4 * BLOCK, BLOCK), (12 * BLOCK + 1024, 1024)]
    for offset, length in spans:
        assert (target[offset:offset + length] == source[offset:offset + length]).all()
    assert int(target.astype(np.uint64).sum()) == sum(int(source[o:o + n].astype(np.uint64).sum()) for o, n in spans)

    (send,) = telemetry.spans("kv_transfer.send")
    assert send.attributes["kv_transfer.bytes"] == BLOCK + BLOCK + 1024
    assert send.attributes["kv_transfer.descriptor_count"] == 3
    assert send.attributes["kv_transfer.notification"] == "strided"
