"""Faults of the builder process (OTEL_KVTRANSFER_BUILDER=process) with the real Mooncake engine: the engine
process (tests/apps/builder_process_app.py) makes real writes to a receiver process on 127.0.0.1, its helper
builds the spans and metrics (tests/apps/builder_process_setup.py). Each fault: the engine goes on, and every
record is built or counted as dropped exactly once, in a metric some exporter sees (the helper's, or the engine
process's own when no helper can carry it)."""

import os
import subprocess
import sys

from test_builder_process import _run, _sends

from otel_kvtransfer import semconv
from otel_kvtransfer.offloading import lifecycle
from otel_kvtransfer.tools.spanfile import read_spans


def test_helpers_are_restarted_after_any_number_of_losses_and_every_one_is_reaped(tmp_path):
    # Four helpers killed in turn (an OOM killer, say), each after it had built its writes.
    # Drains only on flush: nothing reaches a helper after its flush, before it is killed.
    steps = ["send:2", "flush", "kill-helper-nowait"] * 4 + ["send:2", "flush", "zombies", "local-drops"]
    outcomes, totals, _ = _run(tmp_path, *steps, OTEL_KVTRANSFER_FLUSH_INTERVAL_MS="60000")
    killed = [o["killed"] for o in outcomes if "killed" in o]
    assert len(set(killed)) == 4
    assert outcomes[-3]["flushed"] is True and outcomes[-3]["helper"] not in killed  # a fifth helper
    assert outcomes[-2]["zombies"] == []  # every helper given up was reaped
    assert len(_sends(tmp_path)) == 10
    assert totals == [{"sizes": 2, "dropped": {}}]  # the fifth's; the killed ones wrote none
    assert outcomes[-1]["local_drops"] == {}


def test_a_dead_helpers_acknowledgements_are_read_before_anything_is_counted(tmp_path):
    # The helper built the 20 writes and said so; it dies before the engine read that: nothing is lost.
    outcomes, totals, _ = _run(tmp_path, "send:10", "flush", "send:20", "drain", "await-acks", "kill-helper",
                               "send:5", "flush", "local-drops", OTEL_KVTRANSFER_FLUSH_INTERVAL_MS="60000")
    assert outcomes[5]["acks_waiting"] is True
    assert outcomes[8]["flushed"] is True and outcomes[8]["helper"] not in (None, outcomes[6]["killed"])
    assert totals == [{"sizes": 5, "dropped": {}}]
    assert outcomes[9]["local_drops"] == {}


def test_a_helper_stalled_by_its_collector_builds_every_record_exactly_once(tmp_path):
    # The collector hangs (the helper's exporter blocks) while the engine flushes and goes on writing for longer
    # than any write timeout; then it answers again. The same helper builds everything: nothing is counted as
    # lost while it was still going to build it.
    outcomes, totals, _ = _run(tmp_path, "send:5", "flush", "hold", "send:5", "flush:1000", "send:600", "sleep:12",
                               "release", "send:5", "flush", "local-drops", KVT_TEST_HOLD=str(tmp_path / "hold"))
    assert outcomes[5]["flushed"] is False  # the collector did not answer within the flush's own timeout
    assert outcomes[10]["flushed"] is True
    assert outcomes[2]["helper"] == outcomes[10]["helper"]  # never given up for being slow
    assert totals == [{"sizes": 615, "dropped": {}}]
    assert outcomes[11]["local_drops"] == {}


def test_a_record_of_a_class_only_the_engine_has_is_built_with_plain_values(tmp_path):
    # One frame holds the 5 requests and one whose attributes are of classes defined in the engine's __main__.
    outcomes, totals, stderr = _run(tmp_path, "send:3", "main-class", "send:2", "flush",
                                    OTEL_KVTRANSFER_FLUSH_INTERVAL_MS="60000")
    assert outcomes[4]["flushed"] is True
    assert totals == [{"sizes": 6, "dropped": {}}]
    requests = [s for s in read_spans(str(tmp_path / "spans.jsonl")) if s.name == semconv.SPAN_REQUEST]
    odd = [s for s in requests if s.attributes[semconv.REQUEST_KEY] == "1003"]
    assert len(requests) == 6 and len(odd) == 1
    assert odd[0].attributes["test.tag"] == "<__main__.Tag>"  # an object: its class's name
    assert odd[0].attributes["test.tier"] == 3  # an IntEnum: its value
    assert "built with plain values" in stderr and "Traceback" not in stderr


def test_an_engine_with_sigpipe_at_its_default_action_outlives_its_helper(tmp_path):
    outcomes, totals, _ = _run(tmp_path, "sigpipe-default", "send:3", "flush", "kill-helper", "send:3", "flush",
                               OTEL_KVTRANSFER_FLUSH_INTERVAL_MS="60000")  # _run: the app exited 0
    assert outcomes[5]["return_codes"] == [0] and outcomes[6]["flushed"] is True
    assert len(_sends(tmp_path)) == 6 and totals == [{"sizes": 3, "dropped": {}}]


def test_a_stray_module_in_the_working_directory_is_not_imported_by_the_helper(tmp_path):
    # A stray copy of a module the helper imports (its SDK set-up), in the engine's working directory. (Not a
    # stray select.py here: the test's receiver, a multiprocessing spawn child, would import that one itself.)
    work = tmp_path / "work"
    work.mkdir()
    (work / "builder_process_setup.py").write_text("open('stray-imported', 'w').close()\nraise ImportError('stray')\n")
    outcomes, totals, _ = _run(tmp_path, "send:3", "flush", cwd=str(work))
    assert outcomes[2]["flushed"] is True and totals == [{"sizes": 3, "dropped": {}}]
    assert not (work / "stray-imported").exists()


def test_the_helpers_import_path_leaves_out_the_working_directory_without_safe_path_too(tmp_path):
    # Python 3.10 has no -P, and `-c` puts the working directory first: the bootstrap removes it. Run here
    # without -P, whatever this interpreter is.
    (tmp_path / "select.py").write_text("raise ImportError('a stray select.py')\n")
    code = lifecycle.SAFE_PATH + "import select\nprint(select.__file__)\n"
    result = subprocess.run([sys.executable, "-c", code, lifecycle.package_parent()],
                            cwd=str(tmp_path), capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert os.path.dirname(result.stdout.strip()) != str(tmp_path)


def test_the_helpers_import_path_ends_with_the_directory_that_holds_this_package(tmp_path):
    # An engine run from a checkout (the package not installed) must find the package at the end of the helper's
    # path: without site-packages (-S) only that entry can supply it. find_spec looks without importing (the
    # package's own dependencies live in site-packages).
    command = lifecycle.helper_command()
    code = (lifecycle.SAFE_PATH
            + "import importlib.util\nprint(importlib.util.find_spec('otel_kvtransfer').origin)\n")
    result = subprocess.run([sys.executable, "-S", "-c", code, command[-1]], cwd=str(tmp_path),
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == os.path.join(command[-1], "otel_kvtransfer", "__init__.py")


def test_group_signals_and_a_sigterm_leave_the_helper_building_until_its_engine_ends(tmp_path):
    # SIGINT and SIGTERM to the engine's process group (a terminal's Ctrl-C, a service manager's stop) and a
    # SIGTERM to the helper itself, while the engine goes on for longer than any grace period.
    outcomes, totals, stderr = _run(tmp_path, "send:5", "flush", "signal-group", "sleep:11", "send:5", "flush")
    assert outcomes[3]["seen"] == [2, 15]  # the engine got both
    assert outcomes[3]["signalled"] == outcomes[2]["helper"] == outcomes[6]["helper"]
    assert outcomes[6]["flushed"] is True
    assert len(_sends(tmp_path)) == 10 and totals == [{"sizes": 10, "dropped": {}}]
    assert "Traceback" not in stderr


def test_a_full_socket_drops_and_counts_what_it_cannot_write_and_nothing_twice(tmp_path):
    # The helper is stopped (as busy as can be, and alive). A first drain of more records than its socket holds
    # is written in part, the rest kept; the next drain cannot go and is counted here, before any of it is
    # written; once the helper goes on, it builds the first whole. (Records of requests with no transfer: only
    # their number matters here, and they are quick to make; the socket's buffer is made small to be filled.)
    outcomes, totals, _ = _run(tmp_path, "send:1", "flush", "small-socket", "stop-helper", "requests:10000",
                               "drain", "requests:100", "drain", "cont-helper", "flush", "local-drops",
                               OTEL_KVTRANSFER_FLUSH_INTERVAL_MS="60000", KVT_TEST_COUNT_REQUESTS="1")
    assert outcomes[6]["frame_waiting"] is True  # the socket took only part of the first frame
    assert outcomes[10]["flushed"] is True and outcomes[10]["helper"] == outcomes[2]["helper"]  # never given up
    assert outcomes[11]["local_drops"] == {"builder_process": 200}  # the 100 requests' begin and end records
    assert totals == [{"sizes": 1, "dropped": {}, "requests": 10001}]
