"""The offline tools and the demo import in one direction: the command (`tools.cli`) at the top, nothing under it
importing it back, and no circle among them. Read from the source (every import, the deferred ones inside
functions too), since a deferred import closes a circle that importing the modules would never show."""

import ast
import os

import otel_kvtransfer

PACKAGE = os.path.dirname(otel_kvtransfer.__file__)
LAYERS = ("tools", "demo")
PREFIX = "otel_kvtransfer."


def _below(name: str) -> str:
    """`name` relative to the package ("" for anything outside it)."""
    return name[len(PREFIX):] if name.startswith(PREFIX) else ""


def modules(root: str) -> dict:
    """Dotted name (below the package) -> file, for every module of LAYERS under `root`."""
    found = {}
    for layer in LAYERS:
        for folder, _dirs, files in os.walk(os.path.join(root, layer)):
            for name in files:
                if name.endswith(".py"):
                    parts = os.path.relpath(os.path.join(folder, name), root)[:-3].split(os.sep)
                    found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = os.path.join(folder, name)
    return found


def imports(root: str) -> dict:
    """Module -> the modules of LAYERS it imports, anywhere in its source."""
    known = modules(root)
    graph = {}
    for module, path in known.items():
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read(), path)
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from pkg import sub` imports the module pkg.sub when there is one, else names from pkg
                names = [f"{node.module}.{a.name}" if _below(f"{node.module}.{a.name}") in known else node.module
                         for a in node.names]
            else:
                continue
            targets.update(_below(n) for n in names)
        graph[module] = sorted(t for t in targets if t in known and t != module)
    return graph


def circles(graph: dict) -> list:
    """Every circle found by a depth-first walk, each as the path that closes it."""
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


def test_the_tools_are_found():
    graph = imports(PACKAGE)
    assert {"tools.cli", "tools.reading", "tools.timeline", "tools.timeline.page", "demo"} <= set(graph)
    assert "tools.reading" in graph["tools.timeline"] and "demo" in graph["tools.cli"]


def test_nothing_imports_the_command_back():
    graph = imports(PACKAGE)
    assert [m for m, targets in graph.items() if "tools.cli" in targets] == []


def test_no_import_circle_among_the_tools_and_the_demo():
    assert circles(imports(PACKAGE)) == []
