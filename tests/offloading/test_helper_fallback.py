"""A builder process that can never start: its interpreter is gone (the engine's virtualenv was rebuilt or removed
under it). After the link's bounded tries the engine builds in process: one warning line says so, every record
from then on is exported, and what was recorded while helpers were tried is counted as dropped.

Real parts: the engine process runs under `opentelemetry-instrument` with the default builder (`auto`: a helper
process, since its SDK comes from the standard OTEL_* variables), a span file and the console metric exporter;
it makes real Mooncake writes to a receiver process on 127.0.0.1. Its interpreter is a virtualenv made of links
to the test's own (bin/python, pyvenv.cfg, site-packages), and the app removes its bin/python before its first
write, as an upgrade that replaces the virtualenv would: the running process goes on, `sys.executable` names a
file that is no more. Everything runs inside `unshare --net` with loopback up (Mooncake's handshake listener
binds all interfaces).
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time

from support import instrumented_app, netns
from support.console import console_json_objects, console_points
from support.paths import ROOT, TESTS

from otel_kvtransfer import semconv

HERE = os.path.dirname(os.path.abspath(__file__))  # the app imports this module from here
WRITES_AFTER = 5  # writes made once the first span is out: every one of them must be exported
WAIT_S = 60.0  # bounded wait for the first exported span (the fallback comes after ~3 s of tries)
BASE_SIZE = 1000  # write i moves BASE_SIZE + i bytes: each write is told apart by its bytes


# --- the engine process (run under opentelemetry-instrument by the test) --------------------------------------


def engine_whose_interpreter_goes(out_path: str) -> None:
    import numpy as np
    from opentelemetry import trace

    from otel_kvtransfer.demo.loopback import Receiver, open_engine
    from otel_kvtransfer.tools.spanfile import read_spans

    span_file = os.environ["OTEL_KVTRANSFER_SPAN_FILE"]

    def exported_sizes() -> list:
        spans = read_spans(span_file) if os.path.exists(span_file) else []
        return [s.attributes[semconv.BYTES] for s in spans if s.name == semconv.SPAN_SEND]

    with Receiver(1 << 20, env={"MC_FORCE_TCP": "1", "MC_TRANSFER_TIMEOUT": "5"}) as receiver:  # before it goes
        engine = open_engine()
        source = np.full(1 << 16, 7, dtype=np.uint8)
        assert engine.register_memory(source.ctypes.data, source.nbytes) == 0
        os.remove(sys.executable)
        provider = trace.get_tracer_provider()
        writes, flushes = 0, []

        def write() -> None:
            nonlocal writes
            rc = engine.transfer_sync_write(receiver.session, source.ctypes.data, receiver.base_address,
                                            BASE_SIZE + writes)
            assert rc == 0, rc
            writes += 1

        deadline = time.monotonic() + WAIT_S
        while not exported_sizes() and time.monotonic() < deadline:  # until the first span is out, bounded
            write()
            provider.force_flush(5000)
            time.sleep(0.2)
        first_out = writes
        for _ in range(WRITES_AFTER):
            write()
        flushes.append(provider.force_flush(10000))
        with open(out_path, "w", encoding="utf-8") as handle:
            json.dump({"interpreter_gone": not os.path.exists(sys.executable), "writes": writes,
                       "first_out": first_out, "flushed": flushes, "exported": exported_sizes()}, handle)


# --- the test ------------------------------------------------------------------------------------------------


def _linked_venv(root) -> str:
    """A virtualenv of links to this interpreter's own; its bin/python is what the app removes."""
    os.makedirs(root / "bin")
    os.symlink(os.path.realpath(sys.executable), root / "bin" / "python")
    shutil.copy(os.path.join(sys.prefix, "pyvenv.cfg"), root / "pyvenv.cfg")
    purelib = sysconfig.get_paths()["purelib"]
    relative = os.path.relpath(purelib, sys.prefix)
    os.makedirs(root / os.path.dirname(relative))
    os.symlink(purelib, root / relative)
    return str(root / "bin" / "python")


def test_a_helper_that_can_never_start_gives_way_to_the_in_process_builder(tmp_path):
    instrumented_app.require_parts()
    assert sys.prefix != sys.base_prefix, "the tests run from a virtualenv (scripts/test.sh makes one)"
    python = _linked_venv(tmp_path / "venv")
    instrument = os.path.join(os.path.dirname(sys.executable), "opentelemetry-instrument")
    spans_path, out_path = str(tmp_path / "spans.jsonl"), str(tmp_path / "out.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}  # the defaults: builder auto
    env = netns.with_pythonpath(dict(env, **{
        "OTEL_TRACES_EXPORTER": "kvtransfer_file", "OTEL_KVTRANSFER_SPAN_FILE": spans_path,
        "OTEL_METRICS_EXPORTER": "console", "OTEL_METRIC_EXPORT_INTERVAL": "600000", "OTEL_LOGS_EXPORTER": "none",
        "MC_FORCE_TCP": "1", "MC_LOG_LEVEL": "ERROR"}), ROOT)
    script = (f"import sys; sys.path[:0] = [{TESTS!r}, {HERE!r}]; import test_helper_fallback as app; "
              f"app.engine_whose_interpreter_goes({out_path!r})")
    proc = netns.run([instrument, python, "-c", script], env, 240, cwd=str(tmp_path))
    assert proc.returncode == 0 and os.path.exists(out_path), proc.stderr[-3000:]
    with open(out_path, encoding="utf-8") as handle:
        outcome = json.load(handle)
    assert outcome["interpreter_gone"] is True
    # The first span came out while the app still wrote, and from then on every write is exported: the
    # exported writes are exactly the last ones, with the WRITES_AFTER made after the first was seen.
    exported = sorted(outcome["exported"])
    writes = outcome["writes"]
    assert exported, f"nothing was exported in {WAIT_S:g} s: {proc.stderr[-2000:]}"
    first = exported[0] - BASE_SIZE
    assert first <= outcome["first_out"] <= writes - WRITES_AFTER
    assert exported == [BASE_SIZE + i for i in range(first, writes)], outcome
    assert outcome["flushed"] == [True]
    # What was recorded while helpers were tried is counted (at least one record per write not exported).
    dropped = console_points(console_json_objects(proc.stdout), semconv.METRIC_DROPPED)
    counted = [value for attributes, value in dropped
               if attributes.get(semconv.DROP_REASON) == "builder_process"]
    assert first > 0 and counted and counted[-1] >= first, (first, dropped)
    # One warning line says what happened; no traceback per try.
    lines = [line for line in proc.stderr.splitlines() if "builder process could not start" in line]
    assert len(lines) == 1 and "built in this process from now on" in lines[0], lines
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_the_linked_virtualenv_runs_this_interpreter_with_its_packages(tmp_path):
    # The precondition of the test above: the linked virtualenv finds the packages (else its failure would say
    # nothing about the fallback).
    python = _linked_venv(tmp_path / "venv")
    result = subprocess.run([python, "-c", "import sys, opentelemetry.sdk, otel_kvtransfer; print(sys.executable)"],
                            env=netns.with_pythonpath(dict(os.environ), ROOT), capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == python
