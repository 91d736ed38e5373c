"""NIXL agents for tests: kept out of the pytest process, and an initiator connected to a loopback receiver
(otel_kvtransfer.demo.nixl_loopback's Receiver, a NIXL agent in a process of its own).

NIXL 1.5.1's UCX backend crashes the interpreter at exit (SIGSEGV after all Python code has run) in any process
that created an agent, which would turn a passing run into exit code 139. So a test module's agents live in ONE
child process (the module run as a script) that runs its scenarios, writes what each saw to a JSON file and
leaves with os._exit; the tests assert on that file.
"""

import contextlib
import functools
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import traceback

from support import netns
from support.parts import require_part
from support.paths import TESTS

# These tests' agents pause 100 us between idle progress polls, as the test deployments' do (tests/nixl_pacing/
# says why; a busy-polling progress thread per agent, three agents per test, take both cores from the calls the
# tests time): in the child that runs a test module's scenarios and in the receivers it spawns (each imports the
# test module, and with it this one, before it makes an agent).
sys.path.insert(0, os.path.join(TESTS, "nixl_pacing"))
import kvt_test_nixl_pacing  # noqa: E402

kvt_test_nixl_pacing.activate()


def require_nixl() -> None:
    require_part(importlib.util.find_spec("nixl") is not None,
                 "NIXL (pip install --no-deps -r scripts/requirements-nixl.txt)")


def run_apart(script: str, out_path: str, env: dict, timeout_s: float, private_net: bool = False) -> dict:
    """Run `python script out_path` (in a private network namespace if asked) and return the JSON it wrote. The
    tests folder goes first on its PYTHONPATH: the script, a test module in a folder of its own, imports support/."""
    require_nixl()
    argv = [sys.executable, os.path.abspath(script), out_path]
    env = netns.with_pythonpath(env, TESTS)
    if private_net:
        netns.require_tools()
        done = netns.run(argv, env, timeout_s, own_user=True)
    else:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    assert done.returncode == 0 and os.path.exists(out_path), done.stderr[-3000:]
    with open(out_path, encoding="utf-8") as handle:
        return json.load(handle)


def loopback_outcomes(script: str, tmp_path_factory, folder: str, timeout_s: float = 600) -> dict:
    """`run_apart` of a test module whose agents talk UCX over TCP on the loopback device (unless the environment
    names other devices)."""
    out = str(tmp_path_factory.mktemp(folder) / "outcomes.json")
    env = dict(os.environ, UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"), UCX_TLS="tcp,self")
    return run_apart(script, out, env, timeout_s=timeout_s)


def run_scenarios(scenarios: dict) -> dict:
    """{name: what scenario() returned, or {"error": its traceback}}: one failing scenario fails only its tests."""
    results = {}
    for name, scenario in scenarios.items():
        try:
            results[name] = scenario()
        except Exception:  # the traceback goes to the tests, which fail on it
            results[name] = {"error": traceback.format_exc()[-3000:]}
    return results


def run_with_receiver(out_path: str, size: int, scenarios: dict, *args) -> None:
    """Run every `scenario(receiver, *args)` against one loopback Receiver of `size` bytes, then `leave`."""
    from otel_kvtransfer.demo.nixl_loopback import Receiver

    with Receiver(size) as receiver:
        results = run_scenarios({name: functools.partial(function, receiver, *args)
                                 for name, function in scenarios.items()})
    leave(out_path, results)


PIPELINES = ("direct", "sdk")  # OTEL_KVTRANSFER_PIPELINE: our own span and metric builder, or the SDK's


def run_in_each_pipeline(out_path: str, size: int, scenario) -> None:
    """Run `scenario(receiver, telemetry)` once per pipeline, each instrumented afresh, against one Receiver; UCX
    over TCP on loopback unless the environment says otherwise (its TCP transport listens on every device it may
    use; over shared memory a frozen peer would not hold a post back)."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("UCX_TLS", "tcp,self")
    run_with_receiver(out_path, size, {pipeline: functools.partial(_in_pipeline, scenario, pipeline)
                                       for pipeline in PIPELINES})


def _in_pipeline(scenario, pipeline: str, receiver) -> dict:
    from support.telemetry import Telemetry

    os.environ["OTEL_KVTRANSFER_PIPELINE"] = pipeline
    telemetry = Telemetry().instrument()
    try:
        return scenario(receiver, telemetry)
    finally:
        telemetry.uninstrument()
        os.environ.pop("OTEL_KVTRANSFER_PIPELINE", None)


def leave(out_path: str, results: dict) -> None:
    """Write `results` for the tests and end the process before UCX's exit handlers can crash it."""
    with open(out_path, "w", encoding="utf-8") as handle:
        json.dump(results, handle, default=str)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def result_of(outcomes: dict, name: str) -> dict:
    """One scenario's result; a scenario that raised fails the test with its traceback."""
    result = outcomes[name]
    assert "error" not in result, result.get("error")
    return result


def spans_named(result: dict, name: str) -> list:
    """The spans of one scenario's result that are called `name`."""
    return [s for s in result["spans"] if s["name"] == name]


@contextlib.contextmanager
def frozen(receiver):
    """The receiver's process stopped for the duration: what is posted to it stays in flight."""
    os.kill(receiver.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(receiver.pid, signal.SIGCONT)


class Initiator:
    """A NIXL agent with a registered source buffer of `size` bytes in blocks of `block`, connected to
    `receiver` (a loopback Receiver, or a peer of the test's own whose agent `metadata` it is given)."""

    def __init__(self, receiver, size: int, block: int, buffer=None, name: str = "kvt-test", metadata=None):
        import nixl._api as api
        import numpy as np

        from otel_kvtransfer.demo.nixl_loopback import _peers

        self.size, self.block, self.receiver = size, block, receiver
        self.agent = api.nixl_agent(f"{name}-{os.getpid()}-{time.monotonic_ns()}",
                                    api.nixl_agent_config(backends=["UCX"]))
        self.buffer = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8) if buffer is None else buffer
        self.agent.register_memory(self.agent.get_reg_descs([(self.buffer.ctypes.data, size, 0, "")], "DRAM"))
        self.peer = self.agent.add_remote_agent(_peers[receiver.session] if metadata is None else metadata)

    def local_blocks(self):
        return [(self.buffer.ctypes.data + i * self.block, self.block, 0) for i in range(self.size // self.block)]

    def remote_blocks(self):
        return [(self.receiver.base_address + i * self.block, self.block, 0) for i in range(self.size // self.block)]

    def descs(self, blocks=None):
        """(local, remote) transfer descriptor lists of the first `blocks` blocks (all by default)."""
        return (self.agent.get_xfer_descs(self.local_blocks()[:blocks], "DRAM"),
                self.agent.get_xfer_descs(self.remote_blocks()[:blocks], "DRAM"))

    def write_all(self, timeout_s=60.0) -> str:
        """One write of every block, posted, polled to its end and released: its final state. A first write also
        connects the two agents, so a test's own writes start connected."""
        local, remote = self.descs()
        handle = self.agent.initialize_xfer("WRITE", local, remote, self.peer)
        state = self.wait(handle, timeout_s=timeout_s)
        self.agent.release_xfer_handle(handle)
        return state

    def wait(self, handle, timeout_s=30.0, post=True):
        """Post `handle` (unless already posted) and poll it until it is no longer PROC, at most `timeout_s`."""
        state = self.agent.transfer(handle) if post else "PROC"
        deadline = time.monotonic() + timeout_s
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(0.001)
            state = self.agent.check_xfer_state(handle)
        return state
