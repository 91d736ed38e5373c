"""A scrape endpoint that exposes an SDK MeterProvider's metrics the way the Collector's `prometheus` exporter does.

Why not opentelemetry-exporter-prometheus: its metric *names* are the same as the Collector's for every metric
of this package (tests/deployments/test_prometheus_dashboard.py checks that), but it exposes no exemplars and keeps
`service.name` / `service.instance.id` in `target_info` only, while the Collector's exporter (with
`enable_open_metrics: true`, as in collector/agent.yaml) puts exemplars (trace_id, span_id) on the buckets and
sets the `job` / `instance` labels from those resource attributes. The dashboard relies on both, so this
endpoint reproduces the Collector's exposition (exporter/prometheusexporter/collector.go in
opentelemetry-collector-contrib): names and labels through `promnames`, cumulative buckets, one
exemplar per bucket, `otel_scope_*` labels, `target_info`, OpenMetrics text.
"""

import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.sdk.metrics.export import Gauge, Histogram, Sum

from support.observability.promnames import COUNTER, GAUGE, HISTOGRAM, job_and_instance, label_name, metric_name

CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def _escape(value) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(pairs) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs) + "}" if pairs else ""


def _number(value) -> str:
    if isinstance(value, float):
        if math.isinf(value):
            return "+Inf" if value > 0 else "-Inf"
        return repr(value)
    return str(value)


def _exemplar(exemplar) -> str:
    pairs = []
    if exemplar.trace_id:
        pairs.append(("trace_id", format(exemplar.trace_id, "032x")))
    if exemplar.span_id:
        pairs.append(("span_id", format(exemplar.span_id, "016x")))
    return f" # {_labels(pairs) or '{}'} {_number(float(exemplar.value))} {exemplar.time_unix_nano / 1e9:.3f}"


def render(metrics_data) -> str:
    """OpenMetrics text for one MetricsData, as the Collector's prometheus exporter would expose it."""
    families = {}  # name -> (type, help, [lines])
    info_lines = []
    for resource_metrics in metrics_data.resource_metrics if metrics_data else []:
        resource = dict(resource_metrics.resource.attributes)
        job, instance = job_and_instance(resource)
        identity = [(k, v) for k, v in (("job", job), ("instance", instance)) if v is not None]
        info = [(label_name(k), v) for k, v in sorted(resource.items())
                if k not in ("service.name", "service.namespace", "service.instance.id")]
        info_lines.append(f"target_info{_labels(identity + info)} 1")
        for scope_metrics in resource_metrics.scope_metrics:
            scope = scope_metrics.scope
            scope_labels = [("otel_scope_name", scope.name), ("otel_scope_version", scope.version or ""),
                            ("otel_scope_schema_url", scope.schema_url or "")]
            for metric in scope_metrics.metrics:
                data = metric.data
                if isinstance(data, Histogram):
                    kind, prom_type = HISTOGRAM, "histogram"
                elif isinstance(data, Sum) and data.is_monotonic:
                    kind, prom_type = COUNTER, "counter"
                elif isinstance(data, (Sum, Gauge)):
                    kind, prom_type = GAUGE, "gauge"
                else:
                    continue
                name = metric_name(metric.name, metric.unit or "", kind)
                _, _, lines = families.setdefault(name, (prom_type, metric.description or "", []))
                for point in data.data_points:
                    base = [(label_name(k), v) for k, v in sorted(dict(point.attributes).items())]
                    base += scope_labels + identity
                    if kind == HISTOGRAM:
                        bounds = list(point.explicit_bounds) + [math.inf]
                        by_bucket = {}
                        for exemplar in getattr(point, "exemplars", None) or []:
                            index = next(i for i, b in enumerate(bounds) if exemplar.value <= b)
                            by_bucket[index] = exemplar
                        cumulative = 0
                        for index, (bound, count) in enumerate(zip(bounds, point.bucket_counts)):
                            cumulative += count
                            text = f"{name}_bucket{_labels(base + [('le', _number(float(bound)))])} {cumulative}"
                            if index in by_bucket:
                                text += _exemplar(by_bucket[index])
                            lines.append(text)
                        lines.append(f"{name}_sum{_labels(base)} {_number(float(point.sum))}")
                        lines.append(f"{name}_count{_labels(base)} {point.count}")
                    elif kind == COUNTER:
                        text = f"{name}{_labels(base)} {_number(point.value)}"
                        exemplars = getattr(point, "exemplars", None) or []
                        if exemplars:
                            text += _exemplar(exemplars[-1])
                        lines.append(text)
                    else:
                        lines.append(f"{name}{_labels(base)} {_number(point.value)}")
    out = []
    for name, (prom_type, description, lines) in sorted(families.items()):
        family = name[: -len("_total")] if prom_type == "counter" else name  # OpenMetrics: family w/o _total
        if description:
            out.append(f"# HELP {family} {_escape(description)}")
        out.append(f"# TYPE {family} {prom_type}")
        out.extend(lines)
    if info_lines:
        out.append("# TYPE target_info gauge")
        out.extend(info_lines)
    out.append("# EOF")
    return "\n".join(out) + "\n"


class ScrapeEndpoint:
    """Serves `render(reader.get_metrics_data())` on http://127.0.0.1:<port>/metrics."""

    def __init__(self, reader, host: str = "127.0.0.1", port: int = 0):
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404)
                    return
                body = render(endpoint.reader.get_metrics_data()).encode()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # keep the workload's stdout/stderr for its own protocol
                return

        self.reader = reader
        self.server = ThreadingHTTPServer((host, port), Handler)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name="scrape-endpoint", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
