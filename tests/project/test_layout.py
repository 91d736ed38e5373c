"""The package's folders say where code runs, and imports run one way: a module imports only from its own folder
or from folders below it, deferred (function-level) imports included, never another folder's private names (nor
reads a private attribute of an object another folder owns), and no module imports itself back through others
(read from the source: a deferred import closes a circle that importing the modules would never show).

From the bottom: the shared leaves (names, settings, the backend registry, the version), recording/ (the engine's
threads), building/ (the builder), offloading/ (the builder process and its link), wiring/ (start-up), engines/,
frameworks/, tools/, demo/, and the entry points (the CLI, `python -m`, the package's own public face). The
instrumentor loads engines and frameworks by their module names (registry.py), so nothing below them imports them.
"""

import ast
import pathlib

import pytest
from support import private_reads

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "otel_kvtransfer"

LAYERS = (
    ("semconv", "config", "registry", "version", "sdk_internals"),
    ("recording",),
    ("building",),
    ("offloading",),
    ("wiring",),
    ("engines",),
    ("frameworks",),
    ("tools",),
    ("demo",),
    ("cli", "__main__", "__init__"),
)
# Names the OpenTelemetry contrib convention spells with an underscore and reads across modules.
SHARED_PRIVATE = {"_instruments", "_instruments_any"}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        yield ".".join(parts), path


def _layer(module: str) -> int:
    """The layer of a module (dotted, relative to the package): the most specific entry of LAYERS that names it."""
    best, best_len = None, -1
    for level, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best_len:
                best, best_len = level, len(name)
    assert best is not None, f"{module} sits in no layer: add its folder to LAYERS"
    return best


def _folder(module: str) -> str:
    return module.split(".")[0]


def _imports(module: str, path: pathlib.Path):
    """(imported module relative to the package, imported names) for every import of the package's own code."""
    package = module.split(".")[:-1]  # a module's own package (for __init__: the package itself)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and (node.module == "otel_kvtransfer" or node.module.startswith("otel_kvtransfer.")):
                target = node.module[len("otel_kvtransfer") + 1:]
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                file = PACKAGE / sub.replace(".", "/")
                is_module = file.with_suffix(".py").exists() or file.is_dir()
                yield (sub, ()) if is_module else (target or "__init__", (alias.name,))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("otel_kvtransfer."):
                    yield alias.name[len("otel_kvtransfer") + 1:], ()


MODULES = dict(_modules())


def test_every_module_has_a_layer():
    assert len(MODULES) > 40
    for module in MODULES:
        _layer(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_run_downward(module):
    mine = _layer(module)
    upward = [target for target, _ in _imports(module, MODULES[module])
              if _folder(target) != _folder(module) and _layer(target) > mine]
    assert not upward, f"{module} (layer {mine}) imports from above it: {upward}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_names_across_folders(module):
    borrowed = [f"{target}.{name}" for target, names in _imports(module, MODULES[module]) for name in names
                if name.startswith("_") and not name.startswith("__") and name not in SHARED_PRIVATE
                and _folder(target) != _folder(module)]
    assert not borrowed, f"{module} reads another folder's private names: {borrowed}"


def _crossings(module: str, source: str) -> list:
    """Private attributes `module` reads (or sets, or names to getattr) of objects another folder's code owns: the
    owner is where the object comes from (tests/support/private_reads.py), an import or a name assigned from one."""
    crossing = []
    for read in sorted(private_reads.reads(module, source), key=lambda read: (read.line, read.text)):
        owner = read.owner_module()
        if (read.kind == "attribute" and owner is not None and _folder(owner) != _folder(module)
                and read.name not in SHARED_PRIVATE):
            crossing.append(f"{read.text} (line {read.line}: {owner}'s)")
    return crossing


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_attributes_across_folders(module):
    crossing = _crossings(module, MODULES[module].read_text())
    assert not crossing, f"{module} reads another folder's private attributes: {crossing}"


def test_the_check_sees_a_private_attribute_across_folders():
    """The rule is not vacuous: the recorder's queue read from engines/, also through a local name, or a getattr, is
    caught; a module's own privates, and the same read inside recording/, are not."""
    source = ("from otel_kvtransfer.recording import integration as kvt\n"
              "from otel_kvtransfer.recording.recorder import RECORDER\n"
              "class Wrapper:\n"
              "    def __init__(self):\n"
              "        self._calls = []\n"
              "    def call(self, rec, recorder=RECORDER):\n"
              "        self._calls.append(rec)\n"
              "        queue = RECORDER._queue\n"
              "        getattr(recorder, '_idle')\n"
              "        return kvt._DEPTH_LOCK\n")
    assert _crossings("engines.example", source) == [
        "RECORDER._queue (line 8: recording.recorder's)", "getattr(recorder, '_idle') (line 9: recording.recorder's)",
        "kvt._DEPTH_LOCK (line 10: recording.integration's)"]
    assert _crossings("recording.example", source) == []


def test_the_check_sees_an_upward_import(tmp_path):
    """The rule is not vacuous: a recording module importing the builder is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from otel_kvtransfer.building.builder import SpanBuilder\n")
    targets = [target for target, _ in _imports("recording.bad", bad)]
    assert targets == ["building.builder"]
    assert _layer("building.builder") > _layer("recording.bad")


def _graph() -> dict:
    """Module (a package by its own name) -> the package modules it imports, anywhere in its source."""
    graph = {}
    for module, path in MODULES.items():
        name = module[: -len(".__init__")] if module.endswith(".__init__") else module
        graph[name] = sorted({target for target, _ in _imports(module, path)} - {name})
    return graph


def _circles(graph: dict) -> list:
    """Every circle a depth-first walk finds, each as the path that closes it."""
    found, state = [], {}

    def walk(module, path):
        state[module] = "open"
        for target in graph.get(module, ()):
            if state.get(target) == "open":
                found.append(path[path.index(target):] + [target])
            elif target not in state:
                walk(target, path + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            walk(module, [module])
    return found


def test_the_graph_holds_deferred_imports():
    graph = _graph()
    assert "tools.reading" in graph["tools.timeline"] and "demo" in graph["cli"]


def test_nothing_imports_the_command_back():
    """The CLI sits on top of the tools and the demo it runs; only `python -m otel_kvtransfer` imports it."""
    assert [module for module, targets in _graph().items() if "cli" in targets] == ["__main__"]


def test_no_import_circle():
    assert _circles(_graph()) == []


def test_the_walk_finds_a_circle():
    assert _circles({"a": ["b"], "b": ["c"], "c": ["a"]}) == [["a", "b", "c", "a"]]
