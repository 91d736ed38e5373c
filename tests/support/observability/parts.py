"""Finding and running the real parts of the observability tests: Prometheus, node + @grafana/schema, Phoenix.

Every process started here is started in its own session and stopped by its PID (`stop`); every wait is
bounded; every address is 127.0.0.1. `scripts/setup-observability.sh` installs the parts.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

from support.paths import ROOT, TESTS

CACHE = os.environ.get("OTEL_KVT_CACHE") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "otel-kvtransfer")
NODE_DIR = os.path.join(CACHE, "node")
PHOENIX_VENV = os.path.join(CACHE, "phoenix-venv")
SETUP = "bash scripts/setup-observability.sh"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prometheus_binary():
    return shutil.which("prometheus")


def node_ready() -> bool:
    return bool(shutil.which("node")) and os.path.isfile(
        os.path.join(NODE_DIR, "node_modules", "typescript", "bin", "tsc")) and os.path.isdir(
        os.path.join(NODE_DIR, "node_modules", "@grafana", "schema"))


def phoenix_binary():
    path = os.path.join(PHOENIX_VENV, "bin", "phoenix")
    return path if os.access(path, os.X_OK) else None


def mooncake_available() -> bool:
    try:
        import mooncake.engine  # noqa: F401  imported only to see that the engine loads
    except Exception:
        return False
    return True


def veth_namespaces_work() -> bool:
    """A user + network namespace in which veth pairs and tc qdiscs can be made (kernels or sandboxes may refuse)."""
    if not (shutil.which("unshare") and shutil.which("ip") and shutil.which("tc")):
        return False
    probe = subprocess.run(
        ["unshare", "-rn", "sh", "-c", "ip link add kvtprobe type veth peer name kvtprobe1 && "
         "tc qdisc add dev kvtprobe root tbf rate 1mbit burst 32kb latency 400ms"],
        capture_output=True, timeout=20, check=False)
    return probe.returncode == 0


def run_namespace_script(script: str, args: list, timeout_s: float) -> dict:
    """`unshare -rn python script --outer-netns <ours> *args` in its own process group (a run past the bound ends
    it and what it started), and the JSON of its RESULT line; its ERROR line, or none, fails the test."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, TESTS])}
    proc = start(["unshare", "-rn", sys.executable, script, "--outer-netns", os.readlink("/proc/self/ns/net"),
                  *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop(proc)
        stdout, stderr = proc.communicate()
    lines = [line for line in stdout.splitlines() if line.startswith(("RESULT ", "ERROR "))]
    assert lines and lines[-1].startswith("RESULT "), (proc.returncode, stdout[-2000:], stderr[-3000:])
    return json.loads(lines[-1][len("RESULT "):])


def mooncake_tcp_engine(address: str):
    """A Mooncake TransferEngine at `address` over TCP, peers found by handshake (no metadata server)."""
    os.environ.setdefault("MC_FORCE_TCP", "1")
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize(address, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"TransferEngine.initialize({address}) returned {rc}")
    return engine


def start(argv, **kwargs) -> subprocess.Popen:
    """Start a process in its own session (so `stop` can end it and its children by its PID)."""
    return subprocess.Popen(argv, start_new_session=True, **kwargs)


def stop(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM the process group led by proc.pid, then SIGKILL it if it is still there after `timeout`."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(5)


def stop_all(procs, timeout: float = 10.0) -> None:
    """stop() for several processes at once: every group gets SIGTERM first, so they wind down side by side
    within one `timeout`; what is still there at its end gets SIGKILL."""
    running = [p for p in procs if p is not None and p.poll() is None]
    for proc in running:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    for proc in running:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            stop(proc, timeout=0)


def wait_until(predicate, timeout: float, interval: float = 0.25, what: str = "condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except Exception as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(interval)
    raise TimeoutError(f"{what} not reached within {timeout} s (last: {last!r})")


def http_json(url: str, params=None, timeout: float = 5.0):
    assert url.startswith("http://127.0.0.1:"), url  # tests talk to loopback only
    if params:
        url += "?" + urllib.parse.urlencode(params, doseq=True)
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read().decode())


def read_line_with_prefix(proc: subprocess.Popen, prefix: str, timeout: float) -> str:
    """The first stdout line of `proc` that starts with prefix (without it), read within `timeout`."""
    import selectors

    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not selector.select(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
                if proc.poll() is not None:
                    break
                continue
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith(prefix):
                return line[len(prefix):].strip()
    finally:
        selector.close()
    raise TimeoutError(f"no '{prefix}' line from pid {proc.pid} within {timeout} s (exit code {proc.poll()})")
