"""The one lazy patcher every engine and framework patches through, driven by its spec (`LazyPatcher(spec,
patcher)`, each backend's `HOOKS`): a leaf the engine modules import without the rest of wiring/ (nor the SDK
set-up it reaches); `wiring.activation` names it too, beside the frameworks' plugin hook.

`instrument()` patches each module the spec names now if it is imported, else the moment it is (wrapt post-import
hooks, registered once per process because wrapt keeps them forever; they consult the on/off state), and
`uninstrument()` undoes every patch, then lets the backend forget its own state. A framework's spec
(`FrameworkSpec`) is gated: its releases follow the declared range instead of pinning one (below the minimum, one
warning and nothing patched; past the range, patched, saying so once), and before a module is patched, what the
wrappers need from it (otel_kvtransfer.wiring.targets: classes, methods, parameters, attributes) is checked. A
miss, or a patch that fails, is named in one warning and then nothing of that backend stays patched. An engine's
spec is not gated: its calls are patched where the build has them.
"""

import logging
import sys
from importlib import metadata
from types import ModuleType
from typing import Callable, Dict, Optional, Tuple

import wrapt

from otel_kvtransfer.recording.patching import BackendSpec, Patch, Patcher, own_error

_logger = logging.getLogger(__name__)


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


def bounds(supported: str) -> Tuple[Tuple[int, ...], Optional[Tuple[int, ...]]]:
    """A spec's range as (minimum, below): ">=0.5.23, <0.6" -> ((0, 5, 23), (0, 6)); below is None when open."""
    minimum, below = None, None
    for part in supported.split(","):
        part = part.strip()
        if part.startswith(">="):
            minimum = version_tuple(part[2:].strip())
        elif part.startswith("<") and not part.startswith("<="):
            below = version_tuple(part[1:].strip())
    if not minimum:
        raise ValueError(f"a backend's range has no lower bound: {supported!r}")
    return minimum, below


class LazyPatcher:
    """One backend switched on and off as its spec says (module docstring): the gate, the import hooks, the state."""

    def __init__(self, spec: BackendSpec, patcher: Patcher):
        self.spec, self.patcher = spec, patcher
        self.minimum, self.below = bounds(spec.supported)  # the declared range: tested releases
        self.on = False
        self.blocked: Optional[str] = None  # what failed (nothing of the backend is patched)
        self._hooked = False
        self._warned = False
        self._checked: Dict[str, bool] = {}  # module name -> passed its target check (once per module)

    def modules(self) -> Tuple[str, ...]:
        """The library's modules its patches apply to (each patched when it is imported)."""
        return self.spec.modules

    def installed_version(self) -> Optional[str]:
        for distribution in self.spec.distributions:
            try:
                return metadata.version(distribution)
            except metadata.PackageNotFoundError:
                continue
            except Exception:
                return None
        return None

    def is_supported(self, text: Optional[str]) -> bool:
        """Inside the declared range (the releases the tests ran on)."""
        version = version_tuple(text) if text else ()
        return self.minimum <= version and (self.below is None or version < self.below)

    def is_newer(self, text: Optional[str]) -> bool:
        """Past the declared range: instrumented when its target check passes."""
        version = version_tuple(text) if text else ()
        return bool(version) and self.below is not None and version >= self.below

    def _warn_once(self, message: str, *args: object) -> None:
        if not self._warned:
            self._warned = True
            _logger.warning(message, *args)

    def _gate(self) -> bool:
        """A gated backend's release: absent or below the range, no (below: one warning); past it, yes (one warning)."""
        version = self.installed_version()
        if version is None:
            return False
        if not self.is_supported(version) and not self.is_newer(version):
            self._warn_once("otel_kvtransfer: %s %s is outside the supported range %s; %s is not instrumented",
                            self.spec.name, version, self.spec.supported, self.spec.name)
            return False
        if self.blocked is not None:
            return False
        if self.is_newer(version):
            self._warn_once("otel_kvtransfer: %s %s is newer than the tested range %s; instrumenting it because "
                            "what the wrappers use is checked as each module loads (a miss is named in a warning "
                            "and then nothing of %s is instrumented)", self.spec.name, version, self.spec.supported,
                            self.spec.name)
        return True

    def _passes_check(self, module_name: str, module: ModuleType) -> bool:
        """The module has what the wrappers read; on the first miss the whole backend is unpatched."""
        if module_name in self._checked:
            return self._checked[module_name]
        from otel_kvtransfer.wiring import targets as checks

        try:
            absent = checks.missing(module, checks.required(self.spec.targets().get(module_name, ())))
        except Exception:
            own_error(f"check {module_name}")
            absent = [f"{module_name} (could not be checked)"]
        self._checked[module_name] = not absent
        if absent:
            self._block(f"{module_name}: " + ", ".join(absent[:8]) + (" ..." if len(absent) > 8 else ""))
        return not absent

    def _block(self, what: str) -> None:
        """A target is missing or a patch failed: one warning naming it, and nothing of this backend stays patched."""
        if self.blocked is None:
            self.blocked = what
            _logger.warning("otel_kvtransfer: %s %s lacks what its instrumentation needs (%s); nothing of %s is "
                            "instrumented", self.spec.name, self.installed_version(), what, self.spec.name)
        self.patcher.unwrap_all()
        self.spec.forget()

    def _hook(self, patch: Patch) -> Callable[[ModuleType], None]:
        def on_import(module: ModuleType) -> None:
            if not self.on or self.blocked is not None or not self._passes_check(patch.module, module):
                return
            try:
                patch.apply(module)
            except Exception:  # a target the declared checks did not cover
                own_error(f"patch {patch.module}")
                self._block(f"{patch.module}: the patch failed")

        return on_import

    def instrument(self) -> bool:
        """Patch now or on import; False when the library is absent, too old, or failed its target check."""
        if not self.spec.available() or (self.spec.version_gate and not self._gate()) or self.blocked is not None:
            return False
        self.spec.prepare()
        if self.on:
            return True
        self.on = True
        for patch in self.spec.patches:
            if not self._hooked:
                wrapt.register_post_import_hook(self._hook(patch), patch.module)  # runs now if imported
            elif patch.module in sys.modules:
                self._hook(patch)(sys.modules[patch.module])
        self._hooked = True
        return self.blocked is None

    def uninstrument(self) -> None:
        """Undo every patch and forget the backend's own state (nothing when it was not on)."""
        if not self.on:
            return
        self.on = False
        self.patcher.unwrap_all()
        self.spec.forget()
