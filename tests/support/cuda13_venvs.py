"""The virtualenvs of Mooncake's CUDA 13 builds (scripts/cuda13-engine-venv.sh builds them: only that build, a
stand-in CUDA driver, this checkout with its `auto` extra): where each is, whether it is whole, and the library
path its processes need."""

import functools
import os
import subprocess

# (variable naming its python, variable naming its folder, folder under the cache)
MC14 = ("KVT_MC14_PYTHON", "KVT_MC14_VENV", "mooncake-cuda13-venv")
TOKENSPEED = ("KVT_TOKENSPEED_PYTHON", "KVT_TOKENSPEED_VENV", "tokenspeed-mooncake-venv")


def python_of(venv: tuple) -> str:
    """The venv's python: the one its variable names, else the set-up script's default place."""
    python_variable, folder_variable, folder = venv
    explicit = os.environ.get(python_variable)
    if explicit:
        return explicit
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.environ.get(folder_variable) or os.path.join(cache, "otel-kvtransfer", folder),
                        "bin", "python")


def library_path(python: str) -> str:
    """The stand-in driver's and the CUDA runtime's folders, as the set-up script wrote them for the venv."""
    with open(os.path.join(os.path.dirname(os.path.dirname(python)), "kvt-ld-library-path"), encoding="utf-8") as f:
        return f.read().strip()[:4096]


@functools.lru_cache(maxsize=None)
def ready(python: str, probe: str) -> bool:
    """True when the venv's python runs `probe` (its imports) with the venv's library path."""
    if not os.path.isfile(python):
        return False
    try:
        env = dict(os.environ, LD_LIBRARY_PATH=library_path(python))
        return subprocess.run([python, "-c", probe], env=env, capture_output=True, timeout=120,
                              check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def engine_env(python: str, drop_prefixes: tuple = ("OTEL_",)) -> dict:
    """This process's environment without the variables named by `drop_prefixes`, with the venv's library path and
    Mooncake on TCP, quiet."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop_prefixes)}
    env.update({"LD_LIBRARY_PATH": library_path(python), "MC_LOG_LEVEL": "ERROR", "MC_FORCE_TCP": "1"})
    return env
