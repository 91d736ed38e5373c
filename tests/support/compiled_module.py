"""The package's compiled part loaded from a build of the tests' choosing (scripts/stress-compiled.sh builds it
with sanitizers), in place of the installed one: before anything imports the package's module of that name."""

import importlib.util
import os
import sys

NAME = "otel_kvtransfer.engines.mooncake._async_compiled"
VARIABLE = "KVT_COMPILED_MODULE"  # the path of that build, for the test session


def load(path: str) -> None:
    spec = importlib.util.spec_from_file_location(NAME, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{VARIABLE}: {path!r} is no loadable extension module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[NAME] = module
    spec.loader.exec_module(module)


def load_chosen() -> None:
    """The build named by KVT_COMPILED_MODULE, when it names one."""
    path = os.environ.get(VARIABLE)
    if path:
        load(path)
