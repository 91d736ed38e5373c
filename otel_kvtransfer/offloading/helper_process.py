"""The builder process of `OTEL_KVTRANSFER_BUILDER=process`.

Started by `lifecycle.HelperProcess` with the engine's environment, working directory, standard output and error,
in a session of its own (a terminal's Ctrl-C or a service manager's group signal to the engine's process group
does not reach it), with the working directory kept off its import path (a stray `select.py` there is not
imported). It sets up the SDK as the engine's would be (the opentelemetry_configurator entry point reading
OTEL_*, or the function named by OTEL_KVTRANSFER_HELPER_SETUP), attaches the same sampler wrapper and metrics
processor the in-process mode attaches (`in_process.assemble`, as the engine's thread builder is put together),
and feeds every record it reads to it.

Its standard input is one end of a socket pair: `wire` frames come in, acknowledgements go back. Each frame is
acknowledged once handled; a flush runs on a thread of its own and is acknowledged again when done, so a
collector outage never stops the frame loop (the engine would drop what it cannot write). End-of-file ends it:
the SDK's own exit handlers export what it holds, within EXIT_BOUND_S; a frame cut short by its engine's end
(a kill) is counted as dropped. It is not its engine's child (`lifecycle`): its pid is the first thing it
writes back. SIGINT is ignored; SIGTERM flushes what it holds and the helper goes on until its engine's
end-of-file (a second SIGTERM ends it at once, exporting on the way out).
"""

import importlib
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from types import FrameType
from typing import Any, List, Optional, Tuple

from opentelemetry import metrics, trace

from otel_kvtransfer import config, registry
from otel_kvtransfer.building import in_process
from otel_kvtransfer.building.attachment import drop_counter
from otel_kvtransfer.building.sdk_setup import configure_sdk_if_absent
from otel_kvtransfer.offloading import lifecycle, wire
from otel_kvtransfer.offloading.link_drops import DROP_REASON
from otel_kvtransfer.recording.sink import log_own_error

_logger = logging.getLogger("otel_kvtransfer.offloading.helper_process")  # run as __main__
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)
IDLE_TICK_S = 1.0  # the periodic work's interval while no frame comes
EXIT_BOUND_S = 120  # after its engine's end-of-file: the SDK's shutdown (30 s per provider) and a margin


def _set_up_sdk() -> None:
    setup = os.environ.get(lifecycle.SETUP_ENV, "").strip()
    if setup:
        module, _, function = setup.partition(":")
        getattr(importlib.import_module(module), function or "setup")()
        return
    configure_sdk_if_absent("the builder process")


def _read_exact(fd: int, size: int) -> bytes:
    """Up to `size` bytes; fewer only at end-of-file. A reset connection (the engine was killed) is end-of-file."""
    chunks, left = [], size
    while left:
        try:
            chunk = os.read(fd, min(left, 1 << 20))
        except ConnectionError:
            break
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class _Acks:
    """Acknowledgements back to the engine, from the frame loop and the flusher thread."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._lock = threading.Lock()

    def send(self, value: int) -> None:
        with self._lock:
            try:
                self._sock.sendall(wire.ACK.pack(value), _NOSIGNAL)
            except OSError:  # the engine ended or gave this helper up: nobody reads acknowledgements any more
                pass


class _Flusher:
    """Flushes the providers on its own thread. A FLUSH frame is acknowledged a second time (FLUSHED) by the
    first flush that began after the frame was handled; the requests that arrive during a flush are served by
    the next one, together."""

    def __init__(self, providers: Tuple[Any, ...], acks: _Acks) -> None:  # the tracer and meter providers
        self._providers = providers
        self._acks = acks
        self._asked = 0  # flushes asked for, and done
        self._done = 0
        self._sequence = 0  # the latest FLUSH frame among them (0: only SIGTERM asked)
        self._cond = threading.Condition(threading.Lock())
        self._thread: Optional[threading.Thread] = None

    def request(self, sequence: int = 0) -> None:
        with self._cond:
            self._asked += 1
            self._sequence = max(self._sequence, sequence)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="otel-kvtransfer-flusher", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._asked == self._done:
                    self._cond.wait()
                asked, sequence = self._asked, self._sequence
            for provider in self._providers:
                flush = getattr(provider, "force_flush", None)
                if flush is not None:
                    try:
                        flush()
                    except Exception:
                        _logger.debug("otel_kvtransfer builder process: a flush failed", exc_info=True)
            with self._cond:
                self._done = asked
            if sequence:
                self._acks.send(wire.FLUSHED | sequence)


class Helper:
    def __init__(self, acks: _Acks) -> None:
        self._acks = acks
        self.settings = config.load()
        self.tracer_provider = trace.get_tracer_provider()
        self.meter_provider = metrics.get_meter_provider()
        self.drop = drop_counter(self.meter_provider)  # drop(reason, count)
        # The builder as the engine process's thread builder is put together, on this process's SDK.
        self.builder = in_process.assemble(self.settings, registry.load(registry.ENGINES), self.tracer_provider,
                                           self.meter_provider, on_drop=self.drop, builder_process=True)
        self.flusher = _Flusher((self.tracer_provider, self.meter_provider), acks)
        self._unknown_logged = False

    def handle(self, frame: Tuple[Any, ...], unknown: Tuple[str, ...] = ()) -> None:
        """One decoded frame. Never waits for an exporter: a flush is handed to the flusher's thread."""
        kind = frame[0]
        if kind == wire.BATCH:
            batch = frame[1]
            if unknown:
                batch = self._plain(batch, unknown)
            handle = self.builder.take
            for rec in batch:
                try:
                    handle(rec)
                except Exception as exc:
                    self.drop("builder_error", 1)
                    log_own_error("building a span", exc)
            for reason, count in frame[2].items():
                self.drop(reason, count)
        elif kind == wire.END_OPEN:
            self.builder.end_all(self.drop)

    def _plain(self, batch: List[Tuple[Any, ...]], unknown: Tuple[str, ...]) -> List[Tuple[Any, ...]]:
        if not self._unknown_logged:
            self._unknown_logged = True
            _logger.warning("otel_kvtransfer builder process: records carry values of classes it does not load "
                            "(%s); they are built with plain values instead", ", ".join(unknown[:5]))
        return [wire.unknown_to_plain(rec) for rec in batch]

    def run(self, fd: int) -> None:
        # The builder's periodic work (eviction, stuck reports) every flush interval while frames come in; once a
        # second when none came since the last (a wake of an idle process costs CPU; stuck reports count seconds).
        interval = self.settings.flush_interval_s
        idle_interval = max(interval, IDLE_TICK_S)
        next_tick = time.monotonic() + interval
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        framed = False
        while True:
            if poller.poll(max(next_tick - time.monotonic(), 0) * 1000):
                if not self._read_frame(fd):
                    return
                framed = True
                # the first frame after a quiet spell: the periodic work (the in-flight gauges) within the interval
                next_tick = min(next_tick, time.monotonic() + interval)
            if _signals.pop_flush():
                self.builder.release_held()
                self.flusher.request()
            if time.monotonic() >= next_tick:
                self.builder.tick()
                next_tick = time.monotonic() + (interval if framed else idle_interval)
                framed = False

    def _read_frame(self, fd: int) -> bool:
        """One frame read, handled and acknowledged (the engine counts what was never acknowledged as dropped);
        False at end-of-file, or on a frame no engine of ours would write."""
        header = _read_exact(fd, wire.HEADER.size)
        if len(header) < wire.HEADER.size:
            return False  # end-of-file: the engine closed its end or ended
        size, records, sequence = wire.HEADER.unpack(header)
        if size > wire.MAX_FRAME:
            _logger.warning("otel_kvtransfer builder process: a frame of %d bytes; stopping", size)
            return False
        body = _read_exact(fd, size)
        if len(body) < size:  # the engine ended (was killed) in the middle of a frame: its records are lost
            self.drop(DROP_REASON, records)
            return False
        try:
            frame, unknown = wire.decode(body)
            if frame[0] == wire.FLUSH:
                self.builder.release_held()  # a flush exports what has ended, held back or not
                self.flusher.request(sequence)
            else:
                self.handle(frame, unknown)
        except Exception as exc:
            # This frame's records are lost, counted here as what they are; the engine counts nothing for a frame
            # the helper acknowledged.
            self.drop("builder_error", records)
            _logger.warning("otel_kvtransfer builder process: a frame of %d records failed (%s: %s)",
                            records, type(exc).__name__, str(exc)[:200])
        self._acks.send(sequence)
        return True


class _Signals:
    """SIGTERM is usually meant for the engine (a service manager signals every process of its unit): export
    what is held now, then keep building until the engine itself ends. A second SIGTERM ends the helper, which
    exports on its way out. The handler only sets a flag: the frame loop asks the flusher."""

    def __init__(self) -> None:
        self.terms = 0
        self._flush = False

    def on_sigterm(self, signum: int, frame: Optional[FrameType]) -> None:
        self.terms += 1
        if self.terms > 1:
            raise SystemExit(0)
        self._flush = True

    def pop_flush(self) -> bool:
        flush, self._flush = self._flush, False
        return flush


_signals = _Signals()


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the engine
    signal.signal(signal.SIGTERM, _signals.on_sigterm)
    os.environ[lifecycle.HELPER_ENV] = "1"
    try:
        sock = socket.socket(fileno=os.dup(0))
        if sock.family != socket.AF_UNIX:
            raise OSError
    except OSError:
        print("otel_kvtransfer builder process: started by otel_kvtransfer itself, its standard input a socket",
              file=sys.stderr)
        sys.exit(2)
    sock.setblocking(True)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    acks = _Acks(sock)
    acks.send(wire.HELLO | os.getpid())  # first: the engine knows its helper by this (it is not its child)
    try:
        _set_up_sdk()
        helper = Helper(acks)
    except Exception as exc:
        _logger.warning("otel_kvtransfer builder process: could not set up the SDK (%s: %s); spans and metrics "
                        "of this engine process are counted as dropped", type(exc).__name__, str(exc)[:200])
        sys.exit(1)
    helper.run(0)
    # The engine ended (or was killed with its whole tree, which this process is not part of): what follows,
    # exports included, is bounded; SIGALRM's default action ends a helper an exporter holds past it.
    signal.alarm(EXIT_BOUND_S)
    try:  # what its engine left open ends with it (the engine exited, or was killed), as ended by the exit
        helper.builder.end_at_exit()
    except Exception as exc:
        log_own_error("ending the spans still open at exit", exc)
    # The SDK's exit handlers shut the providers down: spans and metrics still held are exported.


if __name__ == "__main__":
    main()
