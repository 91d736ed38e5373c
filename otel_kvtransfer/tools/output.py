"""Output files that appear whole or not at all: written to a temporary file beside the target, then renamed."""

import contextlib
import os
import tempfile


@contextlib.contextmanager
def atomic_output(path: str, mode: str = "w"):
    """Open a temporary file in `path`'s folder for writing; rename it to `path` when the block succeeds and
    remove it when the block fails, so a failed run never leaves an empty or half-written output."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as handle:
            yield handle
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
