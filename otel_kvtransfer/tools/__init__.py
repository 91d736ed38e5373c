"""Offline tools for span files: read them (`source`, `spanfile`), group them into requests with the figures of
`otel_kvtransfer.building.aggregate` (`requests`, `reading`), and show them (`summarize`, `timeline/`, `perfetto`);
`cli` is the `otel-kvtransfer` command. docs/tools.md maps the modules.

Nothing here is imported by the instrumentation; these modules import only `semconv`, `aggregate` and the span
file encoding of `otel_kvtransfer.building.file_exporter` from the core.
"""
