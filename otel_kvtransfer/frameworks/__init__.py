"""One package per serving framework: it finds where the framework decides what a transfer is for and opens and
closes request / transfer / peer scopes through `integration`; it never times engine calls itself. Each package
declares itself in one `recording.patching.FrameworkSpec` (switched on through `wiring.activation.LazyPatcher`);
`registry.FRAMEWORKS` lists them."""
