"""The C part of the Mooncake wing reads and builds tuples by position: the pending entry (recording/pending.py's
ENTRY_*), the RAW_ASYNC record (recording/records.py's ASYNC_*) and the last engine's forms (forms.py). Those
positions are declared once, in Python; the C source names each one (`#define`) and the built module says back
what it was built with (`LAYOUT`). Both must be the Python declaration (`compiled.layout()`): a position moved on
either side alone fails here, before any record comes out wrong."""

import pathlib
import re

from support.parts import require_part

from otel_kvtransfer.engines.mooncake import compiled

SOURCE = pathlib.Path(compiled.__file__).with_name("_async_compiled.c")


def _defined_positions(text: str) -> dict:
    return {name: int(value) for name, value in
            re.findall(r"^#define ((?:ENTRY|ASYNC|FORMS)_[A-Z_]+) (\d+)$", text, flags=re.MULTILINE)}


def test_the_c_source_names_the_python_positions():
    assert _defined_positions(SOURCE.read_text()) == compiled.layout()


def test_the_built_module_was_built_with_the_python_positions():
    require_part(compiled.available(), "the package's compiled part (pip install -e . with a C compiler)")
    from otel_kvtransfer.engines.mooncake import _async_compiled

    assert _async_compiled.LAYOUT == compiled.layout()


def test_a_position_moved_in_the_source_alone_is_seen():
    """The check is not vacuous: the source with the entry's posted time one place on differs."""
    moved = SOURCE.read_text().replace("#define ENTRY_POSTED 7", "#define ENTRY_POSTED 8")
    assert _defined_positions(moved) != compiled.layout()
    assert _defined_positions(moved)["ENTRY_POSTED"] == 8


# What the C part reads of the recorder by name (`module_exec`'s table), and where each one lives.
RECORDER_FIELDS = {"active": "recorder", "queue": "recorder", "capacity": "recorder", "idle": "recorder",
                   "record": "recorder", "drop": "recorder", "settings": "recorder",
                   "max_pending_async": "settings", "append": "queue"}


def test_the_recorder_has_every_field_the_c_source_reads_by_name():
    """The names the C part interns are the recorder's public hot-path fields (`Recorder.queue`, ...): each one
    the source names is here, and is what the recorder, its settings and its queue have."""
    from otel_kvtransfer.recording.recorder import RECORDER

    named = set(re.findall(r'\{&str_\w+, "(\w+)"\}', SOURCE.read_text()))
    assert named - {"transfer_failed", "async_pending_full"} == set(RECORDER_FIELDS)
    owners = {"recorder": RECORDER, "settings": RECORDER.settings, "queue": RECORDER.queue}
    for field, owner in RECORDER_FIELDS.items():
        assert hasattr(owners[owner], field), f"{owner} has no {field}"
