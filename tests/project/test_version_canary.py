"""The release canary (tests/support/version_canary.py, run by scripts/canary.sh in CI): its declared targets match what
the patch functions wrap, it passes on the newest releases (the newest for any Python the package declares), a
release that breaks a wrapper fails it, and a registry that cannot be reached is one line that fails only under
CI=true.
"""

import importlib
import os
import re
import shutil
import subprocess
import sys

import pytest
from packaging.version import Version
from support import version_canary
from support.parts import mooncake_importable, require_part
from support.paths import ROOT

CANARY = version_canary.__file__


def _sglang_importable() -> bool:
    try:
        importlib.import_module("sglang.srt.disaggregation.mooncake.conn")
    except Exception:
        return False
    return True


def test_sglang_targets_are_what_its_patches_wrap():
    """Patched on the installed sglang (real modules), compared with the canary's list, both ways."""
    require_part(_sglang_importable(), "sglang's disaggregation modules (bash scripts/setup.sh)")
    from otel_kvtransfer.frameworks import sglang
    from otel_kvtransfer.frameworks.sglang.common import patcher

    for module in sglang.modules():
        importlib.import_module(module)
    was_on = sglang.HOOKS.on
    sglang.instrument()
    try:
        wrapped = {(owner.__module__, owner.__name__, attr) for owner, attr in patcher.patched()}
    finally:
        if not was_on:
            sglang.uninstrument()
    declared = {(t.module, t.cls, t.method) for t in version_canary.SGLANG_TARGETS if t.method}
    assert wrapped == declared


def test_engine_targets_are_what_the_engine_modules_replace():
    require_part(mooncake_importable(), "the Mooncake engine (bash scripts/setup.sh)")
    from otel_kvtransfer.engines import mooncake, nixl

    names = mooncake.timed_calls() | {"initialize", "initialize_ext"}
    assert names <= set(version_canary.MOONCAKE_METHODS) | set(version_canary.MOONCAKE_OPTIONAL)
    # NIXL: every (class, method) the engine module wraps (read from its source: NIXL need not be installed)
    source = open(nixl.__file__, encoding="utf-8").read()
    for target in version_canary.NIXL_TARGETS:
        assert f'"{target.method}"' in source, target


def test_newest_releases_pass():
    """The canary itself, on the newest releases (downloaded once into its cache, outside the clone)."""
    done = subprocess.run([sys.executable, CANARY], capture_output=True, text=True, timeout=1800, check=False)
    lines = done.stdout.strip().splitlines()
    if any("cannot be reached" in line for line in lines):
        require_part(False, "the package registry (pip index / pip download): " + lines[-1])
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert len(lines) == len(version_canary.LIBRARIES)
    # A build whose newest release lies below the supported range is said so (never instrumented), not checked.
    assert all("every patch target present" in line or "below the supported range" in line for line in lines), lines
    newest_mooncake = next(line for line in lines if line.startswith("canary: mooncake-transfer-engine-cuda13 "))
    assert "lacks" not in newest_mooncake  # the build with 0.3.14: every call this package times is in its engine


def test_the_canary_reads_every_build_of_every_engine():
    """One line per published build, from the engine modules' own lists: the canary cannot miss a build the
    package switches on for."""
    from otel_kvtransfer.engines import mooncake, nixl

    builds = set(mooncake.DISTRIBUTIONS) | set(nixl.DISTRIBUTIONS)
    assert builds <= set(version_canary.LIBRARIES)
    assert all(version_canary.LIBRARIES[name].binary for name in mooncake.DISTRIBUTIONS)  # each its own engine
    assert {version_canary.LIBRARIES[name].aliases["nixl._api"] for name in nixl.DISTRIBUTIONS} == {
        "nixl_cu12._api", "nixl_cu13._api"}


def _cached_release(tmp_path, distribution: str, version: str, members: dict) -> None:
    """A release in the canary's cache (as if downloaded and unpacked), holding `members` {path: bytes}."""
    src = tmp_path / distribution / version / "src"
    for member, data in members.items():
        (src / member).parent.mkdir(parents=True, exist_ok=True)
        (src / member).write_bytes(data)
    (src / ".complete").write_text(version + "\n")


def test_a_supported_release_without_the_engine_fails_and_one_below_the_range_is_said(tmp_path):
    """A Mooncake build whose release has no compiled engine: a failure at a supported version (a wrapper has
    nothing to patch where the build claims to be one), one line and no failure below the supported range (what
    mooncake-transfer-engine-musa 0.0.0.1 is: it installs no `mooncake` package)."""
    placeholder = {"mtmlpkg/__init__.py": b"", "placeholder-0.dist-info/METADATA": b"Name: placeholder\n"}
    _cached_release(tmp_path, "mooncake-transfer-engine-rocm", "0.3.99", placeholder)
    _cached_release(tmp_path, "mooncake-transfer-engine-musa", "0.0.0.1", placeholder)
    env = dict(os.environ, KVT_CANARY_CACHE=str(tmp_path))
    for pinned, code, said in (("mooncake-transfer-engine-rocm==0.3.99", 1, "FAILED, a wrapper's target is missing"),
                               ("mooncake-transfer-engine-musa==0.0.0.1", 0,
                                "below the supported range (>=0.3): never instrumented; its wheel holds no engine")):
        name = pinned.split("==")[0]
        done = subprocess.run([sys.executable, CANARY, "--only", name, "--version", pinned], env=env,
                              capture_output=True, text=True, timeout=120, check=False)
        lines = done.stdout.strip().splitlines()
        assert len(lines) == 1 and said in lines[0] and done.returncode == code, done.stdout + done.stderr[-2000:]


def test_a_release_that_renames_a_target_fails_the_canary(tmp_path):
    """vLLM 0.33.0's real source with `_send_blocks` renamed (what a breaking release would look like)."""
    library = version_canary.LIBRARIES["vllm"]
    try:
        real = version_canary.source_dir(library, "0.33.0")
    except version_canary.RegistryUnreachable as error:
        require_part(False, f"vLLM 0.33.0's wheel from the package registry ({error})")
    module = os.path.join("vllm", "distributed", "kv_transfer", "kv_connector", "v1", "mooncake",
                          "mooncake_connector.py")
    fake = tmp_path / "vllm" / "0.99.0" / "src"
    shutil.copytree(real, fake)
    path = fake / module
    text = path.read_text(encoding="utf-8")
    assert "    def _send_blocks(\n" in text
    path.write_text(text.replace("    def _send_blocks(\n", "    def _send_block_batch(\n"), encoding="utf-8")
    os.environ["KVT_CANARY_CACHE"] = str(tmp_path)
    try:
        absent, _ = version_canary.check(library, "0.99.0")
    finally:
        del os.environ["KVT_CANARY_CACHE"]
    assert absent == ["MooncakeConnectorWorker._send_blocks"]


@pytest.mark.parametrize("ci", ["", "true"])
def test_an_unreachable_registry_is_one_line_and_fails_only_in_ci(tmp_path, ci):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update({"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_NO_INPUT": "1",
                "KVT_CANARY_CACHE": str(tmp_path), "CI": ci})
    done = subprocess.run([sys.executable, CANARY, "--only", "sglang"], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and "sglang: the package registry cannot be reached" in lines[0], done.stdout
    assert "Traceback" not in done.stdout + done.stderr
    assert done.returncode == (1 if ci else 0)


def test_bad_arguments_are_one_line_and_exit_2():
    done = subprocess.run([sys.executable, CANARY, "--version", "vllm==../../etc"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_ci_runs_the_canary():
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as handle:
        assert "scripts/canary.sh" in handle.read()


def test_the_pythons_asked_are_every_one_the_package_declares():
    """From pyproject.toml's requires-python minimum to the newest release line, the running one among them."""
    from packaging.specifiers import SpecifierSet

    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as handle:
        declared = SpecifierSet(re.search(r'^requires-python\s*=\s*"([^"]+)"', handle.read(), re.M).group(1))
    pythons = version_canary.declared_pythons()
    minors = [int(p.split(".")[1]) for p in pythons]
    assert minors == list(range(minors[0], minors[-1] + 1)) and all(p in declared for p in pythons)
    assert f"3.{minors[0] - 1}" not in declared
    assert "%d.%d" % sys.version_info[:2] in pythons and minors[-1] >= version_canary.NEWEST_PYTHON[1]


def test_the_newest_release_is_the_newest_for_any_python_and_its_line_says_which():
    assert version_canary.newest({"3.10": ["0.3.13.post1", "0.3.13", "0.0.0.1"], "3.11": ["0.0.0.1"],
                                  "3.12": []}) == ("0.3.13.post1", ["3.10"])
    assert version_canary.newest({"3.10": ["1.0"], "3.11": ["1.1", "1.0"], "3.12": ["1.1"]}) == ("1.1",
                                                                                                 ["3.11", "3.12"])
    assert version_canary.newest({"3.10": [], "3.11": []}) == (None, [])
    assert version_canary.pythons_text(["3.10", "3.11", "3.12", "3.14"]) == "3.10-3.12, 3.14"
    assert version_canary.pythons_text(["3.10"]) == "3.10"
    # a wheel is fetched for a Python that has one; a release asked for by name, for each declared one in turn
    running = "%d.%d" % sys.version_info[:2]
    assert version_canary._fetch_order(["3.10"]) == ["3.10"]
    assert version_canary._fetch_order([]) == [running] + [p for p in version_canary.declared_pythons() if p != running]


def test_a_build_published_for_one_python_is_found_from_any():
    """On the real registry: mooncake-transfer-engine-musa 0.3.13.post1 (a real engine) has wheels for Python 3.10
    alone, and 3.11 sees only the 0.0.0.1 placeholder; the canary, run from this Python, checks the engine and says
    for which Python its wheels are. A Python a build has no wheel for is an empty list, not an unreachable
    registry."""
    musa = "mooncake-transfer-engine-musa"
    try:
        for_310, for_311 = (version_canary.releases(musa, python) for python in ("3.10", "3.11"))
        assert version_canary.releases("tokenspeed-mooncake", "3.9") == []  # it requires Python >= 3.10
    except version_canary.RegistryUnreachable as error:
        require_part(False, f"the package registry ({error})")
    assert "0.3.13.post1" in for_310 and "0.3.13.post1" not in for_311 and "0.0.0.1" in for_311
    done = subprocess.run([sys.executable, CANARY, "--only", musa], capture_output=True, text=True, timeout=900,
                          check=False)
    (line,) = done.stdout.strip().splitlines()
    if "cannot be reached" in line:
        require_part(False, "the package registry: " + line)
    found = re.match(rf"canary: {musa} (\S+) \(wheels for Python ([^)]+)\): every patch target present", line)
    assert found and done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert Version(found.group(1)) >= Version("0.3.13.post1") and "3.10" in found.group(2), line
