"""bench/gpu_check.py, the device check, where there is no device: one clear line and exit 0; its NIXL half on
host memory between two real NIXL agents in two processes; the wheels it unpacks treated as untrusted input.
No GPU is needed (none is here)."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import zipfile

import pytest
from support.parts import require_part
from support.paths import ROOT

SCRIPT = pathlib.Path(ROOT) / "bench" / "gpu_check.py"


def _run(tmp_path, *args, timeout=300):
    out = tmp_path / "gpu_check.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=tmp_path, check=False)
    return done, (json.loads(out.read_text()) if out.exists() else None)


def test_without_a_device_one_line_says_so_and_nothing_is_measured(tmp_path):
    done, result = _run(tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no device (") and "nothing measured" in lines[0]
    assert result["status"] == "no_device" and result["reason"]
    assert "compute" not in result and "nixl" not in result


def test_bad_arguments_are_one_line_and_exit_2(tmp_path):
    done, _ = _run(tmp_path, "--seconds", "0")
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0
    done, _ = _run(tmp_path, "--nixl-mib", "-1")
    assert done.returncode == 2


def test_nixl_writes_on_host_memory_between_two_processes(tmp_path):
    require_part(importlib.util.find_spec("nixl") is not None,
                 "NIXL (pip install --no-deps -r scripts/requirements-nixl.txt)")
    done, result = _run(tmp_path, "--nixl-memory", "DRAM", "--nixl-mib", "8", "--nixl-writes", "3",
                        "--nixl-descriptors", "4")
    # Exit 0 or 1: whether a send was slower than a memory copy is a timing, reported, not asserted here.
    assert done.returncode in (0, 1), done.stderr[-3000:]
    nixl = result["nixl"]
    assert "error" not in nixl, nixl.get("error")
    assert nixl["processes"] == 2 and "one_process_because" not in nixl
    checks = {c["check"]: c for c in nixl["checks"]}
    for name in ("every write DONE", "one send span per write", "each send's bytes and descriptors exact",
                 "the destination's bytes equal the source's"):
        assert checks[name]["ok"], checks[name]
    assert nixl["send_bytes"] == [8 << 20] and nixl["send_descriptors"] == [4] and nixl["send_spans"] == 3
    assert "no send faster than the device's own copy" in checks
    assert result["device"] is None and "compute" not in result
    assert done.stdout.splitlines()[-1].startswith("gpu_check: no device (")


def _wheel(folder, name, members):
    with zipfile.ZipFile(folder / name, "w") as wheel:
        for path, text in members.items():
            wheel.writestr(path, text)


def test_unpacked_wheels_stay_in_their_folder_and_fit_this_python(tmp_path):
    spec = importlib.util.spec_from_file_location("kvt_gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    target.mkdir()
    here = f"cp3{sys.version_info.minor}"
    _wheel(wheels, "pure-1.0-py3-none-any.whl", {
        "pure/__init__.py": "X = 1\n", "pure-1.0.dist-info/METADATA": "Name: pure\n",
        "pure-1.0.data/purelib/extra_mod.py": "Y = 2\n", "pure-1.0.data/scripts/tool": "#!/bin/sh\n",
        "../escaped.py": "bad\n", "/abs_escaped.py": "bad\n", "pure/../../escaped_too.py": "bad\n"})
    _wheel(wheels, f"native-1.0-{here}-{here}-linux_x86_64.whl", {"native.py": "Z = 3\n"})
    _wheel(wheels, "stable-1.0-cp38-abi3-linux_x86_64.whl", {"stable.py": "S = 4\n"})
    _wheel(wheels, "other-1.0-cp39-cp39-linux_x86_64.whl" if sys.version_info.minor != 9
           else "other-1.0-cp310-cp310-linux_x86_64.whl", {"other.py": "O = 5\n"})
    saved = list(sys.path)
    try:
        report = gpu_check.unpack_wheels(str(wheels), str(target))
        assert sys.path[0] == str(target)
    finally:
        sys.path[:] = saved
    assert sorted(report["unpacked"]) == sorted(["pure-1.0-py3-none-any.whl", "stable-1.0-cp38-abi3-linux_x86_64.whl",
                                                 f"native-1.0-{here}-{here}-linux_x86_64.whl"])
    assert len(report["left_out_for_another_python"]) == 1
    files = sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file())
    assert files == ["extra_mod.py", "native.py", "pure-1.0.dist-info/METADATA", "pure/__init__.py", "stable.py"]
    assert not (tmp_path / "escaped.py").exists() and not os.path.exists("/abs_escaped.py")
    assert not (tmp_path / "escaped_too.py").exists()


@pytest.mark.parametrize("name", ["short.whl", "a-b-c.whl"])
def test_a_wheel_name_without_its_tags_is_left_out(name):
    spec = importlib.util.spec_from_file_location("kvt_gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert gpu_check.wheel_fits_this_python(name) is False
