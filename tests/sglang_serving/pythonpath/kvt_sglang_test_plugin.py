"""TEST-ONLY sglang plugin (entry point group `sglang.srt.plugins`), loaded by sglang in every process it serves
with (engine, scheduler, detokenizer), found through the dist-info folder beside it on PYTHONPATH.

1. Stand-in for what cannot run here: `MooncakeKVSender.supports_host_tensor_indices` is hard-coded True in
   sglang 0.5.23 and makes the sender stage page indices through pinned memory and a CUDA event; on this CPU-only
   machine it is set False, so sglang takes its plain host path.
2. Test plumbing: each process serves its OpenTelemetry Prometheus endpoint on a port of its own
   (OTEL_EXPORTER_PROMETHEUS_PORT=0, as sglang's processes share one environment); when
   KVT_TEST_PROMETHEUS_SD_DIR is set, this writes the port the process got as a Prometheus file_sd target, so the
   real Prometheus finds every engine process.
"""

import json
import os
import sys

_MOONCAKE_CONN = "sglang.srt.disaggregation.mooncake.conn"
_ROLES = {"run_scheduler_process": "scheduler", "run_detokenizer_process": "detokenizer",
          "run_data_parallel_controller_process": "dp_controller"}


def _host_indices_off(module) -> None:
    module.MooncakeKVSender.supports_host_tensor_indices = False


def _role() -> str:
    frame = sys._getframe(1)  # pylint: disable=protected-access
    while frame is not None:
        role = _ROLES.get(frame.f_code.co_name)
        if role:
            return role
        frame = frame.f_back
    return "engine"


def _prometheus_port():
    """The port of the Prometheus HTTP server that OTEL_METRICS_EXPORTER=prometheus started in this process."""
    import gc  # pylint: disable=import-outside-toplevel
    from wsgiref.simple_server import WSGIServer  # pylint: disable=import-outside-toplevel

    # type(o), not isinstance(o): no __class__ look-up on lazy modules (torch warns on those)
    ports = [o.server_address[1] for o in gc.get_objects() if issubclass(type(o), WSGIServer)]
    return ports[0] if len(ports) == 1 else None


def _publish_metrics_target(directory: str) -> None:
    port = _prometheus_port()
    if port is None:
        return
    labels = {"pid": str(os.getpid()), "sglang_process": _role(),
              "service": os.environ.get("OTEL_SERVICE_NAME", "")}
    path = os.path.join(directory, f"{os.getpid()}.json")
    with open(path + ".tmp", "w", encoding="utf-8") as out:
        json.dump([{"targets": [f"127.0.0.1:{port}"], "labels": labels}], out)
    os.replace(path + ".tmp", path)  # Prometheus never reads a half-written file


def activate() -> None:
    if _MOONCAKE_CONN in sys.modules:
        _host_indices_off(sys.modules[_MOONCAKE_CONN])
    else:
        import wrapt  # pylint: disable=import-outside-toplevel

        wrapt.register_post_import_hook(_host_indices_off, _MOONCAKE_CONN)
    directory = os.environ.get("KVT_TEST_PROMETHEUS_SD_DIR")
    if directory and os.path.isdir(directory):
        _publish_metrics_target(directory)
