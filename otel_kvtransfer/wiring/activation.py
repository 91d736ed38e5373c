"""How a framework package is switched on: a version gate, lazy patching, and the framework's own plugin hook.

Every framework package does the same three things, so they live here once:
- `FrameworkHooks.instrument()` follows releases instead of pinning one: below the declared minimum, one warning
  and nothing patched; inside the declared (tested) range, or past it, each of the framework's modules is patched
  now if it is imported, else the moment it is (wrapt post-import hooks, registered once per process because
  wrapt keeps them forever; they consult the on/off state). Past the range it says so once. Before a module is
  patched, what the wrappers need from it (otel_kvtransfer.wiring.targets: classes, methods, parameters, attributes) is
  checked; when anything is missing, one warning names it and nothing of that framework stays patched.
- `activate_plugin()` is what a framework's plugin entry point calls in every process the framework starts: it
  respects OTEL_PYTHON_DISABLED_INSTRUMENTATIONS, sets up the SDK from the standard OTEL_* variables when nobody
  has (saying in one log line where spans go when no exporter is configured), and instruments once.
"""

import logging
import os
import sys
from importlib import metadata
from typing import Callable, Dict, Iterable, Optional, Tuple

from otel_kvtransfer.building.sdk_setup import configure_sdk_if_absent
from otel_kvtransfer.recording.patching import own_error

_logger = logging.getLogger(__name__)

ENTRY_POINT_NAME = "kv_transfer"  # the opentelemetry_instrumentor entry point, also the name to disable


def version_tuple(text: str) -> Tuple[int, ...]:
    """'0.5.23.post1' -> (0, 5, 23); stops at the first part that is not a plain number."""
    parts = []
    for piece in str(text).split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if digits != piece:
            break
    return tuple(parts)


class FrameworkHooks:
    """Version policy + target check + lazy patching of one framework's modules."""

    def __init__(self, name: str, distributions: Iterable[str], minimum: Tuple[int, ...], below: Tuple[int, ...],
                 patches: Callable[[], Dict[str, Callable]], patcher=None, forget: Callable[[], None] = None,
                 targets: Optional[Callable[[], Dict[str, list]]] = None):
        self.name = name
        self._patcher = patcher  # the framework's Patcher: unwrapped on uninstrument
        self._forget = forget  # drops the framework's own per-request bookkeeping on uninstrument
        self.distributions = tuple(distributions)
        self.minimum, self.below = minimum, below  # the declared range: tested releases
        self.supported = (f">={'.'.join(map(str, minimum))}, <{'.'.join(map(str, below))}")
        self._patches = patches  # module name (optionally '#tag' for a second patch of it) -> patch(module)
        self._targets = targets  # module name -> [targets.Target]: what the wrappers need from it
        self.on = False
        self.blocked: Optional[str] = None  # what failed the target check (nothing of the framework is patched)
        self._hooked = False
        self._warned = False
        self._checked: Dict[str, bool] = {}  # module name -> passed its target check (once per module)

    def modules(self) -> Tuple[str, ...]:
        """The framework's modules its patches apply to, in patch order (each patched when it is imported)."""
        return tuple(dict.fromkeys(key.split("#", 1)[0] for key in self._patches()))

    def installed_version(self) -> Optional[str]:
        for distribution in self.distributions:
            try:
                return metadata.version(distribution)
            except metadata.PackageNotFoundError:
                continue
            except Exception:
                return None
        return None

    def is_supported(self, text: Optional[str]) -> bool:
        """Inside the declared range (the releases the tests ran on)."""
        return bool(text) and self.minimum <= version_tuple(text) < self.below

    def is_newer(self, text: Optional[str]) -> bool:
        """Past the declared range: instrumented when its target check passes."""
        return bool(text) and bool(version_tuple(text)) and version_tuple(text) >= self.below

    def _warn_once(self, message: str, *args) -> None:
        if not self._warned:
            self._warned = True
            _logger.warning(message, *args)

    def _passes_check(self, module_name: str, module) -> bool:
        """The module has what the wrappers read; on the first miss the whole framework is unpatched."""
        if module_name in self._checked:
            return self._checked[module_name]
        from otel_kvtransfer.wiring import targets as checks

        try:
            wanted = checks.required((self._targets() if self._targets else {}).get(module_name, ()))
            absent = checks.missing(module, wanted)
        except Exception:
            own_error(f"check {module_name}")
            absent = [f"{module_name} (could not be checked)"]
        self._checked[module_name] = not absent
        if absent:
            self._block(f"{module_name}: " + ", ".join(absent[:8]) + (" ..." if len(absent) > 8 else ""))
        return not absent

    def _block(self, what: str) -> None:
        """A target is missing: one warning naming it, and nothing of this framework stays patched."""
        if self.blocked is None:
            self.blocked = what
            _logger.warning("otel_kvtransfer: %s %s lacks what its instrumentation needs (%s); nothing of %s is "
                            "instrumented", self.name, self.installed_version(), what, self.name)
        if self._patcher is not None:
            self._patcher.unwrap_all()
        if self._forget is not None:
            self._forget()

    def _hook(self, key: str, patch: Callable) -> Callable:
        module_name = key.split("#", 1)[0]

        def on_import(module):
            if not self.on or self.blocked is not None or not self._passes_check(module_name, module):
                return
            try:
                patch(module)
            except Exception:  # a target the declared checks did not cover
                own_error(f"patch {key}")
                _logger.debug("otel_kvtransfer could not patch %s", key, exc_info=True)
                self._block(f"{key}: the patch failed")

        return on_import

    def instrument(self) -> bool:
        """Patch now or on import; False when the framework is absent, too old, or failed its target check."""
        version = self.installed_version()
        if version is None:
            return False
        if not self.is_supported(version) and not self.is_newer(version):
            self._warn_once("otel_kvtransfer: %s %s is outside the supported range %s; %s is not instrumented",
                            self.name, version, self.supported, self.name)
            return False
        if self.blocked is not None:
            return False
        if self.is_newer(version):
            self._warn_once("otel_kvtransfer: %s %s is newer than the tested range %s; instrumenting it because "
                            "what the wrappers use is checked as each module loads (a miss is named in a warning "
                            "and then nothing of %s is instrumented)", self.name, version, self.supported, self.name)
        if self.on:
            return True
        self.on = True
        import wrapt

        for key, patch in self._patches().items():
            module_name = key.split("#", 1)[0]
            if not self._hooked:
                wrapt.register_post_import_hook(self._hook(key, patch), module_name)  # runs now if imported
            elif module_name in sys.modules:
                self._hook(key, patch)(sys.modules[module_name])
        self._hooked = True
        return self.blocked is None

    def uninstrument(self) -> None:
        """Undo every patch and forget the framework's bookkeeping (nothing when it was not on)."""
        if not self.on:
            return
        self.on = False
        if self._patcher is not None:
            self._patcher.unwrap_all()
        if self._forget is not None:
            self._forget()


def is_disabled() -> bool:
    names = os.environ.get("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "")
    wanted = {n.strip() for n in names.split(",") if n.strip()}
    return ENTRY_POINT_NAME in wanted or "*" in wanted


def activate_plugin(framework: str) -> None:
    """What a framework's plugin entry point does; never raises into the framework."""
    if is_disabled():
        return
    try:
        from otel_kvtransfer.wiring.instrumentor import KVTransferInstrumentor

        instrumentor = KVTransferInstrumentor()
        if instrumentor.is_instrumented_by_opentelemetry:
            return
        configure_sdk_if_absent(framework)
        instrumentor.instrument()
    except Exception:
        _logger.warning("otel_kvtransfer: the %s plugin could not activate the instrumentation", framework,
                        exc_info=True)
