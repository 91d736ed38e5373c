"""An OTLP/HTTP trace receiver for tests, run inside a deployment's network namespace (127.0.0.1 only).

    python otlp_http_sink.py PORT OUT_DIR

Parses every POST /v1/traces body with opentelemetry-proto, as a collector does: a body that parses is answered
200 and kept as OUT_DIR/ok-<n>.pb; one that does not is answered 400 and kept as OUT_DIR/rejected-<n>.pb (a
collector drops it). GET /health answers 200. Stops on SIGTERM.
"""

import os
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

_COUNT = [0]
_LOCK = threading.Lock()


def _keep(out_dir: str, kind: str, body: bytes) -> None:
    with _LOCK:
        _COUNT[0] += 1
        number = _COUNT[0]
    path = os.path.join(out_dir, f"{kind}-{number:06d}.pb")
    with open(path + ".part", "wb") as handle:
        handle.write(body)
    os.replace(path + ".part", path)  # a reader never sees half a body


def main(argv) -> int:
    port, out_dir = int(argv[0]), argv[1]
    os.makedirs(out_dir, exist_ok=True)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self._answer(200 if self.path == "/health" else 404)

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            try:
                ExportTraceServiceRequest.FromString(body)
            except DecodeError:
                _keep(out_dir, "rejected", body)
                self._answer(400)
                return
            _keep(out_dir, "ok", body)
            self._answer(200)

        def _answer(self, code):
            self.send_response(code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    server.serve_forever()
    server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
