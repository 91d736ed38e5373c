"""One module per transfer engine: it wraps the engine's calls, times them and hands `records` call tuples to
`integration.deliver` or `pending.PendingTransfers`; nothing else (no spans, no metrics, no framework knowledge).
Each module exposes BACKEND, instrument() -> bool, uninstrument() and peer_attributes(peer); the instrumentor's
ENGINES lists them."""
