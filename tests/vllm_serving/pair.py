"""One real vLLM prefill/decode pair, driven end to end; run inside a private network namespace.

    unshare --net bash -c 'ip link set lo up; exec <vllm venv python> tests/vllm_serving/pair.py \
        --connector mooncake|nixl --out DIR [--otlp-endpoint http://127.0.0.1:4317]'

Starts `python -m vllm.entrypoints.openai.api_server` twice (prefill and decode, one core each) under
`opentelemetry-instrument`, both exporting spans to files in DIR, measures the link capacity of the same engine
(the Mooncake or NIXL loopback engines of otel_kvtransfer.demo) before the servers load the machine, sends the
proxy's two requests (prefill with max_tokens 1, then decode with the prefill's kv_transfer_params) for each
prompt, scrapes both servers' /metrics, stops both servers by their PID and writes DIR/results.json. The
servers, the client and the engines all live in the namespace: several listeners bind all interfaces.
Everything waits a bounded time; a failure is written to results.json as "error" with the log tails.

With `--otlp-endpoint` (an OTLP gRPC receiver in the same namespace: the tests start the agent Collector there,
with Jaeger behind it) the servers export their spans there too, beside the span files, and vLLM traces requests
itself (`--otlp-traces-endpoint`, the same receiver). Some requests (TRACED) then come with a client's W3C
`traceparent`, sent to both servers as a proxy forwards it: vLLM's own `llm_request` span and ours join that trace.

The servers run as a user runs them: the default OpenTelemetry settings (the default builder, the
BatchSpanProcessor's default 5 s delay), stopped with SIGTERM to each API server's PID (what `kill`, docker and
systemd send) a moment after the last answer. vLLM then SIGKILLs its engine core's whole process tree at once;
what the instrumentation had not exported by then must still come out. This driver is a child subreaper: the
builder processes, which are no engine's descendants, become its children, so it waits for every process it
started (helpers included) to end before anything is read, and stops any left over by its PID.
"""

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL_DIR = os.path.join(HERE, "model")
STANDIN_DIR = os.path.join(HERE, "standin")
NIXL_PACING_DIR = os.path.join(os.path.dirname(HERE), "nixl_pacing")
MODEL_NAME = "kvt-tiny-llama"
PORTS = {"prefill": 8100, "decode": 8200}
ENGINE_IDS = {"prefill": "prefill0", "decode": "decode0"}
NIXL_SIDE_PORTS = {"prefill": 5600, "decode": 5601}
MOONCAKE_BOOTSTRAP_PORT = 8998
BLOCK_SIZE = 32
PROMPT_TOKENS = (100, 200, 300)  # 4, 7 and 10 blocks of 32 tokens, one request at a time
LAST_TOKENS = 120  # 4 blocks: NIXL's last request, after the failures and the metrics
CONCURRENT_TOKENS = (150, 250)  # 5 and 8 blocks: prefilled one by one, then decoded at the same time, so one
# decode step may ask for both at once and the Mooncake producer may send both in one engine call
START_TIMEOUT_S = 420
# Short KV leases, so the failure requests below conclude within the run: the producer frees KV nobody read
# after this long (Mooncake: VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT; NIXL: kv_lease_duration).
# A normal read takes seconds here, once NIXL's progress threads no longer busy-poll both cores (../nixl_pacing/:
# while they did, the first request took 23-34 s to reach the decode and a 30 s lease ran out in CI).
KV_TIMEOUT_S = 30
LATE_WATCH_S = 600
TRACED = (1, 4)  # with --otlp-endpoint: the requests sent with a client's traceparent (one alone, one of the two
# decoded at once); the others keep the synthetic per-key trace
LAST_ANSWER_TO_STOP_S = 1.0  # a user stops the servers right after the traffic (the recorder drains every 0.2 s)
HELPERS_END_S = 180  # the builder processes export what they hold and end (each within its own 120 s bound)
PR_SET_CHILD_SUBREAPER = 36


def kv_transfer_config(connector: str, role: str) -> dict:
    if connector == "mooncake":
        return {"kv_connector": "MooncakeConnector",
                "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
                "engine_id": ENGINE_IDS[role],
                "kv_connector_extra_config": {"mooncake_protocol": "tcp", "num_workers": 2}}
    return {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
            "engine_id": ENGINE_IDS[role], "kv_connector_extra_config": {"kv_lease_duration": KV_TIMEOUT_S}}


def server_env(connector: str, role: str, out_dir: str, otlp_endpoint=None) -> dict:
    env = dict(os.environ)
    env.update({
        "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0" if role == "prefill" else "1",
        "VLLM_LOG_STATS_INTERVAL": "2", "MC_LOG_LEVEL": "ERROR",
        # The test-only torch.accelerator stand-in (see standin/) and NIXL's paced progress thread (see
        # ../nixl_pacing/), loaded by vLLM's own plugin loader.
        "PYTHONPATH": os.pathsep.join(p for p in (STANDIN_DIR, NIXL_PACING_DIR, env.get("PYTHONPATH", "")) if p),
        "OTEL_SERVICE_NAME": f"vllm-{role}", "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none",
    })
    for name in [n for n in env if n.startswith(("OTEL_BSP_", "OTEL_KVTRANSFER_"))]:
        del env[name]  # the defaults, as a user has them (the span file is set below)
    if _has_file_exporter():
        env["OTEL_TRACES_EXPORTER"] = "kvtransfer_file"
        env["OTEL_KVTRANSFER_SPAN_FILE"] = os.path.join(out_dir, f"spans-{role}.jsonl")
    else:  # until the span-file exporter lands: console JSON on stdout, parsed from the log
        env["OTEL_TRACES_EXPORTER"] = "console"
    for name in [n for n in env if n.startswith("OTEL_EXPORTER_OTLP_")]:
        del env[name]
    if otlp_endpoint:  # the span files stay the reference; the same spans go to the Collector as well
        env["OTEL_TRACES_EXPORTER"] += ",otlp"
        env.update({"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    if connector == "mooncake":
        env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(MOONCAKE_BOOTSTRAP_PORT)
        env["VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"] = str(KV_TIMEOUT_S)
    else:
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(NIXL_SIDE_PORTS[role])
        # The orphan's expired serve waits for the late read (run_late_read) however slow this machine is: the
        # prefill only sees it at its next engine step, tens of seconds after the lease ran out. Held spans are
        # exported when the servers stop.
        env["OTEL_KVTRANSFER_LATE_WATCH_S"] = str(LATE_WATCH_S)
    return env


def _has_file_exporter() -> bool:
    try:
        import otel_kvtransfer.building.file_exporter  # noqa: F401  imported only to see that it loads
    except Exception:
        return False
    return True


def server_command(connector: str, role: str, otlp_endpoint=None) -> list:
    instrument = os.path.join(os.path.dirname(sys.executable), "opentelemetry-instrument")
    # vLLM keeps a request's traceparent and exports its own llm_request span only when it traces itself
    tracing = ["--otlp-traces-endpoint", otlp_endpoint] if otlp_endpoint else []
    return [instrument, sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--host", "127.0.0.1", "--port", str(PORTS[role]), "--model", MODEL_DIR,
            "--served-model-name", MODEL_NAME, "--load-format", "dummy", "--skip-tokenizer-init",
            "--enforce-eager", "--max-model-len", "512", "--max-num-seqs", "4", "--dtype", "bfloat16",
            "--block-size", str(BLOCK_SIZE), "--kv-transfer-config", json.dumps(kv_transfer_config(connector, role)),
            *tracing]


def _http(method: str, url: str, body=None, timeout_s: float = 120.0, trace=None):
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if trace:  # the client's span: sampled (flags 01), as a traced client sends it
        headers["traceparent"] = f"00-{trace['trace_id']}-{trace['span_id']}-01"
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        raw = response.read(8 << 20)
    return raw.decode("utf-8", "replace")


def _wait_healthy(role: str, process, log_path: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the {role} server exited with {process.returncode}: {_tail(log_path)}")
        try:
            _http("GET", f"http://127.0.0.1:{PORTS[role]}/health", timeout_s=5)
            return
        except OSError:
            time.sleep(2)
    raise RuntimeError(f"the {role} server was not healthy within {START_TIMEOUT_S} s: {_tail(log_path)}")


def _tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return "".join(handle.readlines()[-lines:])
    except OSError:
        return ""


def prompt(tokens: int, seed: int) -> list:
    return [(7 + seed * 131 + i * 17) % 1000 + 3 for i in range(tokens)]


def client_trace(index: int, traced: bool):
    """The ids of the client's span a TRACED request is sent under (random, as a client makes them); else None."""
    if not traced or index not in TRACED:
        return None
    return {"trace_id": os.urandom(16).hex(), "span_id": os.urandom(8).hex()}


def prefill_step(connector: str, index: int, tokens: int, traced: bool = False) -> dict:
    """The proxy's first step: prefill only (max_tokens 1), keeping the KV for a remote decode."""
    transfer_id = f"kvt-{connector}-{index}"
    trace = client_trace(index, traced)
    prefill_params = {"do_remote_decode": True}
    if connector == "mooncake":
        prefill_params["transfer_id"] = transfer_id
    started = time.time()
    prefill = json.loads(_http("POST", f"http://127.0.0.1:{PORTS['prefill']}/v1/completions", {
        "model": MODEL_NAME, "prompt": prompt(tokens, index), "max_tokens": 1,
        "kv_transfer_params": prefill_params}, trace=trace))
    return {"index": index, "prompt_tokens": tokens, "transfer_id": transfer_id, "started": started,
            "client_trace": trace,
            "prefill_response_id": prefill.get("id"),
            "prefill_kv_transfer_params": prefill.get("kv_transfer_params") or {}}


def decode_step(connector: str, request: dict) -> None:
    """The proxy's second step: decode with the KV of the prefill step."""
    if connector == "mooncake":
        decode_params = {"do_remote_prefill": True, "remote_engine_id": ENGINE_IDS["prefill"],
                         "remote_bootstrap_addr": f"http://127.0.0.1:{MOONCAKE_BOOTSTRAP_PORT}",
                         "transfer_id": request["transfer_id"]}
    else:
        decode_params = dict(request["prefill_kv_transfer_params"])
    decode = json.loads(_http("POST", f"http://127.0.0.1:{PORTS['decode']}/v1/completions", {
        "model": MODEL_NAME, "prompt": prompt(request["prompt_tokens"], request["index"]), "max_tokens": 4,
        "kv_transfer_params": decode_params}, trace=request.get("client_trace")))
    request["decode_response_id"] = decode.get("id")
    request["decode_finish_reason"] = str((decode.get("choices") or [{}])[0].get("finish_reason"))[:64]


def run_request(connector: str, index: int, tokens: int, traced: bool = False) -> dict:
    request = prefill_step(connector, index, tokens, traced)
    decode_step(connector, request)
    return request


def run_concurrent(connector: str, first_index: int, traced: bool = False) -> list:
    requests = [prefill_step(connector, first_index + i, tokens, traced) for i, tokens in enumerate(CONCURRENT_TOKENS)]
    errors = []

    def decode(request):
        try:
            decode_step(connector, request)
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    def keep_decode_busy():  # a local request running on decode, so the pair's arrivals queue up behind a step
        try:
            _http("POST", f"http://127.0.0.1:{PORTS['decode']}/v1/completions", {
                "model": MODEL_NAME, "prompt": prompt(400, 77), "max_tokens": 48})
        except OSError as exc:
            errors.append(f"busy request: {type(exc).__name__}: {exc}")

    busy = threading.Thread(target=keep_decode_busy)
    busy.start()
    time.sleep(0.5)
    threads = [threading.Thread(target=decode, args=(r,)) for r in requests]
    threads.append(busy)
    for thread in threads[:-1]:
        thread.start()
    for thread in threads:
        thread.join(300)
    if errors or any(t.is_alive() for t in threads):
        raise RuntimeError(f"concurrent decode failed: {errors[:2]}")
    for request in requests:
        request["concurrent"] = True
    return requests


def run_failures(connector: str) -> dict:
    """Requests whose KV transfer cannot complete, concluded by vLLM's own timeouts.

    - an orphan prefill (do_remote_decode, no decode ever asks): the producer frees its KV after the lease, so
      Mooncake's request span and NIXL's serve span end ERROR `expired`;
    - Mooncake only, a ghost decode (a transfer_id no prefill ever had): the producer answers the decode's pull
      with an error after its timeout, so the decode's receive span ends ERROR `transfer_failed`.
    """
    ids = prompt(64, 99)
    failures = {}
    params = {"do_remote_decode": True}
    if connector == "mooncake":
        params["transfer_id"] = failures["orphan_transfer_id"] = f"kvt-{connector}-orphan"
    orphan = json.loads(_http("POST", f"http://127.0.0.1:{PORTS['prefill']}/v1/completions", {
        "model": MODEL_NAME, "prompt": ids, "max_tokens": 1, "kv_transfer_params": params}))
    lease_over = time.monotonic() + KV_TIMEOUT_S + 5  # the orphan's lease runs out; the next engine steps reap it
    failures["orphan_prefill_response_id"] = orphan.get("id")
    failures["orphan_kv_transfer_params"] = orphan.get("kv_transfer_params") or {}
    if connector == "mooncake":
        failures["ghost_transfer_id"] = ghost = f"kvt-{connector}-ghost"
        try:
            _http("POST", f"http://127.0.0.1:{PORTS['decode']}/v1/completions", {
                "model": MODEL_NAME, "prompt": ids, "max_tokens": 1, "kv_transfer_params": {
                    "do_remote_prefill": True, "remote_engine_id": ENGINE_IDS["prefill"],
                    "remote_bootstrap_addr": f"http://127.0.0.1:{MOONCAKE_BOOTSTRAP_PORT}", "transfer_id": ghost}},
                timeout_s=KV_TIMEOUT_S * 6)
            failures["ghost_answer"] = "completed"
        except OSError as exc:  # vLLM answers a failed KV load with an error (kv_load_failure_policy=fail)
            failures["ghost_answer"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    time.sleep(max(0.0, lease_over - time.monotonic()))  # the ghost's wait above is most of it
    return failures


def run_late_read(failures: dict) -> dict:
    """NIXL: a decode that reads the orphan's KV after the prefill freed it, as one does when its read outlived the
    lease or the router did not forward the KV's expiry (vLLM then reads as usual). The decode cannot tell; the
    prefill can: the decode's completion notice names a request it no longer has, which vLLM logs and counts
    (`record_notification_after_expiry`) at the prefill's next engine step (the last request's)."""
    params = {name: value for name, value in failures["orphan_kv_transfer_params"].items()
              if name != "remote_blocks_expiry_time"}
    started = time.time()
    decode = json.loads(_http("POST", f"http://127.0.0.1:{PORTS['decode']}/v1/completions", {
        "model": MODEL_NAME, "prompt": prompt(64, 99), "max_tokens": 1, "kv_transfer_params": params}))
    return {"started": started, "decode_response_id": decode.get("id"), "key": params.get("remote_request_id")}


def link_capacity(connector: str) -> float:
    """Bytes/s of plain engine writes between two processes on 127.0.0.1, before any server loads the CPUs."""
    import numpy as np

    from otel_kvtransfer.demo import measure_link_capacity

    if connector == "mooncake":
        from otel_kvtransfer.demo.loopback import Receiver, open_engine
    else:
        from otel_kvtransfer.demo.nixl_loopback import Receiver, open_engine
    size = 64 << 20
    with Receiver(size, env={"MC_FORCE_TCP": "1"}) as receiver:
        engine = open_engine()
        src = np.ones(size, dtype=np.uint8)
        if engine.register_memory(src.ctypes.data, src.nbytes) != 0:
            raise RuntimeError("register_memory failed")
        return measure_link_capacity(engine, receiver, src.ctypes.data, size)


def stop(processes, timeout_s: float = 60.0) -> None:
    """SIGTERM to each API server's PID at once, as a user stops them; what is left of a group is killed."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)  # vLLM stops (and kills) its engine-core and worker processes
    deadline = time.monotonic() + timeout_s
    for process in processes:
        try:
            process.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            pass
        _kill_group(process)


def _kill_group(process) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)  # a straggler of its group (the server has ended or hangs)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait(10)


def become_subreaper() -> bool:
    """Orphans of the processes this driver starts (the builder processes) become its children."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _children() -> list:
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii") as handle:
                fields = handle.read().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == os.getpid():
            found.append(int(entry))
    return found


def await_every_child(timeout_s: float, own: set) -> list:
    """Reap every child but this driver's `own` (its multiprocessing helpers), the builder processes adopted here
    included, until none is left or `timeout_s`; the PIDs of those left then, killed."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [pid for pid in _children() if pid not in own]
        if not left or time.monotonic() >= deadline:
            break
        for pid in left:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        time.sleep(0.1)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connector", choices=("mooncake", "nixl"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--skip-capacity", action="store_true")
    parser.add_argument("--otlp-endpoint", default=None,
                        help="an OTLP gRPC receiver (http://127.0.0.1:PORT) the servers and vLLM's tracing export to")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = {"connector": args.connector, "model_dir": MODEL_DIR, "block_size": BLOCK_SIZE, "requests": [],
               "subreaper": become_subreaper()}
    processes, own = {}, set()
    try:
        if not args.skip_capacity:
            results["link_capacity_bytes_per_s"] = link_capacity(args.connector)
        own = set(_children())  # multiprocessing's resource tracker: this driver's, ends with it
        for role in ("prefill", "decode"):
            log_path = os.path.join(args.out, f"{role}.log")
            with open(log_path, "wb") as log:
                processes[role] = subprocess.Popen(
                    server_command(args.connector, role, args.otlp_endpoint),
                    env=server_env(args.connector, role, args.out, args.otlp_endpoint),
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        for role in ("prefill", "decode"):
            _wait_healthy(role, processes[role], os.path.join(args.out, f"{role}.log"))
        results["server_pids"] = {role: p.pid for role, p in processes.items()}
        traced = bool(args.otlp_endpoint)
        for index, tokens in enumerate(PROMPT_TOKENS):
            results["requests"].append(run_request(args.connector, index, tokens, traced))
            time.sleep(3)  # one request per stats interval (VLLM_LOG_STATS_INTERVAL=2)
        results["requests"].extend(run_concurrent(args.connector, len(PROMPT_TOKENS), traced))
        time.sleep(3)
        results["failures"] = run_failures(args.connector)
        time.sleep(3)  # the last stats line
        results["metrics"] = {role: _http("GET", f"http://127.0.0.1:{PORTS[role]}/metrics", timeout_s=30)
                              for role in processes}
        if args.connector == "nixl":  # one more request, whose spans are the newest when the servers stop (vLLM's
            results["late_read"] = run_late_read(results["failures"])  # (its prefill step sees the late read)
            last = run_request(args.connector, len(results["requests"]), LAST_TOKENS)  # figures above omit it)
            last["after_failures"] = True
            results["requests"].append(last)
        time.sleep(LAST_ANSWER_TO_STOP_S)
    except Exception as exc:
        results["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        stop(list(processes.values()))
        results["left_running"] = await_every_child(HELPERS_END_S, own)
        with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=1)
    return 1 if "error" in results else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # NIXL/UCX teardown at interpreter exit can crash after a transfer (the capacity measurement's agent);
    # everything is written by now.
    os._exit(code)
