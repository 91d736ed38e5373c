"""One helper's socket, from the engine's side: frames written whole and in order, acknowledgements read without
waiting.

A frame the socket could not take at once is finished (`push`) before anything else is written, so frames never
interleave. Writes use MSG_NOSIGNAL: a helper that ended never raises SIGPIPE in an engine that restored SIGPIPE's
default action; it answers GONE instead. Waits use poll(), not select(): an engine process may hold more than
select()'s 1,024 descriptors.
"""

import errno
import select
import socket
import time
from typing import Callable, Optional, Union

GONE = None  # what write() answers once the helper has ended
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)
READ_SIZE = 1 << 16  # a read this full may have more behind it
_GONE_ERRORS = (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF)


def ready(fd: int, events: int, timeout_s: float) -> int:
    """The events of `events` that `fd` has within `timeout_s` (0: none)."""
    poller = select.poll()
    poller.register(fd, events)
    answered = poller.poll(max(timeout_s, 0) * 1000)
    return answered[0][1] if answered else 0


class Channel:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.tail: Optional[memoryview] = None  # the unwritten rest of a frame begun

    def fileno(self) -> int:
        return self.sock.fileno()

    def write(self, data: Union[bytes, memoryview]) -> Optional[int]:
        """How much of `data` the socket took (0 while it is full); GONE when the helper has ended."""
        try:
            return self.sock.send(data, _NOSIGNAL)
        except BlockingIOError:
            return 0
        except OSError as exc:
            if exc.errno not in _GONE_ERRORS:
                raise
            return GONE

    def begin(self, frame: bytes, written: int) -> None:
        """`written` bytes of `frame` went: the rest is the tail, written before anything else."""
        if written < len(frame):
            self.tail = memoryview(frame)[written:]

    def push(self, deadline: float, write: Callable[[memoryview], Optional[int]],
             on_readable: Callable[[], bool]) -> bool:
        """The tail, waiting for room until `deadline`; True once it is all written. `write` is the caller's
        write (it handles GONE); when acknowledgements are waiting meanwhile, `on_readable()` reads them (the
        helper may be waiting for us to) and answers False when the helper is gone."""
        while self.tail is not None:
            written = write(self.tail)
            if written is None:
                return False
            self.tail = self.tail[written:] if written < len(self.tail) else None
            if self.tail is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                if ready(self.fileno(), select.POLLOUT | select.POLLIN, left) & select.POLLIN:
                    if not on_readable():
                        return False
        return True

    def read(self) -> Optional[bytes]:
        """What the helper sent (b"": it ended, every byte it sent read before); None while nothing waits."""
        try:
            return self.sock.recv(READ_SIZE)
        except BlockingIOError:
            return None
        except OSError:
            return b""

    def close(self) -> None:
        self.tail = None
        self.sock.close()
