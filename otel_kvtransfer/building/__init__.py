"""Runs in the builder: the recorder's thread of the engine process, or the builder process
(OTEL_KVTRANSFER_BUILDER). Turns records into spans (stitched under their request), the speed metrics and the
stuck reports, and hands them to the OpenTelemetry SDK's processors and exporters. Never on an engine thread.
"""
