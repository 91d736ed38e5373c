"""Where vllm-ascend's source is for the tests (scripts/setup-vllm-ascend.sh unpacks its sdist, pinned by hash), and
the stand-in of its NPU library that goes first on the path beside it."""

import os

from support.paths import TESTS

RELEASE = "0.23.0.post1"
STANDIN = os.path.join(TESTS, "frameworks", "vllm_ascend", "standin")


def source_dir() -> str:
    """vllm-ascend's unpacked source: $KVT_VLLM_ASCEND_SRC, else the set-up script's default place."""
    explicit = os.environ.get("KVT_VLLM_ASCEND_SRC")
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return explicit or os.path.join(cache, "otel-kvtransfer", "vllm-ascend", RELEASE, "src")


def ready() -> bool:
    return os.path.isfile(os.path.join(source_dir(), ".complete"))
