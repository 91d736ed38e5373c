"""Shared test helpers.

A test that needs a real part (the Mooncake wheel, sglang, Prometheus, Chromium, Phoenix, node) calls
`require_part(ok, what)`: locally a missing part skips the test with the fix in the reason; in CI (CI=true) it
fails the test, so a green CI always means the real parts ran.
"""

import os

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_part(ok: bool, what: str) -> None:
    if ok:
        return
    message = f"missing real part: {what} (run `bash scripts/setup.sh`)"
    if IN_CI:
        pytest.fail(message)
    pytest.skip(message)
