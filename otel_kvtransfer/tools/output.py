"""Output files that appear whole or not at all, written where the user said.

A regular file (or a new one) is written to a temporary file beside it and renamed over it, so a failed run never
leaves an empty or half-written output; a new file gets the mode the umask gives, a replaced one keeps its mode.
A name that is not a regular file is written through, never replaced: a symlink goes to what it points at (the
rename happens there), and a device or a pipe (`/dev/stdout`, `>(gzip > f)`) is simply written to.
`staged_outputs` renders several outputs first and renames them together, so one that fails leaves none.
"""

import contextlib
import os
import stat
import tempfile
from typing import Any, Dict


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    return mask


class _Output:
    """One output being written: `handle` to write to, `commit()` to put it in place, `discard()` on failure."""

    def __init__(self, path: str, mode: str):
        try:
            info = os.stat(path)  # through symlinks: what the user named, not the link
        except FileNotFoundError:
            info = None
        text: Dict[str, Any] = {} if "b" in mode else {"encoding": "utf-8"}
        self.tmp = None
        if info is not None and not stat.S_ISREG(info.st_mode):
            if stat.S_ISDIR(info.st_mode):
                raise IsADirectoryError(21, "is a directory", path)
            # a device or pipe (/dev/stdout leads to /proc/self/fd/1, a pipe): opened by the name given
            self.handle = open(path, mode, **text)
            self.target = path
            return
        target = os.path.realpath(path)  # a symlink to a file: the rename replaces the file, the link stays
        folder = os.path.dirname(target)
        fd, self.tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=folder)
        self.target = target
        self.mode = stat.S_IMODE(info.st_mode) if info is not None else 0o666 & ~_umask()
        self.handle = os.fdopen(fd, mode, **text)

    def close(self) -> None:
        self.handle.close()

    def commit(self) -> None:
        self.handle.close()
        if self.tmp is not None:
            os.chmod(self.tmp, self.mode)
            os.replace(self.tmp, self.target)
            self.tmp = None

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            self.handle.close()
        if self.tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.tmp)


@contextlib.contextmanager
def atomic_output(path: str, mode: str = "w"):
    """Open `path` for writing as the module says; the file is in place when the block succeeds."""
    out = _Output(path, mode)
    try:
        yield out.handle
        out.commit()
    except BaseException:
        out.discard()
        raise


class staged_outputs:  # used as a context manager, like a function
    """`with staged_outputs() as stage: stage.write(path, data)` ...: every output is written to its temporary
    file as it comes, and all are renamed into place only when the block succeeds."""

    def __init__(self):
        self._outputs = []

    def __enter__(self):
        return self

    def write(self, path: str, data) -> None:
        out = _Output(path, "wb" if isinstance(data, bytes) else "w")
        self._outputs.append(out)
        out.handle.write(data)
        out.handle.flush()

    def __exit__(self, kind, value, traceback):
        if kind is None:
            try:
                for out in self._outputs:
                    out.commit()
                return False
            except BaseException:
                for out in self._outputs:
                    out.discard()
                raise
        for out in self._outputs:
            out.discard()
        return False
