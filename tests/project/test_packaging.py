"""The package as a user installs it: a real wheel built from this tree, installed into a throwaway virtualenv with
nothing but its declared dependencies, then read back through importlib.metadata and the installed files.

The wheel is built from a copy of the files the build reads (never in the shared tree) with the running
interpreter's setuptools (>= 77, PEP 639), or pip's isolated build when that is older. The virtualenv holding the
declared dependencies is cached under ~/.cache/otel-kvtransfer/packaging-venv, keyed by those requirements; the
wheel itself is reinstalled on every run.
"""

import concurrent.futures
import email
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile

import pytest
from support.observability.parts import CACHE, ROOT, mooncake_available
from support.parts import require_part

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None

BUILD_INPUTS = ("pyproject.toml", "LICENSE", "docs/package-description.md", "dashboards/kv_transfer.json",
                "dashboards/alerts.yaml", "otel_kvtransfer")
DATA_DIR = ("share", "otel-kvtransfer", "dashboards")


def _pyproject():
    if tomllib is None:
        pytest.skip("tomllib needs Python >= 3.11")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as handle:
        return tomllib.load(handle)


def _run(argv, timeout=600, **kwargs):
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, **kwargs)
    assert result.returncode == 0, f"{' '.join(argv)}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def _copy_build_inputs(dest):
    for rel in BUILD_INPUTS:
        src = os.path.join(ROOT, rel)
        target = os.path.join(dest, rel)
        if os.path.isdir(src):
            # no built module either: the wheel's compiled part must come from its C source
            shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "*.so"))
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy2(src, target)


def _setuptools_supports_pep639() -> bool:
    try:
        import setuptools
    except ImportError:
        return False
    major = re.match(r"\d+", setuptools.__version__)
    return bool(major) and int(major.group()) >= 77


def _build_wheel(tmp_path_factory, env=None, copy=_copy_build_inputs):
    src = str(tmp_path_factory.mktemp("src"))
    out = str(tmp_path_factory.mktemp("wheel"))
    copy(src)
    argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", out, src]
    if _setuptools_supports_pep639():
        argv.insert(4, "--no-build-isolation")  # offline and fast; otherwise pip fetches setuptools >= 77
    _run(argv, env=env)
    (name,) = [n for n in os.listdir(out) if n.endswith(".whl")]
    return os.path.join(out, name)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    return _build_wheel(tmp_path_factory)


@pytest.fixture(scope="module")
def wheel_metadata(wheel):
    with zipfile.ZipFile(wheel) as archive:
        (path,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return email.message_from_bytes(archive.read(path))


def _plain_requirements(metadata):
    return sorted(r for r in metadata.get_all("Requires-Dist", []) if "extra ==" not in r)


@pytest.fixture(scope="module")
def venv(wheel, wheel_metadata):
    """A virtualenv with the declared dependencies only (cached), and the freshly built wheel (--no-deps)."""
    requirements = _plain_requirements(wheel_metadata)
    key = hashlib.sha256(json.dumps([sys.version, requirements]).encode()).hexdigest()[:16]
    path = os.path.join(CACHE, "packaging-venv", key)
    python = os.path.join(path, "bin", "python")
    stamp = os.path.join(path, ".complete")
    if not os.path.exists(stamp):
        shutil.rmtree(path, ignore_errors=True)
        _run([sys.executable, "-m", "venv", "--without-pip", path])
        _run([sys.executable, "-m", "pip", "--python", python, "install", "--quiet", *requirements])
        with open(stamp, "w", encoding="utf-8") as handle:
            handle.write("\n".join(requirements))
        # keep only this key: older ones belong to requirements no longer declared
        for other in os.listdir(os.path.dirname(path)):
            if other != key:
                shutil.rmtree(os.path.join(os.path.dirname(path), other), ignore_errors=True)
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps", "--force-reinstall",
          wheel])
    return python


def _in_venv(python, code):
    """Run code in the throwaway venv (cwd outside the tree, so the installed package is what imports)."""
    with tempfile.TemporaryDirectory() as cwd:
        result = _run([python, "-I", "-c", code], timeout=120, cwd=cwd)
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_dependencies_are_the_true_minimums_and_bounded(wheel_metadata):
    requires = {re.split(r"[ <>=!~;]", r, maxsplit=1)[0].lower(): r for r in _plain_requirements(wheel_metadata)}
    # api/sdk 1.27-1.29 lack explicit_bucket_boundaries_advisory; instrumentation 0.57b0-0.62b0 does not reach spawn
    # children (0.57b0 is also the first with instruments-any); 0.63b0 pins semantic-conventions 0.63b0 and so
    # API 1.42.0. scripts/test-minimums.sh runs the core suite at exactly these.
    for name in ("opentelemetry-api", "opentelemetry-sdk"):
        assert re.search(r">=\s*1\.42\.0", requires[name]) and re.search(r"<\s*2\b", requires[name]), requires[name]
    assert re.search(r">=\s*0\.63b0", requires["opentelemetry-instrumentation"])
    # OTLP export (grpcio, protobuf) is the user's choice: an extra, not a dependency
    assert "opentelemetry-exporter-otlp" not in requires
    assert not [r for r in requires if "grpc" in r]


def test_extras(wheel_metadata):
    extras = set(wheel_metadata.get_all("Provides-Extra", []))
    assert {"otlp", "demo", "timeline", "auto", "instruments-any", "mooncake", "mooncake-cpu", "sglang"} <= extras
    by_extra = {}
    for requirement in wheel_metadata.get_all("Requires-Dist", []):
        match = re.search(r'extra\s*==\s*"([^"]+)"', requirement)
        if match:
            by_extra.setdefault(match.group(1), []).append(requirement.split(";", 1)[0].strip().lower())
    names = {extra: {re.split(r"[ <>=!~]", r, maxsplit=1)[0] for r in reqs} for extra, reqs in by_extra.items()}
    assert "opentelemetry-exporter-otlp" in names["otlp"]
    # the demo renders its timeline PNG (Pillow) and exports OTLP
    assert {"pillow", "opentelemetry-exporter-otlp", "numpy"} <= names["demo"]
    assert {"mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda"} <= names["instruments-any"]


def test_license_is_an_spdx_expression_with_its_file(wheel, wheel_metadata):
    assert wheel_metadata["License-Expression"] == "Apache-2.0"
    assert wheel_metadata.get_all("License-File") == ["LICENSE"]
    assert not wheel_metadata.get("License")  # the deprecated free-text field
    assert not [c for c in wheel_metadata.get_all("Classifier", []) if c.startswith("License ::")]
    with zipfile.ZipFile(wheel) as archive:
        (path,) = [n for n in archive.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
        text = archive.read(path).decode()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text) > 10_000  # the full text, not a stub


def test_classifiers_and_no_invented_urls(wheel_metadata):
    classifiers = wheel_metadata.get_all("Classifier", [])
    assert "Framework :: OpenTelemetry :: Instrumentations" in classifiers
    assert any(c.startswith("Programming Language :: Python :: 3.") for c in classifiers)
    # the project has no public homepage or repository yet: no URL rather than an invented one
    assert not wheel_metadata.get_all("Project-URL") and not wheel_metadata.get("Home-page")


def test_long_description_has_no_relative_links_and_no_repo_scripts(wheel_metadata):
    assert wheel_metadata["Description-Content-Type"].startswith("text/markdown")
    body = wheel_metadata.get_payload()
    assert body.strip().startswith("# otel_kvtransfer")
    targets = re.findall(r"\]\(([^)\s]+)", body) + re.findall(r"^\s*\[[^\]]+\]:\s*(\S+)", body, re.M) + \
        re.findall(r"""(?:src|href)=["']([^"']+)""", body)
    relative = [t for t in targets if not re.match(r"https?://", t)]
    assert not relative, relative
    assert "scripts/" not in body and "bash scripts" not in body  # a PyPI reader has no checkout


def test_entry_points_are_declared_as_in_pyproject(venv):
    project = _pyproject()["project"]
    expected = {group: dict(points) for group, points in project["entry-points"].items()}
    expected["console_scripts"] = dict(project["scripts"])
    installed = _in_venv(venv, (
        "import json, importlib.metadata as m\n"
        "eps = m.distribution('otel_kvtransfer').entry_points\n"
        "print(json.dumps({g: {e.name: e.value for e in eps if e.group == g} for g in {e.group for e in eps}}))"))
    assert installed == expected
    for group in ("opentelemetry_instrumentor", "opentelemetry_traces_exporter", "sglang.srt.plugins",
                  "vllm.general_plugins", "console_scripts"):
        assert installed.get(group), group


def test_entry_points_load_with_only_the_declared_dependencies(venv):
    """Every entry point's target imports in a venv holding nothing but the declared dependencies (no sglang,
    vLLM, Mooncake, grpcio): a hidden import of an optional package would break `opentelemetry-instrument`."""
    loaded = _in_venv(venv, (
        "import json, importlib.metadata as m\n"
        "out = {}\n"
        "for e in m.distribution('otel_kvtransfer').entry_points:\n"
        "    try:\n"
        "        out[e.group + ':' + e.name] = callable(e.load())\n"
        "    except Exception as exc:\n"
        "        out[e.group + ':' + e.name] = f'{type(exc).__name__}: {exc}'\n"
        "print(json.dumps(out))"))
    assert loaded and all(v is True for v in loaded.values()), loaded


def test_dashboard_and_alert_rules_ship_in_the_wheel(wheel, venv):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    shipped = [n for n in names if "/data/" + "/".join(DATA_DIR) + "/" in n]
    assert sorted(os.path.basename(n) for n in shipped) == ["alerts.yaml", "kv_transfer.json"]
    data = _in_venv(venv, "import json, sysconfig; print(json.dumps(sysconfig.get_path('data')))")
    for name in ("kv_transfer.json", "alerts.yaml"):
        with open(os.path.join(data, *DATA_DIR, name), "rb") as installed, \
                open(os.path.join(ROOT, "dashboards", name), "rb") as source:
            assert installed.read() == source.read(), name


COMPILED = "otel_kvtransfer/engines/mooncake/_async_compiled."
SAYS_COMPILED = ("import json; from otel_kvtransfer.engines.mooncake import compiled; "
                 "print(json.dumps([compiled.available(), compiled.chosen() is not None]))")


def test_the_compiled_part_is_built_from_source_into_the_wheel(wheel, venv):
    """The async send's compiled wrappers: built from their C source (the copy the build reads has no built
    module), in the wheel, and what the installed package takes."""
    with zipfile.ZipFile(wheel) as archive:
        built = [n for n in archive.namelist() if n.startswith(COMPILED) and n.endswith(".so")]
    assert len(built) == 1, built
    assert _in_venv(venv, SAYS_COMPILED) == [True, True]


def test_a_build_without_a_c_compiler_installs_the_python_path(tmp_path_factory, venv):
    """No compiler (CC names one that fails): the build still makes a wheel, without the compiled part, and the
    package installed from it runs the Python wrappers."""
    wheel = _build_wheel(tmp_path_factory, env=dict(os.environ, CC="false", LDSHARED="false"))
    with zipfile.ZipFile(wheel) as archive:
        assert not [n for n in archive.namelist() if n.startswith(COMPILED) and n.endswith(".so")]
    python = os.path.join(str(tmp_path_factory.mktemp("plain")), "venv")
    _run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", python])
    # the packaging venv's dependencies, this wheel on top: a venv of its own, the shared one keeps the compiled
    site = _in_venv(venv, "import json, sysconfig; print(json.dumps(sysconfig.get_path('purelib')))")
    target = str(tmp_path_factory.mktemp("plain-site"))
    _run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", target, wheel])
    code = f"import sys; sys.path[:0] = [{target!r}, {site!r}]; " + SAYS_COMPILED
    with tempfile.TemporaryDirectory() as cwd:
        result = _run([os.path.join(python, "bin", "python"), "-I", "-c", code], timeout=120, cwd=cwd)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [False, False]


def test_instruments_any_gates_auto_instrumentation(venv, wheel_metadata):
    """opentelemetry-instrument skips the instrumentor when none of `instruments-any` is installed (this venv has
    no engine), and `otel_kvtransfer.wiring.package._instruments_any` says the same as the extra."""
    declared = sorted(r.split(";", 1)[0].strip() for r in wheel_metadata.get_all("Requires-Dist", [])
                      if re.search(r'extra\s*==\s*"instruments-any"', r))
    result = _in_venv(venv, (
        "import json, importlib.metadata as m\n"
        "from opentelemetry.instrumentation.dependencies import get_dist_dependency_conflicts\n"
        "from otel_kvtransfer.wiring import package\n"
        "conflict = get_dist_dependency_conflicts(m.distribution('otel_kvtransfer'))\n"
        "print(json.dumps({'conflict': str(conflict) if conflict else None,\n"
        "                  'required_any': sorted(getattr(conflict, 'required_any', None) or []),\n"
        "                  'instruments': list(package._instruments),\n"
        "                  'instruments_any': sorted(getattr(package, '_instruments_any', ()))}))"))
    assert result["instruments"] == []
    from packaging.requirements import Requirement

    def normalise(requirements):
        return sorted((Requirement(r).name.lower(), str(Requirement(r).specifier)) for r in requirements)

    assert normalise(result["instruments_any"]) == normalise(declared)
    assert result["conflict"] and normalise(result["required_any"]) == normalise(declared)


def test_instruments_any_is_satisfied_where_an_engine_is_installed(wheel_metadata):
    """The other side, in the project's own environment: the Mooncake CPU wheel installed there satisfies it."""
    from opentelemetry.instrumentation.dependencies import get_dependency_conflicts

    require_part(mooncake_available(), "the Mooncake engine (bash scripts/setup.sh)")
    declared = [r.split(";", 1)[0].strip() for r in wheel_metadata.get_all("Requires-Dist", [])
                if re.search(r'extra\s*==\s*"instruments-any"', r)]
    assert get_dependency_conflicts([], declared) is None


# --- docs/faults.md says what the fault tests show ---------------------------------------------------------------

FAULTS_DOC = os.path.join(ROOT, "docs", "faults.md")


def _fault_rows():
    with open(FAULTS_DOC, encoding="utf-8") as handle:
        return [line for line in handle if line.startswith("| ") and not line.startswith("| fault")
                and not line.startswith("|---")]


FAULTS_TESTS = "tests/recording/test_faults.py"  # where a row's bare test name is


def test_faults_doc_names_only_tests_that_exist():
    """Every test file a row names exists (named from the checkout's root), and every test it names exists in the
    file it names (a bare name is in FAULTS_TESTS)."""
    rows = _fault_rows()
    assert len(rows) >= 20
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        for ref in re.findall(r"`([^`]+)`", cells[-1]):
            if ref.startswith("tests/") and ref.endswith(".py"):
                assert os.path.isfile(os.path.join(ROOT, ref)), ref
                continue
            path, _, name = ref.rpartition("::") if "::" in ref else (FAULTS_TESTS, "", ref)
            if path.startswith("bench/") or not name.startswith("test_") or name.endswith(".py"):
                continue
            assert path.startswith("tests/"), f"{ref}: name a test by its path from the checkout's root"
            with open(os.path.join(ROOT, path), encoding="utf-8") as handle:
                source = handle.read()
            assert re.search(rf"^def {re.escape(name.split('[', 1)[0])}\(", source, re.M), (path, name)


def test_faults_doc_claims_no_timing_the_tests_do_not_assert():
    """Timing is never a pass/fail criterion in tests: a row that speaks of speed must say it is not asserted."""
    for row in _fault_rows():
        if "bench/" in row:
            continue
        if re.search(r"slowed|full speed|per-call time|speed", row, re.I):
            assert re.search(r"not asserted", row, re.I), row[:120]


def test_faults_doc_poisoned_span_row_matches_the_test():
    """The test exports ten spans of 10..19 bytes with one processor raising: the doc must not say nine."""
    with open(os.path.join(ROOT, FAULTS_TESTS), encoding="utf-8") as handle:
        source = handle.read()
    body = source[source.index("def test_one_poisoned_span_loses_only_itself"):]
    body = body[:body.index("\ndef ", 1)]
    exported = re.search(r"== list\(range\((\d+), (\d+)\)\)", body)
    assert exported, "the poisoned-span test no longer asserts the exported spans: update docs/faults.md"
    count = int(exported.group(2)) - int(exported.group(1))
    (row,) = [r for r in _fault_rows() if "test_one_poisoned_span_loses_only_itself" in r]
    words = {9: "nine", 10: "ten"}
    assert words.get(count, str(count)) in row and "nine" not in row.replace(words.get(count, ""), "")


# --- the install line of README.md and docs/deploy.md, and the wheel with every extra, from a clean clone --------

INSTALL_DOCS = ("README.md", "docs/deploy.md")
# Every extra pyproject.toml declares, by how the test below takes it (a new extra must be placed in one):
INSTALLED_EXTRAS = ("otlp", "auto", "timeline", "test")  # installed for real, with every dependency (small)
RESOLVED_EXTRAS = ("mooncake", "mooncake-cpu", "demo")  # an engine wheel each: resolved with their dependencies only
# sglang: torch and ~200 more packages (gigabytes; minutes to resolve); instruments-any: every engine and framework
# build, never installed together (vLLM and SGLang pin different torch; the MUSA engine has wheels for Python 3.10
# alone): each requirement's name resolved alone (--no-deps), for any Python the package declares.
NAMES_ONLY_EXTRAS = ("sglang", "instruments-any")

# What a virtualenv holds: every distribution's version, this package's requirements, where it imports from, its
# entry points.
_INSTALLED = (
    "import importlib.metadata as m, importlib.util, json\n"
    "print(json.dumps({'versions': {d.metadata['Name']: d.version for d in m.distributions()},\n"
    "                  'requires': m.distribution('otel_kvtransfer').requires or [],\n"
    "                  'origin': importlib.util.find_spec('otel_kvtransfer').origin,\n"
    "                  'entry_points': sorted({e.group + ':' + e.name\n"
    "                                          for d in m.distributions() for e in d.entry_points})}))")


def _install_line(doc):
    """The first `pip install` line of `doc` (the command, without its comment)."""
    with open(os.path.join(ROOT, doc), encoding="utf-8") as handle:
        found = re.search(r"^(pip install \S+)", handle.read(), re.M)
    assert found, f"{doc} has no install line"
    return found.group(1)


def _copy_clone(dest):
    """What a clone of this tree holds, as it is now: the files git tracks and the new ones it does not ignore (no
    build output, virtualenv, egg-info or compiled module)."""
    require_part(shutil.which("git") is not None, "git (the clean clone is the files git lists)")
    listed = _run(["git", "-C", ROOT, "ls-files", "-z", "--cached", "--others", "--exclude-standard"]).stdout
    for rel in filter(None, listed.split("\0")):
        src = os.path.join(ROOT, rel)
        if os.path.isfile(src) and not os.path.islink(src):  # a tracked file deleted in the tree is not in it
            os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, rel))


def _extra_requirements(requires, extra):
    from packaging.requirements import Requirement

    found = []
    for text in requires:
        requirement = Requirement(text)
        if requirement.marker is not None and requirement.marker.evaluate({"extra": extra}) \
                and not requirement.marker.evaluate({"extra": ""}):
            found.append(requirement)
    return found


def _unsatisfied(info, extras):
    """This package's dependencies and the requirements of `extras` that the venv lacks or holds at a version outside
    their range."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    versions = {canonicalize_name(name): version for name, version in info["versions"].items()}
    wanted = [Requirement(t) for t in info["requires"] if Requirement(t).marker is None]
    wanted += [r for extra in extras for r in _extra_requirements(info["requires"], extra)]
    missing = []
    for requirement in wanted:
        have = versions.get(canonicalize_name(requirement.name))
        if have is None or not requirement.specifier.contains(have, prereleases=True):
            missing.append((str(requirement), have))
    return missing


def test_the_install_line_works_as_written_in_a_clean_clone(tmp_path_factory):
    """The install line of README.md and docs/deploy.md (`pip install '.[auto,otlp]'`, the same in both), run as
    written in a clean copy of the clone, in a new virtualenv with the pip it comes with: every dependency from the
    package registry; the package installed (not linked to the clone), both extras' requirements satisfied,
    `opentelemetry-instrument`, the distro's configurator and the OTLP exporters there, `pip check` clean. The
    published name is the future form: both files say so beside it."""
    lines = {doc: _install_line(doc) for doc in INSTALL_DOCS}
    assert len(set(lines.values())) == 1, lines
    line = lines[INSTALL_DOCS[0]]
    assert line.startswith("pip install '.["), line  # until it is on the registry, from the clone
    for doc in INSTALL_DOCS:
        with open(os.path.join(ROOT, doc), encoding="utf-8") as handle:
            text = handle.read()
        assert re.search(r"PyPI.*pip install 'otel_kvtransfer\[auto,otlp\]'", text), doc
    clone = str(tmp_path_factory.mktemp("clone"))
    _copy_clone(clone)
    venv = os.path.join(str(tmp_path_factory.mktemp("newcomer")), "venv")
    _run([sys.executable, "-m", "venv", venv])
    argv = shlex.split(line)
    _run([os.path.join(venv, "bin", argv[0]), *argv[1:]], timeout=900, cwd=clone)

    python = os.path.join(venv, "bin", "python")
    info = _in_venv(python, _INSTALLED)
    assert os.path.realpath(info["origin"]).startswith(os.path.realpath(venv) + os.sep), info["origin"]
    extras = re.search(r"\[([^\]]+)\]", line).group(1).split(",")
    assert sorted(extras) == ["auto", "otlp"]
    assert _unsatisfied(info, extras) == []
    assert {"opentelemetry_instrumentor:kv_transfer", "opentelemetry_configurator:configurator",
            "opentelemetry_traces_exporter:otlp", "opentelemetry_metrics_exporter:otlp"} <= set(info["entry_points"])
    assert os.path.isfile(os.path.join(venv, "bin", "opentelemetry-instrument"))
    _run([python, "-m", "pip", "check"])


def test_the_wheel_installs_with_every_extra_into_a_clean_virtualenv(tmp_path_factory):
    """The wheel built from a clean copy of the clone, into a new virtualenv (bounded time, network from the package
    registry only): INSTALLED_EXTRAS installed for real with every dependency, each requirement then satisfied;
    RESOLVED_EXTRAS resolved with their dependencies (`pip install --dry-run --report`: each requirement resolved
    to a release in its range, nothing downloaded but metadata); NAMES_ONLY_EXTRAS with --no-deps, each requirement's
    name resolved alone to a release in its range for one of the Pythons the package declares (sglang pulls
    gigabytes; instruments-any is every engine and framework, never installed together)."""
    from packaging.utils import canonicalize_name
    from support import version_canary

    declared = set(_pyproject()["project"]["optional-dependencies"])
    assert declared == set(INSTALLED_EXTRAS + RESOLVED_EXTRAS + NAMES_ONLY_EXTRAS)
    wheel = _build_wheel(tmp_path_factory, copy=_copy_clone)
    venv = os.path.join(str(tmp_path_factory.mktemp("extras")), "venv")
    python = os.path.join(venv, "bin", "python")
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "--quiet"]
    _run([*pip, f"{wheel}[{','.join(INSTALLED_EXTRAS)}]"], timeout=900)
    info = _in_venv(python, _INSTALLED)
    assert _unsatisfied(info, INSTALLED_EXTRAS) == []

    report = str(tmp_path_factory.mktemp("report") / "report.json")
    _run([*pip, "--dry-run", "--ignore-installed", "--report", report, f"{wheel}[{','.join(RESOLVED_EXTRAS)}]"],
         timeout=900)
    with open(report, encoding="utf-8") as handle:
        resolved = {canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"]
                    for item in json.load(handle)["install"]}
    for extra in RESOLVED_EXTRAS:
        requirements = _extra_requirements(info["requires"], extra)
        assert requirements, extra
        for requirement in requirements:
            version = resolved.get(canonicalize_name(requirement.name))
            assert version and requirement.specifier.contains(version, prereleases=True), (extra, str(requirement))

    def resolves(requirement):
        """(Python, release) of the first declared Python, this one first, with a wheel in the range."""
        for python_version in version_canary._fetch_order([]):
            releases = version_canary.releases(requirement.name, python_version)
            inside = [v for v in releases if requirement.specifier.contains(v, prereleases=True)]
            if inside:
                return python_version, inside[0]
        return None

    names_only = [r for extra in NAMES_ONLY_EXTRAS for r in _extra_requirements(info["requires"], extra)]
    assert len(names_only) > len(NAMES_ONLY_EXTRAS)
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
            found = dict(zip(map(str, names_only), pool.map(resolves, names_only)))
    except version_canary.RegistryUnreachable as error:
        require_part(False, f"the package registry ({error})")
    assert [r for r, where in found.items() if where is None] == [], found
