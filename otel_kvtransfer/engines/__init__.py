"""One module per transfer engine: it wraps the engine's calls, times them and hands `records` call tuples to
`integration.deliver` or `pending.PendingTransfers`; nothing else (no spans, no metrics, no framework knowledge).
Each module declares itself in one `recording.patching.EngineSpec` (its patching through
`wiring.lazy_patcher.LazyPatcher`); `registry.ENGINES` lists them."""
