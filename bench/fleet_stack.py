"""The Collector tier of bench/collector_fleet.py: Jaeger, the gateway and the agent from the shipped configs, in
the network namespace the benchmark runs in (loopback only), each process in a session of its own, stopped by its
PID.

The shipped configs are used as they are, with their endpoints from the environment (their `${env:...}`
placeholders). A second config file, merged over each (the Collector merges `--config` files in order; a list is
replaced), changes only what this machine cannot run as shipped: Tempo (AGPL) is not run, so the traces pipelines
export to one backend; the agent's trace exporter (`otlp_grpc/jaeger`) points at the gateway instead of at Jaeger,
which makes the fleet shape engines -> agent -> gateway (routing, then tail sampling) -> Jaeger; and the gateway's
own metrics move off port 8888, which the agent keeps. One gateway: replicas share the resolver's sampling port,
so two would need an address each under one resolvable name.
"""

import glob
import hashlib
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
from support.observability.parts import CACHE, start, stop_all  # noqa: E402

COLLECTOR = os.path.join(ROOT, "collector")
LOOPBACK = "127.0.0.1"
JAEGER = {"otlp_grpc": 14317, "otlp_http": 14318, "health": 14133, "query": 16686, "query_grpc": 16685,
          "telemetry": 18888}
AGENT = {"otlp_grpc": 4317, "otlp_http": 4318, "health": 13133, "zpages": 55679, "telemetry": 8888}
GATEWAY = {"otlp_grpc": 24317, "otlp_http": 24318, "health": 23133, "zpages": 25679, "telemetry": 28888}
BINARIES = {"jaeger": ("jaeger", "KVT_JAEGER"), "agent": ("otelcol-agent", "KVT_OTELCOL"),
            "gateway": ("otelcol-gateway", "KVT_OTELCOL_GATEWAY")}
DECISION_WAIT_S = 10  # gateway.yaml's tail_sampling decision_wait: a trace reaches Jaeger this long after its spans

AGENT_OVERRIDE = """\
service:
  pipelines:
    traces:
      exporters: [otlp_grpc/jaeger]
"""
GATEWAY_OVERRIDE = f"""\
service:
  pipelines:
    traces/sample:
      exporters: [otlp_grpc/jaeger]
  telemetry:
    metrics:
      readers:
        - pull:
            exporter:
              prometheus:
                host: {LOOPBACK}
                port: {GATEWAY['telemetry']}
"""


class StackError(RuntimeError):
    """A part did not start or answer; the message is one line."""


def find_binaries() -> dict:
    """Each binary scripts/setup-go-binaries.sh built into the cache, or the one its environment variable names."""
    found = {}
    for part, (name, override) in BINARIES.items():
        path = os.environ.get(override)
        if not path:
            candidates = sorted(glob.glob(os.path.join(CACHE, "go-bin", f"{name}-*", name)))
            path = candidates[-1] if candidates else ""
        if not os.access(path, os.X_OK):
            raise StackError(f"no {name} binary: run bash scripts/setup-go-binaries.sh (or set {override})")
        found[part] = path
    return found


def version_of(binary: str) -> str:
    """The first line the binary prints for its version (bounded), or why there is none."""
    for argv in ([binary, "--version"], [binary, "version"]):
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"unknown ({type(exc).__name__})"
        lines = [line.strip() for line in (done.stdout + done.stderr).splitlines() if "version" in line.lower()]
        if done.returncode == 0 and lines:
            return lines[0][:200]
    return "unknown"


def config_digests() -> dict:
    """sha256 of each shipped config the stack runs (they may differ from the last commit's)."""
    found = {}
    for name in ("agent.yaml", "gateway.yaml", "jaeger.yaml"):
        try:
            with open(os.path.join(COLLECTOR, name), "rb") as handle:
                found[name] = hashlib.sha256(handle.read()).hexdigest()
        except OSError:
            found[name] = None
    return found


def _env(**settings) -> dict:
    """Only what the configs' placeholders read: nothing of this process's OTEL_* or proxies leaks in."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp")}
    env.update({k: str(v) for k, v in settings.items()})
    return env


def _listeners(ports: dict) -> dict:
    return {"OTELCOL_OTLP_GRPC_ENDPOINT": f"{LOOPBACK}:{ports['otlp_grpc']}",
            "OTELCOL_OTLP_HTTP_ENDPOINT": f"{LOOPBACK}:{ports['otlp_http']}",
            "OTELCOL_HEALTH_ENDPOINT": f"{LOOPBACK}:{ports['health']}",
            "OTELCOL_ZPAGES_ENDPOINT": f"{LOOPBACK}:{ports['zpages']}"}


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            response.read(1 << 16)
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


class Stack:
    """Jaeger, the gateway and the agent, started in that order (each one's destination is up before it)."""

    def __init__(self, binaries: dict, workdir: str):
        self.binaries, self.workdir = binaries, workdir
        self.procs: dict = {}  # part -> Popen
        self.logs: dict = {}

    def _start(self, part: str, argv: list, env: dict, health: str, timeout_s: float = 120) -> None:
        log_path = os.path.join(self.workdir, f"{part}.log")
        with open(log_path, "w", encoding="utf-8") as log:
            self.procs[part] = start(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.logs[part] = log_path
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.alive(part)
            if _answers(health):
                return
            time.sleep(0.3)
        raise StackError(f"{part}: no health at {health} within {timeout_s:.0f} s ({self.last_line(part)})")

    def _override(self, name: str, text: str) -> str:
        path = os.path.join(self.workdir, name)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
        return path

    def start(self) -> None:
        j = JAEGER
        self._start("jaeger", [self.binaries["jaeger"], "--config", os.path.join(COLLECTOR, "jaeger.yaml")], _env(
            JAEGER_OTLP_GRPC_ENDPOINT=f"{LOOPBACK}:{j['otlp_grpc']}",
            JAEGER_OTLP_HTTP_ENDPOINT=f"{LOOPBACK}:{j['otlp_http']}",
            JAEGER_HEALTH_ENDPOINT=f"{LOOPBACK}:{j['health']}",
            JAEGER_QUERY_HTTP_ENDPOINT=f"{LOOPBACK}:{j['query']}",
            JAEGER_QUERY_GRPC_ENDPOINT=f"{LOOPBACK}:{j['query_grpc']}",
            JAEGER_METRICS_HOST=LOOPBACK, JAEGER_METRICS_PORT=j["telemetry"]),
            f"http://{LOOPBACK}:{j['health']}/status")
        self._start("gateway", [self.binaries["gateway"], "--config", os.path.join(COLLECTOR, "gateway.yaml"),
                                "--config", self._override("gateway-override.yaml", GATEWAY_OVERRIDE)], _env(
            **_listeners(GATEWAY), GATEWAY_SAMPLING_HOSTNAME=LOOPBACK,  # `localhost` resolves to ::1 as well
            JAEGER_OTLP_ENDPOINT=f"{LOOPBACK}:{j['otlp_grpc']}"),
            f"http://{LOOPBACK}:{GATEWAY['health']}/")
        self._start("agent", [self.binaries["agent"], "--config", os.path.join(COLLECTOR, "agent.yaml"),
                              "--config", self._override("agent-override.yaml", AGENT_OVERRIDE)], _env(
            **_listeners(AGENT), OTELCOL_PROMETHEUS_HOST=LOOPBACK,
            JAEGER_OTLP_ENDPOINT=f"{LOOPBACK}:{GATEWAY['otlp_grpc']}"),
            f"http://{LOOPBACK}:{AGENT['health']}/")

    def pids(self) -> dict:
        return {part: proc.pid for part, proc in self.procs.items()}

    def alive(self, part: str) -> None:
        proc = self.procs[part]
        if proc.poll() is not None:
            raise StackError(f"{part} exited with {proc.returncode} ({self.last_line(part)})")

    def last_line(self, part: str) -> str:
        try:
            with open(self.logs[part], encoding="utf-8", errors="replace") as handle:
                lines = [line.strip() for line in handle.read()[-20_000:].splitlines() if line.strip()]
        except OSError:
            return "no log"
        return (lines[-1][:300] if lines else "empty log")

    def stop(self) -> None:
        stop_all(list(reversed(self.procs.values())))
