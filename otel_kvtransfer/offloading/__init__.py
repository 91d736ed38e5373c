"""The builder process (OTEL_KVTRANSFER_BUILDER=process, and `auto` when the SDK came from OTEL_*): spans and
metrics built in a helper process instead of the engine's. The engine side is `link` (the recorder's sink: frames
out, acknowledgements back, drops counted once) and `lifecycle` (starting, replacing and reaping helpers); the
helper side is `helper_process`; `wire` is the frame format both read.
"""
