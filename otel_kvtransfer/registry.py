"""The backends the package knows, by module name: a new transfer engine is one module (or package) in `engines/`
and a line in ENGINES, a new serving framework one package in `frameworks/` and a line in FRAMEWORKS. Loaded by
name, so the code that loads them (the instrumentor, the builder process) depends on none of them. Each one
declares itself in one frozen spec (`SPEC`: a `recording.patching.EngineSpec` or `FrameworkSpec`) and patches
through one `wiring.lazy_patcher.LazyPatcher` driven by it; tests/project/test_backend_contract.py holds every one
listed here to that contract on the real libraries.
"""

import importlib
import logging
from types import ModuleType
from typing import Iterable, List

_logger = logging.getLogger(__name__)

# Each exposes SPEC, instrument() -> bool, uninstrument(), modules(), patcher, and the views of its spec
# (DISTRIBUTIONS, SUPPORTED; an engine's BACKEND, SETUP_IN_FIRST_CALL, peer_attributes; a framework's FRAMEWORK).
ENGINES = ("otel_kvtransfer.engines.mooncake", "otel_kvtransfer.engines.nixl")
FRAMEWORKS = ("otel_kvtransfer.frameworks.sglang", "otel_kvtransfer.frameworks.vllm",
              "otel_kvtransfer.frameworks.vllm_ascend")


def load(names: Iterable[str]) -> List[ModuleType]:
    loaded = []
    for name in names:
        try:
            loaded.append(importlib.import_module(name))
        except Exception:
            _logger.warning("otel_kvtransfer: could not load %s", name, exc_info=True)
    return loaded
