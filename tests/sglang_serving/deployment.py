"""A real sglang PD deployment on one CPU machine, instrumented at launch: prefill server + decode server (each
under `opentelemetry-instrument`), sglang-router in PD mode, optionally Phoenix (OTLP trace store) and Prometheus
(scraping every engine process), all inside ONE private network namespace (`unshare --net`, loopback up).
The KV moves over Mooncake (TCP) or, with transfer_backend="nixl", over NIXL (UCX over TCP and shared memory).

By default the pair (prefill + decode, TP1) behind one router; `Server` and `Router` describe other shapes (several
servers of a role, tensor parallelism, another model or transfer backend per server, several routers), as the
production-shapes test runs them (tests/deployments/test_sglang_shapes.py).

Used by the serving tests (tests/deployments/test_sglang_*.py, tests/deployments/test_stuck_sglang.py, one
deployment per module) and by scripts/sglang-pd.sh (`python tests/sglang_serving/deployment.py run ...`). What
cannot run here has a stand-in, named as such: an import-only `sgl_kernel` and a test-only sglang plugin
(pythonpath/ beside this file; for NIXL it also declares the KV pool DRAM, as UCX without CUDA refuses the VRAM
sglang would register; for MLA models it routes the attention to sglang's own MLA dispatch).

Every process is started in its own session, inside the namespace through `nsenter --net` (which execs, so the
PID we hold is the process itself), and stopped by its PID's process group. Every wait is bounded. Nothing
listens or sends outside 127.0.0.1 of the namespace, so the fixed ports below collide with nothing.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))  # tests/: the observability parts
from support.observability.parts import phoenix_binary, prometheus_binary, start, stop, stop_all, wait_until

MODEL_DIR = os.path.join(HERE, "model")
MLA_MODEL_DIR = os.path.join(HERE, "model_mla")  # a tiny DeepSeek-V2 (MLA); its servers need the MLA stand-in
MLA_ENV = {"KVT_TEST_MLA_ON_TORCH_NATIVE": "1"}
STAND_INS = os.path.join(HERE, "pythonpath")
NIXL_PACING = os.path.join(os.path.dirname(HERE), "nixl_pacing")  # a NIXL progress thread is not a busy core
CLIENT = os.path.join(HERE, "client.py")
DIRECT_CLIENT = os.path.join(os.path.dirname(HERE), "support", "pd_direct_client.py")

# Inside the deployment's own network namespace: nothing else listens there.
PREFILL_PORT, BOOTSTRAP_PORT, DECODE_PORT, ROUTER_PORT = 30000, 8998, 30001, 8000
PHOENIX_HTTP_PORT, PHOENIX_GRPC_PORT, PROMETHEUS_PORT = 6006, 4317, 9090
ROUTER_METRICS_PORT = 29000  # sglang-router's default
SERVER_START_S = 420  # 60-130 s on an idle 2-core machine; more when it is shared

COMMON_FLAGS = [
    "--load-format", "dummy", "--skip-tokenizer-init", "--device", "cpu", "--attention-backend", "torch_native",
    "--disable-cuda-graph", "--mem-fraction-static", "0.1", "--max-total-tokens", "16384", "--dtype", "bfloat16",
    "--host", "127.0.0.1",
]
TRANSFER_BACKENDS = ("mooncake", "nixl")
# UCX for NIXL: TCP and shared memory only (no RDMA or CUDA here); it listens on the namespace's loopback only.
NIXL_ENV = {"UCX_TLS": "tcp,self,sm", "UCX_NET_DEVICES": "lo"}
PREFILL_FLAGS = ["--disaggregation-mode", "prefill",
                 # the early cached-prefix send records a CUDA event on the forward stream under overlap scheduling
                 "--disable-overlap-schedule"]
DECODE_FLAGS = ["--disaggregation-mode", "decode", "--disaggregation-decode-retraction-backup", "cpu_tensor"]


class Server:
    """One sglang server of a deployment: its name (its log, span file and service name), its role, its ports and
    its tensor-parallel size, its own environment, model, transfer backend (else the deployment's) and flags. The
    suite's pair is Server("prefill") and Server("decode")."""

    def __init__(self, name: str, role: str = None, *, port: int = None, bootstrap_port: int = None, tp: int = 1,
                 env=None, model_dir=None, backend=None, flags=()):
        self.name = name
        self.role = role or name
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"server {name!r}: role prefill or decode, not {self.role!r}")
        self.port = port or (PREFILL_PORT if self.role == "prefill" else DECODE_PORT)
        self.bootstrap_port = (bootstrap_port or BOOTSTRAP_PORT) if self.role == "prefill" else None
        self.tp = tp
        self.env = dict(env or {})
        self.model_dir = model_dir
        if backend is not None and backend not in TRANSFER_BACKENDS:
            raise ValueError(f"server {name!r}: backend one of {TRANSFER_BACKENDS}, not {backend!r}")
        self.backend = backend
        self.flags = list(flags)  # after the deployment's own (argparse: last wins)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class Router:
    """An sglang-router in PD mode over some of the deployment's servers (by name), on its own port."""

    def __init__(self, name: str, port: int, prefills, decodes, flags=()):
        self.name, self.port = name, port
        self.prefills, self.decodes, self.flags = list(prefills), list(decodes), list(flags)


# Tensor parallelism on a CPU: sglang would build an NCCL communicator (and die: "Expected a cuda device") unless
# its NCCL library path names a file that does not load; each rank gets a core of its own.
def _tp_env(tp: int, workdir: str) -> dict:
    if tp == 1:
        return {}
    not_a_library = os.path.join(workdir, "no-nccl.so")
    if not os.path.exists(not_a_library):
        with open(not_a_library, "w", encoding="utf-8") as handle:
            handle.write("a CPU machine has no NCCL\n")
    cores = os.cpu_count() or 1
    return {"SGLANG_NCCL_SO_PATH": not_a_library,
            "SGLANG_CPU_OMP_THREADS_BIND": "|".join(str(rank % cores) for rank in range(tp))}


def model_config(model_dir: str = MODEL_DIR) -> dict:
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as handle:
        return json.load(handle)


def expected_kv_bytes(tokens: int, config: dict) -> int:
    """A TP1 -> TP1 request's KV: tokens x layers x 2 (K and V) x KV heads x head_dim x dtype bytes (MHA)."""
    return kv_bytes_between(tokens, config, 1, 0, 1, 0)


def kv_bytes_between(tokens, config, prefill_tp, prefill_rank, decode_tp, decode_rank):
    """KV bytes one prefill rank sends one decode rank for `tokens` tokens. MHA: the K and V of the heads the two
    ranks both hold (heads split evenly across each side's ranks); MLA: the whole latent (kv_lora_rank +
    qk_rope_head_dim per token and layer) to every decode rank, from a TP1 prefill (the only MLA prefill here)."""
    dtype_bytes = {"bfloat16": 2, "float16": 2, "float32": 4}[config.get("torch_dtype", "bfloat16")]
    layers = config["num_hidden_layers"]
    if "kv_lora_rank" in config:
        if prefill_tp != 1:
            raise ValueError("MLA truth is written for a TP1 prefill only")
        return tokens * layers * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * dtype_bytes
    heads = config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]

    def held(tp, rank):
        per = heads // tp
        return set(range(rank * per, (rank + 1) * per))

    shared = held(prefill_tp, prefill_rank) & held(decode_tp, decode_rank)
    return tokens * layers * 2 * len(shared) * head_dim * dtype_bytes


def _tool(name: str) -> str:
    """A console script of the interpreter's own environment (the venv's opentelemetry-instrument)."""
    path = os.path.join(os.path.dirname(sys.executable), name)
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(f"{name} not found beside {sys.executable} (run `bash scripts/setup.sh`)")
    return path


class ProcessDied(RuntimeError):
    """A process of the deployment exited while we waited for it."""


def wait_for(check, timeout: float, interval: float, what: str):
    """wait_until, except that a dead process ends the wait at once instead of at the time-out."""

    def guarded():
        try:
            return check()
        except ProcessDied as died:
            return died

    result = wait_until(guarded, timeout, interval, what=what)
    if isinstance(result, ProcessDied):
        raise result
    return result


class Deployment:
    """One deployment; `start()` brings it up (or stops everything it started and raises), `stop()` ends it.
    By default the pair (servers "prefill" and "decode", TP1) behind one router ("router"); `servers` and
    `routers` give other shapes (several servers of a role, tensor parallelism, several routers)."""

    def __init__(self, workdir=None, *, phoenix=False, prometheus=False, enable_trace=False, instrument=True,
                 prefill_env=None, extra_env=None, exporters=None, transfer_backend="mooncake", model_dir=None,
                 server_flags=(), router_flags=(), servers=None, routers=None):
        if transfer_backend not in TRANSFER_BACKENDS:
            raise ValueError(f"transfer_backend: one of {TRANSFER_BACKENDS}")
        self.transfer_backend = transfer_backend
        self.workdir = workdir or tempfile.mkdtemp(prefix="kvt-sglang-")
        os.makedirs(self.workdir, exist_ok=True)
        self.phoenix, self.prometheus, self.enable_trace = phoenix, prometheus, enable_trace
        self.instrument = instrument
        self.prefill_env = dict(prefill_env or {})
        self.extra_env = dict(extra_env or {})
        self.exporters = exporters
        # another model config (a folder with a config.json) and flags after the common ones (argparse: last wins)
        self.model_dir = model_dir or MODEL_DIR
        self.server_flags = list(server_flags)
        self.servers = {s.name: s for s in (servers or (Server("prefill"), Server("decode")))}
        self.routers = list(routers or [Router("router", ROUTER_PORT, [n for n, s in self.servers.items()
                                                                      if s.role == "prefill"],
                                               [n for n, s in self.servers.items() if s.role == "decode"])])
        for router in self.routers:
            router.flags = list(router_flags) + router.flags
            unknown = [n for n in router.prefills + router.decodes if n not in self.servers]
            if unknown:
                raise ValueError(f"router {router.name!r}: no server named {unknown}")
        self.procs = {}  # name -> Popen, in start order
        self._logs = []
        self.holder = None
        self.nsenter = None
        self.sd_dir = os.path.join(self.workdir, "prometheus-targets")

    # --- paths of what the run writes -------------------------------------------------------------------------
    def span_file(self, name: str) -> str:
        """The span file of the server called `name`."""
        return os.path.join(self.workdir, f"spans-{name}.jsonl")

    def log_path(self, name: str) -> str:
        return os.path.join(self.workdir, f"{name}.log")

    # --- processes -----------------------------------------------------------------------------------------------
    def _start(self, name, argv, env=None):
        log = open(self.log_path(name), "w", encoding="utf-8")
        self._logs.append(log)
        proc = start(self.nsenter + list(argv), env=env or os.environ.copy(), stdout=log, stderr=subprocess.STDOUT,
                     cwd=ROOT)
        self.procs[name] = proc
        return proc

    def _alive(self, name):
        proc = self.procs[name]
        if proc.poll() is not None:
            raise ProcessDied(f"{name} exited with {proc.returncode}; last log lines:\n{self.tail(name)}")

    def tail(self, name, lines=40) -> str:
        try:
            with open(self.log_path(name), encoding="utf-8", errors="replace") as handle:
                return "".join(handle.readlines()[-lines:])
        except OSError:
            return ""

    def run_in_namespace(self, argv, timeout=60, input_text=None):
        """Run argv inside the deployment's namespace; (returncode, stdout, stderr)."""
        result = subprocess.run(self.nsenter + list(argv), capture_output=True, text=True, timeout=timeout,
                                input=input_text, cwd=ROOT, check=False)
        return result.returncode, result.stdout, result.stderr

    def client(self, *args, timeout=120, input_text=None):
        """tests/sglang_serving/client.py inside the namespace; its JSON answer."""
        code, out, err = self.run_in_namespace([sys.executable, CLIENT, *args], timeout=timeout,
                                               input_text=input_text)
        if code != 0:
            raise RuntimeError(f"client {args[0]} failed ({code}): {err[-2000:]}")
        return json.loads(out)

    def http_get(self, url, params=None, timeout=30):
        return self.client("get", url, json.dumps(params or {}), timeout=timeout)

    def metrics_text(self, name):
        """The Prometheus exposition of sglang's own metrics on a server (it runs with --enable-metrics)."""
        return self.client("text", f"{self.servers[name].url}/metrics")["text"]

    def _healthy(self, name, url):
        self._alive(name)
        return self.client("ok", url, timeout=30)["ok"]

    # --- environment of the servers -------------------------------------------------------------------------------
    def server_env(self, name: str) -> dict:
        server = self.servers[name]
        env = dict(os.environ)
        env.update({
            "PYTHONPATH": os.pathsep.join(p for p in [STAND_INS, NIXL_PACING, ROOT, env.get("PYTHONPATH", "")] if p),
            "SGLANG_USE_CPU_ENGINE": "1", "MC_FORCE_TCP": "1", "MOONCAKE_PROTOCOL": "tcp",
            "SGLANG_HOST_IP": "127.0.0.1", "MC_LOG_LEVEL": env.get("MC_LOG_LEVEL", "ERROR"),
            "OTEL_SERVICE_NAME": f"sglang-{name}", "OTEL_LOGS_EXPORTER": "none",
            "OTEL_BSP_SCHEDULE_DELAY": "500",
            "OTEL_KVTRANSFER_SPAN_FILE": self.span_file(name),
            **_tp_env(server.tp, self.workdir),
        })
        if not self.instrument:  # the baseline: not even the package's sglang plugin may switch it on
            env["OTEL_PYTHON_DISABLED_INSTRUMENTATIONS"] = "kv_transfer"
            env["OTEL_TRACES_EXPORTER"] = env["OTEL_METRICS_EXPORTER"] = "none"
            return self._own_env(env, server)
        exporters = self.exporters or (["otlp", "kvtransfer_file"] if self.phoenix else ["kvtransfer_file"])
        env["OTEL_TRACES_EXPORTER"] = ",".join(exporters)
        if "otlp" in exporters:
            env.update({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{PHOENIX_GRPC_PORT}",
                        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
        if self.prometheus:
            # sglang's processes share one environment: port 0 gives each its own, and the test plugin publishes it
            env.update({"OTEL_METRICS_EXPORTER": "prometheus", "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
                        "OTEL_EXPORTER_PROMETHEUS_PORT": "0", "KVT_TEST_PROMETHEUS_SD_DIR": self.sd_dir})
        else:
            env["OTEL_METRICS_EXPORTER"] = "none"
        return self._own_env(env, server)

    def backend_of(self, name: str) -> str:
        return self.servers[name].backend or self.transfer_backend

    def _own_env(self, env, server):
        if self.backend_of(server.name) == "nixl":
            env.update(NIXL_ENV)
        env.update(self.extra_env)
        if server.role == "prefill":
            env.update(self.prefill_env)
        env.update(server.env)
        return env

    def server_argv(self, name: str):
        server = self.servers[name]
        argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", server.model_dir or self.model_dir]
        argv += COMMON_FLAGS
        argv += ["--disaggregation-transfer-backend", self.backend_of(name), "--port", str(server.port)]
        if server.role == "prefill":
            argv += PREFILL_FLAGS + ["--disaggregation-bootstrap-port", str(server.bootstrap_port)]
        else:
            argv += DECODE_FLAGS
        if server.tp > 1:
            argv += ["--tp", str(server.tp)]
        argv += self.server_flags + server.flags
        if self.enable_trace:
            argv += ["--enable-trace", "--otlp-traces-endpoint", f"127.0.0.1:{PHOENIX_GRPC_PORT}"]
        if self.instrument:
            argv = [_tool("opentelemetry-instrument")] + argv
        return argv

    # --- bring-up ------------------------------------------------------------------------------------------------
    def start(self):
        try:
            self._start_namespace()
            if self.phoenix:
                self._start_phoenix()
            if self.prometheus:
                shutil.rmtree(self.sd_dir, ignore_errors=True)
                os.makedirs(self.sd_dir)
                self._start_prometheus()
            for name in self.servers:
                self._start(name, self.server_argv(name), self.server_env(name))
            # A router's launcher imports part of sglang (10-60 s here): it starts beside the servers and waits
            # for them.
            for router in self.routers:
                self._start(router.name, self._router_argv(router))
            ports = [(name, s.port) for name, s in self.servers.items()] + [(r.name, r.port) for r in self.routers]
            for name, port in ports:
                wait_for(lambda n=name, p=port: self._healthy(n, f"http://127.0.0.1:{p}/health"),
                         SERVER_START_S, 2.0, what=f"sglang {name} healthy")
        except BaseException:
            self.stop()
            raise
        return self

    def _router_argv(self, router):
        argv = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
        for name in router.prefills:
            argv += ["--prefill", self.servers[name].url, str(self.servers[name].bootstrap_port)]
        for name in router.decodes:
            argv += ["--decode", self.servers[name].url]
        argv += ["--host", "127.0.0.1", "--port", str(router.port)]
        index = self.routers.index(router)
        if index:  # each router serves its own metrics; the first keeps sglang-router's default port
            argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(ROUTER_METRICS_PORT + index)]
        return argv + router.flags

    def _start_namespace(self):
        # The holder owns the namespace for the deployment's lifetime; unshare without --fork becomes `sleep`.
        self.holder = start(["unshare", "--net", "sh", "-c", "ip link set lo up && exec sleep 86400"])
        own = os.readlink(f"/proc/{os.getpid()}/ns/net")

        def ready():
            if self.holder.poll() is not None:
                raise RuntimeError(f"unshare --net exited with {self.holder.returncode}")
            return os.readlink(f"/proc/{self.holder.pid}/ns/net") != own and subprocess.run(
                ["nsenter", f"--net=/proc/{self.holder.pid}/ns/net", "ip", "-o", "link", "show", "lo"],
                capture_output=True, text=True, check=False).stdout.find("UP") >= 0

        wait_until(ready, 10, 0.05, what="a network namespace with loopback up")
        self.nsenter = ["nsenter", f"--net=/proc/{self.holder.pid}/ns/net"]

    def _start_phoenix(self):
        binary = phoenix_binary()
        if not binary:
            raise FileNotFoundError("arize-phoenix is not installed (bash scripts/setup-observability.sh)")
        env = {**os.environ, "PHOENIX_WORKING_DIR": os.path.join(self.workdir, "phoenix"),
               "PHOENIX_HOST": "127.0.0.1", "PHOENIX_PORT": str(PHOENIX_HTTP_PORT),
               "PHOENIX_GRPC_PORT": str(PHOENIX_GRPC_PORT), "PHOENIX_TELEMETRY_ENABLED": "false",
               "PHOENIX_ALLOW_EXTERNAL_RESOURCES": "false"}
        self._start("phoenix", [binary, "serve"], env)
        wait_for(lambda: self._healthy("phoenix", f"http://127.0.0.1:{PHOENIX_HTTP_PORT}/healthz"), 120, 1.0,
                   what="phoenix healthy")

    def _start_prometheus(self):
        binary = prometheus_binary()
        if not binary:
            raise FileNotFoundError("Debian prometheus is not installed (bash scripts/setup-observability.sh)")
        config = os.path.join(self.workdir, "prometheus.yml")
        with open(config, "w", encoding="utf-8") as out:
            out.write("global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\nscrape_configs:\n"
                      "  - job_name: sglang\n    file_sd_configs:\n"
                      f"      - files: ['{self.sd_dir}/*.json']\n        refresh_interval: 1s\n")
        self._start("prometheus", [binary, f"--config.file={config}",
                                   f"--storage.tsdb.path={os.path.join(self.workdir, 'prometheus-data')}",
                                   f"--web.listen-address=127.0.0.1:{PROMETHEUS_PORT}"])
        wait_for(lambda: self._healthy("prometheus", f"http://127.0.0.1:{PROMETHEUS_PORT}/-/ready"), 60, 0.5,
                   what="prometheus ready")

    # --- requests ------------------------------------------------------------------------------------------------
    def generate(self, requests, timeout=600, router="router"):
        """Send requests (dicts with input_ids, max_new_tokens, rid) one after another through a router,
        streaming; per request: rid, ttft_s, total_s, tokens (output token count), meta."""
        (port,) = [r.port for r in self.routers if r.name == router]
        return self.client("generate", f"http://127.0.0.1:{port}/generate", timeout=timeout,
                           input_text=json.dumps(requests))

    def generate_on(self, prefill, decode, requests, timeout=600):
        """Send requests (dicts with rid, input_ids, max_new_tokens, room) all at once straight to one prefill
        and one decode server, as a router sends them (tests/support/pd_direct_client.py); per request: room and
        each server's HTTP status."""
        code, out, err = self.run_in_namespace(
            [sys.executable, DIRECT_CLIENT, f"{self.servers[prefill].url}/generate",
             f"{self.servers[decode].url}/generate", str(self.servers[prefill].bootstrap_port)],
            timeout=timeout, input_text=json.dumps(requests))
        if code != 0:
            raise RuntimeError(f"pd_direct_client failed ({code}): {err[-2000:]}")
        return json.loads(out)

    def prometheus_query(self, expr):
        body = self.http_get(f"http://127.0.0.1:{PROMETHEUS_PORT}/api/v1/query", {"query": expr})
        return body["data"]["result"]

    def prometheus_targets(self):
        return self.http_get(f"http://127.0.0.1:{PROMETHEUS_PORT}/api/v1/targets")["data"]["activeTargets"]

    def server_pids(self, name):
        """PID of the server process and of everything it spawned (schedulers, detokenizer)."""
        import psutil

        root = psutil.Process(self.procs[name].pid)
        return [root.pid] + [c.pid for c in root.children(recursive=True)]

    # --- tear-down -----------------------------------------------------------------------------------------------
    def stop(self):
        """Stop every process by its PID (process group): the routers, then the servers side by side (their
        exporters flush on SIGTERM), then what they export to."""
        for names in ([r.name for r in self.routers], list(self.servers), ["prometheus", "phoenix"]):
            stop_all([self.procs.get(name) for name in names], timeout=30)
        for proc in self.procs.values():
            stop(proc)
        if self.holder is not None:
            stop(self.holder)
        for log in self._logs:
            log.close()
        self._logs = []


def _sigterm_as_exit(*_):
    raise SystemExit(143)


def main(argv=None) -> int:
    """`run`: start a deployment, send N requests through the router, write span files, stop everything."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run")
    run.add_argument("--out", required=True, help="folder for span files, logs and the request results")
    run.add_argument("--requests", type=int, default=8)
    run.add_argument("--tokens", type=int, default=300, help="prompt tokens per request")
    run.add_argument("--max-new-tokens", type=int, default=16)
    run.add_argument("--repeat-every", type=int, default=2,
                     help="every k-th request repeats the previous prompt (cached prefix sent early); 0: never")
    run.add_argument("--no-instrument", action="store_true", help="without opentelemetry-instrument")
    run.add_argument("--transfer-backend", choices=TRANSFER_BACKENDS, default="mooncake",
                     help="the engine that moves the KV (nixl: UCX over TCP on the loopback)")
    args = parser.parse_args(argv)
    if not (1 <= args.requests <= 1000 and 1 <= args.tokens <= 8000 and 1 <= args.max_new_tokens <= 512
            and 0 <= args.repeat_every <= 1000):
        print("sglang-pd: --requests 1..1000, --tokens 1..8000, --max-new-tokens 1..512, --repeat-every 0..1000",
              file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _sigterm_as_exit)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    deployment = Deployment(out, instrument=not args.no_instrument, transfer_backend=args.transfer_backend)
    print(f"sglang-pd: starting prefill + decode + router in a private network namespace (logs in {out}) ...",
          file=sys.stderr)
    try:
        deployment.start()
        requests = prompts(args.requests, args.tokens, args.max_new_tokens, args.repeat_every)
        results = deployment.generate(requests)
    finally:
        deployment.stop()
    with open(os.path.join(out, "requests.json"), "w", encoding="utf-8") as handle:
        json.dump(results, handle, indent=1)
    print(json.dumps({"requests": len(results), "span_files": [deployment.span_file(n) for n in deployment.servers],
                      "ttft_s": [round(r["ttft_s"], 4) for r in results]}))
    return 0


def prompts(count, tokens, max_new_tokens, repeat_every=2, seed=7, rid_prefix="kvt"):
    """`count` requests of `tokens` token ids each; every `repeat_every`-th one repeats the previous prompt."""
    import random

    rng = random.Random(seed)
    vocab = model_config()["vocab_size"]
    out, previous = [], None
    for i in range(count):
        if previous is not None and repeat_every and i % repeat_every == repeat_every - 1:
            ids = previous
        else:
            ids = [rng.randrange(3, vocab) for _ in range(tokens)]
        previous = ids
        out.append({"rid": f"{rid_prefix}-{i}", "input_ids": ids, "max_new_tokens": max_new_tokens})
    return out


if __name__ == "__main__":
    sys.exit(main())
