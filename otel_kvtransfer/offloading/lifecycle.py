"""The builder process's lifecycle, seen from the engine: starting it, spacing the restarts of one that keeps
ending without acknowledging anything, and reaping what it started.

A helper runs in a session of its own (a group signal meant for the engine does not end it) with the engine's
environment minus opentelemetry-instrument's sitecustomize (it instruments nothing), and reads its frames from a
socket on its standard input. It is not the engine's descendant either: a starter process forks it and ends at
once (reaped here), so a supervisor that kills the engine's whole process tree leaves the helper out (vLLM's
shutdown SIGKILLs every descendant of its engine core at once); the helper then sees end-of-file, exports what it
holds and ends by itself, within a bound of its own. Its pid is the first thing it writes on the socket.
A dead helper is replaced: at once when it had acknowledged something, else after a backoff that doubles up to
RESTART_BACKOFF_MAX_S. A helper that never works (its interpreter gone, say: it cannot be started, or it ends
before acknowledging anything) is `given_up()` after START_TRIES such helpers in a row; the link then builds in
this process instead, when it can (`link`). What travels over the socket (frames, acknowledgements, flushes)
is `link.HelperLink`'s concern; this module only hands it the socket.
"""

import logging
import os
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

from otel_kvtransfer.recording import clock

_logger = logging.getLogger(__name__)

HELPER_ENV = "OTEL_KVTRANSFER_HELPER"  # set in the helper's environment: never instrument the helper itself
SETUP_ENV = "OTEL_KVTRANSFER_HELPER_SETUP"  # module:function that sets up the helper's SDK instead of OTEL_*
RESTART_BACKOFF_MAX_S = 60.0
START_TRIES = 3  # helpers in a row that never worked before the link stops starting them (1 s + 2 s of backoff)
SEND_BUFFER = 4 << 20  # room for bursts while the helper builds (the kernel caps it at net.core.wmem_max)

# The helper's import path: the working directory off it (-P; on 3.10, where `-c` puts it first, removed), and
# the directory this package was imported from at its end (an engine run from a checkout finds it there).
SAFE_PATH = ("import sys\n"
             "if sys.path and sys.path[0] == '':\n    del sys.path[0]\n"
             "if sys.argv[1] not in sys.path:\n    sys.path.append(sys.argv[1])\n")
# The starter forks the helper and ends: the helper is adopted by whoever reaps orphans, out of the engine's tree.
_BOOTSTRAP = SAFE_PATH + ("import os\nif os.fork():\n    os._exit(0)\n"
                          "from otel_kvtransfer.offloading.helper_process import main\nmain()\n")


def unavailable_reason() -> Optional[str]:
    """Why this process cannot hand its records to a helper, or None when it can."""
    if not sys.executable:
        return "this interpreter does not know its own executable (embedded Python)"
    exporters = {name.strip().lower() for name in os.environ.get("OTEL_METRICS_EXPORTER", "").split(",")}
    if "prometheus" in exporters:
        return ("OTEL_METRICS_EXPORTER includes prometheus, whose port is this process's; "
                "the helper could not serve the same port")
    return None


def package_parent() -> str:
    """The directory that holds the otel_kvtransfer package: one level up from this file per part of this
    module's dotted name (so it stays right wherever in the package this module lives)."""
    path = os.path.abspath(__file__)
    for _ in __name__.split("."):
        path = os.path.dirname(path)
    return path


def helper_command() -> List[str]:
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe_path, "-c", _BOOTSTRAP, package_parent()]


def _helper_environment() -> Dict[str, str]:
    """The engine's environment minus opentelemetry-instrument's sitecustomize: the helper instruments nothing."""
    env = dict(os.environ)
    env[HELPER_ENV] = "1"
    env.update(clock.environment())  # the helper takes its own times (evicted ends, stuck ages) on our clock
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
             if p and not (os.path.basename(p.rstrip(os.sep)) == "auto_instrumentation"
                           and os.path.exists(os.path.join(p, "sitecustomize.py")))]
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    else:
        env.pop("PYTHONPATH", None)
    return env


class Helper:
    """A helper as the engine knows it: `pid` once the helper has said it (None until then); its exit code is
    never known (it is not this process's child: whoever adopted it reaps it)."""

    def __init__(self) -> None:
        self.pid: Optional[int] = None
        self.returncode: Optional[int] = None


class HelperProcess:
    """The current helper (`proc`, None while none runs), when the next may start, and the starters until they
    are reaped. Its caller (the link) serialises every call."""

    def __init__(self) -> None:
        self.proc: Optional[Helper] = None
        self._starters: List["subprocess.Popen[bytes]"] = []  # starter processes (each ends at once), until reaped
        self._failures = 0  # helpers in a row that could not start or ended without acknowledging anything
        self._next_start = 0.0
        self.last_error = ""  # why the latest helper could not start, for the link's one warning line

    def pid(self) -> Optional[int]:
        proc = self.proc
        return proc.pid if proc is not None else None

    def start(self) -> Optional[socket.socket]:
        """A fresh helper and the engine's end of its socket (non-blocking); None while the backoff holds, or
        when it could not start (then the backoff grows)."""
        now = time.monotonic()
        if now < self._next_start:
            return None
        mine = theirs = None
        try:
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                mine.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
            except OSError:
                pass
            # In a session of its own: a group signal meant for the engine (Ctrl-C, a stop) does not end it.
            # stdout and stderr are the engine's own (a console exporter prints where the engine prints).
            self._starters.append(subprocess.Popen(
                helper_command(), stdin=theirs.fileno(), env=_helper_environment(), close_fds=True,
                start_new_session=True))
            self.proc = Helper()
        except OSError as exc:
            if mine is not None:
                mine.close()
            self._back_off(now)
            # The link says it, once, with what it does instead: one line, not a traceback per retry.
            self.last_error = f"{type(exc).__name__}: {str(exc)[:200]}"
            _logger.debug("otel_kvtransfer: could not start the builder process", exc_info=True)
            return None
        finally:
            if theirs is not None:
                theirs.close()
        mine.setblocking(False)
        return mine

    def _back_off(self, now: float) -> float:
        self._failures += 1
        delay = min(2.0 ** (self._failures - 1), RESTART_BACKOFF_MAX_S)
        self._next_start = now + delay
        return delay

    def given_up(self) -> bool:
        """START_TRIES helpers in a row could not start or ended before acknowledging anything: none will work."""
        return self._failures >= START_TRIES

    def said_pid(self, pid: int) -> None:
        """The current helper's first message: its pid."""
        if self.proc is not None:
            self.proc.pid = pid

    def answered(self) -> None:
        """The current helper acknowledged a frame: it works, and the backoff starts over."""
        self._failures = 0

    def lost(self, worked: bool) -> Tuple[Optional[Helper], float]:
        """The current helper closed its socket (it ended, or is ending): (it, seconds until the next may
        start)."""
        proc, self.proc = self.proc, None
        if worked:
            self._failures, delay = 0, 0.0
            self._next_start = time.monotonic()
        else:
            delay = self._back_off(time.monotonic())
            self.last_error = "it ended before it built anything"
        return proc, delay

    def closed(self, ended: bool) -> Optional[Helper]:
        """The engine closed the socket; `ended`: the helper closed its end in time (it has exported and ends).
        One still exporting is left to end by itself (within its own bound)."""
        proc, self.proc = self.proc, None
        if proc is not None and not ended:
            _logger.warning("otel_kvtransfer: the builder process (pid %s) is still exporting; it ends by itself",
                            proc.pid)
        return proc

    def reap_due(self) -> bool:
        return bool(self._starters)

    def reap(self) -> None:
        """Without waiting: the starters that have ended (poll() reaps them; each ends as soon as it forked)."""
        if self._starters:
            self._starters = [p for p in self._starters if p.poll() is None]

    def after_fork_in_child(self) -> None:
        # The parent's helper and starters are the parent's: this process starts its own helper on its first frame.
        self.proc = None
        self._starters = []
        self._failures, self._next_start = 0, 0.0
