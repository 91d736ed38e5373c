"""Whether the wing's hottest wrappers run compiled, and the compiled wrappers made around their Python twins.

An async send costs its engine's calling thread two wrapped calls and an entry in the pending table; in Python
that is two frames of bytecode around two engine calls, about twice what vLLM's own statistics cost around the
same pair (docs/cost.md, "The async send, compiled"). `_async_compiled` (C, beside this module, built from source
at install where a compiler is, optional) takes the common case of both calls without a Python frame and hands
everything else to the Python wrapper it is made around (`submissions.py`), which stays the reference. A package
built without it, or OTEL_KVTRANSFER_HOT_PATH=python, runs the Python wrappers alone.

What the C part reads by position (the pending entry, the last engine's forms, RAW_ASYNC) it is given here from
the one declaration of each (`layout()`), and it says back what it was built with (`_async_compiled.LAYOUT`):
tests/engines/test_compiled_layout.py fails when the two differ.
"""

from types import ModuleType
from typing import Any, Callable, Dict, Optional, cast

from otel_kvtransfer.engines.mooncake import forms
from otel_kvtransfer.recording import clock, integration, pending, records
from otel_kvtransfer.recording.patching import SUPPRESS_KEY, SUPPRESS_KEY_PLAIN, current_context, own_error
from otel_kvtransfer.recording.recorder import RECORDER

_built: Optional[ModuleType]
try:
    import otel_kvtransfer.engines.mooncake._async_compiled as _built
except ImportError:  # installed without a C compiler, or from a checkout never built
    _built = None


def available() -> bool:
    """Whether this installation has the compiled wrappers."""
    return _built is not None


def chosen() -> Optional[ModuleType]:
    """The compiled wrappers' module when wrappers made now should use it (built, and not turned off); else None.
    Read when an engine is patched: the choice holds until it is patched again."""
    if _built is None or RECORDER.settings.hot_path != "compiled":
        return None
    return _built


def layout() -> Dict[str, int]:
    """The positions the C part reads, from their one declaration each: what `_async_compiled.LAYOUT` must be."""
    return {
        "ENTRY_SIZE": pending.ENTRY_SIZE, "ENTRY_START": pending.ENTRY_START, "ENTRY_BYTES": pending.ENTRY_BYTES,
        "ENTRY_DESCRIPTORS": pending.ENTRY_DESCRIPTORS, "ENTRY_PEER": pending.ENTRY_PEER,
        "ENTRY_FORM": pending.ENTRY_FORM, "ENTRY_INFO": pending.ENTRY_INFO, "ENTRY_CONTEXT": pending.ENTRY_CONTEXT,
        "ENTRY_POSTED": pending.ENTRY_POSTED,
        "ASYNC_SIZE": records.ASYNC_SIZE, "ASYNC_KIND": records.KIND, "ASYNC_START": records.ASYNC_START,
        "ASYNC_DURATION": records.ASYNC_DURATION, "ASYNC_BYTES": records.ASYNC_BYTES,
        "ASYNC_DESCRIPTORS": records.ASYNC_DESCRIPTORS, "ASYNC_PEER": records.ASYNC_PEER,
        "ASYNC_RETURN_CODE": records.ASYNC_RETURN_CODE, "ASYNC_ERROR": records.ASYNC_ERROR,
        "ASYNC_FORM": records.ASYNC_FORM, "ASYNC_CONTEXT": records.ASYNC_CONTEXT,
        "ASYNC_SEEN_RUNNING": records.ASYNC_SEEN_RUNNING, "ASYNC_POST": records.ASYNC_POST,
        "FORMS_ENGINE": forms.FORMS_ENGINE,
    }


def submission(original: Callable[..., Any], submit: Callable[..., Any], refused: Callable[..., None],
               table: pending.PendingTransfers, at: int, batch: bool) -> Optional[Callable[..., Any]]:
    """The compiled common submission made around its Python twin `submit`, or None where it is not chosen."""
    built = chosen()
    if built is None:
        return None
    return cast(Callable[..., Any], built.Submission(
        original, submit, refused, own_error, RECORDER, current_context, integration.ENTERED, forms.last_engine,
        table.entries, table.reused, SUPPRESS_KEY, SUPPRESS_KEY_PLAIN, clock.BASE, at, batch))


def batch_wait(original: Callable[..., Any], completed: Callable[..., None],
               table: pending.PendingTransfers) -> Optional[Callable[..., Any]]:
    """The compiled common wait made around its Python twin's `completed`, or None where it is not chosen."""
    built = chosen()
    if built is None:
        return None
    return cast(Callable[..., Any], built.BatchWait(original, completed, table.ended, table.reclaim, own_error,
                                                    RECORDER, table.entries, table.running_seen, records.RAW_ASYNC,
                                                    clock.BASE))
