"""Whether the engines' hottest wrappers run compiled.

An async send costs its engine's calling thread two wrapped calls and an entry in the pending table; in Python
that is two frames of bytecode around two engine calls, about twice what vLLM's own statistics cost around the
same pair (docs/cost.md, "The async send, compiled"). `_async_compiled` (C, built from source at install where a
compiler is, optional) takes the common case of both calls without a Python frame and hands everything else to
the Python wrapper it is made around, which stays the reference. A package built without it, or
OTEL_KVTRANSFER_HOT_PATH=python, runs the Python wrappers alone.
"""

from types import ModuleType
from typing import Optional

from otel_kvtransfer.recording.recorder import RECORDER

_built: Optional[ModuleType]
try:
    from otel_kvtransfer.recording import _async_compiled as _built
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
