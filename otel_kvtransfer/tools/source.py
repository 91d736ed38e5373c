"""Where span files come from: a path, `-` (stdin), a pipe (`<(cat f)`, `/dev/stdin`) or a FIFO.

A regular file can be read twice (the timeline's second pass); a stream cannot: reopening a pipe reads
nothing, so a stream that must be read twice is first copied to an unnamed temporary file (`spooled`). Opening
never blocks: a FIFO is opened non-blocking, and a reader waits for its first bytes at most FIFO_WAIT_S,
saying once on stderr that it waits, then gives up in one line.
"""

from __future__ import annotations

import os
import select
import shutil
import stat
import sys
import tempfile
from typing import BinaryIO, Optional

from otel_kvtransfer.tools.text import PROG

FIFO_WAIT_S = 30.0  # how long a FIFO or pipe may stay silent before its first byte
_NOTICE_AFTER_S = 1.0


class SourceError(Exception):
    """A source that cannot be read; the message is one line (the caller adds the name)."""


class SpanSource:
    """One span file, held as an open descriptor. `open()` gives a binary handle positioned at the start and the
    size when known (0 for a stream); `rereadable` says whether `open()` may be called again; `regular` whether
    the name is a file (outputs may go beside it)."""

    def __init__(self, name: str, fd: int, size: int, rereadable: bool, regular: bool = False):
        self.name = name
        self.size = size
        self.rereadable = rereadable
        self.regular = regular
        self._fd: Optional[int] = fd
        self._opened = False

    def open(self) -> BinaryIO:
        if self._fd is None:
            raise SourceError("already closed")
        if self._opened and not self.rereadable:
            raise SourceError("a stream cannot be read twice (spool it first)")
        self._opened = True
        if self.rereadable:
            os.lseek(self._fd, 0, os.SEEK_SET)
        return os.fdopen(os.dup(self._fd), "rb")

    def spooled(self) -> "SpanSource":
        """A rereadable source: this one itself, or a stream copied once to an unnamed temporary file."""
        if self.rereadable:
            return self
        spool = tempfile.TemporaryFile(prefix="otel-kvtransfer-")
        with self.open() as stream:
            shutil.copyfileobj(stream, spool, 1 << 20)
        spool.flush()
        fd = os.dup(spool.fileno())
        size = os.fstat(fd).st_size
        spool.close()
        return SpanSource(self.name, fd, size, rereadable=True)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def open_source(name: str) -> SpanSource:
    """`name` as a span source: `-` is stdin; a directory, a terminal or a silent FIFO is a SourceError."""
    if name == "-":
        fd = os.dup(sys.stdin.fileno())
        shown = "stdin"
    else:
        shown = name
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except IsADirectoryError:
            raise SourceError("is a directory, not a span file") from None
        except FileNotFoundError:
            raise SourceError("no such file") from None
        except OSError as exc:
            raise SourceError(f"cannot open: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise SourceError("is a directory, not a span file")
        if os.isatty(fd):
            raise SourceError("is a terminal: give a span file, or pipe one in")
        if stat.S_ISREG(info.st_mode):
            _blocking(fd)
            return SpanSource(shown, fd, info.st_size, rereadable=True, regular=name != "-")
        if stat.S_ISFIFO(info.st_mode) or stat.S_ISSOCK(info.st_mode):
            _wait_for_data(fd, shown)
        _blocking(fd)
        return SpanSource(shown, fd, 0, rereadable=False)
    except BaseException:
        os.close(fd)
        raise


def _blocking(fd: int) -> None:
    os.set_blocking(fd, True)


def _wait_for_data(fd: int, name: str) -> None:
    """Wait until the stream has a byte or its writer left; a FIFO nobody writes to is one clear line."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    if poller.poll(_NOTICE_AFTER_S * 1000):
        return
    sys.stderr.write(f"{PROG}: waiting for a writer on {name} (up to {FIFO_WAIT_S:g} s) ...\n")
    sys.stderr.flush()
    if not poller.poll(max(FIFO_WAIT_S - _NOTICE_AFTER_S, 0) * 1000):
        raise SourceError(f"a FIFO or pipe nobody wrote to in {FIFO_WAIT_S:g} s")
