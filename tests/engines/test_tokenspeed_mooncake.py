"""TokenSpeed's fork of Mooncake (`tokenspeed-mooncake`), as its users run it: a virtualenv holding that build and
nothing of Mooncake's own, this package installed with `.[auto]`, and a script that knows nothing of OpenTelemetry
started under `opentelemetry-instrument`. The build is one of the engine's declared distributions, so
`instruments-any` is satisfied by it alone and the instrumentor loads; every write call the script makes (classic,
batch, async, arrays, pages, the CUDA stream's) is one exported send with its exact bytes, between two OS processes
over TCP on 127.0.0.1, in a network namespace of their own.

The virtualenv: `bash scripts/setup-tokenspeed-mooncake.sh` (KVT_TOKENSPEED_PYTHON names its python). STAND-IN: the
CUDA driver. The build is a CUDA 13 one and a CPU machine has no driver, so `libcuda.so.1` there is built at set-up
with one function per driver call the package's libraries import, each answering CUDA_ERROR_NO_DEVICE; the engine,
its transport, NVIDIA's CUDA runtime and every byte moved are real. The `*_on_cuda` calls need a CUDA stream: here
they fail as on a host without a GPU (real), and are failed sends. With CI=true a missing virtualenv fails these
tests instead of skipping them.
"""

import json
import os
import re
import shutil
import subprocess

import pytest
from support import cuda13_venvs, netns
from support.instrumented_app import spans_when
from support.parts import require_part
from support.paths import APPS

from otel_kvtransfer import semconv
from otel_kvtransfer.engines import mooncake

BUILD = "tokenspeed-mooncake"
RUN_TIMEOUT_S = 300


def tokenspeed_python() -> str:
    return cuda13_venvs.python_of(cuda13_venvs.TOKENSPEED)


def tokenspeed_ready(python: str) -> bool:
    return cuda13_venvs.ready(python, "import importlib.metadata as m, mooncake.engine, numpy, otel_kvtransfer, "
                                      f"opentelemetry.distro\nm.version({BUILD!r})")


@pytest.fixture(scope="module")
def venv():
    """(python, environment) of the TokenSpeed virtualenv, as a user runs it: no OTEL_* or PYTHONPATH of this
    process (the installed package is what imports), the venv's library path."""
    python = tokenspeed_python()
    require_part(tokenspeed_ready(python), f"the tokenspeed-mooncake virtualenv at {python} (run "
                                           "`bash scripts/setup-tokenspeed-mooncake.sh`, or set KVT_TOKENSPEED_PYTHON)")
    netns.require_tools()
    return python, cuda13_venvs.engine_env(python, ("OTEL_", "PYTHON"))


_GATE = r"""
import importlib.metadata as m, json
from opentelemetry.instrumentation.dependencies import get_dist_dependency_conflicts
from otel_kvtransfer.wiring import package
from otel_kvtransfer.wiring.startup import installed_build
from otel_kvtransfer.engines import mooncake as backend
import mooncake.engine
found = []
for entry in package._instruments_any:
    try:
        found.append(m.distribution(entry.split(" ")[0]).metadata["Name"])
    except m.PackageNotFoundError:
        pass
conflict = get_dist_dependency_conflicts(m.distribution("otel_kvtransfer"))
print(json.dumps({"installed": found, "conflict": str(conflict) if conflict else None,
                  "build": installed_build(backend.DISTRIBUTIONS, backend.modules())}))
"""


def test_the_build_alone_switches_the_instrumentation_on(venv):
    """Of every distribution `instruments-any` names, the venv holds TokenSpeed's build alone, and
    opentelemetry-instrument's own check finds no conflict: it loads the instrumentor for this build."""
    python, env = venv
    done = subprocess.run([python, "-I", "-c", _GATE], env=env, capture_output=True, text=True, timeout=120,
                          check=False, cwd=os.path.dirname(python))
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["installed"] == [BUILD] and found["conflict"] is None, found
    assert found["build"][0] == BUILD and found["build"][1].startswith("0.3.")
    assert BUILD in mooncake.DISTRIBUTIONS


def test_only_the_cuda_driver_is_a_stand_in(venv):
    """The engine library loads the stand-in for libcuda.so.1 alone (every other library is the wheel's or the
    system's; the CUDA runtime is NVIDIA's wheel), and the stand-in defines exactly the driver calls the package's
    libraries import."""
    require_part(all(shutil.which(tool) for tool in ("ldd", "nm")), "ldd and nm (binutils)")
    python, env = venv
    engine = subprocess.run([python, "-c", "import mooncake.engine as m; print(m.__file__)"], env=env,
                            capture_output=True, text=True, timeout=120, check=True).stdout.strip()
    standin = os.path.join(os.path.dirname(os.path.dirname(python)), "standin-driver")
    linked = {}
    for line in subprocess.run(["ldd", engine], env=env, capture_output=True, text=True, timeout=60,
                               check=True).stdout.splitlines():
        name, _, where = line.strip().partition(" => ")
        linked[name] = where.split(" (")[0]
    assert "not found" not in " ".join(linked.values()), linked
    assert [n for n, where in linked.items() if where.startswith(standin)] == ["libcuda.so.1"]
    assert linked["libcudart.so.13"].endswith(os.path.join("nvidia", "cu13", "lib", "libcudart.so.13"))

    def symbols(*options, path):
        out = subprocess.run(["nm", "-D", *options, path], capture_output=True, text=True, timeout=60,
                             check=True).stdout
        return {line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()}

    package = os.path.dirname(engine)
    imported = set()
    for name in os.listdir(package):
        if name.endswith(".so"):
            imported |= {s for s in symbols("--undefined-only", path=os.path.join(package, name))
                         if re.match(r"^cu[A-Z]", s)}
    assert len(imported) > 10 and symbols("--defined-only", path=os.path.join(standin, "libcuda.so.1")) == imported


def test_a_user_script_under_opentelemetry_instrument_exports_one_send_per_write(venv, tmp_path):
    """With OTEL_TRACES_EXPORTER=kvtransfer_file: one send per write call of every kind, exact bytes and
    descriptors, the `*_on_cuda` calls failed sends (no GPU); the bytes of every other call arrived; the start-up
    line names the build."""
    python, env = venv
    span_file, out = tmp_path / "spans.jsonl", tmp_path / "out.json"
    env = dict(env, OTEL_TRACES_EXPORTER="kvtransfer_file", OTEL_KVTRANSFER_SPAN_FILE=str(span_file),
               OTEL_METRICS_EXPORTER="none", OTEL_LOGS_EXPORTER="none")
    instrument = os.path.join(os.path.dirname(python), "opentelemetry-instrument")
    done = netns.run([instrument, python, os.path.join(APPS, "tokenspeed_mooncake_user_app.py"), str(out)], env,
                     RUN_TIMEOUT_S, cwd=str(tmp_path))
    assert done.returncode == 0 and out.exists(), done.stderr[-4000:]
    assert re.search(r"engines: mooncake 0\.3\.\S+ \(tokenspeed-mooncake\)", done.stderr), done.stderr[-4000:]
    calls = json.loads(out.read_text())
    assert len(calls) == 12 and len({c["bytes"] for c in calls}) == 12
    cuda = [c for c in calls if c["call"].endswith("_on_cuda")]
    assert len(cuda) == 2 and all(c.get("raised") for c in cuda)
    assert all(c["arrived"] and "raised" not in c for c in calls if c not in cuda), calls
    sends = [s for s in spans_when(str(span_file), len(calls)) if s.name == semconv.SPAN_SEND]
    made = sorted((c["bytes"], c["descriptors"], c.get("raised")) for c in calls)
    exported = sorted((s.attributes[semconv.BYTES], s.attributes[semconv.DESCRIPTOR_COUNT],
                       s.attributes.get(semconv.ERROR_TYPE)) for s in sends)
    assert exported == made
    assert {(s.attributes[semconv.OP], s.attributes[semconv.BACKEND], s.attributes[semconv.PROTOCOL])
            for s in sends} == {("write", mooncake.BACKEND, "tcp")}
