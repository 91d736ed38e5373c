"""A user's script on Mooncake 0.3.14 that knows nothing of OpenTelemetry: one write call of every kind the engine
has, to a receiver process, each of a byte count no other call moves. tests/engines/test_mooncake_cuda13.py runs it
under `opentelemetry-instrument` in the 0.3.14 virtualenv (only the CUDA 13 build and this package's `.[auto]`) and
finds one `kv_transfer.send` per call in the span file, with its bytes.

    python mooncake_cuda13_user_app.py OUT_JSON

OUT_JSON: each call's name, bytes and descriptors as made, what it answered, and whether its bytes arrived (the
receiver's copy against the source). The `*_on_cuda` calls need a CUDA stream: with the stand-in driver they raise,
as on a host without a GPU; they are sends all the same (failed ones).
"""

import json
import os
import sys

import numpy as np
from mooncake.engine import TransferEngine, TransferOpcode

from otel_kvtransfer.demo.loopback import LOOPBACK, Receiver, digest

SIZE = 8 << 20


def main(out_path):
    os.environ["MC_FORCE_TCP"] = "1"
    receiver = Receiver(SIZE, env={"MC_FORCE_TCP": "1", "MC_LOG_LEVEL": "ERROR"})
    try:
        calls = _writes(receiver)
    finally:
        receiver.stop()
    with open(out_path, "w", encoding="utf-8") as handle:
        json.dump(calls, handle)


def _writes(receiver):
    engine = TransferEngine()
    assert engine.initialize(LOOPBACK, "P2PHANDSHAKE", "tcp", "") == 0
    source = np.random.default_rng(3).integers(0, 256, SIZE, dtype=np.uint8)
    assert engine.register_memory(source.ctypes.data, source.nbytes) == 0
    src, dst, peer = source.ctypes.data, receiver.base_address, receiver.session
    calls, at = [], [0]

    def region(length):
        offset = at[0]
        at[0] += (length + 4095) // 4096 * 4096 + 4096
        return offset

    def made(name, pieces, answer_of, expect_arrival=True):
        """`pieces`: (source offset, receiver offset, length) of the call; `answer_of()` makes it."""
        entry = {"call": name, "bytes": sum(p[2] for p in pieces), "descriptors": len(pieces)}
        try:
            entry["answer"] = answer_of()
        except Exception as error:  # what the engine raised is part of the record
            entry["raised"] = type(error).__qualname__
        entry["arrived"] = expect_arrival and all(
            receiver.digest(to, n) == digest(source[frm:frm + n]) for frm, to, n in pieces)
        calls.append(entry)

    def one(length):
        to = region(length)
        return [(to, to, length)]

    def several(*lengths):
        return [(region(n), 0, n) for n in lengths]

    def spread(pieces):
        return [(frm, region(n), n) for frm, _, n in pieces]

    p = one(1001)
    made("transfer_sync_write", p, lambda: engine.transfer_sync_write(peer, src + p[0][0], dst + p[0][1], 1001))
    p = one(1002)
    made("transfer_sync", p, lambda: engine.transfer_sync(peer, src + p[0][0], dst + p[0][1], 1002,
                                                          TransferOpcode.Write))
    p = spread(several(1003, 20000))
    made("batch_transfer_sync_write", p, lambda: engine.batch_transfer_sync_write(
        peer, [src + x[0] for x in p], [dst + x[1] for x in p], [x[2] for x in p]))
    p = spread(several(1004, 30000))
    made("batch_transfer_sync", p, lambda: engine.batch_transfer_sync(
        peer, [src + x[0] for x in p], [dst + x[1] for x in p], [x[2] for x in p], TransferOpcode.Write))

    def until_done(batch_id):
        status = 0
        while status == 0:
            status = engine.transfer_check_status(batch_id)
        return status

    p = one(1005)
    made("transfer_submit_write", p, lambda: until_done(engine.transfer_submit_write(
        peer, src + p[0][0], dst + p[0][1], 1005)))
    p = spread(several(1006, 40000))
    made("batch_transfer_async_write", p, lambda: engine.get_batch_transfer_status([engine.batch_transfer_async_write(
        peer, [src + x[0] for x in p], [dst + x[1] for x in p], [x[2] for x in p])]))
    p = spread(several(1007, 50000))
    made("batch_transfer_async", p, lambda: engine.get_batch_transfer_status([engine.batch_transfer_async(
        peer, [src + x[0] for x in p], [dst + x[1] for x in p], [x[2] for x in p], TransferOpcode.Write)]))

    def arrays(pieces):
        return (np.array([src + x[0] for x in pieces], dtype=np.uint64),
                np.array([dst + x[1] for x in pieces], dtype=np.uint64),
                np.array([x[2] for x in pieces], dtype=np.uint64))

    p = spread(several(1008, 60000, 7))
    made("batch_transfer_sync_write_arrays", p, lambda: engine.batch_transfer_sync_write_arrays(peer, *arrays(p)))
    p = spread(several(1009, 70000))
    made("batch_transfer_async_write_arrays", p, lambda: engine.get_batch_transfer_status(
        [engine.batch_transfer_async_write_arrays(peer, *arrays(p))]))

    # pages x fields: page i of field f is `length` bytes at base + page * stride, on both sides
    base_to = region(1 << 20)
    fields = [(0, 8192, base_to, 8192, 1010), (200000, 4096, base_to + 65536, 4096, 3000)]
    src_pages, dst_pages = [0, 3, 1], [2, 0, 5]
    p = [(fo + sp * fs, to + dp * ts, n) for fo, fs, to, ts, n in fields for sp, dp in zip(src_pages, dst_pages)]
    table = np.array([[src + fo, fs, dst + to, ts, n] for fo, fs, to, ts, n in fields], dtype=np.int64)
    made("batch_transfer_sync_write_pages", p, lambda: engine.batch_transfer_sync_write_pages(
        peer, np.array(src_pages, dtype=np.int64), np.array(dst_pages, dtype=np.int64), table))

    def scatter(pieces):
        return ([src], [SIZE], [dst], [SIZE], [[x[0] for x in pieces]], [[x[1] for x in pieces]],
                [[x[2] for x in pieces]])

    p = spread(several(1011, 80000))
    made("submit_scatter_write", p, lambda: engine.submit_scatter_write(peer, *scatter(p)).drain(30_000).name)
    p = spread(several(1012, 90000))
    made("scatter_transfer_sync_write_with_ticket", p,
         lambda: engine.scatter_transfer_sync_write_with_ticket(peer, *scatter(p)).status.name)

    p = one(1013)
    made("transfer_write_on_cuda", p, lambda: engine.transfer_write_on_cuda(peer, src + p[0][0], dst + p[0][1], 1013),
         expect_arrival=False)
    p = spread(several(1014, 100))
    made("batch_transfer_write_on_cuda", p, lambda: engine.batch_transfer_write_on_cuda(
        peer, [src + x[0] for x in p], [dst + x[1] for x in p], [x[2] for x in p]), expect_arrival=False)
    return calls


if __name__ == "__main__":
    main(sys.argv[1])
