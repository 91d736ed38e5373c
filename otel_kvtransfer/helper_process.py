"""The builder process of `OTEL_KVTRANSFER_BUILDER=process`: `python -m otel_kvtransfer.helper_process`.

Started by `offload.HelperLink` with the engine's environment, standard output and error. It sets up the SDK as the engine's would be (the
opentelemetry_configurator entry point reading OTEL_*, or the function named by OTEL_KVTRANSFER_HELPER_SETUP),
attaches the same sampler wrapper and metrics processor the in-process mode attaches, and feeds every record
it reads to a `SpanBuilder`. Standard input carries `wire` frames; flush acknowledgements go back on the pipe
whose descriptor is the one argument. End-of-file ends it: the SDK's own exit handlers export what it holds.
"""

import importlib
import logging
import os
import select
import signal
import sys
import time

from opentelemetry import metrics, trace

from otel_kvtransfer import config, offload, semconv, wire
from otel_kvtransfer.version import __version__

_logger = logging.getLogger("otel_kvtransfer.helper_process")

# After SIGINT or SIGTERM, how long the helper waits for its engine's end-of-file (the engine got the signal too:
# a terminal's Ctrl-C, a service manager's stop) before it lets the signal end it.
STOP_GRACE_S = 10


def _set_up_sdk() -> None:
    setup = os.environ.get(offload.SETUP_ENV, "").strip()
    if setup:
        module, _, function = setup.partition(":")
        getattr(importlib.import_module(module), function or "setup")()
        return
    from otel_kvtransfer.activation import configure_sdk_if_absent  # pylint: disable=import-outside-toplevel

    configure_sdk_if_absent("the builder process")


def _read_exact(fd: int, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class Helper:
    def __init__(self, ack_fd: int):
        from otel_kvtransfer.instrumentor import (  # pylint: disable=import-outside-toplevel
            ENGINES, _Attachment, _load, drop_counter, new_builder)

        self._ack_fd = ack_fd
        self.settings = config.load()
        self.tracer_provider = trace.get_tracer_provider()
        self.meter_provider = metrics.get_meter_provider()
        tracer = trace.get_tracer(semconv.INSTRUMENTATION_NAME, __version__, self.tracer_provider)
        self._attachment = _Attachment(self.meter_provider)
        self._attachment.attach(tracer, self.tracer_provider, flush_first=False)
        self.drop = drop_counter(self.meter_provider)  # drop(reason, count)
        self.builder = new_builder(tracer, self.settings, _load(ENGINES), on_drop=self.drop)

    def handle(self, frame: tuple) -> None:
        """One frame, then its acknowledgement (the engine counts what was never acknowledged as dropped)."""
        kind, sequence = frame[0], frame[1]
        try:
            if kind == wire.BATCH:
                handle = self.builder.handle
                for rec in wire.records_in(frame[2]):
                    try:
                        handle(rec)
                    except Exception:  # pylint: disable=broad-except
                        self.drop("builder_error", 1)
                        _logger.debug("otel_kvtransfer span builder failed", exc_info=True)
                for reason, count in frame[3].items():
                    self.drop(reason, count)
            elif kind == wire.FLUSH:
                for provider in (self.tracer_provider, self.meter_provider):
                    flush = getattr(provider, "force_flush", None)
                    if flush is not None:
                        flush()
            elif kind == wire.END_OPEN:
                self.builder.end_all(self.drop)
        finally:
            try:
                os.write(self._ack_fd, wire.ACK.pack(sequence))
            except OSError:  # the engine gave this helper up: it reads no more
                pass

    def run(self, fd: int) -> None:
        interval = self.settings.flush_interval_s
        next_tick = time.monotonic() + interval
        while True:
            readable, _, _ = select.select([fd], [], [], max(next_tick - time.monotonic(), 0))
            if readable:
                header = _read_exact(fd, wire.HEADER.size)
                if len(header) < wire.HEADER.size:
                    return  # end-of-file: the engine closed the pipe or ended
                size = wire.HEADER.unpack(header)[0]
                if size > wire.MAX_FRAME:
                    _logger.warning("otel_kvtransfer builder process: a frame of %d bytes; stopping", size)
                    return
                body = _read_exact(fd, size)
                if len(body) < size:
                    return  # the engine gave this helper up in the middle of a frame
                try:
                    self.handle(wire.decode(body))
                except Exception:  # pylint: disable=broad-except
                    self.drop("builder_error", 1)
                    _logger.warning("otel_kvtransfer builder process: a frame failed", exc_info=True)
            if time.monotonic() >= next_tick:
                self.builder.evict_stale()
                next_tick = time.monotonic() + interval


def _on_stop_signal(signum, frame):  # pylint: disable=unused-argument
    # Not now: the engine's last frames are on their way. SIGALRM's default action ends the process if the
    # end-of-file has not come (and the exporters not finished) by then.
    signal.alarm(STOP_GRACE_S)


def main() -> None:
    signal.signal(signal.SIGINT, _on_stop_signal)
    signal.signal(signal.SIGTERM, _on_stop_signal)
    os.environ[offload.HELPER_ENV] = "1"
    try:
        ack_fd = int(sys.argv[1])
        os.fstat(ack_fd)
    except (IndexError, ValueError, OSError):
        print("usage: python -m otel_kvtransfer.helper_process ACK_FD (started by otel_kvtransfer itself)",
              file=sys.stderr)
        sys.exit(2)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    try:
        _set_up_sdk()
        helper = Helper(ack_fd)
    except Exception as exc:  # pylint: disable=broad-except
        _logger.warning("otel_kvtransfer builder process: could not set up the SDK (%s: %s); spans and metrics "
                        "of this engine process are counted as dropped", type(exc).__name__, str(exc)[:200])
        sys.exit(1)
    helper.run(sys.stdin.fileno())
    # The SDK's exit handlers shut the providers down: spans and metrics still held are exported.


if __name__ == "__main__":
    main()
