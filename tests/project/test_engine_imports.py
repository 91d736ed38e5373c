"""The engine modules patch through the one lazy patcher (`wiring.lazy_patcher`), a leaf: importing an engine
module reaches nothing else of wiring/ (but the patcher's target check, `wiring.targets`, which imports nothing of
the package), nor building/ or offloading/ (the SDK set-up, the builder), through any chain of the package's own
imports, deferred ones included (read from the source, as tests/project/test_layout.py reads them)."""

from test_layout import MODULES, _imports

LEAF = "wiring.lazy_patcher"
LEAVES = (LEAF, "wiring.targets", "wiring.__init__")
KEPT_OUT = ("wiring", "building", "offloading")


def _module_of(target: str) -> str:
    """The package module an import names: the module itself, or a package's __init__."""
    return target if target in MODULES else f"{target}.__init__"


def _reached(start: str) -> set:
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module in seen or module not in MODULES:
            continue
        seen.add(module)
        todo.extend(_module_of(target) for target, _ in _imports(module, MODULES[module]))
    return seen


def _kept_out(reached: set) -> list:
    return sorted(module for module in reached
                  if module.split(".")[0] in KEPT_OUT and module not in LEAVES)


def test_the_engines_reach_only_the_lazy_patcher_of_wiring():
    engines = [module for module in MODULES if module.startswith("engines.")]
    assert len(engines) > 5
    for module in engines:
        reached = _reached(module)
        assert not _kept_out(reached), f"{module} reaches {_kept_out(reached)}"
    assert LEAF in _reached("engines.mooncake.__init__")


def test_the_check_sees_a_module_of_wiring_reached():
    """Not vacuous: the plugin hook's module reaches the SDK set-up."""
    assert "building.sdk_setup" in _kept_out(_reached("wiring.activation"))
