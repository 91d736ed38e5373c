"""One package per serving framework: it finds where the framework decides what a transfer is for and opens and
closes request / transfer / peer scopes through `integration`; it never times engine calls itself. Each package
is a `recording.patching.Framework` (switched on through `wiring.activation.FrameworkHooks`);
`registry.FRAMEWORKS` lists them."""
