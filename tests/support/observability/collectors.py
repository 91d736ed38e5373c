"""The real Collectors and Jaeger of the observability tests, built by `scripts/setup-observability.sh`: finding the
binaries, their environment (only what the configs' own `${env:...}` placeholders read), a stack of processes in
a private network namespace, OTLP/HTTP JSON payloads, and reads of Jaeger's query API and of a Collector's own
metrics.

A stack's first process holds its namespace (`unshare --net`, loopback up); the others and every request join it
with `nsenter`. Nothing there listens or sends outside the loopback addresses. Each process is stopped by its PID.
"""

import base64
import glob
import json
import os
import re
import subprocess
import sys
import time

from support.observability.parts import CACHE, start, stop_all, wait_until
from support.paths import ROOT

COLLECTOR = os.path.join(ROOT, "collector")
SETUP = "bash scripts/setup-observability.sh"

# Jaeger's defaults (4317, 4318, 13133, 8888) are the Collector's: its config takes others from the environment.
JAEGER_PORTS = {"otlp_grpc": 14317, "otlp_http": 14318, "health": 14133, "query": 16686, "query_grpc": 16685,
                "metrics": 18888}
LOOPBACK_URL = re.compile(r"http://127\.0\.0\.([1-9][0-9]?):[0-9]+/")
MAX_BODY = 64 << 20  # a Jaeger search of a few thousand traces is a few MB


def find_binary(name: str, override: str):
    """The binary scripts/setup-observability.sh built into the cache (`$CACHE/go-bin/<name>-<version>/<name>`), or
    the one `override` (an environment variable) names."""
    if os.environ.get(override):
        path = os.environ[override]
        return path if os.access(path, os.X_OK) else None
    found = [p for p in sorted(glob.glob(os.path.join(CACHE, "go-bin", f"{name}-*", name))) if os.access(p, os.X_OK)]
    return found[-1] if found else None


def base_env(**settings) -> dict:
    """No OTEL_* or proxy settings of the test process leak in: only what the configs' placeholders read."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp")}
    env.update({k: str(v) for k, v in settings.items()})
    return env


def jaeger_env() -> dict:
    p = JAEGER_PORTS
    return base_env(JAEGER_OTLP_GRPC_ENDPOINT=f"127.0.0.1:{p['otlp_grpc']}",
                    JAEGER_OTLP_HTTP_ENDPOINT=f"127.0.0.1:{p['otlp_http']}",
                    JAEGER_HEALTH_ENDPOINT=f"127.0.0.1:{p['health']}",
                    JAEGER_QUERY_HTTP_ENDPOINT=f"127.0.0.1:{p['query']}",
                    JAEGER_QUERY_GRPC_ENDPOINT=f"127.0.0.1:{p['query_grpc']}",
                    JAEGER_METRICS_HOST="127.0.0.1", JAEGER_METRICS_PORT=p["metrics"])


# --- a stack in a network namespace of its own ------------------------------------------------------------------

# One client process inside the namespace answers every request of a test, one JSON line each way (a process per
# request would cost more than the request).
CLIENT = r"""
import base64, json, sys, urllib.error, urllib.request
for line in sys.stdin:
    ask = json.loads(line)
    body = base64.b64decode(ask["body"]) if ask["method"] == "POST" else None
    request = urllib.request.Request(ask["url"], data=body, method=ask["method"])
    for header in ("Content-Type", "Accept"):
        if ask.get(header):
            request.add_header(header, ask[header])
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            status, answer = response.status, response.read(ask["limit"])
    except urllib.error.HTTPError as error:
        status, answer = error.code, error.read(ask["limit"])
    except Exception as error:
        status, answer = None, repr(error).encode()
    sys.stdout.write(json.dumps({"status": status, "body": base64.b64encode(answer).decode()}) + "\n")
    sys.stdout.flush()
"""


def _netns_of(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


class Stack:
    """Processes in one private network namespace (loopback only): the first one started holds it.

    `hosts`: a hosts file that becomes the namespace's /etc/hosts (a private mount namespace beside the network
    one), so names resolve to loopback addresses the test chooses and changes (rewrite the file in place: the
    bind mount holds its inode)."""

    def __init__(self, workdir: str, nsenter=None, hosts=None):
        self.workdir = workdir
        self.procs = []  # (name, Popen, log path)
        self.nsenter = nsenter  # given: join a namespace that another holds (a deployment's)
        self.hosts = hosts
        self.client = None  # the request process inside the namespace, started at the first request

    def _own_namespace(self, argv: list) -> list:
        if self.hosts is None:
            return ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *argv]
        # unshare --mount makes every mount private to the new namespace: the host's /etc/hosts stays as it is
        return ["unshare", "--net", "--mount", "sh", "-c",
                'ip link set lo up && mount --bind "$1" /etc/hosts && shift && exec "$@"', "sh", self.hosts, *argv]

    def start(self, name: str, argv: list, env: dict) -> subprocess.Popen:
        path = os.path.join(self.workdir, f"{name}.log")
        with open(path, "w", encoding="utf-8") as log:
            if self.nsenter is None:
                # unshare without --fork: this very PID enters the new namespace and then becomes the program
                proc = start(self._own_namespace(argv), env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
                own = _netns_of(os.getpid())
                wait_until(lambda: _netns_of(proc.pid) != own, 10, 0.05, what=f"{name} in its own network namespace")
                self.nsenter = ["nsenter", f"--net=/proc/{proc.pid}/ns/net"]
                if self.hosts is not None:
                    self.nsenter.append(f"--mount=/proc/{proc.pid}/ns/mnt")
            else:
                proc = start(self.nsenter + argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.procs.append((name, proc, path))
        return proc

    def proc(self, name: str) -> subprocess.Popen:
        (proc,) = [p for n, p, _ in self.procs if n == name]
        return proc

    def log(self, name: str) -> str:
        (path,) = [p for n, _, p in self.procs if n == name]
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()

    def alive(self, name: str) -> bool:
        proc = self.proc(name)
        if proc.poll() is not None:
            raise AssertionError(f"{name} exited with {proc.returncode}:\n{self.log(name)[-4000:]}")
        return True

    def http(self, method: str, url: str, body: bytes = b"", content_type: str = "-", accept: str = "-"):
        """(status, body text) of one request made inside the namespace; None when nothing answered."""
        assert LOOPBACK_URL.match(url), url  # tests talk to loopback addresses only
        if self.client is None or self.client.poll() is not None:
            self.client = start(self.nsenter + [sys.executable, "-c", CLIENT], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        ask = {"method": method, "url": url, "body": base64.b64encode(body).decode(), "limit": MAX_BODY,
               "Content-Type": "" if content_type == "-" else content_type, "Accept": "" if accept == "-" else accept}
        self.client.stdin.write(json.dumps(ask) + "\n")
        self.client.stdin.flush()
        line = self.client.stdout.readline()  # the client's own timeout (10 s) bounds this
        answer = json.loads(line) if line else {"status": None}
        if answer["status"] is None:
            return None
        return answer["status"], base64.b64decode(answer["body"]).decode(errors="replace")

    def get_json(self, url: str):
        answer = self.http("GET", url)
        return json.loads(answer[1]) if answer and answer[0] == 200 else None

    def post_json(self, url: str, payload: bytes) -> None:
        answer = self.http("POST", url, payload, "application/json")
        assert answer is not None and answer[0] == 200, (url, answer)

    def wait_healthy(self, name: str, url: str, timeout: float = 120):
        # bounded, but generous: a loaded 2-core machine starts these slowly; a process that exits fails at once
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.alive(name)
            answer = self.http("GET", url)
            if answer is not None and answer[0] == 200:
                return
            time.sleep(0.5)
        raise AssertionError(f"{name}: no health at {url} within {timeout} s:\n{self.log(name)[-4000:]}")

    def stop(self):
        stop_all([self.client] + [proc for _, proc, _ in reversed(self.procs)])


def start_jaeger(stack: Stack, binary: str):
    stack.start("jaeger", [binary, "--config", os.path.join(COLLECTOR, "jaeger.yaml")], jaeger_env())
    stack.wait_healthy("jaeger", f"http://127.0.0.1:{JAEGER_PORTS['health']}/status")
    wait_until(lambda: stack.get_json(f"http://127.0.0.1:{JAEGER_PORTS['query']}/api/services") is not None, 60, 0.5,
               what="Jaeger's query API (/api/services)")


# --- OTLP/HTTP JSON payloads (ids in hex, 64-bit integers as strings) ------------------------------------------

def attr(key, value):
    if isinstance(value, bool):
        return {"key": key, "value": {"boolValue": value}}
    if isinstance(value, int):
        return {"key": key, "value": {"intValue": str(value)}}
    if isinstance(value, float):
        return {"key": key, "value": {"doubleValue": value}}
    return {"key": key, "value": {"stringValue": value}}


def resource(service: str, instance: str):
    return {"attributes": [attr("service.name", service), attr("service.instance.id", instance)]}


# --- reading back -------------------------------------------------------------------------------------------------

def jaeger_trace(stack: Stack, trace_id: str, min_spans: int = 1, timeout: float = 60):
    url = f"http://127.0.0.1:{JAEGER_PORTS['query']}/api/traces/{trace_id}"

    def found():
        body = stack.get_json(url)
        data = (body or {}).get("data") or []
        return data[0] if data and len(data[0]["spans"]) >= min_spans else None

    return wait_until(found, timeout, 0.5, what=f"trace {trace_id} in Jaeger ({min_spans} spans)")


def jaeger_traces(stack: Stack, services, limit: int) -> dict:
    """trace id -> the Jaeger trace, for every trace with a span of any of `services` (one search per service)."""
    found = {}
    for service in services:
        url = (f"http://127.0.0.1:{JAEGER_PORTS['query']}/api/traces?service={service}&limit={int(limit)}"
               "&lookback=1h")
        body = stack.get_json(url)
        assert body is not None, f"Jaeger's search for {service} answered nothing"
        for trace in body.get("data") or []:
            found[trace["traceID"]] = trace
    return found


def tags_of(tags) -> dict:
    return {t["key"]: t["value"] for t in tags}


SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def self_metrics(stack: Stack, url: str) -> list:
    """A Collector's own metrics (its Prometheus text exposition): [(name, labels, value)]."""
    answer = stack.http("GET", url)
    assert answer is not None and answer[0] == 200, (url, answer)
    samples = []
    for line in answer[1].splitlines():
        match = SAMPLE.match(line)
        if match and not line.startswith("#"):
            samples.append((match.group(1), dict(LABEL.findall(match.group(2) or "")), float(match.group(3))))
    return samples


def metric_sum(samples: list, name: str, **labels) -> float:
    """The sum of every series of `name` (with or without the `_total` of a counter) whose labels include
    `labels`; 0 where none exists yet (a Collector's counter is born at its first increment)."""
    names = {name, f"{name}_total"}
    return sum(value for n, have, value in samples
               if n in names and all(have.get(k) == v for k, v in labels.items()))
