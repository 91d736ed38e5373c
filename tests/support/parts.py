"""Real parts a test needs: `require_part(ok, what)` skips a test whose part is missing locally, with the fix in
the reason, and fails it in CI (CI=true), so a green CI always means the real parts ran."""

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


def mooncake_importable() -> bool:
    try:
        import mooncake.engine  # noqa: F401  imported only to see that the engine loads
    except Exception:
        return False
    return True
