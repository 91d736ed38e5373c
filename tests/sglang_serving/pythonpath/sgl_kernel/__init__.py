"""TEST-ONLY STAND-IN for `sgl_kernel` (import only): sglang imports names from it at module level, and its CPU
build is on no package registry this project can reach (both PyPI kernel wheels are CUDA-only).

Every name resolves to a function that raises when called: on a CPU without AMX sglang runs plain torch layers and
calls none of them, so a call reaching one is a real bug the tests must see, not something to paper over.
The submodules in SUBMODULES resolve the same way; any other submodule import fails with ImportError, as it does
without sgl_kernel, so sglang's own fallbacks for a missing kernel (e.g. `sgl_kernel.scalar_type`) apply.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+stand-in"
# the submodules sglang 0.5.23 imports names from, unguarded, on the CPU serving path
SUBMODULES = frozenset({"kvcacheio"})


class StandInCalled(RuntimeError):
    """A kernel of the import-only sgl_kernel stand-in was called."""


def _stub(qualified: str):
    def kernel(*_args, **_kwargs):
        raise StandInCalled(f"{qualified} is an import-only stand-in (tests/sglang_serving); it cannot run here")

    kernel.__name__ = qualified.rsplit(".", 1)[-1]
    kernel.__qualname__ = qualified
    return kernel


def _module_getattr(module_name: str):
    def __getattr__(name: str):  # PEP 562: `from sgl_kernel... import anything`
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub(f"{module_name}.{name}")

    return __getattr__


__getattr__ = _module_getattr(__name__)


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes `sgl_kernel.<sub>` (sub in SUBMODULES) an empty module with the same stub attributes."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + ".") and fullname[len(__name__) + 1:] in SUBMODULES:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module):
        pass


if not any(isinstance(f, _SubmoduleFinder) for f in sys.meta_path):
    sys.meta_path.append(_SubmoduleFinder())
