"""A test's own app under `opentelemetry-instrument`, in a private network namespace, with the standard OTEL_*
variables only: spans go to a span file, what the app saw goes to a JSON file the test reads back.

The app is a function of a test module, `function(out_path)`, called in a fresh interpreter that the
`opentelemetry-instrument` launcher set up, as a user's process would be. The test names its module by its file
(`__file__`): the app imports it from the test's own folder, with support/ importable beside it.
"""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

from support import netns
from support.parts import mooncake_importable, require_part
from support.paths import ROOT, TESTS


def require_parts() -> None:
    require_part(mooncake_importable(), "the Mooncake engine (mooncake-transfer-engine-non-cuda + libibverbs1)")
    netns.require_tools()
    require_part(importlib.util.find_spec("opentelemetry.instrumentation.auto_instrumentation") is not None,
                 "opentelemetry-instrumentation")


def run(tmp_path, test_file: str, function: str, builder: str, env: dict, timeout_s: float, own_user: bool = False):
    """Run `function(out_path)` of the test module `test_file` under opentelemetry-instrument with `builder` and
    the extra `env`.

    Returns (the finished process, the JSON the app wrote, the span file's path); a failed run fails the test
    with the end of its stderr."""
    argv, full_env, spans_path, out_path = _command(tmp_path, test_file, function, builder, env)
    proc = netns.run(argv, full_env, timeout_s, own_user=own_user, cwd=str(tmp_path))
    return _finished(proc, out_path, spans_path)


def start(tmp_path, test_file: str, function: str, builder: str, env: dict, own_user: bool = False) -> "Running":
    """`run`, without waiting for its end: the test reads the app's output while it runs and can tell it a line
    on its stdin (an app that waits for a condition only the test sees)."""
    argv, full_env, spans_path, out_path = _command(tmp_path, test_file, function, builder, env)
    return Running(argv, full_env, tmp_path, spans_path, out_path, own_user)


def spans_when(spans_path: str, count: int, timeout_s: float = 30.0) -> list:
    """The span file's spans once it holds `count`, or all it holds after `timeout_s` (the test then says what is
    missing): a helper process may still be writing when the app has ended."""
    from otel_kvtransfer.tools.spanfile import read_spans

    deadline = time.monotonic() + timeout_s
    while True:
        spans = read_spans(spans_path) if os.path.exists(spans_path) else []
        if len(spans) >= count or time.monotonic() > deadline:
            return spans
        time.sleep(0.2)


class Running:
    """An app started by `start`; its stdout and stderr go to files in tmp_path, read while it runs."""

    def __init__(self, argv, env, tmp_path, spans_path, out_path, own_user):
        self.spans_path, self._out_path = spans_path, out_path
        self._stdout_path, self._stderr_path = str(tmp_path / "app.stdout"), str(tmp_path / "app.stderr")
        with open(self._stdout_path, "wb") as stdout, open(self._stderr_path, "wb") as stderr:
            # a session of its own: the app, its helper processes and its children are stopped together
            self.proc = subprocess.Popen(netns.private_net(argv, own_user), env=env, cwd=str(tmp_path),
                                         stdin=subprocess.PIPE, stdout=stdout, stderr=stderr,
                                         start_new_session=True)

    def stdout(self) -> str:
        return _read(self._stdout_path)

    def stderr(self) -> str:
        return _read(self._stderr_path)

    def tell(self, line: str) -> None:
        """One line on the app's stdin (none if it has ended: `finish` then says why)."""
        try:
            self.proc.stdin.write(line.encode() + b"\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass

    def finish(self, timeout_s: float):
        """(the finished process, the JSON the app wrote, the span file's path), as `run` returns them."""
        try:
            returncode = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"the app did not end within {timeout_s:g} s: {self.stderr()[-3000:]}") from None
        proc = subprocess.CompletedProcess(self.proc.args, returncode, self.stdout(), self.stderr())
        return _finished(proc, self._out_path, self.spans_path)

    def stop(self) -> None:
        """Ends what is left of the app's session: its process group, named by the app's PID (a child it left
        frozen with SIGSTOP would never end on its own)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass  # nothing of it is left
        self.proc.wait(30)
        if self.proc.stdin:
            self.proc.stdin.close()


def _command(tmp_path, test_file: str, function: str, builder: str, env: dict):
    require_parts()
    instrument = os.path.join(os.path.dirname(sys.executable), "opentelemetry-instrument")
    spans_path, out_path = str(tmp_path / "spans.jsonl"), str(tmp_path / "out.json")
    full_env = netns.with_pythonpath(
        {**os.environ, "OTEL_KVTRANSFER_BUILDER": builder, "OTEL_TRACES_EXPORTER": "kvtransfer_file",
         "OTEL_KVTRANSFER_SPAN_FILE": spans_path, "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none",
         "MC_FORCE_TCP": "1", "MC_LOG_LEVEL": "ERROR", **env}, ROOT)
    folder, module = os.path.split(os.path.splitext(os.path.abspath(test_file))[0])
    script = (f"import sys; sys.path[:0] = [{TESTS!r}, {folder!r}]; import {module}; "
              f"{module}.{function}({out_path!r})")
    return [instrument, sys.executable, "-c", script], full_env, spans_path, out_path


def _finished(proc, out_path: str, spans_path: str):
    assert proc.returncode == 0 and os.path.exists(out_path), proc.stderr[-3000:]
    with open(out_path, encoding="utf-8") as handle:
        return proc, json.load(handle), spans_path


def _read(path: str) -> str:
    with open(path, "rb") as handle:
        return handle.read().decode("utf-8", "replace")
