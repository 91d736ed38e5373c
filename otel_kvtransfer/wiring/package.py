"""The libraries this package instruments (the opentelemetry-instrumentation `package.py` convention).

`_instruments` (every entry required) is empty: no single distribution is required. `_instruments_any` lists the
distributions any one of which makes this instrumentation useful: every published build of every engine and
framework in the registry, as each backend's spec declares them (`SPEC.distributions`, also its `DISTRIBUTIONS`:
Mooncake ships ten builds, TokenSpeed's fork among them, NIXL three, vLLM two), at the backend's minimum version
(`SPEC.supported`). That is the one list: pyproject.toml's `instruments-any` extra must say the same
(tests/project/test_packaging.py checks it), because `opentelemetry-instrument` (opentelemetry-instrumentation >=
0.57b0) reads that extra from the installed metadata and loads the instrumentor only where one of them is
installed. `KVTransferInstrumentor().instrument()` called by hand checks `_instruments` only, and instruments
whatever engine and framework modules are importable.

Minimum versions only: which framework releases are instrumented is the framework gate's decision
(otel_kvtransfer.wiring.activation: the declared range, and past it the check of every patch target as its module
loads). An upper bound here would keep `opentelemetry-instrument` from loading the instrumentor on a newer
release before that check could say yes.
"""

from types import ModuleType
from typing import Iterable, Tuple

from otel_kvtransfer import registry

_instruments: Tuple[str, ...] = ()


def _minimum(supported: str) -> str:
    """The lower bound of a backend's declared range (">=0.5.23, <0.6" -> ">= 0.5.23")."""
    for part in supported.split(","):
        part = part.strip()
        if part.startswith(">="):
            return ">= " + part[2:].strip()
    raise ValueError(f"a backend's range has no lower bound: {supported!r}")


def instruments_any(backends: Iterable[ModuleType]) -> Tuple[str, ...]:
    """`name >= minimum` for every distribution of every backend's spec, in the registry's order."""
    return tuple(f"{name} {_minimum(backend.SPEC.supported)}" for backend in backends
                 for name in backend.SPEC.distributions)


_instruments_any = instruments_any(registry.load(registry.ENGINES + registry.FRAMEWORKS))
