"""The release canary: the newest release of each instrumented library, from the package registry, checked
against what the wrappers patch and read, statically: the next release that breaks a wrapper fails the day it is
published, long before anyone runs it.

For each library: `pip index versions --only-binary=:all: --python-version X.Y`, asked for every Python this package
declares (pyproject.toml's requires-python, up to NEWEST_PYTHON), names the newest release with a wheel for any of
them (a build may be published for one Python only: mooncake-transfer-engine-musa 0.3.13.post1 is for 3.10 alone,
while 3.11 and later see only its 0.0.0.1); `pip download --no-deps --only-binary=:all: --python-version X.Y`
fetches that release's wheel for one of those Pythons (never installed, never imported by the canary; no CUDA
stack comes along); its Python files are unpacked into a cache outside the clone, keyed by version, and the wheel
is deleted; the targets are checked on the source with `otel_kvtransfer.wiring.targets.missing_in_source` (ast).
vLLM's targets are the ones its gate checks at run time (otel_kvtransfer/frameworks/vllm/targets.py); sglang's and
the engines' are declared below and kept in step with their patch functions by tests/project/test_version_canary.py.
Mooncake's engine is a compiled extension: its method names are looked up in the binary's string table (pybind11
keeps them there).

vllm-ascend (vLLM's Ascend NPU plugin, whose own Mooncake connectors otel_kvtransfer/frameworks/vllm_ascend wraps)
publishes some releases as an sdist only (0.23.0.post1; its wheels stop at 0.23.0): its newest release is asked for
any kind of distribution, and one without a wheel is read from its sdist. pip fetches that with `pip download
--no-binary :all: --no-build-isolation`, which runs the sdist's metadata step (never a build) in a small virtualenv
of the canary's own (setuptools, setuptools-scm); the Python files and PKG-INFO are unpacked, the sdist deleted.

Every published build of each engine is read, its newest release each (the build names are the engine modules'
DISTRIBUTIONS): Mooncake's ten (CUDA 12, CPU, CUDA 13, three EFA, ROCm, NPU, MUSA, TokenSpeed's fork), each wheel's
own compiled engine; NIXL's three (`nixl` chooses a build at import time: its code is the `nixl-cu12` release of
the same number; `nixl-cu12` and `nixl-cu13` are read as they are). A build whose newest release lies below the
engine's supported range is said so in its line and is no failure: `instruments-any` asks for the range's minimum,
so such a release never switches the instrumentation on (a placeholder release that installs no `mooncake` package
at all, as mooncake-transfer-engine-musa 0.0.0.1 is, says in its line that it holds no engine).

    python tests/support/version_canary.py [--only NAME ...] [--version NAME==X.Y.Z ...]

One line per library, naming the Pythons its release has wheels for; exit 1 when a required target is missing, or
when a build has no wheel for any declared Python. A registry that cannot be reached is said in one line and fails
only under CI=true. Cache: $KVT_CANARY_CACHE, default
${XDG_CACHE_HOME:-~/.cache}/otel-kvtransfer/canary/<distribution>/<version>/.
"""

import argparse
import ast
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))  # the checkout: its package is the one checked
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from otel_kvtransfer.engines import mooncake as mooncake_engine
from otel_kvtransfer.engines import nixl as nixl_engine
from otel_kvtransfer.wiring.targets import Target, missing_in_source

PIP_TIMEOUT_S = 60  # per pip command (the biggest wheel, vLLM's, is ~340 MB)
NEWEST_PYTHON = (3, 15)  # the newest CPython release line: raise it when the next one is out
_VERSION = re.compile(r"^[0-9][0-9A-Za-z.+!-]{0,40}$")
_MAX_SOURCE = 8 << 20  # bytes of one source file read for the check

_SG = "sglang.srt.disaggregation"
SGLANG_TARGETS = [
    Target(f"{_SG}.common.conn", "CommonKVManager", "update_status"),
    Target(f"{_SG}.common.conn", "CommonKVManager", "conclude_transfer"),
    Target(f"{_SG}.common.conn", "CommonKVSender", "__init__"),
    Target(f"{_SG}.common.conn", "CommonKVSender", "clear"),
    Target(f"{_SG}.common.conn", "CommonKVReceiver", "__init__"),
    Target(f"{_SG}.common.conn", "CommonKVReceiver", "send_metadata"),
    Target(f"{_SG}.common.conn", "CommonKVReceiver", "poll"),
    Target(f"{_SG}.common.conn", "CommonKVReceiver", "abort"),
    Target(f"{_SG}.common.conn", "CommonKVManager", "try_ensure_parallel_info"),  # the decode's set-up steps
    Target(f"{_SG}.common.conn", "CommonKVReceiver", "_get_bootstrap_info_from_server"),
    Target(f"{_SG}.common.conn", "CommonKVReceiver", "_register_kv_args"),
    Target(f"{_SG}.common.utils", "FastQueue", "put"),
    Target(f"{_SG}.common.utils", "FastQueue", "get"),
    Target(f"{_SG}.mooncake.conn", "MooncakeKVManager", "__init__"),  # its rank: the start-up line
    Target(f"{_SG}.mooncake.conn", "MooncakeKVManager", "send_kvcache"),
    Target(f"{_SG}.mooncake.conn", "MooncakeKVManager", "send_kvcache_slice"),
    Target(f"{_SG}.mooncake.conn", "MooncakeKVManager", "send_kvcache_dcp"),
    Target(f"{_SG}.mooncake.conn", "MooncakeKVManager", "_do_staging_transfer"),
    Target(f"{_SG}.mooncake.conn", "MooncakeKVManager", "maybe_send_extra"),
    Target(f"{_SG}.mooncake.conn", "MooncakeKVManager", "send_aux"),
    Target(f"{_SG}.mooncake.conn", "MooncakeKVManager", "add_transfer_request"),
    Target(f"{_SG}.mooncake.conn", "MooncakeKVManager", "send_aux_data_to_endpoint"),
    Target(f"{_SG}.nixl.conn", "NixlKVManager", "__init__"),
    Target(f"{_SG}.nixl.conn", "NixlKVManager", "send_kvcache"),
    Target(f"{_SG}.nixl.conn", "NixlKVManager", "send_kvcache_slice"),
    Target(f"{_SG}.nixl.conn", "NixlKVManager", "send_kvcache_mixed"),
    Target(f"{_SG}.nixl.conn", "NixlKVManager", "send_kvcache_dcp"),
    Target(f"{_SG}.nixl.conn", "NixlKVManager", "_do_staging_transfer"),
    Target(f"{_SG}.nixl.conn", "NixlKVManager", "maybe_send_extra"),
    Target(f"{_SG}.nixl.conn", "NixlKVManager", "send_aux"),
    Target(f"{_SG}.nixl.conn", "NixlKVManager", "add_transfer_request"),
    # classes the sglang package registers by role (not wrapped: their presence is what it needs)
    Target(f"{_SG}.mooncake.conn", "MooncakeKVSender"),
    Target(f"{_SG}.mooncake.conn", "MooncakeKVReceiver"),
    Target(f"{_SG}.nixl.conn", "NixlKVSender"),
    Target(f"{_SG}.nixl.conn", "NixlKVReceiver"),
    Target(f"{_SG}.prefill", "SchedulerDisaggregationPrefillMixin", "maybe_send_cached_prefix_chunk"),
    Target(f"{_SG}.prefill", "PrefillBootstrapQueue", "create_sender"),
    Target(f"{_SG}.decode", "DecodePreallocQueue", "_create_receiver_and_enqueue"),
    Target(f"{_SG}.decode", "DecodePreallocQueue", "_ensure_prefill_info"),
    # the decode's KV checksum (integrity.py): is it on, the digest taken, the verdict, a mismatch
    Target(f"{_SG}.decode", "DecodePreallocQueue", "__init__"),
    Target(f"{_SG}.decode", "DecodeTransferQueue", "_commit_transfer_to_req"),
    Target(f"{_SG}.decode", "SchedulerDisaggregationDecodeMixin", "_verify_kv_checksums"),
    Target(f"{_SG}.decode", "SchedulerDisaggregationDecodeMixin", "_handle_kv_checksum_mismatch"),
    Target("sglang.srt.mem_cache.storage.nixl.hicache_nixl", "HiCacheNixl", "_xfer_and_wait"),  # HiCache's offload
    Target("sglang.srt.managers.scheduler", "Scheduler", "run_batch"),
]

_NX = "nixl._api"
NIXL_TARGETS = [
    Target(_NX, "nixl_agent", "prep_xfer_dlist", ("agent_name", "xfer_list")),
    Target(_NX, "nixl_agent", "make_prepped_xfer", ("operation", "local_xfer_side", "local_indices",
                                                    "remote_xfer_side", "remote_indices", "notif_msg")),
    Target(_NX, "nixl_agent", "initialize_xfer", ("operation", "local_descs", "remote_descs", "remote_agent",
                                                  "notif_msg")),
    Target(_NX, "nixl_agent", "transfer", ("handle",)),
    Target(_NX, "nixl_agent", "check_xfer_state", ("handle",)),
    Target(_NX, "nixl_xfer_handle", "release", (), ("_agent", "_handle")),
    Target(_NX, "nixl_prepped_dlist_handle", "release", (), ("_agent", "_handle")),
]

# Mooncake's TransferEngine methods the engine module replaces (a compiled class: names only). Required: what every
# 0.3 release has; optional: the rest of what the engine module times where a build has it (0.3.14's arrays, pages
# and scatter calls, the CUDA builds' *_on_cuda calls), taken from the module so the two cannot drift apart.
MOONCAKE_METHODS = ("initialize", "transfer_sync_write", "transfer_sync_read", "batch_transfer_sync_write",
                    "batch_transfer_sync_read", "batch_transfer_async_write", "batch_transfer_async_read",
                    "transfer_check_status", "get_batch_transfer_status", "register_memory")
MOONCAKE_OPTIONAL = ("initialize_ext", "transfer_sync", "batch_transfer_sync", "transfer_submit_write",
                     "batch_transfer_async", "batch_register_memory", "batch_unregister_memory",
                     *sorted(mooncake_engine.timed_calls() - {"initialize_ext", "transfer_sync", "batch_transfer_sync",
                                                              "transfer_submit_write", "batch_transfer_async",
                                                              *MOONCAKE_METHODS}))


def _vllm_ascend_targets() -> List[Target]:
    from otel_kvtransfer.frameworks.vllm_ascend import targets

    return targets.ALL


def _vllm_targets() -> List[Target]:
    from otel_kvtransfer.frameworks.vllm import targets

    return targets.ALL + targets.PAYLOAD_TARGETS  # the KV connectors', then the traffic that is not KV (optional)


@dataclass
class Library:
    name: str  # the distribution the registry is asked about
    code: str  # the distribution whose wheel holds the code (the same release when it is published)
    targets: Callable[[], List[Target]] = list
    aliases: Dict[str, str] = field(default_factory=dict)  # module prefix -> where its code lives
    binary: Optional[Tuple[str, Tuple[str, ...], Tuple[str, ...]]] = None  # (file pattern, required, optional)
    supported: Optional[str] = None  # an engine's supported range: a newest release below it is not checked
    # Set for a library that publishes releases as an sdist only: the environment its metadata step needs (the
    # newest release is then asked for any kind of distribution, and one without a wheel is read from its sdist).
    sdist_env: Optional[Dict[str, str]] = None


def _nixl_build(name: str) -> Library:
    """`nixl-cuXY` holds its code as the module `nixl_cuXY` (nixl._api is nixl_cuXY._api there); the plain `nixl`
    only chooses a build at import time, and is checked through `nixl-cu12`'s code of its release."""
    code = "nixl-cu12" if name == "nixl" else name
    return Library(name, code, lambda: NIXL_TARGETS, aliases={"nixl._api": code.replace("-", "_") + "._api"},
                   supported=nixl_engine.SUPPORTED)


LIBRARIES = {
    "vllm": Library("vllm", "vllm", _vllm_targets),
    "sglang": Library("sglang", "sglang", lambda: SGLANG_TARGETS),
    # Its setup.py asks `npu-smi` for the chip unless SOC_VERSION names one (its metadata step needs nothing else).
    "vllm-ascend": Library("vllm-ascend", "vllm-ascend", _vllm_ascend_targets,
                           sdist_env={"SOC_VERSION": "ascend910b1"}),
    **{name: Library(name, name, binary=(r"^mooncake/engine[^/]*\.so$", MOONCAKE_METHODS, MOONCAKE_OPTIONAL),
                     supported=mooncake_engine.SUPPORTED) for name in mooncake_engine.DISTRIBUTIONS},
    **{name: _nixl_build(name) for name in nixl_engine.DISTRIBUTIONS},
}


def below_supported(library: Library, version: str) -> bool:
    """The release lies below the engine's supported range: `instruments-any` (its minimum) never switches the
    instrumentation on for it."""
    if not library.supported:
        return False
    minimum = [part.strip()[2:].strip() for part in library.supported.split(",") if part.strip().startswith(">=")]
    try:
        return bool(minimum) and Version(version) < Version(minimum[0])
    except InvalidVersion:
        return False


class RegistryUnreachable(Exception):
    pass


def cache_root() -> str:
    explicit = os.environ.get("KVT_CANARY_CACHE")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "otel-kvtransfer", "canary")


def _pip(*args: str, timeout_s: float = PIP_TIMEOUT_S * 10) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "--timeout", "20",
               "--retries", "1"]
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as error:
        raise RegistryUnreachable(f"pip {args[0]} took longer than {timeout_s:.0f} s") from error


def declared_pythons() -> List[str]:
    """Every Python release line this package declares it runs on (pyproject.toml's requires-python), from its
    minimum up to NEWEST_PYTHON, or the running one where that is newer."""
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as handle:
        found = re.search(r'^requires-python\s*=\s*"([^"]+)"', handle.read(), re.MULTILINE)
    if not found:
        raise ValueError("pyproject.toml declares no requires-python")
    declared = SpecifierSet(found.group(1))
    newest = max(NEWEST_PYTHON, tuple(sys.version_info[:2]))
    return [f"3.{minor}" for minor in range(newest[1] + 1) if f"3.{minor}" in declared]


# What pip prints when it reached the registry and found nothing for that Python, and what it prints when it did not
# reach it (a connection that failed is retried, a page that could not be read is said).
_NO_WHEEL = "No matching distribution found"
_NOT_REACHED = ("Retrying", "Could not fetch URL", "NewConnectionError", "timed out")


def releases(distribution: str, python: str) -> List[str]:
    """The releases on the registry with a wheel for Python `python` (X.Y) on this platform, newest first (`pip index
    versions`, the ordinary client); empty when there is none for that Python."""
    done = _pip("index", "versions", distribution, "--only-binary=:all:", "--python-version", python,
                timeout_s=PIP_TIMEOUT_S)
    found = re.search(r"^Available versions: (.+)$", done.stdout, re.MULTILINE)
    if done.returncode == 0 and found:
        return [v.strip() for v in found.group(1).split(",") if _VERSION.match(v.strip())][:1000]
    if _NO_WHEEL in done.stderr and not any(sign in done.stderr for sign in _NOT_REACHED):
        return []
    last = (done.stderr.strip().splitlines() or ["no answer"])[-1][:200]
    raise RegistryUnreachable(f"no release list for {distribution} (Python {python}): {last}")


def any_kind_releases(distribution: str) -> List[str]:
    """The releases on the registry of any kind of distribution (sdists too), newest first."""
    done = _pip("index", "versions", distribution, timeout_s=PIP_TIMEOUT_S)
    found = re.search(r"^Available versions: (.+)$", done.stdout, re.MULTILINE)
    if done.returncode == 0 and found:
        return [v.strip() for v in found.group(1).split(",") if _VERSION.match(v.strip())][:1000]
    last = (done.stderr.strip().splitlines() or ["no answer"])[-1][:200]
    raise RegistryUnreachable(f"no release list for {distribution}: {last}")


def releases_by_python(distribution: str) -> Dict[str, List[str]]:
    """Each declared Python's releases of `distribution`: one look-up per Python, asked side by side, each bounded by
    pip's own network timeout and PIP_TIMEOUT_S."""
    pythons = declared_pythons()
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(pythons)) as pool:
        return dict(zip(pythons, pool.map(lambda python: releases(distribution, python), pythons)))


def _order(version: str) -> Version:
    try:
        return Version(version)
    except InvalidVersion:
        return Version("0")


def newest(by_python: Dict[str, List[str]]) -> Tuple[Optional[str], List[str]]:
    """(the newest release with a wheel for any of the Pythons, the Pythons it has a wheel for)."""
    known = {version for versions in by_python.values() for version in versions}
    if not known:
        return None, []
    best = max(known, key=_order)
    return best, [python for python, versions in by_python.items() if best in versions]


def pythons_text(pythons: List[str]) -> str:
    """"3.10-3.15", "3.10", "3.10-3.12, 3.14": runs of consecutive release lines joined."""
    minors = sorted(int(python.split(".")[1]) for python in pythons)
    runs: List[List[int]] = []
    for minor in minors:
        if runs and minor == runs[-1][-1] + 1:
            runs[-1].append(minor)
        else:
            runs.append([minor])
    return ", ".join(f"3.{run[0]}" + (f"-3.{run[-1]}" if len(run) > 1 else "") for run in runs)


@dataclass
class Resolved:
    version: str  # the release checked for (the newest, or the one asked for)
    code_version: str  # the release of the wheel that holds the code
    note: str = ""  # said when the two differ
    wheels_for: List[str] = field(default_factory=list)  # the Pythons `version` has wheels for (empty: not asked)
    fetch_for: List[str] = field(default_factory=list)  # the Pythons to fetch the code's wheel for, in turn


class NoWheel(Exception):
    pass


def resolve(library: "Library", version: Optional[str]) -> Resolved:
    """The release to check: `version`, or the newest with a wheel for any declared Python."""
    if version is None:
        version, wheels_for = newest(releases_by_python(library.name))
        if library.sdist_env is not None:
            newest_any = max(any_kind_releases(library.name), key=_order, default=None)
            if newest_any is not None and (version is None or _order(newest_any) > _order(version)):
                version, wheels_for = newest_any, []  # an sdist only
        if version is None:
            raise NoWheel(f"no wheel on the registry for Python {pythons_text(declared_pythons())} on this platform")
    else:
        wheels_for = []  # asked for by name: fetched for whichever declared Python has it, nothing looked up
    if library.code == library.name:
        return Resolved(version, version, "", wheels_for, wheels_for)
    published = releases_by_python(library.code)
    fetch_for = [python for python, versions in published.items() if version in versions]
    if fetch_for:
        return Resolved(version, version, "", wheels_for, fetch_for)
    code_version, fetch_for = newest(published)
    if code_version is None:
        raise NoWheel(f"{library.code}, which holds its code, has no wheel for Python "
                      f"{pythons_text(declared_pythons())} on this platform")
    return Resolved(version, code_version, (f"; {library.name} {version} needs {library.code} {version}, which the "
                                            f"registry does not have: checked {library.code} {code_version}"),
                    wheels_for, fetch_for)


def _fetch_order(pythons: Sequence[str]) -> List[str]:
    """The Pythons to try for a wheel: those given (the running one first where it is among them), else every
    declared one, the running one first."""
    running = "%d.%d" % sys.version_info[:2]
    candidates = list(pythons) or declared_pythons()
    return sorted(candidates, key=lambda python: python != running)


def source_dir(library: Library, version: str, pythons: Sequence[str] = ()) -> str:
    """The release's unpacked code (downloaded once per version, for the first of `pythons` that has a wheel of it;
    the wheel itself is not kept)."""
    if not _VERSION.match(version):
        raise ValueError(f"not a version: {version[:60]!r}")
    home = os.path.join(cache_root(), library.code, version)
    src = os.path.join(home, "src")
    if os.path.exists(os.path.join(src, ".complete")):
        return src
    shutil.rmtree(home, ignore_errors=True)
    os.makedirs(src)
    wheels = os.path.join(home, "wheels")
    for python in _fetch_order(pythons):
        done = _pip("download", "--no-deps", "--only-binary=:all:", "--python-version", python, "--no-cache-dir",
                    "-d", wheels, f"{library.code}=={version}")
        if done.returncode == 0:
            break
        if _NO_WHEEL not in done.stderr or any(sign in done.stderr for sign in _NOT_REACHED):
            break  # not a missing wheel for this Python: no other Python will fare better
    if done.returncode != 0 and library.sdist_env is not None and _NO_WHEEL in done.stderr:
        done = _sdist_download(library, version, wheels)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no answer"])[-1][:200]
        raise RegistryUnreachable(f"could not download {library.code}=={version}: {last}")
    for name in sorted(os.listdir(wheels)):
        if name.endswith(".tar.gz"):
            _unpack_sdist(os.path.join(wheels, name), src)
    pattern = re.compile(library.binary[0]) if library.binary else None
    for name in sorted(n for n in os.listdir(wheels) if n.endswith(".whl")):
        with zipfile.ZipFile(os.path.join(wheels, name)) as wheel:
            for member in wheel.namelist():
                # Python code, its data files (small), the version metadata: the tree imports where it can
                keep = (member.endswith((".py", ".json")) or member.endswith(".dist-info/METADATA")
                        or (pattern is not None and pattern.match(member)))
                if keep and ".." not in member.split("/") and not member.startswith("/"):
                    wheel.extract(member, src)
    shutil.rmtree(wheels, ignore_errors=True)
    with open(os.path.join(src, ".complete"), "w", encoding="utf-8") as marker:
        marker.write(version + "\n")
    return src


SDIST_BUILD = ("setuptools>=64", "setuptools-scm>=8", "wheel", "packaging")  # what an sdist's metadata step imports


def _build_python() -> str:
    """A small virtualenv of the canary's own (in its cache, made once) in which pip runs an sdist's metadata step
    with no build isolation: nothing else is installed, nothing is built."""
    venv = os.path.join(cache_root(), "sdist-build-venv")
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(os.path.join(venv, ".complete")):
        shutil.rmtree(venv, ignore_errors=True)
        try:
            subprocess.run([sys.executable, "-m", "venv", venv], capture_output=True, timeout=PIP_TIMEOUT_S * 2,
                           check=True)
        except (subprocess.SubprocessError, OSError) as error:
            raise RegistryUnreachable(f"could not make the sdist build virtualenv: {str(error)[:160]}") from error
        done = subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--timeout", "20",
                               "--retries", "1", *SDIST_BUILD], capture_output=True, text=True,
                              timeout=PIP_TIMEOUT_S * 5, check=False)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no answer"])[-1][:200]
            raise RegistryUnreachable(f"could not install {', '.join(SDIST_BUILD)}: {last}")
        with open(os.path.join(venv, ".complete"), "w", encoding="utf-8") as marker:
            marker.write("\n".join(SDIST_BUILD) + "\n")
    return python


def _sdist_download(library: Library, version: str, folder: str) -> subprocess.CompletedProcess:
    """The release's sdist into `folder` (pip runs its metadata step, in the build virtualenv)."""
    command = [_build_python(), "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--no-build-isolation",
               "--no-cache-dir", "--disable-pip-version-check", "--timeout", "20", "--retries", "1", "-d", folder,
               f"{library.code}=={version}"]
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S * 10, check=False,
                              env={**os.environ, **(library.sdist_env or {})})
    except subprocess.TimeoutExpired as error:
        raise RegistryUnreachable(f"pip download of {library.code}=={version} took too long") from error


def _unpack_sdist(archive: str, src: str) -> None:
    """An sdist's Python files and its PKG-INFO (as `<name>.egg-info/PKG-INFO`, so its version can be read); its
    entry points are left out, like everything else that is not code."""
    with tarfile.open(archive, "r:gz") as sdist:
        for member in sdist.getmembers():
            parts = member.name.split("/")
            if not member.isfile() or len(parts) < 2 or ".." in parts or member.name.startswith("/"):
                continue
            inside = "/".join(parts[1:])  # below the sdist's own top folder
            if inside == "PKG-INFO":
                target = os.path.join(src, parts[0].rsplit("-", 1)[0] + ".egg-info", "PKG-INFO")
            elif inside.endswith(".py") and "/" in inside and not inside.startswith(("tests/", "docs/",
                                                                                        "examples/", "benchmarks/")):
                target = os.path.join(src, *inside.split("/"))
            else:
                continue
            handle = sdist.extractfile(member)
            if handle is None or member.size > _MAX_SOURCE:
                continue
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with handle, open(target, "wb") as out:
                out.write(handle.read())


def tree_reader(src: str, aliases: Dict[str, str]) -> Callable[[str], Optional[ast.Module]]:
    cache: Dict[str, Optional[ast.Module]] = {}

    def tree_of(module: str) -> Optional[ast.Module]:
        for prefix, real in aliases.items():
            if module == prefix or module.startswith(prefix + "."):
                module = real + module[len(prefix):]
        if module not in cache:
            cache[module] = None
            base = os.path.join(src, *module.split("."))
            for path in (base + ".py", os.path.join(base, "__init__.py")):
                if os.path.isfile(path) and os.path.getsize(path) <= _MAX_SOURCE:
                    with open(path, encoding="utf-8", errors="replace") as handle:
                        cache[module] = ast.parse(handle.read(), filename=path)
                    break
        return cache[module]

    return tree_of


def _binary_names(src: str, pattern: str, names: Tuple[str, ...]) -> List[str]:
    """Names absent from every matching binary's bytes (a pybind11 method name is a NUL-ended string there)."""
    blobs = []
    for folder, _, files in os.walk(src):
        for name in files:
            relative = os.path.relpath(os.path.join(folder, name), src).replace(os.sep, "/")
            if re.match(pattern, relative):
                with open(os.path.join(folder, name), "rb") as handle:
                    blobs.append(handle.read())
    if not blobs:
        return [f"{pattern} (no engine binary in the wheel)"]
    # The linker merges a string into the tail of a longer one ("transfer_sync_write" lives inside
    # "batch_transfer_sync_write"), so only the name's end is certain: a removed name that is the tail of a kept
    # one goes unnoticed here.
    return [n for n in names if not any(n.encode() + b"\0" in blob for blob in blobs)]


def check(library: Library, version: str, pythons: Sequence[str] = ()) -> Tuple[List[str], List[str]]:
    """(required pieces missing, optional pieces missing) of `library` at `version` (its wheel for one of `pythons`)."""
    src = source_dir(library, version, pythons)
    if library.binary:
        _, required, optional = library.binary
        return _binary_names(src, library.binary[0], required), _binary_names(src, library.binary[0], optional)
    targets = library.targets()
    tree_of = tree_reader(src, library.aliases)
    return (missing_in_source(tree_of, [t for t in targets if not t.optional]),
            missing_in_source(tree_of, [t for t in targets if t.optional]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--only", action="append", choices=sorted(LIBRARIES), help="check only these libraries")
    parser.add_argument("--version", action="append", default=[], metavar="NAME==X.Y.Z",
                        help="check this release instead of the newest")
    options = parser.parse_args(argv)
    pinned = {}
    for item in options.version:
        name, _, version = item.partition("==")
        if name not in LIBRARIES or not _VERSION.match(version):
            print(f"canary: --version wants NAME==X.Y.Z with NAME one of {', '.join(LIBRARIES)}", file=sys.stderr)
            return 2
        pinned[name] = version
    in_ci = os.environ.get("CI", "").lower() in ("1", "true", "yes")
    failed = unreachable = False
    for name in options.only or list(LIBRARIES):
        library = LIBRARIES[name]
        try:
            resolved = resolve(library, pinned.get(name))
            absent, newer_absent = check(library, resolved.code_version, resolved.fetch_for)
        except RegistryUnreachable as error:
            unreachable = True
            print(f"canary: {name}: the package registry cannot be reached ({error})"
                  + ("" if in_ci else "; not a failure outside CI"))
            continue
        except NoWheel as error:
            failed = True
            print(f"canary: {name}: FAILED, {error}")
            continue
        except (OSError, zipfile.BadZipFile, SyntaxError, ValueError) as error:
            failed = True
            print(f"canary: {name}: could not read its release ({type(error).__name__}: {str(error)[:200]})")
            continue
        version, note = resolved.version, resolved.note
        if resolved.wheels_for:
            version += f" (wheels for Python {pythons_text(resolved.wheels_for)})"
        elif library.sdist_env is not None and name not in pinned:
            version += " (an sdist only)"
        if below_supported(library, resolved.version):
            held = "holds no engine" if any("no engine binary" in a for a in absent) else (
                "lacks " + ", ".join(absent[:6]) if absent else "has every patch target")
            print(f"canary: {name} {version}: below the supported range ({library.supported}): never instrumented; "
                  f"its wheel {held}{note}")
        elif absent:
            failed = True
            print(f"canary: {name} {version}: FAILED, a wrapper's target is missing: {', '.join(absent[:12])}{note}")
        else:
            if newer_absent:
                note += f"; paths it lacks (optional): {', '.join(newer_absent[:6])}"
            print(f"canary: {name} {version}: every patch target present{note}")
    return 1 if failed or (unreachable and in_ci) else 0


if __name__ == "__main__":
    sys.exit(main())
