"""One package per serving framework: it finds where the framework decides what a transfer is for and opens and
closes request / transfer / peer scopes through `integration`; it never times engine calls itself. Each package
exposes FRAMEWORK, instrument() -> bool and uninstrument(); the instrumentor's FRAMEWORKS lists them."""
