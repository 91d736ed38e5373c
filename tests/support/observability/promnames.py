"""The OpenTelemetry Collector's OTel -> Prometheus naming, as a small function the tests (and readers) can run.

A port of what the Collector's `prometheus` exporter (and `prometheusremotewrite`) does with its default
translation strategy, `UnderscoreEscapingWithSuffixes`: github.com/prometheus/otlptranslator v1.0.0,
`normalizeName` / `buildUnitSuffixes` / `cleanUpUnit` (metric_namer.go, unit_namer.go) and `sanitizeLabelName`
(label_namer.go), which opentelemetry-collector-contrib's exporter/prometheusexporter calls
(collector.go: `metricNamer.Build`, `labelNamer.Build`). collector/README.md states the same rules in prose.

    metric_name("kv_transfer.throughput", "By/s", HISTOGRAM) == "kv_transfer_throughput_bytes_per_second"
    metric_name("kv_transfer.failures", "{transfer}", COUNTER) == "kv_transfer_failures_total"
    label_name("kv_transfer.backend") == "kv_transfer_backend"
"""

import re

COUNTER = "counter"  # monotonic sum
GAUGE = "gauge"  # gauge or non-monotonic sum
HISTOGRAM = "histogram"

# otlptranslator unitMap / perUnitMap.
UNIT_MAP = {
    "d": "days", "h": "hours", "min": "minutes", "s": "seconds", "ms": "milliseconds", "us": "microseconds",
    "ns": "nanoseconds",
    "By": "bytes", "KiBy": "kibibytes", "MiBy": "mebibytes", "GiBy": "gibibytes", "TiBy": "tibibytes",
    "KBy": "kilobytes", "MBy": "megabytes", "GBy": "gigabytes", "TBy": "terabytes",
    "m": "meters", "V": "volts", "A": "amperes", "J": "joules", "W": "watts", "g": "grams",
    "Cel": "celsius", "Hz": "hertz", "1": "", "%": "percent",
}
PER_UNIT_MAP = {"s": "second", "m": "minute", "h": "hour", "d": "day", "w": "week", "mo": "month", "y": "year"}

_INVALID_METRIC_CHARS = re.compile(r"[^a-zA-Z0-9:]+")


def _unit_suffixes(unit: str):
    main_suffix, per_suffix = "", ""
    tokens = unit.split("/", 1)
    main = tokens[0].strip()
    if main and "{" not in main and "}" not in main:  # annotations like {transfer} give no suffix
        main_suffix = UNIT_MAP.get(main, main)
    if len(tokens) > 1 and tokens[1] != "":
        per = tokens[1].strip()
        if per and "{" not in per and "}" not in per:
            per_suffix = PER_UNIT_MAP.get(per, per)
        if per_suffix:
            per_suffix = "per_" + per_suffix
    return main_suffix, per_suffix


def _clean_unit(unit: str) -> str:
    cleaned = re.sub(r"_+", "_", "".join(c if re.match(r"[a-zA-Z0-9:]", c) else "_" for c in unit))
    return cleaned[1:] if cleaned.startswith("_") else cleaned


def metric_name(name: str, unit: str, kind: str) -> str:
    """The Prometheus metric family name the Collector exposes for an OTel metric (before _bucket/_sum/_count)."""
    tokens = [t for t in _INVALID_METRIC_CHARS.split(name) if t]
    main, per = _unit_suffixes(unit or "")
    main, per = _clean_unit(main), _clean_unit(per)
    # addUnitTokens
    if main in tokens:
        main = ""
    if per == "per_":
        per = ""
    else:
        per = per[:-1] if per.endswith("_") else per
        if per in tokens:
            per = ""
    if per:
        main = main[:-1] if main.endswith("_") else main
    if main:
        tokens.append(main)
    if per:
        tokens.append(per)
    if kind == COUNTER:
        tokens = [t for t in tokens if t != "total"] + ["total"]
    # `_ratio` only for gauges with unit "1" (not histograms, not counters).
    if unit == "1" and kind == GAUGE:
        tokens = [t for t in tokens if t != "ratio"] + ["ratio"]
    result = "_".join(tokens)
    if result and result[0].isdigit():
        result = "_" + result
    return result


def label_name(name: str) -> str:
    """The Prometheus label name for an OTel attribute key: each run of other characters becomes one `_`."""
    out = re.sub(r"[^a-zA-Z0-9]+", "_", name)
    if out and out[0].isdigit():
        out = "key_" + out
    return out


def series_names(name: str, unit: str, kind: str):
    """Every sample name the family yields in the exposition."""
    family = metric_name(name, unit, kind)
    if kind == HISTOGRAM:
        return [family + "_bucket", family + "_sum", family + "_count"]
    return [family]


def job_and_instance(resource_attributes: dict):
    """`job` and `instance` labels from resource attributes, as the exporter's extractJob/extractInstance do."""
    service = resource_attributes.get("service.name")
    namespace = resource_attributes.get("service.namespace")
    job = f"{namespace}/{service}" if namespace and service else service
    return job, resource_attributes.get("service.instance.id")


# The package's metrics (docs/telemetry.md) and the names a Collector exposes them under.
DESIGN_METRICS = [
    ("kv_transfer.duration", "s", HISTOGRAM),
    ("kv_transfer.size", "By", HISTOGRAM),
    ("kv_transfer.throughput", "By/s", HISTOGRAM),
    ("kv_transfer.failures", "{transfer}", COUNTER),
    ("kv_transfer.request.duration", "s", HISTOGRAM),
    ("kv_transfer.request.size", "By", HISTOGRAM),
    ("kv_transfer.request.throughput", "By/s", HISTOGRAM),
    ("kv_transfer.request.compute_overlap", "1", HISTOGRAM),
    ("kv_transfer.receive.duration", "s", HISTOGRAM),
    ("kv_transfer.descriptors", "{descriptor}", HISTOGRAM),
    ("kv_transfer.instrumentation.dropped", "{record}", COUNTER),
    ("kv_transfer.request.tail", "s", HISTOGRAM),
    ("kv_transfer.request.tail_queued", "s", HISTOGRAM),
    ("kv_transfer.peer.throughput", "By/s", HISTOGRAM),
    ("kv_transfer.peer.busy_time", "s", COUNTER),
    ("kv_transfer.busy_time", "s", COUNTER),
    ("kv_transfer.inflight", "{item}", GAUGE),
    ("kv_transfer.inflight.oldest_age", "s", GAUGE),
    ("kv_transfer.stuck", "{item}", COUNTER),
    ("kv_transfer.connect.duration", "s", HISTOGRAM),
    ("kv_transfer.post.duration", "s", HISTOGRAM),
    ("kv_transfer.late_completions", "{transfer}", COUNTER),
    ("kv_transfer.receive.allocation_wait", "s", HISTOGRAM),
    ("kv_transfer.integrity_mismatches", "{request}", COUNTER),
]
