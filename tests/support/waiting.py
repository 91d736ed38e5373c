"""Bounded waits on the condition itself: a test never sleeps a fixed time hoping that something happened.

A sleep may stay in a test only where the elapsed time IS the scenario (a peer held frozen, a threshold let
pass by design); it then says so in a comment.
"""

import subprocess
import time

import pytest


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.05):
    """Call `predicate` until it returns something truthy, and return that. Past `timeout_s`, fail the test with
    `what` and the last value seen; an exception from `predicate` propagates at once (it is a finding, not a
    "not yet")."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = predicate()
        if found:
            return found
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what} (last: {_shown(found)})")
        time.sleep(interval_s)


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 300 else text[:300] + "..."


def exited(proc, timeout_s: float, what: str, tail: int = 800):
    """(stdout, stderr) of the subprocess.Popen `proc` once it has exited. Past `timeout_s` it is killed and the
    test fails with `what` and the end of its stderr (of its stdout where stderr goes there)."""
    try:
        return proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{what}: {(out if err is None else err).decode()[-tail:]}")
