"""One module per transfer engine: it wraps the engine's calls, times them and hands `records` call tuples to
`integration.deliver` or `pending.PendingTransfers`; nothing else (no spans, no metrics, no framework knowledge).
Each module is a `recording.patching.Engine` (its patching through `recording.patching.LazyPatch`);
`registry.ENGINES` lists them."""
