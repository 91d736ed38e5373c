"""A user's script on TokenSpeed's Mooncake (`tokenspeed-mooncake`) that knows nothing of OpenTelemetry: one write
call of every kind that build has (classic, batch, async, 8-byte integer arrays, pages x fields, the CUDA stream's),
to a receiver process, each of a byte count no other call moves. tests/engines/test_tokenspeed_mooncake.py runs it
under `opentelemetry-instrument` in a virtualenv with only that build and this package's `.[auto]`, and finds one
`kv_transfer.send` per call in the span file, with its bytes.

    python tokenspeed_mooncake_user_app.py OUT_JSON

OUT_JSON: each call's name, bytes and descriptors as made, what it answered or raised, and whether its bytes arrived
(the receiver's copy against the source). The `*_on_cuda` calls need a CUDA stream: with the stand-in driver they
raise, as on a host without a GPU; they are sends all the same (failed ones).
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
    source = np.random.default_rng(5).integers(0, 256, SIZE, dtype=np.uint8)
    assert engine.register_memory(source.ctypes.data, source.nbytes) == 0
    src, dst, peer = source.ctypes.data, receiver.base_address, receiver.session
    calls, at = [], [0]

    def region(length):
        """A fresh stretch of both buffers (a page apart), so every call's bytes land where no other call's do."""
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

    def pieces(*lengths):
        return [(offset, offset, n) for offset, n in ((region(n), n) for n in lengths)]

    def lists(p):
        return [src + x[0] for x in p], [dst + x[1] for x in p], [x[2] for x in p]

    def arrays(p):
        return tuple(np.array(column, dtype=np.uint64) for column in lists(p))

    def until_done(batch_id):
        status = 0
        while status == 0:
            status = engine.transfer_check_status(batch_id)
        return status

    p = pieces(2001)
    made("transfer_sync_write", p, lambda: engine.transfer_sync_write(peer, src + p[0][0], dst + p[0][1], 2001))
    p = pieces(2002)
    made("transfer_sync", p, lambda: engine.transfer_sync(peer, src + p[0][0], dst + p[0][1], 2002,
                                                          TransferOpcode.Write))
    p = pieces(2003, 21000)
    made("batch_transfer_sync_write", p, lambda: engine.batch_transfer_sync_write(peer, *lists(p)))
    p = pieces(2004, 31000)
    made("batch_transfer_sync", p, lambda: engine.batch_transfer_sync(peer, *lists(p), TransferOpcode.Write))
    p = pieces(2005)
    made("transfer_submit_write", p, lambda: until_done(engine.transfer_submit_write(
        peer, src + p[0][0], dst + p[0][1], 2005)))
    p = pieces(2006, 41000)
    made("batch_transfer_async_write", p, lambda: engine.get_batch_transfer_status(
        [engine.batch_transfer_async_write(peer, *lists(p))]))
    p = pieces(2007, 51000)
    made("batch_transfer_async", p, lambda: engine.get_batch_transfer_status(
        [engine.batch_transfer_async(peer, *lists(p), TransferOpcode.Write)]))
    p = pieces(2008, 61000, 9)
    made("batch_transfer_sync_write_arrays", p, lambda: engine.batch_transfer_sync_write_arrays(peer, *arrays(p)))
    p = pieces(2009, 71000)
    made("batch_transfer_async_write_arrays", p, lambda: engine.get_batch_transfer_status(
        [engine.batch_transfer_async_write_arrays(peer, *arrays(p))]))

    # pages x fields: page i of field f is `length` bytes at base + page * stride, on both sides
    base = region(1 << 20)
    fields = [(base, 8192, base, 8192, 2010), (base + 131072, 4096, base + 65536, 4096, 3001)]
    src_pages, dst_pages = [0, 3, 1], [2, 0, 5]
    p = [(fo + sp * fs, to + dp * ts, n) for fo, fs, to, ts, n in fields for sp, dp in zip(src_pages, dst_pages)]
    table = np.array([[src + fo, fs, dst + to, ts, n] for fo, fs, to, ts, n in fields], dtype=np.int64)
    made("batch_transfer_sync_write_pages", p, lambda: engine.batch_transfer_sync_write_pages(
        peer, np.array(src_pages, dtype=np.int64), np.array(dst_pages, dtype=np.int64), table))

    p = pieces(2011)
    made("transfer_write_on_cuda", p, lambda: engine.transfer_write_on_cuda(peer, src + p[0][0], dst + p[0][1], 2011),
         expect_arrival=False)
    p = pieces(2012, 200)
    made("batch_transfer_write_on_cuda", p, lambda: engine.batch_transfer_write_on_cuda(peer, *lists(p)),
         expect_arrival=False)
    return calls


if __name__ == "__main__":
    main(sys.argv[1])
