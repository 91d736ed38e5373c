"""Runs one real vLLM prefill/decode pair (tests/vllm_serving/pair.py) in a private network namespace and reads
back what it left: results.json, the span files of both servers, vLLM's own figures (its /metrics text and the
"KV Transfer metrics" log lines).

The pair runs from the vLLM virtualenv (`bash scripts/setup-vllm.sh` builds it; `KVT_VLLM_PYTHON` names its
python, default: the venv that script builds). Everything read back is bounded and parsed defensively.
"""

import functools
import json
import math
import os
import re
import subprocess

from support import netns
from support.paths import ROOT

HERE = os.path.dirname(os.path.abspath(__file__))
PAIR = os.path.join(HERE, "pair.py")
MODEL_CONFIG = os.path.join(HERE, "model", "config.json")
RUN_TIMEOUT_S = 1200
_MAX_LOG = 16 << 20


def vllm_python() -> str:
    explicit = os.environ.get("KVT_VLLM_PYTHON")
    if explicit:
        return explicit
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    venv = os.environ.get("KVT_VLLM_VENV") or os.path.join(cache, "otel-kvtransfer", "vllm-venv")
    return os.path.join(venv, "bin", "python")


@functools.lru_cache(maxsize=None)
def vllm_ready(python: str) -> bool:
    """The venv has vLLM, Mooncake, NIXL and this package (vLLM itself is found, not imported: that takes ~30 s)."""
    if not os.path.isfile(python):
        return False
    probe = ("import importlib.util, mooncake.engine, nixl._api, otel_kvtransfer\n"
             "assert importlib.util.find_spec('vllm') is not None")
    try:
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=300, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def run_pair(python: str, connector: str, out_dir: str, nsenter=None, otlp_endpoint=None) -> dict:
    """Run the pair end to end (servers stopped before this returns); results.json as a dict.

    In a private network namespace of its own, or, with `nsenter` (the command that joins one), in that one: where
    the tests' agent Collector listens at `otlp_endpoint`, which the servers then export to as well."""
    # This checkout's package first: the venv's own install of it may point at another clone.
    env = netns.with_pythonpath(dict(os.environ), ROOT)
    argv = [python, PAIR, "--connector", connector, "--out", out_dir]
    if otlp_endpoint:
        argv += ["--otlp-endpoint", otlp_endpoint]
    with open(os.path.join(out_dir, "driver.log"), "wb") as log:
        completed = subprocess.run(list(nsenter) + argv if nsenter else netns.private_net(argv),
                                   env=env, stdout=log, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S,
                                   check=False)
    path = os.path.join(out_dir, "results.json")
    if not os.path.exists(path):
        return {"error": f"the pair driver exited with {completed.returncode} and wrote no results "
                         f"(see {os.path.join(out_dir, 'driver.log')})"}
    with open(path, encoding="utf-8") as handle:
        results = json.load(handle)
    return results if isinstance(results, dict) else {"error": "results.json is not an object"}


def block_bytes(block_size: int) -> int:
    """Bytes of one KV block of the test model across all layers: layers x (K, V) x tokens x KV heads x head
    dim x dtype size, from the model's config.json."""
    with open(MODEL_CONFIG, encoding="utf-8") as handle:
        config = json.load(handle)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    dtype_size = {"bfloat16": 2, "float16": 2, "float32": 4}[config.get("torch_dtype", "bfloat16")]
    return config["num_hidden_layers"] * 2 * block_size * config["num_key_value_heads"] * head_dim * dtype_size


def blocks_of(prompt_tokens: int, block_size: int) -> int:
    return math.ceil(prompt_tokens / block_size)


def read_log(path: str) -> str:
    with open(path, "rb") as handle:
        return handle.read(_MAX_LOG).decode("utf-8", "replace")


_KV_LINE = re.compile(r"KV Transfer metrics: Num successful transfers=(\d{1,9}), .*?"
                      r"Avg MB per transfer=([0-9.]{1,20}), Throughput \(MB/s\)=([0-9.]{1,20})")


def kv_transfer_metric_lines(log_text: str) -> list:
    """vLLM's periodic Mooncake figures: [(transfers, avg MiB per transfer, MiB/s over the interval)]."""
    return [(int(n), float(avg), float(rate)) for n, avg, rate in _KV_LINE.findall(log_text)]


# vLLM NIXL prefill's own lines: a request whose lease ran out before every decode had read its KV, and a read of
# KV it had already released (the decode's notice names a request the prefill no longer knows).
_EXPIRED_LINE = re.compile(r"Releasing expired KV blocks for request (\S{1,200}) which were retrieved")
_LATE_READ_LINE = re.compile(r"invalid KV blocks for unrecognized request (\S{1,200}) were retrieved")


def expired_requests(log_text: str) -> set:
    """The requests vLLM's NIXL prefill says it released because their lease expired."""
    return set(_EXPIRED_LINE.findall(log_text))


def late_read_requests(log_text: str) -> set:
    """The requests vLLM's NIXL prefill says a decode read after it had released their KV."""
    return set(_LATE_READ_LINE.findall(log_text))


def prometheus_value(text: str, name: str) -> float:
    """Sum of every sample of `name` (any labels) in Prometheus text exposition."""
    total = 0.0
    pattern = re.compile(r"^" + re.escape(name) + r"(?:\{[^}\n]{0,2000}\})? ([-+0-9.eE]{1,40})$", re.M)
    for value in pattern.findall(text):
        total += float(value)
    return total
