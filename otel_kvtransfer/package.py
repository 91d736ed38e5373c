"""The libraries this package instruments and the versions it supports.

Empty `_instruments` on purpose: Mooncake ships as two distributions (`mooncake-transfer-engine` for GPU hosts,
`mooncake-transfer-engine-non-cuda` for CPU hosts), so the instrumentor checks for the importable module itself
instead of letting opentelemetry-instrument demand one distribution name.
"""

_instruments: tuple = ()

# Informational: what each engine module supports.
_supports = {
    "mooncake": "mooncake-transfer-engine >= 0.3 (or mooncake-transfer-engine-non-cuda >= 0.3)",
    "sglang": "sglang >= 0.5.23, < 0.6",
}
